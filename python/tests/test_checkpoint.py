"""Reading CSF containers into torch tensors, writing safetensors files, and
gathering MoE layers (stacked, gpt-oss, per-expert; plain and CSF) into
prepared experts."""

import json
import os
import pathlib
import shutil
import struct
import subprocess

import pytest
import torch

import csfmoe
from conftest import adversarial_scales, realistic_scales


def write_safetensors(path, tensors, metadata=None):
    header, blobs, off = ({"__metadata__": metadata} if metadata else {}), [], 0
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
    # A structural field: the row prefix of resident parts, or the per-expert
    # record count of planes (the default storage).
    name = next(k for k in header if k.endswith((".csf.row_prefix", ".csf.expert_exceptions")))
    b, e = header[name]["data_offsets"]
    at = 8 + hlen + b + (4 if name.endswith("row_prefix") else 0)  # make it huge
    data[at:at + 4] = struct.pack("<I", 0xFFFFFF)
    dst.write_bytes(bytes(data))
    with pytest.raises(csfmoe.FormatError, match="row_prefix|prefix|record counts"):
        csfmoe.load_file(dst)


# ---------------------------------------------------------------------------
# gather_moe_layer: stacked (csf synth), gpt-oss and per-expert layouts, plain
# and CSF-compressed, row-major and swizzled scales
# ---------------------------------------------------------------------------
ROOT = pathlib.Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "data" / "qwen3-30b-a3b-nvfp4-synth.safetensors"
SAMPLE_LAYER = "model.layers.0.mlp.experts"
F8 = torch.float8_e4m3fn


def read_raw(path):
    """name -> (dtype name, shape, bytes), straight from the file (no csfmoe)."""
    data = pathlib.Path(path).read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"], data[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]])
            for k, v in header.items()}


def as_bytes(x):
    if isinstance(x, csfmoe.CsfScales):
        x = x.decompress("row_major")
    return x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_gather_stacked_sample_plain_and_csf(gen, tmp_path):
    """The committed `csf synth` file: what gather returns is what the file holds."""
    raw = read_raw(SAMPLE)
    r = lambda leaf: raw[f"{SAMPLE_LAYER}.{leaf}"]  # noqa: E731
    csf_path = tmp_path / "csf.safetensors"
    csfmoe.checkpoint.compress_checkpoint(SAMPLE, csf_path)
    got = {}
    for kind, path in (("plain", SAMPLE), ("csf", csf_path)):
        L = csfmoe.checkpoint.gather_moe_layer(csfmoe.load_file(path), SAMPLE_LAYER)
        got[kind] = L
        assert L["format"] == "nvfp4"
        assert L["w13"].shape == (2, 1536, 1024) and L["w2"].shape == (2, 2048, 384)
        for key, leaf in (("w13", "w13.weight"), ("w2", "w2.weight"), ("w13_scale", "w13.weight_scale"),
                          ("w2_scale", "w2.weight_scale"), ("w13_global", "w13.weight_scale_2"),
                          ("w2_global", "w2.weight_scale_2"), ("w13_input_scale", "w13.input_scale"),
                          ("w2_input_scale", "w2.input_scale")):
            assert as_bytes(L[key]) == r(leaf)[2], (kind, key)
        scales = (L["w13_scale"], L["w2_scale"])
        if kind == "csf":
            # Stacked CSF scales pass through without a decode.
            assert all(isinstance(s, csfmoe.CsfScales) for s in scales)
            assert scales[0].grid == (2, 1536, 128) and scales[1].grid == (2, 2048, 48)
        else:
            assert all(isinstance(s, torch.Tensor) and s.dtype == F8 for s in scales)
    if csfmoe.has_moe:
        hidden = torch.randn(2, 2048, generator=gen).to(torch.bfloat16)
        ids = torch.randint(0, 2, (2, 2), generator=gen, dtype=torch.int32)
        wts = torch.rand(2, 2, generator=gen)
        a = csfmoe.prepare_experts(got["plain"], topk=2)(hidden, ids, wts)
        b = csfmoe.prepare_experts(got["csf"], topk=2)(hidden, ids, wts)
        assert torch.equal(a, b) and a.float().abs().sum() > 0


def truth_layer(gen, fmt, e, h, n, adversarial):
    """Row-major truth of one layer: packed weights, scales (the library's
    realistic generator, or adversarial bytes), globals."""
    g = 16 if fmt == "nvfp4" else 32
    sdt = F8 if fmt == "nvfp4" else torch.uint8
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    w = csfmoe._csfmoe.synthetic_moe_weights(fmt, e, h, n, 2, "w13", seed, True)
    t = {
        "w13": torch.randint(0, 256, (e, 2 * n, h // 2), generator=gen, dtype=torch.uint8),
        "w2": torch.randint(0, 256, (e, h, n // 2), generator=gen, dtype=torch.uint8),
        "w13_scale": w["w13_scale"].reshape(e, 2 * n, h // g).view(sdt),
        "w2_scale": w["w2_scale"].reshape(e, h, n // g).view(sdt),
    }
    if adversarial:
        t["w13_scale"] = adversarial_scales(gen, (e, 2 * n, h // g)).view(sdt)
        t["w2_scale"] = adversarial_scales(gen, (e, h, n // g)).view(sdt)
    if fmt == "nvfp4":
        t["w13_global"] = torch.rand(e, generator=gen) * 1e-3
        t["w2_global"] = torch.rand(e, generator=gen) * 1e-3
    else:
        t["w13_global"] = t["w2_global"] = torch.ones(e)
    return t


def in_layout(scales, fmt, layout):
    """Native bytes of row-major `scales` [.., R, C] in `layout` (the C++ codec swizzles)."""
    if layout == "row_major":
        return scales
    lead = scales.shape[:-2]
    out = csfmoe.CsfScales.compress(scales.reshape(-1, *scales.shape[-2:]), fmt).decompress(layout)
    return out.reshape(*lead, *out.shape[-2:])


def layer_tensors(t, kind, fmt, layout, pre, per_names=("gate_proj", "up_proj", "down_proj")):
    """The checkpoint tensors of truth layer `t` under the names of `kind`."""
    e, two_n, _ = t["w13"].shape
    n = two_n // 2
    out = {}
    if kind == "stacked":
        out[f"{pre}.w13.weight"], out[f"{pre}.w2.weight"] = t["w13"], t["w2"]
        out[f"{pre}.w13.weight_scale"] = in_layout(t["w13_scale"], fmt, layout)
        out[f"{pre}.w2.weight_scale"] = in_layout(t["w2_scale"], fmt, layout)
        if fmt == "nvfp4":
            out[f"{pre}.w13.weight_scale_2"], out[f"{pre}.w2.weight_scale_2"] = t["w13_global"], t["w2_global"]
    elif kind == "gpt-oss":
        out[f"{pre}.gate_up_proj_blocks"] = t["w13"].reshape(e, two_n, -1, 16)
        out[f"{pre}.down_proj_blocks"] = t["w2"].reshape(e, t["w2"].shape[1], -1, 16)
        out[f"{pre}.gate_up_proj_scales"] = in_layout(t["w13_scale"], fmt, layout)
        out[f"{pre}.down_proj_scales"] = in_layout(t["w2_scale"], fmt, layout)
    else:
        gate, up, down = per_names
        for i in range(e):
            p = f"{pre}.{i}."
            for proj, w, s in ((gate, t["w13"][i, :n], t["w13_scale"][i, :n]),
                               (up, t["w13"][i, n:], t["w13_scale"][i, n:]),
                               (down, t["w2"][i], t["w2_scale"][i])):
                out[p + proj + ".weight"] = w.contiguous()
                out[p + proj + ".weight_scale"] = in_layout(s.contiguous(), fmt, layout)
                if fmt == "nvfp4":
                    glob = t["w2_global"] if proj == down else t["w13_global"]
                    out[p + proj + ".weight_scale_2"] = glob[i].reshape(())
    return out


def check_gathered(L, t, fmt):
    assert L["format"] == fmt
    for key in ("w13", "w2", "w13_scale", "w2_scale", "w13_global", "w2_global"):
        want = t[key]
        got = L[key]
        if isinstance(got, csfmoe.CsfScales):
            got = got.decompress("row_major")
        assert tuple(got.shape) == tuple(want.shape), key
        assert got.dtype == want.dtype, key
        assert as_bytes(got) == as_bytes(want), key


@pytest.mark.parametrize("kind,fmt", [("stacked", "nvfp4"), ("stacked", "mxfp4"), ("gpt-oss", "mxfp4"),
                                      ("per-expert", "nvfp4"), ("per-expert", "mxfp4")])
@pytest.mark.parametrize("layout", ["row_major", "swizzled_128x4"])
def test_gather_layouts_plain_and_csf(gen, tmp_path, kind, fmt, layout):
    # Swizzled, H = 1088 pads w2's rows to 1152 and MXFP4's 34 w13 columns to
    # 36 (N = 192: 6 w2 columns to 8); H = 1024, N = 256 is tile-aligned. Grids
    # this large compress; adversarial ones do not, and the container keeps
    # them native.
    e = int(torch.randint(1, 4, (1,), generator=gen))
    h, n = [(1088, 192), (1024, 256)][int(torch.randint(0, 2, (1,), generator=gen))]
    adversarial = bool(torch.randint(0, 4, (1,), generator=gen) == 0)
    t = truth_layer(gen, fmt, e, h, n, adversarial)
    pre = "model.layers.2.mlp.experts"
    names = ("gate_proj", "up_proj", "down_proj") if torch.randint(0, 2, (1,), generator=gen) else ("w1", "w3", "w2")
    tensors = layer_tensors(t, kind, fmt, layout, pre, names)
    tensors["model.layers.2.mlp.gate.weight"] = torch.randn(e, h, generator=gen).to(torch.bfloat16)
    src, dst = tmp_path / "plain.safetensors", tmp_path / "csf.safetensors"
    csfmoe.checkpoint.save_file(tensors, src, {"csfmoe.scale_layout": layout})
    plain = csfmoe.load_file(src)
    for name, want in tensors.items():
        assert as_bytes(plain[name]) == as_bytes(want), name
    check_gathered(csfmoe.checkpoint.gather_moe_layer(plain, pre, scale_layout=layout), t, fmt)
    if layout != "row_major":
        # Read as row-major, the padded swizzled grid does not fit the weights.
        g = 16 if fmt == "nvfp4" else 32
        rows_ok = (2 * n) % 128 == 0 and h % 128 == 0
        cols_ok = (h // g) % 4 == 0 and (n // g) % 4 == 0
        if not (rows_ok and cols_ok):
            with pytest.raises(csfmoe.FormatError, match="matches neither"):
                csfmoe.checkpoint.gather_moe_layer(plain, pre)
    csfmoe.checkpoint.compress_checkpoint(src, dst, layout=layout)
    loaded = csfmoe.load_file(dst)
    # Scales that CSF would not shrink stay native in the container.
    kept = csfmoe._csfmoe.SafetensorsFile(str(dst)).native_kept()
    csf_names = {k for k, v in loaded.items() if isinstance(v, csfmoe.CsfScales)}
    assert csf_names | set(kept) == {k for k in tensors if k.endswith(("weight_scale", "_scales"))}
    assert (len(csf_names) == 0) == adversarial, sorted(kept)
    # CsfScales know their layout; native-kept scales are in `layout`.
    L = csfmoe.checkpoint.gather_moe_layer(loaded, pre, scale_layout=layout)
    check_gathered(L, t, fmt)
    for key, name in (("w13_scale", f"{pre}.w13.weight_scale"), ("w13_scale", f"{pre}.gate_up_proj_scales"),
                      ("w2_scale", f"{pre}.w2.weight_scale"), ("w2_scale", f"{pre}.down_proj_scales")):
        if name in csf_names and layout == "row_major":
            # Stacked CSF scales pass through undecoded.
            assert L[key] is loaded[name]


def _interleave(t):
    """[E, 2N, ..] in the w13 order (gate rows, then up rows) -> gpt-oss's
    alternate rows (row 2i gate i, row 2i + 1 up i)."""
    e, two_n = t.shape[0], t.shape[1]
    n = two_n // 2
    return torch.stack([t[:, :n], t[:, n:]], dim=2).reshape(t.shape).contiguous()


@pytest.mark.parametrize("layout", ["row_major", "swizzled_128x4"])
@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float32])
def test_gather_gpt_oss_with_biases(gen, tmp_path, layout, bias_dtype):
    """A gpt-oss checkpoint proper: interleaved gate/up rows and biases come
    back de-interleaved into the w13 order, with activation gpt_oss; plain
    and through a CSF container (whose w13 scales are re-encoded)."""
    e, h, n = int(torch.randint(1, 4, (1,), generator=gen)), 1024, 256
    t = truth_layer(gen, "mxfp4", e, h, n, False)
    b13 = torch.randn(e, 2 * n, generator=gen).to(bias_dtype)
    b2 = torch.randn(e, h, generator=gen).to(bias_dtype)
    pre = "model.layers.1.mlp.experts"
    file_t = {**t, "w13": _interleave(t["w13"]), "w13_scale": _interleave(t["w13_scale"])}
    tensors = layer_tensors(file_t, "gpt-oss", "mxfp4", layout, pre)
    tensors[f"{pre}.gate_up_proj_bias"] = _interleave(b13)
    tensors[f"{pre}.down_proj_bias"] = b2
    src, dst = tmp_path / "oss.safetensors", tmp_path / "oss-csf.safetensors"
    csfmoe.checkpoint.save_file(tensors, src, {"csfmoe.scale_layout": layout})
    csfmoe.checkpoint.compress_checkpoint(src, dst, layout=layout)
    for path in (src, dst):
        L = csfmoe.checkpoint.gather_moe_layer(csfmoe.load_file(path), pre, scale_layout=layout)
        check_gathered(L, t, "mxfp4")
        assert (L["activation"], L["alpha"], L["limit"]) == ("gpt_oss", 1.702, 7.0)
        assert torch.equal(L["w13_bias"], b13.float()) and torch.equal(L["w2_bias"], b2.float())
    # Without the down bias: still gpt-oss's layer, with the gate/up bias only.
    del tensors[f"{pre}.down_proj_bias"]
    L = csfmoe.checkpoint.gather_moe_layer(tensors, pre, scale_layout=layout)
    check_gathered(L, t, "mxfp4")
    assert L["activation"] == "gpt_oss" and "w2_bias" not in L
    assert torch.equal(L["w13_bias"], b13.float())


def find_csf():
    exe = os.environ.get("CSFMOE_CSF") or shutil.which("csf")
    if not exe:
        found = sorted(ROOT.glob("build*/tools/csf/csf"))
        exe = str(found[0]) if found else None
    if not exe or not os.access(exe, os.X_OK):
        pytest.skip("no csf binary (set CSFMOE_CSF or build the csf target)")
    return exe


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gather_csf_synth_files(tmp_path, seed, fmt):
    """Files written by `csf synth`: the swizzled file's layer equals the
    row-major file's (same seed), plain and CSF-compressed."""
    exe = find_csf()
    gathered = {}
    for layout in ("row_major", "swizzled_128x4"):
        path = tmp_path / f"{layout}.safetensors"
        subprocess.run([exe, "synth", str(path), "--model", "qwen3-30b-a3b", "--format", fmt, "--experts", "2",
                        "--layers", "2", "--seed", str(seed % 2**31), "--layout", layout, "-q"], check=True)
        raw = read_raw(path)
        csf_path = tmp_path / f"{layout}-csf.safetensors"
        csfmoe.checkpoint.compress_checkpoint(path, csf_path, layout=layout)
        for kind, tensors in (("plain", csfmoe.load_file(path)), ("csf", csfmoe.load_file(csf_path))):
            for i in range(2):
                pre = f"model.layers.{i}.mlp.experts"
                L = csfmoe.checkpoint.gather_moe_layer(tensors, pre, scale_layout=layout if kind == "plain" else
                                                       "row_major")
                gathered[(layout, kind, i)] = L
                w13 = f"{pre}.w13.weight" if fmt == "nvfp4" else f"{pre}.gate_up_proj_blocks"
                assert as_bytes(L["w13"]) == raw[w13][2]
                if layout == "row_major":
                    s2 = f"{pre}.w2.weight_scale" if fmt == "nvfp4" else f"{pre}.down_proj_scales"
                    assert as_bytes(L["w2_scale"]) == raw[s2][2]
                if fmt == "nvfp4":
                    assert as_bytes(L["w13_global"]) == raw[f"{pre}.w13.weight_scale_2"][2]
    base = gathered[("row_major", "plain", 1)]
    assert as_bytes(base["w13_scale"]) != as_bytes(gathered[("row_major", "plain", 0)]["w13_scale"])
    for key, L in gathered.items():
        if key[2] != 1:
            continue
        assert L["format"] == fmt
        for k in ("w13", "w2", "w13_scale", "w2_scale", "w13_global", "w2_global"):
            assert as_bytes(L[k]) == as_bytes(base[k]), (key, k)


def stacked_dict(gen, fmt="nvfp4", e=2, h=128, n=64, pre="model.layers.0.mlp.experts"):
    return layer_tensors(truth_layer(gen, fmt, e, h, n, False), "stacked", fmt, "row_major", pre)


def test_gather_errors_name_layer_and_tensors(gen):
    gather = csfmoe.checkpoint.gather_moe_layer
    pre = "model.layers.0.mlp.experts"
    t = stacked_dict(gen)
    with pytest.raises(csfmoe.InvalidArgument,
                       match=r"no MoE layer 'model.layers.7.mlp.experts'.*layers found: model.layers.0.mlp.experts"):
        gather(t, "model.layers.7.mlp.experts")
    with pytest.raises(csfmoe.InvalidArgument, match="layers found: none"):
        gather({"lm_head.weight": torch.zeros(2, 2)}, pre)
    # Stacked, two tensors missing: both named, with the layer.
    part = {k: v for k, v in t.items() if not k.startswith(f"{pre}.w2.weight")}
    with pytest.raises(csfmoe.FormatError, match=rf"layer '{pre}' \(stacked layout\): missing tensors "
                                                 rf"'{pre}.w2.weight', '{pre}.w2.weight_scale'"):
        gather(part, pre)
    part = {k: v for k, v in t.items() if not k.endswith("w13.weight_scale_2")}
    with pytest.raises(csfmoe.FormatError, match=rf"missing tensors '{pre}.w13.weight_scale_2'"):
        gather(part, pre)
    # Per-expert: expert 1's up_proj scale missing.
    per = layer_tensors(truth_layer(gen, "nvfp4", 3, 128, 64, False), "per-expert", "nvfp4", "row_major", pre)
    del per[f"{pre}.1.up_proj.weight_scale"]
    with pytest.raises(csfmoe.FormatError,
                       match=rf"\(per-expert layout\): missing tensors '{pre}.1.up_proj.weight_scale'"):
        gather(per, pre)
    # A missing expert index shows up as its missing tensors.
    per = layer_tensors(truth_layer(gen, "nvfp4", 3, 128, 64, False), "per-expert", "nvfp4", "row_major", pre)
    for k in [k for k in per if k.startswith(f"{pre}.1.")]:
        del per[k]
    with pytest.raises(csfmoe.FormatError, match=rf"'{pre}.1.gate_proj.weight', '{pre}.1.gate_proj.weight_scale'"):
        gather(per, pre)
    per = layer_tensors(truth_layer(gen, "nvfp4", 2, 128, 64, False), "per-expert", "nvfp4", "row_major", pre)
    with pytest.raises(csfmoe.FormatError, match="mixes stacked, gpt-oss and per-expert"):
        gather({**t, **per}, pre)
    with pytest.raises(csfmoe.FormatError, match="mixes"):
        w13 = {k.replace(".gate_proj.", ".w1."): v for k, v in per.items() if ".gate_proj." in k}
        gather({**per, **w13}, pre)


def test_gather_refusals_mirror_the_cpp_loader(gen):
    gather = csfmoe.checkpoint.gather_moe_layer
    pre = "model.layers.0.mlp.experts"
    t = stacked_dict(gen)
    with pytest.raises(csfmoe.Unsupported, match=rf"'{pre}.w13.bias': expert biases of a stacked"):
        gather({**t, f"{pre}.w13.bias": torch.zeros(2, 128)}, pre)
    per = layer_tensors(truth_layer(gen, "nvfp4", 2, 128, 64, False), "per-expert", "nvfp4", "row_major", pre)
    with pytest.raises(csfmoe.Unsupported, match=rf"'{pre}.0.down_proj.bias': expert biases of a per-expert"):
        gather({**per, f"{pre}.0.down_proj.bias": torch.zeros(128)}, pre)
    # gpt-oss biases load (test_gather_gpt_oss_with_biases); malformed ones are refused.
    oss = layer_tensors(truth_layer(gen, "mxfp4", 2, 128, 64, False), "gpt-oss", "mxfp4", "row_major", pre)
    with pytest.raises(csfmoe.FormatError, match=rf"'{pre}.gate_up_proj_bias': expert bias shape \[2, 64\]"):
        gather({**oss, f"{pre}.gate_up_proj_bias": torch.zeros(2, 64)}, pre)
    with pytest.raises(csfmoe.FormatError, match=rf"'{pre}.down_proj_bias': expert bias must be BF16 or F32"):
        gather({**oss, f"{pre}.down_proj_bias": torch.zeros(2, 128, dtype=torch.float16)}, pre)
    with pytest.raises(csfmoe.FormatError, match=rf"'{pre}.down_proj_bias': expert bias \[1, 5\] is nan"):
        b2 = torch.zeros(2, 128)
        b2[1, 5] = float("nan")
        gather({**oss, f"{pre}.down_proj_bias": b2}, pre)
    mx = stacked_dict(gen, "mxfp4")
    with pytest.raises(csfmoe.Unsupported, match=rf"'{pre}.w2.weight_scale_2': an MXFP4 layer with a global"):
        gather({**mx, f"{pre}.w2.weight_scale_2": torch.ones(2)}, pre)
    per = layer_tensors(truth_layer(gen, "nvfp4", 2, 128, 64, False), "per-expert", "nvfp4", "row_major", pre)
    per[f"{pre}.1.up_proj.weight_scale_2"] = per[f"{pre}.1.up_proj.weight_scale_2"] * 2
    with pytest.raises(csfmoe.Unsupported, match=rf"'{pre}.1.gate_proj.weight_scale_2' .* differ"):
        gather(per, pre)
    bad = dict(t)
    bad[f"{pre}.w2.weight_scale_2"] = torch.tensor([1.0, float("nan")])
    with pytest.raises(csfmoe.FormatError, match=r"w2.weight_scale_2': global scale \[1\] is nan"):
        gather(bad, pre)
    bad[f"{pre}.w2.weight_scale_2"] = torch.ones(3)
    with pytest.raises(csfmoe.FormatError, match=r"global scale shape \[3\] is not \[\], \[1\] or \[2\]"):
        gather(bad, pre)
    bad[f"{pre}.w2.weight_scale_2"] = torch.ones(2, dtype=torch.float64)
    with pytest.raises(csfmoe.FormatError, match="global scale must be float32"):
        gather(bad, pre)
    bad = dict(t)
    bad[f"{pre}.w13.weight_scale"] = t[f"{pre}.w13.weight_scale"].view(torch.int8)
    with pytest.raises(csfmoe.FormatError, match="nvfp4 block scale must be"):
        gather(bad, pre)
    bad[f"{pre}.w13.weight_scale"] = t[f"{pre}.w13.weight_scale"][:, :, :5].contiguous()
    with pytest.raises(csfmoe.FormatError, match="matches neither K/16 nor K/32"):
        gather(bad, pre)
    bad = dict(t)
    bad[f"{pre}.w2.weight"] = torch.zeros(2, 256, 32, dtype=torch.uint8)
    bad[f"{pre}.w2.weight_scale"] = torch.zeros(2, 256, 4, dtype=torch.uint8).view(F8)
    with pytest.raises(csfmoe.FormatError, match=r"are not the \[E, 2N, H\] / \[E, H, N\] pair"):
        gather(bad, pre)
    with pytest.raises(csfmoe.InvalidArgument, match="scale_layout must be one of"):
        gather(t, pre, scale_layout="swizzled")
    # Scalar globals broadcast over the experts, as in the C++ loader.
    one = dict(t)
    one[f"{pre}.w13.weight_scale_2"] = torch.tensor(0.5)
    assert torch.equal(gather(one, pre)["w13_global"], torch.full((2,), 0.5))


def test_save_file_roundtrip(gen, tmp_path):
    x = realistic_scales(gen, (2, 128, 8))
    t = {
        "a.bf16": torch.randn(3, 5, generator=gen).to(torch.bfloat16),
        "b.f32.scalar": torch.tensor(1.5),
        "c.bool": torch.rand(7, generator=gen) > 0.5,
        "d.i64": torch.randint(-2**40, 2**40, (4,), generator=gen),
        "e.empty": torch.zeros(0, 3),
        "f.f8": x.view(F8)[:, ::2],  # not contiguous
        "g.csf": csfmoe.CsfScales.compress(x.view(F8)),
    }
    path = tmp_path / "x.safetensors"
    csfmoe.checkpoint.save_file(t, path, {"k": "v"})
    raw = read_raw(path)
    assert raw["f.f8"][:2] == ("F8_E4M3", [2, 64, 8]) and raw["g.csf"][:2] == ("F8_E4M3", [2, 128, 8])
    back = csfmoe.load_file(path)
    for name, want in t.items():
        if isinstance(want, csfmoe.CsfScales):
            want = want.decompress()
        got = back[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert as_bytes(got) == as_bytes(want), name
    assert csfmoe._csfmoe.SafetensorsFile(str(path)).metadata() == {"k": "v"}
    with pytest.raises(csfmoe.InvalidArgument, match="__metadata__"):
        csfmoe.checkpoint.save_file({"__metadata__": torch.zeros(1)}, path)
    with pytest.raises(csfmoe.InvalidArgument, match="expected a torch.Tensor"):
        csfmoe.checkpoint.save_file({"x": [1, 2]}, path)


def test_gather_runs_the_cpp_layer_rules(gen):
    """gather_moe_layer is checked by the C++ rules (resolve_moe_layer): a rule
    added there (activation scales must be positive) holds here too, and an
    NVFP4 layer's input scales come back as the loader reads them."""
    gather = csfmoe.checkpoint.gather_moe_layer
    pre = "model.layers.0.mlp.experts"
    t = stacked_dict(gen)
    good = dict(t)
    good[f"{pre}.w13.input_scale"] = torch.rand(2, generator=gen) + 0.5
    good[f"{pre}.w2.input_scale"] = torch.tensor(0.25)
    L = gather(good, pre)
    assert torch.equal(L["w13_input_scale"], good[f"{pre}.w13.input_scale"])
    assert torch.equal(L["w2_input_scale"], torch.full((2,), 0.25))
    for bad_value in (0.0, -1.0):
        bad = dict(good)
        bad[f"{pre}.w2.input_scale"] = torch.tensor([bad_value])
        with pytest.raises(csfmoe.FormatError, match=rf"'{pre}.w2.input_scale': input scale \[0\] is .* positive"):
            gather(bad, pre)


def test_python_mirrors_the_cli_on_tp_rank_missing_files_and_names(gen, tmp_path):
    src = tmp_path / "layer.safetensors"
    write_safetensors(src, modelopt_layer(gen)[1])
    ck = csfmoe.checkpoint
    # tp without rank, rank without tp, a rank outside the ranks: argument errors in Python's words,
    # and nothing written.
    for kwargs, words in (({"tp": 2}, "tp=2 needs rank="), ({"rank": 1}, "rank=1 needs tp="),
                          ({"tp": 2, "rank": 2}, "rank=2 is outside tp=2's ranks 0..1"),
                          ({"tp": 2, "rank": -1}, "rank=-1 is outside")):
        with pytest.raises(csfmoe.InvalidArgument) as e:
            ck.compress_checkpoint(src, tmp_path / "out", **kwargs)
        assert words in str(e.value)
        assert "--" not in str(e.value)  # no CLI flags
        assert not (tmp_path / "out").exists()
    # A missing source: FileNotFoundError and the package's IO error class, naming the path.
    for call in (lambda: ck.compress_checkpoint(tmp_path / "nope.safetensors", tmp_path / "out"),
                 lambda: ck.load_file(tmp_path / "nope.safetensors")):
        with pytest.raises(FileNotFoundError) as e:
            call()
        assert isinstance(e.value, csfmoe.IoError)
        assert e.value.filename.endswith("nope.safetensors")
    # names= with a name the file lacks: an error naming it, not a silently smaller dict.
    some = next(iter(ck.load_file(src)))
    assert set(ck.load_file(src, names=[some])) == {some}
    with pytest.raises(csfmoe.InvalidArgument) as e:
        ck.load_file(src, names=[some, "model.typo"])
    assert "'model.typo'" in str(e.value) and str(src) in str(e.value)
    # tp=2 with a rank still works.
    ck.compress_checkpoint(src, tmp_path / "r1.safetensors", tp=2, rank=1)
    assert ck.is_csf_container(tmp_path / "r1.safetensors")


def test_load_checkpoint_names_span_the_shards_of_a_folder(gen, tmp_path):
    """names= over a sharded folder: each shard gives what it holds of them;
    only a name in no shard is an error (plain and compressed folders)."""
    _, t = modelopt_layer(gen)
    names = sorted(t)
    cut = 1 + int(torch.randint(0, len(names) - 1, (1,), generator=gen))
    folder = tmp_path / "sharded"
    folder.mkdir()
    shards = {"model-00001-of-00002.safetensors": names[:cut], "model-00002-of-00002.safetensors": names[cut:]}
    for shard, ns in shards.items():
        write_safetensors(folder / shard, {n: t[n] for n in ns})
    index = {"metadata": {"total_size": 0}, "weight_map": {n: s for s, ns in shards.items() for n in ns}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    ck = csfmoe.checkpoint
    ck.compress_checkpoint(folder, tmp_path / "csf")
    # One name from each shard, picked at random.
    pick = [names[int(torch.randint(0, cut, (1,), generator=gen))],
            names[cut + int(torch.randint(0, len(names) - cut, (1,), generator=gen))]]
    for src in (folder, tmp_path / "csf"):
        got = ck.load_checkpoint(src, names=pick, decode=True)
        assert set(got) == set(pick), src
        for n in pick:
            assert got[n].view(torch.uint8).equal(t[n].view(torch.uint8)), n
        with pytest.raises(csfmoe.InvalidArgument) as e:
            ck.load_checkpoint(src, names=pick + ["model.layers.0.mlp.experts.9.typo"])
        assert "'model.layers.0.mlp.experts.9.typo'" in str(e.value) and str(src) in str(e.value)
        assert repr(pick[0]) not in str(e.value)  # only the missing name is named
    with pytest.raises(FileNotFoundError):
        ck.load_checkpoint(tmp_path / "nowhere")


def test_load_file_decode_layout_that_a_native_scale_cannot_take_raises(gen, tmp_path):
    """decode=True with a layout other than the one a block-scale tensor is
    stored native in: an error naming the tensor and both layouts, not the
    stored bytes returned as if converted. CSF tensors are converted."""
    rows, k = 128, 256
    expert = "model.layers.0.mlp.experts.0.gate_proj"
    grid = realistic_scales(gen, (rows, k // 16))
    noise = torch.randint(0, 256, (rows, k // 16), generator=gen, dtype=torch.uint8)  # CSF cannot pay
    swz = in_layout(grid, "nvfp4", "swizzled_128x4")
    assert swz.shape == grid.shape and not torch.equal(swz, grid)
    t = {f"{expert}.weight": torch.randint(0, 256, (rows, k // 2), generator=gen, dtype=torch.uint8),
         f"{expert}.weight_scale": swz.view(torch.float8_e4m3fn),
         "lm_head.weight": torch.randint(0, 256, (rows, k // 2), generator=gen, dtype=torch.uint8),
         "lm_head.weight_scale": noise.view(torch.float8_e4m3fn)}
    plain = tmp_path / "swizzled.safetensors"
    write_safetensors(plain, t, {"csfmoe.scale_layout": "swizzled_128x4"})
    ck = csfmoe.checkpoint
    ck.compress_checkpoint(plain, tmp_path / "c.safetensors")
    entries = csfmoe._csfmoe.SafetensorsFile(str(tmp_path / "c.safetensors")).csf_entries()
    assert f"{expert}.weight_scale" in entries and "lm_head.weight_scale" not in entries
    for path in (plain, tmp_path / "c.safetensors"):
        with pytest.raises(csfmoe.InvalidArgument) as e:
            ck.load_file(path, decode=True, layout="row_major")
        msg = str(e.value)
        assert "'lm_head.weight_scale'" in msg and "swizzled_128x4" in msg and "layout='row_major'" in msg, msg
        # The stored layout, or no layout: the stored bytes.
        for kw in ({}, {"layout": "swizzled_128x4"}):
            got = ck.load_file(path, decode=True, **kw)
            assert got["lm_head.weight_scale"].view(torch.uint8).equal(noise)
            assert got[f"{expert}.weight_scale"].view(torch.uint8).equal(swz)
    # Only the plain file's scale is stuck; the container's CSF tensor converts.
    with pytest.raises(csfmoe.InvalidArgument, match=f"'{expert}.weight_scale'"):
        ck.load_file(plain, decode=True, layout="row_major", names=[f"{expert}.weight_scale"])
    got = ck.load_file(tmp_path / "c.safetensors", decode=True, layout="row_major", names=[f"{expert}.weight_scale"])
    # A layout other than the source's decodes to [E, R, C] of that layout (CsfScales.native_shape).
    assert got[f"{expert}.weight_scale"].view(torch.uint8).equal(grid.reshape(1, *grid.shape))
    with pytest.raises(csfmoe.InvalidArgument, match="layout"):
        ck.load_file(plain, decode=True, layout="column_major")


def test_compress_refusals_speak_of_arguments_and_say_what_to_do(gen, tmp_path):
    """compress_checkpoint's refusals name Python arguments, not CLI flags,
    say what to do instead, and write nothing."""
    _, t = modelopt_layer(gen)
    src = tmp_path / "layer.safetensors"
    write_safetensors(src, t)
    ck = csfmoe.checkpoint
    out = tmp_path / "out.safetensors"

    def refused(call, *words):
        with pytest.raises(csfmoe.InvalidArgument) as e:
            call()
        msg = str(e.value)
        for w in words:
            assert w in msg, msg
        assert "--" not in msg, msg
        assert not out.exists()

    refused(lambda: ck.compress_checkpoint(src, out, schema="b12x", mxfp4_slab=False),
            "mxfp4_slab=False", "schema='b12x'")
    # A container, and a file as b12x / vLLM write it (its planes, no csfmoe metadata).
    ck.compress_checkpoint(src, tmp_path / "c.safetensors")
    refused(lambda: ck.compress_checkpoint(tmp_path / "c.safetensors", out),
            "already a CSF container", "decompress restores the original")
    ck.compress_checkpoint(src, tmp_path / "b12x-container.safetensors", schema="b12x")
    raw = read_raw(tmp_path / "b12x-container.safetensors")  # without its __metadata__
    assert any(n.endswith(".nvfp4_csf_fixed") for n in raw)
    b12x_file = tmp_path / "b12x.safetensors"
    header, blobs, off = {}, [], 0
    for name, (dtype, shape, b) in raw.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    b12x_file.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    assert not ck.is_csf_container(b12x_file)
    refused(lambda: ck.compress_checkpoint(b12x_file, out), "written by b12x / vLLM", "decompress it first")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("e", [1, 3])
@pytest.mark.parametrize("folder", [False, True])
def test_b12x_schema_splits_stacked_experts(gen, tmp_path, fmt, e, folder):
    """schema='b12x' of stacked [E, R, C] tensors (csf synth's names): stored
    per expert under b12x's names, fused gate/up rows in [gate; up] order;
    what comes back is each expert's slice of the stacked input, byte for byte."""
    pre, h, n = "model.layers.0.mlp.experts", 256, 128
    if fmt == "nvfp4":
        src_t = {f"{pre}.w13.weight": torch.randint(0, 256, (e, 2 * n, h // 2), generator=gen, dtype=torch.uint8),
                 f"{pre}.w13.weight_scale": realistic_scales(gen, (e, 2 * n, h // 16)).view(torch.float8_e4m3fn),
                 f"{pre}.w13.weight_scale_2": torch.rand(e, generator=gen) + 0.5,
                 f"{pre}.w2.weight": torch.randint(0, 256, (e, h, n // 2), generator=gen, dtype=torch.uint8),
                 f"{pre}.w2.weight_scale": realistic_scales(gen, (e, h, n // 16)).view(torch.float8_e4m3fn),
                 f"{pre}.w2.weight_scale_2": torch.rand(e, generator=gen) + 0.5}
        fused = {"w13.weight": ".weight", "w13.weight_scale": ".weight_scale", "w13.weight_scale_2": ".weight_scale_2"}
        down = {"w2.weight": ".weight", "w2.weight_scale": ".weight_scale", "w2.weight_scale_2": ".weight_scale_2"}
        gate, up, dn = "gate_proj", "up_proj", "down_proj"
    else:
        src_t = {f"{pre}.gate_up_proj_blocks": torch.randint(0, 256, (e, 2 * n, h // 32, 16), generator=gen,
                                                              dtype=torch.uint8),
                 f"{pre}.gate_up_proj_scales": torch.randint(118, 130, (e, 2 * n, h // 32), generator=gen,
                                                              dtype=torch.uint8),
                 f"{pre}.down_proj_blocks": torch.randint(0, 256, (e, h, n // 32, 16), generator=gen, dtype=torch.uint8),
                 f"{pre}.down_proj_scales": torch.randint(118, 130, (e, h, n // 32), generator=gen, dtype=torch.uint8)}
        fused = {"gate_up_proj_blocks": ".weight", "gate_up_proj_scales": ".weight_scale"}
        down = {"down_proj_blocks": ".weight", "down_proj_scales": ".weight_scale"}
        gate, up, dn = "w1", "w3", "w2"
    want = {}
    for x in range(e):
        for stacked_name, leaf in fused.items():
            s = src_t[f"{pre}.{stacked_name}"][x]
            if s.dim() == 0:  # per-expert global scale: shared by gate and up
                want[f"{pre}.{x}.{gate}{leaf}"] = want[f"{pre}.{x}.{up}{leaf}"] = s
            else:
                want[f"{pre}.{x}.{gate}{leaf}"], want[f"{pre}.{x}.{up}{leaf}"] = s[:n], s[n:]
        for stacked_name, leaf in down.items():
            want[f"{pre}.{x}.{dn}{leaf}"] = src_t[f"{pre}.{stacked_name}"][x]
    src = tmp_path / "in"
    if folder:
        src.mkdir()
        write_safetensors(src / "model.safetensors", src_t)
    else:
        src = tmp_path / "in.safetensors"
        write_safetensors(src, src_t)
    dst = tmp_path / "b12x"
    csfmoe.checkpoint.compress_checkpoint(src, dst, schema="b12x")
    raw = read_raw(dst / "model.safetensors" if folder else dst)
    assert sum(k.endswith(f".{fmt}_csf_fixed") for k in raw) == 3 * e
    assert not any(".w13." in k or "gate_up_proj" in k for k in raw)
    got = csfmoe.checkpoint.load_checkpoint(dst, decode=True)
    assert set(got) == set(want)
    for name, w in want.items():
        g = got[name]
        assert g.reshape(-1).view(torch.uint8).equal(w.contiguous().reshape(-1).view(torch.uint8)), name
    # Sorted entries: only the input and the output, no hidden split copy left.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([src.name, dst.name])


def test_b12x_schema_refuses_stacked_experts_it_cannot_split(gen, tmp_path):
    """w13 rows that do not halve into gate and up: InvalidArgument naming
    the file, the tensor and the reason; nothing written."""
    pre = "model.layers.0.mlp.experts"
    src, out = tmp_path / "odd.safetensors", tmp_path / "out.safetensors"
    write_safetensors(src, {f"{pre}.w13.weight": torch.zeros(2, 33, 128, dtype=torch.uint8),
                            f"{pre}.w13.weight_scale": realistic_scales(gen, (2, 33, 16)).view(torch.float8_e4m3fn)})
    with pytest.raises(csfmoe.InvalidArgument) as e:
        csfmoe.checkpoint.compress_checkpoint(src, out, schema="b12x")
    for w in ("odd.safetensors", f"{pre}.w13.weight", "33 rows do not split into gate and up halves"):
        assert w in str(e.value), str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["odd.safetensors"]
