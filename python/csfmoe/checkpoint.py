"""Reading (and writing) safetensors files and CSF containers as torch
tensors, and gathering the tensors of one MoE layer (stacked, gpt-oss or
per-expert ModelOpt names)."""

from __future__ import annotations

import os
import re
from typing import Dict, List, Optional, Union

import torch

from . import _csfmoe as _C
from . import ops
from ._errors import FormatError, InvalidArgument, Unsupported
from .scales import _DTYPE_BY_NAME, CsfScales

__all__ = ["load_file", "load_checkpoint", "save_file", "is_csf_container", "stack_scales",
           "gather_moe_layer", "compress_checkpoint"]

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


def compress_checkpoint(src, dst, layout: str = "", threads: int = 0):
    """csf compress: writes a container (file or folder) at dst; returns
    (scale source bytes, scale stored bytes). layout "" takes each file's
    csfmoe.scale_layout tag (else row_major); a layout that contradicts the
    tag is an error."""
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
              layout: Optional[str] = None, names=None, threads: int = 0) -> Dict[str, Loaded]:
    """Read a safetensors file (plain, or a csfmoe container) into a dict.

    Native tensors come back as torch tensors on `device`. Each CSF-compressed
    scale tensor comes back as CsfScales on `device` or, with decode=True, as
    its native tensor (dtype and shape of the original; `layout` picks the
    decoded layout, default the source layout). `names` limits what is read.

    The C++ reader does the reading and the checks (csfmoe/checkpoint_reader.hpp).
    In a container every tensor returned is first checked against the CRC32
    of the restore record: a native tensor over its stored bytes, a CSF tensor
    by validating its parts and decoding them once on the host (`threads`
    threads). A mismatch raises CorruptData, malformed parts FormatError, each
    naming the file and the tensor. A plain safetensors file has no CRCs: it
    is only checked structurally."""
    device = torch.device(device)
    path = os.fspath(path)
    f = _C.SafetensorsFile(path)
    entries = f.csf_entries() or {}
    wanted = None if names is None else set(names)
    out: Dict[str, Loaded] = {}
    for info in f.tensors():
        name = info["name"]
        if wanted is not None and name not in wanted:
            continue
        what = f"{path}: tensor '{name}'"
        if name in entries:
            out[name] = _load_csf(f, name, entries[name], device, decode, layout, threads, what)
        else:
            out[name] = _typed(_place(f.bytes(name), device), info["dtype"], info["shape"], what)
    return out


def _load_csf(f, name: str, e: dict, device, decode: bool, layout, threads: int, what: str):
    shape = tuple(int(x) for x in e["shape"])
    dtype = _DTYPE_BY_NAME.get(e["dtype"], torch.uint8)
    if decode and (layout is None or layout == e["layout"]):
        native = f.read(name, threads).view(dtype).reshape(shape)
        return native if device.type == "cpu" else native.to(device)
    experts, rows, cols = (int(x) for x in e["grid"])
    parts = f.csf_parts(name, threads)
    csf = CsfScales(*parts, format=e["format"], layout=e["layout"], experts=experts, rows=rows, cols=cols,
                    dtype=dtype, shape=shape, validated=True, crc32=int(e["crc32"]), origin=what)
    if decode:
        native = csf.decompress(layout, threads)
        return native if device.type == "cpu" else native.to(device)
    return csf if device.type == "cpu" else csf.to(device)


_ST_NAME = {}
for _k, _v in _TORCH_DTYPES.items():
    if _v is not None:
        _ST_NAME.setdefault(_v, _k)


def save_file(tensors: Dict[str, Loaded], path, metadata: Optional[Dict[str, str]] = None) -> None:
    """Write a plain safetensors file at `path`, which must not exist. CsfScales
    are written as their native tensor (decoded on the CPU); `csf compress` /
    compress_checkpoint makes a container of the result. The C++ writer
    builds the file as a temporary beside `path` and renames it into place
    when complete: a failed call leaves nothing behind."""
    items = []
    for name, t in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise InvalidArgument(f"save_file: {path}: invalid tensor name {name!r}")
        if isinstance(t, CsfScales):
            t = t.decompress()
        if not isinstance(t, torch.Tensor):
            raise InvalidArgument(f"save_file: {path}: tensor '{name}': expected a torch.Tensor or CsfScales, "
                                  f"got {type(t).__name__}")
        dt = _ST_NAME.get(t.dtype)
        if dt is None:
            raise InvalidArgument(f"save_file: {path}: tensor '{name}': dtype {t.dtype} has no safetensors name")
        # Contiguous host bytes (a view where the tensor allows it).
        b = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        items.append((name, dt, [int(s) for s in t.shape], b))
    md = None if metadata is None else {str(k): str(v) for k, v in metadata.items()}
    _C.save_safetensors(os.fspath(path), items, md)


def load_checkpoint(path, device: Union[str, torch.device] = "cpu", decode: bool = False,
                    layout: Optional[str] = None, names=None, threads: int = 0) -> Dict[str, Loaded]:
    """load_file over a file or a (sharded) checkpoint folder: the shards
    that model.safetensors.index.json names, or else every *.safetensors
    file in the folder. A tensor name found in two shards is a FormatError."""
    path = os.fspath(path)
    out: Dict[str, Loaded] = {}
    where: Dict[str, str] = {}
    for shard in _C.checkpoint_files(path):
        shard = os.fspath(shard)
        for name, t in load_file(shard, device, decode, layout, names, threads).items():
            if name in where:
                raise FormatError(f"{shard}: tensor '{name}' is also in {where[name]}")
            where[name] = shard
            out[name] = t
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


# ---------------------------------------------------------------------------
# gather_moe_layer: the rules of the C++ load_moe_layer (src/moe/moe_checkpoint.cpp)
# ---------------------------------------------------------------------------
# Per-expert projection names (gate, up, down), as the C++ loader knows them.
_PER_EXPERT = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
_NUM_RE = re.compile(r"[0-9]{1,9}")
_SCALE_DTYPES = {
    "nvfp4": tuple(d for d in (getattr(torch, "float8_e4m3fn", None), torch.uint8) if d is not None),
    "mxfp4": tuple(d for d in (torch.uint8, getattr(torch, "float8_e8m0fnu", None)) if d is not None),
}
_GROUP = {"nvfp4": 16, "mxfp4": 32}
_SHOW = 8  # missing tensor names an error lists before "and N more"


def _natural_key(s: str):
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"([0-9]+)", s) if p]


def _layer_keys(tensors) -> List[str]:
    """MoE layer keys of the block-scale tensors in `tensors` (for messages)."""
    keys = set()
    for n in tensors:
        if n.endswith(".weight_scale") or n.endswith("_scales"):
            pos = n.rfind(".experts.")
            if pos >= 0:
                keys.add(n[:pos + len(".experts")])
            elif n.startswith("experts."):
                keys.add("experts")
    return sorted(keys, key=_natural_key)


def _names(names) -> str:
    names = list(names)
    shown = ", ".join(f"'{n}'" for n in names[:_SHOW])
    return shown + (f" and {len(names) - _SHOW} more" if len(names) > _SHOW else "")


def _shape(x) -> List[int]:
    return [int(s) for s in x.shape]


def _unswizzle(raw: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[.., Rp, Cp] bytes in swizzled_128x4 order -> row-major [.., rows, cols]
    (the index map is csfmoe::swizzled_index, formats.hpp)."""
    rp, cp = int(raw.shape[-2]), int(raw.shape[-1])
    idx = _C.swizzled_indices(rows, cols, cp)
    flat = raw.reshape(-1, rp * cp).view(torch.uint8)
    out = flat[:, idx.to(raw.device)]
    return out.reshape(*raw.shape[:-2], rows, cols).view(raw.dtype)


class _Reader:
    """Checks and reads one layer's tensors; every error names the layer."""

    def __init__(self, tensors, layer: str, scale_layout: str):
        self.t, self.layer, self.scale_layout = tensors, layer, scale_layout

    def fail(self, name: str, why: str):
        raise FormatError(f"gather_moe_layer: layer '{self.layer}': tensor '{name}': {why}")

    def require(self, names, layout: str) -> None:
        missing = [n for n in names if n not in self.t]
        if missing:
            raise FormatError(f"gather_moe_layer: layer '{self.layer}' ({layout} layout): missing tensors "
                              f"{_names(missing)}")

    def fp4(self, wname: str, sname: str, stacked: bool, blocks: bool):
        """(weight [E?, R, K/2], scales row-major [E?, R, K/g] as tensor or
        CsfScales, format, E, R, K): C++ LayerReader::fp4."""
        w, s = self.t[wname], self.t[sname]
        lead = 1 if stacked else 0
        if not isinstance(w, torch.Tensor) or w.dtype != torch.uint8:
            self.fail(wname, f"packed FP4 weight must be uint8, got {getattr(w, 'dtype', type(w).__name__)}")
        rank = lead + (3 if blocks else 2)
        if w.dim() != rank or (blocks and w.shape[-1] != 16):
            want = ("[E, R, K/32, 16]" if stacked else "[R, K/32, 16]") if blocks else (
                "[E, R, K/2]" if stacked else "[R, K/2]")
            self.fail(wname, f"shape {_shape(w)} is not {want}")
        e = int(w.shape[0]) if stacked else 1
        r = int(w.shape[lead])
        k = int(w.shape[lead + 1]) * (32 if blocks else 2)
        if e == 0 or r == 0 or k == 0:
            self.fail(wname, f"empty shape {_shape(w)}")
        csf = isinstance(s, CsfScales)
        if not csf and not isinstance(s, torch.Tensor):
            self.fail(sname, f"expected a tensor or CsfScales, got {type(s).__name__}")
        layout = s.layout if csf else self.scale_layout
        shape = tuple(int(x) for x in s.shape)
        if len(shape) != lead + 2 or (stacked and shape[0] != e):
            self.fail(sname, f"shape {list(shape)} does not match weight '{wname}' {_shape(w)}")
        rs, cs = shape[-2:]
        fmt = None
        for f in ("nvfp4", "mxfp4"):
            g = _GROUP[f]
            if k % g or (blocks and f != "mxfp4"):
                continue
            want_r, want_c = r, k // g
            if layout == "swizzled_128x4":
                want_r, want_c = -(-want_r // 128) * 128, -(-want_c // 4) * 4
            if (rs, cs) == (want_r, want_c):
                fmt = f
                break
        if fmt is None:
            self.fail(sname, f"{layout} scale grid {list(shape)} matches neither K/16 nor K/32 blocks of weight "
                             f"'{wname}' {_shape(w)} (K = {k})")
        if s.dtype not in _SCALE_DTYPES[fmt]:
            names = " or ".join(str(d).replace("torch.", "") for d in _SCALE_DTYPES[fmt])
            self.fail(sname, f"{fmt} block scale must be {names}, got {str(s.dtype).replace('torch.', '')}")
        if csf and s.format != fmt:
            self.fail(sname, f"CSF entry says {s.format}, the weight '{wname}' geometry says {fmt}")
        c = k // _GROUP[fmt]
        # Scales leave row-major [E?, R, K/g], as the MoE API takes them.
        if layout != "row_major" and not csf:
            s = _unswizzle(s, r, c)
        elif layout != "row_major" and (rs, cs) != (r, c):
            # A padded swizzled grid decodes to [E, Rp, Cp]: keep the true grid.
            # (An aligned one decodes to the row-major grid as is: stays CSF.)
            full = s.decompress("row_major").reshape(e, rs, cs)
            s = full[:, :r, :c].contiguous().reshape(*shape[:-2], r, c)
        return (w.reshape(e, r, k // 2) if stacked else w), s, fmt, e, r, k

    def globals(self, name: str, experts: int, stacked: bool) -> torch.Tensor:
        """float32 [E] from [] / [1] (broadcast) or [E] (stacked only)."""
        t = self.t[name]
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            self.fail(name, f"global scale must be float32, got {getattr(t, 'dtype', type(t).__name__)}")
        one = t.dim() == 0 or tuple(t.shape) == (1,)
        if not one and not (stacked and tuple(t.shape) == (experts,)):
            self.fail(name, f"global scale shape {_shape(t)} is not [], [1]" + (f" or [{experts}]" if stacked else ""))
        bad = (~torch.isfinite(t.reshape(-1))).nonzero()
        if bad.numel():
            i = int(bad[0])
            self.fail(name, f"global scale [{i}] is {float(t.reshape(-1)[i])}")
        v = t.reshape(-1).cpu()
        return (v.expand(experts) if one else v).contiguous()

    def no_global(self, name: str) -> None:
        if name in self.t:
            raise Unsupported(f"gather_moe_layer: layer '{self.layer}': tensor '{name}': an MXFP4 layer with a "
                              "global scale is not supported (the MoE API applies none to MXFP4)")

    def check_pair(self, f13, e13, r13, k13, n13, f2, e2, r2, k2, n2) -> None:
        if f13 != f2 or e13 != e2 or r13 % 2 or r2 != k13 or k2 * 2 != r13:
            raise FormatError(
                f"gather_moe_layer: layer '{self.layer}': '{n13}' ({f13} E={e13} rows={r13} K={k13}) and '{n2}' "
                f"({f2} E={e2} rows={r2} K={k2}) are not the [E, 2N, H] / [E, H, N] pair of one layer")


def _native(s):
    """A gathered scale grid as a row-major tensor of its shape (CsfScales
    here are row-major or aligned swizzled: both decode to that grid)."""
    if not isinstance(s, CsfScales):
        return s
    return s.decompress("row_major").reshape(s.shape)


def _cat_scales(items):
    """Stack per-expert grids; CsfScales stay CSF (parts concatenated, no decode)."""
    if all(isinstance(s, CsfScales) for s in items):
        return stack_scales(items)
    return torch.stack([_native(s) for s in items])


def gather_moe_layer(tensors: Dict[str, Loaded], layer: str, scale_layout: str = "row_major") -> Dict[str, object]:
    """Collect one MoE layer from loaded tensors (load_file / load_checkpoint),
    with the rules of the C++ load_moe_layer (csfmoe/moe_checkpoint.hpp).

    Layouts, for a layer key L such as "model.layers.3.mlp.experts":
      stacked (csf synth, ModelOpt names): L.w13.weight [E, 2N, H/2],
        L.w13.weight_scale [E, 2N, H/g], L.w13.weight_scale_2 [] | [1] | [E]
        (NVFP4 only), the same for w2 with [E, H, N/2], [E, H, N/g];
      gpt-oss MXFP4: L.gate_up_proj_blocks [E, 2N, H/32, 16] with
        L.gate_up_proj_scales [E, 2N, H/32], L.down_proj_blocks / _scales;
      per-expert (ModelOpt): L.<e>.{gate_proj|up_proj|down_proj} (or w1/w3/w2)
        .weight, .weight_scale, .weight_scale_2 [] | [1], experts 0..E-1.
    The format (nvfp4: K/16 scale columns, mxfp4: K/32) follows from the
    shapes. `scale_layout` is the layout of native (not CSF) scale tensors:
    what the file's "csfmoe.scale_layout" metadata says (CsfScales carry
    their own).

    Returns format ("nvfp4" | "mxfp4"), w13 uint8 [E, 2N, H/2] (gate rows
    then up rows), w2 uint8 [E, H, N/2], w13_scale / w2_scale row-major
    [E, rows, K/g] as tensors or CsfScales (stacked CSF scales pass through
    undecoded), w13_global / w2_global float32 [E] (ones for MXFP4), and
    w13_input_scale / w2_input_scale float32 [E] when the layer has them.
    Raises InvalidArgument when no layout matches (naming the layers the
    tensors hold), FormatError for missing or malformed tensors and
    Unsupported where the C++ loader refuses (expert biases, gate and up
    global scales that differ, MXFP4 global scales)."""
    ops._check_choice("scale_layout", scale_layout, ops.LAYOUTS)
    L = layer
    rd = _Reader(tensors, L, scale_layout)
    found = []
    if f"{L}.w13.weight" in tensors or f"{L}.w13.weight_scale" in tensors:
        found.append("stacked")
    if f"{L}.gate_up_proj_blocks" in tensors or f"{L}.gate_up_proj_scales" in tensors:
        found.append("gpt-oss")
    ids, naming = set(), set()
    pre = L + "."
    for n in tensors:
        if not n.startswith(pre):
            continue
        num, dot, proj = n[len(pre):].partition(".")
        if not dot or not _NUM_RE.fullmatch(num):
            continue
        for i, trio in enumerate(_PER_EXPERT):
            if any(proj.startswith(p + ".") for p in trio):
                naming.add(i)
                ids.add(int(num))
    if ids:
        found.append("per-expert")
    if not found:
        keys = _layer_keys(tensors)
        raise InvalidArgument(
            f"gather_moe_layer: no MoE layer '{L}': none of '{L}.w13.weight' + '{L}.w13.weight_scale' (stacked), "
            f"'{L}.gate_up_proj_blocks' + '{L}.gate_up_proj_scales' (gpt-oss) or '{L}.<e>.gate_proj.weight' ... "
            f"(per-expert) is there; layers found: {', '.join(keys) if keys else 'none'}")
    if len(found) > 1 or len(naming) > 1:
        raise FormatError(f"gather_moe_layer: layer '{L}' mixes stacked, gpt-oss and per-expert tensor names")

    out: Dict[str, object] = {}
    if found[0] != "per-expert":
        oss = found[0] == "gpt-oss"
        # The MoE API has no expert biases: running without them would be silently wrong.
        for b in (".gate_up_proj_bias", ".down_proj_bias", ".w13.bias", ".w2.bias"):
            if L + b in tensors:
                raise Unsupported(f"gather_moe_layer: tensor '{L}{b}': expert biases are not supported by the MoE API")
        n13, s13n = (f"{L}.gate_up_proj_blocks", f"{L}.gate_up_proj_scales") if oss else (
            f"{L}.w13.weight", f"{L}.w13.weight_scale")
        n2, s2n = (f"{L}.down_proj_blocks", f"{L}.down_proj_scales") if oss else (
            f"{L}.w2.weight", f"{L}.w2.weight_scale")
        rd.require((n13, s13n, n2, s2n), found[0])
        w13, s13, f13, e13, r13, k13 = rd.fp4(n13, s13n, True, oss)
        w2, s2, f2, e2, r2, k2 = rd.fp4(n2, s2n, True, oss)
        rd.check_pair(f13, e13, r13, k13, n13, f2, e2, r2, k2, n2)
        E, fmt = e13, f13
        out.update(format=fmt, w13=w13, w2=w2, w13_scale=s13, w2_scale=s2)
        if fmt == "nvfp4":
            g13n, g2n = f"{L}.w13.weight_scale_2", f"{L}.w2.weight_scale_2"
            rd.require((g13n, g2n), found[0])
            out["w13_global"], out["w2_global"] = rd.globals(g13n, E, True), rd.globals(g2n, E, True)
        else:
            if not oss:
                rd.no_global(f"{L}.w13.weight_scale_2")
                rd.no_global(f"{L}.w2.weight_scale_2")
            out["w13_global"], out["w2_global"] = torch.ones(E), torch.ones(E)
        for key, name in (("w13_input_scale", f"{L}.w13.input_scale"), ("w2_input_scale", f"{L}.w2.input_scale")):
            if name in tensors:
                out[key] = rd.globals(name, E, True)
    else:
        E = max(ids) + 1
        if E > 1024:  # MoePlan::kMaxExperts
            raise InvalidArgument(f"gather_moe_layer: layer '{L}': expert index {E - 1} exceeds the MoE API's 1024 "
                                  "experts")
        gate, up, down = _PER_EXPERT[next(iter(naming))]
        need = [f"{L}.{e}.{p}.{leaf}" for e in range(E) for p in (gate, up, down)
                for leaf in ("weight", "weight_scale")]
        rd.require(need, "per-expert")
        w13, w2, s13, s2, g13, g2, i13, i2 = [], [], [], [], [], [], [], []
        fmt = h = n = None
        for e in range(E):
            p = f"{L}.{e}."
            ng, nu, nd = p + gate + ".weight", p + up + ".weight", p + down + ".weight"
            gw, gs, gf, _, gr, gk = rd.fp4(ng, ng + "_scale", False, False)
            uw, us, uf, _, ur, uk = rd.fp4(nu, nu + "_scale", False, False)
            dw, ds, df, _, dr, dk = rd.fp4(nd, nd + "_scale", False, False)
            if (gf, gr, gk) != (uf, ur, uk):
                raise FormatError(f"gather_moe_layer: layer '{L}': '{ng}' ({gf} {gr}x{gk}) and '{nu}' ({uf} {ur}x{uk}) "
                                  "differ")
            rd.check_pair(gf, 1, 2 * gr, gk, f"{ng} + {nu}", df, 1, dr, dk, nd)
            if e == 0:
                fmt, h, n = gf, gk, gr
            elif (gf, gk, gr) != (fmt, h, n):
                raise FormatError(f"gather_moe_layer: layer '{L}': expert {e} ('{ng}': {gf} N={gr} H={gk}) differs "
                                  f"from expert 0 ({fmt} N={n} H={h})")
            w13.append(torch.cat([gw, uw]))
            w2.append(dw)
            if isinstance(gs, CsfScales) or isinstance(us, CsfScales):
                # Separate grids in the file; the layer's w13 grid is [gate; up]
                # of 2N rows, so it is re-encoded (exact).
                s13.append(CsfScales.compress(torch.cat([_native(gs), _native(us)]), fmt))
            else:
                s13.append(torch.cat([gs, us]))
            s2.append(ds)
            if fmt == "nvfp4":
                rd.require((ng + "_scale_2", nu + "_scale_2", nd + "_scale_2"), "per-expert")
                a, b = rd.globals(ng + "_scale_2", 1, False), rd.globals(nu + "_scale_2", 1, False)
                # Bitwise, as the C++ loader compares them.
                if not torch.equal(a.view(torch.int32), b.view(torch.int32)):
                    raise Unsupported(
                        f"gather_moe_layer: layer '{L}': '{ng}_scale_2' ({float(a)}) and '{nu}_scale_2' ({float(b)}) "
                        "differ; the MoE API has one global scale per expert for the fused gate/up projection, so "
                        "this checkpoint would need requantization")
                g13.append(a)
                g2.append(rd.globals(nd + "_scale_2", 1, False))
            else:
                for x in (ng, nu, nd):
                    rd.no_global(x + "_scale_2")
            for acc, name in ((i13, p + gate + ".input_scale"), (i2, p + down + ".input_scale")):
                if name in tensors:
                    acc.append(rd.globals(name, 1, False))
        out.update(format=fmt, w13=torch.stack(w13), w2=torch.stack(w2), w13_scale=_cat_scales(s13),
                   w2_scale=_cat_scales(s2))
        if fmt == "nvfp4":
            out["w13_global"], out["w2_global"] = torch.cat(g13), torch.cat(g2)
        else:
            out["w13_global"], out["w2_global"] = torch.ones(E), torch.ones(E)
        if len(i13) == E:
            out["w13_input_scale"] = torch.cat(i13)
        if len(i2) == E:
            out["w2_input_scale"] = torch.cat(i2)
    h, n = int(out["w13"].shape[2]) * 2, int(out["w2"].shape[2]) * 2
    try:
        _C.moe_plan(out["format"], E, h, n, 1, "w13", "none", 4096, 1536, "row_major")
    except InvalidArgument as err:
        raise InvalidArgument(f"gather_moe_layer: layer '{L}' (E={E} H={h} N={n}): {err}") from err
    return out
