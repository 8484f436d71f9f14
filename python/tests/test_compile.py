"""The ops are real torch.library ops: opcheck (schema, fake impl, dispatch)
and torch.compile tracing through the fake implementations."""

import pytest
import torch

import csfmoe
from conftest import realistic_scales


def test_opcheck_decompress_and_expand(gen):
    x = realistic_scales(gen, (2, 128, 8))
    csf = csfmoe.compress_scales(x)
    args = (*csf.parts, "nvfp4", "row_major", 2, 128, 8)
    torch.library.opcheck(torch.ops.csfmoe.decompress_scales.default, (*args, "row_major"))
    torch.library.opcheck(torch.ops.csfmoe.expand_scales.default, (*args, torch.empty_like(x), "row_major"))
    ids = torch.tensor([1, 0, 1], dtype=torch.int32)
    torch.library.opcheck(torch.ops.csfmoe.expand_scales_routed.default,
                          (*args, ids, torch.zeros_like(x), "row_major"))


def test_fake_compress_has_dynamic_exception_count(gen):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(shape_env=ShapeEnv()):
        x = torch.empty(3, 256, 16, dtype=torch.uint8)
        fixed, exc, rp, pi = torch.ops.csfmoe.compress_scales(x, "nvfp4", "row_major", 0)
        g = csfmoe.geometry("nvfp4", "row_major", 3, 256, 16)
        assert fixed.shape == (g["fixed_bytes"],)
        assert rp.shape == (g["row_prefix_len"],) and pi.shape == (g["partition_index_len"],)
        assert isinstance(exc.shape[0], torch.SymInt)


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_compile_fullgraph(gen, backend):
    x = realistic_scales(gen, (3, 128, 16))
    csf = csfmoe.compress_scales(x)
    scratch = torch.zeros_like(x)

    def step(fixed, exceptions, row_prefix, partition_index, out, h):
        torch.ops.csfmoe.expand_scales(fixed, exceptions, row_prefix, partition_index, "nvfp4", "row_major",
                                       3, 128, 16, out, "row_major")
        return h * 2 + out.to(torch.float32).sum()

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    h = torch.randn(4, generator=gen)
    got = compiled(*csf.parts, scratch, h)
    assert torch.equal(scratch, x)
    assert torch.allclose(got, h * 2 + x.to(torch.float32).sum())
