"""Pure-PyTorch MoE reference used by the tests (float64, exact dequantization)."""

import torch

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    dtype=torch.float64)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, glob: torch.Tensor, fmt: str) -> torch.Tensor:
    """packed uint8 [E, R, K/2] (low nibble = even element), scales 1-byte
    [E, R, K/g], glob [E] -> float64 [E, R, K]."""
    p = packed.cpu().to(torch.int64)
    codes = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(*p.shape[:-1], -1)
    vals = E2M1[codes]
    s = scales.cpu().view(torch.uint8)
    if fmt == "nvfp4":
        sv = s.view(torch.float8_e4m3fn).to(torch.float64)
        g = 16
    else:
        sv = torch.pow(2.0, s.to(torch.float64) - 127.0)
        sv = torch.where(s == 0xFF, torch.full_like(sv, float("nan")), sv)
        g = 32
    sv = sv.repeat_interleave(g, dim=-1)
    return vals * sv * glob.cpu().to(torch.float64)[:, None, None]


def moe(hidden, w13, w13_scale, w13_global, w2, w2_scale, w2_global, topk_ids, topk_weights, fmt="nvfp4",
        order="w13", activation="silu", alpha=1.702, limit=7.0, w13_bias=None, w2_bias=None):
    """activation "gpt_oss": transformers' GptOssExperts activation written
    out here, on gate and up plus the optional biases (w13_bias in w13's row
    order); w2_bias is added to each expert's output before the weighting."""
    W13 = dequantize(w13, w13_scale, w13_global, fmt)
    W2 = dequantize(w2, w2_scale, w2_global, fmt)
    n = W13.shape[1] // 2
    x = hidden.cpu().to(torch.float64)
    ids = topk_ids.cpu().to(torch.int64)
    wts = topk_weights.cpu().to(torch.float64)
    b13 = None if w13_bias is None else w13_bias.cpu().to(torch.float64)
    b2 = None if w2_bias is None else w2_bias.cpu().to(torch.float64)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = W13[e] @ x[t]
            if b13 is not None:
                gu = gu + b13[e]
            gate, up = (gu[:n], gu[n:]) if order == "w13" else (gu[n:], gu[:n])
            if activation == "gpt_oss":
                gate = gate.clamp(max=limit)
                up = up.clamp(min=-limit, max=limit)
                act = (up + 1) * (gate * torch.sigmoid(gate * alpha))
            else:
                act = gate * torch.sigmoid(gate) * up
            y = W2[e] @ act
            if b2 is not None:
                y = y + b2[e]
            out[t] += wts[t, j] * y
    return out
