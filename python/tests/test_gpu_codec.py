"""CUDA codec ops (expand all / routed, device encode) against the CPU codec
and the source bytes, including capture in a CUDA graph."""

import pytest
import torch

import csfmoe
from conftest import adversarial_scales, realistic_scales

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(not csfmoe.has_cuda, reason="csfmoe built without CUDA"),
]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("kind", ["realistic", "adversarial"])
def test_expand_all_matches_source(gen, fmt, kind):
    e, r, c = 6, int(torch.randint(1, 400, (1,), generator=gen)), int(torch.randint(1, 40, (1,), generator=gen))
    x = realistic_scales(gen, (e, r, c)) if kind == "realistic" else adversarial_scales(gen, (e, r, c))
    csf = csfmoe.compress_scales(x, fmt).cuda()
    assert torch.equal(csf.expand().cpu(), x)
    if fmt == "nvfp4":
        want = csfmoe.compress_scales(x, fmt).decompress("swizzled_128x4")
        assert torch.equal(csf.expand("swizzled_128x4").cpu(), want)


def test_expand_routed_only_touches_routed(gen):
    e, r, c = 16, 256, 32
    x = realistic_scales(gen, (e, r, c))
    csf = csfmoe.compress_scales(x).cuda()
    out = torch.full(x.shape, 0x5A, dtype=torch.uint8, device="cuda")
    ids = torch.randint(0, e, (7, 4), generator=gen)
    ids[0, 0] = e + 3  # out of range: skipped
    csf.expand_into(out, topk_ids=ids.cuda())
    routed = set(int(i) for i in ids.flatten() if 0 <= i < e)
    got = out.cpu()
    for ex in range(e):
        if ex in routed:
            assert torch.equal(got[ex], x[ex])
        else:
            assert (got[ex] == 0x5A).all()


def test_device_encode_bit_identical_to_cpu(gen):
    x = realistic_scales(gen, (4, 128, 16), exception_rate=0.03)
    cpu = csfmoe.compress_scales(x)
    dev = csfmoe.compress_scales(x.cuda())
    for a, b in zip(cpu.parts, dev.parts):
        assert torch.equal(a, b.cpu())


def test_expand_on_side_stream_and_graph_capture(gen):
    e, r, c = 8, 256, 16
    x = realistic_scales(gen, (e, r, c))
    csf = csfmoe.compress_scales(x).cuda()
    scratch = torch.zeros(x.shape, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        csf.expand_into(scratch)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(scratch.cpu(), x)

    scratch.zero_()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        csf.expand_into(scratch)
    assert not scratch.any()  # capture launches nothing
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(scratch.cpu(), x)


def test_cuda_rejections(gen):
    x = realistic_scales(gen, (2, 128, 8))
    csf = csfmoe.compress_scales(x).cuda()
    with pytest.raises(csfmoe.InvalidArgument, match="out: expected a tensor on cuda"):
        csf.expand_into(torch.empty_like(x))
    with pytest.raises(csfmoe.InvalidArgument, match="exceptions: expected a tensor on"):
        torch.ops.csfmoe.expand_scales(csf.fixed, csf.exceptions.cpu(), csf.row_prefix, csf.partition_index,
                                       "nvfp4", "row_major", 2, 128, 8, torch.empty_like(x, device="cuda"),
                                       "row_major")
