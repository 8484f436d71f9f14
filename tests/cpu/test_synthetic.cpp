// Synthetic scale grids: geometry lookup and shapes, and the byte statistics
// of each distribution measured with a reference of the CSF base rule
// written here (histogram per row; smallest base with the largest count).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "csfmoe/errors.hpp"
#include "csfmoe/synthetic.hpp"
#include "test_seed.hpp"

namespace csfmoe {
namespace {

struct CsfCount {
  std::uint64_t values = 0, exceptions = 0, rows = 0;
  double rate() const { return double(exceptions) / double(values); }
  // Bases + offsets + 4-byte exception records over source bytes (the per-row
  // prefix and partition index are left out: they depend on the container).
  double ratio(ScaleFormat f, std::uint32_t cols) const {
    const double offsets = f == ScaleFormat::nvfp4 ? double(cols) / 2 : std::ceil(double(cols) / 8);
    return (double(rows) * (1 + offsets) + 4.0 * double(exceptions)) / double(values);
  }
};

// Reference CSF rule on a row-major [E, R, C] tensor.
CsfCount csf_count(const std::vector<std::uint8_t>& v, const GridShape& s) {
  const unsigned w = csf_window(s.format);
  CsfCount out;
  for (std::size_t row = 0; row < std::size_t{s.experts} * s.rows; ++row) {
    unsigned hist[256] = {};
    for (std::uint32_t c = 0; c < s.cols; ++c) ++hist[v[row * s.cols + c]];
    unsigned best = 0;
    for (unsigned b = 0; b + w - 1 <= 255; ++b) {
      unsigned n = 0;
      for (unsigned k = 0; k < w; ++k) n += hist[b + k];
      best = std::max(best, n);
    }
    out.exceptions += s.cols - best;
    out.values += s.cols;
    ++out.rows;
  }
  return out;
}

GridShape with_experts(GridShape s, std::uint32_t e) {
  s.experts = e;
  return s;
}

TEST(Geometry, LookupAndShapes) {
  for (const MoeGeometry* g : {&kDeepSeekV3, &kKimiK2, &kQwen3_30B_A3B, &kQwen3_235B_A22B}) {
    const MoeGeometry& found = moe_geometry(g->name);
    EXPECT_EQ(&found, g);
    for (ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4}) {
      const GridShape w13 = w13_scale_shape(*g, f);
      const GridShape w2 = w2_scale_shape(*g, f);
      EXPECT_EQ(w13, (GridShape{f, ScaleLayout::row_major, g->experts, 2 * g->intermediate,
                                g->hidden / group_size(f)}));
      EXPECT_EQ(
          w2, (GridShape{f, ScaleLayout::row_major, g->experts, g->hidden, g->intermediate / group_size(f)}));
    }
  }
  EXPECT_EQ(w13_scale_shape(kDeepSeekV3, ScaleFormat::nvfp4).cols, 448u);
  EXPECT_EQ(w2_scale_shape(kQwen3_30B_A3B, ScaleFormat::mxfp4).cols, 24u);
  try {
    moe_geometry("llama");
    FAIL();
  } catch (const InvalidArgument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("llama"), std::string::npos);
    EXPECT_NE(m.find("deepseek-v3"), std::string::npos);
    EXPECT_NE(m.find("qwen3-235b-a22b"), std::string::npos);
  }
}

TEST(Geometry, SwizzledShapesArePadded) {
  const MoeGeometry odd{"odd", 1008, 200, 3, 2};  // H/16 = 63, 2N = 400, N/16 = 12.5
  const GridShape w13 = w13_scale_shape(odd, ScaleFormat::nvfp4, ScaleLayout::swizzled_128x4);
  EXPECT_EQ(w13, (GridShape{ScaleFormat::nvfp4, ScaleLayout::swizzled_128x4, 3, 512, 64}));
  EXPECT_EQ(w13_scale_shape(odd, ScaleFormat::nvfp4).rows, 400u);
  EXPECT_EQ(w13_scale_shape(odd, ScaleFormat::nvfp4).cols, 63u);
  EXPECT_THROW(w2_scale_shape(odd, ScaleFormat::nvfp4), InvalidArgument);  // N not a multiple of 16
  const MoeGeometry odd2{"odd2", 1024, 208, 1, 1};
  EXPECT_EQ(w2_scale_shape(odd2, ScaleFormat::nvfp4, ScaleLayout::swizzled_128x4),
            (GridShape{ScaleFormat::nvfp4, ScaleLayout::swizzled_128x4, 1, 1024, 16}));  // 13 -> 16
  EXPECT_EQ(w13_scale_shape(kDeepSeekV3, ScaleFormat::nvfp4, ScaleLayout::swizzled_128x4),
            with_experts(GridShape{ScaleFormat::nvfp4, ScaleLayout::swizzled_128x4, 0, 4096, 448}, 256));
}

TEST(Synthetic, RejectsBadShapes) {
  EXPECT_THROW(synthetic_scales({ScaleFormat::nvfp4, ScaleLayout::row_major, 0, 4, 4},
                                ScaleDistribution::realistic, 1),
               InvalidArgument);
  EXPECT_THROW(
      synthetic_scales({ScaleFormat::nvfp4, ScaleLayout::row_major, 1, 4, 0}, ScaleDistribution::constant, 1),
      InvalidArgument);
  EXPECT_THROW(synthetic_scales({ScaleFormat::nvfp4, ScaleLayout::swizzled_128x4, 1, 100, 4},
                                ScaleDistribution::realistic, 1),
               InvalidArgument);
  EXPECT_THROW(synthetic_scales({ScaleFormat::mxfp4, ScaleLayout::swizzled_128x4, 1, 128, 6},
                                ScaleDistribution::realistic, 1),
               InvalidArgument);
  EXPECT_THROW(synthetic_expert_matrix(ScaleFormat::nvfp4, 4, 40, 1), InvalidArgument);
  EXPECT_THROW(synthetic_expert_matrix(ScaleFormat::mxfp4, 0, 64, 1), InvalidArgument);
}

// Realistic grids on every geometry (2 experts each to stay fast).
TEST(Synthetic, RealisticMatchesRealCheckpointStatistics) {
  CSFMOE_SEEDED(seed);
  for (const MoeGeometry* g : {&kDeepSeekV3, &kQwen3_30B_A3B, &kQwen3_235B_A22B}) {
    for (ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4}) {
      for (int which = 0; which < 2; ++which) {
        const GridShape s = with_experts(which ? w2_scale_shape(*g, f) : w13_scale_shape(*g, f), 2);
        const auto v = synthetic_scales(s, ScaleDistribution::realistic, seed);
        ASSERT_EQ(v.size(), std::size_t{s.experts} * s.rows * s.cols);
        const CsfCount n = csf_count(v, s);
        const double ratio = n.ratio(f, s.cols);
        std::printf("realistic %-16s %s %s: exceptions %.3f%%, bases+offsets+records %.1f%% of bytes\n",
                    std::string(g->name).c_str(), std::string(to_string(f)).c_str(), which ? "w2 " : "w13",
                    100 * n.rate(), 100 * ratio);
        SCOPED_TRACE(std::string(g->name) + " " + std::string(to_string(f)) + (which ? " w2" : " w13"));
        if (f == ScaleFormat::nvfp4) {
          EXPECT_GE(n.rate(), 0.0003);
          EXPECT_LE(n.rate(), 0.015);
          EXPECT_GE(ratio, 0.50);
          EXPECT_LE(ratio, 0.56);
          // Positive finite E4M3 only: no sign bit, no NaN pattern.
          for (auto b : v) ASSERT_LT(b, 0x7F);
          EXPECT_EQ(*std::max_element(v.begin(), v.end()), 0x7E);  // the tensor amax block
        } else {
          EXPECT_GE(n.rate(), 0.0003);
          EXPECT_LE(n.rate(), 0.025);
          EXPECT_GE(ratio, 0.12);
          EXPECT_LE(ratio, 0.23);
          for (auto b : v) ASSERT_NE(b, 0xFF);
        }
        // Rows do not all share one base: row magnitudes vary.
        std::set<unsigned> modes;
        for (std::uint32_t r = 0; r < s.rows; r += 16) {
          unsigned hist[256] = {};
          for (std::uint32_t c = 0; c < s.cols; ++c) ++hist[v[std::size_t{r} * s.cols + c]];
          modes.insert(unsigned(std::max_element(hist, hist + 256) - hist));
        }
        // E8M0 steps are whole octaves, so MXFP4 rows share fewer modes.
        EXPECT_GE(modes.size(), f == ScaleFormat::nvfp4 ? 5u : 2u);
      }
    }
  }
}

TEST(Synthetic, DispersedSitsNearTheNvfp4BreakEven) {
  CSFMOE_SEEDED(seed);
  for (const GridShape& base : {w13_scale_shape(kDeepSeekV3, ScaleFormat::nvfp4),
                                w2_scale_shape(kQwen3_235B_A22B, ScaleFormat::nvfp4),
                                w13_scale_shape(kDeepSeekV3, ScaleFormat::mxfp4)}) {
    const GridShape s = with_experts(base, 2);
    const CsfCount d = csf_count(synthetic_scales(s, ScaleDistribution::dispersed, seed), s);
    const CsfCount r = csf_count(synthetic_scales(s, ScaleDistribution::realistic, seed), s);
    std::printf("dispersed %s %u x %u: exceptions %.2f%%\n", std::string(to_string(s.format)).c_str(), s.rows,
                s.cols, 100 * d.rate());
    if (s.format == ScaleFormat::nvfp4) {
      EXPECT_GE(d.rate(), 0.08);
      EXPECT_LE(d.rate(), 0.17);
    }
    EXPECT_GT(d.rate(), 5 * r.rate());
  }
}

TEST(Synthetic, DeterministicPerSeedAndDistinctAcrossSeeds) {
  CSFMOE_SEEDED(seed);
  const GridShape s{ScaleFormat::nvfp4, ScaleLayout::row_major, 3, 256, 28};
  for (auto d :
       {ScaleDistribution::realistic, ScaleDistribution::dispersed, ScaleDistribution::uniform_random,
        ScaleDistribution::extremes, ScaleDistribution::constant}) {
    const auto a = synthetic_scales(s, d, seed);
    EXPECT_EQ(a, synthetic_scales(s, d, seed)) << int(d);
    const auto b = synthetic_scales(s, d, seed + 1);
    if (d == ScaleDistribution::constant) {
      // One byte per seed: over 16 seeds at least two different bytes.
      std::set<std::uint8_t> bytes;
      for (std::uint64_t k = 0; k < 16; ++k) bytes.insert(synthetic_scales(s, d, seed + k)[0]);
      EXPECT_GE(bytes.size(), 2u);
      continue;
    }
    EXPECT_NE(a, b) << int(d);
    // Experts differ from each other too.
    const std::size_t per = std::size_t{s.rows} * s.cols;
    EXPECT_FALSE(std::equal(a.begin(), a.begin() + per, a.begin() + per)) << int(d);
  }
}

TEST(Synthetic, SwizzledIsTheSameGridPermuted) {
  CSFMOE_SEEDED(seed);
  for (auto d : {ScaleDistribution::realistic, ScaleDistribution::extremes}) {
    const GridShape rm{ScaleFormat::nvfp4, ScaleLayout::row_major, 2, 256, 12};
    GridShape sw = rm;
    sw.layout = ScaleLayout::swizzled_128x4;
    const auto a = synthetic_scales(rm, d, seed);
    const auto b = synthetic_scales(sw, d, seed);
    ASSERT_EQ(a.size(), b.size());
    const std::size_t per = std::size_t{rm.rows} * rm.cols;
    for (std::uint32_t e = 0; e < rm.experts; ++e)
      for (std::uint32_t r = 0; r < rm.rows; ++r)
        for (std::uint32_t c = 0; c < rm.cols; ++c)
          ASSERT_EQ(b[e * per + swizzled_index(r, c, rm.cols)], a[e * per + std::size_t{r} * rm.cols + c]);
  }
}

TEST(Synthetic, UniformConstantExtremesAreWhatTheySay) {
  CSFMOE_SEEDED(seed);
  for (ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4}) {
    const GridShape s{f, ScaleLayout::row_major, 2, 512, 64};
    const std::size_t n = std::size_t{s.experts} * s.rows * s.cols;

    const auto u = synthetic_scales(s, ScaleDistribution::uniform_random, seed);
    std::vector<double> hist(256);
    for (auto b : u) ++hist[b];
    double chi2 = 0;
    for (double h : hist) chi2 += (h - n / 256.0) * (h - n / 256.0) / (n / 256.0);
    EXPECT_LT(chi2, 400.0);                                                    // 255 dof: mean 255, sd ~22.6
    EXPECT_GT(csf_count(u, s).rate(), f == ScaleFormat::nvfp4 ? 0.80 : 0.90);  // expected ~0.86 / ~0.94

    const auto c = synthetic_scales(s, ScaleDistribution::constant, seed);
    ASSERT_EQ(c.size(), n);
    EXPECT_TRUE(std::all_of(c.begin(), c.end(), [&](std::uint8_t b) { return b == c[0]; }));
    EXPECT_EQ(csf_count(c, s).exceptions, 0u);

    const auto x = synthetic_scales(s, ScaleDistribution::extremes, seed);
    const std::set<std::uint8_t> special = {0x00, 0x01, 0x7E, 0x7F, 0x80, 0xFE, 0xFF};
    std::uint8_t lo = 0xFF, hi = 0;
    std::size_t n_special = 0;
    std::set<std::uint8_t> seen_special;
    for (auto b : x) {
      if (special.count(b)) {
        ++n_special;
        seen_special.insert(b);
      } else {
        lo = std::min(lo, b);
        hi = std::max(hi, b);
      }
    }
    EXPECT_EQ(seen_special, special);
    EXPECT_LT(hi - lo, int(csf_window(f))) << "band is one window wide";
    EXPECT_NEAR(double(n_special) / double(n), 0.25, 0.02);
  }
}

TEST(Synthetic, GeneratorIsFast) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "throughput is not meaningful under sanitizers";
#endif
  CSFMOE_SEEDED(seed);
  // 8 DeepSeek-V3 experts: 14.7 MB of NVFP4 w13 scales.
  const GridShape s = with_experts(w13_scale_shape(kDeepSeekV3, ScaleFormat::nvfp4), 8);
  synthetic_scales(with_experts(s, 1), ScaleDistribution::realistic, seed);  // builds the model table
  const auto t0 = std::chrono::steady_clock::now();
  const auto v = synthetic_scales(s, ScaleDistribution::realistic, seed);
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double mbs = double(v.size()) / dt / 1e6;
  std::printf("realistic NVFP4 generator: %.0f MB/s (single thread)\n", mbs);
  RecordProperty("generator_MBps", std::to_string(mbs));
  EXPECT_GT(mbs, 20.0);  // loose: CI cores are shared; typical is > 200
}

TEST(Synthetic, ExpertMatrixFollowsTheSameModel) {
  CSFMOE_SEEDED(seed);
  for (ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4}) {
    const std::size_t rows = 256, cols = 2048;
    const QuantizedMatrix q = synthetic_expert_matrix(f, rows, cols, seed);
    EXPECT_EQ(q.format, f);
    ASSERT_EQ(q.rows, rows);
    ASSERT_EQ(q.cols, cols);
    ASSERT_EQ(q.scales.size(), rows * cols / group_size(f));
    EXPECT_EQ(synthetic_expert_matrix(f, rows, cols, seed).packed, q.packed);
    EXPECT_NE(synthetic_expert_matrix(f, rows, cols, seed + 1).scales, q.scales);
    const GridShape s{f, ScaleLayout::row_major, 1, std::uint32_t(rows), std::uint32_t(cols / group_size(f))};
    const CsfCount n = csf_count(q.scales, s);
    std::printf("expert matrix %s: scale exceptions %.3f%%\n", std::string(to_string(f)).c_str(),
                100 * n.rate());
    EXPECT_LE(n.rate(), 0.03);
    for (float v : dequantize(q)) ASSERT_TRUE(std::isfinite(v));
  }
}

}  // namespace
}  // namespace csfmoe
