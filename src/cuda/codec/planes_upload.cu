// Host side of planes_to_device (include/csfmoe/device_codec.hpp): every
// check on the host, the planes' bytes uploaded as they are, the resident
// parts built by planes_kernels.cuh.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "csfmoe/detail/plane_layout.hpp"
#include "csfmoe/device_codec.hpp"
#include "csfmoe/errors.hpp"
#include "cuda/codec/device_tensor.hpp"
#include "cuda/codec/planes_kernels.cuh"
#include "cuda/primitives/cuda_check.hpp"
#include "cuda/primitives/strf.hpp"

namespace csfmoe {

using cuda_detail::DeviceGuard;
using gpu::planes::u32;
using gpu::planes::u64;
using gpu::planes::u8;

namespace {

template <class... A>
std::string msg(std::string_view f, const A&... a) {
  return cuda_detail::strf(f, a...);
}

unsigned grid_for(u64 n) {
  return static_cast<unsigned>(
      std::clamp<u64>((n + gpu::planes::kThreads - 1) / gpu::planes::kThreads, 1, 8192));
}

// A stream-ordered temporary, freed on the stream when it goes out of scope
// (also when a later step throws).
template <class T>
class AsyncBuffer {
 public:
  AsyncBuffer(u64 count, cudaStream_t stream) : stream_(stream) {
    CSFMOE_CUDA_CHECK(cudaMallocAsync(&p_, std::max<u64>(count * sizeof(T), 16), stream));
  }
  AsyncBuffer(const AsyncBuffer&) = delete;
  AsyncBuffer& operator=(const AsyncBuffer&) = delete;
  ~AsyncBuffer() { (void)cudaFreeAsync(p_, stream_); }
  T* get() const { return static_cast<T*>(p_); }

 private:
  void* p_ = nullptr;
  cudaStream_t stream_;
};

}  // namespace

DeviceCsfTensor planes_to_device(std::span<const CsfPlanes> experts, ScaleLayout layout, int device,
                                 cudaStream_t stream, std::string_view name) {
  // ---- host checks, before any device work
  if (experts.empty()) throw InvalidArgument(msg("{}: CSF planes to device: no experts given", name));
  if (experts.size() > std::numeric_limits<u32>::max())
    throw InvalidArgument(msg("{}: CSF planes to device: {} experts, too many", name, experts.size()));
  const PlaneShape s = experts[0].shape;
  check_plane_shape(s, name);
  const u32 E = static_cast<u32>(experts.size());
  for (u32 e = 0; e < E; ++e) {
    if (experts[e].shape != s)
      throw InvalidArgument(msg("{}: CSF planes to device: expert {} has grid {}, expert 0 has {}", name, e,
                                to_string(experts[e].shape), to_string(s)));
  }
  CsfGeometry g;
  try {
    g = CsfGeometry::of(GridShape{s.format, layout, E, s.rows, s.cols});
  } catch (const InvalidArgument& err) {
    throw InvalidArgument(msg("{}: CSF planes to device: {}", name, err.what()));
  }
  // Canonical copies only of the experts whose records win over their slot.
  std::vector<std::optional<CsfPlanes>> canonical(E);
  std::vector<u32> record_start(E + 1, 0);
  u64 total = 0;
  for (u32 e = 0; e < E; ++e) {
    const std::string expert_name = msg("{} expert {}", name, e);
    validate_planes(s, experts[e].fixed, experts[e].exceptions, expert_name);
    if (!in_encoder_form(experts[e])) canonical[e] = canonical_planes(experts[e], expert_name);
    record_start[e] = static_cast<u32>(std::min<u64>(total, std::numeric_limits<u32>::max()));
    total += (canonical[e] ? *canonical[e] : experts[e]).exceptions.size();
  }
  if (total > std::numeric_limits<u32>::max())
    throw Unsupported(
        msg("{}: CSF planes to device: grid {} has {} exceptions, more than the 32-bit record "
            "index allows (4294967295)",
            name, to_string(g.shape), total));
  record_start[E] = static_cast<u32>(total);
  codec_detail::check_device(device, "CSF planes_to_device");
  DeviceGuard guard(device);

  // ---- upload
  const u64 plane_bytes = plane_fixed_bytes(s);
  const u64 row_entries = g.total_rows() + 1;
  const u64 partition_entries = u64{g.partitions_per_expert} * E + 1;
  using Storage = DeviceCsfTensor::Storage;
  auto st = std::make_shared<Storage>(device);
  st->fixed = Storage::alloc<u8>(g.fixed_bytes(), "the fixed part");
  st->exceptions = Storage::alloc<u32>(total, "the exception records");
  st->row_prefix = Storage::alloc<u32>(row_entries, "row_prefix");
  st->partition_index = Storage::alloc<u32>(partition_entries, "partition_index");
  const bool nv = s.format == ScaleFormat::nvfp4;
  // MXFP4 planes are the resident slabs byte for byte (no padded column):
  // they go straight into place. NVFP4 planes are staged for the kernel.
  std::optional<AsyncBuffer<u8>> staging;
  if (nv) staging.emplace(plane_bytes * E, stream);
  u8* staged = staging ? staging->get() : nullptr;
  const AsyncBuffer<u32> start_buffer(E + 1, stream);
  u32* starts = start_buffer.get();
  CSFMOE_CUDA_CHECK(cudaMemsetAsync(st->fixed, 0, g.fixed_bytes(), stream));
  // Copies from pageable memory return once the source is staged, so the
  // host buffers may go when this returns; all work is ordered on `stream`.
  for (u32 e = 0; e < E; ++e) {
    const CsfPlanes& p = canonical[e] ? *canonical[e] : experts[e];
    u8* dst = nv ? staged + u64{e} * plane_bytes : st->fixed + u64{e} * g.fixed_bytes_per_expert;
    CSFMOE_CUDA_CHECK(cudaMemcpyAsync(dst, p.fixed.data(), plane_bytes, cudaMemcpyHostToDevice, stream));
    if (!p.exceptions.empty())
      CSFMOE_CUDA_CHECK(cudaMemcpyAsync(st->exceptions + record_start[e], p.exceptions.data(),
                                        p.exceptions.size() * 4, cudaMemcpyHostToDevice, stream));
  }
  CSFMOE_CUDA_CHECK(
      cudaMemcpyAsync(starts, record_start.data(), (E + 1) * 4, cudaMemcpyHostToDevice, stream));

  // ---- build the resident parts
  gpu::planes::PlanesParams p;
  p.planes = staged;
  p.plane_bytes = plane_bytes;
  p.fixed = st->fixed;
  p.layout = g.layout();
  p.experts = E;
  p.rows = s.rows;
  p.cols = s.cols;
  p.records = st->exceptions;
  p.record_start = starts;
  constexpr int T = gpu::planes::kThreads;
  if (nv) {
    const u64 n = u64{E} * s.rows * (1 + csf::plane_row_bytes(s.format, s.cols));
    gpu::planes::nvfp4_fixed_kernel<<<grid_for(n), T, 0, stream>>>(p);
    CSFMOE_CUDA_CHECK_LAUNCH("CSF planes_to_device: nvfp4_fixed kernel launch");
  }
  if (total > 0) {
    gpu::planes::readdress_records_kernel<<<grid_for(total), T, 0, stream>>>(p);
    CSFMOE_CUDA_CHECK_LAUNCH("CSF planes_to_device: readdress_records kernel launch");
  }
  gpu::planes::row_starts_kernel<<<grid_for(row_entries), T, 0, stream>>>(p, st->row_prefix, row_entries, 1);
  CSFMOE_CUDA_CHECK_LAUNCH("CSF planes_to_device: row_starts kernel launch (row_prefix)");
  gpu::planes::row_starts_kernel<<<grid_for(partition_entries), T, 0, stream>>>(
      p, st->partition_index, partition_entries, g.partition_rows);
  CSFMOE_CUDA_CHECK_LAUNCH("CSF planes_to_device: row_starts kernel launch (partition_index)");
  st->mark_ready(stream);
  return DeviceCsfTensor::adopt(std::move(st), g, total);
}

}  // namespace csfmoe
