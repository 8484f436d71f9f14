// Inline decoders declared in csfmoe/formats.hpp. Host and CUDA device code:
// only bit casts and exact arithmetic, no host-only library calls.
#pragma once

#include <cstdint>
#if !defined(__CUDA_ARCH__)
#include <cstring>
#endif

namespace csfmoe {
namespace detail {

CSFMOE_HD float bits_to_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

CSFMOE_HD std::uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

constexpr std::uint32_t kQuietNaNBits = 0x7FC00000u;

}  // namespace detail

CSFMOE_HD float e4m3fn_to_float(std::uint8_t code) {
  const std::uint32_t sign = std::uint32_t{code & 0x80u} << 24;
  const std::uint32_t exp = (code >> 3) & 0xFu;
  const std::uint32_t man = code & 0x7u;
  if (exp == 0xFu && man == 0x7u) return detail::bits_to_float(sign | detail::kQuietNaNBits);
  if (exp == 0u) {
    // Subnormal: man * 2^-9, exact in binary32 (2^-9 is a power of two).
    const float mag = static_cast<float>(man) * 0.001953125f;
    return sign ? -mag : mag;
  }
  // Normal: rebias 7 -> 127 and widen the 3-bit mantissa to 23 bits.
  return detail::bits_to_float(sign | ((exp + 120u) << 23) | (man << 20));
}

CSFMOE_HD float e8m0_to_float(std::uint8_t code) {
  if (code == 0xFFu) return detail::bits_to_float(detail::kQuietNaNBits);
  // 2^-127 is the binary32 subnormal with only mantissa bit 22 set.
  if (code == 0u) return detail::bits_to_float(0x00400000u);
  return detail::bits_to_float(std::uint32_t{code} << 23);
}

CSFMOE_HD float bf16_to_float(std::uint16_t bits) { return detail::bits_to_float(std::uint32_t{bits} << 16); }

}  // namespace csfmoe
