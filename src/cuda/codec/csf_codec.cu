// Host side of the GPU CSF codec: validation, allocation, launch
// configuration and dispatch (see include/csfmoe/device_codec.hpp and
// docs/gpu-codec.md). Kernels are in csf_codec.cuh.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cub/device/device_scan.cuh>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "csfmoe/device_codec.hpp"
#include "csfmoe/errors.hpp"
#include "cuda/codec/csf_codec.cuh"
#include "cuda/codec/device_tensor.hpp"
#include "cuda/primitives/cuda_check.hpp"
#include "cuda/primitives/strf.hpp"

namespace csfmoe {

using codec_detail::check_device;
using cuda_detail::DeviceGuard;
using gpu::u32;
using gpu::u64;
using gpu::u8;

namespace {

template <class... A>
std::string msg(std::string_view f, const A&... a) {
  return cuda_detail::strf(f, a...);
}

// The pointer must be device (or managed) memory usable on `device`.
void check_device_pointer(const void* p, int device, const char* who, const char* what) {
  if (p == nullptr) throw InvalidArgument(msg("{}: {} is null", who, what));
  cudaPointerAttributes a{};
  CSFMOE_CUDA_CHECK(cudaPointerGetAttributes(&a, p));
  if (a.type == cudaMemoryTypeManaged) return;
  if (a.type != cudaMemoryTypeDevice)
    throw InvalidArgument(msg("{}: {} is not device memory (cudaPointerGetAttributes type {})", who, what,
                              static_cast<int>(a.type)));
  if (a.device != device)
    throw InvalidArgument(
        msg("{}: {} lives on device {}, but the tensor is on device {}", who, what, a.device, device));
}

struct DeviceInfo {
  int sms = 0;
};
DeviceInfo device_info(int device) {
  static std::mutex m;
  static std::map<int, DeviceInfo> cache;
  std::lock_guard lock(m);
  auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  DeviceInfo info;
  CSFMOE_CUDA_CHECK(cudaDeviceGetAttribute(&info.sms, cudaDevAttrMultiProcessorCount, device));
  cache.emplace(device, info);
  return info;
}

// Resident blocks per SM of a kernel at a dynamic shared-memory size, cached
// so that the routed path (called per MoE step) does no repeated queries.
int blocks_per_sm(int device, const void* fn, std::size_t smem) {
  static std::mutex m;
  static std::map<std::tuple<int, const void*, std::size_t>, int> cache;
  std::lock_guard lock(m);
  const auto key = std::tuple(device, fn, smem);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  int n = 0;
  CSFMOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, fn, gpu::kThreads, smem));
  n = std::max(n, 1);
  cache.emplace(key, n);
  return n;
}

void check_view(const CsfDeviceView& v, const char* who) {
  const CsfGeometry want = CsfGeometry::of(v.geometry.shape);
  const CsfGeometry& g = v.geometry;
  if (g.padded_rows != want.padded_rows || g.padded_cols != want.padded_cols ||
      g.slab_rows != want.slab_rows || g.slab_bytes != want.slab_bytes ||
      g.fixed_bytes_per_expert != want.fixed_bytes_per_expert || g.partition_rows != want.partition_rows ||
      g.partitions_per_expert != want.partitions_per_expert)
    throw InvalidArgument(
        msg("{}: the tensor view's geometry does not match its shape {}", who, to_string(g.shape)));
  if (v.fixed == nullptr || v.row_prefix == nullptr || v.partition_index == nullptr)
    throw InvalidArgument(
        msg("{}: the tensor view of {} has a null part (empty tensor?)", who, to_string(g.shape)));
  if (v.num_exceptions > 0 && v.exceptions == nullptr)
    throw InvalidArgument(
        msg("{}: the tensor view lists {} exceptions but their pointer is null", who, v.num_exceptions));
  if (reinterpret_cast<std::uintptr_t>(v.fixed) % 16 != 0)
    throw InvalidArgument(msg("{}: the fixed part must be 16-byte aligned", who));
  check_device(v.device, who);
}

void check_layout(ScaleLayout layout, const char* who) {
  if (!is_known(layout))
    throw InvalidArgument(msg("{}: unknown destination layout {}", who, static_cast<unsigned>(layout)));
}

using ExpandFn = void (*)(gpu::ExpandParams);

template <ScaleFormat F, ScaleLayout L>
ExpandFn pick_expand(bool routed) {
  if (routed) return gpu::expand_kernel<F, L, true>;
  return gpu::expand_kernel<F, L, false>;
}

ExpandFn expand_fn(ScaleFormat f, ScaleLayout l, bool routed) {
  const bool rm = l == ScaleLayout::row_major;
  if (f == ScaleFormat::nvfp4)
    return rm ? pick_expand<ScaleFormat::nvfp4, ScaleLayout::row_major>(routed)
              : pick_expand<ScaleFormat::nvfp4, ScaleLayout::swizzled_128x4>(routed);
  return rm ? pick_expand<ScaleFormat::mxfp4, ScaleLayout::row_major>(routed)
            : pick_expand<ScaleFormat::mxfp4, ScaleLayout::swizzled_128x4>(routed);
}

struct RoutedIds {
  const void* ids = nullptr;
  IndexType type = IndexType::int32;
  u64 count = 0;
};

constexpr u32 kMaxRoutedExperts = 65536;

void check_ids(const RoutedIds& r, u32 experts, const char* who) {
  if (r.type != IndexType::int32 && r.type != IndexType::int64)
    throw InvalidArgument(msg("{}: unknown id type {}", who, static_cast<unsigned>(r.type)));
  if (r.count > 0 && r.ids == nullptr)
    throw InvalidArgument(msg("{}: ids is null with count {}", who, r.count));
  const std::size_t align = r.type == IndexType::int64 ? 8 : 4;
  if (reinterpret_cast<std::uintptr_t>(r.ids) % align != 0)
    throw InvalidArgument(msg("{}: ids must be {}-byte aligned", who, align));
  if (experts > kMaxRoutedExperts)
    throw Unsupported(msg("{}: routed expansion supports at most {} experts, the tensor has {}", who,
                          kMaxRoutedExperts, experts));
}

// One launch over one or two tensors of the same format, device and expert
// count. Views are checked by the caller.
void launch_expand(const CsfDeviceView* const* views, u8* const* dsts, u32 njobs, ScaleLayout layout,
                   const RoutedIds* routed, cudaStream_t stream, const ExpandLaunch& launch = {}) {
  const CsfDeviceView& v0 = *views[0];
  gpu::ExpandParams p;
  p.njobs = njobs;
  p.experts = v0.geometry.shape.experts;
  u64 units = 0;
  u32 stage = 0;
  for (u32 j = 0; j < njobs; ++j) {
    const CsfDeviceView& v = *views[j];
    const codec_detail::ExpandPlan plan =
        codec_detail::plan_expand_job(v.geometry, v.fixed, v.exceptions, v.partition_index, layout, dsts[j]);
    p.job[j] = plan.job;
    stage = std::max(stage, plan.stage_bytes);
    units += plan.job.units;
  }
  p.stage_bytes = stage;
  u64 slots = p.experts;
  std::size_t smem = stage;
  if (routed) {
    if (routed->count == 0) return;  // nothing routed: nothing to write
    p.ids = routed->ids;
    p.count = routed->count;
    p.ids64 = routed->type == IndexType::int64;
    slots = std::min<u64>(routed->count, p.experts);
    smem += std::size_t{2} * ((p.experts + 31) / 32) * 4;
  }
  const u64 items = slots * units;
  if (items == 0) return;
  DeviceGuard guard(v0.device);
  const ExpandFn fn = expand_fn(v0.geometry.shape.format, layout, routed != nullptr);
  // Blocks loop over work items: the grid is the resident block count, or
  // fewer for a background expansion (ExpandLaunch).
  const int fit = blocks_per_sm(v0.device, reinterpret_cast<const void*>(fn), smem);
  const int per_sm =
      launch.blocks_per_sm != 0 && launch.blocks_per_sm < u32(fit) ? int(launch.blocks_per_sm) : fit;
  const u64 resident = u64{static_cast<u32>(device_info(v0.device).sms)} * static_cast<u32>(per_sm);
  const unsigned grid = static_cast<unsigned>(std::min<u64>(items, resident));
  fn<<<grid, gpu::kThreads, smem, stream>>>(p);
  CSFMOE_CUDA_CHECK_LAUNCH("CSF expand kernel launch");
}

void check_dst(const void* dst, const char* who) {
  if (dst == nullptr) throw InvalidArgument(msg("{}: destination is null", who));
}

}  // namespace

// ---------------------------------------------------------------------------
// DeviceCsfTensor
// ---------------------------------------------------------------------------

DeviceCsfTensor DeviceCsfTensor::upload(const CsfTensor& host, int device) {
  validate(host);
  check_device(device, "CSF upload");
  DeviceGuard guard(device);
  const CsfGeometry& g = host.geometry;
  auto st = std::make_shared<Storage>(device);
  st->fixed = Storage::alloc<u8>(host.fixed.size(), "the fixed part");
  st->exceptions = Storage::alloc<u32>(host.exceptions.size(), "the exception records");
  st->row_prefix = Storage::alloc<u32>(host.row_prefix.size(), "row_prefix");
  st->partition_index = Storage::alloc<u32>(host.partition_index.size(), "partition_index");
  CSFMOE_CUDA_CHECK(cudaMemcpy(st->fixed, host.fixed.data(), host.fixed.size(), cudaMemcpyHostToDevice));
  if (!host.exceptions.empty())
    CSFMOE_CUDA_CHECK(cudaMemcpy(st->exceptions, host.exceptions.data(), host.exceptions.size() * 4,
                                 cudaMemcpyHostToDevice));
  CSFMOE_CUDA_CHECK(
      cudaMemcpy(st->row_prefix, host.row_prefix.data(), host.row_prefix.size() * 4, cudaMemcpyHostToDevice));
  CSFMOE_CUDA_CHECK(cudaMemcpy(st->partition_index, host.partition_index.data(),
                               host.partition_index.size() * 4, cudaMemcpyHostToDevice));
  return adopt(std::move(st), g, host.exceptions.size());
}

CsfTensor DeviceCsfTensor::download() const {
  if (empty()) throw InvalidArgument("CSF download: the device tensor is empty");
  DeviceGuard guard(view_.device);
  if (storage_ && storage_->ready) CSFMOE_CUDA_CHECK(cudaEventSynchronize(storage_->ready));
  const CsfGeometry& g = view_.geometry;
  CsfTensor t;
  t.geometry = g;
  t.fixed.resize(g.fixed_bytes());
  t.exceptions.resize(view_.num_exceptions);
  t.row_prefix.resize(g.total_rows() + 1);
  t.partition_index.resize(u64{g.partitions_per_expert} * g.shape.experts + 1);
  CSFMOE_CUDA_CHECK(cudaMemcpy(t.fixed.data(), view_.fixed, t.fixed.size(), cudaMemcpyDeviceToHost));
  if (!t.exceptions.empty())
    CSFMOE_CUDA_CHECK(
        cudaMemcpy(t.exceptions.data(), view_.exceptions, t.exceptions.size() * 4, cudaMemcpyDeviceToHost));
  CSFMOE_CUDA_CHECK(
      cudaMemcpy(t.row_prefix.data(), view_.row_prefix, t.row_prefix.size() * 4, cudaMemcpyDeviceToHost));
  CSFMOE_CUDA_CHECK(cudaMemcpy(t.partition_index.data(), view_.partition_index, t.partition_index.size() * 4,
                               cudaMemcpyDeviceToHost));
  return t;
}

std::uint64_t DeviceCsfTensor::resident_bytes() const {
  if (empty()) return 0;
  const CsfGeometry& g = view_.geometry;
  return g.fixed_bytes() +
         4 * (view_.num_exceptions + g.total_rows() + 1 + u64{g.partitions_per_expert} * g.shape.experts + 1);
}

// ---------------------------------------------------------------------------
// Encode
// ---------------------------------------------------------------------------
namespace {

using EncodeFn = void (*)(gpu::EncodeParams);

template <ScaleFormat F>
void pick_encode(ScaleLayout l, EncodeFn& rows, EncodeFn& records) {
  if (l == ScaleLayout::row_major) {
    rows = gpu::encode_rows_kernel<F, ScaleLayout::row_major>;
    records = gpu::encode_records_kernel<F, ScaleLayout::row_major>;
  } else {
    rows = gpu::encode_rows_kernel<F, ScaleLayout::swizzled_128x4>;
    records = gpu::encode_records_kernel<F, ScaleLayout::swizzled_128x4>;
  }
}

// Stream-ordered temporaries (freed on the stream, so no extra sync).
template <class T>
T* alloc_async(std::uint64_t count, cudaStream_t stream) {
  void* p = nullptr;
  CSFMOE_CUDA_CHECK(cudaMallocAsync(&p, std::max<std::uint64_t>(count * sizeof(T), 16), stream));
  return static_cast<T*>(p);
}

}  // namespace

DeviceCsfTensor encode_on_device(const GridShape& shape, const std::uint8_t* d_src, int device,
                                 cudaStream_t stream) {
  const CsfGeometry g = CsfGeometry::of(shape);
  check_device(device, "CSF encode_on_device");
  DeviceGuard guard(device);
  check_device_pointer(d_src, device, "CSF encode_on_device", "the source grid");
  const bool nv = shape.format == ScaleFormat::nvfp4;
  const u64 n = g.total_rows() + 1;
  if (n >= (u64{1} << 31))
    throw Unsupported(msg("CSF encode_on_device: grid {} has {} rows in all, more than the scan supports",
                          to_string(shape), n - 1));

  auto st = std::make_shared<DeviceCsfTensor::Storage>(device);
  st->fixed = DeviceCsfTensor::Storage::alloc<u8>(g.fixed_bytes(), "the fixed part");
  st->row_prefix = DeviceCsfTensor::Storage::alloc<u32>(n, "row_prefix");
  const u64 parts = u64{g.partitions_per_expert} * shape.experts + 1;
  st->partition_index = DeviceCsfTensor::Storage::alloc<u32>(parts, "partition_index");

  gpu::EncodeParams p;
  p.src = d_src;
  p.fixed = st->fixed;
  p.src_per_expert = g.native_bytes(shape.layout) / shape.experts;
  p.layout = g.layout();
  p.mask_bytes = nv ? 0 : p.layout.mask_bytes();
  p.experts = shape.experts;
  p.rows = shape.rows;
  p.cols = shape.cols;
  p.unit_rows = nv ? 128 : 64;
  p.units = g.padded_rows / p.unit_rows;
  // Lanes per row: enough 16-byte chunks to cover the row, at least 8.
  u32 lanes = 8;
  while (lanes < 32 && u64{lanes} * 16 < shape.cols) lanes *= 2;
  p.lanes = lanes;
  const std::size_t hist_bytes = std::size_t{gpu::kWarps} * (32 / lanes) * 256 * 4;
  const std::size_t slab_stage = nv ? round_up(128 + u64{g.padded_cols / 4} * gpu::kGroupStride, 16) : 0;
  p.staged = nv && hist_bytes + slab_stage <= 48 * 1024;
  const std::size_t smem = hist_bytes + (p.staged ? slab_stage : 0);

  EncodeFn rows_fn = nullptr, records_fn = nullptr;
  if (nv)
    pick_encode<ScaleFormat::nvfp4>(shape.layout, rows_fn, records_fn);
  else
    pick_encode<ScaleFormat::mxfp4>(shape.layout, rows_fn, records_fn);

  u32* counts = alloc_async<u32>(n, stream);
  auto* total = alloc_async<unsigned long long>(1, stream);
  std::size_t scan_bytes = 0;
  CSFMOE_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, counts, st->row_prefix,
                                                  static_cast<int>(n), stream));
  void* scan_tmp = alloc_async<u8>(scan_bytes, stream);
  p.counts = counts;
  p.total = total;

  if (!p.staged) CSFMOE_CUDA_CHECK(cudaMemsetAsync(st->fixed, 0, g.fixed_bytes(), stream));
  CSFMOE_CUDA_CHECK(cudaMemsetAsync(counts, 0, n * 4, stream));
  CSFMOE_CUDA_CHECK(cudaMemsetAsync(total, 0, sizeof(unsigned long long), stream));
  const u64 blocks = u64{p.units} * shape.experts;
  rows_fn<<<static_cast<unsigned>(blocks), gpu::kThreads, smem, stream>>>(p);
  CSFMOE_CUDA_CHECK_LAUNCH("CSF encode_rows kernel launch");
  CSFMOE_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(scan_tmp, scan_bytes, counts, st->row_prefix,
                                                  static_cast<int>(n), stream));
  {
    const unsigned grid = static_cast<unsigned>(std::min<u64>((parts + 255) / 256, 4096));
    gpu::partition_index_kernel<<<grid, 256, 0, stream>>>(st->row_prefix, st->partition_index, parts,
                                                          g.partition_rows);
    CSFMOE_CUDA_CHECK_LAUNCH("CSF partition_index kernel launch");
  }
  unsigned long long total_host = 0;
  CSFMOE_CUDA_CHECK(cudaMemcpyAsync(&total_host, total, sizeof total_host, cudaMemcpyDeviceToHost, stream));
  CSFMOE_CUDA_CHECK(cudaFreeAsync(scan_tmp, stream));
  CSFMOE_CUDA_CHECK(cudaFreeAsync(total, stream));
  CSFMOE_CUDA_CHECK(cudaFreeAsync(counts, stream));
  CSFMOE_CUDA_CHECK(cudaStreamSynchronize(stream));  // the one sync: size the exception stream
  if (total_host > std::numeric_limits<u32>::max())
    throw Unsupported(
        msg("CSF encode_on_device: grid {} has {} exceptions, more than the 32-bit record index allows "
            "(4294967295)",
            to_string(shape), total_host));

  st->exceptions = DeviceCsfTensor::Storage::alloc<u32>(total_host, "the exception records");
  if (total_host > 0) {
    p.row_prefix = st->row_prefix;
    p.exceptions = st->exceptions;
    records_fn<<<static_cast<unsigned>(blocks), gpu::kThreads, 0, stream>>>(p);
    CSFMOE_CUDA_CHECK_LAUNCH("CSF encode_records kernel launch");
  }
  st->mark_ready(stream);
  return DeviceCsfTensor::adopt(std::move(st), g, total_host);
}

// ---------------------------------------------------------------------------
// Expand
// ---------------------------------------------------------------------------
void expand_all(const CsfDeviceView& tensor, ScaleLayout layout, std::uint8_t* d_dst, cudaStream_t stream) {
  check_view(tensor, "CSF expand_all");
  check_layout(layout, "CSF expand_all");
  check_dst(d_dst, "CSF expand_all");
  const CsfDeviceView* views[1] = {&tensor};
  u8* dsts[1] = {d_dst};
  launch_expand(views, dsts, 1, layout, nullptr, stream);
}

void expand_routed(const CsfDeviceView& tensor, ScaleLayout layout, const void* ids, IndexType id_type,
                   std::uint64_t count, std::uint8_t* d_dst, cudaStream_t stream) {
  check_view(tensor, "CSF expand_routed");
  check_layout(layout, "CSF expand_routed");
  check_dst(d_dst, "CSF expand_routed");
  const RoutedIds r{ids, id_type, count};
  check_ids(r, tensor.geometry.shape.experts, "CSF expand_routed");
  const CsfDeviceView* views[1] = {&tensor};
  u8* dsts[1] = {d_dst};
  launch_expand(views, dsts, 1, layout, &r, stream);
}

// ---------------------------------------------------------------------------
// Layer level
// ---------------------------------------------------------------------------
namespace {

u64 ref_native_bytes(const ScaleTensorRef& t, ScaleLayout layout) {
  if (t.is_csf()) return t.csf->view().geometry.native_bytes(layout);
  return CsfGeometry::of(t.shape).native_bytes(layout);
}

void check_ref(const ScaleTensorRef& t, const char* name, u8* scratch, u64 scratch_bytes, ScaleLayout layout,
               const char* who) {
  if (t.csf != nullptr && t.native != nullptr)
    throw InvalidArgument(msg("{}: {} names both a native pointer and a CSF tensor", who, name));
  if (t.is_csf()) {
    check_view(t.csf->view(), who);
    const u64 need = t.csf->view().geometry.native_bytes(layout);
    if (scratch == nullptr) throw InvalidArgument(msg("{}: the scratch for {} is null", who, name));
    if (scratch_bytes < need)
      throw InvalidArgument(msg("{}: the scratch for {} holds {} bytes, the {} grid {} needs {}", who, name,
                                scratch_bytes, to_string(layout), to_string(t.csf->view().geometry.shape),
                                need));
    return;
  }
  if (t.native == nullptr)
    throw InvalidArgument(msg("{}: {} is neither native (null pointer) nor CSF", who, name));
  if (t.shape.layout != layout)
    throw InvalidArgument(msg("{}: {} is kept native in {} but the call asks for {}", who, name,
                              to_string(t.shape.layout), to_string(layout)));
}

bool expand_layer(const LayerScales& layer, const ScaleScratch& scratch, ScaleLayout layout,
                  const RoutedIds* routed, cudaStream_t stream, const char* who,
                  const ExpandLaunch& launch = {}) {
  if (!layer.any_csf()) return false;
  check_layout(layout, who);
  check_ref(layer.w13, "w13", scratch.w13, scratch.w13_bytes, layout, who);
  check_ref(layer.w2, "w2", scratch.w2, scratch.w2_bytes, layout, who);
  const CsfDeviceView* views[2];
  u8* dsts[2];
  u32 n = 0;
  if (layer.w13.is_csf()) views[n] = &layer.w13.csf->view(), dsts[n++] = scratch.w13;
  if (layer.w2.is_csf()) views[n] = &layer.w2.csf->view(), dsts[n++] = scratch.w2;
  for (u32 j = 0; j < n; ++j)
    if (routed) check_ids(*routed, views[j]->geometry.shape.experts, who);
  const bool fuse = n == 2 && views[0]->device == views[1]->device &&
                    views[0]->geometry.shape.format == views[1]->geometry.shape.format &&
                    views[0]->geometry.shape.experts == views[1]->geometry.shape.experts;
  if (fuse) {
    launch_expand(views, dsts, 2, layout, routed, stream, launch);
  } else {
    for (u32 j = 0; j < n; ++j) launch_expand(&views[j], &dsts[j], 1, layout, routed, stream, launch);
  }
  return true;
}

}  // namespace

ScratchSizes scratch_sizes(const LayerScales& layer, ScaleLayout layout) {
  check_layout(layout, "CSF scratch_sizes");
  return {ref_native_bytes(layer.w13, layout), ref_native_bytes(layer.w2, layout)};
}

bool expand_scales(const LayerScales& layer, const ScaleScratch& scratch, ScaleLayout layout,
                   cudaStream_t stream, const ExpandLaunch& launch) {
  return expand_layer(layer, scratch, layout, nullptr, stream, "CSF expand_scales", launch);
}

bool expand_scales_routed(const LayerScales& layer, const ScaleScratch& scratch, ScaleLayout layout,
                          const void* ids, IndexType id_type, std::uint64_t count, cudaStream_t stream) {
  const RoutedIds r{ids, id_type, count};
  return expand_layer(layer, scratch, layout, &r, stream, "CSF expand_scales_routed");
}

ScalePointers scale_pointers(const LayerScales& layer, const ScaleScratch& scratch) {
  return {layer.w13.is_csf() ? scratch.w13 : layer.w13.native,
          layer.w2.is_csf() ? scratch.w2 : layer.w2.native};
}

ResidentBytes layer_resident_bytes(const LayerScales& layer) {
  auto one = [](const ScaleTensorRef& t) -> ResidentBytes {
    if (t.is_csf()) {
      const CsfGeometry& g = t.csf->view().geometry;
      return {g.native_bytes(g.shape.layout), t.csf->resident_bytes()};
    }
    return resident_bytes(t.shape);
  };
  return one(layer.w13) + one(layer.w2);
}

}  // namespace csfmoe
