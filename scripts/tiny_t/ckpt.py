"""Reading and writing K3 release checkpoints (config.json + index + safetensors shards) for the
tiny-t scripts: text weights in and out of `model.K3Text`."""
import json
import os
import re

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import mxfp4
from model import Config, K3Text

PREFIX = "language_model."
F32 = re.compile(r"(conv1d\.weight|dt_bias|A_log|o_norm\.weight|e_score_correction_bias)$")
EXPERT = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.experts_(w[123])$")


def read_config(d):
    return json.load(open(os.path.join(d, "config.json")))


def build(d):
    return K3Text(Config(read_config(d)["text_config"]))


def weight_map(d):
    return json.load(open(os.path.join(d, "model.safetensors.index.json")))["weight_map"]


def read_tensors(d, names=None):
    out = {}
    wm = weight_map(d)
    by_file = {}
    for n, f in wm.items():
        if names is None or names(n):
            by_file.setdefault(f, []).append(n)
    for f, ns in by_file.items():
        with safe_open(os.path.join(d, f), "pt") as h:
            for n in ns:
                out[n] = h.get_tensor(n)
    return out


def load_text(model, d):
    """Loads the text weights of checkpoint `d` into `model` (experts dequantised)."""
    t = read_tensors(d, lambda n: n.startswith(PREFIX))
    sd = model.state_dict()
    new = {}
    for name in sd:
        m = EXPERT.match(name)
        if m:
            l, w = m.groups()
            E = model.c.E
            ws = [mxfp4.dequantize(t[f"{PREFIX}model.layers.{l}.block_sparse_moe.experts.{e}.{w}.weight_packed"],
                                   t[f"{PREFIX}model.layers.{l}.block_sparse_moe.experts.{e}.{w}.weight_scale"]) for e in range(E)]
            new[name] = torch.stack(ws)
        else:
            new[name] = t[PREFIX + name].float()
    model.load_state_dict(new)
    return model


def text_tensors(model):
    """The text tensors of `model` under checkpoint names and dtypes (experts MXFP4)."""
    out = {}
    for name, v in model.state_dict().items():
        v = v.detach().float().cpu()
        m = EXPERT.match(name)
        if m:
            l, w = m.groups()
            for e in range(v.shape[0]):
                p, s = mxfp4.quantize(v[e])
                base = f"{PREFIX}model.layers.{l}.block_sparse_moe.experts.{e}.{w}"
                out[base + ".weight_packed"] = p
                out[base + ".weight_scale"] = s
        else:
            out[PREFIX + name] = v.contiguous() if F32.search(name) else v.to(torch.bfloat16).contiguous()
    return out


def replace_text(d, tensors):
    """Rewrites the shards of release checkpoint `d` with the given text tensors: every text tensor
    must exist with the same shape and dtype (the layout and the index stay exactly as written by
    `k3-prefill synth`); vision tensors are kept."""
    wm = weight_map(d)
    missing = sorted(set(n for n in wm if n.startswith(PREFIX)) ^ set(tensors))
    if missing:
        raise SystemExit(f"text tensor sets differ: {missing[:10]}")
    for f in sorted(set(wm.values())):
        path = os.path.join(d, f)
        cur = {}
        with safe_open(path, "pt") as h:
            meta = h.metadata()
            for n in h.keys():
                cur[n] = h.get_tensor(n)
        for n in cur:
            if n in tensors:
                new = tensors[n]
                if new.shape != cur[n].shape or new.dtype != cur[n].dtype:
                    raise SystemExit(f"{n}: {tuple(new.shape)} {new.dtype} != {tuple(cur[n].shape)} {cur[n].dtype}")
                cur[n] = new
        save_file(cur, path, metadata=meta)
