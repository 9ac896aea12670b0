"""A compact PyTorch Kimi K3 text model (spec/KIMI_K3.md §3), written for training tiny-t.

Parameter names are the checkpoint's (without the `language_model.` prefix), except the routed
experts, which are stacked per layer (`experts_w1/w3 [E, I, L]`, `experts_w2 [E, L, I]`) and
converted to/from the per-expert compressed-tensors MXFP4 tensors by `load_checkpoint_state` /
`export_state` (see mxfp4.py).

KDA runs in one of three ways (`model.kda_impl`): "recurrent" (the delta rule token by token,
float32: the CPU check against golden tiny-a), "chunk" (a PyTorch chunked form, chunk 16, any
device) and "fla" (flash-linear-attention's Triton `chunk_kda`, the GPU training path).
Everything else is plain PyTorch; under `torch.autocast(bfloat16)` the matmuls run in BF16 and the
norms, gates, router and recurrences in float32.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class W(nn.Module):
    """Holds one named tensor (`<name>.weight`) of any shape."""

    def __init__(self, *shape):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(*shape))


def lin(x, w):
    return F.linear(x, w.weight if isinstance(w, nn.Module) else w)


def rms(x, w, eps):
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def situ(g, u, b1, b2):
    g = g.float()
    u = u.float()
    return b1 * torch.tanh(g / b1) * torch.sigmoid(g) * (b2 * torch.tanh(u / b2))


class Config:
    def __init__(self, tc):
        self.raw = tc
        self.H = tc["hidden_size"]
        self.L = tc["num_hidden_layers"]
        self.V = tc["vocab_size"]
        la = tc["linear_attn_config"]
        self.mla_layers = [l - 1 for l in la["full_attn_layers"]]  # 0-based
        self.kda_heads = la["num_heads"]
        self.kda_dim = la["head_dim"]
        self.conv = la["short_conv_kernel_size"]
        self.lower = la["gate_lower_bound"]
        self.mla_heads = tc["num_attention_heads"]
        self.q_lora = tc["q_lora_rank"]
        self.kv_lora = tc["kv_lora_rank"]
        self.nope = tc["qk_nope_head_dim"]
        self.rope = tc["qk_rope_head_dim"]
        self.vdim = tc["v_head_dim"]
        self.inter = tc["intermediate_size"]
        self.dense = tc["first_k_dense_replace"]
        self.E = tc["num_experts"]
        self.topk = tc["num_experts_per_token"]
        self.shared = tc["num_shared_experts"]
        self.moe_inter = tc["moe_intermediate_size"]
        self.latent = tc["routed_expert_hidden_size"]
        self.block = tc["attn_res_block_size"]
        self.eps = tc["rms_norm_eps"]
        self.b1 = tc["activation_situ_beta"]
        self.b2 = tc["activation_situ_linear_beta"]
        self.scaling = tc["routed_scaling_factor"]


# ---------------------------------------------------------------------------------------------
# KDA


def kda_recurrent(q, k, v, g, beta):
    """q, k (L2-normed, q scaled), v: [B, T, H, D]; g: [B, T, H, D] log decay; beta: [B, T, H].
    Returns o [B, T, H, D] and the final state [B, H, K, V] (float32)."""
    B, T, Hh, D = q.shape
    S = q.new_zeros(B, Hh, D, v.shape[-1], dtype=torch.float32)
    out = []
    for t in range(T):
        S = S * g[:, t].float().exp().unsqueeze(-1)
        kt = k[:, t].float()
        err = v[:, t].float() - torch.einsum("bhk,bhkv->bhv", kt, S)
        S = S + beta[:, t].float()[..., None, None] * kt.unsqueeze(-1) * err.unsqueeze(-2)
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t].float(), S))
    return torch.stack(out, 1), S


def kda_chunk(q, k, v, g, beta, C=16):
    """Chunked form of the same recurrence (spec §3.4) in PyTorch, float32. With g >= -5 and
    chunks of 16 every factor exp(±G) stays below e^80, so the products are formed factorised."""
    B, T, Hh, D = q.shape
    pad = (-T) % C
    if pad:
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    n = (T + pad) // C
    # [B, H, n, C, D]
    q, k, v, g = (x.float().reshape(B, n, C, Hh, -1).permute(0, 3, 1, 2, 4) for x in (q, k, v, g))
    beta = beta.float().reshape(B, n, C, Hh).permute(0, 3, 1, 2)
    G = g.cumsum(-2)
    eG = G.exp()
    kin = k * (-G).exp()  # k_j exp(-G_j)
    qe = q * eG
    ke = k * eG
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(0)
    A = (ke @ kin.transpose(-1, -2)).masked_fill(~strict, 0) * beta.unsqueeze(-1)
    eye = torch.eye(C, device=q.device, dtype=torch.float32)
    Tw = torch.linalg.solve_triangular(eye + A, torch.diag_embed(beta), upper=False, unitriangular=True)
    Wm = Tw @ ke
    U = Tw @ v
    QK = (qe @ kin.transpose(-1, -2)).masked_fill(~incl, 0)
    GL = G[..., -1:, :]  # [B, H, n, 1, D]
    kdec = k * (GL - G).exp()
    S = q.new_zeros(B, Hh, D, v.shape[-1], dtype=torch.float32)
    outs = []
    for i in range(n):
        Vt = U[:, :, i] - Wm[:, :, i] @ S
        outs.append(qe[:, :, i] @ S + QK[:, :, i] @ Vt)
        S = S * GL[:, :, i].transpose(-1, -2).exp() + kdec[:, :, i].transpose(-1, -2) @ Vt
    o = torch.stack(outs, 2).permute(0, 2, 3, 1, 4).reshape(B, n * C, Hh, -1)
    return o[:, :T], S


class KDA(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        Cd = c.kda_heads * c.kda_dim
        for n in ("q_proj", "k_proj", "v_proj", "g_proj"):
            setattr(self, n, W(Cd, c.H))
        self.o_proj = W(c.H, Cd)
        for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
            setattr(self, n, W(Cd, 1, c.conv))
        self.f_a_proj = W(c.kda_dim, c.H)
        self.f_b_proj = W(Cd, c.kda_dim)
        self.dt_bias = nn.Parameter(torch.zeros(Cd))
        self.A_log = nn.Parameter(torch.zeros(c.kda_dim))  # per head: entries [0, heads)
        self.b_proj = W(c.kda_heads, c.H)
        self.o_norm = W(c.kda_dim)

    def conv(self, x, w):
        # causal depthwise conv over T, x: [B, T, C], weight [C, 1, K] (float32)
        K = w.shape[-1]
        y = F.conv1d(F.pad(x.float().transpose(1, 2), (K - 1, 0)), w.float(), groups=x.shape[-1])
        return F.silu(y.transpose(1, 2))

    def forward(self, x, impl):
        c = self.c
        B, T, _ = x.shape
        Hh, D = c.kda_heads, c.kda_dim
        q = self.conv(lin(x, self.q_proj), self.q_conv1d.weight).view(B, T, Hh, D)
        k = self.conv(lin(x, self.k_proj), self.k_conv1d.weight).view(B, T, Hh, D)
        v = self.conv(lin(x, self.v_proj), self.v_conv1d.weight).view(B, T, Hh, D)
        q = q / torch.sqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * D ** -0.5
        k = k / torch.sqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
        z = lin(lin(x, self.f_a_proj), self.f_b_proj).float() + self.dt_bias.float()
        A = self.A_log[:Hh].float().exp().view(1, 1, Hh, 1)
        g = c.lower * torch.sigmoid(A * z.view(B, T, Hh, D))
        beta = torch.sigmoid(lin(x, self.b_proj).float())
        if impl == "recurrent":
            o, _ = kda_recurrent(q, k, v, g, beta)
        elif impl == "chunk":
            o, _ = kda_chunk(q, k, v, g, beta)
        else:
            from fla.ops.kda import chunk_kda

            o, _ = chunk_kda(q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16), g, beta.to(torch.bfloat16),
                             scale=1.0, output_final_state=False)
            o = o.float()
        o = rms(o, self.o_norm.weight, c.eps) * torch.sigmoid(lin(x, self.g_proj).float().view(B, T, Hh, D))
        return lin(o.reshape(B, T, Hh * D).to(x.dtype), self.o_proj)


# ---------------------------------------------------------------------------------------------
# MLA


class MLA(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        qd = c.nope + c.rope
        self.q_a_proj = W(c.q_lora, c.H)
        self.q_a_layernorm = W(c.q_lora)
        self.q_b_proj = W(c.mla_heads * qd, c.q_lora)
        self.kv_a_proj_with_mqa = W(c.kv_lora + c.rope, c.H)
        self.kv_a_layernorm = W(c.kv_lora)
        self.kv_b_proj = W(c.mla_heads * (c.nope + c.vdim), c.kv_lora)
        self.g_proj = W(c.mla_heads * c.vdim, c.H)
        self.o_proj = W(c.H, c.mla_heads * c.vdim)

    def forward(self, x):
        c = self.c
        B, T, _ = x.shape
        Hh = c.mla_heads
        cq = rms(lin(x, self.q_a_proj), self.q_a_layernorm.weight, 1e-6).to(x.dtype)
        q = lin(cq, self.q_b_proj).view(B, T, Hh, c.nope + c.rope)
        kv = lin(x, self.kv_a_proj_with_mqa)
        ckv = rms(kv[..., :c.kv_lora], self.kv_a_layernorm.weight, 1e-6).to(x.dtype)
        kpe = kv[..., c.kv_lora:]
        kvb = lin(ckv, self.kv_b_proj).view(B, T, Hh, c.nope + c.vdim)
        knope, v = kvb[..., :c.nope], kvb[..., c.nope:]
        k = torch.cat([knope, kpe.unsqueeze(2).expand(B, T, Hh, c.rope)], -1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, d]
        dq = c.nope + c.rope
        if v.shape[-1] != dq:  # flash kernels want one head size
            v = F.pad(v, (0, dq - v.shape[-1]))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=dq ** -0.5)[..., :c.vdim]
        a = a.transpose(1, 2).reshape(B, T, Hh * c.vdim)
        a = a * torch.sigmoid(lin(x, self.g_proj).float()).to(a.dtype)
        return lin(a, self.o_proj)


# ---------------------------------------------------------------------------------------------
# FFN


class DenseMLP(nn.Module):
    def __init__(self, c, width):
        super().__init__()
        self.c = c
        self.gate_proj = W(width, c.H)
        self.up_proj = W(width, c.H)
        self.down_proj = W(c.H, width)

    def forward(self, x):
        h = situ(lin(x, self.gate_proj), lin(x, self.up_proj), self.c.b1, self.c.b2)
        return lin(h.to(x.dtype), self.down_proj)


class Gate(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(c.E, c.H))
        # Not learned by gradients: moved by the load-balancing rule (train.py).
        self.register_buffer("e_score_correction_bias", torch.zeros(c.E))


class MoE(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.gate = Gate(c)
        self.routed_expert_down_proj = W(c.latent, c.H)
        self.routed_expert_norm = W(c.latent)
        self.routed_expert_up_proj = W(c.H, c.latent)
        self.shared_experts = DenseMLP(c, c.shared * c.moe_inter)
        self.experts_w1 = nn.Parameter(torch.zeros(c.E, c.moe_inter, c.latent))
        self.experts_w3 = nn.Parameter(torch.zeros(c.E, c.moe_inter, c.latent))
        self.experts_w2 = nn.Parameter(torch.zeros(c.E, c.latent, c.moe_inter))
        self.fake_quant = False  # MXFP4 quantisation-aware training (straight-through)
        self.last_load = None

    def expert_weights(self):
        if not self.fake_quant:
            return self.experts_w1, self.experts_w3, self.experts_w2
        from mxfp4 import fake_quant

        return tuple(fake_quant(w) for w in (self.experts_w1, self.experts_w3, self.experts_w2))

    def route(self, x):
        c = self.c
        with torch.autocast(x.device.type, enabled=False):
            s = torch.sigmoid(F.linear(x.float(), self.gate.weight.float()))
        sel = torch.topk(s.detach() + self.gate.e_score_correction_bias, c.topk, dim=-1).indices
        w = s.gather(-1, sel)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * c.scaling
        return sel, w

    def forward(self, x, dense_experts=True):
        c = self.c
        B, T, _ = x.shape
        xf = x.reshape(B * T, -1)
        sel, w = self.route(xf)
        self.last_load = torch.bincount(sel.flatten(), minlength=c.E).detach() if self.training else None
        xl = lin(xf, self.routed_expert_down_proj)
        w1, w3, w2 = self.expert_weights()
        if dense_experts:
            # Every expert on every token, weighted by the (mostly zero) routing weights:
            # the same function as the sparse sum, without data-dependent shapes.
            comb = torch.zeros(B * T, c.E, device=x.device, dtype=torch.float32).scatter(-1, sel, w.float())
            gt = torch.einsum("nl,eil->nei", xl, w1.to(xl.dtype))
            up = torch.einsum("nl,eil->nei", xl, w3.to(xl.dtype))
            h = situ(gt, up, c.b1, c.b2) * comb.unsqueeze(-1)
            r = torch.einsum("nei,eli->nl", h.to(xl.dtype), w2.to(xl.dtype)).float()
        else:
            r = torch.zeros(B * T, c.latent, device=x.device, dtype=torch.float32)
            for e in range(c.E):
                rows, slot = (sel == e).nonzero(as_tuple=True)
                if rows.numel() == 0:
                    continue
                xe = xl[rows]
                he = situ(F.linear(xe, w1[e].to(xe.dtype)), F.linear(xe, w3[e].to(xe.dtype)), c.b1, c.b2)
                ye = F.linear(he.to(xe.dtype), w2[e].to(xe.dtype)).float()
                r.index_add_(0, rows, ye * w[rows, slot].unsqueeze(-1).float())
        r = rms(r, self.routed_expert_norm.weight, c.eps).to(x.dtype)
        y = lin(r, self.routed_expert_up_proj) + self.shared_experts(xf)
        return y.view(B, T, -1)


# ---------------------------------------------------------------------------------------------
# Decoder


class Layer(nn.Module):
    def __init__(self, c, l):
        super().__init__()
        self.c = c
        self.l = l
        self.is_mla = l in c.mla_layers
        for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            setattr(self, n, W(c.H))
        self.self_attention_res_proj = W(1, c.H)
        self.mlp_res_proj = W(1, c.H)
        self.self_attn = MLA(c) if self.is_mla else KDA(c)
        if l < c.dense:
            self.mlp = DenseMLP(c, c.inter)
        else:
            self.block_sparse_moe = MoE(c)

    def ffn(self, x):
        return self.mlp(x) if self.l < self.c.dense else self.block_sparse_moe(x, self.dense_experts)


def attn_res(bank, P, norm_w, proj_w, eps):
    """Spec §3.2: softmax over depth of the bank entries and the running sum P."""
    V = torch.stack(bank + [P], 0).float()  # [n+1, B, T, H]
    kk = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + eps)
    s = (kk * (norm_w.float() * proj_w.float().view(-1))).sum(-1)  # [n+1, B, T]
    a = torch.softmax(s, 0)
    return (a.unsqueeze(-1) * V).sum(0)


class Inner(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = W(c.V, c.H)
        self.layers = nn.ModuleList([Layer(c, l) for l in range(c.L)])
        self.norm = W(c.H)
        self.output_attn_res_norm = W(c.H)
        self.output_attn_res_proj = W(1, c.H)


class K3Text(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.model = Inner(c)
        self.lm_head = W(c.V, c.H)
        self.kda_impl = "recurrent"
        self.dropout = 0.0  # training only: on the attention and FFN outputs
        self.set_dense_experts(True)

    def set_dense_experts(self, on):
        for layer in self.model.layers:
            layer.dense_experts = on

    def moe_layers(self):
        return [l.block_sparse_moe for l in self.model.layers if l.l >= self.c.dense]

    def forward(self, ids, hidden_out=None):
        c = self.c
        m = self.model
        dt = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled() and ids.is_cuda else torch.float32
        P = F.embedding(ids, m.embed_tokens.weight).float()
        bank = []
        for layer in m.layers:
            l = layer.l
            h = attn_res(bank, P, layer.self_attention_res_norm.weight, layer.self_attention_res_proj.weight, c.eps) if bank else P
            if l % c.block == 0:
                bank.append(P)
                P = None
            xin = rms(h, layer.input_layernorm.weight, c.eps).to(dt)
            u = layer.self_attn(xin) if layer.is_mla else layer.self_attn(xin, self.kda_impl)
            if self.training and self.dropout:
                u = F.dropout(u, self.dropout)
            P = u.float() if P is None else P + u.float()
            h2 = attn_res(bank, P, layer.mlp_res_norm.weight, layer.mlp_res_proj.weight, c.eps)
            mo = layer.ffn(rms(h2, layer.post_attention_layernorm.weight, c.eps).to(dt))
            if self.training and self.dropout:
                mo = F.dropout(mo, self.dropout)
            P = P + mo.float()
        z = attn_res(bank, P, m.output_attn_res_norm.weight, m.output_attn_res_proj.weight, c.eps)
        hfin = rms(z, m.norm.weight, c.eps).to(dt)
        if hidden_out is not None:
            return hfin
        return lin(hfin, self.lm_head)


def init_weights(model, seed):
    """Training init: 2-D weights N(0, 1/fan_in) (output projections scaled down by depth), norm
    gains 1, AttnRes projections 0 (uniform depth mix), KDA gate parameters in the ranges of the
    spec's recipe."""
    g = torch.Generator().manual_seed(seed)
    c = model.c
    depth_scale = (2 * c.L) ** -0.5
    for name, p in model.named_parameters():
        with torch.no_grad():
            if name.endswith("_res_proj.weight"):
                p.zero_()
            elif p.dim() == 1 or name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                if name.endswith("dt_bias"):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)
                elif name.endswith("A_log"):
                    p.zero_()
                    p[: c.kda_heads] = torch.log(torch.linspace(0.5, 2.0, c.kda_heads))
                else:
                    p.fill_(1.0)
            elif "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.startswith("experts_w") or ".experts_w" in name:
                fan_in = p.shape[-1]
                std = fan_in ** -0.5 * (depth_scale if name.endswith("w2") else 1.0)
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1]
                std = fan_in ** -0.5
                if name.endswith("o_proj.weight") or name.endswith("down_proj.weight") and "routed" not in name:
                    std *= depth_scale
                if name.endswith("lm_head.weight"):
                    std *= 0.5
                p.copy_(torch.randn(p.shape, generator=g) * std)
    for moe in model.moe_layers():
        moe.gate.e_score_correction_bias.zero_()
