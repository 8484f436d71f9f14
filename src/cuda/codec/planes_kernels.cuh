// Device code of planes_to_device (src/cuda/codec/planes_upload.cu): the
// resident CSF form built on the GPU from b12x / vLLM's canonical planes
// uploaded as they are. Nothing is decoded: bases and codes move byte for
// byte into the resident slabs, records are re-addressed to the padded
// columns in place, and row_prefix / partition_index are found by binary
// search in each expert's sorted records (no atomics, no scan). The layouts
// are csf_layout.hpp's (resident) and plane_layout.hpp's (planes).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "csfmoe/detail/csf_layout.hpp"
#include "csfmoe/detail/plane_layout.hpp"
#include "cuda/primitives/search.cuh"

namespace csfmoe::gpu::planes {

using u8 = std::uint8_t;
using u32 = std::uint32_t;
using u64 = std::uint64_t;

constexpr int kThreads = 256;

struct PlanesParams {
  const u8* planes = nullptr;  // E fixed planes, plane_bytes apart
  u64 plane_bytes = 0;
  u8* fixed = nullptr;  // the resident fixed part, zeroed before (padding rows and columns stay 0)
  csf::LayoutView layout;
  u32 experts = 0, rows = 0, cols = 0;
  u32* records = nullptr;             // all experts' records: plane positions in, resident out
  const u32* record_start = nullptr;  // E + 1 entries: each expert's first record, then the total
};

template <class F>
__device__ __forceinline__ void grid_stride(u64 n, F&& f) {
  for (u64 i = blockIdx.x * u64{blockDim.x} + threadIdx.x; i < n; i += u64{gridDim.x} * blockDim.x) f(i);
}

// NVFP4: one thread per (expert, row, byte of the row's plane entry): byte 0
// is the base, byte 1 + j the code pair j (columns 2j, 2j + 1), which is
// one byte of the resident slab too.
__global__ void nvfp4_fixed_kernel(PlanesParams p) {
  const csf::PlaneLayout L(ScaleFormat::nvfp4, p.rows, p.cols);
  const u32 per_row = 1 + L.row_bytes;
  grid_stride(u64{p.experts} * p.rows * per_row, [&](u64 i) {
    const u32 k = static_cast<u32>(i % per_row);
    const u64 er = i / per_row;
    const u32 r = static_cast<u32>(er % p.rows);
    const u64 e = er / p.rows;
    const u8* plane = p.planes + e * p.plane_bytes;
    u8* slab = p.fixed + p.layout.slab_offset<ScaleFormat::nvfp4>(e, r);
    if (k == 0)
      slab[csf::base_index(ScaleFormat::nvfp4, r)] = plane[L.base_at(r)];
    else
      slab[csf::nvfp4_code_pair_byte(r, k - 1)] = plane[L.codes_at(r) + (k - 1)];
  });
}

// The expert of record i: the last e with record_start[e] <= i.
__device__ __forceinline__ u32 expert_of_record(const u32* start, u32 experts, u64 i) {
  return ptx::last_at_most(start, experts, i);
}

// Plane positions (row * cols + col) to resident ones (row * padded_cols + col).
__global__ void readdress_records_kernel(PlanesParams p) {
  const u64 total = p.record_start[p.experts];
  grid_stride(total, [&](u64 i) {
    const u32 rec = p.records[i];
    const u32 pos = csf::record_position(rec);
    p.records[i] = csf::make_record(p.layout.position(pos / p.cols, pos % p.cols), csf::record_value(rec));
  });
}

// out[i] = index of the first record of padded row i * step (over all
// experts' padded rows; the entry past the last row is the total): the
// first of the expert's re-addressed records at or past the row's start.
// step 1 gives row_prefix, step = partition rows partition_index.
__global__ void row_starts_kernel(PlanesParams p, u32* out, u64 entries, u32 step) {
  const u64 rows_total = u64{p.experts} * p.layout.padded_rows;
  grid_stride(entries, [&](u64 i) {
    const u64 row = i * step;
    if (row >= rows_total) {
      out[i] = p.record_start[p.experts];
      return;
    }
    const u64 e = row / p.layout.padded_rows;
    const u64 first_pos = (row % p.layout.padded_rows) * p.layout.padded_cols;
    u32 lo = p.record_start[e], hi = p.record_start[e + 1];
    while (lo < hi) {
      const u32 mid = lo + (hi - lo) / 2;
      if (csf::record_position(p.records[mid]) < first_pos)
        lo = mid + 1;
      else
        hi = mid;
    }
    out[i] = lo;
  });
}

}  // namespace csfmoe::gpu::planes
