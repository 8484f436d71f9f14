// NVFP4 (ModelOpt) and MXFP4 (OCP MX) quantizers: shape and value checks,
// scale bytes against the recipes recomputed here with brute-force rounding,
// round-trip error bounds, zero blocks and blocks dominated by one value.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "csfmoe/errors.hpp"
#include "csfmoe/quantize.hpp"
#include "test_seed.hpp"

namespace csfmoe {
namespace {

// --- independent reference of both recipes --------------------------------
// Nearest value in a sorted list of non-negative magnitudes, ties to the
// even index (= even mantissa bit for these formats).
unsigned nearest_index(double a, const std::vector<double>& mags) {
  unsigned best = 0;
  for (unsigned c = 1; c < mags.size(); ++c) {
    const double d = std::fabs(mags[c] - a), db = std::fabs(mags[best] - a);
    if (d < db || (d == db && c % 2 == 0)) best = c;
  }
  return best;
}
const std::vector<double>& e2m1_mags() {
  static const std::vector<double> m = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  return m;
}
const std::vector<double>& e4m3_mags() {
  static const std::vector<double> m = [] {
    std::vector<double> v;
    for (int c = 0; c < 0x7F; ++c) {
      const int e = c >> 3, man = c & 7;
      v.push_back(e == 0 ? std::ldexp(man, -9) : std::ldexp(1.0 + man / 8.0, e - 7));
    }
    return v;
  }();
  return m;
}
// ModelOpt packs the sign bit for quotients < 0; NaN (0 / 0) packs as +6.
unsigned ref_e2m1(float q) {
  if (std::isnan(q)) return 7;
  const unsigned m = nearest_index(std::min(std::fabs(double(q)), 6.0), e2m1_mags());
  return (q < 0 ? 8u : 0u) | m;
}
unsigned nibble(const QuantizedMatrix& q, std::size_t i) {
  return i % 2 == 0 ? (q.packed[i / 2] & 0xFu) : (q.packed[i / 2] >> 4);
}

struct RefNv {
  float global;
  std::vector<std::uint8_t> scales;
  std::vector<unsigned> codes;
};
RefNv ref_nvfp4(const std::vector<float>& x, std::size_t rows, std::size_t cols, float override_global = 0) {
  RefNv r;
  float amax = 0;
  for (float v : x) amax = std::max(amax, std::fabs(v));
  r.global = override_global > 0 ? override_global : amax == 0 ? 1.0f : amax / 2688.0f;
  for (std::size_t i = 0; i < rows; ++i)
    for (std::size_t b = 0; b < cols / 16; ++b) {
      float bmax = 0;
      for (int k = 0; k < 16; ++k) bmax = std::max(bmax, std::fabs(x[i * cols + b * 16 + k]));
      const float per_block = bmax / 6.0f;
      const float s = std::min(per_block == 0 ? 1.0f : per_block / r.global, 448.0f);
      const auto code = std::uint8_t(nearest_index(s, e4m3_mags()));
      r.scales.push_back(code);
      const float eff = float(e4m3_mags()[code]) * r.global;
      for (int k = 0; k < 16; ++k) r.codes.push_back(ref_e2m1(x[i * cols + b * 16 + k] / eff));
    }
  return r;
}
struct RefMx {
  std::vector<std::uint8_t> scales;
  std::vector<unsigned> codes;
};
RefMx ref_mxfp4(const std::vector<float>& x, std::size_t rows, std::size_t cols) {
  RefMx r;
  for (std::size_t i = 0; i < rows; ++i)
    for (std::size_t b = 0; b < cols / 32; ++b) {
      float bmax = 0;
      for (int k = 0; k < 32; ++k) bmax = std::max(bmax, std::fabs(x[i * cols + b * 32 + k]));
      int e = -127;
      if (bmax > 0) {
        int fe;
        std::frexp(bmax, &fe);  // bmax = m * 2^fe, m in [0.5, 1): floor(log2) = fe - 1
        e = std::clamp(fe - 1 - 2, -127, 127);
      }
      r.scales.push_back(std::uint8_t(e + 127));
      for (int k = 0; k < 32; ++k)
        r.codes.push_back(ref_e2m1(float(double(x[i * cols + b * 32 + k]) * std::ldexp(1.0, -e))));
    }
  return r;
}

// Heavy-tailed test weights with row-to-row magnitude changes.
std::vector<float> random_weights(std::mt19937_64& rng, std::size_t rows, std::size_t cols) {
  std::normal_distribution<double> n(0, 1);
  std::student_t_distribution<double> t(3);
  std::vector<float> x(rows * cols);
  for (std::size_t r = 0; r < rows; ++r) {
    const double mag = std::exp2(std::uniform_real_distribution<double>(-20, 10)(rng));
    for (std::size_t c = 0; c < cols; ++c) x[r * cols + c] = float(mag * (rng() % 8 == 0 ? t(rng) : n(rng)));
  }
  return x;
}

// Half an E2M1 step at the quotient's magnitude (steps 0.5, 1, 2).
double half_step(double y) { return y < 2 ? 0.25 : y < 4 ? 0.5 : 1.0; }

// --- shape and value validation ---------------------------------------------
TEST(Quantize, RejectsBadShapesAndValues) {
  std::vector<float> x(64, 1.0f);
  EXPECT_THROW(quantize_nvfp4(x, 2, 30), InvalidArgument);  // size mismatch
  EXPECT_THROW(quantize_nvfp4(x, 8, 8), InvalidArgument);   // cols % 16
  EXPECT_THROW(quantize_mxfp4(x, 4, 16), InvalidArgument);  // cols % 32
  EXPECT_THROW(quantize_mxfp4(x, 1, 32), InvalidArgument);  // size mismatch
  EXPECT_THROW(quantize_nvfp4({}, 0, 16), InvalidArgument);
  EXPECT_NO_THROW(quantize_nvfp4(x, 4, 16));
  EXPECT_NO_THROW(quantize_mxfp4(x, 2, 32));
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    auto y = x;
    y[37] = bad;
    try {
      quantize_nvfp4(y, 2, 32);
      FAIL() << "accepted " << bad;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("row 1, col 5"), std::string::npos) << e.what();
    }
    EXPECT_THROW(quantize_mxfp4(y, 2, 32), InvalidArgument);
  }
  for (float bad : {-1.0f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()})
    EXPECT_THROW(quantize_nvfp4(x, 4, 16, bad), InvalidArgument) << bad;
}

TEST(Quantize, DequantizeRejectsInconsistentMatrices) {
  std::vector<float> x(64, 0.5f);
  const QuantizedMatrix good = quantize_nvfp4(x, 2, 32);
  auto q = good;
  q.packed.pop_back();
  EXPECT_THROW(dequantize(q), InvalidArgument);
  q = good;
  q.scales.push_back(0);
  EXPECT_THROW(dequantize_element(q, 0, 0), InvalidArgument);
  q = good;
  q.cols = 48;
  EXPECT_THROW(dequantize(q), InvalidArgument);
  EXPECT_THROW(dequantize_element(good, 2, 0), InvalidArgument);
  EXPECT_THROW(dequantize_element(good, 0, 32), InvalidArgument);
  auto mx = quantize_mxfp4(x, 2, 32);
  mx.global_scale = 2.0f;
  EXPECT_THROW(dequantize(mx), InvalidArgument);
}

// --- recipes ---------------------------------------------------------------
TEST(Quantize, Nvfp4MatchesModelOptRecipe) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const std::size_t rows = 37, cols = 96;
  const auto x = random_weights(rng, rows, cols);
  const auto q = quantize_nvfp4(x, rows, cols);
  const auto ref = ref_nvfp4(x, rows, cols);
  EXPECT_EQ(q.format, ScaleFormat::nvfp4);
  ASSERT_EQ(q.rows, rows);
  ASSERT_EQ(q.cols, cols);
  ASSERT_EQ(q.packed.size(), rows * cols / 2);
  EXPECT_EQ(q.global_scale, ref.global);
  ASSERT_EQ(q.scales, ref.scales);
  for (std::size_t i = 0; i < rows * cols; ++i) ASSERT_EQ(nibble(q, i), ref.codes[i]) << "element " << i;
  // The largest block scale is the top of the FP8 range by construction.
  EXPECT_EQ(*std::max_element(q.scales.begin(), q.scales.end()), 0x7E);
}

TEST(Quantize, Nvfp4GlobalOverrideAndClamp) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const auto x = random_weights(rng, 8, 64);
  float amax = 0;
  for (float v : x) amax = std::max(amax, std::fabs(v));
  // A global 16x too small pushes big blocks past 448: they must clamp.
  for (float g : {amax / 2688.0f / 16.0f, amax / 2688.0f * 3.0f}) {
    const auto q = quantize_nvfp4(x, 8, 64, g);
    const auto ref = ref_nvfp4(x, 8, 64, g);
    EXPECT_EQ(q.global_scale, g);
    ASSERT_EQ(q.scales, ref.scales);
    for (std::size_t i = 0; i < x.size(); ++i) ASSERT_EQ(nibble(q, i), ref.codes[i]) << "element " << i;
  }
}

TEST(Quantize, Mxfp4MatchesOcpRecipe) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const std::size_t rows = 29, cols = 128;
  auto x = random_weights(rng, rows, cols);
  // Adversarial magnitudes: exact powers of two, subnormals, the float limit.
  for (int k = 0; k < 32; ++k) x[k] = std::ldexp(1.0f, 3 - k);
  for (int k = 32; k < 64; ++k) x[k] = std::numeric_limits<float>::denorm_min() * float(k);
  x[64] = std::numeric_limits<float>::max();
  x[100] = -std::numeric_limits<float>::max();
  const auto q = quantize_mxfp4(x, rows, cols);
  const auto ref = ref_mxfp4(x, rows, cols);
  EXPECT_EQ(q.format, ScaleFormat::mxfp4);
  EXPECT_EQ(q.global_scale, 1.0f);
  ASSERT_EQ(q.scales, ref.scales);
  for (std::size_t i = 0; i < rows * cols; ++i) ASSERT_EQ(nibble(q, i), ref.codes[i]) << "element " << i;
  EXPECT_EQ(q.scales[0], 127 + 3 - 2);  // amax 8
  EXPECT_EQ(q.scales[1], 0);            // subnormal block clamps to 2^-127
  EXPECT_EQ(q.scales[2], 127 + 127 - 2);
}

// --- round trip -------------------------------------------------------------
TEST(Quantize, RoundTripErrorWithinHalfAStep) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4}) {
    const std::size_t rows = 64, cols = 256, g = group_size(f);
    const auto x = random_weights(rng, rows, cols);
    const auto q = f == ScaleFormat::nvfp4 ? quantize_nvfp4(x, rows, cols) : quantize_mxfp4(x, rows, cols);
    const auto y = dequantize(q);
    ASSERT_EQ(y.size(), x.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
      const std::size_t r = i / cols, c = i % cols;
      ASSERT_EQ(y[i], dequantize_element(q, r, c));
      const std::uint8_t s = q.scales[r * (cols / g) + c / g];
      const double scale =
          f == ScaleFormat::nvfp4 ? double(e4m3fn_to_float(s)) * q.global_scale : double(e8m0_to_float(s));
      const double err = std::fabs(double(x[i]) - double(y[i]));
      if (scale == 0) {  // NVFP4 block whose scale underflowed FP8: all zero
        ASSERT_EQ(y[i], 0.0f);
        continue;
      }
      const double yq = std::fabs(double(x[i])) / scale;
      // Quotients above 6 saturate: MXFP4 clips (6, 8) by the OCP recipe;
      // NVFP4 only past 6 * (1 + 1/16) when the FP8 scale is subnormal.
      double bound = half_step(yq) * scale;
      if (yq > 6) bound = std::max(bound, (yq - 6) * scale);
      if (f == ScaleFormat::nvfp4 && yq > 6.375 * (1 + 1e-6)) ASSERT_LT(s, 0x08) << "element " << i;
      ASSERT_LE(err, bound * (1 + 1e-6))
          << to_string(f) << " element " << i << " x " << x[i] << " y " << y[i];
      // The product e2m1 * scale (* global) is exact in double; dequantize
      // must give it rounded once to float.
      ASSERT_EQ(float(double(e2m1_to_float(std::uint8_t(nibble(q, i)))) * scale), y[i])
          << "dequantize is not the correctly rounded product, element " << i;
    }
  }
}

// --- zero and dominated blocks ----------------------------------------------
TEST(Quantize, ZeroBlocksAndZeroTensors) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  std::vector<float> zeros(4 * 64, 0.0f);
  const auto nz = quantize_nvfp4(zeros, 4, 64);
  EXPECT_EQ(nz.global_scale, 1.0f);
  // ModelOpt replaces a zero block scale by 1.0 before the FP8 cast.
  for (auto s : nz.scales) EXPECT_EQ(s, 0x38);
  for (auto p : nz.packed) EXPECT_EQ(p, 0);
  for (float v : dequantize(nz)) EXPECT_EQ(v, 0.0f);
  const auto mz = quantize_mxfp4(zeros, 4, 64);
  for (auto s : mz.scales) EXPECT_EQ(s, 0x00);
  for (auto p : mz.packed) EXPECT_EQ(p, 0);

  // One zero block (with -0.0 inside) amid random data.
  auto x = random_weights(rng, 4, 64);
  for (int k = 0; k < 32; ++k) x[64 + 32 + k] = k % 2 ? -0.0f : 0.0f;
  const auto q = quantize_nvfp4(x, 4, 64);
  EXPECT_EQ(q.scales[1 * 4 + 2], 0x38);
  EXPECT_EQ(q.scales[1 * 4 + 3], 0x38);
  for (int k = 0; k < 32; ++k) EXPECT_EQ(nibble(q, 64 + 32 + k), 0u) << k;
  EXPECT_EQ(q.scales, ref_nvfp4(x, 4, 64).scales);
  const auto m = quantize_mxfp4(x, 4, 64);
  EXPECT_EQ(m.scales[1 * 2 + 1], 0x00);
  EXPECT_EQ(m.scales, ref_mxfp4(x, 4, 64).scales);
}

TEST(Quantize, BlockWithOneHugeValue) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0, 1);
  std::vector<float> x(2 * 64);
  for (float& v : x) v = n(rng);
  const float huge = 1.0e4f * (1 + float(rng() % 1000) / 1000);
  x[64 + 17] = -huge;
  const auto q = quantize_nvfp4(x, 2, 64);
  EXPECT_EQ(q.global_scale, huge / 2688.0f);
  EXPECT_EQ(q.scales[4 + 1], 0x7E);     // the huge value's block: scale 448
  EXPECT_EQ(nibble(q, 64 + 17), 0xFu);  // -6
  EXPECT_NEAR(dequantize_element(q, 1, 17), -huge, huge * 1e-6);
  const auto ref = ref_nvfp4(x, 2, 64);
  EXPECT_EQ(q.scales, ref.scales);
  // Gaussian neighbours are tiny next to 1e4 * 448/2688: they vanish.
  for (int k = 16; k < 32; ++k)
    if (k != 17) EXPECT_EQ(nibble(q, 64 + k) & 7u, 0u) << k;

  const auto m = quantize_mxfp4(x, 2, 64);
  int fe;
  std::frexp(huge, &fe);
  EXPECT_EQ(m.scales[2], std::uint8_t(fe - 1 - 2 + 127));
  EXPECT_EQ(m.scales, ref_mxfp4(x, 2, 64).scales);
  const double y = huge / std::ldexp(1.0, fe - 3);  // in [4, 8)
  EXPECT_EQ(double(dequantize_element(m, 1, 17)),
            -e2m1_mags()[nearest_index(std::min(y, 6.0), e2m1_mags())] * std::ldexp(1.0, fe - 3));
}

TEST(Quantize, PackingPutsEvenElementInLowNibble) {
  std::vector<float> x(32, 0.0f);
  x[0] = 6.0f;  // sets the scale
  x[1] = -3.0f;
  x[2] = 1.0f;
  const auto q = quantize_mxfp4(x, 1, 32);  // amax 6: exponent 0, quotients unchanged
  EXPECT_EQ(q.scales[0], 127);
  EXPECT_EQ(q.packed[0], 0xD7);  // low: +6 (0x7), high: -3 (0xD)
  EXPECT_EQ(q.packed[1], 0x02);
}

}  // namespace
}  // namespace csfmoe
