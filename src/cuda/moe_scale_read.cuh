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

// Reader of one row's scale quads: four consecutive scale bytes (col4 % 4 ==
// 0) of (e, row), little-endian in one word. The row's addressing is done
// once; a quad's source is then one aligned word (word), for dense grids the
// quad itself (the 4 columns of a 128x4 tile are contiguous), for CSF the
// word holding its offsets, decoded by quad_from_word: CSF bytes are base +
// offset with per-byte wrap-around, as csf_fixed_scale.
template <ScaleFormat F, ScaleKind K>
struct ScaleRowReader {
  const std::uint8_t* row;                // dense: the row's first byte or tile slot; csf: its first offsets
  const std::uint8_t* base_at = nullptr;  // csf: the row's base byte

  // expert: expert_scales<K>(s, e), hoisted out of loops over rows. Reads nothing.
  __device__ __forceinline__ ScaleRowReader(const ScaleSource& s, const std::uint8_t* expert,
                                            std::uint32_t r) {
    if constexpr (K == ScaleKind::csf) {
      const std::uint8_t* slab = expert + std::uint64_t(r / csf_slab_rows(F)) * s.slab_bytes;
      base_at = slab + csf_base_index<F>(r);
      if constexpr (F == ScaleFormat::nvfp4)
        row = slab + 128 + nvfp4_offset_nibble(r, 0) / 2;
      else
        row = slab + mxfp4_offset_byte(s, r, 0);
    } else {
      row = expert + dense_index_in_expert<K>(s, r, 0);
    }
  }

  // csf: the aligned word holding the row's base byte, and the byte from it.
  __device__ __forceinline__ const std::uint32_t* base_word() const {
    return reinterpret_cast<const std::uint32_t*>(reinterpret_cast<std::uintptr_t>(base_at) &
                                                  ~std::uintptr_t(3));
  }
  __device__ __forceinline__ std::uint32_t base_from_word(std::uint32_t w) const {
    return (w >> (8 * (std::uint32_t(reinterpret_cast<std::uintptr_t>(base_at)) & 3u))) & 0xFFu;
  }

  // The aligned 32-bit source word of quad col4, to be copied as is (a
  // cp.async stage) and decoded by quad_from_word: the quad itself for dense
  // grids, the word holding its offsets for CSF.
  __device__ __forceinline__ const std::uint32_t* word(std::uint32_t col4) const {
    if constexpr (K == ScaleKind::csf) {
      // NVFP4: 4 offset nibbles at byte col4 * 64 (even); MXFP4: 4 bits of byte col4 / 8.
      const std::uint8_t* at = F == ScaleFormat::nvfp4 ? row + col4 * 64 : row + col4 / 8;
      return reinterpret_cast<const std::uint32_t*>(reinterpret_cast<std::uintptr_t>(at) &
                                                    ~std::uintptr_t(3));
    } else if constexpr (K == ScaleKind::dense_swizzled) {
      return reinterpret_cast<const std::uint32_t*>(row + col4 * 128);  // next 128x4 tile: 512 bytes
    } else {
      return reinterpret_cast<const std::uint32_t*>(row + col4);
    }
  }

  // Quad col4 from its source word (word(col4) read or staged); base: the
  // row's base byte (csf only).
  __device__ __forceinline__ std::uint32_t quad_from_word(std::uint32_t w, std::uint32_t col4,
                                                          std::uint32_t base) const {
    if constexpr (K == ScaleKind::csf) {
      const std::uint32_t lane =
          std::uint32_t(reinterpret_cast<std::uintptr_t>(row)) & 3u;  // byte in the word
      std::uint32_t spread;
      if constexpr (F == ScaleFormat::nvfp4) {
        const std::uint32_t off = (w >> (8 * lane)) & 0xFFFFu;  // col4 * 64 keeps the row's byte lane
        spread = (off & 0xFu) | ((off & 0xF0u) << 4) | ((off & 0xF00u) << 8) | ((off & 0xF000u) << 12);
      } else {
        const std::uint32_t at = lane + col4 / 8;
        const std::uint32_t bits = (w >> (8 * (at & 3u) + col4 % 8)) & 0xFu;
        spread = (bits & 1u) | ((bits & 2u) << 7) | ((bits & 4u) << 14) | ((bits & 8u) << 21);
      }
      return __vadd4(spread, base * 0x01010101u);
    } else {
      return w;
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
