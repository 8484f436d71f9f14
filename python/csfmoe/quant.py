"""FP4 quantization of stacked expert weights and its exact inverse.

`quantize` runs the library's quantizers (csfmoe/quantize.hpp: NVFP4 with the
ModelOpt recipe, one global scale per expert; MXFP4 with the OCP MX recipe)
on the CPU. `dequantize` is exact in float64: an E2M1 value times a block
scale has at most 6 significant bits, times a float32 global at most 30."""

from __future__ import annotations

import torch

from . import _csfmoe as _C
from . import ops
from ._errors import InvalidArgument

__all__ = ["quantize", "dequantize", "group_size"]

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def group_size(format: str) -> int:
    ops._check_choice("format", format, ops.FORMATS)
    return 16 if format == "nvfp4" else 32


def quantize(weights: torch.Tensor, format: str = "nvfp4", threads: int = 0) -> dict:
    """Quantize `weights` [E, R, K] (any float dtype, any device; K a
    multiple of the group size) expert by expert.

    Returns CPU tensors {"packed": uint8 [E, R, K/2] (low nibble = even
    element), "scales": uint8 [E, R, K/g] (e4m3fn / e8m0 bits), "global":
    float32 [E] (1 for MXFP4)}: the layout PreparedExperts and moe_reference
    take."""
    g = group_size(format)
    if not isinstance(weights, torch.Tensor) or not weights.is_floating_point():
        raise InvalidArgument(f"weights: expected a floating-point torch.Tensor, got "
                              f"{getattr(weights, 'dtype', type(weights).__name__)}")
    if weights.dim() != 3:
        raise InvalidArgument(f"weights: expected [E, R, K], got shape {list(weights.shape)}")
    e, r, k = (int(s) for s in weights.shape)
    if k % g:
        raise InvalidArgument(f"weights: K = {k} (last dimension) is not a multiple of the {format} group size {g}")
    x = weights.detach().to(device="cpu", dtype=torch.float32).contiguous()
    if not bool(torch.isfinite(x).all()):
        raise InvalidArgument("weights: contains NaN or infinity")
    q = _C.quantize_experts(format, x, e, r, k, threads)
    return {"packed": q["packed"].view(e, r, k // 2), "scales": q["scales"].view(e, r, k // g),
            "global": q["global"]}


def dequantize(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, format: str = "nvfp4",
               dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Exact values of quantized experts: packed [E, R, K/2], native
    row-major scales [E, R, K/g] (any 1-byte dtype), global [E] -> [E, R, K]
    in `dtype` (exact in float64) on packed's device."""
    g = group_size(format)
    ops._check_tensor(packed, "packed", (torch.uint8,), 3)
    e, r, half = (int(s) for s in packed.shape)
    dev = packed.device
    ops._check_tensor(scales, "scales", ops.BYTE_DTYPES, 3, dev)
    if tuple(scales.shape) != (e, r, half * 2 // g):
        raise InvalidArgument(f"scales: expected shape {[e, r, half * 2 // g]}, got {list(scales.shape)}")
    if not isinstance(global_scale, torch.Tensor) or tuple(global_scale.shape) != (e,):
        raise InvalidArgument(f"global_scale: expected a tensor of shape [{e}], got "
                              f"{list(getattr(global_scale, 'shape', []))}")
    table = torch.tensor(_E2M1, dtype=torch.float64, device=dev)
    p = packed.to(torch.int64)
    values = table[torch.stack((p & 0xF, p >> 4), dim=-1).reshape(e, r, half * 2)]
    s = ops._u8(scales)
    if format == "nvfp4":
        block = s.view(torch.float8_e4m3fn).to(torch.float64)
    else:
        block = torch.pow(2.0, s.to(torch.float64) - 127.0)
        block = torch.where(s == 0xFF, torch.full_like(block, float("nan")), block)
    out = values * block.repeat_interleave(g, dim=-1)
    out = out * global_scale.to(device=dev, dtype=torch.float64)[:, None, None]
    return out.to(dtype)
