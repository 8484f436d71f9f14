"""Fused MoE ops and PreparedExperts (plan -> prepare -> call).

The CPU path is the library's float64 reference (csfmoe::moe_reference);
the CUDA path binds the GPU kernels when this build has them
(csfmoe._csfmoe.has_moe_cuda)."""

from __future__ import annotations

import weakref
from typing import Optional, Union

import torch

from . import _csfmoe as _C
from . import ops
from ._errors import InvalidArgument, Unsupported
from .scales import CsfScales

__all__ = ["moe_activation", "moe_reference", "fused_moe", "PreparedExperts", "plan_moe", "prepare_experts", "moe_call"]

_FP32 = (torch.float32,)


def plan_moe(format: str, experts: int, hidden: int, intermediate: int, topk: int, order: str = "w13",
             compression: str = "none", max_tokens: int = 4096, stage_read_max_tokens: int = 1536,
             scale_layout: str = "row_major", activation: str = "silu", alpha: float = 1.702,
             limit: float = 7.0) -> dict:
    """csfmoe::plan_weights: validates the layer geometry and activation
    (InvalidArgument naming the field) and returns the byte sizes and scale
    grid shapes."""
    return dict(_C.moe_plan(format, experts, hidden, intermediate, topk, order, compression, max_tokens,
                            stage_read_max_tokens, scale_layout, activation, float(alpha), float(limit)))


def _check_layer(hidden, w13, w13_scale, w13_global, w2, w2_scale, w2_global, topk_ids, topk_weights, format):
    ops._check_choice("format", format, ops.FORMATS)
    g = 16 if format == "nvfp4" else 32
    ops._check_tensor(hidden, "hidden", (torch.bfloat16,), 2)
    dev = hidden.device
    ops._check_tensor(w13, "w13", (torch.uint8,), 3, dev)
    e, two_n, h_half = (int(s) for s in w13.shape)
    t, h = (int(s) for s in hidden.shape)
    n = two_n // 2
    if two_n % 2 or h_half * 2 != h:
        raise InvalidArgument(f"w13: expected [E, 2N, H/2] with H={h}, got {list(w13.shape)}")
    for name, ten, shape, dts in (
        ("w2", w2, (e, h, n // 2), (torch.uint8,)),
        ("w13_scale", w13_scale, (e, two_n, h // g), ops.BYTE_DTYPES),
        ("w2_scale", w2_scale, (e, h, n // g), ops.BYTE_DTYPES),
        ("w13_global", w13_global, (e,), _FP32),
        ("w2_global", w2_global, (e,), _FP32),
    ):
        ops._check_tensor(ten, name, dts, None, dev)
        if tuple(ten.shape) != shape:
            raise InvalidArgument(f"{name}: expected shape {list(shape)}, got {list(ten.shape)}")
    ops._check_tensor(topk_ids, "topk_ids", ops.INDEX_DTYPES, 2, dev)
    ops._check_tensor(topk_weights, "topk_weights", _FP32, 2, dev)
    if topk_ids.shape[0] != t or topk_weights.shape != topk_ids.shape:
        raise InvalidArgument(f"topk_ids {list(topk_ids.shape)} and topk_weights {list(topk_weights.shape)} "
                              f"must both be [T={t}, k]")
    return e, h, n, int(topk_ids.shape[1])


ACTIVATIONS = ("silu", "gpt_oss")


def moe_activation(gate_up: torch.Tensor, activation: str = "silu", alpha: float = 1.702,
                   limit: float = 7.0) -> torch.Tensor:
    """The library's gate/up activation (csfmoe/detail/activation.hpp, the one
    the C++ reference applies) in float64 on the CPU: gate_up [..., 2N]
    holds gate in [..., :N] and up in [..., N:] (de-interleaved; biases
    already added); returns [..., N] float64. "silu": SiLU(gate) * up;
    "gpt_oss": (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with
    g = min(gate, limit), NaN kept."""
    if activation not in ACTIVATIONS:
        raise InvalidArgument(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    if gate_up.device.type != "cpu" or gate_up.shape[-1] % 2:
        raise InvalidArgument(f"gate_up: expected a CPU tensor [..., 2N], got {list(gate_up.shape)} on "
                              f"{gate_up.device}")
    n = gate_up.shape[-1] // 2
    x = gate_up.to(torch.float64)
    gate, up = x[..., :n].contiguous(), x[..., n:].contiguous()
    out = torch.empty(gate.shape, dtype=torch.float64)
    _C.moe_activation(gate, up, out, activation, float(alpha), float(limit))
    return out


@torch.library.custom_op("csfmoe::moe_reference", mutates_args=())
def moe_reference(hidden: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w13_global: torch.Tensor,
                  w2: torch.Tensor, w2_scale: torch.Tensor, w2_global: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, format: str = "nvfp4", order: str = "w13",
                  threads: int = 0, activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
                  w13_bias: Optional[torch.Tensor] = None, w2_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """CPU float64 reference of one MoE layer: float32 [T, H]. Native
    row-major scales [E, rows, K/g]; hidden bf16 [T, H]. activation "gpt_oss"
    (clamped SwiGLU, moe_activation) takes optional float32 expert biases
    w13_bias [E, 2N] (in w13's row order) and w2_bias [E, H]."""
    e, h, n, k = _check_layer(hidden, w13, w13_scale, w13_global, w2, w2_scale, w2_global, topk_ids, topk_weights,
                              format)
    if hidden.device.type != "cpu":
        raise InvalidArgument(f"hidden: moe_reference runs on the CPU, got {hidden.device}")
    _check_activation(activation, w13_bias, w2_bias, e, h, n, hidden.device)
    out = torch.empty(hidden.shape, dtype=torch.float32)
    _C.moe_reference(format, e, h, n, k, order, w13, ops._u8(w13_scale), w13_global, w2, ops._u8(w2_scale),
                     w2_global, hidden.view(torch.int16), topk_ids, topk_weights, out, threads, activation,
                     float(alpha), float(limit), w13_bias, w2_bias)
    return out


@moe_reference.register_fake
def _(hidden, w13, w13_scale, w13_global, w2, w2_scale, w2_global, topk_ids, topk_weights, format="nvfp4",
      order="w13", threads=0, activation="silu", alpha=1.702, limit=7.0, w13_bias=None, w2_bias=None):
    return hidden.new_empty(hidden.shape, dtype=torch.float32)


def _check_activation(activation, w13_bias, w2_bias, e, h, n, dev) -> None:
    """The layer's activation and its optional expert biases (gpt_oss only):
    float32 w13_bias [E, 2N], w2_bias [E, H] on the layer's device."""
    if activation not in ACTIVATIONS:
        raise InvalidArgument(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    for name, b, shape in (("w13_bias", w13_bias, (e, 2 * n)), ("w2_bias", w2_bias, (e, h))):
        if b is None:
            continue
        if activation != "gpt_oss":
            raise InvalidArgument(f"{name}: expert biases are for the gpt_oss activation only, the layer's is "
                                  f"{activation!r}")
        ops._check_tensor(b, name, _FP32, None, dev)
        if tuple(b.shape) != shape:
            raise InvalidArgument(f"{name}: expected shape {list(shape)}, got {list(b.shape)}")


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              w13_scale: Union[torch.Tensor, CsfScales], w2_scale: Union[torch.Tensor, CsfScales],
              w13_global: torch.Tensor, w2_global: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, format: str = "nvfp4", order: str = "w13",
              scales_expanded: bool = False, activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
              w13_bias: Optional[torch.Tensor] = None, w2_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One MoE layer call: out[t] = sum_j w[t,j] * W2[e] (SiLU(gate) * up),
    or with activation "gpt_oss" gpt-oss's clamped SwiGLU and optional
    float32 expert biases (moe_reference).

    CPU tensors run the reference (result cast to hidden's dtype). CsfScales
    are decoded first. CUDA needs a build with the GPU MoE kernels."""
    if hidden.device.type == "cuda":
        # One-off: prepares (and synchronizes) per call. Engines keep a
        # PreparedExperts per layer instead.
        layer = PreparedExperts(w13, w2, w13_scale, w2_scale, w13_global, w2_global, format, order,
                                int(topk_ids.shape[1]), max_tokens=max(int(hidden.shape[0]), 1),
                                activation=activation, alpha=alpha, limit=limit, w13_bias=w13_bias,
                                w2_bias=w2_bias)
        return layer(hidden, topk_ids, topk_weights)
    if isinstance(w13_scale, CsfScales):
        w13_scale = w13_scale.decompress("row_major")
    if isinstance(w2_scale, CsfScales):
        w2_scale = w2_scale.decompress("row_major")
    out = torch.ops.csfmoe.moe_reference(hidden, w13, w13_scale, w13_global, w2, w2_scale, w2_global, topk_ids,
                                         topk_weights, format, order, 0, activation, float(alpha), float(limit),
                                         w13_bias, w2_bias)
    return out.to(hidden.dtype)


# handle -> PreparedExperts for the torch op csfmoe::moe_call; weak, so a
# layer goes away with its last user reference.
_LAYERS = weakref.WeakValueDictionary()


def _host_csf_tensor(scales: CsfScales):
    """The parts of `scales` as one host object the CUDA layer uploads as
    they are (compressed bytes; copied to the host first if on a device)."""
    host = [t.cpu() for t in scales.parts]
    return _C.host_csf_tensor(*host, scales.format, scales.layout, scales.experts, scales.rows, scales.cols)


class PreparedExperts:
    """A layer's experts made ready for repeated calls (plan -> prepare -> bind).

    Mirrors the C++ lifecycle (csfmoe/moe_cuda.hpp): the constructor plans
    (validates geometry and constraints) and prepares the weights; on CUDA
    that encodes CSF scales on the device, allocates the layer's workspace
    (through torch) and synchronizes, so build it at load time, before any
    graph capture. Each stream a call runs on is bound once to that one
    workspace (no allocation, also while a graph is captured, e.g. by
    torch.compile's CUDA graphs): calls of one layer on different streams
    must not overlap. Calls allocate nothing but the output and never
    synchronize: capturable with torch.cuda.graph.

    compression "csf" keeps the block scales as CSF; with scales_expanded the
    call reads scratch that `expand_scales()` filled (share one scratch
    between layers with `scratch=(w13_scratch, w2_scratch)` and order reuse
    with events). CsfScales in the layer's scale_layout are uploaded as they
    are (validated, never decoded); native scales, or CsfScales of another
    layout, are encoded on the device. CPU weights run the float64 reference.

    activation "gpt_oss" runs gpt-oss's clamped SwiGLU (alpha, limit) with
    optional float32 expert biases w13_bias [E, 2N] (in w13's row order:
    gate rows, then up rows for "w13") and w2_bias [E, H] on the weights'
    device, on the CPU reference and in every GPU kernel alike.
    """

    def __init__(self, w13, w2, w13_scale, w2_scale, w13_global, w2_global, format: str = "nvfp4",
                 order: str = "w13", topk: int = 8, compression: str = "none", max_tokens: int = 4096,
                 stage_read_max_tokens: int = 1536, scales_expanded: bool = False, scratch=None,
                 force_mode: str = "", scale_layout: str = "row_major", activation: str = "silu",
                 alpha: float = 1.702, limit: float = 7.0, w13_bias: Optional[torch.Tensor] = None,
                 w2_bias: Optional[torch.Tensor] = None):
        ops._check_tensor(w13, "w13", (torch.uint8,), 3)
        e, two_n, h_half = (int(s) for s in w13.shape)
        self.format, self.order, self.topk = format, order, topk
        self.experts, self.hidden, self.intermediate = e, h_half * 2, two_n // 2
        _check_activation(activation, w13_bias, w2_bias, e, self.hidden, self.intermediate, w13.device)
        self.activation, self.alpha, self.limit = activation, float(alpha), float(limit)
        self.w13_bias, self.w2_bias = w13_bias, w2_bias
        self.compression, self.scales_expanded, self.max_tokens = compression, scales_expanded, max_tokens
        self.plan = plan_moe(format, e, self.hidden, self.intermediate, topk, order, compression, max_tokens,
                             stage_read_max_tokens, scale_layout, activation, alpha, limit)
        dev = w13.device
        self.w13, self.w2 = w13, w2
        self.w13_global, self.w2_global = w13_global.to(torch.float32), w2_global.to(torch.float32)
        self._layer = None
        self._workspace = None
        if dev.type == "cuda":
            if not getattr(_C, "has_moe_cuda", False):
                raise Unsupported("PreparedExperts on CUDA: this csfmoe build has no CUDA MoE kernels")
            # A CSF layer given CsfScales in its scale layout keeps them as
            # they are: their parts go to the device without decoding (the
            # layer validates them). Otherwise the device encodes native
            # scales itself.
            csf_parts = (compression == "csf" and isinstance(w13_scale, CsfScales)
                         and isinstance(w2_scale, CsfScales) and w13_scale.layout == scale_layout
                         and w2_scale.layout == scale_layout)
            if csf_parts:
                s13_arg, s2_arg = _host_csf_tensor(w13_scale), _host_csf_tensor(w2_scale)
                checked = (("w2", w2), ("w13_global", self.w13_global), ("w2_global", self.w2_global))
            else:
                w13_scale = w13_scale.expand(scale_layout) if isinstance(w13_scale, CsfScales) else w13_scale
                w2_scale = w2_scale.expand(scale_layout) if isinstance(w2_scale, CsfScales) else w2_scale
                s13_arg, s2_arg = ops._u8(w13_scale), ops._u8(w2_scale)
                checked = (("w2", w2), ("w13_scale", w13_scale), ("w2_scale", w2_scale),
                           ("w13_global", self.w13_global), ("w2_global", self.w2_global))
            for name, t in checked:
                if t.device != dev:
                    raise InvalidArgument(f"{name}: on {t.device}, w13 is on {dev}")
            mx = format == "mxfp4"
            s13 = s2 = None
            if compression == "csf":
                n13 = e * two_n * (self.hidden // (16 if format == "nvfp4" else 32))
                n2 = e * self.hidden * (self.intermediate // (16 if format == "nvfp4" else 32))
                if scratch is None or scratch[1] is None:
                    scratch = (torch.empty(n13, dtype=torch.uint8, device=dev),
                               torch.empty(n2, dtype=torch.uint8, device=dev))
                s13, s2 = scratch
            self.scratch = scratch
            self._keep = (w13_scale, w2_scale)
            self._layer = _C.CudaMoeLayer(
                format, e, self.hidden, self.intermediate, topk, order, compression, max_tokens,
                stage_read_max_tokens, scale_layout, w13, s13_arg, None if mx else self.w13_global, w2,
                s2_arg, None if mx else self.w2_global, s13, s2, scales_expanded, force_mode,
                ops._stream(dev), activation, self.alpha, self.limit, w13_bias, w2_bias)
            # Allocated here, outside any capture: a workspace allocated while
            # a graph is recorded would belong to the graph's memory pool.
            self._workspace = torch.empty(max(int(self._layer.workspace_bytes(max_tokens)), 1), dtype=torch.uint8,
                                          device=dev)
            if compression == "csf":
                # The layer holds its own CSF copies: the native scales may go.
                self._keep = None
                self.w13_scale = self.w2_scale = None
            else:
                self.w13_scale, self.w2_scale = w13_scale, w2_scale
        else:
            if compression == "csf":
                if not isinstance(w13_scale, CsfScales):
                    w13_scale = CsfScales.compress(w13_scale, format)
                if not isinstance(w2_scale, CsfScales):
                    w2_scale = CsfScales.compress(w2_scale, format)
            self.w13_scale, self.w2_scale = w13_scale, w2_scale
        self.handle = id(self)
        _LAYERS[self.handle] = self

    @property
    def device(self) -> torch.device:
        return self.w13.device

    def resident_scale_bytes(self) -> int:
        if self._layer is not None:
            return int(self._layer.resident_scale_bytes())
        return sum(s.nbytes if isinstance(s, CsfScales) else s.numel() for s in (self.w13_scale, self.w2_scale))

    def expand_scales(self, blocks_per_sm: int = 0) -> None:
        """Fill this layer's scratch with all experts' scales on the current
        stream (for layers built with scales_expanded=True).

        blocks_per_sm caps the expansion's resident blocks per SM (0: as many
        as fit). 1 on a low-priority side stream lets it run beside a call on
        another stream instead of holding whole SMs (ExpandLaunch,
        docs/moe-api.md)."""
        if isinstance(blocks_per_sm, bool) or not isinstance(blocks_per_sm, int) or not 0 <= blocks_per_sm <= 0xFFFF:
            raise InvalidArgument(f"expand_scales: blocks_per_sm must be an int in 0..65535, got {blocks_per_sm!r}")
        if self._layer is None:
            return
        self._layer.expand_scales(ops._stream(self.device), blocks_per_sm)

    def _bind(self, stream: int) -> None:
        if not self._layer.is_bound(stream):
            self._layer.bind_stream(stream, self._workspace)

    def mode_for(self, tokens: int) -> str:
        """Scale mode a call of `tokens` tokens uses on the current stream."""
        stream = ops._stream(self.device)
        self._bind(stream)
        return self._layer.mode_for(stream, tokens)

    def _run(self, hidden, topk_ids, topk_weights):
        if self._layer is None:
            return fused_moe(hidden, self.w13, self.w2, self.w13_scale, self.w2_scale, self.w13_global,
                             self.w2_global, topk_ids, topk_weights, self.format, self.order,
                             activation=self.activation, alpha=self.alpha, limit=self.limit,
                             w13_bias=self.w13_bias, w2_bias=self.w2_bias)
        dev = self.device
        ops._check_tensor(hidden, "hidden", (torch.bfloat16,), 2, dev)
        ops._check_tensor(topk_ids, "topk_ids", ops.INDEX_DTYPES, 2, dev)
        ops._check_tensor(topk_weights, "topk_weights", _FP32, 2, dev)
        if hidden.shape[1] != self.hidden:
            raise InvalidArgument(f"hidden: expected [T, {self.hidden}], got {list(hidden.shape)}")
        if hidden.shape[0] > self.max_tokens:
            raise InvalidArgument(f"hidden: {hidden.shape[0]} tokens exceed max_tokens {self.max_tokens}")
        stream = ops._stream(dev)
        self._bind(stream)
        out = torch.empty_like(hidden)
        self._layer.run(stream, hidden, topk_ids, topk_weights, out)
        return out

    def __call__(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if topk_ids.dim() != 2 or topk_ids.shape[1] != self.topk:
            raise InvalidArgument(f"topk_ids: expected [T, {self.topk}], got {list(topk_ids.shape)}")
        return torch.ops.csfmoe.moe_call(hidden, topk_ids, topk_weights, self.handle)


@torch.library.custom_op("csfmoe::moe_call", mutates_args=())
def moe_call(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, handle: int) -> torch.Tensor:
    """Run the PreparedExperts registered under `handle` (its id): bf16 [T, H]."""
    layer = _LAYERS.get(handle)
    if layer is None:
        raise InvalidArgument(f"moe_call: no PreparedExperts with handle {handle}")
    return layer._run(hidden, topk_ids, topk_weights)


@moe_call.register_fake
def _(hidden, topk_ids, topk_weights, handle):
    return torch.empty_like(hidden)


def prepare_experts(layer: dict, topk: int, format: str = "nvfp4", order: str = "w13",
                    compression: str = "none", device: Optional[Union[str, torch.device]] = None,
                    **constraints) -> PreparedExperts:
    """PreparedExperts from csfmoe.checkpoint.gather_moe_layer's dict (a
    gpt-oss layer's activation, alpha, limit and biases included)."""
    dev = torch.device(device) if device is not None else layer["w13"].device

    def move(x):
        return x.to(dev)

    for key in ("activation", "alpha", "limit"):
        if key in layer:
            constraints.setdefault(key, layer[key])
    for key in ("w13_bias", "w2_bias"):
        if layer.get(key) is not None:
            constraints.setdefault(key, move(layer[key]))
    return PreparedExperts(move(layer["w13"]), move(layer["w2"]), move(layer["w13_scale"]),
                           move(layer["w2_scale"]), move(layer["w13_global"]), move(layer["w2_global"]),
                           format, order, topk, compression, **constraints)
