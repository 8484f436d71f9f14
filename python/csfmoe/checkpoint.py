"""Reading safetensors files and CSF containers into torch tensors, and
gathering the tensors of a ModelOpt NVFP4 MoE layer."""

from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Optional, Union

import torch

from . import _csfmoe as _C
from ._errors import FormatError, InvalidArgument
from .scales import _DTYPE_BY_NAME, CsfScales

__all__ = ["load_file", "load_checkpoint", "is_csf_container", "stack_scales", "gather_moe_layer",
           "compress_checkpoint"]

_TORCH_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": getattr(torch, "uint16", None),
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": getattr(torch, "uint32", None),
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "U64": getattr(torch, "uint64", None),
    "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
    "F8_E5M2": getattr(torch, "float8_e5m2", None),
    "F8_E8M0": getattr(torch, "float8_e8m0fnu", None),
}

Loaded = Union[torch.Tensor, CsfScales]


def is_csf_container(path) -> bool:
    return bool(_C.is_csf_container(os.fspath(path)))


def compress_checkpoint(src, dst, layout: str = "row_major", threads: int = 0):
    """csf compress: writes a container (file or folder) at dst; returns
    (scale source bytes, scale stored bytes)."""
    return tuple(_C.compress_checkpoint(os.fspath(src), os.fspath(dst), layout, threads))


def _place(raw: torch.Tensor, device: torch.device) -> torch.Tensor:
    # raw views the read-only file mapping: always copy it out (clone gives
    # an aligned, writable CPU tensor).
    return raw.clone() if device.type == "cpu" else raw.to(device)


def _typed(raw: torch.Tensor, dtype_name: str, shape, what: str) -> torch.Tensor:
    dt = _TORCH_DTYPES.get(dtype_name)
    if dt is None:
        raise FormatError(f"{what}: dtype {dtype_name} has no torch equivalent in this torch build")
    shape = [int(s) for s in shape]
    if dt == torch.bool:
        return raw.view(torch.bool).reshape(shape)
    return raw.view(dt).reshape(shape)


def load_file(path, device: Union[str, torch.device] = "cpu", decode: bool = False,
              layout: Optional[str] = None, names=None) -> Dict[str, Loaded]:
    """Read a safetensors file (plain, or a csfmoe container) into a dict.

    Native tensors come back as torch tensors on `device`. Each CSF-compressed
    scale tensor comes back as CsfScales on `device` (validated on the host
    first, so device kernels can trust it) or, with decode=True, as its native
    tensor (dtype and shape of the original; `layout` picks the decoded
    layout, default the source layout). `names` limits what is read."""
    device = torch.device(device)
    path = os.fspath(path)
    f = _C.SafetensorsFile(path)
    entries = f.csf_entries() or {}
    part_of = {}
    for name, e in entries.items():
        for p in e["parts"]:
            part_of[p] = name
    wanted = None if names is None else set(names)
    out: Dict[str, Loaded] = {}
    for info in f.tensors():
        name = info["name"]
        if name in part_of:
            continue
        if wanted is not None and name not in wanted:
            continue
        raw = f.bytes(name)
        out[name] = _typed(_place(raw, device), info["dtype"], info["shape"], f"{path}: tensor '{name}'")
    for name, e in entries.items():
        if wanted is not None and name not in wanted:
            continue
        out[name] = _load_csf(f, path, name, e, device, decode, layout)
    return out


def _load_csf(f, path: str, name: str, e: dict, device, decode: bool, layout):
    experts, rows, cols = (int(x) for x in e["grid"])
    host = []
    for part, dt in zip(e["parts"], ("U8", "U32", "U32", "U32")):
        raw = f.bytes(part)
        if dt == "U32":
            if raw.numel() % 4:
                raise FormatError(f"{path}: tensor '{part}': {raw.numel()} bytes is not a whole number of U32")
            raw = raw.clone().view(torch.int32)
        host.append(raw)
    what = f"{path}: tensor '{name}'"
    try:
        csf = CsfScales(*host, format=e["format"], layout=e["layout"], experts=experts, rows=rows, cols=cols,
                        dtype=_DTYPE_BY_NAME.get(e["dtype"], torch.uint8), shape=tuple(e["shape"]))
        csf.validate()
    except (InvalidArgument, FormatError) as err:
        raise FormatError(f"{what}: {err}") from err
    if decode:
        native = csf.decompress(layout)
        return native if device.type == "cpu" else native.to(device)
    if device.type == "cpu":
        # fixed still views the mapping: own it.
        csf.fixed = csf.fixed.clone()
        return csf
    return csf.to(device)


def _shard_files(folder: str) -> List[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, "rb") as fh:
            weight_map = json.load(fh).get("weight_map", {})
        shards = list(dict.fromkeys(weight_map.values()))
        for s in shards:
            if os.path.basename(s) != s or s in (".", ".."):
                raise FormatError(f"{index}: shard name '{s}' is not a plain file name")
        return [os.path.join(folder, s) for s in shards]
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors"))


def load_checkpoint(path, device: Union[str, torch.device] = "cpu", decode: bool = False,
                    layout: Optional[str] = None, names=None) -> Dict[str, Loaded]:
    """load_file over a file or a (sharded) checkpoint folder."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return load_file(path, device, decode, layout, names)
    out: Dict[str, Loaded] = {}
    for shard in _shard_files(path):
        out.update(load_file(shard, device, decode, layout, names))
    return out


def stack_scales(items: List[CsfScales]) -> CsfScales:
    """Concatenate CsfScales of the same format, layout and grid rows/cols
    along the expert axis (per-expert tensors of a checkpoint -> one layer
    tensor). Host parts only."""
    if not items:
        raise InvalidArgument("stack_scales: empty list")
    first = items[0]
    for i, s in enumerate(items):
        if (s.format, s.layout, s.rows, s.cols) != (first.format, first.layout, first.rows, first.cols):
            raise InvalidArgument(
                f"stack_scales: item {i} is {s.format} {s.layout} [{s.rows}, {s.cols}], item 0 is "
                f"{first.format} {first.layout} [{first.rows}, {first.cols}]")
        if s.device.type != "cpu":
            raise InvalidArgument(f"stack_scales: item {i} is on {s.device}; stack on the host, then .to()")
    fixed, exc, rp, pi = [], [], [], []
    base = 0
    for s in items:
        # Prefix entries are global record indices: shift by the records before.
        n = s.exceptions.numel()
        fixed.append(s.fixed)
        exc.append(s.exceptions.view(torch.int32))
        rp.append(s.row_prefix.view(torch.int32)[:-1].to(torch.int64) + base)
        pi.append(s.partition_index.view(torch.int32)[:-1].to(torch.int64) + base)
        base += n
    if base >= 2 ** 32:
        raise InvalidArgument(f"stack_scales: {base} exception records do not fit 32-bit prefixes")
    end = torch.tensor([base], dtype=torch.int64)

    def words(chunks):
        w = torch.cat(chunks + [end])
        return torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32)

    experts = sum(s.experts for s in items)
    shape = None
    if all(len(s.shape) == 2 for s in items):
        shape = (experts, *first.shape)
    elif all(len(s.shape) >= 3 for s in items):
        shape = (experts, *first.shape[-2:])
    out = CsfScales(torch.cat(fixed), torch.cat(exc), words(rp), words(pi), format=first.format,
                    layout=first.layout, experts=experts, rows=first.rows, cols=first.cols, dtype=first.dtype,
                    shape=shape, validated=all(s.validated for s in items))
    return out


_EXPERT_RE = re.compile(r"^(?P<layer>.*\.experts)\.(?P<idx>\d+)\.(?P<proj>[A-Za-z0-9_]+)\.(?P<leaf>.+)$")

# ModelOpt / HF names of the three projections.
_PROJ = {"gate_proj": "w1", "w1": "w1", "up_proj": "w3", "w3": "w3", "down_proj": "w2", "w2": "w2"}


def gather_moe_layer(tensors: Dict[str, Loaded], layer: str) -> Dict[str, object]:
    """Collect a ModelOpt NVFP4 MoE layer from loaded tensors.

    Accepts per-expert names (`{layer}.{i}.{gate_proj|up_proj|down_proj}.
    {weight, weight_scale, weight_scale_2, input_scale}`, also w1/w3/w2) and
    returns the stacked layer: w13 uint8 [E, 2N, H/2] (gate rows then up
    rows), w2 uint8 [E, H, N/2], w13_scale / w2_scale as tensors or CsfScales
    (CSF parts are stacked without decoding), w13_global / w2_global float32
    [E] (weight_scale_2; gate and up must share theirs), and
    w13_input_scale / w2_input_scale float32 [E] when present."""
    per: Dict[int, Dict[str, Dict[str, Loaded]]] = {}
    for name, t in tensors.items():
        m = _EXPERT_RE.match(name)
        if not m or m["layer"] != layer or m["proj"] not in _PROJ:
            continue
        per.setdefault(int(m["idx"]), {}).setdefault(_PROJ[m["proj"]], {})[m["leaf"]] = t
    if not per:
        raise InvalidArgument(f"gather_moe_layer: no expert tensors under '{layer}'")
    experts = sorted(per)
    if experts != list(range(len(experts))):
        raise FormatError(f"gather_moe_layer: '{layer}' experts are not 0..{len(experts) - 1}")

    def get(e, proj, leaf):
        try:
            return per[e][proj][leaf]
        except KeyError:
            raise FormatError(f"gather_moe_layer: missing {layer}.{e}.{proj}.{leaf}") from None

    def cat_scales(items):
        if all(isinstance(s, CsfScales) for s in items):
            return stack_scales(items)
        if any(isinstance(s, CsfScales) for s in items):
            items = [s.decompress() if isinstance(s, CsfScales) else s for s in items]
        return torch.stack(items)

    def scalar(t):
        return t.reshape(-1)[0].to(torch.float32)

    out: Dict[str, object] = {}
    out["w13"] = torch.stack([torch.cat([get(e, "w1", "weight"), get(e, "w3", "weight")]) for e in experts])
    out["w2"] = torch.stack([get(e, "w2", "weight") for e in experts])
    w13s = []
    for e in experts:
        g, u = get(e, "w1", "weight_scale"), get(e, "w3", "weight_scale")
        if isinstance(g, CsfScales) or isinstance(u, CsfScales):
            # gate and up are separate grids in the file; the layer's w13 grid
            # is [gate; up] of 2N rows, so re-encode it (exact).
            fmt = g.format if isinstance(g, CsfScales) else u.format
            g = g.decompress() if isinstance(g, CsfScales) else g
            u = u.decompress() if isinstance(u, CsfScales) else u
            w13s.append(CsfScales.compress(torch.cat([g, u]), fmt))
        else:
            w13s.append(torch.cat([g, u]))
    out["w13_scale"] = cat_scales(w13s)
    out["w2_scale"] = cat_scales([get(e, "w2", "weight_scale") for e in experts])
    g13 = []
    for e in experts:
        a, b = scalar(get(e, "w1", "weight_scale_2")), scalar(get(e, "w3", "weight_scale_2"))
        if not torch.equal(a, b):
            raise FormatError(f"gather_moe_layer: {layer}.{e}: gate and up weight_scale_2 differ ({a} vs {b})")
        g13.append(a)
    out["w13_global"] = torch.stack(g13)
    out["w2_global"] = torch.stack([scalar(get(e, "w2", "weight_scale_2")) for e in experts])
    if all("input_scale" in per[e].get("w1", {}) for e in experts):
        out["w13_input_scale"] = torch.stack([scalar(get(e, "w1", "input_scale")) for e in experts])
    if all("input_scale" in per[e].get("w2", {}) for e in experts):
        out["w2_input_scale"] = torch.stack([scalar(get(e, "w2", "input_scale")) for e in experts])
    return out

