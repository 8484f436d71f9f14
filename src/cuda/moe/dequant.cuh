// Bit-level conversions of the decode kernel (src/cuda/moe/decode_kernel.cuh), and
// the K order the prefill kernel (src/cuda/moe/prefill_kernel.cuh) shares with it.
//
// Plain integer code, host and device, so that the CPU tests can check every
// input exhaustively (tests/cpu/test_decode_bits.cpp) against the format
// decoders of csfmoe/formats.hpp.
#pragma once

#include <cstdint>

#include "csfmoe/formats.hpp"

namespace csfmoe::moe_detail::decode_bits {

// __byte_perm selectors that gather a lane's scale bytes from its four rows'
// aligned dense words (row c's word holds the lane's bytes from byte pos[c]):
//   NVFP4 u[j] = (row 2j col 0, row 2j col 1, row 2j+1 col 0, row 2j+1 col 1)
//     from words 2j, 2j + 1 by sel[j];
//   MXFP4 u[0] = (row 0, row 1, row 2, row 3): sel[0] picks rows 0, 1 from
//     words 0, 1, sel[1] rows 2, 3 from words 2, 3, and 0x5410 joins them.
template <bool Nvfp4>
CSFMOE_HD void dense_scale_selectors(const std::uint32_t (&pos)[4], std::uint32_t (&sel)[2]) {
  if constexpr (Nvfp4) {
    for (int j = 0; j < 2; ++j) {
      const std::uint32_t p0 = pos[2 * j], p1 = pos[2 * j + 1] + 4;
      sel[j] = p0 | (p0 + 1) << 4 | p1 << 8 | (p1 + 1) << 12;
    }
  } else {
    sel[0] = pos[0] | (pos[1] + 4) << 4;
    sel[1] = pos[2] | (pos[3] + 4) << 4;
  }
}

// bf16 pair (value * 2^-126) of the E2M1 nibbles J and J + 4 of q (low half:
// nibble J). Placing the 3 magnitude bits at bf16 bits 8..6 gives the value
// times 2^-126 exactly (E2M1's subnormal 0.5 lands on bf16's subnormal range),
// and the sign goes to bit 15. The nibble, masked alone in each 16-bit half,
// is multiplied by 2^(6-4j) + 2^(12-4j): one integer multiply makes two
// copies, one with the magnitude at bits 8..6 and one with the sign at bit 15,
// in disjoint bit ranges (6..9 and 12..15 of each half, so no carries), and
// one mask keeps those four bits. Three instructions per pair, one of them on
// the FMA pipe, where the plain shift-and-mask form needs four. Nibbles 2 and
// 3 of each half are first moved down to 0 and 1 (one shift for two pairs).
template <int J>
CSFMOE_HD std::uint32_t e2m1_pair(std::uint32_t q) {
  static_assert(J >= 0 && J < 4);
  constexpr int kLow = J & 1;  // nibble position within the shifted half
  const std::uint32_t src = J < 2 ? q : q >> 8;
  const std::uint32_t x = src & (0x000F000Fu << (4 * kLow));
  constexpr std::uint32_t kCopies = (1u << (6 - 4 * kLow)) + (1u << (12 - 4 * kLow));
  return (x * kCopies) & 0x81C081C0u;
}

// Fixed factor folded into NVFP4 scales: 2^118 * 2^-126 (the nibbles) = 2^-8,
// undone in the kernel's epilogue. MXFP4 scales (2^-127..2^127) do not fold.
constexpr float kNvfp4ScaleFold = 0x1p118f;

// Exact bf16 bits of a block-scale byte times the fixed factor; NaN codes
// give 0x7FFF (as __float2bfloat16_rn does). Every such value has at most 3
// significant bits, so the top half of the float's bits is the bf16.
template <ScaleFormat F>
CSFMOE_HD std::uint16_t scale_bf16(std::uint8_t b) {
  const float v = F == ScaleFormat::nvfp4 ? e4m3fn_to_float(b) * kNvfp4ScaleFold : e8m0_to_float(b);
  const std::uint32_t u = detail::float_to_bits(v);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;
  return std::uint16_t(u >> 16);
}

// True when a word of four scale bytes holds a byte that the packed path
// below does not convert: NVFP4 subnormals (exponent 0), NaN (x111'1111) and
// negative scales (sign set: the packed path has no sign bit), MXFP4 0x00
// (2^-127, a bf16 subnormal) and 0xFF (NaN). Byte-parallel tests:
// haszero(x) = (x - 0x01..) & ~x & 0x80.. is exact as a predicate.
template <ScaleFormat F>
CSFMOE_HD bool scale_word_special(std::uint32_t v) {
  const auto has_zero_byte = [](std::uint32_t x) { return ((x - 0x01010101u) & ~x & 0x80808080u) != 0; };
  if constexpr (F == ScaleFormat::nvfp4) {
    // Bytes <= 0x7F once the sign is known clear: +1 sets bit 7 only for 0x7F.
    return has_zero_byte(v & 0x78787878u) || ((v | ((v & 0x7F7F7F7Fu) + 0x01010101u)) & 0x80808080u) != 0;
  } else {
    return has_zero_byte(v) || has_zero_byte(~v);
  }
}

// bf16 pair (s, s): scale_bf16 of byte B of v in both halves, exact when
// !scale_word_special(v). A byte permute isolates the byte b, then one
// integer multiply(-add), on the FMA pipe, writes it into both halves: NVFP4
// (sign clear, exponent e 1..15, mantissa m) as b * 16 + 0x7700 (m at bf16
// mantissa bits 4..6, e at exponent bits 7..10, + 238 on the exponent: the
// rebias 127 - 7 plus the fold 118; no carry reaches the other half), MXFP4
// as b << 7 (the E8M0 byte is the bf16 exponent).
template <ScaleFormat F, int B>
CSFMOE_HD std::uint32_t scale_splat_bf16(std::uint32_t v) {
  static_assert(B >= 0 && B < 4);
#if defined(__CUDA_ARCH__)
  const std::uint32_t b = __byte_perm(v, 0u, 0x4440 | B);
#else
  const std::uint32_t b = (v >> (8 * B)) & 0xFFu;
#endif
  if constexpr (F == ScaleFormat::nvfp4)
    return b * 0x00100010u + 0x77007700u;
  else
    return b * 0x00800080u;
}

// MXFP4 scale pairs with the nibbles' 2^126 folded in: byte b as the bf16
// 2^(b - 1) = 2^126 * 2^(b - 127), so that one multiply per pair gives the
// exact value (the products are normal bf16 numbers). Exact for bytes up to
// 0x80 (2^127, the largest bf16 power of two); a word holding a byte above
// (scales >= 2^2, or the NaN code) takes the unfolded path. One integer
// multiply-add after the byte permute, as scale_splat_bf16.
CSFMOE_HD constexpr bool mxfp4_word_unfoldable(std::uint32_t v) {
  // Per byte: bit 7 set and a low bit set (low 7 bits + 0x7F carries into bit 7).
  return (((v & 0x7F7F7F7Fu) + 0x7F7F7F7Fu) & v & 0x80808080u) != 0;
}
template <int B>
CSFMOE_HD std::uint32_t mxfp4_folded_splat_bf16(std::uint32_t v) {
  static_assert(B >= 0 && B < 4);
#if defined(__CUDA_ARCH__)
  const std::uint32_t b = __byte_perm(v, 0u, 0x4440 | B);
#else
  const std::uint32_t b = (v >> (8 * B)) & 0xFFu;
#endif
  return b * 0x00800080u + 0x3F003F00u;
}

// The prefill kernel's K permutation (src/cuda/moe/prefill_kernel.cuh), the decode
// kernel's lane order written out, within a 128-wide K block: the
// activations are stored permuted so that shared memory can be filled with
// plain 16-byte copies. Logical position l (the
// order of the k16 steps: step l / 16, position l % 16 of the MMA's K) holds
// physical K prefill_k_source(l); prefill_k_slot is its inverse. Lane t of a
// quad covers physical K 32t..32t+31; step s = 2w + h takes the nibbles
// j = 2h and 2h + 1 of its word w, i.e. E2M1 pairs (8w + j, 8w + j + 4).
CSFMOE_HD constexpr std::uint32_t prefill_k_source(std::uint32_t l) {
  const std::uint32_t s = l >> 4, q = (l >> 3) & 1, t = (l >> 1) & 3, e = l & 1;
  return 32 * t + 8 * (s >> 1) + 2 * (s & 1) + q + 4 * e;
}
CSFMOE_HD constexpr std::uint32_t prefill_k_slot(std::uint32_t p) {
  const std::uint32_t t = p >> 5, w = (p >> 3) & 3, h = (p >> 1) & 1, q = p & 1, e = (p >> 2) & 1;
  return 16 * (2 * w + h) + 8 * q + 2 * t + e;
}
// Column of the permuted copy of a row that holds column k of the original.
CSFMOE_HD constexpr std::uint32_t prefill_permuted_column(std::uint32_t k) {
  return (k & ~std::uint32_t(128 - 1)) | prefill_k_slot(k & (128 - 1));
}

}  // namespace csfmoe::moe_detail::decode_bits
