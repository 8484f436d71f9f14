// Number formats: every code of E2M1 / E4M3fn / E8M0 / BF16 against an
// independent decoder written here, and the encoders against a brute-force
// nearest-value search (ties to the even code) on midpoints and random floats.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <vector>

#include "csfmoe/errors.hpp"
#include "csfmoe/formats.hpp"
#include "test_seed.hpp"

namespace csfmoe {
namespace {

std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float float_of(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Reference decoders from the format definitions (sign, exponent, mantissa).
double ref_minifloat(unsigned code, int ebits, int mbits, int bias) {
  const unsigned m = code & ((1u << mbits) - 1);
  const unsigned e = (code >> mbits) & ((1u << ebits) - 1);
  const double s = (code >> (ebits + mbits)) & 1u ? -1.0 : 1.0;
  if (e == 0) return s * std::ldexp(double(m), 1 - bias - mbits);
  return s * std::ldexp(1.0 + double(m) / double(1u << mbits), int(e) - bias);
}

// Brute force: the non-NaN code of `codes` nearest to x among the positive
// half, ties to the code with even low bit; sign from signbit(x).
std::uint8_t ref_nearest(double x, const std::vector<double>& mags, std::uint8_t sign_bit) {
  const double a = std::fabs(x);
  std::size_t best = 0;
  for (std::size_t c = 1; c < mags.size(); ++c) {
    const double d = std::fabs(mags[c] - a), db = std::fabs(mags[best] - a);
    if (d < db || (d == db && (c & 1) == 0)) best = c;
  }
  return static_cast<std::uint8_t>((std::signbit(x) ? sign_bit : 0) | best);
}

std::vector<double> e2m1_mags() {
  std::vector<double> m;
  for (unsigned c = 0; c < 8; ++c) m.push_back(ref_minifloat(c, 2, 1, 1));
  return m;
}
std::vector<double> e4m3_mags() {  // codes 0x00..0x7E (0x7F is NaN)
  std::vector<double> m;
  for (unsigned c = 0; c < 0x7F; ++c) m.push_back(ref_minifloat(c, 4, 3, 7));
  return m;
}

// A float drawn to cover many binades, signs and exact grid points.
float random_float(std::mt19937_64& rng, int emin, int emax) {
  std::uniform_int_distribution<int> e(emin, emax);
  std::uniform_real_distribution<double> m(1.0, 2.0);
  const double v = std::ldexp(m(rng), e(rng));
  return float(rng() & 1 ? -v : v);
}

TEST(E2M1, EveryCodeDecodesToItsDefinitionAndReencodes) {
  for (unsigned c = 0; c < 16; ++c) {
    const float v = e2m1_to_float(std::uint8_t(c));
    EXPECT_EQ(double(v), ref_minifloat(c, 2, 1, 1)) << "code " << c;
    EXPECT_EQ(std::signbit(v), c >= 8) << "code " << c;
    EXPECT_EQ(float_to_e2m1(v), c) << "code " << c;
  }
  for (unsigned c = 1; c < 8; ++c)
    EXPECT_LT(e2m1_to_float(std::uint8_t(c - 1)), e2m1_to_float(std::uint8_t(c)));
}

TEST(E2M1, MidpointsRoundToEvenAndSaturate) {
  const struct {
    float x;
    float want;
  } cases[] = {{0.25f, 0.0f},      {0.75f, 1.0f},  {1.25f, 1.0f}, {1.75f, 2.0f}, {2.5f, 2.0f},
               {3.5f, 4.0f},       {5.0f, 4.0f},   {6.0f, 6.0f},  {7.0f, 6.0f},  {1e30f, 6.0f},
               {0.2500001f, 0.5f}, {4.999f, 4.0f}, {5.001f, 6.0f}};
  for (const auto& t : cases) {
    EXPECT_EQ(e2m1_to_float(float_to_e2m1(t.x)), t.want) << "x = " << t.x;
    EXPECT_EQ(e2m1_to_float(float_to_e2m1(-t.x)), -t.want) << "x = " << -t.x;
  }
  EXPECT_EQ(float_to_e2m1(std::numeric_limits<float>::infinity()), 0x7);
  EXPECT_EQ(float_to_e2m1(-std::numeric_limits<float>::infinity()), 0xF);
  EXPECT_EQ(float_to_e2m1(std::numeric_limits<float>::quiet_NaN()), 0x7);
  EXPECT_EQ(float_to_e2m1(-0.1f), 0x8);  // rounds to zero, keeps the sign
}

TEST(E2M1, RandomAndGridFloatsMatchBruteForce) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const auto mags = e2m1_mags();
  std::vector<float> xs;
  for (std::size_t i = 0; i + 1 < mags.size(); ++i) {
    const float mid = float((mags[i] + mags[i + 1]) / 2);
    xs.insert(xs.end(), {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 10.0f), float(mags[i])});
  }
  for (int i = 0; i < 200000; ++i) xs.push_back(random_float(rng, -6, 4));
  for (float x : xs) {
    ASSERT_EQ(float_to_e2m1(x), ref_nearest(x, mags, 0x8)) << "x = " << x;
    ASSERT_EQ(float_to_e2m1(-x), ref_nearest(-x, mags, 0x8)) << "x = " << -x;
  }
}

TEST(E4M3fn, EveryCodeDecodesToItsDefinition) {
  for (unsigned c = 0; c < 256; ++c) {
    const float v = e4m3fn_to_float(std::uint8_t(c));
    if ((c & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(v)) << "code " << c;
      continue;
    }
    EXPECT_EQ(double(v), ref_minifloat(c, 4, 3, 7)) << "code " << c;
    EXPECT_EQ(std::signbit(v), c >= 0x80) << "code " << c;
    EXPECT_EQ(float_to_e4m3fn(v), c) << "re-encode of code " << c;
  }
  EXPECT_EQ(e4m3fn_to_float(0x7E), 448.0f);
  EXPECT_EQ(e4m3fn_to_float(0xFE), -448.0f);
  EXPECT_EQ(e4m3fn_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3fn_to_float(0x07), 7.0f * std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3fn_to_float(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(e4m3fn_to_float(0x38), 1.0f);
  for (unsigned c = 1; c < 0x7F; ++c) {
    EXPECT_LT(e4m3fn_to_float(std::uint8_t(c - 1)), e4m3fn_to_float(std::uint8_t(c))) << "code " << c;
    EXPECT_GT(e4m3fn_to_float(std::uint8_t(0x80 | (c - 1))), e4m3fn_to_float(std::uint8_t(0x80 | c)));
  }
}

TEST(E4M3fn, SpecialsSaturateAndUnderflow) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(float_to_e4m3fn(std::numeric_limits<float>::quiet_NaN()), 0x7F);
  EXPECT_EQ(float_to_e4m3fn(inf), 0x7E);
  EXPECT_EQ(float_to_e4m3fn(-inf), 0xFE);
  EXPECT_EQ(float_to_e4m3fn(449.0f), 0x7E);
  EXPECT_EQ(float_to_e4m3fn(470.0f), 0x7E);  // would round to the NaN slot without saturation
  EXPECT_EQ(float_to_e4m3fn(-1e30f), 0xFE);
  EXPECT_EQ(float_to_e4m3fn(std::numeric_limits<float>::max()), 0x7E);
  EXPECT_EQ(float_to_e4m3fn(std::ldexp(1.0f, -10)), 0x00);  // tie between 0 and 2^-9: even
  EXPECT_EQ(float_to_e4m3fn(std::nextafter(std::ldexp(1.0f, -10), 1.0f)), 0x01);
  EXPECT_EQ(float_to_e4m3fn(3.0f * std::ldexp(1.0f, -10)), 0x02);  // 1.5 steps: tie, even
  EXPECT_EQ(float_to_e4m3fn(std::numeric_limits<float>::denorm_min()), 0x00);
  EXPECT_EQ(float_to_e4m3fn(-std::numeric_limits<float>::denorm_min()), 0x80);
  EXPECT_EQ(float_to_e4m3fn(15.5f * std::ldexp(1.0f, -10)), 0x08);  // rounds up into the normals
}

TEST(E4M3fn, RandomAndGridFloatsMatchBruteForce) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const auto mags = e4m3_mags();
  std::vector<float> xs;
  for (std::size_t i = 0; i + 1 < mags.size(); ++i) {
    const float mid = float((mags[i] + mags[i + 1]) / 2);  // exact in binary32
    xs.insert(xs.end(), {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1000.0f), float(mags[i])});
  }
  for (int i = 0; i < 300000; ++i) xs.push_back(random_float(rng, -14, 9));
  for (float x : xs) {
    const double a = std::fabs(double(x));
    // Saturation: beyond 448 the nearest finite value is 448 anyway.
    ASSERT_EQ(float_to_e4m3fn(x), ref_nearest(a > 448 ? std::copysign(448.0, x) : x, mags, 0x80))
        << "x = " << x;
  }
}

TEST(E8M0, EveryCode) {
  for (unsigned c = 0; c < 256; ++c) {
    const float v = e8m0_to_float(std::uint8_t(c));
    if (c == 0xFF) {
      EXPECT_TRUE(std::isnan(v));
      continue;
    }
    EXPECT_EQ(double(v), std::ldexp(1.0, int(c) - 127)) << "code " << c;
    if (c > 0) EXPECT_EQ(double(v), 2.0 * e8m0_to_float(std::uint8_t(c - 1))) << "code " << c;
  }
  EXPECT_EQ(e8m0_to_float(127), 1.0f);
  EXPECT_EQ(e8m0_to_float(0), std::ldexp(1.0f, -127));  // binary32 subnormal
}

TEST(BF16, EveryCodeDecodesAndReencodes) {
  std::size_t nans = 0;
  for (std::uint32_t c = 0; c < 65536; ++c) {
    const float v = bf16_to_float(std::uint16_t(c));
    ASSERT_EQ(bits_of(v), c << 16) << "code " << c;
    const std::uint16_t back = float_to_bf16(v);
    if (std::isnan(v)) {
      ++nans;
      ASSERT_TRUE(std::isnan(bf16_to_float(back))) << "code " << c;
      ASSERT_EQ(back & 0x8000u, c & 0x8000u) << "NaN sign of code " << c;
    } else {
      ASSERT_EQ(back, c) << "code " << c;
    }
  }
  EXPECT_EQ(nans, 2u * 127u);
  for (std::uint32_t c = 1; c < 0x7F80; ++c)
    ASSERT_LT(bf16_to_float(std::uint16_t(c - 1)), bf16_to_float(std::uint16_t(c)));
}

TEST(BF16, RoundingMatchesBruteForce) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  auto ref = [](float x) -> std::uint16_t {
    const std::uint32_t u = bits_of(x);
    const std::uint16_t lo = std::uint16_t(u >> 16), hi = std::uint16_t(lo + 1);
    // Distances in double; the code past the largest finite one is infinity,
    // which counts as 2^128 for rounding (IEEE overflow rule).
    auto val = [](std::uint16_t c) {
      return (c & 0x7FFF) == 0x7F80 ? std::copysign(std::ldexp(1.0, 128), bf16_to_float(c))
                                    : double(bf16_to_float(c));
    };
    const double dl = std::fabs(double(x) - val(lo)), dh = std::fabs(double(x) - val(hi));
    if (dl < dh) return lo;
    if (dh < dl) return hi;
    return (lo & 1) ? hi : lo;
  };
  std::vector<float> xs = {std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                           std::numeric_limits<float>::denorm_min(), 1.0f, -0.0f};
  for (int i = 0; i < 200000; ++i) xs.push_back(float_of(std::uint32_t(rng())));
  for (int i = 0; i < 20000; ++i) {  // exact ties: low half 0x8000
    std::uint32_t u = (std::uint32_t(rng()) & 0xFFFF0000u) | 0x8000u;
    xs.push_back(float_of(u));
  }
  for (float x : xs) {
    if (std::isnan(x) || std::isinf(x)) continue;
    ASSERT_EQ(float_to_bf16(x), ref(x)) << "x bits " << std::hex << bits_of(x);
  }
  // NaN payloads in the low half only must stay NaN, not become infinity.
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(float_of(0x7F800001u)))));
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(float_of(0xFF800001u)))));
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::infinity()), 0x7F80);
}

TEST(Names, RoundTripAndReject) {
  for (ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4})
    EXPECT_EQ(parse_scale_format(to_string(f)), f);
  for (ScaleLayout l : {ScaleLayout::row_major, ScaleLayout::swizzled_128x4})
    EXPECT_EQ(parse_scale_layout(to_string(l)), l);
  EXPECT_EQ(to_string(ScaleFormat::nvfp4), "nvfp4");
  EXPECT_EQ(to_string(ScaleLayout::swizzled_128x4), "swizzled_128x4");
  for (const char* bad : {"", "NVFP4", "nvfp8", "mxfp4 ", "row-major"}) {
    EXPECT_THROW(parse_scale_format(bad), InvalidArgument) << bad;
    EXPECT_THROW(parse_scale_layout(bad), InvalidArgument) << bad;
  }
  try {
    parse_scale_format("fp6");
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("fp6"), std::string::npos);
    EXPECT_EQ(e.kind(), ErrorKind::invalid_argument);
  }
}

TEST(Swizzle, IsABijectionOverPaddedTiles) {
  for (std::size_t cols : {4u, 8u, 112u}) {
    const std::size_t rows = 256;
    std::set<std::size_t> seen;
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t c = 0; c < cols; ++c) {
        const std::size_t i = swizzled_index(r, c, cols);
        ASSERT_LT(i, rows * cols);
        ASSERT_TRUE(seen.insert(i).second) << r << "," << c;
      }
  }
  EXPECT_EQ(swizzled_index(33, 5, 8), 512u + 1 * 16 + 1 * 4 + 1);
}

}  // namespace
}  // namespace csfmoe
