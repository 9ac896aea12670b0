#!/usr/bin/env python3
"""Evaluates a tiny-t checkpoint with the project's own engine and with model.py, in float32.

- Tokenizes the held-out text with the checkpoint's tokenizer (tokenizer.py: the same ranks and
  pattern as the engines' tiktoken-rs tokenizer).
- Held-out perplexity over non-overlapping windows of --seq tokens, each window from a fresh
  state (its first token is context only): from `k3-prefill forward --backend cpu` logits
  (the engine) and from model.py on the checkpoint's weights (torch, float32).
- The unigram perplexity of the same held-out tokens, estimated on those tokens themselves.
- Engine vs torch logits on the first --compare windows: per-row relative L2 error and argmax
  agreement.

    python3 scripts/tiny_t/evaluate.py --model tests/models/tiny-t --text /tmp/tiny-t-corpus/heldout.txt \
        --engine target/release/k3-prefill [--windows N] [--json out.json]
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt  # noqa: E402
import tokenizer as tk  # noqa: E402


def engine_logits(engine, model, ids, tmp):
    ip = os.path.join(tmp, "ids.json")
    op = os.path.join(tmp, "out.safetensors")
    json.dump([int(i) for i in ids], open(ip, "w"))
    subprocess.run([engine, "forward", "--backend", "cpu", "--model", model, "--input-ids", ip, "--out", op],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    from safetensors.torch import load_file

    return load_file(op)["logits"]


def nll(logits, ids):
    return F.cross_entropy(logits[:-1].float(), torch.as_tensor(ids[1:], dtype=torch.long), reduction="sum").item()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", required=True, help="held-out text (corpus.py heldout.txt)")
    ap.add_argument("--engine", help="k3-prefill binary (omit: torch only)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--windows", type=int, default=0, help="evaluate only the first N windows (0: all)")
    ap.add_argument("--compare", type=int, default=2, help="windows whose logits are compared engine vs torch")
    ap.add_argument("--torch-windows", type=int, default=0,
                    help="with --engine: run model.py only on the first N windows (0: all; it is slow on a CPU)")
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    enc = tk.load(a.model)
    ids = np.array(enc.encode_ordinary(open(a.text, encoding="utf-8").read()), dtype=np.int64)
    c = np.bincount(ids)
    p = c[c > 0] / len(ids)
    uni = float(math.exp(-(p * np.log(p)).sum()))
    n = len(ids) // a.seq
    if a.windows:
        n = min(n, a.windows)
    m = ckpt.load_text(ckpt.build(a.model), a.model).eval()
    m.kda_impl = "chunk"
    m.set_dense_experts(False)
    res = {"heldout_tokens": int(len(ids)), "unigram_ppl": uni, "windows": n, "seq": a.seq}
    tot_t = tot_e = 0.0
    cnt = cnt_t = 0
    errs, agree = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for w in range(n):
            win = ids[w * a.seq:(w + 1) * a.seq]
            use_torch = not a.engine or not a.torch_windows or w < max(a.torch_windows, a.compare)
            if use_torch:
                lt = m(torch.as_tensor(win).view(1, -1))[0]
                tot_t += nll(lt, win)
                cnt_t += len(win) - 1
            if a.engine:
                le = engine_logits(a.engine, a.model, win, tmp)
                tot_e += nll(le, win)
                if w < a.compare:
                    errs.append(((le - lt).norm(dim=-1) / lt.norm(dim=-1)).max().item())
                    agree.append((le.argmax(-1) == lt.argmax(-1)).float().mean().item())
            cnt += len(win) - 1
            if (w + 1) % 10 == 0 or w + 1 == n:
                msg = f"{w + 1}/{n} windows: torch ppl {math.exp(tot_t / max(1, cnt_t)):.3f} ({cnt_t} tokens)"
                if a.engine:
                    msg += f", engine ppl {math.exp(tot_e / cnt):.3f}"
                print(msg, flush=True)
    res["torch_f32_ppl"] = math.exp(tot_t / cnt_t)
    res["torch_scored_tokens"] = cnt_t
    res["engine_scored_tokens"] = cnt if a.engine else 0
    if a.engine:
        res["engine_cpu_f32_ppl"] = math.exp(tot_e / cnt)
        res["logits_max_row_rel_err"] = max(errs) if errs else None
        res["argmax_agreement"] = min(agree) if agree else None
    res["ratio_to_unigram"] = res.get("engine_cpu_f32_ppl", res["torch_f32_ppl"]) / uni
    print(json.dumps(res, indent=1))
    if a.json:
        json.dump(res, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
