"""Run Hugging Face transformers MoE models on csfmoe.

`patch_model(model, format="nvfp4", scales="csf")` quantizes the routed
experts of every supported sparse-MoE block to FP4 with csfmoe's quantizer
(or takes a checkpoint's FP4 tensors: quantized=), keeps their block scales
CSF-compressed (scales="csf") or native, and swaps
the block's `experts` module for a `CsfExperts` module. The rest of the block
stays the model's own: its router (top-k ids and weights, DeepSeek-V3's
grouped top-k and score correction, gpt-oss's softmax over the top-k logits),
shared experts and glue run unchanged and hand their routing to CsfExperts,
which has the `experts(hidden, top_k_index, top_k_weights)` interface of
transformers' fused expert modules.

Supported blocks (transformers >= 5, fused 3-D expert parameters):

  Qwen3MoeSparseMoeBlock   Qwen3-MoE       SiLU-gated experts
  MixtralSparseMoeBlock    Mixtral         SiLU-gated experts
  DeepseekV3MoE            DeepSeek-V3     SiLU-gated routed experts; shared experts stay BF16
  GptOssMLP                gpt-oss         clamped SwiGLU, interleaved gate/up rows, expert biases

On the CPU the experts run a float64 reference over the exactly dequantized
FP4 weights (slow; for tests and checks). On CUDA they run csfmoe's fused
kernels (PreparedExperts), gpt-oss's clamped SwiGLU and expert biases
included (the kernels' gate/up epilogue and combine add them).

`unpatch_model(model)` puts the original expert modules back (patching keeps
them; on CUDA they wait in host memory unless offload_original=False), so the
model computes bit for bit what it computed before.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from .. import _csfmoe
from .. import moe as _moe
from .._errors import CudaError, Error, InvalidArgument, Unsupported
from ..quant import dequantize, quantize

__all__ = [
    "CsfExperts",
    "SUPPORTED_BLOCKS",
    "patch_model",
    "unpatch_model",
    "is_patched",
    "dequantized_expert_weights",
    "expert_memory",
]

FORMATS = ("nvfp4", "mxfp4")
SCALES = ("csf", "native")


@dataclasses.dataclass(frozen=True)
class _BlockKind:
    family: str  # model family, for messages
    router: str  # attribute of the block holding its router
    swiglu: str  # "silu": SiLU(gate) * up; "gpt_oss": clamped SwiGLU with biases


SUPPORTED_BLOCKS: Dict[str, _BlockKind] = {
    "Qwen3MoeSparseMoeBlock": _BlockKind("Qwen3-MoE", "gate", "silu"),
    "MixtralSparseMoeBlock": _BlockKind("Mixtral", "gate", "silu"),
    "DeepseekV3MoE": _BlockKind("DeepSeek-V3", "gate", "silu"),
    "GptOssMLP": _BlockKind("gpt-oss", "router", "gpt_oss"),
}

_PATCH_ATTR = "_csfmoe_patch"


@dataclasses.dataclass
class _Swap:
    block: nn.Module
    name: str  # qualified name of the block in the model
    original: nn.Module  # the block's own experts module
    original_device: torch.device


@dataclasses.dataclass
class _PatchRecord:
    swaps: List[_Swap]
    format: str
    scales: str
    device: torch.device


def _is_silu(act) -> bool:
    probe = torch.tensor([-3.0, -0.5, 0.0, 0.75, 4.0], dtype=torch.float64)
    try:
        got = act(probe)
    except Exception:  # an activation that cannot take float64 is not SiLU
        return False
    return isinstance(got, torch.Tensor) and torch.allclose(got, probe * torch.sigmoid(probe), rtol=1e-12, atol=0)


def _expert_params(name: str, kind: _BlockKind, experts: nn.Module, need_values: bool = True):
    """The block's experts as csfmoe's layout: W13 [E, 2N, H] (gate rows, then
    up rows), W2 [E, H, N], and biases [E, 2N] / [E, H] (gpt-oss) or None.
    need_values=False (FP4 tensors given) accepts meta-device parameters."""
    where = f"{name}.experts ({type(experts).__name__})"
    if isinstance(experts, CsfExperts):
        raise InvalidArgument(f"patch_model: {name} is already patched by csfmoe (call unpatch_model first)")
    if isinstance(experts, nn.ModuleList):
        raise Unsupported(f"patch_model: {where} is a ModuleList of per-expert MLPs; the integration needs the fused "
                          f"3-D expert parameters of transformers >= 5")
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    for what, p in (("gate_up_proj", gate_up), ("down_proj", down)):
        if not isinstance(p, torch.Tensor) or p.dim() != 3 or not p.is_floating_point():
            raise Unsupported(f"patch_model: {where} has no 3-D floating-point {what} parameter "
                              f"(got {type(p).__name__}{list(p.shape) if isinstance(p, torch.Tensor) else ''})")
        if p.device.type == "meta" and need_values:
            raise InvalidArgument(f"patch_model: {where}.{what} is on the meta device: load the weights first")
    e = int(gate_up.shape[0])
    if kind.swiglu == "gpt_oss":
        # gate_up_proj [E, H, 2N] used as x @ W, gate and up in alternate columns.
        h, two_n = int(gate_up.shape[1]), int(gate_up.shape[2])
        n = two_n // 2
        if two_n % 2 or tuple(down.shape) != (e, n, h):
            raise Unsupported(f"patch_model: {where}: gate_up_proj {list(gate_up.shape)} and down_proj "
                              f"{list(down.shape)} are not [E, H, 2N] and [E, N, H]")
        w = gate_up.detach().transpose(1, 2)
        w13 = torch.cat((w[:, 0::2], w[:, 1::2]), dim=1)
        w2 = down.detach().transpose(1, 2)
        biases = []
        for what, shape in (("gate_up_proj_bias", (e, two_n)), ("down_proj_bias", (e, h))):
            b = getattr(experts, what, None)
            if not isinstance(b, torch.Tensor) or tuple(b.shape) != shape:
                raise Unsupported(f"patch_model: {where}.{what}: expected shape {list(shape)}, got "
                                  f"{list(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__}")
            biases.append(b.detach())
        b13 = torch.cat((biases[0][:, 0::2], biases[0][:, 1::2]), dim=1)
        for what in ("alpha", "limit"):
            if not isinstance(getattr(experts, what, None), (int, float)):
                raise Unsupported(f"patch_model: {where} has no numeric {what} (clamped SwiGLU parameter)")
        return w13, w2, b13, biases[1], (float(experts.alpha), float(experts.limit))
    two_n, h = int(gate_up.shape[1]), int(gate_up.shape[2])
    n = two_n // 2
    if two_n % 2 or tuple(down.shape) != (e, h, n):
        raise Unsupported(f"patch_model: {where}: gate_up_proj {list(gate_up.shape)} and down_proj "
                          f"{list(down.shape)} are not [E, 2N, H] and [E, H, N]")
    if getattr(experts, "has_bias", False) or getattr(experts, "gate_up_proj_bias", None) is not None:
        raise Unsupported(f"patch_model: {where} has expert biases, which the {kind.family} path does not expect")
    if not _is_silu(getattr(experts, "act_fn", None)):
        raise Unsupported(f"patch_model: {where}: activation {type(getattr(experts, 'act_fn', None)).__name__} is "
                          f"not SiLU, the only gate activation of the csfmoe kernels")
    return gate_up.detach(), down.detach(), None, None, None


def _topk_of(name: str, kind: _BlockKind, block: nn.Module) -> int:
    router = getattr(block, kind.router, None)
    k = getattr(router, "top_k", None)
    if k is None:
        k = getattr(getattr(block, "config", None), "num_experts_per_tok", None)
    if not isinstance(k, int) or k < 1:
        raise Unsupported(f"patch_model: {name}.{kind.router} ({type(router).__name__}) does not say its top-k")
    return k


def _fp4_tensors(name: str, layer: dict, format: str, e: int, h: int, n: int):
    """Checked CPU copies of one block's FP4 tensors (gather_moe_layer's dict:
    w13, w2, w13_scale, w2_scale as native tensors or CsfScales, w13_global,
    w2_global) in the quantizer's output form."""
    if not isinstance(layer, dict):
        raise InvalidArgument(f"patch_model: quantized[{name!r}]: expected a dict of FP4 tensors, got "
                              f"{type(layer).__name__}")
    if layer.get("format", format) != format:
        raise InvalidArgument(f"patch_model: quantized[{name!r}] is {layer['format']}, the patch asks for {format}")
    if layer.get("order", "w13") != "w13":
        raise Unsupported(f"patch_model: quantized[{name!r}]: gate/up order {layer['order']!r}; the integration "
                          f"takes w13 (gate rows, then up rows)")
    g = 16 if format == "nvfp4" else 32
    want = {"w13": (e, 2 * n, h // 2), "w2": (e, h, n // 2), "w13_scale": (e, 2 * n, h // g),
            "w2_scale": (e, h, n // g), "w13_global": (e,), "w2_global": (e,)}
    out = {}
    for key, shape in want.items():
        t = layer.get(key)
        if t is None and key.endswith("_global") and format == "mxfp4":
            t = torch.ones(e)
        if hasattr(t, "decompress"):  # CsfScales: decoded and validated on the host
            t = t.decompress("row_major")
        if not isinstance(t, torch.Tensor):
            raise InvalidArgument(f"patch_model: quantized[{name!r}][{key!r}]: expected a tensor of shape "
                                  f"{list(shape)}, got {type(t).__name__}")
        if tuple(t.shape) != shape:
            raise InvalidArgument(f"patch_model: quantized[{name!r}][{key!r}]: expected shape {list(shape)} for the "
                                  f"block's experts (E={e}, H={h}, N={n}), got {list(t.shape)}")
        if key.endswith("_global"):
            t = t.to(torch.float32)
            bad = (~torch.isfinite(t)).nonzero()
            if len(bad):
                raise InvalidArgument(f"patch_model: quantized[{name!r}][{key!r}][{int(bad[0])}] is "
                                      f"{float(t[int(bad[0])])}: global scales must be finite")
        elif t.element_size() != 1:
            raise InvalidArgument(f"patch_model: quantized[{name!r}][{key!r}]: expected 1-byte elements, got "
                                  f"{t.dtype}")
        else:
            t = t.view(torch.uint8)
        out[key] = t.detach().cpu().contiguous()
    return ({"packed": out["w13"], "scales": out["w13_scale"], "global": out["w13_global"]},
            {"packed": out["w2"], "scales": out["w2_scale"], "global": out["w2_global"]})


def _check_device(where: str, device: torch.device) -> None:
    """A CUDA device the csfmoe kernels can use, else the package's error
    (not torch's, which surfaces later and names no layer)."""
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise Unsupported(f"{where}: device {device}: csfmoe runs experts on 'cpu' or 'cuda'")
    if not _csfmoe.has_cuda:
        raise Unsupported(f"{where}: device {device}: this csfmoe build has no CUDA kernels (built without nvcc); "
                          f"use device='cpu' or a CUDA build of csfmoe")
    if not torch.cuda.is_available():
        raise CudaError(f"{where}: device {device}: torch finds no CUDA device (no GPU or no driver); "
                        f"use device='cpu'")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise CudaError(f"{where}: device {device}: only {torch.cuda.device_count()} CUDA device(s) present")


def _quantize_named(name: str, what: str, w: torch.Tensor, format: str) -> dict:
    """quantize() with the layer, the tensor and the expert in its errors."""
    try:
        return quantize(w, format)
    except Error as err:
        where = f"patch_model: {name}.{what}"
        if w.is_floating_point():
            bad = (~torch.isfinite(w.detach())).flatten(1).any(1).nonzero()
            if len(bad):
                where += f" (expert {int(bad[0])})"
        raise type(err)(f"{where}: {err}") from None


def _activation_kwargs(swiglu: str, clamp: Optional[Tuple[float, float]]) -> dict:
    """The block's activation as plan_moe / PreparedExperts keywords (their
    own alpha and limit defaults where the block gives none)."""
    kw = {"activation": swiglu}
    if clamp is not None:
        kw["alpha"], kw["limit"] = clamp
    return kw


def _check_kernels(name: str, format: str, scales: str, w13_shape, topk: int, max_tokens: int, swiglu: str,
                   clamp: Optional[Tuple[float, float]]) -> None:
    e, two_n, h = (int(s) for s in w13_shape)
    n = two_n // 2
    where = f"{name} (E={e}, H={h}, N={n}, top-k={topk}, {format})"
    try:
        _moe.plan_moe(format, e, h, n, topk, "w13", "csf" if scales == "csf" else "none", max_tokens,
                      **_activation_kwargs(swiglu, clamp))
    except InvalidArgument as err:
        raise InvalidArgument(f"patch_model: {where}: the csfmoe kernels cannot run these experts: {err}") from None


class CsfExperts(nn.Module):
    """The routed experts of one MoE block as csfmoe FP4 weights.

    w13 / w2 are the weights to quantize, or (with `quantized`, FP4 tensors
    as csfmoe.checkpoint.gather_moe_layer gives them) only their shapes.

    Called like transformers' fused experts: forward(hidden [T, H],
    top_k_index [T, k], top_k_weights [T, k]) -> [T, H] in hidden's dtype,
    out[t] = sum_j w[t, j] * expert_{ids[t, j]}(hidden[t]).

    CPU: float64 reference over the exactly dequantized weights (the scales
    go through the CSF codec first when scales="csf"); bf16 hidden states
    run the library's C++ reference (csfmoe.moe_reference) instead. CUDA:
    csfmoe's fused kernels (bf16 in, bf16 out). gpt-oss's clamped SwiGLU and
    biases run in both (the activation's one home, moe_activation)."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, topk: int, format: str = "nvfp4",
                 scales: str = "csf", device: Optional[torch.device] = None, b13: Optional[torch.Tensor] = None,
                 b2: Optional[torch.Tensor] = None, swiglu: str = "silu",
                 clamp: Optional[Tuple[float, float]] = None, max_tokens: int = 4096, name: str = "experts",
                 scratch=None, scales_expanded: bool = False, quantized: Optional[dict] = None,
                 quantized_key: Optional[str] = None):
        super().__init__()
        if format not in FORMATS:
            raise InvalidArgument(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
        if scales not in SCALES:
            raise InvalidArgument(f"scales must be one of {', '.join(SCALES)}, got {scales!r}")
        e, two_n, h = (int(s) for s in w13.shape)
        n = two_n // 2
        device = torch.device(device) if device is not None else w13.device
        compression = "csf" if scales == "csf" else "none"
        _check_kernels(name, format, scales, w13.shape, topk, max_tokens, swiglu, clamp)
        _check_device(name, device)
        self.format, self.scales, self.swiglu, self.clamp = format, scales, swiglu, clamp
        self.num_experts, self.hidden_dim, self.intermediate_dim, self.top_k = e, h, n, topk
        self.name, self.max_tokens = name, max_tokens
        if quantized is None:
            q13, q2 = _quantize_named(name, "gate_up_proj", w13, format), _quantize_named(name, "down_proj", w2, format)
        else:
            # Errors name the entry as the caller keyed it (patch_model: the block's name).
            q13, q2 = _fp4_tensors(name if quantized_key is None else quantized_key, quantized, format, e, h, n)
        # Biases are not quantized: float32 (the kernels' type; exact for the
        # bf16, fp16 and fp32 biases of a model) in w13's row order.
        self.b13 = None if b13 is None else b13.to(device=device, dtype=torch.float32).contiguous()
        self.b2 = None if b2 is None else b2.to(device=device, dtype=torch.float32).contiguous()
        self.layer = _moe.PreparedExperts(q13["packed"].to(device), q2["packed"].to(device),
                                          q13["scales"].to(device), q2["scales"].to(device),
                                          q13["global"].to(device), q2["global"].to(device), format, "w13", topk,
                                          compression, max_tokens=max_tokens, scales_expanded=scales_expanded,
                                          scratch=scratch, w13_bias=self.b13, w2_bias=self.b2,
                                          **_activation_kwargs(swiglu, clamp))
        # A CUDA layer with CSF scales drops its native scales; a host copy
        # (1/16 or 1/32 of the FP4 bytes) keeps dequantized() available.
        self._host_scales = (q13["scales"], q2["scales"]) if self.layer.w13_scale is None else None
        self._chain: Optional[_ExpandAhead] = None
        self._chain_index = 0
        self._dequantized = None

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
                f"top_k={self.top_k}, format={self.format}, scales={self.scales}, activation={self.swiglu}, "
                f"device={self.device}")

    @property
    def device(self) -> torch.device:
        return self.layer.device

    def _native_scales(self) -> Tuple[torch.Tensor, torch.Tensor]:
        if self._host_scales is not None:
            return self._host_scales
        out = []
        for s in (self.layer.w13_scale, self.layer.w2_scale):
            out.append(s.decompress("row_major") if hasattr(s, "decompress") else s)
        return out[0], out[1]

    def dequantized(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Exact float64 W13 [E, 2N, H] (gate rows, then up rows) and W2
        [E, H, N] on the layer's device. Cached on a CPU layer."""
        if self._dequantized is not None:
            return self._dequantized
        s13, s2 = self._native_scales()
        L = self.layer
        w = (dequantize(L.w13, s13.to(L.w13.device), L.w13_global, self.format),
             dequantize(L.w2, s2.to(L.w2.device), L.w2_global, self.format))
        if self.device.type == "cpu":
            self._dequantized = w
        return w

    def _activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        # The library's activation, the same code as its C++ reference (one
        # home); it runs on the CPU, so a reference on another device goes
        # there and back.
        x = gate_up.cpu()
        if self.swiglu == "silu":
            y = _moe.moe_activation(x, "silu")
        else:
            alpha, limit = self.clamp
            y = _moe.moe_activation(x, "gpt_oss", alpha, limit)
        return y.to(gate_up.device)

    def _reference(self, hidden, ids, weights):
        w13, w2 = self.dequantized()
        x = hidden.to(torch.float64)
        ids = ids.to(torch.int64)
        wts = weights.to(torch.float64)
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            if not 0 <= e < self.num_experts:
                raise InvalidArgument(f"{self.name}: top_k_index holds expert {e}, outside [0, {self.num_experts})")
            tok, slot = torch.where(ids == e)
            gu = x[tok] @ w13[e].T
            if self.b13 is not None:
                gu = gu + self.b13[e].to(torch.float64)
            y = self._activation(gu) @ w2[e].T
            if self.b2 is not None:
                y = y + self.b2[e].to(torch.float64)
            out.index_add_(0, tok, y * wts[tok, slot, None])
        return out

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if hidden_states.dim() != 2 or hidden_states.shape[-1] != self.hidden_dim:
            raise InvalidArgument(f"{self.name}: hidden_states: expected [T, {self.hidden_dim}], got "
                                  f"{list(hidden_states.shape)}")
        if hidden_states.device != self.device:
            raise InvalidArgument(f"{self.name}: hidden_states on {hidden_states.device}, the patched experts are on "
                                  f"{self.device} (patch_model(..., device=...) chooses)")
        if top_k_index.shape != (hidden_states.shape[0], self.top_k) or top_k_weights.shape != top_k_index.shape:
            raise InvalidArgument(f"{self.name}: top_k_index {list(top_k_index.shape)} and top_k_weights "
                                  f"{list(top_k_weights.shape)} must both be [T={hidden_states.shape[0]}, "
                                  f"{self.top_k}]")
        if self.device.type == "cpu":
            if hidden_states.dtype == torch.bfloat16:
                out = self.layer(hidden_states.contiguous(), top_k_index.contiguous(),
                                 top_k_weights.to(torch.float32).contiguous())
            else:
                out = self._reference(hidden_states, top_k_index, top_k_weights)
            return out.to(hidden_states.dtype)
        x = hidden_states.to(torch.bfloat16).contiguous()
        ids = top_k_index.contiguous()
        w = top_k_weights.to(torch.float32).contiguous()
        if self._chain is not None:
            self._chain.before_call(self._chain_index)
        if x.shape[0] <= self.max_tokens:
            out = self.layer(x, ids, w)
        else:  # a prefill longer than the layer's workspace
            out = torch.cat([self.layer(x[i:i + self.max_tokens], ids[i:i + self.max_tokens],
                                        w[i:i + self.max_tokens]) for i in range(0, x.shape[0], self.max_tokens)])
        if self._chain is not None:
            self._chain.after_call(self._chain_index)
        return out.to(hidden_states.dtype)

    def scratch_tensors(self) -> List[torch.Tensor]:
        """The device scale scratch this layer expands CSF scales into (CUDA,
        scales="csf"; possibly shared with other layers), else []."""
        scratch = getattr(self.layer, "scratch", None)
        return [t for t in (scratch or ()) if t is not None]

    def memory(self) -> Dict[str, int]:
        """Resident bytes: FP4 weights, block scales (CSF parts and index, or
        native), global scales and biases; the scale scratch is not counted
        (expert_memory counts each shared scratch once)."""
        L = self.layer
        biases = sum(b.numel() * b.element_size() for b in (self.b13, self.b2) if b is not None)
        return {"weights": L.w13.numel() + L.w2.numel(), "scales": int(L.resident_scale_bytes()),
                "globals": 4 * (L.w13_global.numel() + L.w2_global.numel()), "biases": biases}


class _ExpandAhead:
    """One scale scratch shared by all patched layers (CUDA, CSF scales):
    layer i+1's scales expand on a side stream while the rest of layer i
    and the attention of layer i+1 run; two events order the reuse of the
    scratch. Each forward starts by expanding the first layer's scales, and
    everything forked to the side stream joins the current stream before the
    last layer's call, so a forward is self-contained (CUDA-graph capture
    sees a fork and a join)."""

    def __init__(self, layers: List["CsfExperts"]):
        self.layers = layers
        dev = layers[0].device
        self.side = torch.cuda.Stream(dev)
        self.expanded = torch.cuda.Event()
        self.consumed = torch.cuda.Event()
        self.next = 0  # the layer whose scales the side stream expands last
        for i, m in enumerate(layers):
            m._chain, m._chain_index = self, i

    def _expand(self, i: int, after: Optional[torch.cuda.Event]) -> None:
        with torch.cuda.stream(self.side):
            if after is not None:
                self.side.wait_event(after)
            self.layers[i].layer.expand_scales()
            self.expanded.record(self.side)

    def before_call(self, i: int) -> None:
        if i not in (0, self.next):
            raise InvalidArgument(f"{self.layers[i].name}: expand_ahead expands the layers' scales in model order, "
                                  f"but layer {i} runs after layer {self.next - 1}")
        cur = torch.cuda.current_stream(self.layers[i].device)
        if i == 0:
            self.side.wait_stream(cur)
            self._expand(0, None)
        cur.wait_event(self.expanded)

    def after_call(self, i: int) -> None:
        self.next = i + 1
        if i + 1 < len(self.layers):
            self.consumed.record(torch.cuda.current_stream(self.layers[i].device))
            self._expand(i + 1, self.consumed)

    def detach(self) -> None:
        for m in self.layers:
            m._chain = None


def _find_blocks(model: nn.Module):
    blocks, unsupported = [], []
    for name, module in model.named_modules():
        cls = type(module).__name__
        if cls in SUPPORTED_BLOCKS:
            blocks.append((name, module, SUPPORTED_BLOCKS[cls]))
        elif ("moe" in cls.lower() or "sparse" in cls.lower()) and hasattr(module, "experts"):
            unsupported.append(cls)
    return blocks, unsupported


def is_patched(model: nn.Module) -> bool:
    return getattr(model, _PATCH_ATTR, None) is not None


def patch_model(model: nn.Module, format: str = "nvfp4", scales: str = "csf",
                device: Optional[torch.device] = None, max_tokens: int = 4096,
                offload_original: bool = True, expand_ahead: bool = False, share_scratch: bool = True,
                quantized: Optional[Dict[str, dict]] = None) -> nn.Module:
    """Run the routed experts of `model`'s supported sparse-MoE blocks on
    csfmoe (in place; returns `model`).

    format: "nvfp4" or "mxfp4" (the experts are quantized from their current
    weights). scales: "csf" (CSF-compressed block scales) or "native".
    device: where the experts run; default the device of each block's expert
    parameters. max_tokens: the largest token count of one kernel call (longer
    inputs run in chunks). offload_original: keep the original expert modules
    in host memory while patched (they come back with unpatch_model).
    expand_ahead (CUDA, scales="csf", all blocks of one geometry): the layers
    share one expanded-scale scratch, and each layer's scales expand on a side
    stream while the previous layer finishes; without it each call picks its
    own scale mode (stage_read or routed). share_scratch (CUDA, scales="csf"):
    blocks of one geometry share one scale scratch (the size of one layer's
    native scales), their calls on one stream ordering its reuse; False gives
    each layer its own, for layers run concurrently on different streams.
    quantized: {block name (e.g. "model.layers.3.mlp"): FP4 tensors as
    csfmoe.checkpoint.gather_moe_layer returns them}: those blocks take the
    given FP4 weights instead of quantizing theirs (SiLU blocks; the block's
    own expert parameters may then be on the meta device).

    Raises Unsupported when the model has no supported block (naming the MoE
    classes it found), when a block's experts are not transformers' fused
    3-D parameters, and for gpt-oss on CUDA; InvalidArgument for a model
    already patched, bad options, expert shapes the kernels cannot run,
    non-finite expert weights (naming the block, the tensor and the expert)
    and bad `quantized` tensors (naming the key); for device="cuda" where no
    CUDA device can be used, Unsupported (a build without CUDA kernels) or
    CudaError (no GPU). Nothing changes when it raises.

    While patched, model.save_pretrained raises Unsupported: transformers
    would write a checkpoint without the routed experts (CsfExperts holds no
    parameters). unpatch_model restores it."""
    if format not in FORMATS:
        raise InvalidArgument(f"patch_model: format must be one of {', '.join(FORMATS)}, got {format!r}")
    if scales not in SCALES:
        raise InvalidArgument(f"patch_model: scales must be one of {', '.join(SCALES)}, got {scales!r}")
    if not isinstance(model, nn.Module):
        raise InvalidArgument(f"patch_model: expected a torch.nn.Module, got {type(model).__name__}")
    if is_patched(model):
        raise InvalidArgument(f"patch_model: {type(model).__name__} is already patched by csfmoe "
                              f"(call unpatch_model first)")
    if expand_ahead and scales != "csf":
        raise InvalidArgument("patch_model: expand_ahead needs scales='csf' (native scales need no expansion)")
    blocks, unsupported = _find_blocks(model)
    if not blocks:
        found = f"; it has MoE blocks of unsupported classes {sorted(set(unsupported))}" if unsupported else ""
        raise Unsupported(f"patch_model: {type(model).__name__} has no sparse-MoE block csfmoe supports{found}. "
                          f"Supported blocks: {', '.join(SUPPORTED_BLOCKS)}")
    quantized = dict(quantized or {})
    unknown = sorted(set(quantized) - {name for name, _, _ in blocks})
    if unknown:
        raise InvalidArgument(f"patch_model: quantized names {unknown}, which are not MoE blocks of "
                              f"{type(model).__name__}; its blocks: {[name for name, _, _ in blocks]}")
    found = []
    for name, block, kind in blocks:
        if name in quantized and kind.swiglu != "silu":
            raise Unsupported(f"patch_model: quantized[{name!r}]: FP4 tensors are taken for SiLU blocks only, "
                              f"not {kind.family}'s")
        w13, w2, b13, b2, clamp = _expert_params(name, kind, getattr(block, "experts", None),
                                                 need_values=name not in quantized)
        dev = torch.device(device) if device is not None else w13.device
        if dev.type == "meta":
            raise InvalidArgument(f"patch_model: {name}.experts has its parameters on the meta device: pass device=")
        found.append((name, block, kind, (w13, w2, b13, b2, clamp), _topk_of(name, kind, block), dev))
    if expand_ahead:
        shapes = {(tuple(p[0].shape), tuple(p[1].shape), k, d) for _, _, _, p, k, d in found}
        if len(shapes) != 1 or next(iter(shapes))[3].type != "cuda":
            raise InvalidArgument(f"patch_model: expand_ahead needs all MoE blocks on one CUDA device with one "
                                  f"geometry (they share a scale scratch); found {sorted(map(str, shapes))}")
    for name, block, kind, (w13, w2, b13, b2, clamp), topk, dev in found:
        _check_kernels(f"{name}.experts", format, scales, w13.shape, topk, max_tokens, kind.swiglu, clamp)
    for name, _, _, _, _, dev in found:
        _check_device(f"patch_model: {name}.experts", dev)
    # One block at a time (its original offloaded before the next is
    # quantized: the peak stays one layer above the model), undone on failure.
    swaps, scratches, chain = [], {}, []
    try:
        for i in range(len(found)):
            name, block, kind, (w13, w2, b13, b2, clamp), topk, dev = found[i]
            found[i] = None  # drop the views of the original weights with it
            shares = scales == "csf" and dev.type == "cuda" and (share_scratch or expand_ahead)
            key = (tuple(w13.shape), tuple(w2.shape), str(dev))
            new = CsfExperts(w13, w2, topk, format, scales, dev, b13, b2, kind.swiglu, clamp, max_tokens,
                             name=f"{name}.experts", scratch=scratches.get(key) if shares else None,
                             scales_expanded=expand_ahead, quantized=quantized.get(name), quantized_key=name)
            if shares:
                scratches.setdefault(key, new.layer.scratch)
            chain.append(new)
            original = block.experts
            original_device = next(original.parameters()).device
            block.experts = new
            swaps.append(_Swap(block, name, original, original_device))
            if offload_original and original_device.type not in ("cpu", "meta"):
                original.to("cpu")
            del w13, w2, b13, b2
        if expand_ahead:
            _ExpandAhead(chain)
    except BaseException:
        for swap in reversed(swaps):
            if swap.original_device.type != "meta":
                swap.original.to(swap.original_device)
            swap.block.experts = swap.original
        raise
    dev = chain[0].device
    setattr(model, _PATCH_ATTR, _PatchRecord(swaps, format, scales, dev))
    if callable(getattr(model, "save_pretrained", None)):
        model.save_pretrained = _refuse_save_pretrained(type(model).__name__)
    return model


def _refuse_save_pretrained(cls: str):
    # transformers saves parameters; CsfExperts holds none, so the file would
    # lack the routed experts and a reload would initialize them at random.
    def save_pretrained(*args, **kwargs):
        raise Unsupported(
            f"save_pretrained: this {cls} is patched by csfmoe: its routed experts are csfmoe FP4 layers, which "
            f"transformers does not save (the checkpoint would lack them and a reload would fill them with random "
            f"values). Call csfmoe.integrations.transformers.unpatch_model(model) first to save the original "
            f"weights, or load dequantized_expert_weights(model) into an unpatched copy and save that")

    save_pretrained._csfmoe_guard = True
    return save_pretrained


def unpatch_model(model: nn.Module) -> nn.Module:
    """Put back the expert modules patch_model replaced (on their original
    device); the model then computes exactly what it did before patching."""
    record = getattr(model, _PATCH_ATTR, None)
    if record is None:
        raise InvalidArgument(f"unpatch_model: {type(model).__name__} is not patched by csfmoe")
    for swap in record.swaps:
        if not isinstance(swap.block.experts, CsfExperts):
            raise InvalidArgument(f"unpatch_model: {swap.name}.experts was replaced after patching "
                                  f"({type(swap.block.experts).__name__}); not restoring over it")
    for swap in record.swaps:
        swap.block.experts._chain = None
        if swap.original_device.type != "meta":
            swap.original.to(swap.original_device)
        swap.block.experts = swap.original
    delattr(model, _PATCH_ATTR)
    if getattr(model.__dict__.get("save_pretrained"), "_csfmoe_guard", False):
        del model.__dict__["save_pretrained"]
    return model


def _patched_experts(model: nn.Module, what: str):
    if not is_patched(model):
        raise InvalidArgument(f"{what}: {type(model).__name__} is not patched by csfmoe")
    return [(name, m) for name, m in model.named_modules() if isinstance(m, CsfExperts)]


def dequantized_expert_weights(model: nn.Module, dtype: Optional[torch.dtype] = None) -> Dict[str, torch.Tensor]:
    """The exactly dequantized FP4 expert weights of a patched model, named
    and laid out as the original parameters (`<block>.experts.gate_up_proj`,
    `.down_proj`; gpt-oss transposed and interleaved again), in `dtype`
    (default: the original parameters' dtype), on the CPU.

    `reference.load_state_dict(dequantized_expert_weights(model),
    strict=False)` gives an unpatched copy of the model the same weights."""
    record = getattr(model, _PATCH_ATTR, None)
    originals = {f"{s.name}.experts": s.original for s in record.swaps} if record else {}
    out = {}
    for name, m in _patched_experts(model, "dequantized_expert_weights"):
        w13, w2 = m.dequantized()
        orig = originals.get(name)
        dt = dtype or (orig.gate_up_proj.dtype if orig is not None else torch.float32)
        if m.swiglu == "gpt_oss":
            inter = torch.empty_like(w13)
            inter[:, 0::2], inter[:, 1::2] = w13[:, :m.intermediate_dim], w13[:, m.intermediate_dim:]
            w13, w2 = inter.transpose(1, 2), w2.transpose(1, 2)
        out[f"{name}.gate_up_proj"] = w13.to(dt).contiguous().cpu()
        out[f"{name}.down_proj"] = w2.to(dt).contiguous().cpu()
    return out


def expert_memory(model: nn.Module) -> Dict[str, int]:
    """Resident bytes of the patched experts summed over blocks: "weights"
    (FP4), "scales" (CSF parts and index, or native), "globals", "biases",
    "scratch" (CSF scale scratch on the GPU, each shared one counted once),
    "total", and "bf16_equivalent" (the same experts as BF16 weights)."""
    total = {"weights": 0, "scales": 0, "globals": 0, "biases": 0, "scratch": 0, "bf16_equivalent": 0}
    seen = set()
    for _, m in _patched_experts(model, "expert_memory"):
        for k, v in m.memory().items():
            total[k] += v
        for t in m.scratch_tensors():
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total["scratch"] += t.numel() * t.element_size()
        total["bf16_equivalent"] += 2 * 3 * m.num_experts * m.hidden_dim * m.intermediate_dim
    total["total"] = sum(total[k] for k in ("weights", "scales", "globals", "biases", "scratch"))
    return total
