#!/usr/bin/env python3
"""Checks model.py against golden tiny-a (Moonshot's reference, float32): logits per row and the
MLA latents. Run before training: proves the torch model is the engines' model.

    python3 scripts/tiny_t/check_golden.py [--golden tests/golden/tiny-a] [--kda recurrent|chunk|fla]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt  # noqa: E402


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser()
    ap.add_argument("--golden", default=os.path.join(here, "../../tests/golden/tiny-a"))
    ap.add_argument("--kda", default="recurrent")
    ap.add_argument("--sparse", action="store_true", help="per-expert loop instead of the dense MoE form")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    m = ckpt.load_text(ckpt.build(a.golden), a.golden).eval()
    m.kda_impl = a.kda
    m.set_dense_experts(not a.sparse)
    from safetensors.torch import load_file

    g = load_file(os.path.join(a.golden, "golden.safetensors"))
    ids = g["input_ids"].view(1, -1)
    logits = m(ids)[0]
    ref = g["logits"]
    rel = (logits - ref).norm(dim=-1) / ref.norm(dim=-1)
    agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"logits per-row rel err: max {rel.max():.3e} median {rel.median():.3e}; argmax agreement {agree:.4f}")
    ok = rel.max().item() <= 1e-3
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
