#!/usr/bin/env python3
"""Extract the Qwen2 BPE merges and the reference's letter table into data files.

Sources, both in stable-diffusion.cpp as bundled in the crates.io package diffusion-rs-sys 0.1.20:
- `src/tokenizers/vocab/qwen_merges.hpp`: a C byte array holding Qwen2's `merges.txt`
  (151387 lines `left right`, in GPT-2's byte-to-unicode alphabet, no header line). Written
  byte for byte, gzip-compressed with a zero timestamp, to `qwen2_merges.txt.gz`.
- `src/tokenizers/tokenize_util.cpp`: `is_letter`, the code point ranges the reference's
  pre-tokenizer takes for `\\p{L}`. Written as `qwen2_letters.txt`, one range
  `<first hex> <last hex>` per line, in the source's order.

The output is a function of the input only. Usage:
  python3 gen_qwen2_vocab.py ~/.cargo/registry/src/*/diffusion-rs-sys-0.1.20/stable-diffusion.cpp
"""

import gzip
import hashlib
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    root = sys.argv[1]
    text = open(os.path.join(root, "src/tokenizers/vocab/qwen_merges.hpp"), encoding="ascii").read()
    body = text[text.index("{") + 1 : text.rindex("}")]
    raw = bytes(int(x, 16) for x in re.findall(r"0x([0-9a-fA-F]{2})", body))
    lines = raw.decode("utf-8").split("\n")
    assert lines[-1] == "", "the merges end with a newline"
    lines = lines[:-1]
    for i, line in enumerate(lines):
        assert line.count(" ") == 1, (i, line)
    assert len(lines) == 151387, len(lines)
    out = os.path.join(HERE, "qwen2_merges.txt.gz")
    with open(out, "wb") as f:
        with gzip.GzipFile(filename="", mode="wb", fileobj=f, compresslevel=9, mtime=0) as g:
            g.write(raw)
    print(f"{out}: {len(lines)} merges, {len(raw)} bytes, sha256 {hashlib.sha256(raw).hexdigest()}")
    print(f"  file sha256 {hashlib.sha256(open(out, 'rb').read()).hexdigest()}, {os.path.getsize(out)} bytes")

    src = open(os.path.join(root, "src/tokenizers/tokenize_util.cpp"), encoding="utf-8").read()
    fn = src[src.index("bool is_letter(char32_t ch)") :]
    fn = fn[fn.index("ranges[] = {") : fn.index("};")]
    ranges = re.findall(r"\{\s*0x([0-9A-Fa-f]+),\s*0x([0-9A-Fa-f]+)\s*\}", fn)
    assert len(ranges) > 600, len(ranges)
    out = os.path.join(HERE, "qwen2_letters.txt")
    with open(out, "w") as f:
        for a, b in ranges:
            assert int(a, 16) <= int(b, 16), (a, b)
            f.write(f"{int(a, 16):X} {int(b, 16):X}\n")
    print(f"{out}: {len(ranges)} ranges")


if __name__ == "__main__":
    main()
