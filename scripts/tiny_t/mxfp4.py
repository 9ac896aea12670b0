"""MXFP4 in the release's compressed-tensors layout (spec §2.3): groups of 32 along the input
dimension, E8M0 scale 2^ceil(log2(amax/6)) per group, FP4 E2M1 codes, low nibble = even element."""
import torch

MAGS = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _scales(w):
    """Per-group exponent (int) of w [..., in] grouped by 32."""
    g = w.float().reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = g.abs().amax(-1)
    e = torch.ceil(torch.log2(amax.clamp_min(1e-30) / 6.0)).clamp(-127, 127)
    return g, e


def _round(x):
    """Nearest E2M1 magnitude index of |x| (x already divided by the scale, |x| <= 6)."""
    mags = MAGS.to(x.device)
    return (x.abs().unsqueeze(-1) - mags).abs().argmin(-1)


def quantize(w):
    """w [out, in] float → (weight_packed U8 [out, in/2], weight_scale U8 [out, in/32])."""
    assert w.shape[-1] % 32 == 0
    g, e = _scales(w)
    x = g / torch.exp2(e).unsqueeze(-1)
    code = _round(x) | ((x < 0) & (_round(x) > 0)).to(torch.int64) << 3
    code = code.reshape(*w.shape).to(torch.uint8)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed.contiguous(), (e + 127).to(torch.uint8).contiguous()


def dequantize(packed, scale):
    """Inverse of `quantize`: float32 [out, in]."""
    lo = (packed & 0x0F).long()
    hi = (packed >> 4).long()
    code = torch.stack([lo, hi], -1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    mags = MAGS.to(packed.device)[code & 7]
    val = torch.where(code >= 8, -mags, mags)
    s = torch.exp2(scale.float() - 127.0)
    return (val.reshape(*val.shape[:-1], -1, 32) * s.unsqueeze(-1)).reshape(val.shape)


def fake_quant(w):
    """MXFP4 round trip in the forward pass, identity gradient (straight-through)."""
    with torch.no_grad():
        g, e = _scales(w)
        s = torch.exp2(e).unsqueeze(-1)
        x = g / s
        q = MAGS.to(w.device)[_round(x)] * torch.sign(x)
        q = (q * s).reshape(w.shape).to(w.dtype)
    return w + (q - w).detach()
