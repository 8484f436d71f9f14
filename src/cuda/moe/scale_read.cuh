// Device readers of one projection's block-scale bytes, shared by the GEMM
// kernels: a dense grid (row-major or 128x4-swizzled) or the CSF fixed part
// (base + offset; exception slots read offset 0 and are patched by the caller).
#pragma once

#include <cstdint>

#include "cuda/moe/dequant.cuh"
#include "cuda/moe/launchers.hpp"
#include "cuda/primitives/ptx.cuh"
#include "moe/grouped_shape.hpp"
#include "moe/stage_read_index.hpp"

namespace csfmoe::moe_detail {

template <ScaleFormat F>
__device__ __forceinline__ float scale_to_float(std::uint8_t b) {
  if constexpr (F == ScaleFormat::nvfp4)
    return e4m3fn_to_float(b);
  else
    return e8m0_to_float(b);
}

// E2M1 decode by bit assembly (same values as e2m1_to_float, whose table
// lookup with a run-time index would live in local memory).
__device__ __forceinline__ float e2m1_bits_to_float(std::uint32_t code) {
  const std::uint32_t mag = code & 7u;
  const std::uint32_t bits =
      mag == 1u ? 0x3F000000u : (mag >= 2u ? (((mag >> 1) + 126u) << 23) | ((mag & 1u) << 22) : 0u);
  return __uint_as_float(bits | ((code & 8u) << 28));
}

// Byte index of (row, col) in one expert's dense grid, and of (e, row, col).
template <ScaleKind K>
__device__ __forceinline__ std::uint64_t dense_index_in_expert(const ScaleSource& s, std::uint32_t row,
                                                               std::uint32_t col) {
  return K == ScaleKind::dense_swizzled ? swizzled_index(row, col, s.cols)
                                        : std::uint64_t(row) * s.cols + col;
}
template <ScaleKind K>
__device__ __forceinline__ std::uint64_t dense_index(const ScaleSource& s, int e, std::uint32_t row,
                                                     std::uint32_t col) {
  return std::uint64_t(e) * s.expert_stride + dense_index_in_expert<K>(s, row, col);
}

// Scale byte (e, row, col) from a dense grid.
template <ScaleKind K>
__device__ __forceinline__ std::uint8_t dense_scale(const ScaleSource& s, int e, std::uint32_t row,
                                                    std::uint32_t col) {
  return s.dense[dense_index<K>(s, e, row, col)];
}

// Base + offset of (e, row, col) from the CSF fixed part (layout:
// csfmoe/detail/csf_layout.hpp); exception slots hold offset 0 and are
// patched afterwards from the records.
template <ScaleFormat F>
__device__ __forceinline__ std::uint8_t csf_fixed_scale(const ScaleSource& s, int e, std::uint32_t row,
                                                        std::uint32_t col) {
  const std::uint8_t* slab = s.fixed + s.layout.slab_offset<F>(e, row);
  const std::uint8_t base = slab[csf::base_index(F, row)];
  if constexpr (F == ScaleFormat::nvfp4) {
    const std::uint32_t n = csf::nvfp4_offset_nibble(row, col);
    return std::uint8_t(base + ((slab[csf::nvfp4_nibble_byte(n)] >> csf::nvfp4_nibble_shift(n)) & 0xF));
  } else {
    return std::uint8_t(
        base +
        ((slab[csf::mxfp4_offset_byte(row, col, s.layout.padded_cols)] >> csf::mxfp4_offset_bit(col)) & 1));
  }
}

// Dense scale words: a lane's four rows' aligned source words w.x..w.w, and
// the selectors of decode_bits::dense_scale_selectors (LaneScales::gather's
// layout of u).
template <ScaleFormat F>
__device__ __forceinline__ void gather_dense_scale_bytes(
    const uint4& w, const std::uint32_t (&sel)[2], std::uint32_t (&u)[F == ScaleFormat::nvfp4 ? 2 : 1]) {
  if constexpr (F == ScaleFormat::nvfp4) {
    u[0] = __byte_perm(w.x, w.y, sel[0]);
    u[1] = __byte_perm(w.z, w.w, sel[1]);
  } else {
    u[0] = __byte_perm(__byte_perm(w.x, w.y, sel[0]), __byte_perm(w.z, w.w, sel[1]), 0x5410);
  }
}

// Block row (0..31) of a decode lane's row c: lane chunk c = 2i + h holds
// row 16i + g + 8h, g = lane / 4 (the two m16 MMA row tiles of the block).
__device__ __forceinline__ int decode_lane_row(int c, int g) { return 16 * (c / 2) + g + 8 * (c % 2); }

// The block-scale bytes one decode lane (src/cuda/moe/decode_kernel.cuh) needs per
// 128-wide K block kb, streamed through its cp.async ring. Lane t of a quad
// covers K 32t..32t+31 of each of its four rows c = 0..3 per K block: NVFP4
// scale columns 8kb + 2t and 8kb + 2t + 1, MXFP4 column 4kb + t. The lane
// copies one aligned source word per row and K block (word: for dense grids
// the scale quad holding its bytes, for CSF the word holding their offsets)
// and gathers from the four the bytes it needs (gather):
//   NVFP4 u[j] = (row 2j col 0, row 2j col 1, row 2j+1 col 0, row 2j+1 col 1),
//   MXFP4 u[0] = (row 0, row 1, row 2, row 3), little-endian.
// CSF bytes are base + offset with per-byte wrap-around, as csf_fixed_scale;
// exception slots read offset 0 and are patched from the records
// (BlockExceptions::patch, or LaneExceptions when not staged).
template <ScaleFormat F, ScaleKind K>
struct LaneScales {
  static constexpr int kRows = 4;
  static constexpr int kWords = F == ScaleFormat::nvfp4 ? 2 : 1;  // words of gathered bytes
  static constexpr bool kCsf = K == ScaleKind::csf;
  static constexpr bool kMxCsf = kCsf && F == ScaleFormat::mxfp4;
  // Source bytes between consecutive K blocks (CSF MXFP4: half a byte, see word).
  static constexpr std::uint32_t kStride = F == ScaleFormat::nvfp4
                                               ? (kCsf                             ? 512u
                                                  : K == ScaleKind::dense_swizzled ? 1024u
                                                                                   : 8u)
                                               : (K == ScaleKind::dense_swizzled ? 512u : 4u);

  const std::uint8_t* expert;
  std::uint32_t at[kRows];        // offset from expert of row c's source word at kb = 0 (CSF MXFP4: byte)
  std::uint32_t sel[2] = {0, 0};  // __byte_perm selectors of the gather (CSF MXFP4: sel[0] = t)
  std::uint32_t base_lo[kWords] = {};  // csf: row bases at the bytes of u, bit 7 cleared ...
  std::uint32_t base_hi[kWords] = {};  // ... and bit 7 alone (carry-free byte-wise add)

  // expert: expert_scales<K>(s, e); rows: the lane's four weight rows; t: lane % 4.
  // Reads the CSF base bytes (four loads); nothing else.
  __device__ __forceinline__ LaneScales(const ScaleSource& s, const std::uint8_t* expert,
                                        const std::uint32_t (&rows)[kRows], std::uint32_t t)
      : expert(expert) {
    std::uint32_t pos[kRows], base[kRows];
#pragma unroll
    for (int c = 0; c < kRows; ++c) {
      const std::uint32_t r = rows[c];
      std::uint64_t off;
      if constexpr (kCsf) {
        const std::uint64_t slab = std::uint64_t(csf::slab_index(F, r)) * s.layout.slab_bytes;
        base[c] = __ldg(expert + slab + csf::base_index(F, r));
        if constexpr (F == ScaleFormat::nvfp4)  // the byte holding both nibbles of columns 2t, 2t + 1
          off = slab + csf::slab_base_bytes(F) + csf::nvfp4_offset_nibble(r, 2 * t) / 2;
        else
          off = slab + csf::mxfp4_offset_byte(r, 0, s.layout.padded_cols);
      } else {
        base[c] = 0;
        off = dense_index_in_expert<K>(s, r, F == ScaleFormat::nvfp4 ? 2 * t : t);
      }
      pos[c] = std::uint32_t(reinterpret_cast<std::uintptr_t>(expert) + off) & 3u;
      // Expert grids are far below 4 GiB. Strides are whole words, so the
      // word of every K block is at[c] + kb * kStride, aligned once here
      // (CSF MXFP4 moves half a byte per block: aligned in word).
      at[c] = std::uint32_t(off) - (kMxCsf ? 0u : pos[c]);
    }
    if constexpr (!kCsf) {
      decode_bits::dense_scale_selectors<F == ScaleFormat::nvfp4>(pos, sel);
    } else if constexpr (F == ScaleFormat::nvfp4) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        // The offset byte of each row, twice.
        const std::uint32_t p0 = pos[2 * j], p1 = pos[2 * j + 1] + 4;
        sel[j] = p0 | p0 << 4 | p1 << 8 | p1 << 12;
        const std::uint32_t b = (base[2 * j] | base[2 * j + 1] << 16) * 0x0101u;
        base_lo[j] = b & 0x7F7F7F7Fu;
        base_hi[j] = b & 0x80808080u;
      }
    } else {
      const std::uint32_t b = base[0] | base[1] << 8 | base[2] << 16 | base[3] << 24;
      base_lo[0] = b & 0x7F7F7F7Fu;
      base_hi[0] = b & 0x80808080u;
      sel[0] = t;  // the lane's bit among the 4 columns of a K block
    }
  }

  // The aligned source word of row c for K block kb, to be copied as is.
  __device__ __forceinline__ const std::uint32_t* word(int c, std::uint32_t kb) const {
    if constexpr (kMxCsf)
      return reinterpret_cast<const std::uint32_t*>(mx_csf_byte(c, kb) & ~std::uintptr_t(3));
    else
      return reinterpret_cast<const std::uint32_t*>(expert + at[c] + kb * kStride);
  }
  // CSF MXFP4: the byte holding row c's offset bits of K block kb.
  __device__ __forceinline__ std::uintptr_t mx_csf_byte(int c, std::uint32_t kb) const {
    return reinterpret_cast<std::uintptr_t>(expert) + at[c] + kb / 2;
  }

  // The lane's scale bytes of K block kb from the four copied words.
  __device__ __forceinline__ void gather(const uint4& w, std::uint32_t kb, std::uint32_t (&u)[kWords]) const {
    if constexpr (!kCsf) {
      gather_dense_scale_bytes<F>(w, sel, u);
    } else if constexpr (F == ScaleFormat::nvfp4) {
      u[0] = __byte_perm(w.x, w.y, sel[0]);
      u[1] = __byte_perm(w.z, w.w, sel[1]);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        // (b0, b0, b1, b1) -> nibbles (lo b0, hi b0, lo b1, hi b1), then + base byte-wise:
        // offsets < 16 and base bits 0..6 never carry out of a byte; bit 7 adds as an xor.
        const std::uint32_t nib = (u[j] & 0x000F000Fu) | ((u[j] >> 4) & 0x0F000F00u);
        u[j] = (nib + base_lo[j]) ^ base_hi[j];
      }
    } else {
      const std::uint32_t bit = (kb & 1u) * 4u;
      const std::uint32_t words[kRows] = {w.x, w.y, w.z, w.w};
      std::uint32_t bits = 0;
#pragma unroll
      for (int c = 0; c < kRows; ++c) {
        const std::uint32_t shift = 8u * (std::uint32_t(mx_csf_byte(c, kb)) & 3u) + bit + sel[0];
        bits |= ((words[c] >> shift) & 1u) << (8 * c);
      }
      u[0] = (bits + base_lo[0]) ^ base_hi[0];
    }
  }
};

// Dense block scales in the grouped kernel's ring (src/cuda/moe/grouped_kernel.cuh,
// grouped_smem): per stage, ring row j holds weight row j's bytes of the stage's
// K block, kRowBytes each. The producer copies the aligned words LaneScales<F,
// K> loads for the same row and K block (its word of kb = 0 at
// dense_index_in_expert(row, 0), then kb * kStride), and a consumer lane
// gathers its bytes from them as LaneScales does, so the GEMM sees the same
// scale bytes either way.
template <ScaleFormat F, ScaleKind K>
struct RingScales {
  static_assert(K != ScaleKind::csf, "the ring holds dense scales");
  static constexpr std::uint32_t kRowBytes = grouped_scale_row_bytes(F == ScaleFormat::nvfp4);
  static constexpr int kWords = LaneScales<F, K>::kWords;
  static constexpr std::uint32_t kStride =
      grouped_scale_kb_stride(F == ScaleFormat::nvfp4, K == ScaleKind::dense_swizzled);
  static_assert(kStride == LaneScales<F, K>::kStride, "the words LaneScales reads");

  // Producer: copies one row's words of a K block (`src`: the row's word at
  // that K block, LaneScales::word) into `dst`, its ring row of a stage.
  __device__ __forceinline__ static void copy(unsigned char* dst, const std::uint8_t* src) {
    if constexpr (F == ScaleFormat::mxfp4) {
      ptx::cp_async4(dst, src);
    } else if constexpr (K == ScaleKind::dense_swizzled) {
      ptx::cp_async4(dst, src);  // columns 8kb .. 8kb + 3 and, one 512-byte tile on, the next four
      ptx::cp_async4(dst + 4, src + 512);
    } else {
      ptx::cp_async8(dst, src);
    }
  }

  // Consumer lane t: NVFP4 columns 2t, 2t + 1 of a row's K block, in word
  // t / 2 at byte 2t % 4; MXFP4 column t, byte t of the row's word.
  std::uint32_t in_row;
  std::uint32_t sel[2];
  __device__ __forceinline__ explicit RingScales(std::uint32_t t) {
    const std::uint32_t at = grouped_scale_lane_byte(F == ScaleFormat::nvfp4, t);
    in_row = at & ~3u;
    const std::uint32_t pos[4] = {at & 3u, at & 3u, at & 3u, at & 3u};
    decode_bits::dense_scale_selectors<F == ScaleFormat::nvfp4>(pos, sel);
  }
  // The lane's word of ring row `ring_row` in a stage's scale rows.
  __device__ __forceinline__ std::uint32_t word(const unsigned char* rows, std::uint32_t ring_row) const {
    return *reinterpret_cast<const std::uint32_t*>(rows + ring_row * kRowBytes + in_row);
  }
  __device__ __forceinline__ void gather(const uint4& w, std::uint32_t (&u)[kWords]) const {
    gather_dense_scale_bytes<F>(w, sel, u);
  }
};

// CSF exception records of a decode block's 32 rows: two runs of 16
// consecutive weight rows (the gate and up halves of a gate/up block, the two
// halves of a down block), whose records are consecutive in the record array
// (ordered by row, then column).
//
// When they fit (kCapacity; realistic grids hold a few per row) the prologue
// stages them into shared memory bucketed by K block (from the load-time
// index, or by a counting sort: stage, scan, scatter), and a warp at K block
// kb patches from one short list with a warp-uniform trip count (patch).
// Per-lane row cursors made the patch divergent (some lane of nearly every
// warp and K block is due; docs/decode-kernel.md). A staged record is a
// PatchEntry, laid out so that a lane tests one masked compare and patches
// with one byte permute.
// Buckets are K blocks modulo kBuckets; the entry keeps kb / kBuckets, so any
// K is bucketed. Records that do not fit (adversarial grids) stay in global
// memory and are walked by LaneExceptions, whose cursors reuse the staging
// storage.
//
// PatchEntry (uint2) of a record whose exception_entry is `entry`, in K block
// kb: x = (kb / kBuckets) << 24 | (word of u) << 21 | lane key << 16 |
// selector, y = the exception byte in all four bytes. The selector
// (0x3210 with the patched byte's nibble set to 4) makes
// __byte_perm(u[word], y, selector) replace that byte: __byte_perm reads only
// the low 3 bits of the selector's four low nibbles, not the key above them.
struct BlockExceptions {
  static constexpr std::uint32_t kCapacity = 256;
  static constexpr std::uint32_t kBuckets = 256;
  static constexpr std::uint32_t kMaxKBlocks = 0xFFFFu;   // sort keys hold kb in 16 bits ...
  static constexpr std::uint32_t kSkip = 0xFFFFu;         // ... or this, for a column past K
  static constexpr std::uint32_t kKeyMask = 0xFF1F0000u;  // the bits of a PatchEntry a lane matches
  static constexpr int kMaxThreads = 256;
  static_assert(kIndexMaxCapacity <= kCapacity, "an indexed row block fits the staging area");
  static_assert(kIndexMaxKBlocks <= kBuckets, "indexed K blocks are their own buckets");
  std::uint32_t run_prefix[2][17];  // row_prefix of each run's 16 rows, and one past
  std::uint32_t first_row[2];       // weight row of each run's first row
  std::uint32_t row_range[32][2];   // [begin, end) of block row r in the global record array
  union {
    struct {
      std::uint32_t records[kCapacity];  // per-block sort: kb << 16 | entry (low 16 bits), in record order
      uint2 patches[kCapacity];          // PatchEntry, by bucket
      // Entries of bucket j at [bucket[j], bucket[j + 1]): counts at j + 1,
      // then their exclusive sums, then, advanced by the scatter, the ends.
      std::uint32_t bucket[kBuckets + 1];
    } staged;
    std::uint32_t cursor[4][kMaxThreads];  // not staged: LaneExceptions' cursors of each thread
  } data;

  // The match key of lane (g, t) = (lane / 4, lane % 4) in the PatchEntry layout.
  __device__ __forceinline__ static std::uint32_t lane_key(int g, int t) {
    return std::uint32_t(g | t << 3) << 16;
  }
  // PatchEntry of exception_entry `entry` (16 bits) in a K block kb with
  // kb / kBuckets = kb_high.
  __device__ __forceinline__ static uint2 patch_entry(std::uint32_t entry, std::uint32_t kb_high) {
    const std::uint32_t p = (entry >> 5) & 7u, nibble = 4u * (p & 3u);
    const std::uint32_t selector = (0x3210u & ~(0xFu << nibble)) | 4u << nibble;
    return make_uint2(kb_high << 24 | (p >> 2) << 21 | (entry & 31u) << 16 | selector,
                      ((entry >> 8) & 0xFFu) * 0x01010101u);
  }

  // Indexed path (ScaleSource::index), step 1, before a barrier: the row
  // block's index entry (stage_read_index.hpp) into the staged buckets and
  // patch entries, which it already holds sorted; it depends on nothing but
  // the expert. Every 16-byte chunk holds either 8 entries or 16 offsets.
  __device__ __forceinline__ void load_index(const ScaleSource& s, int e, std::uint32_t row_block,
                                             std::uint32_t kblocks, int tid, int threads) {
    const std::uint8_t* src =
        s.index + (std::uint64_t(e) * s.index_blocks_per_expert + row_block) * s.index_block_bytes;
    const std::uint32_t entry_vecs = s.index_capacity / 8, vecs = s.index_block_bytes / 16;
    for (std::uint32_t q = std::uint32_t(tid); q < vecs; q += std::uint32_t(threads)) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(src) + q);
      const std::uint32_t w[4] = {v.x, v.y, v.z, v.w};
      if (q < entry_vecs) {
#pragma unroll
        for (int k = 0; k < 8; ++k)
          data.staged.patches[8 * q + k] = patch_entry(w[k / 2] >> (16 * (k % 2)), 0);
      } else {
        const std::uint32_t first = 16 * (q - entry_vecs);
#pragma unroll
        for (int k = 0; k < 16; ++k)
          if (first + k <= kblocks) data.staged.bucket[first + k] = (w[k / 4] >> (8 * (k % 4))) & 0xFFu;
      }
    }
  }
  // After that barrier: whether the row block fit the index (then the staged
  // buckets are complete and nothing else of this struct is used).
  __device__ __forceinline__ bool index_complete() const { return data.staged.bucket[0] != kIndexOverflow; }

  // Buckets in use for K of kblocks 128-wide blocks.
  __device__ __forceinline__ static std::uint32_t buckets(std::uint32_t kblocks) {
    return kblocks < kBuckets ? kblocks : kBuckets;
  }

  // Step 1, before a barrier: the runs start at weight rows first0 and first1
  // of expert e; K has kblocks blocks.
  __device__ __forceinline__ void load_prefix(const ScaleSource& s, int e, std::uint32_t first0,
                                              std::uint32_t first1, std::uint32_t kblocks, int tid,
                                              int threads) {
    for (int idx = tid; idx < 34; idx += threads) {
      const std::uint32_t run = idx < 17 ? 0u : 1u, q = idx - 17 * run;
      run_prefix[run][q] =
          s.row_prefix[std::uint64_t(e) * s.layout.padded_rows + (run == 0 ? first0 : first1) + q];
    }
    if (tid == 0) {
      first_row[0] = first0;
      first_row[1] = first1;
    }
    for (std::uint32_t j = tid; j <= buckets(kblocks); j += threads) data.staged.bucket[j] = 0;
  }

  // Step 2, after it and before another: the row ranges; when the records
  // fit, their sort keys and the per-bucket counts. Returns whether they were
  // staged (block-uniform); if so, scan and scatter follow.
  template <ScaleFormat F>
  __device__ __forceinline__ bool stage(const ScaleSource& s, std::uint32_t kblocks, int tid, int threads) {
    constexpr std::uint32_t kColsPerBlock = 128 / group_size(F);
    const std::uint32_t b0 = run_prefix[0][0], n0 = run_prefix[0][16] - b0;
    const std::uint32_t b1 = run_prefix[1][0], n1 = run_prefix[1][16] - b1;
    const bool fits = n0 + n1 <= kCapacity && kblocks <= kMaxKBlocks;
    if (fits)
      for (std::uint32_t idx = tid; idx < n0 + n1; idx += threads) {
        const std::uint32_t run = idx < n0 ? 0u : 1u;
        const std::uint32_t rec = s.exceptions[run == 0 ? b0 + idx : b1 + (idx - n0)];
        const std::uint32_t pos = csf::record_position(rec), row = s.layout.position_row(pos),
                            col = pos - row * s.layout.padded_cols;
        // Padding columns past K (none in encoder output) are never read.
        const std::uint32_t kb = col / kColsPerBlock, key = kb < kblocks ? kb : kSkip;
        data.staged.records[idx] =
            key << 16 | exception_entry<F>(16 * run + (row - first_row[run]), col % kColsPerBlock,
                                           csf::record_value_u32(rec));
        if (key != kSkip) atomicAdd(&data.staged.bucket[kb % kBuckets + 1], 1u);
      }
    for (int r = tid; r < 32; r += threads) {
      const int run = r / 16, lr = r % 16;
      row_range[r][0] = run_prefix[run][lr];
      row_range[r][1] = run_prefix[run][lr + 1];
    }
    return fits;
  }

  // Records of the block's rows. Without any, the zeroed buckets are all
  // empty and steps 3 and 4 can be skipped.
  __device__ __forceinline__ std::uint32_t count() const {
    return run_prefix[0][16] - run_prefix[0][0] + run_prefix[1][16] - run_prefix[1][0];
  }

  // Step 3, staged, between barriers: the exclusive sums of the counts (warp 0).
  __device__ __forceinline__ void scan(std::uint32_t kblocks, int tid) {
    if (tid >= 32) return;
    const std::uint32_t n = buckets(kblocks), per = (n + 31) / 32, lo = std::uint32_t(tid) * per;
    const std::uint32_t hi = lo + per < n ? lo + per : n;
    std::uint32_t sum = 0;
    for (std::uint32_t j = lo; j < hi; ++j) sum += data.staged.bucket[j + 1];
    std::uint32_t incl = sum;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const std::uint32_t v = __shfl_up_sync(0xFFFFFFFFu, incl, d);
      if (tid >= d) incl += v;
    }
    std::uint32_t at = incl - sum;
    for (std::uint32_t j = lo; j < hi; ++j) {
      const std::uint32_t c = data.staged.bucket[j + 1];
      data.staged.bucket[j + 1] = at;
      at += c;
    }
  }
  // Step 4, staged, before a barrier: the patch entries into their buckets.
  // Order within a bucket (shared atomics) does not matter: a grid position
  // has at most one record, so the patches of a bucket commute.
  __device__ __forceinline__ void scatter(int tid, int threads) {
    for (std::uint32_t idx = tid, n = count(); idx < n; idx += threads) {
      const std::uint32_t v = data.staged.records[idx], kb = v >> 16;
      if (kb != kSkip)
        data.staged.patches[atomicAdd(&data.staged.bucket[kb % kBuckets + 1], 1u)] =
            patch_entry(v & 0xFFFFu, kb / kBuckets);
    }
  }

  // Staged: patches the gathered bytes u (LaneScales layout) of K block kb
  // of the lane whose lane_key is `key`. All lanes of a warp walk the same
  // entries (kb is warp-uniform); each entry is one load, one masked compare
  // and a predicated byte permute per word, without branches.
  template <int kWords>
  __device__ __forceinline__ void patch(std::uint32_t kb, std::uint32_t key,
                                        std::uint32_t (&u)[kWords]) const {
    constexpr std::uint32_t kHigh = 1u << 21, kMatch = kKeyMask | kHigh;
    const std::uint32_t j = kb % kBuckets;
    key |= (kb / kBuckets) << 24;
    const uint2* const end = data.staged.patches + data.staged.bucket[j + 1];
#pragma unroll 1
    for (const uint2* en = data.staged.patches + data.staged.bucket[j]; en != end; ++en) {
      const uint2 v = *en;
      const std::uint32_t d = v.x ^ key;  // zero in kMatch: this lane's word 0
      u[0] = (d & kMatch) == 0 ? __byte_perm(u[0], v.y, v.x) : u[0];
      if constexpr (kWords == 2) u[1] = ((d ^ kHigh) & kMatch) == 0 ? __byte_perm(u[1], v.y, v.x) : u[1];
    }
  }
};

// The exception records of a lane's four rows when they are not staged
// (BlockExceptions: adversarial grids), read from global memory. A lane
// visits its K blocks in ascending order, so one cursor per row suffices:
// records before the current block belong to other lanes or warps and are
// skipped. `soonest` (the smallest column among the cursors' records) lets a
// K block without an exception cost one comparison. The cursors live in
// shared memory (BlockExceptions::data.cursor, free when not staged) to keep
// the registers of the main loop for the staged path.
template <ScaleFormat F>
struct LaneExceptions {
  static constexpr std::uint32_t kNone = 0xFFFFFFFFu;
  static constexpr std::uint32_t kColsPerBlock = 128 / group_size(F);
  std::uint32_t soonest = kNone;

  // Position of the first column of the lane's row c (g = lane / 4).
  __device__ __forceinline__ static std::uint32_t row_start(const ScaleSource& s, const BlockExceptions& b,
                                                            int c, int g) {
    return (b.first_row[c / 2] + std::uint32_t(g + 8 * (c % 2))) * s.layout.padded_cols;
  }
  // Column of record i of the row starting at position first, or kNone past end.
  __device__ __forceinline__ static std::uint32_t column(const ScaleSource& s, std::uint32_t i,
                                                         std::uint32_t end, std::uint32_t first) {
    return i < end ? csf::record_position(s.exceptions[i]) - first : kNone;
  }

  // tid: the thread's index in the block; g: lane / 4.
  __device__ __forceinline__ void start(const ScaleSource& s, BlockExceptions& b, int tid, int g) {
    soonest = kNone;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int br = decode_lane_row(c, g);
      const std::uint32_t i = b.row_range[br][0];
      b.data.cursor[c][tid] = i;
      const std::uint32_t col = column(s, i, b.row_range[br][1], row_start(s, b, c, g));
      soonest = col < soonest ? col : soonest;
    }
  }

  // Does K block kb hold a record of one of the rows?
  __device__ __forceinline__ bool due(std::uint32_t kb) const { return soonest < (kb + 1) * kColsPerBlock; }

  // Patches the lane's gathered bytes u (LaneScales layout) of K block kb
  // with the records of its columns; advances the cursors past the block.
  template <int kWords>
  __device__ __forceinline__ void patch(const ScaleSource& s, BlockExceptions& b, int tid, int g,
                                        std::uint32_t kb, std::uint32_t t, std::uint32_t (&u)[kWords]) {
    constexpr std::uint32_t kLaneCols = F == ScaleFormat::nvfp4 ? 2 : 1;
    const std::uint32_t end_col = (kb + 1) * kColsPerBlock, lane_col = kb * kColsPerBlock + t * kLaneCols;
    soonest = kNone;
    for (int c = 0; c < 4; ++c) {
      const std::uint32_t end = b.row_range[decode_lane_row(c, g)][1], first = row_start(s, b, c, g);
      std::uint32_t i = b.data.cursor[c][tid], col;
      while ((col = column(s, i, end, first)) < end_col) {
        if (col - lane_col < kLaneCols) {
          const std::uint32_t byte = F == ScaleFormat::nvfp4 ? 2 * (c % 2) + (col - lane_col) : c;
          std::uint32_t& word = u[F == ScaleFormat::nvfp4 ? c / 2 : 0];
          word = (word & ~(0xFFu << (8 * byte))) | (csf::record_value_u32(s.exceptions[i]) << (8 * byte));
        }
        ++i;
      }
      b.data.cursor[c][tid] = i;
      soonest = col < soonest ? col : soonest;
    }
  }
};

// Start of expert e's scales: its dense grid or its CSF fixed part.
template <ScaleKind K>
__device__ __forceinline__ const std::uint8_t* expert_scales(const ScaleSource& s, int e) {
  return K == ScaleKind::csf ? s.fixed + std::uint64_t(e) * s.layout.fixed_bytes_per_expert
                             : s.dense + std::uint64_t(e) * s.expert_stride;
}

}  // namespace csfmoe::moe_detail
