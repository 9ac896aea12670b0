#!/usr/bin/env python3
"""Assembles tests/models/tiny-t: a checkpoint written by the project's own synthetic-model
writer (`k3-prefill synth` with tiny-t's dimensions: config.json with the release's
text_config/quantization_config/vision_config, the index, the shards, tokenizer_config.json and
the random vision tower), whose text tensors are replaced by the trained ones (same names, shapes,
dtypes, shards and index), and whose tiktoken.model is the trained tokenizer.

    python3 scripts/tiny_t/export.py --synth DIR --tensors RUN/text-1.safetensors RUN/text-2.safetensors \
        --tokenizer TOK/tiktoken.model --out tests/models/tiny-t
"""
import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--synth", required=True)
    ap.add_argument("--tensors", nargs="+", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from safetensors.torch import load_file

    tensors = {}
    for f in a.tensors:
        tensors.update(load_file(f))
    os.makedirs(a.out, exist_ok=True)
    for f in os.listdir(a.synth):
        shutil.copyfile(os.path.join(a.synth, f), os.path.join(a.out, f))
    shutil.copyfile(a.tokenizer, os.path.join(a.out, "tiktoken.model"))
    ckpt.replace_text(a.out, tensors)
    total = sum(os.path.getsize(os.path.join(a.out, f)) for f in os.listdir(a.out) if f.endswith(".safetensors"))
    print(f"wrote {a.out}: {len(tensors)} text tensors replaced; shards {total} bytes")


if __name__ == "__main__":
    main()
