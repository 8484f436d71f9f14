"""csfmoe: lossless CSF compression of FP4 MoE block scales and fused MoE
ops for PyTorch. See docs/python.md."""

# torch first: on CUDA builds it loads the libcudart that _csfmoe shares.
import torch  # noqa: F401

from . import _csfmoe
from ._errors import (
    ERROR_CLASSES as _ERROR_CLASSES,
    CorruptData,
    CudaError,
    Error,
    FileMissing,
    FormatError,
    InvalidArgument,
    IoError,
    Unsupported,
)

_csfmoe._set_error_classes(list(_ERROR_CLASSES))

from . import ops  # noqa: E402  (registers torch.ops.csfmoe.*)
from .ops import geometry, native_shape  # noqa: E402
from .scales import CsfScales  # noqa: E402
from .quant import dequantize, quantize  # noqa: E402
from . import checkpoint  # noqa: E402
from .checkpoint import load_file, load_checkpoint  # noqa: E402

has_cuda = bool(_csfmoe.has_cuda)
has_moe = bool(_csfmoe.has_moe)

if has_moe:
    from . import moe  # noqa: E402,F401
    from .moe import *  # noqa: E402,F401,F403


def compress_scales(scales, format: str = "nvfp4", layout: str = "row_major", threads: int = 0) -> CsfScales:
    """Encode a native scale tensor [.., R, C] into CsfScales."""
    return CsfScales.compress(scales, format, layout, threads)


def decompress_scales(csf: CsfScales, layout=None, threads: int = 0):
    """Decode CsfScales on the CPU into a native tensor (validated)."""
    return csf.decompress(layout, threads)


def expand_scales(csf: CsfScales, out=None, layout=None, topk_ids=None):
    """Rebuild native grids on the parts' device into `out` (allocated if None)."""
    if out is None:
        out = csf.new_scratch(layout)
    return csf.expand_into(out, layout, topk_ids)


__version__ = _csfmoe.__version__  # CMakeLists.txt project() version
