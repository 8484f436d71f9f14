"""csfmoe.quantize / dequantize against the recipes written out in PyTorch,
and the quantized experts through the C++ reference."""

import pytest
import torch

import csfmoe
from torch_reference import dequantize as torch_dequantize
from torch_reference import moe as torch_moe

E2M1_POS = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_quantize_round_trip_error_and_recipe(gen, fmt):
    e, r, k = 3, 24, 128
    g = 16 if fmt == "nvfp4" else 32
    x = torch.randn(e, r, k, generator=gen) * torch.rand(e, 1, 1, generator=gen) * 10
    q = csfmoe.quantize(x.to(torch.bfloat16) if fmt == "mxfp4" else x, fmt)
    src = (x.to(torch.bfloat16) if fmt == "mxfp4" else x).double()
    assert q["packed"].shape == (e, r, k // 2) and q["scales"].shape == (e, r, k // g)
    assert q["packed"].dtype == q["scales"].dtype == torch.uint8 and q["global"].dtype == torch.float32
    if fmt == "nvfp4":
        torch.testing.assert_close(q["global"], (x.abs().amax((1, 2)) / (6 * 448)).float(), rtol=0, atol=0)
    else:
        assert torch.equal(q["global"], torch.ones(e))
    d = csfmoe.dequantize(q["packed"], q["scales"], q["global"], fmt)
    assert d.dtype == torch.float64
    assert torch.equal(d, torch_dequantize(q["packed"], q["scales"], q["global"], fmt))
    # Every element is an E2M1 value nearest to x / block scale (saturated at
    # 6), with x's sign. The scales come back through an all-ones code (0x22).
    scale = csfmoe.dequantize(torch.full((e, r, k // 2), 0x22, dtype=torch.uint8), q["scales"], q["global"], fmt)
    y, v = src / scale, d / scale
    assert bool(torch.isin(v.abs(), E2M1_POS).all())
    nearest = (y.abs().clamp(max=6.0)[..., None] - E2M1_POS).abs().min(-1).values
    chosen = (y.abs().clamp(max=6.0) - v.abs()).abs()
    assert bool((chosen <= nearest + 1e-6 * y.abs()).all())
    assert bool(((v == 0) | (torch.sign(v) == torch.sign(y))).all())
    err = ((d - src).norm() / src.norm()).item()
    assert 0.01 < err < 0.2


def test_quantize_refuses_bad_input():
    with pytest.raises(csfmoe.InvalidArgument, match="multiple of the nvfp4 group size 16"):
        csfmoe.quantize(torch.randn(2, 4, 24), "nvfp4")
    with pytest.raises(csfmoe.InvalidArgument, match=r"\[E, R, K\]"):
        csfmoe.quantize(torch.randn(4, 32), "mxfp4")
    with pytest.raises(csfmoe.InvalidArgument, match="NaN"):
        csfmoe.quantize(torch.full((1, 2, 32), float("nan")), "mxfp4")
    with pytest.raises(csfmoe.InvalidArgument, match="format"):
        csfmoe.quantize(torch.randn(1, 2, 32), "fp8")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_quantized_experts_run_the_reference(gen, fmt):
    e, h, n, t, k = 4, 128, 64, 6, 2
    q13 = csfmoe.quantize(torch.randn(e, 2 * n, h, generator=gen) / h**0.5, fmt)
    q2 = csfmoe.quantize(torch.randn(e, h, n, generator=gen) / n**0.5, fmt)
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    w = torch.softmax(torch.randn(t, k, generator=gen), 1)
    args = (q13["packed"], q13["scales"], q13["global"], q2["packed"], q2["scales"], q2["global"])
    got = torch.ops.csfmoe.moe_reference(x, *args, ids, w, fmt, "w13", 0)
    want = torch_moe(x, *args, ids, w, fmt)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
