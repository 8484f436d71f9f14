// CPU reference MoE and layer planning.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "csfmoe/errors.hpp"
#include "csfmoe/moe.hpp"
#include "csfmoe/quantize.hpp"
#include "test_seed.hpp"

namespace csfmoe {
namespace {

MoeLayerGeometry small_geometry(std::uint32_t E = 6, std::uint32_t H = 64, std::uint32_t N = 64,
                                std::uint32_t k = 2) {
  return MoeLayerGeometry{E, H, N, k, GateUpOrder::w13};
}

std::vector<std::uint16_t> random_hidden(std::mt19937_64& rng, std::size_t n) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<std::uint16_t> h(n);
  for (auto& v : h) v = float_to_bf16(d(rng));
  return h;
}

struct Routing {
  std::vector<std::int64_t> ids;
  std::vector<float> weights;
};
Routing random_routing(std::mt19937_64& rng, std::uint32_t T, std::uint32_t k, std::uint32_t E) {
  Routing r;
  std::uniform_int_distribution<std::int64_t> id(0, E - 1);
  std::uniform_real_distribution<float> w(0.05f, 1.0f);
  for (std::uint64_t i = 0; i < std::uint64_t{T} * k; ++i) {
    r.ids.push_back(id(rng));
    r.weights.push_back(w(rng));
  }
  return r;
}

// Independent oracle: materialize every dequantized matrix with dequantize()
// and run the layer literally.
std::vector<double> naive_moe(const MoeHostWeights& w, const std::vector<std::uint16_t>& hidden,
                              std::uint32_t T, const Routing& r) {
  const auto& g = w.geometry;
  const std::size_t H = g.hidden, N = g.intermediate, G = group_size(w.format);
  std::vector<double> out(T * H, 0.0);
  for (std::uint32_t t = 0; t < T; ++t) {
    for (std::uint32_t j = 0; j < g.topk; ++j) {
      const std::size_t e = std::size_t(r.ids[t * g.topk + j]);
      QuantizedMatrix q13{w.format, 2 * N, H, {}, {}, w.w13_global[e]};
      q13.packed.assign(w.w13.begin() + e * 2 * N * H / 2, w.w13.begin() + (e + 1) * 2 * N * H / 2);
      q13.scales.assign(w.w13_scales.begin() + e * 2 * N * H / G,
                        w.w13_scales.begin() + (e + 1) * 2 * N * H / G);
      QuantizedMatrix q2{w.format, H, N, {}, {}, w.w2_global[e]};
      q2.packed.assign(w.w2.begin() + e * H * N / 2, w.w2.begin() + (e + 1) * H * N / 2);
      q2.scales.assign(w.w2_scales.begin() + e * H * N / G, w.w2_scales.begin() + (e + 1) * H * N / G);
      const std::vector<float> d13 = dequantize(q13), d2 = dequantize(q2);
      std::vector<double> act(N);
      const bool up_first = g.order == GateUpOrder::w31;
      for (std::size_t n = 0; n < N; ++n) {
        const std::size_t gr = up_first ? N + n : n, ur = up_first ? n : N + n;
        double gate = 0, up = 0;
        for (std::size_t h = 0; h < H; ++h) {
          const double x = bf16_to_float(hidden[t * H + h]);
          gate += x * d13[gr * H + h];
          up += x * d13[ur * H + h];
        }
        if (!w.w13_bias.empty()) {
          gate += w.w13_bias[e * 2 * N + gr];
          up += w.w13_bias[e * 2 * N + ur];
        }
        if (g.activation.kind == MoeActivation::gpt_oss) {
          // transformers' GptOssExperts, written out.
          const double lim = g.activation.limit;
          const double gc = std::min(gate, lim), uc = std::clamp(up, -lim, lim);
          act[n] = (uc + 1) * gc * (1 / (1 + std::exp(-g.activation.alpha * gc)));
        } else {
          act[n] = gate / (1 + std::exp(-gate)) * up;
        }
      }
      for (std::size_t h = 0; h < H; ++h) {
        double y = 0;
        for (std::size_t n = 0; n < N; ++n) y += d2[h * N + n] * act[n];
        if (!w.w2_bias.empty()) y += w.w2_bias[e * H + h];
        out[t * H + h] += double(r.weights[t * g.topk + j]) * y;
      }
    }
  }
  return out;
}

double rel(const std::vector<float>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / den);
}

TEST(MoePlan, AcceptsRealGeometries) {
  for (ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4}) {
    const MoeLayerGeometry g{256, 7168, 2048, 8, GateUpOrder::w13};
    MoeConstraints c;
    c.compression = ScaleCompression::csf;
    const MoePlan p = plan_weights(f, g, c);
    const unsigned G = group_size(f);
    EXPECT_EQ(p.w13_bytes, 256ull * 4096 * 3584);
    EXPECT_EQ(p.w2_bytes, 256ull * 7168 * 1024);
    EXPECT_EQ(p.w13_scale_bytes, 256ull * 4096 * (7168 / G));
    EXPECT_EQ(p.w2_scales.rows, 7168u);
    EXPECT_EQ(p.w2_scales.cols, 2048u / G);
  }
  MoeConstraints sw;
  sw.scale_layout = ScaleLayout::swizzled_128x4;
  // Qwen3-30B: 2N = 1536 rows, w2 has 768/16 = 48 columns: already aligned.
  const MoePlan p = plan_weights(ScaleFormat::nvfp4, {128, 2048, 768, 8, GateUpOrder::w31}, sw);
  EXPECT_EQ(p.w13_scales.layout, ScaleLayout::swizzled_128x4);
  EXPECT_EQ(p.w13_scale_bytes, 128ull * 1536 * 128);
}

void expect_rejected(ScaleFormat f, MoeLayerGeometry g, MoeConstraints c, const std::string& needle) {
  try {
    (void)plan_weights(f, g, c);
    ADD_FAILURE() << "accepted a plan that should fail on " << needle;
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(MoePlan, RejectsUnsupportedGeometryWithTheField) {
  const MoeLayerGeometry ok{8, 256, 128, 2, GateUpOrder::w13};
  const MoeConstraints c;
  auto g = ok;
  g.hidden = 96;
  expect_rejected(ScaleFormat::nvfp4, g, c, "geometry.hidden");
  g = ok;
  g.intermediate = 0;
  expect_rejected(ScaleFormat::nvfp4, g, c, "geometry.intermediate");
  g = ok;
  g.experts = 0;
  expect_rejected(ScaleFormat::nvfp4, g, c, "geometry.experts");
  g.experts = 5000;
  expect_rejected(ScaleFormat::nvfp4, g, c, "geometry.experts");
  g = ok;
  g.topk = 0;
  expect_rejected(ScaleFormat::mxfp4, g, c, "geometry.topk");
  g.topk = 65;
  expect_rejected(ScaleFormat::mxfp4, g, c, "geometry.topk");
  g = ok;
  g.order = static_cast<GateUpOrder>(7);
  expect_rejected(ScaleFormat::mxfp4, g, c, "geometry.order");
  auto cc = c;
  cc.max_tokens = 0;
  expect_rejected(ScaleFormat::nvfp4, ok, cc, "constraints.max_tokens");
  cc = c;
  cc.compression = static_cast<ScaleCompression>(9);
  expect_rejected(ScaleFormat::nvfp4, ok, cc, "constraints.compression");
  expect_rejected(static_cast<ScaleFormat>(4), ok, c, "source_format");
  // Too many positions per expert for 24-bit CSF records, only with csf.
  const MoeLayerGeometry huge{2, 65536, 8192, 2, GateUpOrder::w13};
  EXPECT_NO_THROW((void)plan_weights(ScaleFormat::nvfp4, huge, c));
  cc = c;
  cc.compression = ScaleCompression::csf;
  expect_rejected(ScaleFormat::nvfp4, huge, cc, "CSF scales");
}

TEST(MoePlan, ParsesNames) {
  EXPECT_EQ(parse_moe_scale_mode("stage_read"), MoeScaleMode::stage_read);
  EXPECT_EQ(parse_gate_up_order("w31"), GateUpOrder::w31);
  EXPECT_EQ(parse_scale_compression("csf"), ScaleCompression::csf);
  for (auto m :
       {MoeScaleMode::native, MoeScaleMode::expanded, MoeScaleMode::routed, MoeScaleMode::stage_read})
    EXPECT_EQ(parse_moe_scale_mode(to_string(m)), m);
  EXPECT_THROW(parse_moe_scale_mode("fast"), InvalidArgument);
  EXPECT_THROW(parse_gate_up_order("w12"), InvalidArgument);
}

TEST(MoeReference, MatchesNaiveDequantizedLayer) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4}) {
    const auto g = small_geometry(5, 64, 64, 3);
    const MoeHostWeights w = synthetic_moe_weights(f, g, seed);
    const std::uint32_t T = 7;
    const auto hidden = random_hidden(rng, T * g.hidden);
    const Routing r = random_routing(rng, T, g.topk, g.experts);
    std::vector<float> out(T * g.hidden);
    moe_reference(w, hidden, T, r.ids, r.weights, out);
    const auto want = naive_moe(w, hidden, T, r);
    EXPECT_LT(rel(out, want), 1e-6) << to_string(f);
    double norm = 0;
    for (float v : out) norm += double(v) * v;
    EXPECT_GT(norm, 0.0);
  }
}

TEST(MoeReference, Int32IdsThreadsAndFastWeightsAgree) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const auto g = small_geometry(9, 128, 64, 4);
  const MoeHostWeights w = synthetic_moe_weights(ScaleFormat::nvfp4, g, seed, /*fast=*/true);
  const std::uint32_t T = 33;
  const auto hidden = random_hidden(rng, T * g.hidden);
  const Routing r = random_routing(rng, T, g.topk, g.experts);
  std::vector<std::int32_t> ids32(r.ids.begin(), r.ids.end());
  std::vector<float> a(T * g.hidden), b(a.size());
  moe_reference(w, hidden, T, r.ids, r.weights, a, 1);
  moe_reference(w, hidden, T, ids32, r.weights, b, 0);
  EXPECT_EQ(a, b);  // bitwise: slots summed in order whatever the thread count
  EXPECT_LT(rel(a, naive_moe(w, hidden, T, r)), 1e-6);
}

TEST(MoeReference, GateUpOrderW31SwapsHalves) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const auto g = small_geometry(3, 64, 64, 2);
  MoeHostWeights w = synthetic_moe_weights(ScaleFormat::mxfp4, g, seed);
  const std::uint32_t T = 4;
  const auto hidden = random_hidden(rng, T * g.hidden);
  const Routing r = random_routing(rng, T, g.topk, g.experts);
  std::vector<float> a(T * g.hidden), b(a.size());
  moe_reference(w, hidden, T, r.ids, r.weights, a);
  // Same layer stored up-first.
  MoeHostWeights s = w;
  s.geometry.order = GateUpOrder::w31;
  const std::size_t N = g.intermediate, H = g.hidden, G = 32;
  for (std::size_t e = 0; e < g.experts; ++e) {
    for (std::size_t n = 0; n < N; ++n) {
      for (std::size_t i = 0; i < H / 2; ++i)
        std::swap(s.w13[(e * 2 * N + n) * H / 2 + i], s.w13[(e * 2 * N + N + n) * H / 2 + i]);
      for (std::size_t i = 0; i < H / G; ++i)
        std::swap(s.w13_scales[(e * 2 * N + n) * H / G + i], s.w13_scales[(e * 2 * N + N + n) * H / G + i]);
    }
  }
  moe_reference(s, hidden, T, r.ids, r.weights, b);
  EXPECT_EQ(a, b);
}

TEST(MoeReference, DuplicateIdsAreSeparateSlots) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  auto g = small_geometry(4, 64, 64, 2);
  const MoeHostWeights w2 = synthetic_moe_weights(ScaleFormat::nvfp4, g, seed);
  MoeHostWeights w1 = w2;
  w1.geometry.topk = 1;
  const std::uint32_t T = 5;
  const auto hidden = random_hidden(rng, T * g.hidden);
  std::vector<std::int64_t> dup, single;
  std::vector<float> wdup, wsingle;
  for (std::uint32_t t = 0; t < T; ++t) {
    const std::int64_t e = std::int64_t(rng() % g.experts);
    const float a = 0.25f + float(rng() % 8) / 16, b = 0.125f + float(rng() % 8) / 32;
    dup.insert(dup.end(), {e, e});
    wdup.insert(wdup.end(), {a, b});
    single.push_back(e);
    wsingle.push_back(a + b);  // exact in float: dyadic with few bits
  }
  std::vector<float> x(T * g.hidden), y(x.size());
  moe_reference(w2, hidden, T, dup, wdup, x);
  moe_reference(w1, hidden, T, single, wsingle, y);
  for (std::size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(x[i], y[i], 1e-6 * (1 + std::abs(y[i]))) << i;
}

TEST(MoeReference, RejectsBadIdsAndSizes) {
  CSFMOE_SEEDED(seed);
  const auto g = small_geometry(4, 64, 64, 2);
  const MoeHostWeights w = synthetic_moe_weights(ScaleFormat::nvfp4, g, seed, true);
  std::vector<std::uint16_t> hidden(2 * 64, float_to_bf16(0.5f));
  std::vector<float> weights(4, 1.0f), out(2 * 64);
  std::vector<std::int64_t> ids = {0, 1, 2, 4};
  try {
    moe_reference(w, hidden, 2, ids, weights, out);
    ADD_FAILURE() << "accepted id 4 of 4 experts";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("topk_ids[1, 1] = 4"), std::string::npos) << e.what();
  }
  ids = {0, 1, -1, 2};
  EXPECT_THROW(moe_reference(w, hidden, 2, ids, weights, out), InvalidArgument);
  ids = {0, 1, 2};
  EXPECT_THROW(moe_reference(w, hidden, 2, ids, weights, out), InvalidArgument);
  ids = {0, 1, 2, 3};
  std::vector<float> short_out(64);
  EXPECT_THROW(moe_reference(w, hidden, 2, ids, weights, short_out), InvalidArgument);
  MoeHostWeights bad = w;
  bad.w2_scales.pop_back();
  try {
    validate(bad);
    ADD_FAILURE();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("w2_scales"), std::string::npos) << e.what();
  }
}

TEST(MoeReference, RelayoutSwizzledPlacesEveryByte) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const GridShape s{ScaleFormat::nvfp4, ScaleLayout::row_major, 2, 130, 6};
  std::vector<std::uint8_t> src(2 * 130 * 6);
  for (auto& b : src) b = std::uint8_t(rng());
  const auto sw = relayout_scales(s, src, ScaleLayout::swizzled_128x4);
  ASSERT_EQ(sw.size(), 2u * 256 * 8);
  for (std::size_t e = 0; e < 2; ++e)
    for (std::size_t r = 0; r < 130; ++r)
      for (std::size_t c = 0; c < 6; ++c)
        ASSERT_EQ(sw[e * 256 * 8 + swizzled_index(r, c, 8)], src[(e * 130 + r) * 6 + c]);
  EXPECT_EQ(relayout_scales(s, src, ScaleLayout::row_major), src);
}

TEST(MoeReference, RelativeError) {
  std::vector<float> ref = {3, 4}, a = {3, 4}, b = {3, 5};
  EXPECT_EQ(relative_error(a, ref), 0.0);
  EXPECT_NEAR(relative_error(b, ref), 0.2, 1e-12);
  b[0] = std::nanf("");
  EXPECT_TRUE(std::isnan(relative_error(b, ref)));
}

// gpt-oss's layer: clamped SwiGLU with biases, against the literal layer.
// Large inputs (x 8) push many gate and up values past
// the clamp, both ways; both orders, both formats, with and without biases.
TEST(MoeReference, GptOssActivationWithBiasesMatchesNaiveLayer) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4})
    for (GateUpOrder order : {GateUpOrder::w13, GateUpOrder::w31})
      for (bool biases : {false, true}) {
        SCOPED_TRACE(std::string(to_string(f)) + " " + std::string(to_string(order)) +
                     (biases ? " biases" : ""));
        auto g = small_geometry(5, 64, 64, 3);
        g.order = order;
        g.activation = MoeActivationSpec::gpt_oss();
        MoeHostWeights w = synthetic_moe_weights(f, g, seed);
        if (biases) {
          std::normal_distribution<float> d(0.0f, 4.0f);
          w.w13_bias.resize(std::size_t{g.experts} * 2 * g.intermediate);
          w.w2_bias.resize(std::size_t{g.experts} * g.hidden);
          for (float& v : w.w13_bias) v = d(rng);
          for (float& v : w.w2_bias) v = d(rng);
        }
        const std::uint32_t T = 9;
        auto hidden = random_hidden(rng, T * g.hidden);
        for (auto& v : hidden) v = float_to_bf16(bf16_to_float(v) * 8.0f);  // exact: a power of two
        const Routing r = random_routing(rng, T, g.topk, g.experts);
        std::vector<float> out(T * g.hidden);
        moe_reference(w, hidden, T, r.ids, r.weights, out);
        EXPECT_LT(rel(out, naive_moe(w, hidden, T, r)), 1e-6);
        // The activation matters: the SiLU layer on the same weights differs.
        MoeHostWeights silu = w;
        silu.geometry.activation = MoeActivationSpec::silu();
        silu.w13_bias.clear();
        silu.w2_bias.clear();
        std::vector<float> other(out.size());
        moe_reference(silu, hidden, T, r.ids, r.weights, other);
        EXPECT_GT(rel(other, naive_moe(w, hidden, T, r)), 1e-3);
      }
}

TEST(MoeReference, BiasesAndActivationAreChecked) {
  auto g = small_geometry();
  MoeHostWeights w = synthetic_moe_weights(ScaleFormat::nvfp4, g, 1, /*fast=*/true);
  w.w13_bias.assign(std::size_t{g.experts} * 2 * g.intermediate, 0.0f);
  EXPECT_THROW(validate(w), InvalidArgument);  // biases with SiLU
  w.geometry.activation = MoeActivationSpec::gpt_oss();
  EXPECT_NO_THROW(validate(w));
  w.w13_bias.pop_back();
  EXPECT_THROW(validate(w), InvalidArgument);
  w.w13_bias.clear();
  w.w2_bias.assign(std::size_t{g.experts} * g.hidden + 1, 0.0f);
  EXPECT_THROW(validate(w), InvalidArgument);
  w.w2_bias.pop_back();
  EXPECT_NO_THROW(validate(w));
  for (double bad : {0.0, -1.0, std::nan(""), double(INFINITY)}) {
    w.geometry.activation = MoeActivationSpec::gpt_oss(bad, 7.0);
    EXPECT_THROW(validate(w), InvalidArgument) << bad;
    EXPECT_THROW((void)plan_weights(ScaleFormat::nvfp4, w.geometry, {}), InvalidArgument) << bad;
    w.geometry.activation = MoeActivationSpec::gpt_oss(1.702, bad);
    EXPECT_THROW(validate(w), InvalidArgument) << bad;
    EXPECT_THROW((void)plan_weights(ScaleFormat::nvfp4, w.geometry, {}), InvalidArgument) << bad;
  }
  w.geometry.activation.kind = static_cast<MoeActivation>(7);
  EXPECT_THROW((void)plan_weights(ScaleFormat::nvfp4, w.geometry, {}), InvalidArgument);
  w.geometry.activation = MoeActivationSpec::gpt_oss();
  EXPECT_NO_THROW((void)plan_weights(ScaleFormat::nvfp4, w.geometry, {}));
  EXPECT_EQ(parse_moe_activation("silu"), MoeActivation::silu);
  EXPECT_EQ(parse_moe_activation("gpt_oss"), MoeActivation::gpt_oss);
  EXPECT_THROW((void)parse_moe_activation("swiglu"), InvalidArgument);
  EXPECT_EQ(to_string(MoeActivation::gpt_oss), "gpt_oss");
}

}  // namespace
}  // namespace csfmoe
