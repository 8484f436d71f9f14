"""The CPU reference MoE op against the pure-PyTorch reference in the tests."""

import pytest
import torch

import csfmoe
from torch_reference import moe as torch_moe

pytestmark = pytest.mark.skipif(not csfmoe.has_moe, reason="this build has no MoE API")


def layer(gen, fmt, e, h, n, order="w13", fast=False):
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    w = csfmoe._csfmoe.synthetic_moe_weights(fmt, e, h, n, 2, order, seed, fast)
    g = 16 if fmt == "nvfp4" else 32
    sdt = torch.float8_e4m3fn if fmt == "nvfp4" else torch.uint8
    return {
        "w13": w["w13"].reshape(e, 2 * n, h // 2),
        "w13_scale": w["w13_scale"].reshape(e, 2 * n, h // g).view(sdt),
        "w13_global": w["w13_global"],
        "w2": w["w2"].reshape(e, h, n // 2),
        "w2_scale": w["w2_scale"].reshape(e, h, n // g).view(sdt),
        "w2_global": w["w2_global"],
    }


def routing(gen, t, k, e):
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
    ids[0, -1] = ids[0, 0]  # a duplicate slot adds its own contribution
    w = torch.rand(t, k, generator=gen)
    return ids, (w / w.sum(1, keepdim=True)).to(torch.float32)


@pytest.mark.parametrize("fmt,order", [("nvfp4", "w13"), ("mxfp4", "w31")])
def test_reference_op_matches_torch(gen, fmt, order):
    e, h, n, t, k = 4, 128, 64, 5, 2
    L = layer(gen, fmt, e, h, n, order)
    hidden = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    ids, wts = routing(gen, t, k, e)
    got = torch.ops.csfmoe.moe_reference(hidden, L["w13"], L["w13_scale"], L["w13_global"], L["w2"],
                                         L["w2_scale"], L["w2_global"], ids, wts, fmt, order, 0)
    want = torch_moe(hidden, L["w13"], L["w13_scale"], L["w13_global"], L["w2"], L["w2_scale"], L["w2_global"],
                     ids, wts, fmt, order)
    err = (got.double() - want).norm() / want.norm()
    assert err < 1e-6, err


def test_prepared_experts_csf_equals_native(gen):
    e, h, n, t = 4, 128, 64, 3
    L = layer(gen, "nvfp4", e, h, n)
    hidden = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    ids, wts = routing(gen, t, 2, e)
    native = csfmoe.prepare_experts(L, topk=2)
    csf = csfmoe.prepare_experts(L, topk=2, compression="csf")
    assert isinstance(csf.w13_scale, csfmoe.CsfScales)
    a = native(hidden, ids, wts)
    b = csf(hidden, ids, wts)
    assert a.dtype == torch.bfloat16 and torch.equal(a, b)


def test_expand_scales_blocks_per_sm_checked(gen):
    L = layer(gen, "nvfp4", 2, 128, 64)
    p = csfmoe.prepare_experts(L, topk=2, compression="csf", scales_expanded=True)
    p.expand_scales()  # CPU layers read their CSF scales directly: nothing to expand
    p.expand_scales(blocks_per_sm=1)
    for bad in (-1, 1 << 16, 1.0, True, "1"):
        with pytest.raises(csfmoe.InvalidArgument, match="blocks_per_sm"):
            p.expand_scales(blocks_per_sm=bad)


def test_moe_rejections(gen):
    e, h, n = 2, 128, 64
    L = layer(gen, "nvfp4", e, h, n)
    hidden = torch.randn(2, h, generator=gen).to(torch.bfloat16)
    ids, wts = routing(gen, 2, 2, e)
    args = [L["w13"], L["w13_scale"], L["w13_global"], L["w2"], L["w2_scale"], L["w2_global"]]
    with pytest.raises(csfmoe.InvalidArgument, match="hidden: dtype"):
        torch.ops.csfmoe.moe_reference(hidden.float(), *args, ids, wts)
    with pytest.raises(csfmoe.InvalidArgument, match="w2: expected shape"):
        bad = list(args)
        bad[3] = bad[3][:, :64].contiguous()
        torch.ops.csfmoe.moe_reference(hidden, *bad, ids, wts)
    bad_ids = ids.clone()
    bad_ids[1, 1] = e  # out of range: the C++ reference names token and slot
    with pytest.raises(csfmoe.InvalidArgument, match=r"topk_ids\[1, 1\]"):
        torch.ops.csfmoe.moe_reference(hidden, *args, bad_ids, wts)
    with pytest.raises(csfmoe.InvalidArgument, match="multiple|hidden|64"):
        csfmoe.plan_moe("nvfp4", 4, 100, 64, 2)


def gpt_oss_biases(gen, e, h, n):
    """Expert biases as gpt-oss's: a quarter of the gate/up ones large enough
    to push their outputs past the clamp limit."""
    b13 = torch.randn(e, 2 * n, generator=gen) * 0.5
    big = torch.rand(e, 2 * n, generator=gen) < 0.25
    b13[big] = torch.empty(int(big.sum())).uniform_(-12, 12, generator=gen)
    return b13.float(), (torch.randn(e, h, generator=gen) * 0.5).float()


@pytest.mark.parametrize("fmt,order", [("nvfp4", "w13"), ("mxfp4", "w31")])
def test_reference_op_gpt_oss_with_biases_matches_torch(gen, fmt, order):
    e, h, n, t, k = 4, 128, 64, 6, 2
    L = layer(gen, fmt, e, h, n, order)
    hidden = (torch.randn(t, h, generator=gen) * 2).to(torch.bfloat16)
    ids, wts = routing(gen, t, k, e)
    b13, b2 = gpt_oss_biases(gen, e, h, n)
    args = (hidden, L["w13"], L["w13_scale"], L["w13_global"], L["w2"], L["w2_scale"], L["w2_global"], ids, wts)
    for alpha, limit, biases in ((1.702, 7.0, (b13, b2)), (0.9, 3.0, (b13, None)), (1.702, 7.0, (None, None))):
        got = torch.ops.csfmoe.moe_reference(*args, fmt, order, 0, "gpt_oss", alpha, limit, *biases)
        want = torch_moe(*args, fmt, order, "gpt_oss", alpha, limit, *biases)
        err = (got.double() - want).norm() / want.norm()
        assert err < 1e-6, (alpha, limit, err)
    silu = torch_moe(*args, fmt, order)
    assert (want - silu).norm() > 0.1 * silu.norm()  # the activation matters on these inputs
    # PreparedExperts and fused_moe on the CPU take the same arguments.
    p = csfmoe.PreparedExperts(L["w13"], L["w2"], L["w13_scale"], L["w2_scale"], L["w13_global"], L["w2_global"],
                               fmt, order, k, compression="csf", activation="gpt_oss", w13_bias=b13, w2_bias=b2)
    want = torch_moe(*args, fmt, order, "gpt_oss", 1.702, 7.0, b13, b2)
    assert ((p(hidden, ids, wts).double() - want).norm() / want.norm()).item() < 4e-3


def test_gpt_oss_arguments_checked(gen):
    e, h, n = 4, 128, 64
    L = layer(gen, "nvfp4", e, h, n)
    b13, b2 = gpt_oss_biases(gen, e, h, n)
    args = (L["w13"], L["w2"], L["w13_scale"], L["w2_scale"], L["w13_global"], L["w2_global"], "nvfp4", "w13", 2)
    with pytest.raises(csfmoe.InvalidArgument, match="w13_bias: expert biases are for the gpt_oss activation"):
        csfmoe.PreparedExperts(*args, w13_bias=b13)
    with pytest.raises(csfmoe.InvalidArgument, match=r"w2_bias: expected shape \[4, 128\]"):
        csfmoe.PreparedExperts(*args, activation="gpt_oss", w2_bias=b2[:, :64].contiguous())
    with pytest.raises(csfmoe.InvalidArgument, match="w13_bias: dtype"):
        csfmoe.PreparedExperts(*args, activation="gpt_oss", w13_bias=b13.half())
    with pytest.raises(csfmoe.InvalidArgument, match="alpha"):
        csfmoe.PreparedExperts(*args, activation="gpt_oss", alpha=float("nan"))
    with pytest.raises(csfmoe.InvalidArgument, match="limit"):
        csfmoe.plan_moe("nvfp4", e, h, n, 2, activation="gpt_oss", limit=0.0)
    with pytest.raises(csfmoe.InvalidArgument, match="activation"):
        csfmoe.PreparedExperts(*args, activation="swiglu")


def _gpt_oss_formula(gate, up, alpha=1.702, limit=7.0):
    """transformers' GptOssExperts activation, written out in float64."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


EDGES = [0.0, -0.0, 1e-300, 6.999, 7.0, 7.001, -7.0, -7.001, 8.5, -8.5, 100.0, -100.0, 1e6, -1e6, 745.0, -745.0,
         1.0, -1.0, float("nan")]


def test_moe_activation_is_the_library_one(gen):
    """csfmoe.moe.moe_activation (the C++ activation through the binding)
    against the straightforward float64 formulas: random values, many past
    the clamp, and the edges (zeros, large negatives, NaN)."""
    n = 96
    x = torch.randn(64, 2 * n, generator=gen, dtype=torch.float64) * 6
    edges = torch.tensor(EDGES, dtype=torch.float64)
    pairs = torch.cartesian_prod(edges, edges)  # [P, 2]: (gate, up)
    cases = [x, torch.cat((pairs[:, :1], pairs[:, 1:]), dim=1)]
    for gu in cases:
        h = gu.shape[-1] // 2
        gate, up = gu[..., :h], gu[..., h:]
        got = csfmoe.moe.moe_activation(gu, "gpt_oss")
        torch.testing.assert_close(got, _gpt_oss_formula(gate, up), rtol=1e-13, atol=1e-300, equal_nan=True)
        got = csfmoe.moe.moe_activation(gu, "gpt_oss", 0.5, 3.0)
        torch.testing.assert_close(got, _gpt_oss_formula(gate, up, 0.5, 3.0), rtol=1e-13, atol=1e-300,
                                   equal_nan=True)
        got = csfmoe.moe.moe_activation(gu, "silu")
        torch.testing.assert_close(got, gate * torch.sigmoid(gate) * up, rtol=1e-13, atol=1e-300, equal_nan=True)
    assert (x.abs() > 7).any()  # the random case reaches past the clamp
    with pytest.raises(csfmoe.InvalidArgument, match="activation"):
        csfmoe.moe.moe_activation(x, "swiglu")
    with pytest.raises(csfmoe.InvalidArgument, match="limit"):
        csfmoe.moe.moe_activation(x, "gpt_oss", 1.702, -1.0)
    with pytest.raises(csfmoe.InvalidArgument, match="2N"):
        csfmoe.moe.moe_activation(x[:, :-1], "gpt_oss")
