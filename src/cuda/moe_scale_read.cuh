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

// Scale byte (e, row, col) from a dense grid.
template <ScaleKind K>
__device__ __forceinline__ std::uint8_t dense_scale(const ScaleSource& s, int e, std::uint32_t row,
                                                    std::uint32_t col) {
  const std::uint8_t* g = s.dense + std::uint64_t(e) * s.expert_stride;
  if constexpr (K == ScaleKind::dense_swizzled)
    return g[swizzled_index(row, col, s.cols)];
  else
    return g[std::uint64_t(row) * s.cols + col];
}

// Base + offset of (e, row, col) from the CSF fixed part; exception slots
// hold offset 0 and are patched afterwards from the records.
template <ScaleFormat F>
__device__ __forceinline__ std::uint8_t csf_fixed_scale(const ScaleSource& s, int e, std::uint32_t row,
                                                        std::uint32_t col) {
  const std::uint8_t* slab =
      s.fixed + std::uint64_t(e) * s.fixed_per_expert + std::uint64_t(row / csf_slab_rows(F)) * s.slab_bytes;
  if constexpr (F == ScaleFormat::nvfp4) {
    const std::uint8_t base = slab[(row % 32) * 4 + (row % 128) / 32];
    const std::uint32_t n = (col / 4) * 512 + (row % 32) * 16 + ((row % 128) / 32) * 4 + (col % 4);
    return std::uint8_t(base + ((slab[128 + n / 2] >> ((n & 1) * 4)) & 0xF));
  } else {
    const std::uint8_t base = slab[row % 16];
    const std::uint32_t mask_bytes = (s.padded_cols + 7) / 8;
    return std::uint8_t(base + ((slab[16 + (row % 16) * mask_bytes + col / 8] >> (col % 8)) & 1));
  }
}

// Four consecutive scale bytes (col4 % 4 == 0) of (e, row), little-endian in
// one word: one aligned load for dense grids, two byte loads for CSF. CSF
// bytes are base + offset with per-byte wrap-around, as csf_fixed_scale.
template <ScaleFormat F, ScaleKind K>
__device__ __forceinline__ std::uint32_t scale_quad(const ScaleSource& s, int e, std::uint32_t row,
                                                    std::uint32_t col4) {
  if constexpr (K == ScaleKind::csf) {
    const std::uint8_t* slab = s.fixed + std::uint64_t(e) * s.fixed_per_expert +
                               std::uint64_t(row / csf_slab_rows(F)) * s.slab_bytes;
    std::uint32_t base, spread;
    if constexpr (F == ScaleFormat::nvfp4) {
      base = slab[(row % 32) * 4 + (row % 128) / 32];
      const std::uint32_t n = (col4 / 4) * 512 + (row % 32) * 16 + ((row % 128) / 32) * 4;  // nibbles n..n+3
      const std::uint32_t off = slab[128 + n / 2] | (std::uint32_t(slab[128 + n / 2 + 1]) << 8);
      spread = (off & 0xFu) | ((off & 0xF0u) << 4) | ((off & 0xF00u) << 8) | ((off & 0xF000u) << 12);
    } else {
      base = slab[row % 16];
      const std::uint32_t mask_bytes = (s.padded_cols + 7) / 8;
      const std::uint32_t bits = (slab[16 + (row % 16) * mask_bytes + col4 / 8] >> (col4 % 8)) & 0xFu;
      spread = (bits & 1u) | ((bits & 2u) << 7) | ((bits & 4u) << 14) | ((bits & 8u) << 21);
    }
    return __vadd4(spread, base * 0x01010101u);
  } else {
    const std::uint8_t* g = s.dense + std::uint64_t(e) * s.expert_stride;
    if constexpr (K == ScaleKind::dense_swizzled)
      return *reinterpret_cast<const std::uint32_t*>(g + swizzled_index(row, col4, s.cols));
    else
      return *reinterpret_cast<const std::uint32_t*>(g + std::uint64_t(row) * s.cols + col4);
  }
}

}  // namespace csfmoe::moe_detail
