"""CPU codec ops against a pure-PyTorch reference of the CSF row encoding."""

import pytest
import torch

import csfmoe
from csfmoe import CsfScales, ops
from conftest import adversarial_scales, realistic_scales

WIN = {"nvfp4": 16, "mxfp4": 2}


def reference_records(grid: torch.Tensor, fmt: str, padded_cols: int, padded_rows: int):
    """Per expert: (base per row, sorted exception records) per the format
    notes: smallest base with the most bytes in [b, b + W)."""
    w = WIN[fmt]
    e, r, c = grid.shape
    g = grid.to(torch.int64).reshape(e * r, c)
    hist = torch.zeros(e * r, 256, dtype=torch.int64)
    hist.scatter_add_(1, g, torch.ones_like(g))
    csum = torch.cat([torch.zeros(e * r, 1, dtype=torch.int64), hist.cumsum(1)], 1)
    counts = csum[:, w:257] - csum[:, 0 : 257 - w]  # counts[b] = bytes in [b, b + w)
    base = counts.argmax(1)  # argmax returns the first maximum: lowest base wins
    inside = (g >= base[:, None]) & (g < base[:, None] + w)
    recs = []
    for ex in range(e):
        rows_ex = slice(ex * r, (ex + 1) * r)
        rr, cc = torch.nonzero(~inside[rows_ex], as_tuple=True)
        vals = g[rows_ex][rr, cc]
        pos = rr * padded_cols + cc
        recs.append(((vals << 24) | pos).tolist())
    return base.reshape(e, r), recs


def records_of(csf: CsfScales):
    x = csf.exceptions.to(torch.int64) & 0xFFFFFFFF
    rp = csf.row_prefix.to(torch.int64) & 0xFFFFFFFF
    g = csf.geometry
    out = []
    for ex in range(csf.experts):
        lo = int(rp[ex * g["padded_rows"]])
        hi = int(rp[(ex + 1) * g["padded_rows"]])
        out.append(x[lo:hi].tolist())
    return out


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("kind", ["realistic", "adversarial"])
def test_row_major_matches_reference(gen, fmt, kind):
    e = int(torch.randint(1, 4, (1,), generator=gen))
    r = int(torch.randint(1, 300, (1,), generator=gen))
    c = int(torch.randint(1, 70, (1,), generator=gen))
    make = realistic_scales if kind == "realistic" else adversarial_scales
    x = make(gen, (e, r, c)) if kind == "adversarial" else make(gen, (e, r, c), band=WIN[fmt])
    csf = csfmoe.compress_scales(x, fmt)
    g = csf.geometry
    assert csf.fixed.numel() == g["fixed_bytes"]
    _, ref = reference_records(x, fmt, g["padded_cols"], g["padded_rows"])
    assert records_of(csf) == ref
    assert torch.equal(csf.decompress(), x)
    assert torch.equal(csfmoe.decompress_scales(csf), x)


@pytest.mark.parametrize("dtype_name", ["float8_e4m3fn", "float8_e8m0fnu", "uint8", "int8"])
def test_dtype_and_shape_preserved(gen, dtype_name):
    dtype = getattr(torch, dtype_name)
    fmt = "mxfp4" if dtype_name == "float8_e8m0fnu" else "nvfp4"
    x = realistic_scales(gen, (2, 3, 128, 8)).view(dtype)  # leading dims are experts
    csf = csfmoe.compress_scales(x, fmt)
    assert csf.grid == (6, 128, 8)
    y = csf.decompress()
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y.view(torch.uint8), x.view(torch.uint8))


def swizzle(grid: torch.Tensor) -> torch.Tensor:
    """[E, Rp, Cp] logical padded grid -> bytes in the 128x4 swizzle."""
    e, rp, cp = grid.shape
    r = torch.arange(rp)[:, None]
    c = torch.arange(cp)[None, :]
    idx = ((r // 128) * (cp // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)
    out = torch.empty(e, rp * cp, dtype=grid.dtype)
    out[:, idx.reshape(-1)] = grid.reshape(e, -1)
    return out.reshape(e, rp, cp)


def test_swizzled_source_roundtrip_and_row_major_view(gen):
    e, rp, cp = 2, 256, 12
    logical = realistic_scales(gen, (e, rp, cp))
    sw = swizzle(logical)
    csf = csfmoe.compress_scales(sw, "nvfp4", "swizzled_128x4")
    assert torch.equal(csf.decompress(), sw)
    assert torch.equal(csf.decompress("row_major"), logical)


def test_row_major_source_to_swizzled(gen):
    e, r, c = 2, 100, 6  # pads to 128 x 8
    x = realistic_scales(gen, (e, r, c))
    csf = csfmoe.compress_scales(x, "nvfp4")
    sw = csf.decompress("swizzled_128x4")
    assert sw.shape == (e, 128, 8)
    base, _ = reference_records(x, "nvfp4", 8, 128)
    # Undo the swizzle: true positions hold the source, column padding the
    # row's base, padded rows zero.
    rr = torch.arange(128)[:, None]
    cc = torch.arange(8)[None, :]
    idx = ((rr // 128) * 2 + cc // 4) * 512 + (rr % 32) * 16 + ((rr % 128) // 32) * 4 + (cc % 4)
    logical = sw.reshape(e, -1)[:, idx.reshape(-1)].reshape(e, 128, 8)
    assert torch.equal(logical[:, :r, :c], x)
    assert torch.equal(logical[:, :r, c:], base.to(torch.uint8)[:, :, None].expand(e, r, 8 - c))
    assert not logical[:, r:, :].any()


def test_expand_cpu_all_and_routed(gen):
    e, r, c = 5, 128, 16
    x = realistic_scales(gen, (e, r, c))
    csf = csfmoe.compress_scales(x, "nvfp4")
    assert torch.equal(csfmoe.expand_scales(csf), x)
    out = torch.full_like(x, 0xAA)
    ids = torch.tensor([[3, 1], [3, 99]], dtype=torch.int64)  # 99 is out of range: skipped
    csfmoe.expand_scales(csf, out, topk_ids=ids)
    for ex in range(e):
        if ex in (1, 3):
            assert torch.equal(out[ex], x[ex])
        else:
            assert (out[ex] == 0xAA).all()


def test_stats(gen):
    x = realistic_scales(gen, (2, 128, 16), exception_rate=0.02)
    csf = csfmoe.compress_scales(x, "nvfp4")
    s = csf.stats()
    assert s["exceptions"] == csf.exceptions.numel()
    assert s["encoded_bytes"] == csf.nbytes
    assert s["source_bytes"] == x.numel()
