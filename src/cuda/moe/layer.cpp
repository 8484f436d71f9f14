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
#include "moe/stage_read_index.hpp"

namespace csfmoe {

namespace {

using moe_detail::kTileM;

void cuda_check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw CudaError(fmt::format("{}: {}", what, cudaGetErrorString(err)));
}

// Switches to `device` for the scope, restoring the caller's device.
struct DeviceGuard {
  int previous = -1;
  explicit DeviceGuard(int device) {
    cuda_check(cudaGetDevice(&previous), "cudaGetDevice");
    if (previous != device) cuda_check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int now = -1;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous) (void)cudaSetDevice(previous);
  }
};

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
struct Layout {
  std::uint64_t header = 0, tile_expert = 0, sorted_slot = 0, act = 0, slot_out = 0, total = 0;
};
Layout layout_of(const MoePlan& plan, std::uint32_t max_tokens) {
  const auto up = [](std::uint64_t x) { return round_up(x, 256); };
  const std::uint64_t slots = std::uint64_t{max_tokens} * plan.geometry.topk;
  const std::uint64_t tiles = moe_detail::max_tiles(slots, plan.geometry.experts);
  Layout l;
  l.header = 0;
  l.tile_expert = up(l.header + 16);
  l.sorted_slot = up(l.tile_expert + tiles * 4);
  l.act = up(l.sorted_slot + tiles * kTileM * 4);
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
moe_detail::StageReadIndex host_stage_read_index(const DeviceCsfTensor& t, const moe_detail::IndexRows& rows,
                                                 const char* name) {
  const CsfDeviceView& v = t.view();
  std::vector<std::uint32_t> records(v.num_exceptions), prefix(v.geometry.total_rows() + 1);
  if (!records.empty())
    cuda_check(cudaMemcpy(records.data(), v.exceptions, records.size() * 4, cudaMemcpyDeviceToHost),
               fmt::format("prepare_weights: read the {} exception records", name).c_str());
  cuda_check(cudaMemcpy(prefix.data(), v.row_prefix, prefix.size() * 4, cudaMemcpyDeviceToHost),
             fmt::format("prepare_weights: read the {} row prefix", name).c_str());
  return moe_detail::build_stage_read_index(v.geometry, rows, records, prefix);
}

}  // namespace

MoeWeights prepare_weights(const MoePlan& plan, const MoeDeviceWeights& w, const ScaleScratch* scratch,
                           cudaStream_t stream) {
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
  check_pointer(w.w13_scales, "prepare_weights: weights.w13_scales", w.device, csf ? 1 : 16);
  check_pointer(w.w2_scales, "prepare_weights: weights.w2_scales", w.device, csf ? 1 : 16);
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
  if (csf) {
    out.w13_csf_ = encode_on_device(plan.w13_scales, w.w13_scales, w.device, stream);
    out.w2_csf_ = encode_on_device(plan.w2_scales, w.w2_scales, w.device, stream);
    // The caller may free its native scales once this returns.
    out.src_.w13_scales = nullptr;
    out.src_.w2_scales = nullptr;
  }
  cuda_check(cudaStreamSynchronize(stream), "prepare_weights: stream synchronize");
  const MoeLayerGeometry& geo = plan.geometry;
  if (csf && plan.constraints.stage_read_max_tokens > 0 &&
      moe_detail::decode_shape_ok(geo.hidden, geo.intermediate)) {
    // The stage-read index of both projections (the decode kernel's row
    // blocks: 16 gate + 16 up rows, or 32 down rows), in one allocation.
    moe_detail::IndexRows r13, r2;
    r13.first_half = geo.order == GateUpOrder::w13 ? 0 : geo.intermediate;
    r13.second_half = geo.order == GateUpOrder::w13 ? geo.intermediate : 0;
    r13.stride = 16;
    r13.blocks_per_expert = geo.intermediate / 16;
    r2.blocks_per_expert = geo.hidden / 32;
    const moe_detail::StageReadIndex i13 = host_stage_read_index(out.w13_csf_, r13, "w13"),
                                     i2 = host_stage_read_index(out.w2_csf_, r2, "w2");
    const std::uint64_t at2 = round_up(i13.bytes.size(), 256), total = at2 + i2.bytes.size();
    if (total != 0) {
      void* d = nullptr;
      cuda_check(cudaMalloc(&d, total),
                 fmt::format("prepare_weights: allocate {} bytes of stage-read index", total).c_str());
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
        cuda_check(cudaMemcpy(base + at, i.bytes.data(), i.bytes.size(), cudaMemcpyHostToDevice),
                   "prepare_weights: upload the stage-read index");
        view = {base + at, i.capacity, i.block_bytes, i.blocks_per_expert, i.bytes.size()};
      };
      place(i13, 0, out.w13_index_);
      place(i2, at2, out.w2_index_);
    }
  }
  return out;
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

namespace {
// The smallest T that runs the prefill kernel: the option, or the measured
// crossover of 16 rows per expert on average.
std::uint32_t prefill_threshold(const MoeBindOptions& o, const MoeLayerGeometry& g) {
  if (o.prefill_min_tokens != 0) return o.prefill_min_tokens;
  const std::uint64_t rows = 16ull * g.experts;
  return std::uint32_t(std::max<std::uint64_t>(1, (rows + g.topk - 1) / g.topk));
}
}  // namespace

MoeScaleMode BoundMoe::mode_for(std::uint32_t tokens) const {
  if (options_.force_mode) return *options_.force_mode;
  const MoePlan& p = weights_->plan();
  if (p.constraints.compression == ScaleCompression::none) return MoeScaleMode::native;
  if (scales_expanded_) return MoeScaleMode::expanded;
  // Calls the prefill kernel runs expand their routed experts (it reads dense
  // scales) where the layer has a scratch: at DeepSeek-V3 T = 1024, routed +
  // prefill took 4.8 ms, stage-read + decode 10.6 ms (bench/RESULTS.md).
  const bool prefill =
      prefill_ok_ && weights_->scratch() && tokens >= prefill_threshold(options_, p.geometry);
  return tokens <= p.constraints.stage_read_max_tokens && !prefill ? MoeScaleMode::stage_read
                                                                   : MoeScaleMode::routed;
}

const char* to_string(MoeKernel k) {
  return k == MoeKernel::decode ? "decode" : k == MoeKernel::prefill ? "prefill" : "tiled";
}

MoeKernel BoundMoe::kernel_for(std::uint32_t tokens) const {
  if (prefill_ok_ && tokens >= prefill_threshold(options_, weights_->plan().geometry) &&
      mode_for(tokens) != MoeScaleMode::stage_read)
    return MoeKernel::prefill;
  return decode_ok_ && tokens <= options_.decode_max_tokens ? MoeKernel::decode : MoeKernel::tiled;
}

std::uint32_t BoundMoe::invalid_id_count() const {
  DeviceGuard guard(weights_->source().device);
  int header[2] = {0, 0};
  cuda_check(cudaMemcpyAsync(header, workspace_.data, sizeof header, cudaMemcpyDeviceToHost, stream_),
             "invalid_id_count: copy");
  cuda_check(cudaStreamSynchronize(stream_), "invalid_id_count: synchronize");
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
  BoundMoe b;
  const MoeLayerGeometry& g = p.geometry;
  if (options.decode_max_tokens > 0 && moe_detail::decode_shape_ok(g.hidden, g.intermediate)) {
    int optin = 0;
    cuda_check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, w.source().device),
               "bind: shared memory per block");
    const std::uint32_t need =
        std::max(moe_detail::decode_smem_bytes(g.hidden), moe_detail::decode_smem_bytes(g.intermediate));
    if (need <= std::uint32_t(optin)) {
      moe_detail::configure_decode_kernels(std::uint32_t(optin));
      int sms = 0;
      cuda_check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, w.source().device),
                 "bind: multiprocessor count");
      b.sm_count_ = std::uint32_t(sms);
      b.decode_ok_ = true;
    }
  }
  if (prefill_threshold(options, g) <= max_tokens && moe_detail::prefill_shape_ok(g.hidden, g.intermediate))
    b.prefill_ok_ = moe_detail::configure_prefill_kernels(w.source().device);
  if (options.programmatic_launch) {
    int major = 0;
    cuda_check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, w.source().device),
               "bind: compute capability");
    b.chained_ = major >= 9;
  }
  b.weights_ = &w;
  b.stream_ = stream;
  b.max_tokens_ = max_tokens;
  b.workspace_ = ws;
  b.scales_expanded_ = scales_expanded;
  b.options_ = options;
  return b;
}

void run(const BoundMoe& b, const void* hidden, std::uint32_t tokens, const void* topk_ids, IndexType id_type,
         const float* topk_weights, void* out) {
  if (b.weights_ == nullptr) throw InvalidArgument("run: the binding is empty (use bind)");
  const MoeWeights& w = *b.weights_;
  const MoePlan& p = w.plan();
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
  cuda_check(cudaStreamIsCapturing(b.stream_, &capture), "run: cudaStreamIsCapturing");
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
  const MoeScaleMode mode = b.mode_for(tokens);

  const Layout l = layout_of(p, b.max_tokens_);
  auto* base = static_cast<unsigned char*>(b.workspace_.data);
  moe_detail::Routing r;
  r.header = reinterpret_cast<int*>(base + l.header);
  r.tile_expert = reinterpret_cast<int*>(base + l.tile_expert);
  r.sorted_slot = reinterpret_cast<int*>(base + l.sorted_slot);
  auto* act = reinterpret_cast<std::uint16_t*>(base + l.act);
  auto* slot_out = reinterpret_cast<float*>(base + l.slot_out);
  const std::uint32_t slots = tokens * g.topk;
  const std::uint64_t tiles = moe_detail::max_tiles(slots, g.experts);

  moe_detail::launch_routing(topk_ids, id_type, slots, g.experts, r, b.chained_, b.stream_);

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
  gp.sm_count = b.sm_count_;
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
  gp.chained = b.chained_;
  // Token passes of 8 while nearly every expert tile holds at most 8 rows (one
  // pass): up to 32 tokens, or up to 4 routed rows per expert on average; a
  // wider pass's larger register set costs per pass, and only the 8-token
  // pass prefetches its activations (H200, passes of 8 instead of 16:
  // DeepSeek-V3 T = 64 2377 -> 2097 us, T = 128 2702 -> 2482; Qwen3-30B-A3B
  // T = 64 equal, T = 128, 8 rows per expert, 228 -> 252 us: hence the bound).
  // Passes of 16 (hardly spilling) up to 512 tokens, of 32 (the fewest weight
  // re-reads per tile, but spilling) above.
  using moe_detail::GemmPath;
  const MoeKernel kernel = b.kernel_for(tokens);
  const bool passes_of_8 = tokens <= 32 || std::uint64_t(tokens) * g.topk <= 4ull * g.experts;
  const GemmPath path = kernel == MoeKernel::tiled     ? GemmPath::tiled
                        : kernel == MoeKernel::prefill ? GemmPath::prefill
                        : passes_of_8                  ? GemmPath::decode_8
                        : tokens <= 512                ? GemmPath::decode_16
                                                       : GemmPath::decode_32;
  if (path == GemmPath::prefill) {
    // The prefill kernel reads K-permuted activations. slot_out is written
    // only by the down GEMM, after gate/up has read this copy.
    auto* permuted = reinterpret_cast<std::uint16_t*>(slot_out);
    moe_detail::launch_prefill_permute(static_cast<const std::uint16_t*>(hidden), permuted, tokens, g.hidden,
                                       b.chained_, b.stream_);
    gp.a = permuted;
  }
  moe_detail::launch_gate_up(p.format, path, gp, b.stream_);

  moe_detail::GemmParams dp = gp;
  dp.a = act;
  dp.w = w.source().w2;
  dp.k = g.intermediate;
  dp.out_rows = g.hidden;
  dp.scales = s2;
  dp.global = w.source().w2_global;
  dp.act = nullptr;
  dp.slot_out = slot_out;
  moe_detail::launch_down(p.format, path, dp, b.stream_);

  moe_detail::CombineParams cp;
  cp.slot_out = slot_out;
  cp.ids = topk_ids;
  cp.weights = topk_weights;
  cp.out = static_cast<std::uint16_t*>(out);
  cp.tokens = tokens;
  cp.topk = g.topk;
  cp.hidden = std::uint32_t(H);
  cp.experts = g.experts;
  cp.chained = b.chained_;
  moe_detail::launch_combine(id_type, cp, b.stream_);
  (void)N;
}

}  // namespace csfmoe
