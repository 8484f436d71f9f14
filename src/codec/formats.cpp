// Encoders and names for the number formats of csfmoe/formats.hpp.
#include "csfmoe/formats.hpp"

#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>

#include "csfmoe/errors.hpp"

namespace csfmoe {

std::string_view to_string(ScaleFormat f) noexcept {
  switch (f) {
    case ScaleFormat::nvfp4:
      return "nvfp4";
    case ScaleFormat::mxfp4:
      return "mxfp4";
  }
  return "unknown";
}

std::string_view to_string(ScaleLayout l) noexcept {
  switch (l) {
    case ScaleLayout::row_major:
      return "row_major";
    case ScaleLayout::swizzled_128x4:
      return "swizzled_128x4";
  }
  return "unknown";
}

ScaleFormat parse_scale_format(std::string_view s) {
  if (s == "nvfp4") return ScaleFormat::nvfp4;
  if (s == "mxfp4") return ScaleFormat::mxfp4;
  throw InvalidArgument("scale format '" + std::string(s) + "' is not known (expected nvfp4 or mxfp4)");
}

ScaleLayout parse_scale_layout(std::string_view s) {
  if (s == "row_major") return ScaleLayout::row_major;
  if (s == "swizzled_128x4") return ScaleLayout::swizzled_128x4;
  throw InvalidArgument("scale layout '" + std::string(s) +
                        "' is not known (expected row_major or swizzled_128x4)");
}

std::uint8_t float_to_e2m1(float x) noexcept {
  if (std::isnan(x)) return 0x7;
  // IEEE sign: -0.0 and small negatives that round to zero give -0 (0x8).
  const std::uint8_t sign = std::signbit(x) ? 0x8 : 0x0;
  const float a = std::fabs(x);
  // Midpoints between neighbouring magnitudes {0,.5,1,1.5,2,3,4,6}; on a tie
  // the even code (even mantissa bit) wins, hence <= at ties that round down.
  std::uint8_t m;
  if (a <= 0.25f)
    m = 0;
  else if (a < 0.75f)
    m = 1;
  else if (a <= 1.25f)
    m = 2;
  else if (a < 1.75f)
    m = 3;
  else if (a <= 2.5f)
    m = 4;
  else if (a < 3.5f)
    m = 5;
  else if (a <= 5.0f)
    m = 6;
  else
    m = 7;
  return static_cast<std::uint8_t>(sign | m);
}

std::uint8_t float_to_e4m3fn(float x) noexcept {
  if (std::isnan(x)) return 0x7F;
  const std::uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const float a = std::fabs(x);
  // Saturate (infinities included): the largest finite E4M3 magnitude is 448.
  if (a >= 448.0f) return static_cast<std::uint8_t>(sign | 0x7E);
  std::uint32_t code;
  if (a < 0.015625f) {
    // Below 2^-6 the grid is uniform in steps of 2^-9; scaling by 2^9 is exact
    // and nearbyint rounds ties to even. A result of 8 is code 0x08 = 2^-6.
    code = static_cast<std::uint32_t>(std::nearbyint(a * 512.0f));
  } else {
    // Normal range: round the binary32 mantissa to 3 bits, ties to even; a
    // carry into the exponent is what rounding up across a binade means.
    const std::uint32_t u = detail::float_to_bits(a);
    const std::uint32_t r = (u + 0x7FFFFu + ((u >> 20) & 1u)) >> 20;
    code = r - (120u << 3);
    if (code > 0x7Eu) code = 0x7Eu;
  }
  return static_cast<std::uint8_t>(sign | code);
}

std::uint16_t float_to_bf16(float x) noexcept {
  const std::uint32_t u = detail::float_to_bits(x);
  // Keep sign and payload of a NaN; force the quiet bit so that truncating a
  // payload held only in the low half cannot turn it into infinity.
  if (std::isnan(x)) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  return static_cast<std::uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace csfmoe
