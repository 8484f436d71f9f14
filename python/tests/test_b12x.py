"""b12x / vLLM interop from Python: compress_checkpoint(schema="b12x") writes
the planes under b12x's names; a file as b12x writes it (the planes, no
csfmoe metadata) loads with its scales decoded byte-exact; damaged planes
are refused naming the file and the tensor; compress_checkpoint(tp=...)
slices a compressed input."""

import json
import struct

import pytest
import torch

import csfmoe
from test_checkpoint import modelopt_layer, write_safetensors


def header_of(path):
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


def strip_csfmoe_metadata(src, dst):
    """The same tensors without csfmoe's descriptor and restore record: a file
    as b12x / vLLM write it."""
    header, body = header_of(src)
    meta = {k: v for k, v in header.get("__metadata__", {}).items() if not k.startswith("csfmoe.")}
    header["__metadata__"] = meta
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    dst.write_bytes(struct.pack("<Q", len(text)) + text + body)


def as_bytes(x):
    if isinstance(x, csfmoe.CsfScales):
        x = x.decompress()
    return x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture
def b12x_file(gen, tmp_path):
    pre, t = modelopt_layer(gen, e=2)
    src, packed, foreign = tmp_path / "m.safetensors", tmp_path / "b.safetensors", tmp_path / "f.safetensors"
    write_safetensors(src, t)
    csfmoe.checkpoint.compress_checkpoint(src, packed, schema="b12x")
    strip_csfmoe_metadata(packed, foreign)
    return pre, t, packed, foreign


def test_schema_b12x_writes_the_plane_names(b12x_file):
    pre, t, packed, _ = b12x_file
    header, _ = header_of(packed)
    scales = [n for n in t if n.endswith(".weight_scale")]
    assert scales
    for name in scales:
        assert name not in header
        assert header[f"{name}.nvfp4_csf_fixed"]["dtype"] == "U8"
        assert header[f"{name}.nvfp4_csf_exceptions"]["dtype"] == "U32"
    loaded = csfmoe.load_checkpoint(packed, decode=True)
    assert all(as_bytes(loaded[n]) == as_bytes(t[n]) for n in t)


def test_file_written_by_b12x_loads_byte_exact(b12x_file):
    pre, t, _, foreign = b12x_file
    assert not csfmoe.checkpoint.is_csf_container(foreign)
    csfmoe._csfmoe.verify_checkpoint(str(foreign))  # raises on any damage
    for decode in (False, True):
        loaded = csfmoe.load_checkpoint(foreign, decode=decode)
        assert set(loaded) == set(t)
        for name, want in t.items():
            got = loaded[name]
            if name.endswith(".weight_scale") and not decode:
                assert isinstance(got, csfmoe.CsfScales) and got.crc32 is None, name
            assert as_bytes(got) == as_bytes(want), name
    layer = csfmoe.checkpoint.gather_moe_layer(csfmoe.load_checkpoint(foreign), pre)
    assert layer is not None


def test_damaged_planes_are_refused(b12x_file, tmp_path):
    pre, t, _, foreign = b12x_file
    header, body = header_of(foreign)
    name = f"{pre}.0.up_proj.weight_scale"
    b, _ = header[f"{name}.nvfp4_csf_fixed"]["data_offsets"]
    data = bytearray(foreign.read_bytes())
    base = len(data) - len(body)
    data[base + b] = 0xF5  # a base byte above 240
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    with pytest.raises(csfmoe.FormatError) as info:
        csfmoe.load_checkpoint(bad, decode=True)
    assert str(bad) in str(info.value) and name in str(info.value)
    with pytest.raises(csfmoe.FormatError):
        csfmoe._csfmoe.verify_checkpoint(str(bad))


def test_tensor_parallel_slice_of_a_compressed_input(b12x_file, tmp_path):
    pre, t, packed, foreign = b12x_file
    src = tmp_path / "m.safetensors"
    for rank in range(2):
        from_native, from_b12x = tmp_path / f"n{rank}.safetensors", tmp_path / f"s{rank}.safetensors"
        csfmoe.checkpoint.compress_checkpoint(src, from_native, tp=2, rank=rank)
        csfmoe.checkpoint.compress_checkpoint(foreign, from_b12x, tp=2, rank=rank)
        a = csfmoe.load_checkpoint(from_native, decode=True)
        b = csfmoe.load_checkpoint(from_b12x, decode=True)
        assert set(a) == set(b)
        assert all(as_bytes(a[n]) == as_bytes(b[n]) for n in a)
    with pytest.raises(csfmoe.InvalidArgument, match="schema"):
        csfmoe.checkpoint.compress_checkpoint(src, tmp_path / "x.safetensors", schema="zip")


def test_mxfp4_slab_storage_is_optional(gen, tmp_path):
    """MXFP4 short rows: the slab form by default where it is smaller, b12x's
    planes on request; both restore the source exactly."""
    e, rows, c = 2, 64, 12
    # E8M0 scales as real MXFP4 rows have them: each row's bytes at its base or
    # base + 1, row bases a few steps apart, a few bytes elsewhere.
    base = 118 + torch.randint(0, 3, (e, rows, 1), generator=gen)
    scales = (base + torch.randint(0, 2, (e, rows, c), generator=gen)).to(torch.uint8)
    scales.view(-1)[torch.randint(0, scales.numel(), (5,), generator=gen)] = 0xFF
    t = {
        "model.layers.0.mlp.experts.gate_up_proj_blocks":
            torch.randint(0, 256, (e, rows, c, 16), generator=gen, dtype=torch.uint8),
        "model.layers.0.mlp.experts.gate_up_proj_scales": scales,
    }
    src = tmp_path / "m.safetensors"
    write_safetensors(src, t)
    stored = {}
    for slab in (True, False):
        dst = tmp_path / f"c{slab}.safetensors"
        stored[slab] = csfmoe.checkpoint.compress_checkpoint(src, dst, mxfp4_slab=slab)[1]
        entries = csfmoe._csfmoe.SafetensorsFile(str(dst)).csf_entries()
        storage = {v["storage"] for v in entries.values()}
        assert storage == ({"mxfp4_slab"} if slab else {"planes"}), storage
        loaded = csfmoe.load_checkpoint(dst, decode=True)
        assert all(as_bytes(loaded[n]) == as_bytes(t[n]) for n in t)
    assert stored[True] < stored[False]
