// Device readers of one projection's block-scale bytes, shared by the GEMM
// kernels: a dense grid (row-major or 128x4-swizzled) or the CSF fixed part
// (base + offset; exception slots read offset 0 and are patched by the caller).
#pragma once

#include <cstdint>

#include "cuda/moe_kernels.cuh"

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

// CSF fixed part (docs/csf-format.md): the slab holding `row` of expert e,
// the row's base byte in it, and where its offsets start.
template <ScaleFormat F>
__device__ __forceinline__ const std::uint8_t* csf_slab(const ScaleSource& s, int e, std::uint32_t row) {
  return s.fixed + std::uint64_t(e) * s.fixed_per_expert +
         std::uint64_t(row / csf_slab_rows(F)) * s.slab_bytes;
}
template <ScaleFormat F>
__device__ __forceinline__ std::uint32_t csf_base_index(std::uint32_t row) {
  return F == ScaleFormat::nvfp4 ? (row % 32) * 4 + (row % 128) / 32 : row % 16;
}
template <ScaleFormat F>
__device__ __forceinline__ std::uint8_t csf_base(const std::uint8_t* slab, std::uint32_t row) {
  return slab[csf_base_index<F>(row)];
}
// NVFP4: nibble index of (row, col) after the 128 base bytes (128x4 tiles).
__device__ __forceinline__ std::uint32_t nvfp4_offset_nibble(std::uint32_t row, std::uint32_t col) {
  return (col / 4) * 512 + (row % 32) * 16 + ((row % 128) / 32) * 4 + (col % 4);
}
// MXFP4: byte of the 1-bit offsets holding (row, col) after the 16 base bytes.
__device__ __forceinline__ std::uint32_t mxfp4_offset_byte(const ScaleSource& s, std::uint32_t row,
                                                           std::uint32_t col) {
  return 16 + (row % 16) * ((s.padded_cols + 7) / 8) + col / 8;
}

// Base + offset of (e, row, col) from the CSF fixed part; exception slots
// hold offset 0 and are patched afterwards from the records.
template <ScaleFormat F>
__device__ __forceinline__ std::uint8_t csf_fixed_scale(const ScaleSource& s, int e, std::uint32_t row,
                                                        std::uint32_t col) {
  const std::uint8_t* slab = csf_slab<F>(s, e, row);
  const std::uint8_t base = csf_base<F>(slab, row);
  if constexpr (F == ScaleFormat::nvfp4) {
    const std::uint32_t n = nvfp4_offset_nibble(row, col);
    return std::uint8_t(base + ((slab[128 + n / 2] >> ((n & 1) * 4)) & 0xF));
  } else {
    return std::uint8_t(base + ((slab[mxfp4_offset_byte(s, row, col)] >> (col % 8)) & 1));
  }
}

// Block row (0..31) of a decode lane's row c: lane chunk c = 2i + h holds
// row 16i + g + 8h, g = lane / 4 (the two m16 MMA row tiles of the block).
__device__ __forceinline__ int decode_lane_row(int c, int g) { return 16 * (c / 2) + g + 8 * (c % 2); }

// The block-scale bytes one decode lane (src/cuda/moe_decode.cuh) needs per
// 128-wide K block kb, streamed through its cp.async ring. Lane t of a quad
// covers K 32t..32t+31 of each of its four rows c = 0..3 per K block: NVFP4
// scale columns 8kb + 2t and 8kb + 2t + 1, MXFP4 column 4kb + t. The lane
// copies one aligned source word per row and K block (word: for dense grids
// the scale quad holding its bytes, for CSF the word holding their offsets)
// and gathers from the four the bytes it needs (gather):
//   NVFP4 u[j] = (row 2j col 0, row 2j col 1, row 2j+1 col 0, row 2j+1 col 1),
//   MXFP4 u[0] = (row 0, row 1, row 2, row 3), little-endian.
// CSF bytes are base + offset with per-byte wrap-around, as csf_fixed_scale;
// exception slots read offset 0 and are patched by LaneExceptions.
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
        const std::uint64_t slab = std::uint64_t(r / csf_slab_rows(F)) * s.slab_bytes;
        base[c] = __ldg(expert + slab + csf_base_index<F>(r));
        if constexpr (F == ScaleFormat::nvfp4)  // the byte holding both nibbles of columns 2t, 2t + 1
          off = slab + 128 + nvfp4_offset_nibble(r, 2 * t) / 2;
        else
          off = slab + mxfp4_offset_byte(s, r, 0);
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
    if constexpr (F == ScaleFormat::nvfp4) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const std::uint32_t p0 = pos[2 * j], p1 = pos[2 * j + 1] + 4;
        // dense: the two bytes of each row; csf: the offset byte of each row, twice.
        sel[j] = kCsf ? p0 | p0 << 4 | p1 << 8 | p1 << 12 : p0 | (p0 + 1) << 4 | p1 << 8 | (p1 + 1) << 12;
        if constexpr (kCsf) {
          const std::uint32_t b = (base[2 * j] | base[2 * j + 1] << 16) * 0x0101u;
          base_lo[j] = b & 0x7F7F7F7Fu;
          base_hi[j] = b & 0x80808080u;
        }
      }
    } else if constexpr (kCsf) {
      const std::uint32_t b = base[0] | base[1] << 8 | base[2] << 16 | base[3] << 24;
      base_lo[0] = b & 0x7F7F7F7Fu;
      base_hi[0] = b & 0x80808080u;
      sel[0] = t;  // the lane's bit among the 4 columns of a K block
    } else {
      sel[0] = pos[0] | (pos[1] + 4) << 4;
      sel[1] = pos[2] | (pos[3] + 4) << 4;
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
    if constexpr (F == ScaleFormat::nvfp4) {
      u[0] = __byte_perm(w.x, w.y, sel[0]);
      u[1] = __byte_perm(w.z, w.w, sel[1]);
      if constexpr (kCsf) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          // (b0, b0, b1, b1) -> nibbles (lo b0, hi b0, lo b1, hi b1), then + base byte-wise:
          // offsets < 16 and base bits 0..6 never carry out of a byte; bit 7 adds as an xor.
          const std::uint32_t nib = (u[j] & 0x000F000Fu) | ((u[j] >> 4) & 0x0F000F00u);
          u[j] = (nib + base_lo[j]) ^ base_hi[j];
        }
      }
    } else if constexpr (kCsf) {
      const std::uint32_t bit = (kb & 1u) * 4u;
      const std::uint32_t words[kRows] = {w.x, w.y, w.z, w.w};
      std::uint32_t bits = 0;
#pragma unroll
      for (int c = 0; c < kRows; ++c) {
        const std::uint32_t shift = 8u * (std::uint32_t(mx_csf_byte(c, kb)) & 3u) + bit + sel[0];
        bits |= ((words[c] >> shift) & 1u) << (8 * c);
      }
      u[0] = (bits + base_lo[0]) ^ base_hi[0];
    } else {
      u[0] = __byte_perm(__byte_perm(w.x, w.y, sel[0]), __byte_perm(w.z, w.w, sel[1]), 0x5410);
    }
  }
};

// CSF exception records of a decode block's 32 rows: two runs of 16
// consecutive weight rows (the gate and up halves of a gate/up block, the two
// halves of a down block), whose records are consecutive in the record array
// (ordered by row, then column). stage() copies them into shared memory when
// they fit (kCapacity; realistic grids hold a few per row), else the lanes
// read them from global memory (adversarial grids).
struct BlockExceptions {
  static constexpr std::uint32_t kCapacity = 512;
  std::uint32_t run_prefix[2][17];  // row_prefix of each run's 16 rows, and one past
  std::uint32_t row_range[32][2];   // [begin, end) of block row r, indices into `records` below
  std::uint32_t records[kCapacity];

  // Step 1, before a barrier: the runs start at weight rows first0 and first1 of expert e.
  __device__ __forceinline__ void load_prefix(const ScaleSource& s, int e, std::uint32_t first0,
                                              std::uint32_t first1, int tid, int threads) {
    for (int idx = tid; idx < 34; idx += threads) {
      const std::uint32_t run = idx < 17 ? 0u : 1u, q = idx - 17 * run;
      run_prefix[run][q] = s.row_prefix[std::uint64_t(e) * s.padded_rows + (run == 0 ? first0 : first1) + q];
    }
  }
  // Step 2, after it and before another: the records and the row ranges.
  // Returns whether the records were staged (else lanes read global memory).
  __device__ __forceinline__ bool stage(const ScaleSource& s, int tid, int threads) {
    const std::uint32_t b0 = run_prefix[0][0], n0 = run_prefix[0][16] - b0;
    const std::uint32_t b1 = run_prefix[1][0], n1 = run_prefix[1][16] - b1;
    const bool fits = n0 + n1 <= kCapacity;
    if (fits)
      for (std::uint32_t idx = tid; idx < n0 + n1; idx += threads)
        records[idx] = s.exceptions[idx < n0 ? b0 + idx : b1 + (idx - n0)];
    for (int r = tid; r < 32; r += threads) {
      const int run = r / 16, lr = r % 16;
      const std::uint32_t shift = !fits ? 0u : run == 0 ? 0u - b0 : n0 - b1;
      row_range[r][0] = run_prefix[run][lr] + shift;
      row_range[r][1] = run_prefix[run][lr + 1] + shift;
    }
    return fits;
  }
  __device__ __forceinline__ std::uint32_t record(const ScaleSource& s, bool staged, std::uint32_t i) const {
    return staged ? records[i] : s.exceptions[i];
  }
};

// The exception records of a lane's four rows. A lane visits its K blocks in
// ascending order, so one cursor per row suffices: records before the current
// block belong to other lanes or warps and are skipped. `soonest` (the
// smallest column among the cursors' records) lets a K block without an
// exception cost one comparison.
template <ScaleFormat F>
struct LaneExceptions {
  static constexpr std::uint32_t kNone = 0xFFFFFFFFu;
  static constexpr std::uint32_t kColsPerBlock = 128 / group_size(F);
  bool staged;  // BlockExceptions::stage
  std::uint32_t next[4];
  std::uint32_t soonest = kNone;

  // Column of record i of the row starting at position first, or kNone past end.
  __device__ __forceinline__ std::uint32_t column(const ScaleSource& s, const BlockExceptions& b,
                                                  std::uint32_t i, std::uint32_t end,
                                                  std::uint32_t first) const {
    return i < end ? (b.record(s, staged, i) & 0xFFFFFFu) - first : kNone;
  }

  // rows: the lane's weight rows; g: lane / 4.
  __device__ __forceinline__ void start(const ScaleSource& s, const BlockExceptions& b,
                                        const std::uint32_t (&rows)[4], int g) {
    soonest = kNone;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int br = decode_lane_row(c, g);
      next[c] = b.row_range[br][0];
      const std::uint32_t col = column(s, b, next[c], b.row_range[br][1], rows[c] * s.padded_cols);
      soonest = col < soonest ? col : soonest;
    }
  }

  // Does K block kb hold a record of one of the rows?
  __device__ __forceinline__ bool due(std::uint32_t kb) const { return soonest < (kb + 1) * kColsPerBlock; }

  // Patches the lane's gathered bytes u (LaneScales layout) of K block kb
  // with the records of its columns; advances the cursors past the block.
  template <int kWords>
  __device__ __forceinline__ void patch(const ScaleSource& s, const BlockExceptions& b,
                                        const std::uint32_t (&rows)[4], int g, std::uint32_t kb,
                                        std::uint32_t t, std::uint32_t (&u)[kWords]) {
    constexpr std::uint32_t kLaneCols = F == ScaleFormat::nvfp4 ? 2 : 1;
    const std::uint32_t end_col = (kb + 1) * kColsPerBlock, lane_col = kb * kColsPerBlock + t * kLaneCols;
    soonest = kNone;
    for (int c = 0; c < 4; ++c) {
      const std::uint32_t end = b.row_range[decode_lane_row(c, g)][1], first = rows[c] * s.padded_cols;
      std::uint32_t i = next[c], col;
      while ((col = column(s, b, i, end, first)) < end_col) {
        if (col - lane_col < kLaneCols) {
          const std::uint32_t byte = F == ScaleFormat::nvfp4 ? 2 * (c % 2) + (col - lane_col) : c;
          std::uint32_t& word = u[F == ScaleFormat::nvfp4 ? c / 2 : 0];
          word = (word & ~(0xFFu << (8 * byte))) | ((b.record(s, staged, i) >> 24) << (8 * byte));
        }
        ++i;
      }
      next[c] = i;
      soonest = col < soonest ? col : soonest;
    }
  }
};

// Start of expert e's scales: its dense grid or its CSF fixed part.
template <ScaleKind K>
__device__ __forceinline__ const std::uint8_t* expert_scales(const ScaleSource& s, int e) {
  return K == ScaleKind::csf ? s.fixed + std::uint64_t(e) * s.fixed_per_expert
                             : s.dense + std::uint64_t(e) * s.expert_stride;
}

}  // namespace csfmoe::moe_detail
