#!/usr/bin/env python3
"""Extract Mistral's BPE vocabulary and merges (FLUX.2 dev's Mistral-Small-3.2) into data files.

Sources, in stable-diffusion.cpp as bundled in the crates.io package diffusion-rs-sys 0.1.20:
- `src/tokenizers/vocab/mistral_vocab.hpp`: a C byte array holding a JSON object, token -> id,
  131072 entries (ids 0..131071, each once; in GPT-2's byte-to-unicode alphabet but for the
  1000 special tokens). Written as `mistral_vocab.txt.gz`: the tokens in id order, one per
  line (no token holds a newline; checked), gzip level 9 with a zero timestamp.
- `src/tokenizers/vocab/mistral_merges.hpp`: a C byte array holding the merges, `left right`
  per line. Written byte for byte as `mistral_merges.txt.gz`.

The output is a function of the input only. Usage:
  python3 gen_mistral_vocab.py ~/.cargo/registry/src/*/diffusion-rs-sys-0.1.20/stable-diffusion.cpp
"""

import gzip
import hashlib
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def array(root, name):
    text = open(os.path.join(root, "src/tokenizers/vocab", name), encoding="ascii").read()
    body = text[text.index("{") + 1 : text.rindex("}")]
    return bytes(int(x, 16) for x in re.findall(r"0x([0-9a-fA-F]{2})", body))


def write(name, raw):
    out = os.path.join(HERE, name)
    with open(out, "wb") as f:
        with gzip.GzipFile(filename="", mode="wb", fileobj=f, compresslevel=9, mtime=0) as g:
            g.write(raw)
    print(f"{out}: {len(raw)} bytes, sha256 {hashlib.sha256(raw).hexdigest()}")
    print(f"  file sha256 {hashlib.sha256(open(out, 'rb').read()).hexdigest()}, {os.path.getsize(out)} bytes")


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    root = sys.argv[1]
    vocab = json.loads(array(root, "mistral_vocab.hpp").decode("utf-8"))
    assert len(vocab) == 131072, len(vocab)
    by_id = sorted(vocab.items(), key=lambda kv: kv[1])
    assert [i for _, i in by_id] == list(range(len(by_id))), "ids 0..n-1, each once"
    assert not any("\n" in t for t, _ in by_id), "a token holds a newline"
    write("mistral_vocab.txt.gz", "".join(t + "\n" for t, _ in by_id).encode("utf-8"))
    merges = array(root, "mistral_merges.hpp")
    lines = merges.decode("utf-8").split("\n")
    assert lines[-1] == "", "the merges end with a newline"
    for i, line in enumerate(lines[:-1]):
        assert line.count(" ") == 1, (i, line)
    print(f"{len(lines) - 1} merges")
    write("mistral_merges.txt.gz", merges)


if __name__ == "__main__":
    main()
