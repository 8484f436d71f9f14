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

// Byte index of (e, row, col) in a dense grid.
template <ScaleKind K>
__device__ __forceinline__ std::uint64_t dense_index(const ScaleSource& s, int e, std::uint32_t row,
                                                     std::uint32_t col) {
  const std::uint64_t in_expert =
      K == ScaleKind::dense_swizzled ? swizzled_index(row, col, s.cols) : std::uint64_t(row) * s.cols + col;
  return std::uint64_t(e) * s.expert_stride + in_expert;
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
__device__ __forceinline__ std::uint8_t csf_base(const std::uint8_t* slab, std::uint32_t row) {
  if constexpr (F == ScaleFormat::nvfp4)
    return slab[(row % 32) * 4 + (row % 128) / 32];
  else
    return slab[row % 16];
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

// Four consecutive scale bytes (col4 % 4 == 0) of (e, row), little-endian in
// one word: one aligned load for dense grids, two byte loads for CSF. CSF
// bytes are base + offset with per-byte wrap-around, as csf_fixed_scale.
template <ScaleFormat F, ScaleKind K>
__device__ __forceinline__ std::uint32_t scale_quad(const ScaleSource& s, int e, std::uint32_t row,
                                                    std::uint32_t col4) {
  if constexpr (K == ScaleKind::csf) {
    const std::uint8_t* slab = csf_slab<F>(s, e, row);
    const std::uint32_t base = csf_base<F>(slab, row);
    std::uint32_t spread;
    if constexpr (F == ScaleFormat::nvfp4) {
      const std::uint32_t n = nvfp4_offset_nibble(row, col4);  // nibbles n..n+3, n % 4 == 0
      const std::uint32_t off = slab[128 + n / 2] | (std::uint32_t(slab[128 + n / 2 + 1]) << 8);
      spread = (off & 0xFu) | ((off & 0xF0u) << 4) | ((off & 0xF00u) << 8) | ((off & 0xF000u) << 12);
    } else {
      const std::uint32_t bits = (slab[mxfp4_offset_byte(s, row, col4)] >> (col4 % 8)) & 0xFu;
      spread = (bits & 1u) | ((bits & 2u) << 7) | ((bits & 4u) << 14) | ((bits & 8u) << 21);
    }
    return __vadd4(spread, base * 0x01010101u);
  } else {
    return *reinterpret_cast<const std::uint32_t*>(s.dense + dense_index<K>(s, e, row, col4));
  }
}

}  // namespace csfmoe::moe_detail
