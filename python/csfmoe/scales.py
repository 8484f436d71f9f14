"""CsfScales: the CSF parts of one scale tensor plus the geometry to use them."""

from __future__ import annotations

import dataclasses
import zlib
from typing import Optional, Sequence, Tuple, Union

import torch

from . import _csfmoe as _C
from . import ops
from ._errors import CorruptData, InvalidArgument

_DTYPE_BY_NAME = {
    "U8": torch.uint8,
    "I8": torch.int8,
    "F8_E4M3": getattr(torch, "float8_e4m3fn", torch.uint8),
    "F8_E8M0": getattr(torch, "float8_e8m0fnu", torch.uint8),
}


@dataclasses.dataclass(repr=False)
class CsfScales:
    """A CSF-encoded block-scale tensor.

    fixed / exceptions / row_prefix / partition_index are 1-D tensors on one
    device (see csfmoe.ops). `dtype` and `shape` describe the native tensor
    (e.g. float8_e4m3fn [E, 2N, H/16] for ModelOpt NVFP4 w13); the grid is
    (experts, rows, cols) with leading dims multiplied into experts.
    """

    fixed: torch.Tensor
    exceptions: torch.Tensor
    row_prefix: torch.Tensor
    partition_index: torch.Tensor
    format: str
    layout: str  # layout of the source bytes
    experts: int
    rows: int
    cols: int
    dtype: torch.dtype = torch.uint8
    shape: Optional[Tuple[int, ...]] = None  # native shape in `layout`; default (E, R, C)
    validated: bool = False  # the host parts passed csfmoe::validate
    # CRC32 of the native tensor in `layout` (from a container), checked by
    # decompress() to that layout; `origin` names it in errors ("file: tensor 'x'").
    crc32: Optional[int] = None
    origin: Optional[str] = None

    def __post_init__(self) -> None:
        ops._check_parts(self.fixed, self.exceptions, self.row_prefix, self.partition_index, self.format,
                         self.layout, self.experts, self.rows, self.cols)
        if self.shape is None:
            self.shape = ops.native_shape(self.layout, self.format, self.experts, self.rows, self.cols)
        self.shape = tuple(int(s) for s in self.shape)

    def __repr__(self) -> str:
        # Short on purpose: the parts can hold megabytes.
        src = self.source_nbytes
        ratio = f"{100.0 * self.nbytes / src:.1f}%" if src else "n/a"
        dtype = str(self.dtype).replace("torch.", "")
        return (f"CsfScales({self.format}, {self.layout}, shape={list(self.shape)}, dtype={dtype}, "
                f"stored={self.nbytes} of {src} bytes ({ratio}), device={self.device})")

    # -- construction -------------------------------------------------------
    @classmethod
    def compress(cls, scales: torch.Tensor, format: str = "nvfp4", layout: str = "row_major",
                 threads: int = 0) -> "CsfScales":
        """Encode a native scale tensor [.., R, C] (CPU or CUDA)."""
        ops._check_tensor(scales, "scales", ops.BYTE_DTYPES)
        e, r, c = ops._grid_of(scales)
        parts = torch.ops.csfmoe.compress_scales(scales, format, layout, threads)
        # Parts this process just encoded are valid by construction.
        return cls(*parts, format=format, layout=layout, experts=e, rows=r, cols=c, dtype=scales.dtype,
                   shape=tuple(scales.shape), validated=True)

    # -- properties ---------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.fixed.device

    @property
    def parts(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return (self.fixed, self.exceptions, self.row_prefix, self.partition_index)

    @property
    def grid(self) -> Tuple[int, int, int]:
        return (self.experts, self.rows, self.cols)

    @property
    def geometry(self) -> dict:
        return ops.geometry(self.format, self.layout, self.experts, self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        """Encoded bytes (all four parts)."""
        return sum(t.numel() * t.element_size() for t in self.parts)

    @property
    def source_nbytes(self) -> int:
        return self.geometry["native_bytes_" + self.layout]

    def native_shape(self, layout: Optional[str] = None) -> Tuple[int, ...]:
        """Shape of the decoded tensor: the source shape for the source layout,
        else [E, R', C'] of that layout."""
        layout = layout or self.layout
        if layout == self.layout:
            return self.shape
        return ops.native_shape(layout, self.format, self.experts, self.rows, self.cols)

    def _args(self):
        return (*self.parts, self.format, self.layout, self.experts, self.rows, self.cols)

    # -- checks and moves ---------------------------------------------------
    def validate(self) -> "CsfScales":
        """Full structural check of the parts (FormatError on the first
        violation). Device parts are copied to the host for it."""
        host = [t.cpu() for t in self.parts]
        _C.validate(*host, self.format, self.layout, self.experts, self.rows, self.cols)
        self.validated = True
        return self

    def to(self, device: Union[str, torch.device], non_blocking: bool = False) -> "CsfScales":
        """Copy to `device`. Parts are validated first when they leave the
        host unvalidated, since the device kernels trust their contents."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device == self.device:
            return self
        if not self.validated:
            self.validate()
        moved = [t.to(device, non_blocking=non_blocking) for t in self.parts]
        return dataclasses.replace(self, fixed=moved[0], exceptions=moved[1], row_prefix=moved[2],
                                   partition_index=moved[3])

    def cuda(self, device=None, non_blocking: bool = False) -> "CsfScales":
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif isinstance(device, int):
            device = torch.device("cuda", device)
        return self.to(device, non_blocking)

    def stats(self) -> dict:
        host = [t.cpu() for t in self.parts]
        return dict(_C.stats(*host, self.format, self.layout, self.experts, self.rows, self.cols))

    # -- decoding -----------------------------------------------------------
    def _view(self, raw: torch.Tensor, layout: str) -> torch.Tensor:
        return raw.view(self.dtype).reshape(self.native_shape(layout))

    def decompress(self, layout: Optional[str] = None, threads: int = 0) -> torch.Tensor:
        """Decode on the CPU (validating unless already validated) into a new
        tensor of the native dtype and shape."""
        layout = layout or self.layout
        host = [t.cpu() for t in self.parts]
        raw = torch.ops.csfmoe.decompress_scales(*host, self.format, self.layout, self.experts, self.rows,
                                                 self.cols, layout, threads, self.validated)
        if self.crc32 is not None and layout == self.layout:
            got = zlib.crc32(raw.numpy())
            if got != self.crc32:
                raise CorruptData(f"{self.origin or 'CsfScales'}: CRC32 of the decoded tensor is {got:08x}, "
                                  f"expected {self.crc32:08x}")
        return self._view(raw, layout)

    def new_scratch(self, layout: Optional[str] = None) -> torch.Tensor:
        """An uninitialized native tensor on this device for expand_into."""
        layout = layout or self.layout
        raw = torch.empty(self.native_shape(layout), dtype=torch.uint8, device=self.device)
        return raw.view(self.dtype)

    def expand_into(self, out: torch.Tensor, layout: Optional[str] = None,
                    topk_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Rebuild the native grids into caller-owned `out` on this device
        (all experts, or only those in topk_ids). On CUDA this runs on the
        current stream without allocating or synchronizing."""
        layout = layout or self.layout
        if topk_ids is None:
            torch.ops.csfmoe.expand_scales(*self._args(), out, layout)
        else:
            torch.ops.csfmoe.expand_scales_routed(*self._args(), topk_ids, out, layout)
        return out

    def expand(self, layout: Optional[str] = None) -> torch.Tensor:
        """expand_into a new tensor on this device."""
        layout = layout or self.layout
        return self.expand_into(self.new_scratch(layout), layout)
