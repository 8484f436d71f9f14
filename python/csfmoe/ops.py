"""torch.library custom ops of the csfmoe namespace.

Every op checks dtype, shape and device in Python (raising
csfmoe.InvalidArgument, a ValueError) before the C++ call, which checks again
and raises the C++ library's own typed errors. Each op has a fake (meta)
implementation so that torch.compile and torch.export trace through it.

Part tensors of a CSF scale tensor (see docs/python.md):
  fixed            uint8 [E * fixed_bytes_per_expert]
  exceptions       int32 (or uint32) [X]   32-bit records, bit patterns as stored
  row_prefix       int32 (or uint32) [E * padded_rows + 1]
  partition_index  int32 (or uint32) [E * partitions_per_expert + 1]
"""

from __future__ import annotations

import functools
import math
from typing import List, Optional, Tuple

import torch

from . import _csfmoe as _C
from ._errors import InvalidArgument, Unsupported

__all__ = [
    "geometry",
    "native_shape",
    "compress_scales",
    "decompress_scales",
    "expand_scales",
    "expand_scales_routed",
]

FORMATS = ("nvfp4", "mxfp4")
LAYOUTS = ("row_major", "swizzled_128x4")
BYTE_DTYPES = tuple(
    d
    for d in (
        torch.uint8,
        torch.int8,
        getattr(torch, "float8_e4m3fn", None),
        getattr(torch, "float8_e8m0fnu", None),
    )
    if d is not None
)
WORD_DTYPES = tuple(d for d in (torch.int32, getattr(torch, "uint32", None)) if d is not None)
INDEX_DTYPES = (torch.int32, torch.int64)


@functools.lru_cache(maxsize=1024)
def geometry(format: str, layout: str, experts: int, rows: int, cols: int) -> dict:
    """Sizes derived from a grid shape (CsfGeometry::of); raises InvalidArgument."""
    return dict(_C.geometry(format, layout, experts, rows, cols))


def native_shape(layout: str, format: str, experts: int, rows: int, cols: int) -> Tuple[int, int, int]:
    """Shape [E, R, C] of a native scale tensor in `layout`: the true grid for
    row_major, rows padded to 128 and columns to 4 for swizzled_128x4."""
    _check_choice("layout", layout, LAYOUTS)
    if layout == "row_major":
        return (experts, rows, cols)
    return (experts, -(-rows // 128) * 128, -(-cols // 4) * 4)


# ---------------------------------------------------------------------------
# checks (shared with moe.py)
# ---------------------------------------------------------------------------
def _check_choice(what: str, value: str, choices) -> None:
    if value not in choices:
        raise InvalidArgument(f"{what} must be one of {', '.join(choices)}, got {value!r}")


def _check_tensor(t, what: str, dtypes, ndim: Optional[int] = None, device: Optional[torch.device] = None):
    if not isinstance(t, torch.Tensor):
        raise InvalidArgument(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise InvalidArgument(f"{what}: dtype must be one of {names}, got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() != ndim:
        raise InvalidArgument(f"{what}: expected {ndim}-D, got shape {list(t.shape)}")
    if device is not None and t.device != device:
        raise InvalidArgument(f"{what}: expected a tensor on {device}, got {t.device}")
    if not t.is_contiguous():
        raise InvalidArgument(f"{what}: tensor is not contiguous (call .contiguous())")


def _grid_of(scales: torch.Tensor) -> Tuple[int, int, int]:
    """(E, R, C) of a native scale tensor: leading dims are stacked experts."""
    if scales.dim() < 2:
        raise InvalidArgument(f"scales: expected [.., rows, cols], got shape {list(scales.shape)}")
    experts = math.prod(int(s) for s in scales.shape[:-2])
    return experts, int(scales.shape[-2]), int(scales.shape[-1])


def _check_parts(fixed, exceptions, row_prefix, partition_index, format, src_layout, experts, rows, cols):
    _check_choice("format", format, FORMATS)
    _check_choice("src_layout", src_layout, LAYOUTS)
    g = geometry(format, src_layout, experts, rows, cols)
    _check_tensor(fixed, "fixed", (torch.uint8,), 1)
    dev = fixed.device
    _check_tensor(exceptions, "exceptions", WORD_DTYPES, 1, dev)
    _check_tensor(row_prefix, "row_prefix", WORD_DTYPES, 1, dev)
    _check_tensor(partition_index, "partition_index", WORD_DTYPES, 1, dev)
    for t, what, n in (
        (fixed, "fixed", g["fixed_bytes"]),
        (row_prefix, "row_prefix", g["row_prefix_len"]),
        (partition_index, "partition_index", g["partition_index_len"]),
    ):
        if t.numel() != n:
            raise InvalidArgument(
                f"{what}: expected {n} elements for a [{experts}, {rows}, {cols}] {format} grid, got {t.numel()}"
            )
    return g


def _check_out(out, what, layout, format, experts, rows, cols, device):
    _check_choice("layout", layout, LAYOUTS)
    _check_tensor(out, what, BYTE_DTYPES, None, device)
    want = math.prod(native_shape(layout, format, experts, rows, cols))
    if out.numel() != want:
        raise InvalidArgument(
            f"{what}: expected {want} bytes ({layout} grid of {experts} x {rows} x {cols}), "
            f"got shape {list(out.shape)} ({out.numel()} elements)"
        )


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _require_cuda_build(what: str) -> None:
    if not _C.has_cuda:
        raise Unsupported(f"{what}: this csfmoe build has no CUDA kernels (built with CSFMOE_ENABLE_CUDA=OFF or no nvcc)")


# ---------------------------------------------------------------------------
# compress_scales
# ---------------------------------------------------------------------------
@torch.library.custom_op("csfmoe::compress_scales", mutates_args=())
def compress_scales(
    scales: torch.Tensor, format: str, layout: str, threads: int = 0
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Encode native scales [.., R, C] (1-byte dtype) into CSF parts
    (fixed, exceptions, row_prefix, partition_index). CPU tensors use the CPU
    codec; CUDA tensors the device encoder (which synchronizes the current
    stream once, so not inside graph capture)."""
    _check_choice("format", format, FORMATS)
    _check_choice("layout", layout, LAYOUTS)
    _check_tensor(scales, "scales", BYTE_DTYPES)
    e, r, c = _grid_of(scales)
    geometry(format, layout, e, r, c)
    src = _u8(scales.detach())
    if scales.device.type == "cpu":
        return tuple(_C.encode(src, format, layout, e, r, c, threads))
    if scales.device.type == "cuda":
        _require_cuda_build("compress_scales")
        return tuple(_C.encode_on_device(src, format, layout, e, r, c, _stream(scales.device)))
    raise InvalidArgument(f"scales: unsupported device {scales.device}")


@compress_scales.register_fake
def _(scales, format, layout, threads=0):
    e, r, c = _grid_of(scales)
    g = geometry(format, layout, e, r, c)
    n = torch.library.get_ctx().new_dynamic_size()
    return (
        scales.new_empty((g["fixed_bytes"],), dtype=torch.uint8),
        scales.new_empty((n,), dtype=torch.int32),
        scales.new_empty((g["row_prefix_len"],), dtype=torch.int32),
        scales.new_empty((g["partition_index_len"],), dtype=torch.int32),
    )


# ---------------------------------------------------------------------------
# decompress_scales (CPU, validating)
# ---------------------------------------------------------------------------
@torch.library.custom_op("csfmoe::decompress_scales", mutates_args=())
def decompress_scales(
    fixed: torch.Tensor,
    exceptions: torch.Tensor,
    row_prefix: torch.Tensor,
    partition_index: torch.Tensor,
    format: str,
    src_layout: str,
    experts: int,
    rows: int,
    cols: int,
    layout: str,
    threads: int = 0,
    trusted: bool = False,
) -> torch.Tensor:
    """Decode CPU parts into a new uint8 tensor of native_shape(layout, ...).
    The parts are fully validated (FormatError) unless `trusted`."""
    _check_parts(fixed, exceptions, row_prefix, partition_index, format, src_layout, experts, rows, cols)
    if fixed.device.type != "cpu":
        raise InvalidArgument(f"fixed: decompress_scales decodes on the CPU, got {fixed.device}; use expand_scales")
    out = torch.empty(native_shape(layout, format, experts, rows, cols), dtype=torch.uint8)
    _C.decode(fixed, exceptions, row_prefix, partition_index, format, src_layout, experts, rows, cols,
              out, layout, threads, trusted)
    return out


@decompress_scales.register_fake
def _(fixed, exceptions, row_prefix, partition_index, format, src_layout, experts, rows, cols, layout,
      threads=0, trusted=False):
    return fixed.new_empty(native_shape(layout, format, experts, rows, cols), dtype=torch.uint8)


# ---------------------------------------------------------------------------
# expand_scales / expand_scales_routed (into caller-owned scratch)
# ---------------------------------------------------------------------------
@torch.library.custom_op("csfmoe::expand_scales", mutates_args=("out",))
def expand_scales(
    fixed: torch.Tensor,
    exceptions: torch.Tensor,
    row_prefix: torch.Tensor,
    partition_index: torch.Tensor,
    format: str,
    src_layout: str,
    experts: int,
    rows: int,
    cols: int,
    out: torch.Tensor,
    layout: str,
) -> None:
    """Rebuild every expert's native grid into `out` (1-byte dtype,
    native_shape(layout) elements, on the parts' device). On CUDA: async on
    the current stream, no allocation, no host sync (graph-capturable). The
    kernels trust the part contents: validate parts before they go to the
    device (CsfScales does)."""
    _check_parts(fixed, exceptions, row_prefix, partition_index, format, src_layout, experts, rows, cols)
    _check_out(out, "out", layout, format, experts, rows, cols, fixed.device)
    if fixed.device.type == "cpu":
        _C.decode(fixed, exceptions, row_prefix, partition_index, format, src_layout, experts, rows, cols,
                  _u8(out), layout, 0, False)
        return
    _require_cuda_build("expand_scales")
    _C.expand_all(fixed, exceptions, row_prefix, partition_index, format, src_layout, experts, rows, cols,
                  _u8(out), layout, _stream(out.device))


@expand_scales.register_fake
def _(fixed, exceptions, row_prefix, partition_index, format, src_layout, experts, rows, cols, out, layout):
    return None


@torch.library.custom_op("csfmoe::expand_scales_routed", mutates_args=("out",))
def expand_scales_routed(
    fixed: torch.Tensor,
    exceptions: torch.Tensor,
    row_prefix: torch.Tensor,
    partition_index: torch.Tensor,
    format: str,
    src_layout: str,
    experts: int,
    rows: int,
    cols: int,
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    layout: str,
) -> None:
    """Rebuild only the experts listed in topk_ids (int32/int64, any shape;
    ids outside [0, E) are skipped) into `out`, which holds all E grids;
    other experts are left untouched."""
    _check_parts(fixed, exceptions, row_prefix, partition_index, format, src_layout, experts, rows, cols)
    _check_out(out, "out", layout, format, experts, rows, cols, fixed.device)
    _check_tensor(topk_ids, "topk_ids", INDEX_DTYPES, None, fixed.device)
    if fixed.device.type == "cpu":
        ids = topk_ids.reshape(-1)
        ids = ids[(ids >= 0) & (ids < experts)].to(torch.int32).contiguous()
        _C.decode(fixed, exceptions, row_prefix, partition_index, format, src_layout, experts, rows, cols,
                  _u8(out), layout, 0, False, ids)
        return
    _require_cuda_build("expand_scales_routed")
    _C.expand_routed(fixed, exceptions, row_prefix, partition_index, format, src_layout, experts, rows, cols,
                     topk_ids, _u8(out), layout, _stream(out.device))


@expand_scales_routed.register_fake
def _(fixed, exceptions, row_prefix, partition_index, format, src_layout, experts, rows, cols, topk_ids, out,
      layout):
    return None
