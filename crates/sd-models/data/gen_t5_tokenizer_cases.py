#!/usr/bin/env python3
"""Generate t5_tokenizer_cases.json: T5 token ids computed by the reference's own tokenizer.

The truth is stable-diffusion.cpp itself (the pinned diffusion-rs-sys 0.1.20 source), called
through our harness `sdref t5-tokens` (xtask/reference: `sdref_t5_tokenize` in
driver/driver.cpp runs sd.cpp's T5UniGramTokenizer and, for the FLUX layout, its
parse_prompt_attention and Tokenizer::pad_tokens exactly as FluxCLIPEmbedder::tokenize does).

- `raw`: `T5UniGramTokenizer::encode(prompt)`: ids only, no EOS, no weighting syntax.
- `flux`: what FLUX's conditioner feeds T5: chunks of 256 ids (tokens, EOS, pad 0) and the
  per-token weights.

Usage (after `cargo xtask reference`):
  python3 gen_t5_tokenizer_cases.py target/reference/release/sdref > t5_tokenizer_cases.json
"""

import json
import os
import subprocess
import sys
import tempfile

LONG1 = ", ".join(["a highly detailed photograph of a red fox in the snow"] * 30)
LONG2 = " ".join(f"word{i}" for i in range(300))

PROMPTS = [
    "a photo of a cat",
    "A Photo Of A CAT",
    "",
    " ",
    "   ",
    "  leading and trailing   spaces  ",
    "tabs\tand\nnewlines\r\nhere",
    "double  space and    four",
    "don't stop, it's the cat's toy; they're we've",
    "numbers 1234567890 3.14159 1e-6 #42 $5.00 50%",
    "punctuation!!! ??? ... --- ___ *** ~~~ ^^^ ||| \\\\ // @@",
    "https://example.com/path?query=1&x=y",
    "café naïve résumé Ångström façade",
    "Привет мир, это тест",
    "日本語のテキスト、猫の写真",
    "中文提示词：一只可爱的猫",
    "한국어 프롬프트",
    "emoji 🐱🦊🔥 and ✨ sparkles ❤️",
    "ﬁ ligature and ＦＵＬＬＷＩＤＴＨ letters and ² ½",
    "combining e\u0301 and a\u0308",
    "zero\u200bwidth and nbsp\u00a0here",
    "\u2581 metaspace itself \u2581\u2581",
    "special <pad> </s> <unk> tokens",
    "<pad>",
    "</s></s>",
    "x<unk>y",
    "<PAD> <extra_id_0> <extra_id_99> <s>",
    "a (red:1.3) fox in [the snow]",
    "((masterpiece)), best quality, (blue eyes:0.8), [[blurry]]",
    "escaped \\(not weighted\\) and \\[x\\]",
    "a cat BREAK a dog",
    "BREAK",
    "(BREAK)",
    "a (nested (weights:1.5) here:1.2) ok",
    "(unclosed paren and [bracket",
    "closing) without] opening",
    "weight (at end:1.1)",
    "(word:1.2)",
    "(:1.2)",
    LONG1,
    LONG2,
    "tokens " * 254,
    "tokens " * 255,
    "a" * 300,
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "MixedCASE camelCase snake_case kebab-case",
    "quote \u2019 curly \u201cdouble\u201d and \u00abguillemets\u00bb",
    "The quick brown fox jumps over the lazy dog.",
    "a beautiful landscape painting, oil on canvas, by Claude Monet, trending on artstation, 8k, highly detailed",
]


def run(sdref, path, *extra):
    out = subprocess.run([sdref, "t5-tokens", "--prompts", path, *extra], check=True, capture_output=True)
    return json.loads(out.stdout)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sdref = sys.argv[1]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False, encoding="utf-8") as f:
        json.dump(PROMPTS, f, ensure_ascii=False)
        path = f.name
    try:
        raw = run(sdref, path, "--raw")
        flux = run(sdref, path)
    finally:
        os.unlink(path)
    doc = {
        "generator": "crates/sd-models/data/gen_t5_tokenizer_cases.py",
        "source": "stable-diffusion.cpp 5db680c (diffusion-rs-sys 0.1.20) via `sdref t5-tokens`",
        "flux_chunk_len": 256,
        "raw": [{"prompt": r["prompt"], "ids": r["ids"]} for r in raw],
        "flux": [{"prompt": r["prompt"], "ids": r["ids"], "weights": r["weights"]} for r in flux],
    }
    # One case per line keeps diffs readable.
    lines = ["{"]
    for k in ("generator", "source", "flux_chunk_len"):
        lines.append(f" {json.dumps(k)}: {json.dumps(doc[k], ensure_ascii=False)},")
    for k in ("raw", "flux"):
        lines.append(f" {json.dumps(k)}: [")
        cases = [" " + json.dumps(c, ensure_ascii=False) for c in doc[k]]
        lines.append(",\n".join(cases))
        lines.append(" ]," if k == "raw" else " ]")
    lines.append("}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
