// Tensor- and expert-parallel slicing: the per-rank layers sum to the whole
// layer, slicing is byte-exact, and bad arguments are refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "csfmoe/errors.hpp"
#include "csfmoe/parallel.hpp"
#include "test_seed.hpp"

namespace csfmoe {
namespace {

// Independent float64 oracle (dequantize everything, then plain sums), so
// that the sums over ranks can be compared far below float rounding; the
// library's moe_reference rounds its output to float.
std::vector<double> dequant(ScaleFormat f, const std::uint8_t* w, const std::uint8_t* s, double global,
                            std::uint64_t rows, std::uint64_t k) {
  const unsigned G = group_size(f);
  std::vector<double> m(rows * k);
  for (std::uint64_t r = 0; r < rows; ++r)
    for (std::uint64_t c = 0; c < k; ++c) {
      const std::uint8_t b = w[r * (k / 2) + c / 2];
      const double v = e2m1_to_float(static_cast<std::uint8_t>(c % 2 ? b >> 4 : b & 0xF));
      const std::uint8_t sb = s[r * (k / G) + c / G];
      const double sc = f == ScaleFormat::nvfp4 ? e4m3fn_to_float(sb) : e8m0_to_float(sb);
      m[r * k + c] = v * sc * global;
    }
  return m;
}

// out[t] += w * (W2 act(gate + b13, up + b13) + b2) for the slots with
// keep(slot) true, act SiLU(gate) * up or gpt-oss's clamped SwiGLU (written
// out here, not taken from activation.hpp), biases where `w` has them; ids are
// local to `w`.
std::vector<double> oracle(const MoeHostWeights& w, const std::vector<std::uint16_t>& hidden, std::uint32_t T,
                           const std::vector<std::int32_t>& ids, const std::vector<float>& wts,
                           const std::vector<bool>& keep) {
  const auto& g = w.geometry;
  const std::uint64_t H = g.hidden, N = g.intermediate, k = g.topk;
  const unsigned G = group_size(w.format);
  std::vector<double> out(T * H, 0.0);
  for (std::uint32_t t = 0; t < T; ++t)
    for (std::uint64_t j = 0; j < k; ++j) {
      if (!keep[t * k + j]) continue;
      const std::uint64_t e = std::uint64_t(ids[t * k + j]);
      const auto a = dequant(w.format, w.w13.data() + e * 2 * N * H / 2,
                             w.w13_scales.data() + e * 2 * N * H / G, w.w13_global[e], 2 * N, H);
      const auto b = dequant(w.format, w.w2.data() + e * H * N / 2, w.w2_scales.data() + e * H * N / G,
                             w.w2_global[e], H, N);
      std::vector<double> act(N);
      for (std::uint64_t n = 0; n < N; ++n) {
        double gate = 0, up = 0;
        const std::uint64_t gr = g.order == GateUpOrder::w13 ? n : N + n;
        const std::uint64_t ur = g.order == GateUpOrder::w13 ? N + n : n;
        for (std::uint64_t h = 0; h < H; ++h) {
          const double x = bf16_to_float(hidden[t * H + h]);
          gate += a[gr * H + h] * x;
          up += a[ur * H + h] * x;
        }
        if (g.activation.kind == MoeActivation::gpt_oss) {
          if (!w.w13_bias.empty()) {
            gate += w.w13_bias[e * 2 * N + gr];
            up += w.w13_bias[e * 2 * N + ur];
          }
          const double lim = g.activation.limit, alpha = g.activation.alpha;
          gate = std::min(gate, lim);
          up = std::max(std::min(up, lim), -lim);
          act[n] = (up + 1.0) * gate / (1.0 + std::exp(-alpha * gate));
        } else {
          act[n] = gate / (1.0 + std::exp(-gate)) * up;
        }
      }
      for (std::uint64_t h = 0; h < H; ++h) {
        double y = w.w2_bias.empty() ? 0.0 : w.w2_bias[e * H + h];
        for (std::uint64_t n = 0; n < N; ++n) y += b[h * N + n] * act[n];
        out[t * H + h] += double(wts[t * k + j]) * y;
      }
    }
  return out;
}

double rel(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

struct Inputs {
  std::uint32_t T = 0;
  std::vector<std::uint16_t> hidden;
  std::vector<std::int32_t> ids;
  std::vector<float> wts;
};

// Random tokens; every fourth token repeats an expert in two slots (duplicates are separate slots).
Inputs make_inputs(const MoeLayerGeometry& g, std::uint32_t T, std::mt19937_64& rng) {
  Inputs in;
  in.T = T;
  std::normal_distribution<float> x(0.f, 1.f);
  std::uniform_int_distribution<std::int32_t> id(0, std::int32_t(g.experts) - 1);
  std::uniform_real_distribution<float> wt(0.05f, 1.f);
  in.hidden.resize(std::size_t{T} * g.hidden);
  for (auto& h : in.hidden) h = float_to_bf16(x(rng));
  in.ids.resize(std::size_t{T} * g.topk);
  in.wts.resize(in.ids.size());
  for (std::uint32_t t = 0; t < T; ++t)
    for (std::uint32_t j = 0; j < g.topk; ++j) {
      in.ids[t * g.topk + j] = (t % 4 == 3 && j > 0) ? in.ids[t * g.topk] : id(rng);
      in.wts[t * g.topk + j] = wt(rng);
    }
  return in;
}

// One expert-parallel rank's share of the layer: the slots routed to its
// experts (ids made local to its slice), the others dropped.
std::vector<double> ep_rank_output(const MoeHostWeights& s, const ExpertPartition& p, const Inputs& in) {
  std::vector<std::int32_t> local(in.ids.size(), 0);
  std::vector<bool> keep(in.ids.size(), false);
  for (std::size_t i = 0; i < in.ids.size(); ++i)
    if (p.owns(std::uint32_t(in.ids[i]))) {
      keep[i] = true;
      local[i] = in.ids[i] - std::int32_t(p.first);
    }
  return oracle(s, in.hidden, in.T, local, in.wts, keep);
}

std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// A gpt_oss layer with random expert biases: a quarter of them large enough
// that the clamp at the limit is reached.
MoeHostWeights gpt_oss_layer(ScaleFormat f, MoeLayerGeometry g, std::uint64_t seed, std::mt19937_64& rng) {
  g.activation = MoeActivationSpec::gpt_oss();
  MoeHostWeights w = synthetic_moe_weights(f, g, seed);
  std::normal_distribution<float> small(0.f, 1.f);
  std::uniform_real_distribution<float> big(5.f, 12.f);
  auto draw = [&](std::size_t n) {
    std::vector<float> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = i % 4 == 1 ? (i % 8 == 1 ? big(rng) : -big(rng)) : small(rng);
    return v;
  };
  w.w13_bias = draw(std::size_t{g.experts} * 2 * g.intermediate);
  w.w2_bias = draw(std::size_t{g.experts} * g.hidden);
  return w;
}

struct Case {
  ScaleFormat format;
  GateUpOrder order;
};
class Parallel : public ::testing::TestWithParam<Case> {};

TEST_P(Parallel, TensorParallelRanksSumToTheWholeLayer) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const MoeLayerGeometry g{4, 64, 512, 2, GetParam().order};
  const MoeHostWeights w = synthetic_moe_weights(GetParam().format, g, seed);
  const Inputs in = make_inputs(g, 6, rng);
  const std::vector<bool> all(in.ids.size(), true);
  const auto whole = oracle(w, in.hidden, in.T, in.ids, in.wts, all);
  std::vector<float> whole_ref(in.T * g.hidden);
  moe_reference(w, in.hidden, in.T, in.ids, in.wts, whole_ref, 1);
  // The oracle is the library's reference up to the final float rounding.
  ASSERT_LT(rel(to_double(whole_ref), whole), 1e-6);
  for (unsigned tp : {1u, 2u, 4u, 8u}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    std::vector<double> sum(whole.size(), 0.0);
    std::vector<double> sum_ref(whole.size(), 0.0);
    for (unsigned r = 0; r < tp; ++r) {
      const MoeHostWeights s = slice_tensor_parallel(w, tp, r);
      ASSERT_EQ(s.geometry.intermediate, g.intermediate / tp);
      const auto part = oracle(s, in.hidden, in.T, in.ids, in.wts, all);
      for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += part[i];
      std::vector<float> pr(whole.size());
      moe_reference(s, in.hidden, in.T, in.ids, in.wts, pr, 1);
      for (std::size_t i = 0; i < sum.size(); ++i) sum_ref[i] += pr[i];
    }
    EXPECT_LT(rel(sum, whole), 1e-12);
    // moe_reference rounds each rank's partial sum to float: tp roundings.
    EXPECT_LT(rel(sum_ref, to_double(whole_ref)), 1e-6 * tp);
  }
}

TEST_P(Parallel, ExpertParallelRanksSumToTheWholeLayer) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const MoeLayerGeometry g{6, 64, 128, 3, GetParam().order};
  const MoeHostWeights w = synthetic_moe_weights(GetParam().format, g, seed);
  const Inputs in = make_inputs(g, 7, rng);
  const auto whole = oracle(w, in.hidden, in.T, in.ids, in.wts, std::vector<bool>(in.ids.size(), true));
  for (unsigned ep : {1u, 2u, 4u, 6u}) {  // 6 % 4 != 0: uneven blocks
    SCOPED_TRACE("ep " + std::to_string(ep));
    std::vector<double> sum(whole.size(), 0.0);
    std::uint32_t covered = 0;
    for (unsigned r = 0; r < ep; ++r) {
      const ExpertPartition p = expert_parallel_partition(g.experts, ep, r);
      ASSERT_EQ(p.first, covered);
      covered += p.count;
      const MoeHostWeights s = slice_expert_parallel(w, ep, r);
      ASSERT_EQ(s.geometry.experts, p.count);
      for (const std::int32_t id : in.ids)
        ASSERT_EQ(p.owns(std::uint32_t(id)), expert_owner(g.experts, ep, std::uint32_t(id)) == r);
      const auto part = ep_rank_output(s, p, in);
      for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += part[i];
    }
    EXPECT_EQ(covered, g.experts);
    EXPECT_LT(rel(sum, whole), 1e-12);
  }
}

TEST_P(Parallel, TensorParallelSlicesReassembleTheOriginalBytes) {
  CSFMOE_SEEDED(seed);
  const MoeLayerGeometry g{3, 128, 512, 2, GetParam().order};
  const MoeHostWeights w = synthetic_moe_weights(GetParam().format, g, seed, /*fast=*/true);
  const unsigned G = group_size(w.format);
  const std::uint64_t E = g.experts, H = g.hidden, N = g.intermediate;
  for (unsigned tp : {1u, 2u, 4u, 8u}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    std::vector<MoeHostWeights> s;
    for (unsigned r = 0; r < tp; ++r) s.push_back(slice_tensor_parallel(w, tp, r));
    const std::uint64_t n = N / tp;
    // Rebuild [E, 2N, X]: half h of rank r holds rows h*N + r*n ... of the original.
    auto rebuild13 = [&](auto member, std::uint64_t row_bytes) {
      std::vector<std::uint8_t> out(E * 2 * N * row_bytes);
      for (std::uint64_t e = 0; e < E; ++e)
        for (unsigned r = 0; r < tp; ++r)
          for (std::uint64_t h = 0; h < 2; ++h)
            std::copy_n((s[r].*member).begin() + ((e * 2 + h) * n) * row_bytes, n * row_bytes,
                        out.begin() + (e * 2 * N + h * N + r * n) * row_bytes);
      return out;
    };
    auto rebuild2 = [&](auto member, std::uint64_t per) {  // [E*H, N/per]
      std::vector<std::uint8_t> out(E * H * (N / per));
      for (std::uint64_t row = 0; row < E * H; ++row)
        for (unsigned r = 0; r < tp; ++r)
          std::copy_n((s[r].*member).begin() + row * (n / per), n / per,
                      out.begin() + row * (N / per) + r * (n / per));
      return out;
    };
    EXPECT_EQ(rebuild13(&MoeHostWeights::w13, H / 2), w.w13);
    EXPECT_EQ(rebuild13(&MoeHostWeights::w13_scales, H / G), w.w13_scales);
    EXPECT_EQ(rebuild2(&MoeHostWeights::w2, 2), w.w2);
    EXPECT_EQ(rebuild2(&MoeHostWeights::w2_scales, G), w.w2_scales);
    for (const auto& x : s) {
      EXPECT_EQ(x.w13_global, w.w13_global);
      EXPECT_EQ(x.w2_global, w.w2_global);
    }
  }
  // Expert parallel: the blocks concatenate to the original.
  for (unsigned ep : {1u, 2u, 3u}) {
    std::vector<std::uint8_t> w13, w2s;
    std::vector<float> g13;
    for (unsigned r = 0; r < ep; ++r) {
      const auto x = slice_expert_parallel(w, ep, r);
      w13.insert(w13.end(), x.w13.begin(), x.w13.end());
      w2s.insert(w2s.end(), x.w2_scales.begin(), x.w2_scales.end());
      g13.insert(g13.end(), x.w13_global.begin(), x.w13_global.end());
    }
    EXPECT_EQ(w13, w.w13);
    EXPECT_EQ(w2s, w.w2_scales);
    EXPECT_EQ(g13, w.w13_global);
  }
}

// gpt-oss's activation with expert biases: the TP ranks' reference outputs
// sum to the whole layer's (the down bias counted once: rank 0 holds it), the
// EP ranks' cover it, and the bias slices reassemble the original.
TEST_P(Parallel, BiasedGptOssRanksSumToTheWholeLayer) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const MoeLayerGeometry g{4, 64, 512, 2, GetParam().order};
  const MoeHostWeights w = gpt_oss_layer(GetParam().format, g, seed, rng);
  const std::uint64_t E = g.experts, H = g.hidden, N = g.intermediate;
  const Inputs in = make_inputs(g, 6, rng);
  const std::vector<bool> all(in.ids.size(), true);
  const auto whole = oracle(w, in.hidden, in.T, in.ids, in.wts, all);
  std::vector<float> whole_ref(in.T * g.hidden);
  moe_reference(w, in.hidden, in.T, in.ids, in.wts, whole_ref, 1);
  ASSERT_LT(rel(to_double(whole_ref), whole), 1e-6);
  {  // the biases matter: without them the output moves far beyond the tolerance
    MoeHostWeights nb = w;
    nb.w13_bias.clear();
    nb.w2_bias.clear();
    ASSERT_GT(rel(oracle(nb, in.hidden, in.T, in.ids, in.wts, all), whole), 1e-2);
  }
  for (unsigned tp : {1u, 2u, 4u, 8u}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    const std::uint64_t n = N / tp;
    std::vector<double> sum(whole.size(), 0.0), sum_ref(whole.size(), 0.0);
    std::vector<float> b13(w.w13_bias.size());
    for (unsigned r = 0; r < tp; ++r) {
      const MoeHostWeights s = slice_tensor_parallel(w, tp, r);
      EXPECT_EQ(s.geometry.activation.kind, MoeActivation::gpt_oss);
      ASSERT_EQ(s.w13_bias.size(), E * 2 * n);
      EXPECT_EQ(s.w2_bias, r == 0 ? w.w2_bias : std::vector<float>{});
      for (std::uint64_t e = 0; e < E; ++e)
        for (std::uint64_t h = 0; h < 2; ++h)
          std::copy_n(s.w13_bias.begin() + (e * 2 + h) * n, n, b13.begin() + e * 2 * N + h * N + r * n);
      const auto part = oracle(s, in.hidden, in.T, in.ids, in.wts, all);
      for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += part[i];
      std::vector<float> pr(whole.size());
      moe_reference(s, in.hidden, in.T, in.ids, in.wts, pr, 1);
      for (std::size_t i = 0; i < sum.size(); ++i) sum_ref[i] += pr[i];
    }
    EXPECT_EQ(b13, w.w13_bias);
    EXPECT_LT(rel(sum, whole), 1e-12);
    EXPECT_LT(rel(sum_ref, to_double(whole_ref)), 1e-6 * tp);
  }
  for (unsigned ep : {1u, 3u, 4u}) {  // 4 % 3 != 0: uneven blocks
    SCOPED_TRACE("ep " + std::to_string(ep));
    std::vector<double> sum(whole.size(), 0.0);
    std::vector<float> b13, b2;
    for (unsigned r = 0; r < ep; ++r) {
      const ExpertPartition p = expert_parallel_partition(g.experts, ep, r);
      const MoeHostWeights s = slice_expert_parallel(w, ep, r);
      b13.insert(b13.end(), s.w13_bias.begin(), s.w13_bias.end());
      b2.insert(b2.end(), s.w2_bias.begin(), s.w2_bias.end());
      const auto part = ep_rank_output(s, p, in);
      for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += part[i];
    }
    EXPECT_EQ(b13, w.w13_bias);
    EXPECT_EQ(b2, w.w2_bias);
    EXPECT_LT(rel(sum, whole), 1e-12);
  }
  // Each bias is optional: a layer with only one slices too.
  MoeHostWeights only13 = w;
  only13.w2_bias.clear();
  EXPECT_TRUE(slice_tensor_parallel(only13, 2, 0).w2_bias.empty());
  EXPECT_EQ(slice_expert_parallel(only13, 2, 1).w13_bias.size(), (E / 2) * 2 * N);
  MoeHostWeights only2 = w;
  only2.w13_bias.clear();
  EXPECT_TRUE(slice_tensor_parallel(only2, 2, 1).w13_bias.empty());
  EXPECT_EQ(slice_tensor_parallel(only2, 2, 0).w2_bias, w.w2_bias);
}

INSTANTIATE_TEST_SUITE_P(
    FormatsAndOrders, Parallel,
    ::testing::Values(Case{ScaleFormat::nvfp4, GateUpOrder::w13}, Case{ScaleFormat::nvfp4, GateUpOrder::w31},
                      Case{ScaleFormat::mxfp4, GateUpOrder::w13}, Case{ScaleFormat::mxfp4, GateUpOrder::w31}),
    [](const auto& i) {
      return std::string(to_string(i.param.format)) + "_" + std::string(to_string(i.param.order));
    });

TEST(ParallelArgs, BadTensorParallelArgumentsAreRefused) {
  CSFMOE_SEEDED(seed);
  const MoeLayerGeometry g{2, 64, 512, 1, GateUpOrder::w13};
  const MoeHostWeights w = synthetic_moe_weights(ScaleFormat::nvfp4, g, seed, true);
  EXPECT_THROW(slice_tensor_parallel(w, 0, 0), InvalidArgument);
  EXPECT_THROW(slice_tensor_parallel(w, 4, 4), InvalidArgument);
  EXPECT_THROW(slice_tensor_parallel(w, 3, 0), InvalidArgument);   // 512 % 3
  EXPECT_THROW(slice_tensor_parallel(w, 16, 0), InvalidArgument);  // 32 columns: below the 64 tile
  try {
    slice_tensor_parallel(w, 16, 0);
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("N/tp"), std::string::npos) << e.what();
  }
  MoeHostWeights broken = w;
  broken.w2.pop_back();
  EXPECT_THROW(slice_tensor_parallel(broken, 2, 0), InvalidArgument);
}

TEST(ParallelArgs, BadExpertParallelArgumentsAreRefused) {
  EXPECT_THROW(expert_parallel_partition(8, 0, 0), InvalidArgument);
  EXPECT_THROW(expert_parallel_partition(8, 9, 0), InvalidArgument);
  EXPECT_THROW(expert_parallel_partition(8, 4, 4), InvalidArgument);
  EXPECT_THROW(expert_owner(8, 4, 8), InvalidArgument);
  // Every expert has exactly one owner, for all E, ep up to 40.
  for (std::uint32_t E = 1; E <= 40; ++E)
    for (unsigned ep = 1; ep <= E; ++ep) {
      std::vector<int> seen(E, 0);
      for (unsigned r = 0; r < ep; ++r) {
        const auto p = expert_parallel_partition(E, ep, r);
        EXPECT_GE(p.count, E / ep);
        EXPECT_LE(p.count, E / ep + 1);
        for (std::uint32_t e = p.first; e < p.first + p.count; ++e) {
          ++seen[e];
          ASSERT_EQ(expert_owner(E, ep, e), r) << "E " << E << " ep " << ep << " e " << e;
        }
      }
      for (std::uint32_t e = 0; e < E; ++e) ASSERT_EQ(seen[e], 1);
    }
}

TEST(ParallelNames, ProjectionNamesGiveTheirSplit) {
  EXPECT_EQ(tensor_parallel_split_of("model.layers.3.mlp.experts.17.w1.weight"), TpSplit::rows);
  EXPECT_EQ(tensor_parallel_split_of("model.layers.3.mlp.experts.17.w3.weight_scale"), TpSplit::rows);
  EXPECT_EQ(tensor_parallel_split_of("model.layers.3.mlp.experts.17.w2.weight"), TpSplit::cols);
  EXPECT_EQ(tensor_parallel_split_of("model.layers.3.mlp.experts.w13_weight"), TpSplit::gate_up_rows);
  EXPECT_EQ(tensor_parallel_split_of("model.layers.0.mlp.experts.gate_up_proj_blocks"),
            TpSplit::gate_up_rows);
  EXPECT_EQ(tensor_parallel_split_of("model.layers.0.mlp.experts.down_proj_scales"), TpSplit::cols);
  EXPECT_EQ(tensor_parallel_split_of("model.layers.0.mlp.experts.5.gate_proj.weight"), TpSplit::rows);
  EXPECT_EQ(tensor_parallel_split_of("model.layers.0.mlp.experts.5.up_proj.weight"), TpSplit::rows);
  EXPECT_EQ(tensor_parallel_split_of("experts.w2_weight_scale"), TpSplit::cols);
  // Not expert projections.
  EXPECT_EQ(tensor_parallel_split_of("model.layers.0.mlp.gate_proj.weight"), TpSplit::none);
  EXPECT_EQ(tensor_parallel_split_of("model.layers.0.mlp.shared_experts.gate_proj.weight"), TpSplit::none);
  EXPECT_EQ(tensor_parallel_split_of("model.layers.0.mlp.experts.5.w10.weight"), TpSplit::none);
  EXPECT_EQ(tensor_parallel_split_of("model.layers.0.mlp.router.weight"), TpSplit::none);
}

// Inverse of slice_axis for the test: put every rank's pieces back.
TEST(ParallelBytes, AxisSlicesReassembleTheTensor) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (int iter = 0; iter < 30; ++iter) {
    const unsigned tp = 1u << (rng() % 4);
    const TpSplit split = std::array{TpSplit::rows, TpSplit::gate_up_rows, TpSplit::cols}[rng() % 3];
    const std::size_t rank_n = 1 + rng() % 4, axis = rng() % rank_n, es = 1 + rng() % 4;
    std::vector<std::uint64_t> shape(rank_n);
    for (auto& d : shape) d = 1 + rng() % 3;
    shape[axis] = (split == TpSplit::gate_up_rows ? 2 : 1) * tp * (1 + rng() % 3);
    std::uint64_t n = es;
    for (auto d : shape) n *= d;
    std::vector<std::uint8_t> src(n);
    for (auto& b : src) b = static_cast<std::uint8_t>(rng());
    std::uint64_t outer = 1, inner = es;
    for (std::size_t i = 0; i < axis; ++i) outer *= shape[i];
    for (std::size_t i = axis + 1; i < rank_n; ++i) inner *= shape[i];
    std::vector<std::uint8_t> back(n, 0);
    std::vector<int> hits(n, 0);
    for (unsigned r = 0; r < tp; ++r) {
      const auto ranges = tensor_parallel_axis_ranges(shape[axis], split, tp, r, 1, "t");
      const auto part = slice_axis(src, shape, es, axis, ranges);
      std::uint64_t kept = 0;
      for (const auto& x : ranges) kept += x.count;
      ASSERT_EQ(part.size(), outer * kept * inner);
      std::size_t p = 0;
      for (std::uint64_t o = 0; o < outer; ++o)
        for (const auto& x : ranges)
          for (std::uint64_t i = 0; i < x.count * inner; ++i, ++p) {
            const std::uint64_t at = (o * shape[axis] + x.first) * inner + i;
            back[at] = part[p];
            ++hits[at];
          }
    }
    ASSERT_EQ(back, src);
    ASSERT_TRUE(std::all_of(hits.begin(), hits.end(), [](int h) { return h == 1; }));
  }
  const std::vector<std::uint64_t> shape{4, 6};
  std::vector<std::uint8_t> src(24);
  EXPECT_THROW(slice_axis(src, shape, 1, 2, {}), InvalidArgument);
  const std::array<AxisRange, 1> bad{AxisRange{5, 2}};
  EXPECT_THROW(slice_axis(src, shape, 1, 1, bad), InvalidArgument);
  EXPECT_THROW(slice_axis(std::span(src).first(23), shape, 1, 1, {}), InvalidArgument);
  EXPECT_THROW(tensor_parallel_axis_ranges(6, TpSplit::gate_up_rows, 2, 0, 1, "t"), InvalidArgument);
  EXPECT_THROW(tensor_parallel_axis_ranges(64, TpSplit::cols, 4, 0, 32, "t"), InvalidArgument);
  EXPECT_THROW(tensor_parallel_axis_ranges(64, TpSplit::cols, 4, 4, 1, "t"), InvalidArgument);
}

TEST(ParallelBytes, ScaleGridSlicesInBothLayouts) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4})
    for (int iter = 0; iter < 6; ++iter) {
      const unsigned tp = 1u << (rng() % 4);
      const bool rows_split = rng() % 2;
      const TpSplit split = rows_split ? (rng() % 2 ? TpSplit::gate_up_rows : TpSplit::rows) : TpSplit::cols;
      const std::uint32_t E = 1 + rng() % 3;
      // Not tile aligned on purpose (e.g. 2*tp*37 rows, tp*5 columns).
      const std::uint32_t R =
          rows_split ? (split == TpSplit::gate_up_rows ? 2 : 1) * tp * (1 + rng() % 90) : 1 + rng() % 300;
      const std::uint32_t C = rows_split ? 1 + rng() % 9 : tp * (1 + rng() % 6);
      GridShape rm{f, ScaleLayout::row_major, E, R, C};
      std::vector<std::uint8_t> src(std::uint64_t{E} * R * C);
      for (auto& b : src) b = static_cast<std::uint8_t>(rng());
      const auto swz = relayout_scales(rm, src, ScaleLayout::swizzled_128x4);
      GridShape sz{f, ScaleLayout::swizzled_128x4, E, std::uint32_t(round_up(R, 128)),
                   std::uint32_t(round_up(C, 4))};
      std::vector<std::uint8_t> back(src.size(), 0);
      for (unsigned r = 0; r < tp; ++r) {
        const auto rows = rows_split ? tensor_parallel_axis_ranges(R, split, tp, r, 1, "s")
                                     : std::vector<AxisRange>{{0, R}};
        const AxisRange cols =
            rows_split ? AxisRange{0, C} : tensor_parallel_axis_ranges(C, split, tp, r, 1, "s")[0];
        GridShape o1, o2;
        const auto a = slice_scale_grid(rm, R, C, src, rows, cols, &o1);
        const auto b = slice_scale_grid(sz, R, C, swz, rows, cols, &o2);
        // The swizzled slice is the swizzle of the row-major slice (zero padding).
        ASSERT_EQ(b, relayout_scales(o1, a, ScaleLayout::swizzled_128x4));
        ASSERT_EQ(o2.rows, round_up(o1.rows, 128));
        ASSERT_EQ(o2.cols, round_up(o1.cols, 4));
        // Put the row-major slice back into place.
        std::size_t p = 0;
        for (std::uint32_t e = 0; e < E; ++e)
          for (const auto& x : rows)
            for (std::uint64_t i = 0; i < x.count; ++i)
              for (std::uint64_t c = 0; c < cols.count; ++c)
                back[(std::uint64_t{e} * R + x.first + i) * C + cols.first + c] = a[p++];
        ASSERT_EQ(p, a.size());
      }
      ASSERT_EQ(back, src);
    }
  // Tile-aligned row slices of a swizzled grid are its byte ranges: concatenation rebuilds it.
  GridShape rm{ScaleFormat::nvfp4, ScaleLayout::row_major, 1, 512, 8};
  std::vector<std::uint8_t> src(512 * 8);
  for (auto& b : src) b = static_cast<std::uint8_t>(rng());
  const auto swz = relayout_scales(rm, src, ScaleLayout::swizzled_128x4);
  GridShape sz{ScaleFormat::nvfp4, ScaleLayout::swizzled_128x4, 1, 512, 8};
  std::vector<std::uint8_t> cat;
  for (unsigned r = 0; r < 4; ++r) {
    const auto rows = tensor_parallel_axis_ranges(512, TpSplit::rows, 4, r, 128, "s");
    const auto part = slice_scale_grid(sz, 512, 8, swz, rows, {0, 8});
    cat.insert(cat.end(), part.begin(), part.end());
  }
  EXPECT_EQ(cat, swz);
  // Wrong stored shapes are refused.
  EXPECT_THROW(slice_scale_grid(sz, 380, 8, swz, {}, {0, 8}), InvalidArgument);
  EXPECT_THROW(slice_scale_grid(sz, 512, 3, swz, {}, {0, 3}), InvalidArgument);
  const std::array<AxisRange, 1> out_of{AxisRange{500, 20}};
  EXPECT_THROW(slice_scale_grid(sz, 512, 8, swz, out_of, {0, 8}), InvalidArgument);
  EXPECT_THROW(slice_scale_grid(rm, 512, 8, src, {}, {4, 5}), InvalidArgument);
}

}  // namespace
}  // namespace csfmoe
