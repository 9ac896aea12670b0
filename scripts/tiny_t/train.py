#!/usr/bin/env python3
"""Trains tiny-t (model.py) on the tokenized corpus (prepare.py) and writes the checkpoint's text
tensors (release names and dtypes, routed experts MXFP4) plus a loss log.

Recipe: AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), peak LR --lr with 30 linear warm-up
steps then cosine decay to 10 %, batches of --batch random windows of --seq tokens (seeded), BF16
autocast with float32 master weights, gradient clipping 1.0, dropout --dropout on the attention
and FFN outputs (training only). Routing: the sigmoid router's e_score_correction_bias is not
trained by gradients; after every step each MoE layer moves it by --bias-rate towards balance
(DeepSeek-V3's auxiliary-loss-free rule: +rate for experts below the mean load, -rate above).
The last --qat-frac of the steps train with the routed experts fake-quantised to MXFP4
(straight-through gradients). Every --eval-every steps the validation loss is measured with MXFP4
experts; the best state is kept and exported.

--steps 0 picks the number of steps from --time-budget after timing steps 10..30 (the chosen
number is printed and logged; pass it as --steps to repeat a run).

At the end (on the exported weights, i.e. BF16-rounded trunk and MXFP4 experts, computed in float32):
held-out perplexity, the same with the unquantised experts of the kept state, and the unigram
perplexity of the held-out tokens (estimated on those tokens). Everything goes to OUT/summary.json.
"""
import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt  # noqa: E402
from model import init_weights  # noqa: E402


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pick_kda(model, device):
    """fla's Triton chunk_kda when it runs and agrees with the PyTorch chunked form, else that."""
    if device.type != "cuda":
        return "chunk"
    try:
        import fla.ops.kda  # noqa: F401
    except Exception as e:  # noqa: BLE001
        log(f"fla not importable ({e}); KDA in PyTorch")
        return "chunk"
    torch.manual_seed(0)
    layer = next(l for l in model.model.layers if not l.is_mla).self_attn
    x = torch.randn(2, 200, model.c.H, device=device)
    outs = {}
    try:
        for impl in ("chunk", "fla"):
            xx = x.clone().requires_grad_(True)
            with torch.autocast("cuda", torch.bfloat16):
                y = layer(xx, impl)
            y.float().square().mean().backward()
            outs[impl] = (y.detach().float(), xx.grad.detach())
            layer.zero_grad(set_to_none=True)
    except Exception as e:  # noqa: BLE001
        log(f"fla chunk_kda failed ({type(e).__name__}: {e}); KDA in PyTorch")
        return "chunk"
    ey = ((outs["fla"][0] - outs["chunk"][0]).norm() / outs["chunk"][0].norm()).item()
    eg = ((outs["fla"][1] - outs["chunk"][1]).norm() / outs["chunk"][1].norm()).item()
    log(f"fla chunk_kda vs PyTorch chunked KDA: output rel err {ey:.2e}, input-grad rel err {eg:.2e}")
    return "fla" if ey < 3e-2 and eg < 1e-1 else "chunk"


@torch.no_grad()
def evaluate(model, data, seq, batch, device, amp, max_windows=None):
    """Mean next-token loss over non-overlapping windows of `seq` tokens (each from a fresh state)."""
    was = model.training
    model.eval()
    n = (len(data) - 1) // seq
    if max_windows:
        n = min(n, max_windows)
    tot, cnt = 0.0, 0
    for i in range(0, n, batch):
        idx = torch.arange(i, min(n, i + batch), device=device) * seq
        w = data[idx.unsqueeze(1) + torch.arange(seq + 1, device=device)]
        with torch.autocast(device.type, torch.bfloat16, enabled=amp):
            logits = model(w[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum")
        tot += loss.item()
        cnt += w[:, 1:].numel()
    model.train(was)
    return tot / cnt


def set_fake_quant(model, on):
    for moe in model.moe_layers():
        moe.fake_quant = on


def unigram_ppl(ids):
    c = np.bincount(ids.astype(np.int64))
    p = c[c > 0] / len(ids)
    return float(math.exp(-(p * np.log(p)).sum()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="a checkpoint directory whose config.json defines the model")
    ap.add_argument("--data", required=True, help="train.bin / valid.bin / heldout.bin (uint16)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--time-budget", type=float, default=200.0, help="seconds of training when --steps 0")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--bias-rate", type=float, default=1e-3)
    ap.add_argument("--qat-frac", type=float, default=0.2)
    ap.add_argument("--eval-every", type=int, default=0, help="default: about 12 evaluations")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--kda", default="auto", help="auto | fla | chunk | recurrent")
    ap.add_argument("--sparse-experts", action="store_true", help="per-expert loop instead of the dense form")
    a = ap.parse_args()
    t_start = time.time()
    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(a.seed)
    np.random.seed(a.seed)
    device = torch.device(a.device)
    amp = device.type == "cuda"
    if amp:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    model = ckpt.build(a.config)
    init_weights(model, a.seed)
    model.to(device).train()
    model.dropout = a.dropout
    model.set_dense_experts(not a.sparse_experts)
    model.kda_impl = pick_kda(model, device) if a.kda == "auto" else a.kda
    n_par = sum(p.numel() for p in model.parameters())
    log(f"model: {n_par / 1e6:.2f} M parameters; KDA via {model.kda_impl}; device {device}")

    def load(name):
        return torch.from_numpy(np.fromfile(os.path.join(a.data, name), dtype=np.uint16).astype(np.int64)).to(device)

    train, valid, held = load("train.bin"), load("valid.bin"), load("heldout.bin")
    log(f"tokens: train {len(train)}, valid {len(valid)}, held-out {len(held)}")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "conv1d" not in n and "_res_proj" not in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "conv1d" not in n and "_res_proj" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd}, {"params": other, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=amp)
    gen = torch.Generator().manual_seed(a.seed)
    warm = 30
    steps = a.steps
    logf = open(os.path.join(a.out, "loss.jsonl"), "w")
    best = (float("inf"), None, -1)
    moes = model.moe_layers()
    t_loop = time.time()
    t10 = None
    step = 0
    eval_every = a.eval_every

    def lr_at(s, total):
        if s < warm:
            return a.lr * (s + 1) / warm
        prog = min(1.0, (s - warm) / max(1, total - warm))
        return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog)))

    while True:
        if steps and step >= steps:
            break
        if step == 10:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t10 = time.time()
        if step == 30 and not steps:
            if device.type == "cuda":
                torch.cuda.synchronize()
            per = (time.time() - t10) / 20
            left = a.time_budget - (time.time() - t_loop)
            steps = max(40, 30 + int(left / per))
            log(f"{per * 1000:.0f} ms/step ({a.batch * a.seq / per / 1e3:.0f}k tokens/s): --steps {steps}")
        total = steps or 10 ** 9
        if not eval_every and steps:
            eval_every = max(10, steps // 12)
        qat = steps and step >= int(steps * (1 - a.qat_frac))
        set_fake_quant(model, bool(qat))
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, total)
        off = torch.randint(0, len(train) - a.seq - 1, (a.batch,), generator=gen).to(device)
        w = train[off.unsqueeze(1) + torch.arange(a.seq + 1, device=device)]
        with torch.autocast(device.type, torch.bfloat16, enabled=amp):
            logits = model(w[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for moe in moes:
                load_ = moe.last_load.float()
                moe.gate.e_score_correction_bias += a.bias_rate * torch.sign(load_.mean() - load_)
        step += 1
        rec = {"step": step, "loss": None, "lr": lr_at(step - 1, total), "qat": bool(qat)}
        if step % 10 == 0 or step == 1:
            imb = max((m.last_load.max().item() / m.last_load.float().mean().item()) for m in moes)
            rec.update(loss=loss.item(), grad_norm=gn.item(), max_load_ratio=imb, t=time.time() - t_loop)
            log(f"step {step}/{steps or '?'} loss {loss.item():.4f} gn {gn.item():.2f} max-load/mean {imb:.2f} qat {bool(qat)}")
        if eval_every and (step % eval_every == 0 or step == steps):
            set_fake_quant(model, True)
            vl = evaluate(model, valid, a.seq, 32, device, amp)
            set_fake_quant(model, bool(qat))
            rec["valid_loss_mxfp4"] = vl
            log(f"step {step}: valid loss (MXFP4 experts) {vl:.4f} (ppl {math.exp(vl):.2f})")
            if vl < best[0]:
                best = (vl, {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}, step)
        if rec["loss"] is not None or "valid_loss_mxfp4" in rec:
            logf.write(json.dumps(rec) + "\n")
            logf.flush()
    train_s = time.time() - t_loop
    log(f"trained {step} steps in {train_s:.0f} s; best valid at step {best[2]}")

    # Export the kept state: text tensors under checkpoint names and dtypes.
    model.load_state_dict(best[1])
    tensors = ckpt.text_tensors(model)
    from safetensors.torch import save_file

    names = sorted(tensors)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, os.path.join(a.out, "text-1.safetensors"))
    save_file({n: tensors[n] for n in names[half:]}, os.path.join(a.out, "text-2.safetensors"))

    # Held-out perplexity in float32 on the exported weights, and with unquantised experts.
    model.eval()
    if amp:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    impl_used = model.kda_impl
    float_kda = "chunk" if model.kda_impl == "fla" else model.kda_impl
    model.kda_impl = float_kda
    set_fake_quant(model, False)
    held_float = evaluate(model, held, a.seq, 16, device, False)
    exported = ckpt.build(a.config)
    sd = {}
    from ckpt import EXPERT, PREFIX
    import mxfp4

    for name in exported.state_dict():
        m = EXPERT.match(name)
        if m:
            l, wn = m.groups()
            sd[name] = torch.stack([mxfp4.dequantize(tensors[f"{PREFIX}model.layers.{l}.block_sparse_moe.experts.{e}.{wn}.weight_packed"],
                                                     tensors[f"{PREFIX}model.layers.{l}.block_sparse_moe.experts.{e}.{wn}.weight_scale"])
                                    for e in range(exported.c.E)])
        else:
            sd[name] = tensors[PREFIX + name].float()
    exported.load_state_dict(sd)
    exported.to(device).eval()
    exported.kda_impl = float_kda
    held_q = evaluate(exported, held, a.seq, 16, device, False)
    held_np = held.cpu().numpy()
    uni = unigram_ppl(held_np)
    summary = {
        "steps": step, "best_step": best[2], "train_seconds": train_s, "total_seconds": time.time() - t_start,
        "kda_impl_training": impl_used,
        "tokens_seen": step * a.batch * a.seq, "train_tokens": len(train), "heldout_tokens": len(held),
        "valid_loss_mxfp4_best": best[0],
        "heldout_ppl_exported": math.exp(held_q), "heldout_ppl_float_experts": math.exp(held_float),
        "heldout_unigram_ppl": uni, "ratio": math.exp(held_q) / uni,
        "args": vars(a), "parameters": n_par,
    }
    json.dump(summary, open(os.path.join(a.out, "summary.json"), "w"), indent=1)
    log(f"held-out ppl: exported (MXFP4) {math.exp(held_q):.3f}, unquantised experts {math.exp(held_float):.3f}; "
        f"unigram {uni:.2f}; ratio {math.exp(held_q) / uni:.4f}")


if __name__ == "__main__":
    main()
