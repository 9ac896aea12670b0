#!/usr/bin/env python3
"""Peer comparison on the GPU box, side by side in one run, on K3 shapes (96 heads):
  - KDA prefill: our chunked fp32 kernel (k3-prefill bench --kernels) vs fla's chunk_kda
    (fla-core, Triton; fp32 inputs, and bf16 q/k/v as serving engines run it);
  - MLA prefill attention (causal, qk 192, v 128, bf16): our flash kernel vs PyTorch's best
    scaled_dot_product_attention backend.
Usage (repository root, .devbin carried with k3-prefill and the fla-core wheel):
  python3 scripts/peer_bench.py --bin .devbin/k3-prefill --tokens 8192,32768,131072
"""
import argparse, json, subprocess, sys, time

import warnings

import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore")


def bench(fn, reps=3):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    ts.sort()
    return ts[len(ts) // 2]


def fla_kda(T, dtype, H=96, D=128):
    from fla.ops.kda import chunk_kda
    g0 = torch.Generator(device="cuda").manual_seed(0)
    q = F.normalize(torch.randn(1, T, H, D, device="cuda", generator=g0), dim=-1).to(dtype)
    k = F.normalize(torch.randn(1, T, H, D, device="cuda", generator=g0), dim=-1).to(dtype)
    v = torch.randn(1, T, H, D, device="cuda", generator=g0).to(dtype)
    g = -5 * torch.rand(1, T, H, D, device="cuda", generator=g0)
    beta = torch.rand(1, T, H, device="cuda", generator=g0).to(dtype)
    s0 = torch.zeros(1, H, D, D, device="cuda")
    return bench(lambda: chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True))


def sdpa(T, H=96, DQK=192, DV=128):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q = torch.randn(1, H, T, DQK, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, H, T, DQK, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, H, T, DV, device="cuda", dtype=torch.bfloat16)
    best = None
    for name, be in [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)]:
        try:
            with sdpa_kernel(be):
                ms = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        except Exception as ex:  # backend does not take these shapes
            print(f"  sdpa {name}: unavailable ({str(ex).splitlines()[0][:80]})", file=sys.stderr)
            continue
        print(f"  sdpa {name}: {ms:.2f} ms", file=sys.stderr)
        if best is None or ms < best[1]:
            best = (name, ms)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=".devbin/k3-prefill")
    ap.add_argument("--tokens", default="8192,32768,131072")
    ap.add_argument("--ours-json", help="our kernel rows (the JSON lines of `k3-prefill bench --kernels`) from an earlier run, instead of running it")
    a = ap.parse_args()
    ours = {}
    if a.ours_json:
        stdout = open(a.ours_json).read()
    else:
        out = subprocess.run([a.bin, "bench", "--kernels", "--tokens", a.tokens], capture_output=True, text=True)
        if out.returncode != 0:
            print(out.stderr, file=sys.stderr)
            sys.exit("k3-prefill bench --kernels failed")
        stdout = out.stdout
        print(stdout, file=sys.stderr, flush=True)  # our kernel table, for the log
    for line in stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            ours[r["tokens"]] = r
    print(f"{'tokens':>7} | {'our KDA fp32':>12} {'fla fp32':>9} {'fla bf16':>9} {'fla32/ours':>10} | {'our MLA':>8} {'SDPA best':>16} {'sdpa/ours':>9}", flush=True)
    for T in [int(x) for x in a.tokens.split(",")]:
        torch.cuda.empty_cache()
        f32 = fla_kda(T, torch.float32)
        b16 = fla_kda(T, torch.bfloat16)
        torch.cuda.empty_cache()
        sd = sdpa(T)
        o = ours[T]
        ok, om = o["kda_ms"], o["mla_ms"]
        sds = f"{sd[1]:.1f} ({sd[0]})" if sd else "n/a"
        ratio = f"{sd[1] / om:.2f}" if sd else "n/a"
        print(f"{T:>7} | {ok:>12.1f} {f32:>9.1f} {b16:>9.1f} {f32 / ok:>10.2f} | {om:>8.1f} {sds:>16} {ratio:>9}", flush=True)


if __name__ == "__main__":
    main()
