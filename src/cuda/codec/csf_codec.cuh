// Device code of the GPU CSF codec (included by csf_codec.cu only).
//
// Encode: kernel encode_rows (one block per 128-row NVFP4 slab or 64-row MXFP4
// partition; a group of lanes per row, several short rows per warp) builds
// bases, offsets and per-row exception counts; cub::DeviceScan turns counts
// into row_prefix; encode_records writes the records once their total is
// known. Expand: one persistent kernel per (format, layout, routed) walks
// work items (expert, unit) of up to two tensors; a unit owns whole
// partitions, so its block patches its own exception records after its dense
// write (no inter-block race). The layouts are documented in
// docs/csf-format.md (format) and docs/gpu-codec.md (kernels).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "codec/expand_plan.hpp"
#include "csfmoe/detail/csf_layout.hpp"
#include "csfmoe/formats.hpp"
#include "cuda/primitives/ptx.cuh"
#include "cuda/primitives/search.cuh"

namespace csfmoe::gpu {

using u8 = std::uint8_t;
using u16 = std::uint16_t;
using u32 = std::uint32_t;
using u64 = std::uint64_t;

constexpr int kThreads = 256;  // every codec kernel
constexpr int kWarps = kThreads / 32;
// Shared-memory stride of one NVFP4 nibble group (codec/expand_plan.hpp).
using codec_detail::kGroupStride;
// Expansion blocks resident per SM the register budget is sized for (6 x 256
// threads: enough bytes in flight to saturate HBM with 30 KB staging each).
constexpr int kExpandBlocksPerSm = 6;

// ---------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------
using ptx::cp_async16;
using ptx::cp_async_commit;
using ptx::cp_async_wait_all;

// 4 nibbles (bits 4i..4i+3 of x) -> 4 bytes.
__device__ __forceinline__ u32 spread_nibbles(u32 x) {
  return (x & 0xFu) | ((x & 0xF0u) << 4) | ((x & 0xF00u) << 8) | ((x & 0xF000u) << 12);
}
// 4 bits -> 4 bytes of 0/1.
__device__ __forceinline__ u32 spread_bits4(u32 x) {
  return (x & 1u) | ((x & 2u) << 7) | ((x & 4u) << 14) | ((x & 8u) << 21);
}
// 8 bits -> 8 bytes of 0/1.
__device__ __forceinline__ u64 spread_bits8(u32 m) {
  const u64 x = (u64{m & 0xFFu} * 0x0101010101010101ull) & 0x8040201008040201ull;
  return ((x + 0x7F7F7F7F7F7F7F7Full) >> 7) & 0x0101010101010101ull;
}

// A slab holds fewer than 2^24 positions, so its byte count fits 32 bits and
// slab offsets multiply it 32 x 32 -> 64 bits. The cvt is explicit because a
// cast folds back into a 64-bit mask of the parameter, which costs registers.
__device__ __forceinline__ u32 slab_bytes_u32(const csf::LayoutView& v) {
  u32 r;
  asm("cvt.u32.u64 %0, %1;" : "=r"(r) : "l"(v.slab_bytes));
  return r;
}

// Stores the first n (<= 16) bytes of v at p: one 16-byte store when possible.
__device__ __forceinline__ void store_bytes(u8* p, const uint4& v, u32 n) {
  if (n == 16 && (reinterpret_cast<uintptr_t>(p) & 15u) == 0) {
    *reinterpret_cast<uint4*>(p) = v;
    return;
  }
  const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (u32 i = 0; i < 16; ++i)
    if (i < n) p[i] = static_cast<u8>(w[i / 4] >> (8 * (i % 4)));
}

// ---------------------------------------------------------------------------
// Expansion
// ---------------------------------------------------------------------------
// One tensor to expand and its units (codec/expand_plan.hpp).
using codec_detail::ExpandJob;

struct ExpandParams {
  ExpandJob job[2];
  u32 njobs = 1;
  u32 experts = 0;
  // Routed only.
  const void* ids = nullptr;
  u64 count = 0;
  u32 ids64 = 0;
  u32 stage_bytes = 0;  // dynamic shared memory used for staging (16-byte multiple)
};

struct Item {
  u32 job, expert, unit;
};

// Exception records of [row_begin, row_end) are located through
// partition_index. The block owns them: it loads the first kThreads of them
// before its dense phase (so their latency hides under it) and stores them
// after the dense write, behind a barrier, so the record wins.
struct Patch {
  u32 lo = 0, hi = 0, rec = 0;
};

__device__ __forceinline__ Patch patch_prefetch(const ExpandJob& J, u32 e, u32 row_begin, u32 row_end) {
  const u32 p0 = e * J.partitions + row_begin / J.partition_rows;
  const u32 p1 = e * J.partitions + (row_end + J.partition_rows - 1) / J.partition_rows;
  Patch pt;
  pt.lo = __ldg(J.partition_index + p0);
  pt.hi = __ldg(J.partition_index + p1);
  if (pt.lo + threadIdx.x < pt.hi) pt.rec = __ldg(J.exceptions + pt.lo + threadIdx.x);
  return pt;
}

template <ScaleLayout L>
__device__ __forceinline__ void patch_one(const ExpandJob& J, u8* out, u32 rec, u32 col_begin, u32 col_end) {
  const u32 pos = csf::record_position(rec);
  const u32 r = J.layout.position_row(pos);
  const u32 c = J.layout.position_col(pos);
  if (c < col_begin || c >= col_end) return;  // another column split owns it
  if constexpr (L == ScaleLayout::row_major)
    out[u64{r} * J.cols + c] = csf::record_value(rec);
  else
    out[swizzled_index(r, c, J.out_cols)] = csf::record_value(rec);
}

template <ScaleLayout L>
__device__ __forceinline__ void patch_apply(const ExpandJob& J, u32 e, const Patch& pt, u32 col_begin,
                                            u32 col_end) {
  u8* out = J.dst + e * J.out_per_expert;
  if (pt.lo + threadIdx.x < pt.hi) patch_one<L>(J, out, pt.rec, col_begin, col_end);
  for (u32 i = pt.lo + kThreads + threadIdx.x; i < pt.hi; i += kThreads)
    patch_one<L>(J, out, __ldg(J.exceptions + i), col_begin, col_end);
}

// NVFP4, row-major output: the slab's nibble groups are staged in shared
// memory (padded stride), then lanes write 16 consecutive bytes of one row
// each; 4 lanes per row, 8 rows per warp instruction.
struct NvRowUnit {
  u32 slab, g0, ng;  // column groups [g0, g0 + ng)
};

__device__ __forceinline__ NvRowUnit nv_row_unit(const ExpandJob& J, u32 unit) {
  const u32 groups = J.layout.padded_cols / 4;
  NvRowUnit u;
  u.slab = unit / J.col_units;
  u.g0 = (unit % J.col_units) * J.unit_groups;
  u.ng = min(J.unit_groups, groups - u.g0);
  return u;
}

__device__ __forceinline__ void nv_row_fill(const ExpandJob& J, u32 e, u32 unit, u8* smem) {
  const NvRowUnit u = nv_row_unit(J, unit);
  const u8* slab = J.fixed + e * J.layout.fixed_bytes_per_expert + u64{u.slab} * slab_bytes_u32(J.layout);
  const u32 chunks = 8 + u.ng * 16;
  for (u32 t = threadIdx.x; t < chunks; t += kThreads) {
    if (t < 8) {
      cp_async16(smem + t * 16, slab + t * 16);
    } else {
      const u32 v = t - 8;
      cp_async16(smem + 128 + (v >> 4) * kGroupStride + (v & 15) * 16,
                 slab + 128 + u64{u.g0 + (v >> 4)} * 256 + (v & 15) * 16);
    }
  }
  cp_async_commit();
}

__device__ __forceinline__ void nv_row_dense(const ExpandJob& J, u32 e, u32 unit, const u8* smem) {
  const NvRowUnit u = nv_row_unit(J, unit);
  const u32 r0 = u.slab * 128;
  const u32 rows_valid = min(128u, J.rows - r0);
  const u32 c_begin = u.g0 * 4;
  const u32 c_end = min(c_begin + u.ng * 4, J.cols);
  const u32 words = (c_end - c_begin + 15) / 16;  // 16-byte pieces per row
  const u32 wq_count = (words + 3) / 4;
  const u32 warp_items = wq_count * 16;
  const u32 lane = threadIdx.x & 31;
  const u8* nib = smem + 128;
  u8* out = J.dst + e * J.out_per_expert + u64{r0} * J.cols;
  for (u32 wi = threadIdx.x >> 5; wi < warp_items; wi += kWarps) {
    const u32 kb = wi & 3, q = (wi >> 2) & 3, wq = wi >> 4;
    const u32 k = kb * 8 + (lane >> 2);
    const u32 w = wq * 4 + (lane & 3);
    const u32 rr = q * 32 + k;
    if (rr >= rows_valid || w >= words) continue;
    const u32 base4 = u32{smem[k * 4 + q]} * 0x01010101u;
    u32 v[4];
#pragma unroll
    for (u32 j = 0; j < 4; ++j) {
      const u32 gl = 4 * w + j;
      const u32 x = gl < u.ng ? *reinterpret_cast<const u16*>(nib + gl * kGroupStride + k * 8 + q * 2) : 0u;
      v[j] = spread_nibbles(x) + base4;
    }
    const u32 c0 = c_begin + 16 * w;
    store_bytes(out + u64{rr} * J.cols + c0, make_uint4(v[0], v[1], v[2], v[3]), min(16u, c_end - c0));
  }
}

// NVFP4, swizzled output: a 128x4 tile is one nibble group expanded. Lane t
// turns 8 nibble bytes (chunk k of group gi) and the 4 bases of rows
// k + 32q into output bytes [16t, 16t + 16): loads and stores both coalesced.
__device__ __forceinline__ void nv_swz_dense(const ExpandJob& J, u32 e, u32 unit) {
  const u32 groups = J.layout.padded_cols / 4;
  const u8* slab = J.fixed + e * J.layout.fixed_bytes_per_expert + u64{unit} * slab_bytes_u32(J.layout);
  u8* out = J.dst + e * J.out_per_expert + u64{unit} * groups * 512;
  const u32 chunks = groups * 32;
  const u32 bases = __ldg(reinterpret_cast<const u32*>(slab) + (threadIdx.x & 31));  // k = t & 31 for every t
  u32 b4[4];
#pragma unroll
  for (u32 q = 0; q < 4; ++q) b4[q] = ((bases >> (8 * q)) & 0xFFu) * 0x01010101u;
#pragma unroll 8
  for (u32 t = threadIdx.x; t < chunks; t += kThreads) {
    const uint2 n = __ldg(reinterpret_cast<const uint2*>(slab + 128) + t);
    const uint4 v = make_uint4(spread_nibbles(n.x & 0xFFFFu) + b4[0], spread_nibbles(n.x >> 16) + b4[1],
                               spread_nibbles(n.y & 0xFFFFu) + b4[2], spread_nibbles(n.y >> 16) + b4[3]);
    store_bytes(out + u64{t} * 16, v, 16);
  }
}

// MXFP4 units stage their slabs (contiguous fixed bytes) in shared memory
// when they fit; `fx` then points at the first staged slab `slab0`.
__device__ __forceinline__ void mx_fill(const ExpandJob& J, u32 e, u32 row_begin, u32 row_end, u8* smem) {
  const u32 s0 = row_begin / 16, s1 = (row_end + 15) / 16;
  const u32 slab_bytes = slab_bytes_u32(J.layout);
  const u8* src = J.fixed + e * J.layout.fixed_bytes_per_expert + u64{s0} * slab_bytes;
  const u32 chunks = (s1 - s0) * slab_bytes / 16;
  for (u32 t = threadIdx.x; t < chunks; t += kThreads) cp_async16(smem + t * 16, src + u64{t} * 16);
  cp_async_commit();
}

// MXFP4, row-major output: each lane turns 2 mask bytes of a row into 16
// output bytes; consecutive lanes walk the flattened rows of the unit.
__device__ __forceinline__ void mx_row_dense(const ExpandJob& J, u32 e, u32 unit, const u8* fx, u32 slab0) {
  const u32 r0 = unit * J.unit_rows;
  const u32 r1 = min(r0 + J.unit_rows, J.rows);
  const u32 words = (J.cols + 15) / 16;
  const u32 items = (r1 - r0) * words;
  const u32 slab_bytes = slab_bytes_u32(J.layout), mask_bytes = J.mask_bytes;
  u8* out = J.dst + e * J.out_per_expert;
  for (u32 i = threadIdx.x; i < items; i += kThreads) {
    const u32 rr = i / words, w = i - rr * words;
    const u32 r = r0 + rr;
    const u8* slab = fx + u64{csf::slab_index(ScaleFormat::mxfp4, r) - slab0} * slab_bytes;
    const u64 base8 = u64{slab[csf::base_index(ScaleFormat::mxfp4, r)]} * 0x0101010101010101ull;
    const u8* mask = slab + 16 + (r % 16) * mask_bytes;  // csf::mxfp4_row_mask, added in 64 bits
    const u32 m0 = mask[2 * w];
    const u32 m1 = 2 * w + 1 < mask_bytes ? mask[2 * w + 1] : 0u;
    const u64 lo = spread_bits8(m0) + base8, hi = spread_bits8(m1) + base8;
    const uint4 v = make_uint4(static_cast<u32>(lo), static_cast<u32>(lo >> 32), static_cast<u32>(hi),
                               static_cast<u32>(hi >> 32));
    store_bytes(out + u64{r} * J.cols + 16 * w, v, min(16u, J.cols - 16 * w));
  }
}

// MXFP4, swizzled output: each lane builds one 16-byte tile chunk (rows
// k, k+32, k+64, k+96 of a 128-row tile, 4 columns); rows past the CSF grid
// (the tile rounds rows up to 128) are 0x00.
__device__ __forceinline__ void mx_swz_dense(const ExpandJob& J, u32 e, u32 unit, const u8* fx, u32 slab0) {
  const u32 groups = J.out_cols / 4;
  const u32 tiles_per_unit = J.unit_rows / 128;
  const u32 t0 = unit * tiles_per_unit;
  const u32 t1 = min(t0 + tiles_per_unit, J.out_rows / 128);
  const u32 items = (t1 - t0) * groups * 32;
  const u32 slab_bytes = slab_bytes_u32(J.layout), mask_bytes = J.mask_bytes;
  u8* out = J.dst + e * J.out_per_expert + u64{t0} * groups * 512;
  for (u32 t = threadIdx.x; t < items; t += kThreads) {
    const u32 k = t & 31, tg = t >> 5;
    const u32 tt = tg / groups, gi = tg - tt * groups;
    u32 v[4];
#pragma unroll
    for (u32 q = 0; q < 4; ++q) {
      const u32 r = (t0 + tt) * 128 + q * 32 + k;
      v[q] = 0;
      if (r < J.layout.padded_rows) {
        const u8* slab = fx + u64{csf::slab_index(ScaleFormat::mxfp4, r) - slab0} * slab_bytes;
        const u32 m = slab[16 + (r % 16) * mask_bytes + gi / 2];  // csf::mxfp4_row_mask
        v[q] = spread_bits4(m >> (4 * (gi & 1))) +
               u32{slab[csf::base_index(ScaleFormat::mxfp4, r)]} * 0x01010101u;
      }
    }
    store_bytes(out + u64{t} * 16, make_uint4(v[0], v[1], v[2], v[3]), 16);
  }
}

template <ScaleFormat F, ScaleLayout L>
struct Expander {
  static constexpr bool kNvRow = F == ScaleFormat::nvfp4 && L == ScaleLayout::row_major;
  static constexpr bool kMx = F == ScaleFormat::mxfp4;

  // CSF rows [begin, end) of a unit.
  __device__ static u32 row_begin(const ExpandJob& J, u32 unit) {
    if constexpr (kNvRow) return nv_row_unit(J, unit).slab * 128;
    return unit * J.unit_rows;
  }
  __device__ static u32 row_end(const ExpandJob& J, u32 unit) {
    if constexpr (kNvRow) return row_begin(J, unit) + 128;
    return min(unit * J.unit_rows + J.unit_rows, J.layout.padded_rows);
  }
  // Asynchronous staging of the unit's fixed bytes (if any).
  __device__ static void fill(const ExpandJob& J, u32 e, u32 unit, u8* smem) {
    if constexpr (kNvRow) {
      nv_row_fill(J, e, unit, smem);
    } else if constexpr (kMx) {
      if (J.staged) mx_fill(J, e, row_begin(J, unit), row_end(J, unit), smem);
    }
  }
  __device__ static void dense(const ExpandJob& J, u32 e, u32 unit, const u8* smem) {
    if constexpr (kNvRow) {
      nv_row_dense(J, e, unit, smem);
    } else if constexpr (F == ScaleFormat::nvfp4) {
      nv_swz_dense(J, e, unit);
    } else {
      const u8* fx = J.staged ? smem : J.fixed + e * J.layout.fixed_bytes_per_expert;
      const u32 slab0 = J.staged ? row_begin(J, unit) / 16 : 0u;
      if constexpr (L == ScaleLayout::row_major)
        mx_row_dense(J, e, unit, fx, slab0);
      else
        mx_swz_dense(J, e, unit, fx, slab0);
    }
  }
  __device__ static Patch prefetch(const ExpandJob& J, u32 e, u32 unit) {
    return patch_prefetch(J, e, row_begin(J, unit), row_end(J, unit));
  }
  __device__ static void patch(const ExpandJob& J, u32 e, u32 unit, const Patch& pt) {
    if constexpr (kNvRow) {
      const NvRowUnit u = nv_row_unit(J, unit);
      patch_apply<L>(J, e, pt, u.g0 * 4, u.g0 * 4 + u.ng * 4);
    } else {
      patch_apply<L>(J, e, pt, 0, J.layout.padded_cols);
    }
  }
};

// Used-expert set of a routed call, built redundantly by every block in
// shared memory (ids are few and L2-resident): bitmap + exclusive popcount
// prefix per 32-expert word. Returns the number of distinct used experts.
__device__ __forceinline__ u32 build_used_set(const ExpandParams& p, u32* bitmap, u32* prefix) {
  const u32 words = (p.experts + 31) / 32;
  for (u32 i = threadIdx.x; i < words; i += kThreads) bitmap[i] = 0;
  __syncthreads();
  if (p.ids64) {
    const long long* ids = static_cast<const long long*>(p.ids);
    for (u64 i = threadIdx.x; i < p.count; i += kThreads) {
      const u64 id = static_cast<u64>(__ldg(ids + i));
      if (id < p.experts) atomicOr(&bitmap[id >> 5], 1u << (id & 31));
    }
  } else {
    const int* ids = static_cast<const int*>(p.ids);
    for (u64 i = threadIdx.x; i < p.count; i += kThreads) {
      const u32 id = static_cast<u32>(__ldg(ids + i));
      if (id < p.experts) atomicOr(&bitmap[id >> 5], 1u << (id & 31));
    }
  }
  __syncthreads();
  __shared__ u32 s_used;
  if (threadIdx.x < 32) {
    const u32 lane = threadIdx.x;
    u32 running = 0;
    for (u32 w0 = 0; w0 < words; w0 += 32) {
      const u32 w = w0 + lane;
      const u32 c = w < words ? __popc(bitmap[w]) : 0u;
      u32 incl = c;
#pragma unroll
      for (u32 d = 1; d < 32; d <<= 1) {
        const u32 y = __shfl_up_sync(0xFFFFFFFFu, incl, d);
        if (lane >= d) incl += y;
      }
      if (w < words) prefix[w] = running + incl - c;
      running += __shfl_sync(0xFFFFFFFFu, incl, 31);
    }
    if (lane == 0) s_used = running;
  }
  __syncthreads();
  return s_used;
}

// The slot-th used expert (ascending ids).
__device__ __forceinline__ u32 nth_used(const u32* bitmap, const u32* prefix, u32 words, u32 slot) {
  const u32 lo = ptx::last_at_most(prefix, words, slot);  // the word holding it
  const u32 bit = __fns(bitmap[lo], 0, static_cast<int>(slot - prefix[lo] + 1));
  return lo * 32 + bit;
}

template <ScaleFormat F, ScaleLayout L, bool Routed>
__global__ void __launch_bounds__(kThreads, kExpandBlocksPerSm) expand_kernel(const ExpandParams p) {
  using X = Expander<F, L>;
  extern __shared__ uint4 smem_raw[];
  u8* smem = reinterpret_cast<u8*>(smem_raw);
  u32* bitmap = reinterpret_cast<u32*>(smem + p.stage_bytes);
  const u32 words = (p.experts + 31) / 32;
  u32* prefix = bitmap + words;

  const u32 used = Routed ? build_used_set(p, bitmap, prefix) : p.experts;
  const u64 items0 = u64{used} * p.job[0].units;
  const u64 total = items0 + (p.njobs > 1 ? u64{used} * p.job[1].units : 0);

  auto item_of = [&](u64 item) {
    Item it;
    it.job = item >= items0;
    const u64 local = it.job ? item - items0 : item;
    const u32 units = it.job ? p.job[1].units : p.job[0].units;
    const u32 slot = static_cast<u32>(local / units);
    it.unit = static_cast<u32>(local - u64{slot} * units);
    it.expert = Routed ? nth_used(bitmap, prefix, words, slot) : slot;
    return it;
  };

  u64 item = blockIdx.x;
  if (item >= total) return;
  Item cur = item_of(item);
  X::fill(cur.job ? p.job[1] : p.job[0], cur.expert, cur.unit, smem);
  while (true) {
    const ExpandJob& J = cur.job ? p.job[1] : p.job[0];
    const Patch pt = X::prefetch(J, cur.expert, cur.unit);  // in flight during the fill and the dense write
    cp_async_wait_all();
    __syncthreads();
    X::dense(J, cur.expert, cur.unit, smem);
    __syncthreads();  // dense bytes written (and staging free) before the patch
    const u64 next = item + gridDim.x;
    Item nxt{};
    if (next < total) {
      nxt = item_of(next);
      X::fill(nxt.job ? p.job[1] : p.job[0], nxt.expert, nxt.unit, smem);  // overlaps the patch
    }
    X::patch(J, cur.expert, cur.unit, pt);
    if (next >= total) break;
    item = next;
    cur = nxt;
  }
}

// ---------------------------------------------------------------------------
// Encoding
// ---------------------------------------------------------------------------
struct EncodeParams {
  const u8* src = nullptr;
  u8* fixed = nullptr;
  u32* counts = nullptr;  // E * layout.padded_rows (+1, zeroed)
  unsigned long long* total = nullptr;
  const u32* row_prefix = nullptr;  // records pass
  u32* exceptions = nullptr;        // records pass
  u64 src_per_expert = 0;
  csf::LayoutView layout;  // of the CSF parts being built
  u32 experts = 0, rows = 0, cols = 0;
  u32 unit_rows = 0;  // rows per block
  u32 units = 0;      // per expert
  u32 lanes = 32;     // lanes per row (4..32, power of two)
  u32 staged = 0;     // NVFP4: build the slab in shared memory
  // MXFP4: layout.mask_bytes(), precomputed: deriving it in encode_rows costs
  // registers.
  u32 mask_bytes = 0;
};

// 16 source bytes of (e, r) from column c0 (n valid, the rest 0).
template <ScaleLayout L>
__device__ __forceinline__ void load_row16(const EncodeParams& p, u32 e, u32 r, u32 c0, u32 (&v)[4], u32& n) {
  n = min(16u, p.cols - c0);
  const u8* src = p.src + e * p.src_per_expert;
  if constexpr (L == ScaleLayout::row_major) {
    const u8* s = src + u64{r} * p.cols + c0;
    if (n == 16 && (reinterpret_cast<uintptr_t>(s) & 15u) == 0) {
      const uint4 x = __ldg(reinterpret_cast<const uint4*>(s));
      v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
      return;
    }
#pragma unroll
    for (u32 j = 0; j < 4; ++j) v[j] = 0;
    for (u32 i = 0; i < n; ++i) v[i / 4] |= u32{__ldg(s + i)} << (8 * (i % 4));
  } else {
    // Swizzled sources are padded: cols % 4 == 0, every group is whole.
    const u32 groups = p.cols / 4;
#pragma unroll
    for (u32 j = 0; j < 4; ++j) {
      const u32 gi = c0 / 4 + j;
      v[j] = gi < groups ? __ldg(reinterpret_cast<const u32*>(src + swizzled_index(r, gi * 4, p.cols))) : 0u;
    }
  }
}

__device__ __forceinline__ u32 byte_of(const u32 (&v)[4], u32 i) {
  return (v[i / 4] >> (8 * (i % 4))) & 0xFFu;
}

// Base of the row: smallest b in [0, 256 - W] maximizing the bytes in
// [b, b + W). hist holds the row's histogram (group-private; every bin
// outside [mn, mx] is 0) and is left all-zero on return. Only bases in
// [max(mn - W + 1, 0), min(mx, 256 - W)] can win (others count 0), so the
// work is bounded by the row's byte range, not by 256 bins: P is the
// exclusive prefix over bins [lo, mx], count(b) = P[b + W] - P[b], with P = n
// past mx.
template <u32 W>
__device__ __forceinline__ u32 choose_base(u32* hist, u32 glane, u32 lanes, u32 gmask, u32 n_values, u32 mn,
                                           u32 mx, u32& in_window) {
  if (mx - mn < W) {  // the whole row fits one window: its lowest base
    for (u32 b = mn + glane; b <= mx; b += lanes) hist[b] = 0;
    __syncwarp(gmask);
    in_window = n_values;
    return mx >= W - 1 ? mx - (W - 1) : 0u;
  }
  const u32 lo = mn >= W - 1 ? mn - (W - 1) : 0u;
  const u32 nb = mx - lo + 1;
  const u32 seg = (nb + lanes - 1) / lanes;
  const u32 b0 = lo + glane * seg, b1 = min(b0 + seg, mx + 1);
  u32 local = 0;
  for (u32 b = b0; b < b1; ++b) local += hist[b];
  u32 incl = local;
  for (u32 d = 1; d < lanes; d <<= 1) {
    const u32 y = __shfl_up_sync(gmask, incl, d, lanes);
    if (glane >= d) incl += y;
  }
  u32 run = incl - local;
  for (u32 b = b0; b < b1; ++b) {
    const u32 h = hist[b];
    hist[b] = run;
    run += h;
  }
  __syncwarp(gmask);
  // key = count << 9 | (511 - b): the max key has the max count, then the lowest b.
  u32 best = 0;
  const u32 last = min(mx, 256u - W);
  for (u32 b = b0; b < b1 && b <= last; ++b) {
    const u32 hi = b + W <= mx ? hist[b + W] : n_values;
    best = max(best, ((hi - hist[b]) << 9) | (511u - b));
  }
  for (u32 d = lanes / 2; d >= 1; d >>= 1) best = max(best, __shfl_xor_sync(gmask, best, d, lanes));
  __syncwarp(gmask);
  for (u32 b = b0; b < b1; ++b) hist[b] = 0;  // ready for the next row
  __syncwarp(gmask);
  in_window = best >> 9;
  return 511u - (best & 511u);
}

template <ScaleFormat F, ScaleLayout L>
__global__ void __launch_bounds__(kThreads) encode_rows_kernel(const EncodeParams p) {
  constexpr bool kNv = F == ScaleFormat::nvfp4;
  constexpr u32 W = kNv ? 16u : 2u;
  extern __shared__ uint4 smem_raw[];
  u32* hists = reinterpret_cast<u32*>(smem_raw);
  const u32 groups_per_warp = 32 / p.lanes;
  u8* sslab = reinterpret_cast<u8*>(hists + kWarps * groups_per_warp * 256);
  __shared__ u32 s_block_total;

  const u32 e = blockIdx.x / p.units;
  const u32 unit = blockIdx.x - e * p.units;
  const u32 r0 = unit * p.unit_rows;
  const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const u32 grp = lane / p.lanes, glane = lane % p.lanes;
  const u32 gmask = p.lanes == 32 ? 0xFFFFFFFFu : (((1u << p.lanes) - 1u) << (grp * p.lanes));
  u32* hist = hists + (warp * groups_per_warp + grp) * 256;
  u8* fixed_e = p.fixed + e * p.layout.fixed_bytes_per_expert;
  const u32 groups = p.layout.padded_cols / 4;
  const u32 slab_bytes = slab_bytes_u32(p.layout);

  if (threadIdx.x == 0) s_block_total = 0;
  for (u32 i = threadIdx.x; i < kWarps * groups_per_warp * 256; i += kThreads) hists[i] = 0;
  if (kNv && p.staged) {
    const u32 bytes = 128 + groups * kGroupStride;
    for (u32 i = threadIdx.x * 16; i < bytes; i += kThreads * 16)
      *reinterpret_cast<uint4*>(sslab + i) = uint4{};
  }
  __syncthreads();

  u32 block_total = 0;
  const u32 rows_per_pass = kWarps * groups_per_warp;
  for (u32 pass = 0; pass * rows_per_pass < p.unit_rows; ++pass) {
    const u32 r = r0 + pass * rows_per_pass + warp * groups_per_warp + grp;
    if (r >= p.rows || r >= r0 + p.unit_rows) continue;  // padding rows stay 0 (memset)
    u32 mn = 255, mx = 0;
    for (u32 c0 = glane * 16; c0 < p.cols; c0 += p.lanes * 16) {
      u32 v[4], n;
      load_row16<L>(p, e, r, c0, v, n);
      for (u32 i = 0; i < n; ++i) {
        const u32 b = byte_of(v, i);
        mn = min(mn, b);
        mx = max(mx, b);
        atomicAdd(&hist[b], 1u);
      }
    }
    for (u32 d = p.lanes / 2; d >= 1; d >>= 1) {
      mn = min(mn, __shfl_xor_sync(gmask, mn, d, p.lanes));
      mx = max(mx, __shfl_xor_sync(gmask, mx, d, p.lanes));
    }
    __syncwarp(gmask);
    u32 in_window;
    const u32 base = choose_base<W>(hist, glane, p.lanes, gmask, p.cols, mn, mx, in_window);
    // Offsets (exception slots keep 0).
    for (u32 c0 = glane * 16; c0 < p.cols; c0 += p.lanes * 16) {
      u32 v[4], n;
      load_row16<L>(p, e, r, c0, v, n);
      if constexpr (kNv) {
        const u32 rs = r % 128;
        u8* slab = p.staged ? sslab : fixed_e + u64{csf::slab_index(F, r)} * slab_bytes;
        const u32 stride = p.staged ? kGroupStride : 256u;
#pragma unroll
        for (u32 j = 0; j < 4; ++j) {
          const u32 gi = c0 / 4 + j;
          if (gi >= groups) break;
          u32 x = 0;
#pragma unroll
          for (u32 i = 0; i < 4; ++i) {
            const u32 col = j * 4 + i;
            const u32 d = byte_of(v, col) - base;
            if (col < n && d < W) x |= d << (4 * i);
          }
          *reinterpret_cast<u16*>(slab + csf::slab_base_bytes(F) + gi * stride +
                                  csf::nvfp4_row_in_group(rs)) = static_cast<u16>(x);
        }
      } else {
        // csf::mxfp4_row_mask, added in 64 bits
        u8* mask = fixed_e + u64{csf::slab_index(F, r)} * slab_bytes + 16 + (r % 16) * p.mask_bytes + c0 / 8;
        u32 bits = 0;
#pragma unroll
        for (u32 i = 0; i < 16; ++i) {
          const u32 d = byte_of(v, i) - base;
          if (i < n && d == 1) bits |= 1u << i;
        }
        mask[0] = static_cast<u8>(bits);
        if (c0 / 8 + 1 < p.mask_bytes) mask[1] = static_cast<u8>(bits >> 8);
      }
    }
    if (glane == 0) {
      if constexpr (kNv) {
        const u32 rs = r % 128;
        u8* slab = p.staged ? sslab : fixed_e + u64{csf::slab_index(F, r)} * slab_bytes;
        slab[csf::base_index(F, rs)] = static_cast<u8>(base);
      } else {
        fixed_e[u64{csf::slab_index(F, r)} * slab_bytes + csf::base_index(F, r)] = static_cast<u8>(base);
      }
      const u32 exc = p.cols - in_window;
      p.counts[u64{e} * p.layout.padded_rows + r] = exc;
      block_total += exc;
    }
  }
  if (block_total) atomicAdd(&s_block_total, block_total);
  __syncthreads();
  if (threadIdx.x == 0 && s_block_total) atomicAdd(p.total, static_cast<unsigned long long>(s_block_total));
  if (kNv && p.staged) {
    // Copy the slab out (unpadding the groups); unit_rows == 128: one slab.
    u8* slab = fixed_e + u64{r0 / 128} * slab_bytes;
    const u32 chunks = 8 + groups * 16;
    for (u32 t = threadIdx.x; t < chunks; t += kThreads) {
      if (t < 8) {
        *reinterpret_cast<uint4*>(slab + t * 16) = *reinterpret_cast<const uint4*>(sslab + t * 16);
      } else {
        const u32 v = t - 8;
        *reinterpret_cast<uint4*>(slab + 128 + u64{v >> 4} * 256 + (v & 15) * 16) =
            *reinterpret_cast<const uint4*>(sslab + 128 + (v >> 4) * kGroupStride + (v & 15) * 16);
      }
    }
  }
}

// Records of every row with exceptions, in column order, at row_prefix.
template <ScaleFormat F, ScaleLayout L>
__global__ void __launch_bounds__(kThreads) encode_records_kernel(const EncodeParams p) {
  constexpr bool kNv = F == ScaleFormat::nvfp4;
  constexpr u32 W = kNv ? 16u : 2u;
  const u32 e = blockIdx.x / p.units;
  const u32 unit = blockIdx.x - e * p.units;
  const u32 r0 = unit * p.unit_rows;
  const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const u32 groups_per_warp = 32 / p.lanes;
  const u32 grp = lane / p.lanes, glane = lane % p.lanes;
  const u32 gmask = p.lanes == 32 ? 0xFFFFFFFFu : (((1u << p.lanes) - 1u) << (grp * p.lanes));
  const u8* fixed_e = p.fixed + e * p.layout.fixed_bytes_per_expert;
  const u32 slab_bytes = slab_bytes_u32(p.layout);
  const u32 rows_per_pass = kWarps * groups_per_warp;
  for (u32 pass = 0; pass * rows_per_pass < p.unit_rows; ++pass) {
    const u32 r = r0 + pass * rows_per_pass + warp * groups_per_warp + grp;
    if (r >= p.rows || r >= r0 + p.unit_rows) continue;
    const u64 gr = u64{e} * p.layout.padded_rows + r;
    u32 out = p.row_prefix[gr];
    if (p.row_prefix[gr + 1] == out) continue;
    u32 base;
    if constexpr (kNv) {
      const u32 rs = r % 128;
      base = fixed_e[u64{csf::slab_index(F, r)} * slab_bytes + csf::base_index(F, rs)];
    } else {
      base = fixed_e[u64{csf::slab_index(F, r)} * slab_bytes + csf::base_index(F, r)];
    }
    const u32 pos0 = p.layout.position(r, 0);
    const u32 trips = (p.cols + p.lanes * 16 - 1) / (p.lanes * 16);
    for (u32 t = 0; t < trips; ++t) {
      const u32 c0 = (t * p.lanes + glane) * 16;
      u32 v[4], n = 0, bad = 0;
      if (c0 < p.cols) {
        load_row16<L>(p, e, r, c0, v, n);
#pragma unroll
        for (u32 i = 0; i < 16; ++i)
          if (i < n && byte_of(v, i) - base >= W) bad |= 1u << i;
      }
      const u32 cnt = __popc(bad);
      u32 incl = cnt;
      for (u32 d = 1; d < p.lanes; d <<= 1) {
        const u32 y = __shfl_up_sync(gmask, incl, d, p.lanes);
        if (glane >= d) incl += y;
      }
      u32 o = out + incl - cnt;
      while (bad) {
        const u32 i = __ffs(bad) - 1;
        bad &= bad - 1;
        p.exceptions[o++] = csf::make_record(pos0 + c0 + i, static_cast<u8>(byte_of(v, i)));
      }
      out += __shfl_sync(gmask, incl, p.lanes - 1, p.lanes);
    }
  }
}

__global__ void partition_index_kernel(const u32* row_prefix, u32* partition_index, u64 entries,
                                       u32 partition_rows) {
  for (u64 i = blockIdx.x * u64{blockDim.x} + threadIdx.x; i < entries; i += u64{gridDim.x} * blockDim.x)
    partition_index[i] = row_prefix[i * partition_rows];
}

}  // namespace csfmoe::gpu
