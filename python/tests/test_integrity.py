"""The Python loaders verify what `csf verify` verifies: one flipped byte in
any CSF part or in a passthrough weight of a container is refused by
load_file / load_checkpoint (decode or not) with the C++ verdict's error
class, naming the file and the tensor; clean containers load byte-exact.
Also: CsfScales prints short, and save_file goes through the C++ writer."""

import json
import os
import re
import shutil
import struct

import pytest
import torch

import csfmoe
from conftest import realistic_scales

LAYER = "model.layers.0.mlp.experts"


def stacked_layer(gen, e=2, h=512, n=256):
    """A stacked NVFP4 layer on fresh random data, plus a passthrough weight."""
    f8 = torch.float8_e4m3fn
    t = {
        f"{LAYER}.w13.weight": torch.randint(0, 256, (e, 2 * n, h // 2), generator=gen, dtype=torch.uint8),
        f"{LAYER}.w13.weight_scale": realistic_scales(gen, (e, 2 * n, h // 16), exception_rate=0.02).view(f8),
        f"{LAYER}.w13.weight_scale_2": torch.rand(e, generator=gen) + 0.5,
        f"{LAYER}.w2.weight": torch.randint(0, 256, (e, h, n // 2), generator=gen, dtype=torch.uint8),
        f"{LAYER}.w2.weight_scale": realistic_scales(gen, (e, h, n // 16), exception_rate=0.02).view(f8),
        f"{LAYER}.w2.weight_scale_2": torch.rand(e, generator=gen) + 0.5,
        "model.embed_tokens.weight": torch.randn(16, 64, generator=gen).to(torch.bfloat16),
    }
    return t


def header_of(path):
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), 8 + n


def flipped_copy(src, dst, tensor, gen):
    """dst = src with one byte inside `tensor`'s data flipped (all 8 bits)."""
    header, base = header_of(src)
    b, e = header[tensor]["data_offsets"]
    assert e > b, tensor
    at = base + b + int(torch.randint(0, e - b, (1,), generator=gen))
    data = bytearray(src.read_bytes())
    data[at] ^= 0xFF
    dst.write_bytes(bytes(data))


def as_bytes(x):
    if isinstance(x, csfmoe.CsfScales):
        x = x.decompress()
    return x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def swizzle_128x4(grid):
    """[E, R, C] row-major -> the 128x4 tile layout (R % 128 == 0, C % 4 == 0):
    byte (r, c) at tile (r // 128, c // 4), then (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4."""
    e, rows, cols = grid.shape
    r = torch.arange(rows).view(-1, 1)
    c = torch.arange(cols).view(1, -1)
    at = ((r // 128) * (cols // 4) + c // 4) * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4
    flat = grid.reshape(e, -1).view(torch.uint8)
    out = torch.empty_like(flat)
    out[:, at.reshape(-1)] = flat
    return out.view(grid.dtype).view(e, rows, cols)


# Both storages of a container: planes (row-major grids, the default) and the
# resident parts (what a swizzled source keeps; these grids have the same
# shape in either layout).
@pytest.fixture(params=["", "swizzled_128x4"], ids=["planes", "resident"])
def container(gen, tmp_path, request):
    from test_checkpoint import write_safetensors

    tensors = stacked_layer(gen)
    if request.param:
        for name in (f"{LAYER}.w13.weight_scale", f"{LAYER}.w2.weight_scale"):
            tensors[name] = swizzle_128x4(tensors[name])
    src, dst = tmp_path / "model.safetensors", tmp_path / "csf.safetensors"
    write_safetensors(src, tensors)
    csfmoe.checkpoint.compress_checkpoint(src, dst, layout=request.param)
    storage = "resident" if request.param else "planes"
    assert {e["storage"] for e in csf_entries(dst).values()} == {storage}
    return tensors, dst


def csf_entries(path):
    return csfmoe._csfmoe.SafetensorsFile(str(path)).csf_entries()


def csf_names(path):
    return sorted(csf_entries(path))


def cpp_verdict(path):
    """The class of the error `csf verify` (verify_checkpoint) raises, or None."""
    try:
        csfmoe._csfmoe.verify_checkpoint(str(path))
    except csfmoe.Error as e:
        return type(e)
    return None


def python_verdicts(path, folder=None):
    """(error class, message) of every Python loading path, in order."""
    target = folder or path
    calls = [
        ("load_file", lambda: csfmoe.load_file(path)),
        ("load_file decode", lambda: csfmoe.load_file(path, decode=True)),
        ("load_checkpoint", lambda: csfmoe.load_checkpoint(target)),
        ("load_checkpoint decode", lambda: csfmoe.load_checkpoint(target, decode=True)),
    ]
    if csfmoe.has_moe:
        calls.append(("prepare_experts", lambda: csfmoe.prepare_experts(
            csfmoe.checkpoint.gather_moe_layer(csfmoe.load_checkpoint(target), LAYER), topk=2, compression="csf")))
    out = []
    for what, call in calls:
        with pytest.raises(csfmoe.Error) as info:
            call()
        out.append((what, type(info.value), str(info.value)))
    return out


def test_clean_container_loads_byte_exact(container):
    tensors, path = container
    assert cpp_verdict(path) is None
    names = csf_names(path)
    assert f"{LAYER}.w13.weight_scale" in names and f"{LAYER}.w2.weight_scale" in names
    for decode in (False, True):
        loaded = csfmoe.load_checkpoint(path, decode=decode)
        assert set(loaded) == set(tensors)
        for name, want in tensors.items():
            got = loaded[name]
            assert isinstance(got, csfmoe.CsfScales) == (name in names and not decode), name
            if isinstance(got, torch.Tensor):
                assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), name
            assert as_bytes(got) == as_bytes(want), name


def test_every_part_and_a_passthrough_flip_is_refused(container, gen, tmp_path):
    tensors, path = container
    entries = csf_entries(path)
    targets = [(p, n) for n, e in entries.items() for p in e["parts"]]
    targets += [("model.embed_tokens.weight", "model.embed_tokens.weight"), (f"{LAYER}.w2.weight", f"{LAYER}.w2.weight")]
    header, _ = header_of(path)
    corrupt_seen = 0
    for i, (stored, logical) in enumerate(targets):
        if header[stored]["data_offsets"][1] == header[stored]["data_offsets"][0]:
            continue  # an empty part (no exceptions) has no byte to flip
        bad = tmp_path / f"bad{i}.safetensors"
        flipped_copy(path, bad, stored, gen)
        want = cpp_verdict(bad)
        assert want in (csfmoe.CorruptData, csfmoe.FormatError), (stored, want)
        corrupt_seen += want is csfmoe.CorruptData
        for what, cls, msg in python_verdicts(bad):
            assert cls is want, (stored, what, cls, msg)
            assert str(bad) in msg and f"'{logical}'" in msg, (stored, what, msg)
    # The fixed parts and the passthrough weights decode, then fail their CRC.
    assert corrupt_seen >= 2


def test_fixed_part_flip_that_still_validates_is_corrupt(container, gen, tmp_path):
    """A flipped code that keeps the parts structurally valid (the C++ verdict
    is CorruptData, not FormatError): only the CRC catches it, and every
    Python path must; the same damage made in memory to loaded scales too."""
    _, path = container
    name = f"{LAYER}.w13.weight_scale"
    first_part = csf_entries(path)[name]["parts"][0]  # the fixed slabs or the planes
    header, base = header_of(path)
    b, e = header[first_part]["data_offsets"]
    data = path.read_bytes()
    bad = tmp_path / "bad.safetensors"
    for _ in range(400):
        at = base + b + int(torch.randint(0, e - b, (1,), generator=gen))
        bad_bytes = bytearray(data)
        bad_bytes[at] ^= 0x01
        bad.write_bytes(bytes(bad_bytes))
        if cpp_verdict(bad) is not csfmoe.CorruptData:
            continue
        for what, cls, msg in python_verdicts(bad):
            assert cls is csfmoe.CorruptData and "CRC32" in msg and f"'{name}'" in msg, (what, msg)
        break
    else:
        pytest.fail("no validating flip found in 400 draws")
    clean = csfmoe.load_file(path)[name]
    for _ in range(400):
        fixed = clean.parts[0].clone()
        at = int(torch.randint(0, fixed.numel(), (1,), generator=gen))
        fixed[at] ^= 0x01
        try:
            csfmoe._csfmoe.validate(fixed, *clean.parts[1:], clean.format, clean.layout, *clean.grid)
        except csfmoe.FormatError:
            continue
        tampered = csfmoe.CsfScales(fixed, *clean.parts[1:], format=clean.format, layout=clean.layout,
                                    experts=clean.experts, rows=clean.rows, cols=clean.cols, dtype=clean.dtype,
                                    shape=clean.shape, crc32=clean.crc32, origin=clean.origin)
        with pytest.raises(csfmoe.CorruptData, match=re.escape(f"{path}: tensor '{name}'")):
            tampered.decompress()
        return
    pytest.fail("no validating in-memory flip found in 400 draws")


def test_sharded_folder_flip_names_the_shard(gen, tmp_path):
    from test_checkpoint import write_safetensors

    tensors = stacked_layer(gen)
    names = list(tensors)
    src = tmp_path / "src"
    src.mkdir()
    shards = {"model-00001-of-00002.safetensors": names[:3], "model-00002-of-00002.safetensors": names[3:]}
    weight_map = {}
    for shard, part in shards.items():
        write_safetensors(src / shard, {n: tensors[n] for n in part})
        weight_map.update({n: shard for n in part})
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    dst = tmp_path / "csf"
    csfmoe.checkpoint.compress_checkpoint(src, dst)
    loaded = csfmoe.load_checkpoint(dst)
    assert set(loaded) == set(tensors)
    assert all(as_bytes(loaded[n]) == as_bytes(tensors[n]) for n in tensors)

    bad = tmp_path / "bad"
    shutil.copytree(dst, bad)
    shard = bad / "model-00002-of-00002.safetensors"
    os.remove(shard)
    entries = csf_entries(dst / shard.name)
    target = entries[f"{LAYER}.w2.weight_scale"]["parts"][0] if f"{LAYER}.w2.weight_scale" in entries \
        else f"{LAYER}.w2.weight"
    flipped_copy(dst / shard.name, shard, target, gen)
    want = cpp_verdict(bad)
    assert want is not None
    with pytest.raises(want, match=re.escape(str(shard))):
        csfmoe.load_checkpoint(bad)


def test_duplicate_tensor_across_shards_is_refused(gen, tmp_path):
    from test_checkpoint import write_safetensors

    folder = tmp_path / "ckpt"
    folder.mkdir()
    x = torch.randn(4, generator=gen)
    write_safetensors(folder / "a.safetensors", {"x": x})
    write_safetensors(folder / "b.safetensors", {"x": x + 1})
    with pytest.raises(csfmoe.FormatError, match="'x' is also in"):
        csfmoe.load_checkpoint(folder)


def test_csf_scales_repr_is_short(gen):
    x = realistic_scales(gen, (8, 512, 64)).view(torch.float8_e4m3fn)
    s = csfmoe.CsfScales.compress(x)
    text = repr(s)
    assert len(text) < 200 and "\n" not in text, text
    assert "nvfp4" in text and "row_major" in text and "[8, 512, 64]" in text
    assert f"stored={s.nbytes} of {x.numel()} bytes" in text
    assert f"({100.0 * s.nbytes / x.numel():.1f}%)" in text
    assert str(s) == text


def test_save_file_never_replaces_and_leaves_nothing(gen, tmp_path):
    path = tmp_path / "x.safetensors"
    first = {"a": torch.randn(3, generator=gen)}
    csfmoe.checkpoint.save_file(first, path)
    before = path.read_bytes()
    with pytest.raises(csfmoe.InvalidArgument, match="already exists"):
        csfmoe.checkpoint.save_file({"a": torch.randn(5, generator=gen)}, path)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["x.safetensors"]
    with pytest.raises(csfmoe.Error):
        csfmoe.checkpoint.save_file(first, tmp_path / "missing-folder" / "y.safetensors")
    assert sorted(os.listdir(tmp_path)) == ["x.safetensors"]
