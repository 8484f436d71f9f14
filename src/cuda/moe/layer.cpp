// Host side of the fused MoE layer: checks, CSF preparation, binding and the
// launch sequence of one call (routing -> [routed expansion] -> gate/up GEMM
// -> down GEMM -> combine).
#include <fmt/core.h>

#include <algorithm>
#include <string>
#include <vector>

#include "csfmoe/errors.hpp"
#include "csfmoe/moe_cuda.hpp"
#include "cuda/moe/launchers.hpp"
#include "cuda/primitives/cuda_check.hpp"
#include "moe/call_plan.hpp"
#include "moe/stage_read_index.hpp"

namespace csfmoe {

namespace {

using cuda_detail::DeviceGuard;
using moe_detail::kTileM;

// A device pointer argument: non-null, aligned, resident on `device`.
void check_pointer(const void* p, const char* name, int device, std::size_t align,
                   bool check_residency = true) {
  if (p == nullptr) throw InvalidArgument(fmt::format("{} is null", name));
  if (reinterpret_cast<std::uintptr_t>(p) % align != 0)
    throw InvalidArgument(fmt::format("{} ({}) is not {}-byte aligned", name, p, align));
  if (!check_residency) return;
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, p);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw InvalidArgument(fmt::format("{} ({}) is not a CUDA pointer: {}", name, p, cudaGetErrorString(err)));
  }
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)
    throw InvalidArgument(fmt::format("{} ({}) is not device memory", name, p));
  if (attr.type == cudaMemoryTypeDevice && attr.device != device)
    throw InvalidArgument(
        fmt::format("{} ({}) lives on device {}, the layer on device {}", name, p, attr.device, device));
}

// Workspace layout of a binding for max_tokens (offsets 256-byte aligned).
// The routing tables hold the routing of any tile size a call may use (the
// kTileM tiles of the decode, tiled and prefill kernels, the grouped
// kernel's token tiles); act holds the padded rows of kTileM tiles, which
// also covers the grouped kernel's one row per slot; chunk_counts is the
// routing's scratch for calls above one chunk of slots.
struct Layout {
  std::uint64_t header = 0, tile_expert = 0, sorted_slot = 0, chunk_counts = 0, act = 0, slot_out = 0,
                total = 0;
};
Layout layout_of(const MoePlan& plan, std::uint32_t max_tokens) {
  using moe_detail::routed_tiles;
  const auto up = [](std::uint64_t x) { return round_up(x, 256); };
  const std::uint32_t E = plan.geometry.experts;
  const std::uint64_t slots = std::uint64_t{max_tokens} * plan.geometry.topk;
  const std::uint64_t tiles = moe_detail::max_tiles(slots, E);
  const std::uint64_t table_tiles = std::max(tiles, routed_tiles(slots, E, moe_detail::kGroupedMinTile));
  const std::uint64_t table_rows = std::max(
      tiles * kTileM, routed_tiles(slots, E, moe_detail::kGroupedMaxTile) * moe_detail::kGroupedMaxTile);
  Layout l;
  l.header = 0;
  l.tile_expert = up(l.header + 16);
  l.sorted_slot = up(l.tile_expert + table_tiles * 4);
  l.chunk_counts = up(l.sorted_slot + table_rows * 4);
  l.act = up(l.chunk_counts + moe_detail::route_chunks(slots) * (E + 1) * 4);
  l.slot_out = up(l.act + tiles * kTileM * plan.geometry.intermediate * 2);
  l.total = up(l.slot_out + slots * plan.geometry.hidden * 4);
  return l;
}

moe_detail::ScaleSource dense_source(const std::uint8_t* p, const GridShape& s) {
  moe_detail::ScaleSource src;
  src.kind = s.layout == ScaleLayout::swizzled_128x4 ? moe_detail::ScaleKind::dense_swizzled
                                                     : moe_detail::ScaleKind::dense_row_major;
  src.dense = p;
  src.expert_stride = std::uint64_t{s.rows} * s.cols;
  src.cols = s.cols;
  return src;
}

// Expanded scratch is row-major over the CSF tensor's (possibly padded) grid.
moe_detail::ScaleSource scratch_source(const std::uint8_t* p, const GridShape& s) {
  GridShape rm = s;
  rm.layout = ScaleLayout::row_major;
  return dense_source(p, rm);
}

moe_detail::ScaleSource csf_source(const CsfDeviceView& v, const MoeWeights::StageReadIndexView& index) {
  moe_detail::ScaleSource src;
  src.index = index.data;
  src.index_capacity = index.capacity;
  src.index_block_bytes = index.block_bytes;
  src.index_blocks_per_expert = index.blocks_per_expert;
  src.kind = moe_detail::ScaleKind::csf;
  src.fixed = v.fixed;
  src.exceptions = v.exceptions;
  src.row_prefix = v.row_prefix;
  src.layout = v.geometry.layout();
  return src;
}

std::uint64_t row_major_bytes(const GridShape& s) { return std::uint64_t{s.experts} * s.rows * s.cols; }

}  // namespace

ScratchSizes moe_scale_scratch_bytes(const MoePlan& plan) {
  return {row_major_bytes(plan.w13_scales), row_major_bytes(plan.w2_scales)};
}

std::uint64_t MoeWeights::resident_scale_bytes() const {
  if (plan_.constraints.compression == ScaleCompression::csf)
    return w13_csf_.resident_bytes() + w2_csf_.resident_bytes() + stage_read_index_bytes();
  return plan_.w13_scale_bytes + plan_.w2_scale_bytes;
}

std::uint64_t MoeWeights::stage_read_index_bytes() const { return w13_index_.bytes + w2_index_.bytes; }

namespace {

// The stage-read index of one CSF tensor, built on the host from its
// exception records and row prefix (a few MB for a large layer).
moe_detail::StageReadIndex host_stage_read_index(const DeviceCsfTensor& t,
                                                 const moe_detail::IndexRows& rows) {
  const CsfDeviceView& v = t.view();
  std::vector<std::uint32_t> records(v.num_exceptions), prefix(v.geometry.total_rows() + 1);
  if (!records.empty())
    CSFMOE_CUDA_CHECK(cudaMemcpy(records.data(), v.exceptions, records.size() * 4, cudaMemcpyDeviceToHost));
  CSFMOE_CUDA_CHECK(cudaMemcpy(prefix.data(), v.row_prefix, prefix.size() * 4, cudaMemcpyDeviceToHost));
  return moe_detail::build_stage_read_index(v.geometry, rows, records, prefix);
}

// Scales given as CSF parts (planes or resident tensors): a csf plan and no
// native scale pointers.
void check_csf_given(const MoePlan& plan, const MoeDeviceWeights& w, const char* what) {
  if (plan.constraints.compression != ScaleCompression::csf)
    throw InvalidArgument(
        fmt::format("prepare_weights: scales given as {} need a plan of compression csf", what));
  if (w.w13_scales || w.w2_scales)
    throw InvalidArgument(fmt::format(
        "prepare_weights: the scales come as {}; weights.w13_scales / w2_scales must be null", what));
}

// The checks of a layer's scales given as planes that need no device.
void check_planes(const MoePlan& plan, const MoeDeviceWeights& w, const MoeCsfPlanes& planes) {
  check_csf_given(plan, w, "CSF planes");
  const auto check = [&](std::span<const CsfPlanes> experts, const GridShape& need, const char* what) {
    if (experts.size() != need.experts)
      throw InvalidArgument(fmt::format("prepare_weights: {} scale planes hold {} experts, the plan has {}",
                                        what, experts.size(), need.experts));
    const PlaneShape shape{need.format, need.rows, need.cols};
    for (std::size_t e = 0; e < experts.size(); ++e)
      if (experts[e].shape != shape)
        throw InvalidArgument(
            fmt::format("prepare_weights: {} scale planes of expert {} hold grid {}, the plan "
                        "needs {}",
                        what, e, to_string(experts[e].shape), to_string(shape)));
  };
  check(planes.w13, plan.w13_scales, "w13");
  check(planes.w2, plan.w2_scales, "w2");
}

// The same for resident host tensors (their parts are validated by upload).
void check_tensors(const MoePlan& plan, const MoeDeviceWeights& w, const MoeCsfTensors& tensors) {
  check_csf_given(plan, w, "CSF tensors");
  const auto check = [&](const CsfTensor* t, const GridShape& need, const char* what) {
    if (t == nullptr) throw InvalidArgument(fmt::format("prepare_weights: the {} CSF tensor is null", what));
    if (t->geometry.shape != need)
      throw InvalidArgument(fmt::format("prepare_weights: the {} CSF tensor has grid {}, the plan needs {}",
                                        what, to_string(t->geometry.shape), to_string(need)));
  };
  check(tensors.w13, plan.w13_scales, "w13");
  check(tensors.w2, plan.w2_scales, "w2");
}

}  // namespace

MoeWeights prepare_layer(const MoePlan& plan, const MoeDeviceWeights& w, const MoeCsfPlanes* planes,
                         const MoeCsfTensors* tensors, const ScaleScratch* scratch, cudaStream_t stream) {
  if (planes) check_planes(plan, w, *planes);
  if (tensors) check_tensors(plan, w, *tensors);
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    throw Unsupported("prepare_weights: no CUDA device is available");
  }
  if (w.device < 0 || w.device >= count)
    throw InvalidArgument(
        fmt::format("prepare_weights: weights.device {} is not in [0, {})", w.device, count));
  DeviceGuard guard(w.device);
  const bool csf = plan.constraints.compression == ScaleCompression::csf;
  check_pointer(w.w13, "prepare_weights: weights.w13", w.device, 16);
  check_pointer(w.w2, "prepare_weights: weights.w2", w.device, 16);
  if (!planes && !tensors) {
    check_pointer(w.w13_scales, "prepare_weights: weights.w13_scales", w.device, csf ? 1 : 16);
    check_pointer(w.w2_scales, "prepare_weights: weights.w2_scales", w.device, csf ? 1 : 16);
  }
  if (plan.geometry.activation.kind == MoeActivation::gpt_oss) {
    // Optional (a gpt_oss layer without biases adds none); FP32, 16-byte
    // aligned for the combine's float4 reads.
    if (w.w13_bias) check_pointer(w.w13_bias, "prepare_weights: weights.w13_bias", w.device, 16);
    if (w.w2_bias) check_pointer(w.w2_bias, "prepare_weights: weights.w2_bias", w.device, 16);
  } else if (w.w13_bias || w.w2_bias) {
    throw InvalidArgument(fmt::format(
        "prepare_weights: weights.w13_bias/w2_bias are for the gpt_oss activation only, the layer's is {}",
        to_string(plan.geometry.activation.kind)));
  }
  if (plan.format == ScaleFormat::nvfp4) {
    check_pointer(w.w13_global, "prepare_weights: weights.w13_global (NVFP4 needs per-expert FP32 globals)",
                  w.device, 4);
    check_pointer(w.w2_global, "prepare_weights: weights.w2_global (NVFP4 needs per-expert FP32 globals)",
                  w.device, 4);
  } else if (w.w13_global || w.w2_global) {
    throw InvalidArgument(
        "prepare_weights: MXFP4 has no global scale; weights.w13_global/w2_global must be null");
  }
  MoeWeights out;
  out.plan_ = plan;
  out.src_ = w;
  if (scratch) {
    const ScratchSizes need = moe_scale_scratch_bytes(plan);
    if (!csf) throw InvalidArgument("prepare_weights: a scale_scratch is only used with compression csf");
    check_pointer(scratch->w13, "prepare_weights: scale_scratch.w13", w.device, 16);
    check_pointer(scratch->w2, "prepare_weights: scale_scratch.w2", w.device, 16);
    if (scratch->w13_bytes < need.w13 || scratch->w2_bytes < need.w2)
      throw InvalidArgument(
          fmt::format("prepare_weights: scale_scratch holds {} + {} bytes, the layer needs {} + {} "
                      "(moe_scale_scratch_bytes)",
                      scratch->w13_bytes, scratch->w2_bytes, need.w13, need.w2));
    out.scratch_ = *scratch;
  }
  if (planes) {
    const ScaleLayout layout = plan.constraints.scale_layout;
    out.w13_csf_ = planes_to_device(planes->w13, layout, w.device, stream, "w13 scales");
    out.w2_csf_ = planes_to_device(planes->w2, layout, w.device, stream, "w2 scales");
  } else if (tensors) {
    // upload validates the parts; its errors get the projection's name.
    const auto upload = [&](const CsfTensor& t, const char* what) {
      try {
        return DeviceCsfTensor::upload(t, w.device);
      } catch (const FormatError& e) {
        throw FormatError(fmt::format("prepare_weights: {} scales: {}", what, e.what()));
      }
    };
    out.w13_csf_ = upload(*tensors->w13, "w13");
    out.w2_csf_ = upload(*tensors->w2, "w2");
  } else if (csf) {
    out.w13_csf_ = encode_on_device(plan.w13_scales, w.w13_scales, w.device, stream);
    out.w2_csf_ = encode_on_device(plan.w2_scales, w.w2_scales, w.device, stream);
    // The caller may free its native scales once this returns.
    out.src_.w13_scales = nullptr;
    out.src_.w2_scales = nullptr;
  }
  CSFMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  const MoeLayerGeometry& geo = plan.geometry;
  if (csf && plan.constraints.stage_read_max_tokens > 0 &&
      moe_detail::decode_shape_ok(geo.hidden, geo.intermediate)) {
    // The stage-read index of both projections (the decode kernel's row
    // blocks: 16 gate + 16 up rows, or 32 down rows), in one allocation.
    moe_detail::IndexRows r13, r2;
    r13.first_half = geo.order == GateUpOrder::w13 ? 0 : geo.intermediate;
    r13.second_half = geo.order == GateUpOrder::w13 ? geo.intermediate : 0;
    using moe_detail::kDecodeHalfRows;
    using moe_detail::kDecodeRows;
    static_assert(moe_detail::IndexRows{}.stride == kDecodeRows &&
                      moe_detail::IndexRows{}.second_half == kDecodeHalfRows,
                  "the index's default rows are a down row block");
    r13.stride = kDecodeHalfRows;
    r13.blocks_per_expert = geo.intermediate / kDecodeHalfRows;
    r2.blocks_per_expert = geo.hidden / kDecodeRows;
    const moe_detail::StageReadIndex i13 = host_stage_read_index(out.w13_csf_, r13),
                                     i2 = host_stage_read_index(out.w2_csf_, r2);
    const std::uint64_t at2 = round_up(i13.bytes.size(), 256), total = at2 + i2.bytes.size();
    if (total != 0) {
      void* d = nullptr;
      CSFMOE_CUDA_CHECK(cudaMalloc(&d, total));
      const int device = w.device;
      out.index_storage_ = std::shared_ptr<void>(d, [device](void* q) {
        try {
          DeviceGuard guard(device);
          (void)cudaFree(q);
        } catch (...) {  // destructors must not throw: the context is gone or the device is lost
        }
      });
      auto* base = static_cast<std::uint8_t*>(d);
      const auto place = [&](const moe_detail::StageReadIndex& i, std::uint64_t at,
                             MoeWeights::StageReadIndexView& view) {
        if (i.bytes.empty()) return;
        CSFMOE_CUDA_CHECK(cudaMemcpy(base + at, i.bytes.data(), i.bytes.size(), cudaMemcpyHostToDevice));
        view = {base + at, i.capacity, i.block_bytes, i.blocks_per_expert, i.bytes.size()};
      };
      place(i13, 0, out.w13_index_);
      place(i2, at2, out.w2_index_);
    }
  }
  return out;
}

MoeWeights prepare_weights(const MoePlan& plan, const MoeDeviceWeights& w, const ScaleScratch* scratch,
                           cudaStream_t stream) {
  return prepare_layer(plan, w, nullptr, nullptr, scratch, stream);
}

MoeWeights prepare_weights(const MoePlan& plan, const MoeDeviceWeights& w, const MoeCsfPlanes& scales,
                           const ScaleScratch* scratch, cudaStream_t stream) {
  return prepare_layer(plan, w, &scales, nullptr, scratch, stream);
}

MoeWeights prepare_weights(const MoePlan& plan, const MoeDeviceWeights& w, const MoeCsfTensors& scales,
                           const ScaleScratch* scratch, cudaStream_t stream) {
  return prepare_layer(plan, w, nullptr, &scales, scratch, stream);
}

void expand_scales(const MoeWeights& w, cudaStream_t stream, const ExpandLaunch& launch) {
  if (w.plan().constraints.compression != ScaleCompression::csf)
    throw InvalidArgument("expand_scales: the layer keeps native scales (compression none)");
  if (!w.scratch()) throw InvalidArgument("expand_scales: the layer was prepared without a scale_scratch");
  DeviceGuard guard(w.source().device);
  LayerScales layer;
  layer.w13 = ScaleTensorRef::of_csf(w.w13_csf());
  layer.w2 = ScaleTensorRef::of_csf(w.w2_csf());
  (void)csfmoe::expand_scales(layer, *w.scratch(), ScaleLayout::row_major, stream, launch);
}

std::uint64_t moe_workspace_bytes(const MoePlan& plan, std::uint32_t max_tokens) {
  if (max_tokens == 0 || max_tokens > plan.constraints.max_tokens)
    throw InvalidArgument(fmt::format("moe_workspace_bytes: max_tokens {} must be in [1, plan max_tokens {}]",
                                      max_tokens, plan.constraints.max_tokens));
  return layout_of(plan, max_tokens).total;
}

MoeCallPlan BoundMoe::call_plan(std::uint32_t tokens, bool scales_expanded) const {
  return plan_call(weights_->plan(), caps_, tokens, scales_expanded, weights_->scratch().has_value(),
                   options_);
}

std::uint32_t BoundMoe::invalid_id_count() const {
  DeviceGuard guard(weights_->source().device);
  int header[2] = {0, 0};
  CSFMOE_CUDA_CHECK(cudaMemcpyAsync(header, workspace_.data, sizeof header, cudaMemcpyDeviceToHost, stream_));
  CSFMOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return std::uint32_t(header[1]);
}

BoundMoe bind(const MoeWeights& w, cudaStream_t stream, std::uint32_t max_tokens, const MoeWorkspace& ws,
              bool scales_expanded, const MoeBindOptions& options) {
  const MoePlan& p = w.plan();
  if (max_tokens == 0 || max_tokens > p.constraints.max_tokens)
    throw InvalidArgument(fmt::format("bind: max_tokens {} must be in [1, plan max_tokens {}]", max_tokens,
                                      p.constraints.max_tokens));
  DeviceGuard guard(w.source().device);
  check_pointer(ws.data, "bind: workspace.data", w.source().device, 256);
  const std::uint64_t need = layout_of(p, max_tokens).total;
  if (ws.bytes < need)
    throw InvalidArgument(
        fmt::format("bind: workspace holds {} bytes, max_tokens {} needs {} (moe_workspace_bytes)", ws.bytes,
                    max_tokens, need));
  const bool csf = p.constraints.compression == ScaleCompression::csf;
  if (scales_expanded && !csf)
    throw InvalidArgument(
        "bind: scales_expanded = true needs a CSF layer (compression none reads native scales)");
  if (scales_expanded && !w.scratch())
    throw InvalidArgument("bind: scales_expanded = true needs a layer prepared with a scale_scratch");
  if (options.force_mode) {
    const MoeScaleMode m = *options.force_mode;
    if ((m == MoeScaleMode::native) == csf)
      throw InvalidArgument(fmt::format("bind: force_mode {} does not suit a layer with compression {}",
                                        to_string(m), to_string(p.constraints.compression)));
    if ((m == MoeScaleMode::expanded || m == MoeScaleMode::routed) && !w.scratch())
      throw InvalidArgument(
          fmt::format("bind: force_mode {} needs a layer prepared with a scale_scratch", to_string(m)));
  } else if (csf && !scales_expanded && !w.scratch() && p.constraints.stage_read_max_tokens < max_tokens) {
    throw InvalidArgument(
        fmt::format("bind: calls above stage_read_max_tokens {} expand routed experts and need a "
                    "scale_scratch (max_tokens {})",
                    p.constraints.stage_read_max_tokens, max_tokens));
  }
  try {
    validate(options);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(std::string("bind: ") + e.what());
  }
  BoundMoe b;
  const MoeLayerGeometry& g = p.geometry;
  const int dev = w.source().device;
  int sms = 0, optin = 0, major = 0, minor = 0;
  CSFMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CSFMOE_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  CSFMOE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  CSFMOE_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  b.caps_.sm_count = std::uint32_t(sms);
  b.caps_.smem_per_block_optin = std::uint32_t(optin);
  b.caps_.cc_major = major;
  b.caps_.cc_minor = minor;
  if (moe_detail::decode_possible(p, b.caps_, options))
    moe_detail::configure_decode_kernels(std::uint32_t(optin));
  if (moe_detail::prefill_threshold(options, g) <= max_tokens &&
      moe_detail::prefill_shape_ok(g.hidden, g.intermediate))
    b.caps_.prefill_kernels = moe_detail::configure_prefill_kernels(dev);
  if (moe_detail::grouped_threshold(options, g) <= max_tokens &&
      moe_detail::grouped_shape_ok(g.hidden, g.intermediate))
    b.caps_.grouped_kernels = moe_detail::configure_grouped_kernels(dev);
  b.weights_ = &w;
  b.stream_ = stream;
  b.max_tokens_ = max_tokens;
  b.workspace_ = ws;
  b.scales_expanded_ = scales_expanded;
  b.options_ = options;
  return b;
}

void run(const BoundMoe& b, const void* hidden, std::uint32_t tokens, const void* topk_ids, IndexType id_type,
         const float* topk_weights, void* out, std::optional<bool> scales_expanded) {
  if (b.weights_ == nullptr) throw InvalidArgument("run: the binding is empty (use bind)");
  const MoeWeights& w = *b.weights_;
  const MoePlan& p = w.plan();
  const bool expanded = scales_expanded.value_or(b.scales_expanded_);
  if (expanded && (p.constraints.compression != ScaleCompression::csf || !w.scratch()))
    throw InvalidArgument("run: scales_expanded = true needs a CSF layer prepared with a scale_scratch");
  const MoeLayerGeometry& g = p.geometry;
  if (tokens > b.max_tokens_)
    throw InvalidArgument(
        fmt::format("run: tokens {} exceeds the bound max_tokens {}", tokens, b.max_tokens_));
  if (id_type != IndexType::int32 && id_type != IndexType::int64)
    throw InvalidArgument(fmt::format("run: topk_ids type {} is not int32 or int64", unsigned(id_type)));
  if (tokens == 0) return;
  const int dev = w.source().device;
  DeviceGuard guard(dev);
  // Attribute queries are not stream work, but skip them while capturing so
  // that run() adds nothing but kernels to a graph.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  CSFMOE_CUDA_CHECK(cudaStreamIsCapturing(b.stream_, &capture));
  const bool resid = capture == cudaStreamCaptureStatusNone;
  check_pointer(hidden, "run: hidden", dev, 16, resid);
  check_pointer(out, "run: out", dev, 16, resid);
  check_pointer(topk_ids, "run: topk_ids", dev, id_type == IndexType::int64 ? 8 : 4, resid);
  check_pointer(topk_weights, "run: topk_weights", dev, 4, resid);
  const std::uint64_t H = g.hidden, N = g.intermediate;
  {
    const auto lo = [](const void* q) { return reinterpret_cast<std::uintptr_t>(q); };
    const std::uint64_t act_bytes = tokens * H * 2;
    if (lo(out) < lo(hidden) + act_bytes && lo(hidden) < lo(out) + act_bytes)
      throw InvalidArgument("run: out overlaps hidden");
  }
  const MoeCallPlan plan = b.call_plan(tokens, expanded);
  const MoeScaleMode mode = plan.mode;

  const Layout l = layout_of(p, b.max_tokens_);
  auto* base = static_cast<unsigned char*>(b.workspace_.data);
  moe_detail::Routing r;
  r.header = reinterpret_cast<int*>(base + l.header);
  r.tile_expert = reinterpret_cast<int*>(base + l.tile_expert);
  r.sorted_slot = reinterpret_cast<int*>(base + l.sorted_slot);
  r.chunk_counts = reinterpret_cast<int*>(base + l.chunk_counts);
  auto* act = reinterpret_cast<std::uint16_t*>(base + l.act);
  auto* slot_out = reinterpret_cast<float*>(base + l.slot_out);
  const std::uint32_t slots = tokens * g.topk;
  const bool grouped = plan.kernel == MoeKernel::grouped;
  if (grouped) r.tile_rows = plan.token_tile;
  const std::uint64_t tiles = moe_detail::max_tiles(slots, g.experts);

  moe_detail::launch_routing(topk_ids, id_type, slots, g.experts, r, plan.routing_chunked,
                             plan.programmatic_launch, b.stream_);

  moe_detail::ScaleSource s13, s2;
  switch (mode) {
    case MoeScaleMode::native:
      s13 = dense_source(w.source().w13_scales, p.w13_scales);
      s2 = dense_source(w.source().w2_scales, p.w2_scales);
      break;
    case MoeScaleMode::routed: {
      LayerScales layer;
      layer.w13 = ScaleTensorRef::of_csf(w.w13_csf());
      layer.w2 = ScaleTensorRef::of_csf(w.w2_csf());
      // The routed kernel for every strategy today (routed_expansion_kernel).
      (void)expand_scales_routed(layer, *w.scratch(), ScaleLayout::row_major, topk_ids, id_type, slots,
                                 b.stream_);
    }
      [[fallthrough]];
    case MoeScaleMode::expanded:
      s13 = scratch_source(w.scratch()->w13, p.w13_scales);
      s2 = scratch_source(w.scratch()->w2, p.w2_scales);
      break;
    case MoeScaleMode::stage_read:
      s13 = csf_source(w.w13_csf().view(), w.w13_stage_read_index());
      s2 = csf_source(w.w2_csf().view(), w.w2_stage_read_index());
      break;
  }

  moe_detail::GemmParams gp;
  gp.header = r.header;
  gp.tile_expert = r.tile_expert;
  gp.sorted_slot = r.sorted_slot;
  gp.max_tiles = std::uint32_t(tiles);
  gp.sm_count = b.caps_.sm_count;
  gp.a = static_cast<const std::uint16_t*>(hidden);
  gp.topk = g.topk;
  gp.w = w.source().w13;
  gp.k = g.hidden;
  gp.out_rows = 2 * g.intermediate;
  gp.scales = s13;
  gp.global = w.source().w13_global;
  gp.n = g.intermediate;
  gp.gate_row0 = g.order == GateUpOrder::w13 ? 0 : g.intermediate;
  gp.up_row0 = g.order == GateUpOrder::w13 ? g.intermediate : 0;
  gp.act = act;
  gp.activation = g.activation.kind;
  gp.act_alpha = float(g.activation.alpha);
  gp.act_limit = float(g.activation.limit);
  gp.bias = w.source().w13_bias;
  gp.chained = plan.programmatic_launch;
  using moe_detail::GemmPath;
  const GemmPath path = plan.kernel == MoeKernel::tiled     ? GemmPath::tiled
                        : plan.kernel == MoeKernel::prefill ? GemmPath::prefill
                        : plan.token_pass == 8              ? GemmPath::decode_8
                        : plan.token_pass == 16             ? GemmPath::decode_16
                                                            : GemmPath::decode_32;
  gp.decode = plan.gate_up;
  if (grouped || path == GemmPath::prefill) {
    // The wgmma kernels read K-permuted activations. slot_out is written
    // only by the down GEMM, after gate/up has read this copy.
    auto* permuted = reinterpret_cast<std::uint16_t*>(slot_out);
    moe_detail::launch_prefill_permute(static_cast<const std::uint16_t*>(hidden), permuted, tokens, g.hidden,
                                       plan.programmatic_launch, b.stream_);
    gp.a = permuted;
  }
  gp.tile_group = plan.tile_group;
  if (grouped)
    moe_detail::launch_grouped(p.format, true, plan.token_tile, plan.ring_scales, g.experts, gp, b.stream_);
  else
    moe_detail::launch_gate_up(p.format, path, gp, b.stream_);

  // Down reads act: per sorted row, or per slot (grouped).
  moe_detail::GemmParams dp = gp;
  dp.a = act;
  dp.w = w.source().w2;
  dp.k = g.intermediate;
  dp.out_rows = g.hidden;
  dp.scales = s2;
  dp.global = w.source().w2_global;
  dp.act = nullptr;
  dp.bias = nullptr;
  dp.slot_out = slot_out;
  dp.decode = plan.down;
  if (plan.bf16_slots) dp.slot_out16 = reinterpret_cast<std::uint16_t*>(slot_out);
  if (grouped)
    moe_detail::launch_grouped(p.format, false, plan.token_tile, plan.ring_scales, g.experts, dp, b.stream_);
  else
    moe_detail::launch_down(p.format, path, dp, b.stream_);

  moe_detail::CombineParams cp;
  cp.slot_out = slot_out;
  cp.slot_out16 = dp.slot_out16;
  cp.ids = topk_ids;
  cp.weights = topk_weights;
  cp.out = static_cast<std::uint16_t*>(out);
  cp.tokens = tokens;
  cp.topk = g.topk;
  cp.hidden = std::uint32_t(H);
  cp.experts = g.experts;
  cp.bias = w.source().w2_bias;
  cp.chained = plan.programmatic_launch;
  moe_detail::launch_combine(id_type, cp, b.stream_);
  (void)N;
}

}  // namespace csfmoe
