// Fused MoE layer on the GPU (W4A16: FP4 weights and block scales are
// dequantized to BF16 in the kernels and multiplied on BF16 tensor cores with
// FP32 accumulation). Only available when built with CUDA (csfmoe_cuda).
//
// Life cycle, as an inference engine drives it:
//   MoePlan plan = plan_weights(format, geometry, constraints);      // once, host only
//   MoeWeights w = prepare_weights(plan, device_weights, &scratch, stream);  // load time, syncs
//   BoundMoe b = bind(w, stream, max_tokens, workspace, scales_expanded);  // once per stream/shape
//   [expand_scales(w, stream)]   // only for layers bound with scales_expanded = true
//   run(b, hidden, T, ids, id_type, weights, out);                     // per call; graph-capturable
//
// run() allocates nothing and never synchronizes the host: all temporaries
// live in the caller's workspace (moe_workspace_bytes). Results are
// deterministic (no atomics in any reduction) and bitwise identical across
// scale modes: the modes only change where each K slice's scale bytes come from.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>

#include "csfmoe/call_plan.hpp"
#include "csfmoe/device_codec.hpp"
#include "csfmoe/moe.hpp"

namespace csfmoe {

// Device pointers of a layer's weights as the checkpoint loader placed them
// (all on `device`, 16-byte aligned). Scales are in plan.constraints.scale_layout.
struct MoeDeviceWeights {
  const std::uint8_t* w13 = nullptr;         // [E, 2N, H/2] packed E2M1
  const std::uint8_t* w13_scales = nullptr;  // plan.w13_scale_bytes
  const float* w13_global = nullptr;         // [E] FP32 (NVFP4); nullptr for MXFP4 (unit)
  const std::uint8_t* w2 = nullptr;          // [E, H, N/2]
  const std::uint8_t* w2_scales = nullptr;   // plan.w2_scale_bytes
  const float* w2_global = nullptr;          // [E]
  // Expert biases, gpt_oss activation only (null: none): FP32 w13_bias
  // [E, 2N] in the w13 row order, w2_bias [E, H], 16-byte aligned.
  const float* w13_bias = nullptr;
  const float* w2_bias = nullptr;
  int device = 0;
};

// Expanded scales go to a caller-owned ScaleScratch (device_codec.hpp), in
// row-major layout; several layers may share one. Bytes it needs per tensor:
ScratchSizes moe_scale_scratch_bytes(const MoePlan& plan);

struct MoeCsfPlanes;
struct MoeCsfTensors;

// A layer ready to run: the caller's packed weights (referenced, not copied)
// and either its native scales (referenced) or device-resident CSF copies.
class MoeWeights {
 public:
  const MoePlan& plan() const { return plan_; }
  const MoeDeviceWeights& source() const { return src_; }
  // True when the layer holds its own CSF scales: the caller may free its
  // native scale tensors (source().w13_scales / w2_scales are then unused).
  bool source_scales_droppable() const { return plan_.constraints.compression == ScaleCompression::csf; }
  const DeviceCsfTensor& w13_csf() const { return w13_csf_; }
  const DeviceCsfTensor& w2_csf() const { return w2_csf_; }
  const std::optional<ScaleScratch>& scratch() const { return scratch_; }
  // Device bytes of the scales this layer needs resident (native or CSF
  // parts, plus the stage-read index below).
  std::uint64_t resident_scale_bytes() const;
  // A CSF layer also keeps, per projection, an index of its exception records
  // by expert, decode row block and K block (built once by prepare_weights),
  // so that the stage-read decode kernel need not sort them per block; these
  // are its device bytes (0 where the layer has none: compression none,
  // constraints.stage_read_max_tokens = 0, or a layer the decode kernel cannot
  // run). About 4 % of the CSF bytes for NVFP4, 25 % for MXFP4 (whose CSF
  // part is small), measured on synthetic DeepSeek-V3 and Qwen3 layers.
  std::uint64_t stage_read_index_bytes() const;

  // The index of one projection as the kernels read it (internal).
  struct StageReadIndexView {
    const std::uint8_t* data = nullptr;
    std::uint32_t capacity = 0, block_bytes = 0, blocks_per_expert = 0;
    std::uint64_t bytes = 0;
  };
  const StageReadIndexView& w13_stage_read_index() const { return w13_index_; }
  const StageReadIndexView& w2_stage_read_index() const { return w2_index_; }

 private:
  friend MoeWeights prepare_layer(const MoePlan&, const MoeDeviceWeights&, const MoeCsfPlanes*,
                                  const MoeCsfTensors*, const ScaleScratch*, cudaStream_t);
  MoePlan plan_;
  MoeDeviceWeights src_;
  DeviceCsfTensor w13_csf_, w2_csf_;
  std::optional<ScaleScratch> scratch_;
  std::shared_ptr<void> index_storage_;  // both indexes, one device allocation
  StageReadIndexView w13_index_, w2_index_;
};

// Checks every pointer (non-null, 16-byte aligned, on `device`) and, for
// compression csf, encodes both scale tensors on the device (bit-identical to
// the CPU encoder). scale_scratch is required for the expanded and routed
// modes (it may be shared by layers) and may be null otherwise. Synchronizes
// `stream`: call it at load time, before any graph capture.
MoeWeights prepare_weights(const MoePlan& plan, const MoeDeviceWeights& weights,
                           const ScaleScratch* scale_scratch, cudaStream_t stream);

// A CSF layer's block scales as checkpoints store them: per expert, the
// canonical planes (csfmoe/b12x_planes.hpp) of its w13 grid [2N, H/g], rows
// in the plan's gate/up order, and of its w2 grid [H, N/g]. b12x / vLLM
// files, csfmoe's plane containers and its MXFP4 slab containers all read
// into planes without decoding.
struct MoeCsfPlanes {
  std::span<const CsfPlanes> w13, w2;
};

// prepare_weights for a layer of compression csf whose scales come as
// planes (weights.w13_scales / w2_scales must be null): the planes are
// uploaded as they are and the resident CSF parts built from them on the
// device (planes_to_device), never decoded or re-encoded on the host. The
// layer equals one prepared from the decoded native scales, part for part.
// Throws InvalidArgument, before any device work, when the plan is not csf,
// native scale pointers are given, or an expert count or grid differs from
// the plan's; FormatError (naming the tensor and expert) for malformed
// planes; then as the overload above.
MoeWeights prepare_weights(const MoePlan& plan, const MoeDeviceWeights& weights, const MoeCsfPlanes& scales,
                           const ScaleScratch* scale_scratch, cudaStream_t stream);

// A CSF layer's block scales already in csfmoe's resident form on the host
// (CsfTensor: a container's CheckpointFile::csf_parts, Python's CsfScales),
// grids in the plan's scale_layout.
struct MoeCsfTensors {
  const CsfTensor* w13 = nullptr;
  const CsfTensor* w2 = nullptr;
};

// prepare_weights for a layer of compression csf whose scales come as
// resident host parts (weights.w13_scales / w2_scales null): uploaded as
// they are (DeviceCsfTensor::upload validates them first), no decode, no
// re-encode. InvalidArgument before any device work when the plan is not
// csf, native scale pointers are given, a tensor is missing or its grid is
// not the plan's; FormatError for malformed parts.
MoeWeights prepare_weights(const MoePlan& plan, const MoeDeviceWeights& weights, const MoeCsfTensors& scales,
                           const ScaleScratch* scale_scratch, cudaStream_t stream);

// Rebuild all experts' scales of a CSF layer into its scratch on `stream`
// (no allocation, no host sync). A later call bound with scales_expanded =
// true reads them; the caller orders reuse of a shared scratch with events.
// For an expansion behind a running call (a side stream of lower priority)
// pass ExpandLaunch{1} (csfmoe/device_codec.hpp).
void expand_scales(const MoeWeights& weights, cudaStream_t stream, const ExpandLaunch& launch = {});

struct MoeWorkspace {
  void* data = nullptr;  // device memory, 256-byte aligned
  std::uint64_t bytes = 0;
};
// Workspace a binding for up to max_tokens tokens needs.
std::uint64_t moe_workspace_bytes(const MoePlan& plan, std::uint32_t max_tokens);

// A frozen launch configuration: stream, token bound, workspace, the
// device's capabilities (read once here), and the rule that picks a call's
// scale mode from its token count (plan_call, csfmoe/call_plan.hpp):
//   compression none                 -> native
//   csf, scales_expanded = true      -> expanded
//   csf, T <= stage_read_max_tokens  -> stage_read, unless the call runs the
//                                       prefill kernel (prefill_min_tokens)
//                                       and the layer has a scale_scratch
//   csf, otherwise                   -> routed
class BoundMoe {
 public:
  const MoeWeights& weights() const { return *weights_; }
  cudaStream_t stream() const { return stream_; }
  std::uint32_t max_tokens() const { return max_tokens_; }
  const MoeBindOptions& options() const { return options_; }
  const MoeDeviceCaps& device_caps() const { return caps_; }
  // The whole launch plan of a call of `tokens` tokens (plan_call), with the
  // binding's scales_expanded or the call's own.
  MoeCallPlan call_plan(std::uint32_t tokens) const { return call_plan(tokens, scales_expanded_); }
  MoeCallPlan call_plan(std::uint32_t tokens, bool scales_expanded) const;
  bool scales_expanded() const { return scales_expanded_; }
  MoeScaleMode mode_for(std::uint32_t tokens) const { return call_plan(tokens).mode; }
  MoeKernel kernel_for(std::uint32_t tokens) const { return call_plan(tokens).kernel; }
  // Whether the calls launch their kernels as programmatic dependents.
  bool programmatic_launch() const { return options_.programmatic_launch && caps_.cc_major >= 9; }
  // Ids outside [0, E) seen by the last call (they contribute nothing).
  // Synchronizes the stream; for debugging, never inside a capture.
  std::uint32_t invalid_id_count() const;

 private:
  friend BoundMoe bind(const MoeWeights&, cudaStream_t, std::uint32_t, const MoeWorkspace&, bool,
                       const MoeBindOptions&);
  friend void run(const BoundMoe&, const void*, std::uint32_t, const void*, IndexType, const float*, void*,
                  std::optional<bool>);
  const MoeWeights* weights_ = nullptr;  // must outlive the binding
  cudaStream_t stream_ = nullptr;
  std::uint32_t max_tokens_ = 0;
  MoeWorkspace workspace_;
  bool scales_expanded_ = false;
  MoeDeviceCaps caps_;
  MoeBindOptions options_;
};

// Validates and freezes; `weights` must outlive the result. Throws
// InvalidArgument for a too small or misaligned workspace, max_tokens above
// the plan's, a mode that does not suit the layer, or invalid options.tuning.
BoundMoe bind(const MoeWeights& weights, cudaStream_t stream, std::uint32_t max_tokens,
              const MoeWorkspace& workspace, bool scales_expanded, const MoeBindOptions& options = {});

// One layer call on the bound stream. hidden and out: bf16 [T, H]; topk_ids:
// [T, k] int32 or int64; topk_weights: [T, k] f32; all on the layer's device,
// 16-byte aligned (ids and weights 4-byte), out not overlapping the inputs.
// T = 0 does nothing. Asynchronous; capturable in a CUDA graph.
// scales_expanded: this call's choice (reads_expanded_scales says when
// expanding ahead pays), else the binding's; true needs a CSF layer with a
// scale_scratch that expand_scales filled (InvalidArgument otherwise).
void run(const BoundMoe& bound, const void* hidden, std::uint32_t tokens, const void* topk_ids,
         IndexType id_type, const float* topk_weights, void* out,
         std::optional<bool> scales_expanded = std::nullopt);

}  // namespace csfmoe
