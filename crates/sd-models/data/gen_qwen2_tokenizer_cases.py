#!/usr/bin/env python3
"""Generate qwen2_tokenizer_cases.json: Qwen2 token ids computed by the reference's own tokenizer.

The truth is stable-diffusion.cpp itself (the pinned diffusion-rs-sys 0.1.20 source), called
through our harness `sdref qwen-tokens` (xtask/reference: `sdref_qwen2_tokenize` in
driver/driver.cpp runs sd.cpp's Qwen2Tokenizer and, for Z-Image, the template and
parse_prompt_attention exactly as LLMEmbedder::tokenize does).

The prompts are not chosen for this tokenizer: they are every prompt of the T5 cases
(t5_tokenizer_cases.json: ASCII, accents, Cyrillic, CJK, Hangul, emoji, combining marks,
zero-width and no-break spaces, whitespace runs, the weighting syntax, long prompts) and of the
CLIP reference table (reference_prompt_tokens.json: issue 10's prompts and the fuzzed ones),
plus the chat-template markers and Qwen's special tokens written in prompts.

- `raw`: `Qwen2Tokenizer::encode(prompt)`: ids only.
- `zimage`: what Z-Image's conditioner feeds the LLM: ids and per-token weights.

With `--mistral` it writes mistral_tokenizer_cases.json instead: the same prompts plus
Mistral's control tokens written in prompts, through sd.cpp's MistralTokenizer (`raw`) and
FLUX.2 dev's template with BOS (`flux2`, ids and weights).

Usage (after `cargo xtask reference`):
  python3 gen_qwen2_tokenizer_cases.py target/reference/release/sdref > qwen2_tokenizer_cases.json
  python3 gen_qwen2_tokenizer_cases.py --mistral target/reference/release/sdref > mistral_tokenizer_cases.json
"""

import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

EXTRA = [
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    "<think>\n\n</think>\n\n",
    "text <|endoftext|> more <|IM_START|> <tool_call>x</tool_call> <|vision_start|><|image_pad|><|vision_end|>",
    "line one\n line two\n\n  line three\r\n\tend",
    "I'M HERE, YOU'RE THERE, WE'D GO, THEY'LL SEE, IT'S 'quoted'",
    "\u3000ideographic\u3000space and \u2003em space",
]


MISTRAL_EXTRA = [
    "[INST]hello[/INST] <s>x</s> [SYSTEM_PROMPT]sys[/SYSTEM_PROMPT] <SPECIAL_42><SPECIAL_999> <pad>",
    "[inst] lower-case markers are text, <SPECIAL_1000> too, and <unk>",
]


def prompts(mistral=False):
    out = []
    t5 = json.load(open(os.path.join(HERE, "t5_tokenizer_cases.json"), encoding="utf-8"))
    out += [c["prompt"] for c in t5["raw"]]
    clip = json.load(open(os.path.join(HERE, "reference_prompt_tokens.json"), encoding="utf-8"))
    out += [c["prompt"] for c in clip]
    out += EXTRA
    if mistral:
        out += MISTRAL_EXTRA
    seen, uniq = set(), []
    for p in out:
        if p not in seen:
            seen.add(p)
            uniq.append(p)
    return uniq


def run(sdref, path, *extra):
    out = subprocess.run([sdref, "qwen-tokens", "--prompts", path, *extra], check=True, capture_output=True)
    return json.loads(out.stdout)


def main():
    args = sys.argv[1:]
    mistral = args[:1] == ["--mistral"]
    if mistral:
        args = args[1:]
    if len(args) != 1:
        sys.exit(__doc__)
    sdref = args[0]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False, encoding="utf-8") as f:
        json.dump(prompts(mistral), f, ensure_ascii=False)
        path = f.name
    try:
        raw = run(sdref, path, *(["--mistral"] if mistral else []))
        templated = run(sdref, path, *(["--mistral", "--flux2"] if mistral else ["--zimage"]))
    finally:
        os.unlink(path)
    key = "flux2" if mistral else "zimage"
    doc = {
        "generator": "crates/sd-models/data/gen_qwen2_tokenizer_cases.py" + (" --mistral" if mistral else ""),
        "source": "stable-diffusion.cpp 5db680c (diffusion-rs-sys 0.1.20) via `sdref qwen-tokens`",
        "raw": [{"prompt": r["prompt"], "ids": r["ids"]} for r in raw],
        key: [{"prompt": r["prompt"], "ids": r["ids"], "weights": r["weights"]} for r in templated],
    }
    lines = ["{"]
    for k in ("generator", "source"):
        lines.append(f" {json.dumps(k)}: {json.dumps(doc[k], ensure_ascii=False)},")
    for k in ("raw", key):
        lines.append(f" {json.dumps(k)}: [")
        cases = [" " + json.dumps(c, ensure_ascii=False) for c in doc[k]]
        lines.append(",\n".join(cases))
        lines.append(" ]," if k == "raw" else " ]")
    lines.append("}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
