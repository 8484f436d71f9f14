"""Bad inputs are rejected before any work, as csfmoe exceptions carrying the
C++ message; corrupted parts are FormatError."""

import pytest
import torch

import csfmoe
from csfmoe import _csfmoe as _C
from conftest import realistic_scales


def test_python_side_rejections(gen):
    x = realistic_scales(gen, (2, 128, 8))
    with pytest.raises(csfmoe.InvalidArgument, match="scales: dtype"):
        csfmoe.compress_scales(x.to(torch.float32))
    with pytest.raises(ValueError, match="not contiguous"):
        csfmoe.compress_scales(x.transpose(1, 2))
    with pytest.raises(ValueError, match="format must be one of"):
        csfmoe.compress_scales(x, "fp8")
    with pytest.raises(ValueError, match=r"expected \[\.\., rows, cols\]"):
        csfmoe.compress_scales(x.reshape(-1))
    csf = csfmoe.compress_scales(x)
    with pytest.raises(ValueError, match="out: expected 2048 bytes"):
        csfmoe.expand_scales(csf, torch.empty(2, 128, 7, dtype=torch.uint8))
    with pytest.raises(ValueError, match="topk_ids: dtype"):
        csfmoe.expand_scales(csf, torch.empty_like(x), topk_ids=torch.zeros(3, dtype=torch.float32))
    with pytest.raises(ValueError, match="row_prefix: expected 257 elements"):
        csfmoe.CsfScales(csf.fixed, csf.exceptions, csf.row_prefix[:-1], csf.partition_index, "nvfp4",
                         "row_major", 2, 128, 8)
    if hasattr(torch, "float8_e4m3fn"):
        with pytest.raises(ValueError, match="fixed: dtype"):
            torch.ops.csfmoe.decompress_scales(csf.fixed.to(torch.int32), *csf.parts[1:], "nvfp4", "row_major",
                                               2, 128, 8, "row_major")


def test_cpp_errors_are_translated():
    # Straight to the bindings: the C++ checks and messages.
    with pytest.raises(csfmoe.InvalidArgument) as ei:
        _C.geometry("nvfp4", "swizzled_128x4", 1, 100, 8)
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, csfmoe.Error)
    assert "128" in str(ei.value)
    with pytest.raises(csfmoe.InvalidArgument, match="unknown|nvfp4|format"):
        _C.geometry("nvfp5", "row_major", 1, 128, 8)
    src = torch.zeros(100, dtype=torch.uint8)
    with pytest.raises(csfmoe.InvalidArgument):
        _C.encode(src, "nvfp4", "row_major", 1, 128, 8, 0)
    with pytest.raises(csfmoe.InvalidArgument, match="expected 1-byte elements"):
        _C.encode(torch.zeros(1024, dtype=torch.int32), "nvfp4", "row_major", 1, 128, 8, 0)
    with pytest.raises(csfmoe.IoError):
        csfmoe.load_file("/nonexistent/dir/x.safetensors")


def test_corrupt_parts_are_format_errors(gen):
    x = realistic_scales(gen, (3, 128, 16), exception_rate=0.05)
    csf = csfmoe.compress_scales(x)
    assert csf.exceptions.numel() > 2
    # A prefix that runs backwards.
    rp = csf.row_prefix.clone()
    k = int(torch.randint(1, rp.numel() - 1, (1,), generator=gen))
    rp[k] = rp[-1] + 1
    bad = csfmoe.CsfScales(csf.fixed, csf.exceptions, rp, csf.partition_index, "nvfp4", "row_major", 3, 128, 16)
    with pytest.raises(csfmoe.FormatError) as ei:
        bad.decompress()
    assert "row_prefix" in str(ei.value) or "partition" in str(ei.value)
    with pytest.raises(csfmoe.FormatError):
        bad.validate()
    # An exception record whose value lies inside its row's window.
    ex = csf.exceptions.clone()
    rec = int(ex[0]) & 0xFFFFFFFF
    pos = rec & 0xFFFFFF
    row = pos // csf.geometry["padded_cols"]
    base = int(_row_bases(x[0])[row])
    ex[0] = torch.tensor(((base << 24) | pos) - (1 << 32) if base >= 128 else (base << 24) | pos)
    bad = csfmoe.CsfScales(csf.fixed, ex, csf.row_prefix, csf.partition_index, "nvfp4", "row_major", 3, 128, 16)
    with pytest.raises(csfmoe.FormatError, match="exception"):
        bad.validate()
    # Moving unvalidated bad parts to a device validates first.
    with pytest.raises(csfmoe.FormatError):
        bad.to("meta")


def _row_bases(grid):
    g = grid.to(torch.int64)
    hist = torch.zeros(g.shape[0], 256, dtype=torch.int64).scatter_add_(1, g, torch.ones_like(g))
    csum = torch.cat([torch.zeros(g.shape[0], 1, dtype=torch.int64), hist.cumsum(1)], 1)
    return (csum[:, 16:257] - csum[:, :241]).argmax(1)
