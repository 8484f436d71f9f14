"""Fused MoE on the GPU against the pure-PyTorch reference, every scale
mode, and CUDA-graph capture through torch.cuda.graph."""

import pytest
import torch

import csfmoe
from test_moe_cpu import gpt_oss_biases, layer, routing
from torch_reference import moe as torch_moe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(not getattr(csfmoe._csfmoe, "has_moe_cuda", False), reason="no CUDA MoE in this build"),
]

# W4A16 kernels: BF16 products with FP32 accumulation vs float64.
TOL = 2e-2


def cuda_layer(L):
    return {k: v.cuda() for k, v in L.items()}


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("compression", ["none", "csf"])
def test_fused_moe_matches_torch(gen, fmt, compression):
    e, h, n, t, k = 8, 256, 128, 9, 2
    L = layer(gen, fmt, e, h, n)
    hidden = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    ids, wts = routing(gen, t, k, e)
    want = torch_moe(hidden, L["w13"], L["w13_scale"], L["w13_global"], L["w2"], L["w2_scale"], L["w2_global"],
                     ids, wts, fmt)
    p = csfmoe.prepare_experts(cuda_layer(L), topk=k, format=fmt, compression=compression)
    got = p(hidden.cuda(), ids.cuda(), wts.cuda())
    torch.cuda.synchronize()
    err = (got.cpu().double() - want).norm() / want.norm()
    assert err < TOL, err


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("where", ["cpu", "cuda"])
def test_csf_scales_prepared_as_they_are(gen, fmt, where):
    """CsfScales handed to a CSF layer are uploaded as they are (no decode,
    no re-encode): the same resident bytes and bitwise the same outputs as
    the layer that encodes the native scales on the device."""
    e, h, n, k = 8, 256, 128, 2
    L = layer(gen, fmt, e, h, n)
    dev = cuda_layer(L)
    csf = {key: csfmoe.compress_scales(L[key], fmt).to(where) for key in ("w13_scale", "w2_scale")}
    native = csfmoe.prepare_experts(dev, topk=k, format=fmt, compression="csf", max_tokens=64)
    given = csfmoe.prepare_experts({**dev, **csf}, topk=k, format=fmt, compression="csf", max_tokens=64)
    assert given.resident_scale_bytes() == native.resident_scale_bytes()
    for t in (1, 5, 64):
        hidden = torch.randn(t, h, generator=gen).to(torch.bfloat16).cuda()
        ids, wts = routing(gen, t, k, e)
        ids, wts = ids.cuda(), wts.cuda()
        assert torch.equal(given(hidden, ids, wts), native(hidden, ids, wts))
    bad = csfmoe.compress_scales(L["w2_scale"][:4], fmt)  # 4 experts for a layer of 8
    with pytest.raises(csfmoe.InvalidArgument, match="w2 CSF tensor has grid"):
        csfmoe.prepare_experts({**dev, **csf, "w2_scale": bad}, topk=k, format=fmt, compression="csf")


@pytest.mark.parametrize("fmt,order", [("nvfp4", "w13"), ("mxfp4", "w31")])
def test_gpt_oss_with_biases_matches_torch_in_every_mode(gen, fmt, order):
    """gpt-oss's clamped SwiGLU and expert biases in the kernels' epilogue and
    combine: decode (T = 3), grouped (T = 200) and every scale mode, against
    the float64 PyTorch formula; the scale modes bitwise equal."""
    e, h, n, k = 16, 256, 128, 4
    L = layer(gen, fmt, e, h, n, order)
    b13, b2 = gpt_oss_biases(gen, e, h, n)
    dev = {key: v.cuda() for key, v in L.items()}
    args = (dev["w13"], dev["w2"], dev["w13_scale"], dev["w2_scale"], dev["w13_global"], dev["w2_global"], fmt,
            order, k)
    kw = dict(activation="gpt_oss", w13_bias=b13.cuda(), w2_bias=b2.cuda(), max_tokens=256)
    for t in (3, 200):
        hidden = (torch.randn(t, h, generator=gen) * 2).to(torch.bfloat16)
        ids, wts = routing(gen, t, k, e)
        want = torch_moe(hidden, L["w13"], L["w13_scale"], L["w13_global"], L["w2"], L["w2_scale"],
                         L["w2_global"], ids, wts, fmt, order, "gpt_oss", 1.702, 7.0, b13, b2)
        hidden, ids, wts = hidden.cuda(), ids.cuda(), wts.cuda()
        base = csfmoe.PreparedExperts(*args, **kw)(hidden, ids, wts)
        err = (base.cpu().double() - want).norm() / want.norm()
        assert err < TOL, (t, err)
        for mode in ("stage_read", "routed"):
            got = csfmoe.PreparedExperts(*args, compression="csf", force_mode=mode, **kw)(hidden, ids, wts)
            if t < 64 or mode == "routed":  # the same kernel as native's: the same bits
                assert torch.equal(got, base), (t, mode)
            else:  # stage-read stays on the decode kernel
                assert (got.cpu().double() - want).norm() / want.norm() < TOL, (t, mode)
    with pytest.raises(csfmoe.InvalidArgument, match="w13_bias: expected a tensor on cuda"):
        csfmoe.PreparedExperts(*args, activation="gpt_oss", w13_bias=b13)


def test_scale_modes_bitwise_equal(gen):
    e, h, n, t, k = 8, 256, 128, 17, 2
    L = cuda_layer(layer(gen, "nvfp4", e, h, n))
    hidden = torch.randn(t, h, generator=gen).to(torch.bfloat16).cuda()
    ids, wts = (x.cuda() for x in routing(gen, t, k, e))
    base = csfmoe.prepare_experts(L, topk=k)(hidden, ids, wts)
    for mode in ("stage_read", "routed"):
        p = csfmoe.prepare_experts(L, topk=k, compression="csf", force_mode=mode)
        assert torch.equal(p(hidden, ids, wts), base), mode
    p = csfmoe.prepare_experts(L, topk=k, compression="csf", scales_expanded=True)
    side = torch.cuda.Stream()
    for blocks_per_sm in (0, 1):  # 1: one expansion block per SM (a background expansion)
        p.scratch[0].fill_(0xFF)
        p.scratch[1].fill_(0xFF)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            p.expand_scales(blocks_per_sm=blocks_per_sm)
        torch.cuda.current_stream().wait_stream(side)
        assert torch.equal(p(hidden, ids, wts), base), blocks_per_sm


def test_graph_capture(gen):
    e, h, n, t, k = 8, 256, 128, 4, 2
    L = cuda_layer(layer(gen, "nvfp4", e, h, n))
    p = csfmoe.prepare_experts(L, topk=k, compression="csf")
    hidden = torch.randn(t, h, generator=gen).to(torch.bfloat16).cuda()
    ids, wts = (x.cuda() for x in routing(gen, t, k, e))
    eager = p(hidden, ids, wts)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = p(hidden, ids, wts)
    # New inputs in the same buffers, then replay.
    hidden.copy_(torch.randn(t, h, generator=gen).to(torch.bfloat16))
    g.replay()
    again = p(hidden, ids, wts)
    torch.cuda.synchronize()
    assert torch.equal(out, again)
    assert not torch.equal(out, eager)


def test_gpu_rejections(gen):
    L = cuda_layer(layer(gen, "nvfp4", 4, 128, 64))
    p = csfmoe.prepare_experts(L, topk=2)
    hidden = torch.randn(3, 128).to(torch.bfloat16).cuda()
    ids, wts = (x.cuda() for x in routing(gen, 3, 2, 4))
    with pytest.raises(csfmoe.InvalidArgument, match="hidden: dtype"):
        p(hidden.float(), ids, wts)
    with pytest.raises(csfmoe.InvalidArgument, match="expected a tensor on cuda"):
        p(hidden, ids.cpu(), wts)
