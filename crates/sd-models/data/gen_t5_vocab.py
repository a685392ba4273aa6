#!/usr/bin/env python3
"""Extract the T5 SentencePiece vocabulary (pieces and scores) into t5_vocab.tsv.gz.

Source: stable-diffusion.cpp embeds T5's Hugging Face `tokenizer.json` (a Unigram model,
32100 pieces: the 32000 SentencePiece pieces of T5 and the 100 `<extra_id_N>` sentinels)
as a byte array in `src/tokenizers/vocab/t5.hpp`. This script reads that array, checks the
parts of the JSON our tokenizer relies on (the model type, `unk_id`, the Metaspace
pre-tokenizer settings), and writes one line per id, in id order:

    <score as written in the JSON>\t<piece>\n

gzip-compressed with a zero timestamp, so the output is a function of the input only.
Scores are copied as the JSON's decimal text: the reference parses them to double and
converts to float, and so does `src/text/t5_tokenizer.rs`.

Usage:
  python3 gen_t5_vocab.py ~/.cargo/registry/src/*/diffusion-rs-sys-0.1.20/stable-diffusion.cpp/src/tokenizers/vocab/t5.hpp
"""

import gzip
import hashlib
import io
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "t5_vocab.tsv.gz")


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    text = open(sys.argv[1], encoding="ascii").read()
    body = text[text.index("{") + 1 : text.rindex("}")]
    raw = bytes(int(x, 16) for x in re.findall(r"0x([0-9a-fA-F]{2})", body))
    # Keep the scores' decimal text: parse floats as strings.
    data = json.loads(raw.decode("utf-8"), parse_float=lambda s: s)
    model = data["model"]
    assert model["type"] == "Unigram", model["type"]
    assert model["unk_id"] == 2, model["unk_id"]
    pre = data["pre_tokenizer"]
    assert pre["type"] == "Metaspace" and pre["replacement"] == "\u2581" and pre["add_prefix_space"] is True, pre
    vocab = model["vocab"]
    lines = []
    for i, (piece, score) in enumerate(vocab):
        assert isinstance(score, str), (i, piece, score)
        assert piece and not any(c in piece for c in "\t\n\r\0"), (i, piece)
        float(score)
        lines.append(f"{score}\t{piece}\n")
    assert len(set(p for p, _ in vocab)) == len(vocab), "duplicate pieces"
    tsv = "".join(lines).encode("utf-8")
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
        gz.write(tsv)
    with open(OUT, "wb") as f:
        f.write(buf.getvalue())
    print(f"tokenizer.json: {len(raw)} bytes, sha256 {hashlib.sha256(raw).hexdigest()}")
    print(f"pieces: {len(vocab)}")
    print(f"t5_vocab.tsv: {len(tsv)} bytes, sha256 {hashlib.sha256(tsv).hexdigest()}")
    print(f"t5_vocab.tsv.gz: {len(buf.getvalue())} bytes, sha256 {hashlib.sha256(buf.getvalue()).hexdigest()}")


if __name__ == "__main__":
    main()
