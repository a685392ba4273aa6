#!/usr/bin/env python3
"""Generate crates/sd-models/data/tokenizer_cases.json, the expected output of the CLIP tokenizer tests.

Where the truth comes from
--------------------------
* BPE merges, vocabulary and byte-to-unicode table: the upstream pure-Python CLIP tokenizer
  (`SimpleTokenizer` in `open_clip/tokenizer.py`, copied from OpenAI CLIP), loaded straight from
  the `open_clip_torch` wheel without importing torch. Its `bpe()` and `encoder` are used as they are.
* Text cleanup and pre-tokenizer: stable-diffusion.cpp (the reference we must match) does NOT use
  ftfy, html.unescape or Unicode character classes. Its facts (clip_tokenizer.cpp):
  - `\\s+` (std::regex, C locale: space \\t \\n \\v \\f \\r) collapsed to one space, then stripped;
  - lowercasing with `tolower` on bytes: ASCII only;
  - the text is split on the literal special tokens `<|startoftext|>` / `<|endoftext|>`;
  - split pattern `'s|'t|'re|'ve|'m|'ll|'d|[[:alpha:]]+|[[:digit:]]|[^[:space:][:alpha:][:digit:]]+`
    run by std::regex over bytes, so the classes are ASCII-only and every non-ASCII byte falls in
    the last alternative.
  For ASCII prompts without HTML entities this equals upstream CLIP; the script asserts so for
  every case marked `same_as_upstream`.
* Prompt weighting: a port of A1111's `parse_prompt_attention` (modules/prompt_parser.py) with
  the deviations that stable-diffusion.cpp's version has (each marked `SD.CPP:` below).
* Chunking: stable-diffusion.cpp's conditioner (`tokenize` + `Tokenizer::pad_tokens` with
  min_length = max_length = 77 and overflow expansion).

Optionally `--oracle BIN` compares every case with a program built from stable-diffusion.cpp's own
tokenizer sources (see data/README.md); it reads NUL-separated prompts on stdin and prints one
JSON object per prompt with keys ids, parsed, sd1{ids,weights}, sd2{ids,weights}.

Usage:
  pip download --no-deps open_clip_torch==3.3.0 && pip install ftfy regex
  python3 gen_tokenizer_cases.py --wheel open_clip_torch-3.3.0-py3-none-any.whl > tokenizer_cases.json
"""

import argparse
import fractions
import gzip
import hashlib
import json
import math
import os
import re
import struct
import subprocess
import sys
import types
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB_GZ = os.path.join(HERE, "bpe_simple_vocab_16e6.txt.gz")

BOS, EOS = 49406, 49407
CHUNK_LEN = 77


# ---------------------------------------------------------------------------- upstream tokenizer

def load_upstream(wheel):
    """Import open_clip/tokenizer.py from the wheel with torch and numpy stubbed out."""
    with zipfile.ZipFile(wheel) as z:
        src = z.read("open_clip/tokenizer.py").decode("utf-8")
        gz = z.read("open_clip/bpe_simple_vocab_16e6.txt.gz")
    with open(VOCAB_GZ, "rb") as f:
        ours = f.read()
    if hashlib.sha256(gz).digest() != hashlib.sha256(ours).digest():
        sys.exit("the wheel's bpe_simple_vocab_16e6.txt.gz differs from data/bpe_simple_vocab_16e6.txt.gz")
    for name in ("torch", "numpy"):
        stub = types.ModuleType(name)
        stub.__getattr__ = lambda attr: object  # only used in annotations of functions we never call
        sys.modules.setdefault(name, stub)
    mod = types.ModuleType("open_clip_tokenizer")
    # its default vocabulary path is next to __file__: point it at our copy (checked identical above)
    mod.__file__ = os.path.join(HERE, "tokenizer.py")
    exec(compile(src, "open_clip/tokenizer.py", "exec"), mod.__dict__)
    return mod.SimpleTokenizer(bpe_path=VOCAB_GZ)


# ---------------------------------------------------------------------------- sd.cpp text handling

ASCII_WS = " \t\n\v\f\r"
SPECIAL = {"<|startoftext|>": BOS, "<|endoftext|>": EOS}
PRETOK = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d|[a-zA-Z]+|[0-9]|[^ \t\n\v\f\ra-zA-Z0-9]+")


def sdcpp_normalize(text):
    text = re.sub("[" + re.escape(ASCII_WS) + "]+", " ", text).strip(ASCII_WS)
    return "".join(chr(ord(c) + 32) if "A" <= c <= "Z" else c for c in text)


def split_special(text):
    out, pos = [], 0
    while pos < len(text):
        hits = [(text.find(t, pos), t) for t in SPECIAL if text.find(t, pos) >= 0]
        if not hits:
            out.append(text[pos:])
            break
        at, tok = min(hits)
        if at > pos:
            out.append(text[pos:at])
        out.append(tok)
        pos = at + len(tok)
    return out


def sdcpp_encode(tok, text):
    ids = []
    # The pinned sd.cpp (5db680c) cuts special tokens out of the raw text, case-sensitively,
    # and cleans up each remaining part (later versions lowercase first).
    for part in split_special(text):
        if part in SPECIAL:
            ids.append(SPECIAL[part])
            continue
        for piece in PRETOK.findall(sdcpp_normalize(part)):
            word = "".join(tok.byte_encoder[b] for b in piece.encode("utf-8"))
            ids.extend(tok.encoder[t] for t in tok.bpe(word).split(" "))
    return ids


# ---------------------------------------------------------------------------- f32 arithmetic

def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def f32_from_decimal(s):
    """Correctly rounded decimal -> f32 (as strtof does), avoiding decimal -> f64 -> f32 double rounding."""
    exact = fractions.Fraction(s)
    cand = f32(float(exact))
    if math.isinf(cand):
        return cand
    bits = struct.unpack("<I", struct.pack("<f", cand))[0]
    near = [cand]
    for nb in (bits - 1, bits + 1):
        if 0 <= nb < 0x7F800000:
            near.append(struct.unpack("<f", struct.pack("<I", nb))[0])
    best = min(near, key=lambda v: (abs(fractions.Fraction(v) - exact),
                                    struct.unpack("<I", struct.pack("<f", v))[0] & 1))
    return best


ROUND_MUL = f32(1.1)
SQUARE_MUL = f32(1.0 / ROUND_MUL)


def stof_prefix(w):
    """The part of `[+-]?[.0-9]+` that strtof consumes, or None where it converts nothing."""
    m = re.match(r"[+-]?(\d+\.?\d*|\.\d+)", w)
    return m.group(0) if m else None


# ---------------------------------------------------------------------------- prompt weighting

def parse_prompt_attention(text):
    """A1111's parse_prompt_attention with stable-diffusion.cpp's deviations."""
    res, round_b, square_b = [], [], []

    def multiply_range(start, mul):
        for p in range(start, len(res)):
            res[p][1] = f32(res[p][1] * mul)

    rest = text
    while rest:
        m = re.match(r"\\[()\[\]\\]|\\|\(|\[", rest)
        # SD.CPP: the weight needs `)` right after the number; A1111 allows spaces around it.
        wm = re.match(r":([+-]?[.0-9]+)\)", rest)
        if m:
            tok, weight = m.group(0), None
        elif wm:
            tok, weight = wm.group(0), wm.group(1)
        elif rest[0] in ")]":
            tok, weight = rest[0], None
        # SD.CPP: `\bBREAK\b` is matched against the remaining text alone, so the left boundary
        # always holds ("aBREAK b" breaks); the right boundary uses ASCII word characters.
        elif rest.startswith("BREAK") and (len(rest) == 5 or not re.match(r"[A-Za-z0-9_]", rest[5])):
            tok, weight = "BREAK", None
        else:
            # SD.CPP: text runs also stop at `B` (matched alone), which changes nothing in the result.
            tm = re.match(r"[^\\()\[\]:B]+|:|B", rest)
            tok, weight = tm.group(0), None
        rest = rest[len(tok):]

        if tok == "(":
            round_b.append(len(res))
        elif tok == "[":
            square_b.append(len(res))
        elif weight is not None:
            # SD.CPP: a weight with no open `(` is dropped (A1111 keeps it as text).
            if round_b:
                prefix = stof_prefix(weight)
                if prefix is None:
                    raise ValueError("stof fails on %r (sd.cpp aborts)" % weight)
                multiply_range(round_b.pop(), f32_from_decimal(prefix))
        elif tok == ")" and round_b:
            multiply_range(round_b.pop(), ROUND_MUL)
        elif tok == "]" and square_b:
            multiply_range(square_b.pop(), SQUARE_MUL)
        elif tok == "\\(":
            # SD.CPP: only `\(` loses its backslash; `\)`, `\[`, `\]`, `\\` stay as written.
            res.append(["(", 1.0])
        elif tok == "BREAK":
            res.append(["BREAK", -1.0])
        else:
            res.append([tok, 1.0])

    for pos in round_b:
        multiply_range(pos, ROUND_MUL)
    for pos in square_b:
        multiply_range(pos, SQUARE_MUL)
    if not res:
        res = [["", 1.0]]
    i = 0
    while i + 1 < len(res):
        if res[i][1] == res[i + 1][1]:
            res[i][0] += res[i + 1][0]
            del res[i + 1]
        else:
            i += 1
    return res


def tokenize_weighted(tok, text, pad_id):
    tokens, weights = [], []
    for frag, w in parse_prompt_attention(text):
        if frag == "BREAK" and w == -1.0:
            pad = (75 - len(tokens) % 75) % 75
            tokens += [EOS] * pad
            weights += [1.0] * pad
            continue
        ids = sdcpp_encode(tok, frag)
        tokens += ids
        weights += [w] * len(ids)
    body = CHUNK_LEN - 2
    chunks = [(tokens[i:i + body], weights[i:i + body]) for i in range(0, len(tokens), body)] or [([], [])]
    if len(tokens) + 2 <= CHUNK_LEN:
        chunks = [(tokens, weights)]
    out_ids, out_w = [], []
    for ids, ws in chunks:
        c_ids = [BOS] + ids + [EOS]
        c_w = [1.0] + ws + [1.0]
        c_ids += [pad_id] * (CHUNK_LEN - len(c_ids))
        c_w += [1.0] * (CHUNK_LEN - len(c_w))
        out_ids += c_ids
        out_w += c_w
    return out_ids, out_w


# ---------------------------------------------------------------------------- cases

LONG = ("masterpiece, best quality, highly detailed photograph of an old lighthouse on a rocky "
        "coast at sunset, dramatic clouds, golden hour lighting, waves crashing against the rocks, "
        "seagulls flying overhead, 35mm film, kodak portra 400, shallow depth of field, bokeh, "
        "sharp focus, intricate details, trending on artstation, award winning, 8k uhd, hdr")

# (name, prompt, same_as_upstream, rule)
PLAIN = [
    ("simple", "a photo of a cat", True, "plain lowercase words"),
    ("ascii_upper", "A Photo Of A CAT", True, "ASCII lowercasing"),
    ("whitespace", "  leading and trailing   spaces\t\nand\ttabs  ", True, "whitespace collapse and strip"),
    ("ascii_ws_kinds", "tab\x0bvt\x0cff\rcr\n\nlf", False, "all six C-locale spaces collapse (upstream ftfy drops \\v)"),
    ("contractions", "don't stop, it's the cat's toy; they're we've i'm you'll he'd", True, "'s 't 're 've 'm 'll 'd split off"),
    ("contractions_upper", "DON'T IT'S THEY'RE", True, "contractions after lowercasing"),
    ("quotes", "'''s 's 'x ''", True, "a run of quotes is one punctuation piece"),
    ("punctuation", "hello!!! what?? ...ok... #hashtag @user $100 50% a&b", True, "punctuation runs"),
    ("digits", "1234567890 3.14 -42 1e10 2024-01-01", True, "each digit is its own piece"),
    ("parens_plain", "masterpiece, best quality, (photorealistic:1.4), [blurry]", True, "plain tokenize keeps brackets as text"),
    ("symbols", "a_b-c.d/e\\f|g~h`i^j{k}l<m>n=o+p*q", True, "ASCII symbols"),
    ("long_words", "supercalifragilisticexpialidocious antidisestablishmentarianism", True, "long BPE words"),
    ("special_tokens", "<|startoftext|>hello world<|endoftext|>", False,
     "literal special tokens map to 49406/49407 (open_clip spells them <start_of_text>)"),
    ("special_tokens_upper", "<|STARTOFTEXT|> upper <|EndOfText|>", False,
     "special tokens are cut out before lowercasing: in capitals they are text (the pinned sd.cpp, 5db680c)"),
    ("latin_accents", "café naïve résumé", False, "sd.cpp: non-ASCII bytes are not letters, split from ASCII letters"),
    ("latin_upper", "CAFÉ ÜBER Straße", False, "sd.cpp: only ASCII is lowercased"),
    ("cjk", "東京タワー 日本語の夜景", False, "sd.cpp: a CJK run is one punctuation-class piece"),
    ("emoji", "emoji 🐱🚀 cat 👍🏽", False, "4-byte UTF-8 through the byte encoder"),
    ("unicode_numbers", "x² ½ ① ٣", False, "non-ASCII digits are not digits in sd.cpp"),
    ("unicode_spaces", "nbsp\u00a0here\u2003em\u3000ideographic", False, "sd.cpp: non-ASCII spaces are not whitespace"),
    ("html_entities", "fish &amp; chips &lt;b&gt;", False, "sd.cpp does no HTML unescaping (upstream does)"),
    ("empty", "", True, "empty prompt gives no tokens"),
    ("only_spaces", " \t \n ", True, "whitespace-only prompt gives no tokens"),
    ("long", LONG, True, "a prompt longer than 75 tokens"),
]

WEIGHTED = [
    ("a1111_doc", "a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).",
     "A1111 docstring example: nested (), (x:w), [] multiply"),
    ("paren", "an (important) word", "A1111: (x) multiplies by 1.1"),
    ("square", "an [unimportant] word", "A1111: [x] divides by 1.1"),
    ("unbalanced_round", "(unbalanced", "A1111: an unclosed ( applies 1.1 to the rest"),
    ("unbalanced_square", "[unbalanced square", "A1111: an unclosed [ applies 1/1.1 to the rest"),
    ("unbalanced_close", "unmatched) closing] brackets", "A1111: ) or ] with nothing open is literal text"),
    ("unnecessary", "(unnecessary)(parens)", "A1111: equal neighbouring weights merge"),
    ("nested_weight", "((a:0.5):2) b", "A1111: nested explicit weights multiply"),
    ("square_colon", "[b:1.5] c", "A1111: `:w` only closes round brackets; inside [] it is text"),
    ("escapes", "\\(literal\\]", "sd.cpp: only \\( loses its backslash"),
    ("escapes_all", "a \\) b \\[ c \\\\ d \\ e", "sd.cpp: \\) \\[ \\\\ and a lone \\ stay as written"),
    ("weight_space", "(word: 1.3)", "sd.cpp: no spaces allowed around the weight; falls back to (x) = 1.1"),
    ("stray_weight", ":1.3) stray weight", "sd.cpp: a weight with no open ( is dropped"),
    ("weight_prefix", "(a:1.2.3) (b:+.5) (c:-1) (d:1..)", "sd.cpp: stof reads the longest number prefix"),
    ("break", "a cat BREAK a dog", "A1111: BREAK pads the chunk to 75 tokens"),
    ("break_start", "BREAK at start", "BREAK with no tokens before pads nothing"),
    ("break_in_word", "BREAKfast BREAKs aBREAK b", "sd.cpp: the left word boundary always holds"),
    ("break_weighted", "(BREAK) x", "a weighted BREAK is plain text"),
    ("break_twice", "a BREAK BREAK b", "two BREAKs with a space between"),
    ("break_merged", "x BREAK[]BREAK y", "two adjacent BREAKs merge into text"),
    ("capital_b", "Big BOLD Bb aBc B", "B is matched alone and merged back"),
    ("empty_weighted", "", "empty prompt: one chunk BOS EOS pad"),
    ("long_weighted", "(" + LONG + ":1.2)", "more than 75 tokens: two chunks of BOS 75 EOS"),
    ("long_break", "a portrait BREAK " + LONG, "BREAK then a long prompt: three chunks"),
    ("unicode_weighted", "(café:1.3) [東京]", "weights with non-ASCII text"),
]


def exact_len_prompt(tok, n):
    """A prompt of exactly n tokens: 'a' repeated is one token each."""
    p = " ".join(["a"] * n)
    assert len(sdcpp_encode(tok, p)) == n
    return p


def run_oracle(oracle, prompts):
    data = "\0".join(prompts).encode("utf-8")
    out = subprocess.run([oracle], input=data, stdout=subprocess.PIPE, check=True).stdout.decode("utf-8")
    return [json.loads(line) for line in out.splitlines()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--wheel", required=True, help="open_clip_torch wheel (.whl)")
    ap.add_argument("--oracle", help="binary built from stable-diffusion.cpp's tokenizer sources")
    args = ap.parse_args()
    tok = load_upstream(args.wheel)

    weighted = list(WEIGHTED) + [
        ("exactly_75", exact_len_prompt(tok, 75), "75 tokens fit one chunk"),
        ("exactly_76", exact_len_prompt(tok, 76), "76 tokens need two chunks"),
        ("exactly_150_break", exact_len_prompt(tok, 75) + " BREAK " + exact_len_prompt(tok, 75),
         "BREAK at a chunk boundary pads nothing"),
    ]

    plain_out = []
    for name, prompt, same, rule in PLAIN:
        ids = sdcpp_encode(tok, prompt)
        up = tok.encode(prompt)
        if same and ids != up:
            sys.exit("case %s: sd.cpp rules and upstream CLIP disagree: %s vs %s" % (name, ids, up))
        plain_out.append({"name": name, "rule": rule, "prompt": prompt, "ids": ids,
                          "upstream_ids": up, "same_as_upstream": ids == up})

    weighted_out = []
    for name, prompt, rule in weighted:
        parsed = parse_prompt_attention(prompt)
        case = {"name": name, "rule": rule, "prompt": prompt,
                "parsed": [[t, w] for t, w in parsed]}
        for model, pad in (("sd1", EOS), ("sd2", 0)):
            ids, ws = tokenize_weighted(tok, prompt, pad)
            case[model] = {"ids": ids, "weights": ws}
        weighted_out.append(case)

    if args.oracle:
        cases = plain_out + weighted_out
        got = run_oracle(args.oracle, [c["prompt"] for c in cases])
        bad = 0
        for c, o in zip(cases, got):
            if "ids" in c and o["ids"] != c["ids"]:
                print("oracle disagrees on ids of %s: %s vs %s" % (c["name"], o["ids"], c["ids"]), file=sys.stderr)
                bad += 1
            if "parsed" in c:
                if [[t, f32(w)] for t, w in o["parsed"]] != c["parsed"]:
                    print("oracle disagrees on parse of %s: %s" % (c["name"], o["parsed"]), file=sys.stderr)
                    bad += 1
                for m in ("sd1", "sd2"):
                    if o[m]["ids"] != c[m]["ids"] or [f32(w) for w in o[m]["weights"]] != c[m]["weights"]:
                        print("oracle disagrees on %s chunks of %s" % (m, c["name"]), file=sys.stderr)
                        bad += 1
        if bad:
            sys.exit("%d disagreements with the oracle" % bad)
        print("oracle agrees on all %d cases" % len(cases), file=sys.stderr)

    json.dump({
        "generator": "crates/sd-models/data/gen_tokenizer_cases.py",
        "upstream": os.path.basename(args.wheel),
        "tokenize": plain_out,
        "weighted": weighted_out,
    }, sys.stdout, ensure_ascii=False, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
