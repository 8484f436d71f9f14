"""Reading CSF containers into torch tensors, and gathering a ModelOpt
NVFP4 MoE layer into prepared experts."""

import json
import struct

import pytest
import torch

import csfmoe
from conftest import realistic_scales


def write_safetensors(path, tensors):
    header, blobs, off = {}, [], 0
    names = {torch.uint8: "U8", torch.float32: "F32", torch.bfloat16: "BF16", torch.float8_e4m3fn: "F8_E4M3"}
    for name, t in tensors.items():
        b = t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def modelopt_layer(gen, e=3, h=256, n=128):
    t = {}
    pre = "model.layers.0.mlp.experts"
    for i in range(e):
        for proj, rows, k in (("gate_proj", n, h), ("up_proj", n, h), ("down_proj", h, n)):
            t[f"{pre}.{i}.{proj}.weight"] = torch.randint(0, 256, (rows, k // 2), generator=gen, dtype=torch.uint8)
            t[f"{pre}.{i}.{proj}.weight_scale"] = realistic_scales(gen, (rows, k // 16)).view(torch.float8_e4m3fn)
            t[f"{pre}.{i}.{proj}.weight_scale_2"] = torch.tensor([0.01 if proj != "down_proj" else 0.02])
    t["model.embed_tokens.weight"] = torch.randn(4, 8, generator=gen).to(torch.bfloat16)
    return pre, t


def test_container_roundtrip_and_layer(gen, tmp_path):
    pre, t = modelopt_layer(gen)
    src, dst = tmp_path / "model.safetensors", tmp_path / "csf.safetensors"
    write_safetensors(src, t)
    assert not csfmoe.checkpoint.is_csf_container(src)
    csfmoe.checkpoint.compress_checkpoint(src, dst)
    assert csfmoe.checkpoint.is_csf_container(dst)
    loaded = csfmoe.load_file(dst)
    assert set(loaded) == set(t)
    n_csf = 0
    for name, want in t.items():
        got = loaded[name]
        if isinstance(got, csfmoe.CsfScales):
            n_csf += 1
            got = got.decompress()
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.view(torch.uint8) if got.dtype != torch.bfloat16 else got,
                           want.view(torch.uint8) if want.dtype != torch.bfloat16 else want), name
    assert n_csf > 0
    decoded = csfmoe.load_file(dst, decode=True)
    assert all(isinstance(v, torch.Tensor) for v in decoded.values())

    layer = csfmoe.checkpoint.gather_moe_layer(loaded, pre)
    assert layer["w13"].shape == (3, 256, 128) and layer["w2"].shape == (3, 256, 64)
    want13 = torch.stack([torch.cat([t[f"{pre}.{i}.gate_proj.weight_scale"], t[f"{pre}.{i}.up_proj.weight_scale"]])
                          for i in range(3)])
    s13 = layer["w13_scale"]
    s13 = s13.decompress() if isinstance(s13, csfmoe.CsfScales) else s13
    assert torch.equal(s13.reshape(want13.shape).view(torch.uint8), want13.view(torch.uint8))
    if csfmoe.has_moe:
        p = csfmoe.prepare_experts(layer, topk=2, compression="csf")
        hidden = torch.randn(2, 256, generator=gen).to(torch.bfloat16)
        ids = torch.tensor([[0, 2], [1, 1]], dtype=torch.int32)
        wts = torch.full((2, 2), 0.5)
        out = p(hidden, ids, wts)
        native = dict(layer, w13_scale=s13.reshape(want13.shape), w2_scale=csfmoe.CsfScales.decompress(
            layer["w2_scale"]) if isinstance(layer["w2_scale"], csfmoe.CsfScales) else layer["w2_scale"])
        ref = csfmoe.prepare_experts(native, topk=2)(hidden, ids, wts)
        # Random scale bytes include NaN patterns: NaN must land in the same places.
        assert out.shape == (2, 256) and torch.allclose(out.float(), ref.float(), equal_nan=True)


def test_corrupt_container_rejected(gen, tmp_path):
    pre, t = modelopt_layer(gen, e=1)
    src, dst = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    write_safetensors(src, t)
    csfmoe.checkpoint.compress_checkpoint(src, dst)
    data = bytearray(dst.read_bytes())
    hlen = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + hlen])
    name = next(k for k in header if k.endswith(".csf.row_prefix"))
    b, e = header[name]["data_offsets"]
    at = 8 + hlen + b + 4  # second prefix entry: make it huge
    data[at:at + 4] = struct.pack("<I", 0xFFFFFF)
    dst.write_bytes(bytes(data))
    with pytest.raises(csfmoe.FormatError, match="row_prefix|prefix"):
        csfmoe.load_file(dst)
