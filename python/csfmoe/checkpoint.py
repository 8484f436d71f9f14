"""Reading (and writing) safetensors files and CSF containers as torch
tensors, and gathering the tensors of one MoE layer (stacked, gpt-oss or
per-expert ModelOpt names)."""

from __future__ import annotations

import errno
import os
from typing import Dict, List, Optional, Union

import torch

from . import _csfmoe as _C
from . import ops
from ._errors import FileMissing, FormatError, InvalidArgument
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


def _require_exists(path: str, what: str) -> None:
    if not os.path.exists(path):
        raise FileMissing(errno.ENOENT, f"{what}: no such file or folder", path)


def compress_checkpoint(src, dst, layout: str = "", threads: int = 0, schema: str = "csfmoe",
                        tp: int = 1, rank: Optional[int] = None, mxfp4_slab: bool = True):
    """csf compress: writes a container (file or folder) at dst; returns
    (scale source bytes, scale stored bytes). layout "" takes each file's
    csfmoe.scale_layout tag (else row_major); a layout that contradicts the
    tag is an error. schema "b12x" writes b12x / vLLM's plane tensors for
    every per-expert scale, stacked [E, R, C] experts split per expert first
    (docs/container-format.md); tp / rank store one
    tensor-parallel slice (src may then be compressed already). mxfp4_slab
    False keeps MXFP4 scales as b12x's planes where the slab form is smaller.
    Raises FileMissing (a FileNotFoundError and IoError) when src does not
    exist, InvalidArgument for tp > 1 without rank, rank without tp > 1, a
    rank outside 0..tp-1, or schema "b12x" with mxfp4_slab False (which only
    the csfmoe schema reads)."""
    src, dst = os.fspath(src), os.fspath(dst)
    if tp > 1 and rank is None:
        raise InvalidArgument(f"compress_checkpoint: tp={tp} needs rank= (which slice to store, 0..{tp - 1})")
    if rank is not None and tp <= 1:
        raise InvalidArgument(f"compress_checkpoint: rank={rank} needs tp= (the tensor-parallel degree, at least 2)")
    if rank is not None and not 0 <= rank < tp:
        raise InvalidArgument(f"compress_checkpoint: rank={rank} is outside tp={tp}'s ranks 0..{tp - 1}")
    if schema == "b12x" and not mxfp4_slab:
        raise InvalidArgument("compress_checkpoint: mxfp4_slab=False chooses how schema='csfmoe' stores MXFP4 "
                              "scales; schema='b12x' always writes b12x's planes, so drop one of the two")
    _require_exists(src, "compress_checkpoint: src")
    return tuple(_C.compress_checkpoint(src, dst, layout, threads, schema, tp, 0 if rank is None else rank,
                                        mxfp4_slab))


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
    decoded layout, default the source layout). `names` limits what is read;
    a name the file lacks raises InvalidArgument, a missing path FileMissing.
    With decode=True and a `layout` other than the one a block-scale tensor
    is stored native in (no CSF form to decode into another layout), the
    call raises InvalidArgument naming the tensor and both layouts rather
    than return that tensor in its stored layout.

    The C++ reader does the reading and the checks (csfmoe/checkpoint_reader.hpp).
    In a container every tensor returned is first checked against the CRC32
    of the restore record: a native tensor over its stored bytes, a CSF tensor
    by validating its parts and decoding them once on the host (`threads`
    threads). A mismatch raises CorruptData, malformed parts FormatError, each
    naming the file and the tensor. A plain safetensors file has no CRCs: it
    is only checked structurally."""
    path = os.fspath(path)
    if layout is not None:
        ops._check_choice("layout", layout, ops.LAYOUTS)
    _require_exists(path, "load_file")
    f = _C.SafetensorsFile(path)
    if names is not None:
        missing = sorted(set(names) - {info["name"] for info in f.tensors()})
        if missing:
            raise InvalidArgument(f"load_file: {path} has no tensor named {', '.join(repr(m) for m in missing)}")
    return _load_open(f, path, device, decode, layout, names, threads)


def _load_open(f, path: str, device, decode: bool, layout: Optional[str], names, threads: int) -> Dict[str, Loaded]:
    """load_file of an open file: what it holds of `names` (all if None)."""
    device = torch.device(device)
    entries = f.csf_entries() or {}
    wanted = None if names is None else set(names)
    if decode and layout is not None:
        # Only a CSF tensor can be decoded into another layout; a scale tensor
        # stored native would come back in its stored layout, unasked.
        stuck = sorted((n, l) for n, l in f.scale_tensors().items()
                       if n not in entries and l != layout and (wanted is None or n in wanted))
        if stuck:
            n, l = stuck[0]
            more = f" (and {len(stuck) - 1} more)" if len(stuck) > 1 else ""
            raise InvalidArgument(
                f"load_file: {path}: tensor '{n}'{more} is a block-scale tensor stored native in {l} "
                f"(the file's csfmoe.scale_layout, else row_major), not CSF, so decode=True cannot give it "
                f"in layout={layout!r}; load it without layout= (it comes back {l}) and convert it yourself, "
                f"or pass names= without it")
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
                    dtype=dtype, shape=shape, validated=True, crc32=None if e["crc32"] is None else int(e["crc32"]),
                    origin=what)
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
    if layout is not None:
        ops._check_choice("layout", layout, ops.LAYOUTS)
    _require_exists(path, "load_checkpoint")
    shards = [(os.fspath(p), _C.SafetensorsFile(os.fspath(p))) for p in _C.checkpoint_files(path)]
    if names is not None:
        # Each shard holds some of `names`; only a name in none of them is missing.
        held = {info["name"] for _, f in shards for info in f.tensors()}
        missing = sorted(set(names) - held)
        if missing:
            raise InvalidArgument(f"load_checkpoint: {path} has no tensor named "
                                  f"{', '.join(repr(m) for m in missing)}")
    out: Dict[str, Loaded] = {}
    where: Dict[str, str] = {}
    for shard, f in shards:
        for name, t in _load_open(f, shard, device, decode, layout, names, threads).items():
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
# gather_moe_layer: the C++ layer rules (resolve_moe_layer) decide; the torch
# glue below only assembles what they resolved.
# ---------------------------------------------------------------------------
_GROUP = {"nvfp4": 16, "mxfp4": 32}


def _unswizzle(raw: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[.., Rp, Cp] bytes in swizzled_128x4 order -> row-major [.., rows, cols]
    (the index map is csfmoe::swizzled_index, formats.hpp)."""
    rp, cp = int(raw.shape[-2]), int(raw.shape[-1])
    idx = _C.swizzled_indices(rows, cols, cp)
    flat = raw.reshape(-1, rp * cp).view(torch.uint8)
    out = flat[:, idx.to(raw.device)]
    return out.reshape(*raw.shape[:-2], rows, cols).view(raw.dtype)


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


def _layer_table(tensors, scale_layout: str) -> dict:
    """name -> (safetensors dtype, shape, scale layout) for the C++ rules."""
    out = {}
    for name, t in tensors.items():
        if isinstance(t, CsfScales):
            out[name] = (_ST_NAME.get(t.dtype, "U8"), [int(x) for x in t.shape], t.layout)
        elif isinstance(t, torch.Tensor) and t.dtype in _ST_NAME:
            out[name] = (_ST_NAME[t.dtype], [int(x) for x in t.shape], scale_layout)
    return out


def _tensor_bytes(tensors):
    def read(name: str) -> torch.Tensor:
        t = tensors[name]
        if isinstance(t, CsfScales):
            t = t.decompress()
        return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return read


def _weight(tensors, p: dict, stacked: bool) -> torch.Tensor:
    w = tensors[p["weight"]]
    rows, half = int(p["rows"]), int(p["k"]) // 2
    return w.reshape(int(p["experts"]), rows, half) if stacked else w.reshape(rows, half)


def _scales(tensors, p: dict, fmt: str):
    """The projection's scales as row-major [E?, R, K/g]: a tensor or CsfScales."""
    s = tensors[p["scale"]]
    r, c = int(p["rows"]), int(p["k"]) // _GROUP[fmt]
    if p["scale_layout"] == "row_major":
        return s
    shape = tuple(int(x) for x in s.shape)
    if not isinstance(s, CsfScales):
        return _unswizzle(s, r, c)
    if shape[-2:] == (r, c):
        return s  # an aligned swizzled grid decodes to the row-major grid as is: stays CSF
    # A padded swizzled grid decodes to [E, Rp, Cp]: keep the true grid.
    full = s.decompress("row_major").reshape(int(p["experts"]), *shape[-2:])
    return full[:, :r, :c].contiguous().reshape(*shape[:-2], r, c)


def gather_moe_layer(tensors: Dict[str, Loaded], layer: str, scale_layout: str = "row_major") -> Dict[str, object]:
    """Collect one MoE layer from loaded tensors (load_file / load_checkpoint).
    The C++ layer rules decide (resolve_moe_layer in csfmoe/moe_checkpoint.hpp,
    the checks and messages of load_moe_layer and `csf moe --checkpoint`);
    this function assembles the torch tensors they name.

    Layouts, for a layer key L such as "model.layers.3.mlp.experts":
      stacked (csf synth, ModelOpt names): L.w13.weight [E, 2N, H/2],
        L.w13.weight_scale [E, 2N, H/g], L.w13.weight_scale_2 [] | [1] | [E]
        (NVFP4 only), the same for w2 with [E, H, N/2], [E, H, N/g];
      gpt-oss MXFP4: L.gate_up_proj_blocks [E, 2N, H/32, 16] with
        L.gate_up_proj_scales [E, 2N, H/32], L.down_proj_blocks / _scales;
        with expert biases (L.gate_up_proj_bias [E, 2N], L.down_proj_bias
        [E, H], BF16 or float32, each optional) a gpt-oss layer proper: gate
        and up rows interleaved (row 2i gate i, row 2i + 1 up i), returned
        de-interleaved, with activation "gpt_oss" (biases on stacked or
        per-expert names are refused: Unsupported);
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
    w13_input_scale / w2_input_scale float32 [E] when an NVFP4 layer has them
    (checked finite and positive), and for a gpt-oss layer with biases
    activation "gpt_oss", alpha, limit (gpt-oss's 1.702, 7.0) and
    w13_bias float32 [E, 2N] (gate, then up) / w2_bias [E, H] where present
    (checked finite); prepare_experts passes them on.
    Raises InvalidArgument when no layout matches (naming the layers the
    tensors hold), FormatError for missing or malformed tensors (biases of
    the wrong shape or dtype included) and Unsupported where the C++ loader
    refuses (stacked or per-expert biases, gate and up global scales that
    differ, MXFP4 global scales)."""
    ops._check_choice("scale_layout", scale_layout, ops.LAYOUTS)
    spec = _C.resolve_moe_layer(_layer_table(tensors, scale_layout), layer, 1, _tensor_bytes(tensors),
                                "gather_moe_layer")
    fmt, E = spec["format"], int(spec["experts"])
    out: Dict[str, object] = {"format": fmt}
    if spec["naming"] != "per-expert":
        p13, p2 = spec["w13"][0], spec["w2"][0]
        w13, s13 = _weight(tensors, p13, True), _scales(tensors, p13, fmt)
        if spec["gate_up_interleaved"]:
            w13 = _deinterleave(w13)
            # The rows move, so CSF scales are decoded, moved and re-encoded (exact).
            if isinstance(s13, CsfScales):
                s13 = CsfScales.compress(_deinterleave(_native(s13)), fmt)
            else:
                s13 = _deinterleave(s13)
        out.update(w13=w13, w2=_weight(tensors, p2, True), w13_scale=s13, w2_scale=_scales(tensors, p2, fmt))
    else:
        w13, w2, s13, s2 = [], [], [], []
        for e in range(E):
            g, u, d = spec["w13"][2 * e], spec["w13"][2 * e + 1], spec["w2"][e]
            w13.append(torch.cat([_weight(tensors, g, False), _weight(tensors, u, False)]))
            w2.append(_weight(tensors, d, False))
            gs, us = _scales(tensors, g, fmt), _scales(tensors, u, fmt)
            if isinstance(gs, CsfScales) or isinstance(us, CsfScales):
                # Separate grids in the file; the layer's w13 grid is [gate; up]
                # of 2N rows, so it is re-encoded (exact).
                s13.append(CsfScales.compress(torch.cat([_native(gs), _native(us)]), fmt))
            else:
                s13.append(torch.cat([gs, us]))
            s2.append(_scales(tensors, d, fmt))
        out.update(w13=torch.stack(w13), w2=torch.stack(w2), w13_scale=_cat_scales(s13), w2_scale=_cat_scales(s2))
    for key in ("w13_global", "w2_global", "w13_input_scale", "w2_input_scale"):
        if spec[key]:
            out[key] = torch.tensor(spec[key], dtype=torch.float32)
    if spec["activation"] == "gpt_oss":
        out.update(activation="gpt_oss", alpha=float(spec["alpha"]), limit=float(spec["limit"]))
        for key in ("w13_bias", "w2_bias"):
            if spec[key]:
                out[key] = torch.tensor(spec[key], dtype=torch.float32).reshape(E, -1)
    return out


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[E, 2N, C] with rows alternating gate, up (gpt-oss) -> gate rows, then
    up rows (the w13 order)."""
    e, two_n = int(t.shape[0]), int(t.shape[1])
    return t.reshape(e, two_n // 2, 2, *t.shape[2:]).transpose(1, 2).reshape(t.shape).contiguous()
