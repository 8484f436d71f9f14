// CPU reference of the fused MoE layer (float64 accumulation), host weight
// containers and synthetic layers.
#include <fmt/core.h>

#include <array>
#include <cmath>
#include <limits>
#include <string>

#include "common/cpu_threads.hpp"
#include "csfmoe/errors.hpp"
#include "csfmoe/moe.hpp"
#include "csfmoe/quantize.hpp"
#include "csfmoe/synthetic.hpp"

namespace csfmoe {

namespace {

void expect_size(const char* member, std::size_t have, std::uint64_t want) {
  if (have != want)
    throw InvalidArgument(
        fmt::format("MoeHostWeights.{} holds {} elements, the geometry needs {}", member, have, want));
}

// Plain splitmix64: cheap, good enough for weights of a benchmark layer.
struct Mix {
  std::uint64_t s;
  std::uint64_t next() { return splitmix64(s); }
};

double scale_value(ScaleFormat f, std::uint8_t b) {
  return f == ScaleFormat::nvfp4 ? double(e4m3fn_to_float(b)) : double(e8m0_to_float(b));
}

// y[r] = sum_k x[k] * (e2m1(w[r, k]) * scale[r, k / g]) * global, float64.
void matvec(ScaleFormat f, const std::uint8_t* w, const std::uint8_t* scales, double global,
            std::uint32_t rows, std::uint32_t k, const double* x, double* y) {
  static const auto table = [] {
    std::array<double, 16> t{};
    for (unsigned i = 0; i < 16; ++i) t[i] = double(e2m1_to_float(static_cast<std::uint8_t>(i)));
    return t;
  }();
  const unsigned g = group_size(f);
  const std::uint32_t groups = k / g;
  for (std::uint32_t r = 0; r < rows; ++r) {
    const std::uint8_t* wr = w + std::size_t{r} * (k / 2);
    const std::uint8_t* sr = scales + std::size_t{r} * groups;
    double acc = 0.0;
    for (std::uint32_t q = 0; q < groups; ++q) {
      double part = 0.0;
      const std::uint8_t* wb = wr + std::size_t{q} * g / 2;
      const double* xb = x + std::size_t{q} * g;
      for (unsigned i = 0; i < g / 2; ++i) {
        part += xb[2 * i] * table[wb[i] & 0xF];
        part += xb[2 * i + 1] * table[wb[i] >> 4];
      }
      acc += part * scale_value(f, sr[q]);
    }
    y[r] = acc * global;
  }
}

template <typename Id>
void reference_impl(const MoeHostWeights& w, std::span<const std::uint16_t> hidden, std::uint32_t tokens,
                    std::span<const Id> ids, std::span<const float> weights, std::span<float> out,
                    unsigned threads) {
  validate(w);
  const MoeLayerGeometry& g = w.geometry;
  const std::uint64_t H = g.hidden, N = g.intermediate, k = g.topk;
  expect_size("hidden (argument)", hidden.size(), tokens * H);
  if (ids.size() != tokens * k)
    throw InvalidArgument(fmt::format("moe_reference: topk_ids holds {} ids, [T={}, k={}] needs {}",
                                      ids.size(), tokens, k, tokens * k));
  if (weights.size() != tokens * k)
    throw InvalidArgument(fmt::format("moe_reference: topk_weights holds {} values, [T={}, k={}] needs {}",
                                      weights.size(), tokens, k, tokens * k));
  if (out.size() != tokens * H)
    throw InvalidArgument(fmt::format("moe_reference: out holds {} values, [T={}, H={}] needs {}", out.size(),
                                      tokens, H, tokens * H));
  for (std::uint64_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || std::uint64_t(ids[i]) >= g.experts)
      throw InvalidArgument(fmt::format("moe_reference: topk_ids[{}, {}] = {} is outside [0, {})", i / k,
                                        i % k, std::int64_t(ids[i]), g.experts));

  const unsigned G = group_size(w.format);
  const std::uint64_t w13_expert = 2 * N * (H / 2), w13s_expert = 2 * N * (H / G);
  const std::uint64_t w2_expert = H * (N / 2), w2s_expert = H * (N / G);
  const bool up_first = g.order == GateUpOrder::w31;

  // One task per token: slots are summed in slot order so the result does not
  // depend on the thread count.
  cpu_threads::for_each_index(tokens, threads, [&](std::size_t t) {
    std::vector<double> x(H), gu(2 * N), act(N), y(H), acc(H, 0.0);
    for (std::uint64_t h = 0; h < H; ++h) x[h] = double(bf16_to_float(hidden[t * H + h]));
    for (std::uint64_t j = 0; j < k; ++j) {
      const std::uint64_t e = std::uint64_t(ids[t * k + j]);
      matvec(w.format, w.w13.data() + e * w13_expert, w.w13_scales.data() + e * w13s_expert, w.w13_global[e],
             std::uint32_t(2 * N), std::uint32_t(H), x.data(), gu.data());
      if (!w.w13_bias.empty())
        for (std::uint64_t r = 0; r < 2 * N; ++r) gu[r] += double(w.w13_bias[e * 2 * N + r]);
      const double* gate = gu.data() + (up_first ? N : 0);
      const double* up = gu.data() + (up_first ? 0 : N);
      for (std::uint64_t n = 0; n < N; ++n) act[n] = apply_activation(g.activation, gate[n], up[n]);
      matvec(w.format, w.w2.data() + e * w2_expert, w.w2_scales.data() + e * w2s_expert, w.w2_global[e],
             std::uint32_t(H), std::uint32_t(N), act.data(), y.data());
      if (!w.w2_bias.empty())
        for (std::uint64_t h = 0; h < H; ++h) y[h] += double(w.w2_bias[e * H + h]);
      const double wt = double(weights[t * k + j]);
      for (std::uint64_t h = 0; h < H; ++h) acc[h] += wt * y[h];
    }
    for (std::uint64_t h = 0; h < H; ++h) out[t * H + h] = float(acc[h]);
  });
}

}  // namespace

void validate(const MoeHostWeights& w) {
  const MoeLayerGeometry& g = w.geometry;
  if (w.format != ScaleFormat::nvfp4 && w.format != ScaleFormat::mxfp4)
    throw InvalidArgument(fmt::format("MoeHostWeights.format {} is not nvfp4 or mxfp4", unsigned(w.format)));
  const unsigned G = group_size(w.format);
  if (g.experts == 0 || g.topk == 0 || g.hidden == 0 || g.intermediate == 0 || g.hidden % G ||
      g.intermediate % G)
    throw InvalidArgument(fmt::format(
        "MoeHostWeights.geometry E={} H={} N={} k={} needs non-zero sizes and H, N multiples of {}",
        g.experts, g.hidden, g.intermediate, g.topk, G));
  const std::uint64_t E = g.experts, H = g.hidden, N = g.intermediate;
  expect_size("w13", w.w13.size(), E * 2 * N * (H / 2));
  expect_size("w13_scales", w.w13_scales.size(), E * 2 * N * (H / G));
  expect_size("w13_global", w.w13_global.size(), E);
  expect_size("w2", w.w2.size(), E * H * (N / 2));
  expect_size("w2_scales", w.w2_scales.size(), E * H * (N / G));
  expect_size("w2_global", w.w2_global.size(), E);
  validate(g.activation);
  if (g.activation.kind != MoeActivation::gpt_oss) {
    if (!w.w13_bias.empty() || !w.w2_bias.empty())
      throw InvalidArgument(
          fmt::format("MoeHostWeights: expert biases are for the gpt_oss activation only, the layer's is {}",
                      to_string(g.activation.kind)));
    return;
  }
  if (!w.w13_bias.empty()) expect_size("w13_bias", w.w13_bias.size(), E * 2 * N);
  if (!w.w2_bias.empty()) expect_size("w2_bias", w.w2_bias.size(), E * H);
}

MoeHostWeights synthetic_moe_weights(ScaleFormat f, const MoeLayerGeometry& g, std::uint64_t seed,
                                     bool fast) {
  MoeHostWeights w;
  w.format = f;
  w.geometry = g;
  const unsigned G = group_size(f);
  if (g.experts == 0 || g.hidden == 0 || g.intermediate == 0 || g.hidden % G || g.intermediate % G)
    throw InvalidArgument(
        fmt::format("synthetic_moe_weights: geometry E={} H={} N={} needs H, N multiples of {}", g.experts,
                    g.hidden, g.intermediate, G));
  const std::uint64_t E = g.experts, H = g.hidden, N = g.intermediate;
  w.w13.resize(E * 2 * N * (H / 2));
  w.w13_scales.resize(E * 2 * N * (H / G));
  w.w13_global.resize(E);
  w.w2.resize(E * H * (N / 2));
  w.w2_scales.resize(E * H * (N / G));
  w.w2_global.resize(E);
  if (fast) {
    cpu_threads::for_each_index(E, 0, [&](std::size_t e) {
      Mix m{seed ^ (0xA5A5ull + e * 0x10001ull)};
      const auto fill = [&](std::uint8_t* p, std::uint64_t n) {
        for (std::uint64_t i = 0; i < n; i += 8) {
          const std::uint64_t r = m.next();
          for (std::uint64_t b = 0; b < 8 && i + b < n; ++b)
            p[i + b] = static_cast<std::uint8_t>(r >> (8 * b));
        }
      };
      fill(w.w13.data() + e * 2 * N * (H / 2), 2 * N * (H / 2));
      fill(w.w2.data() + e * H * (N / 2), H * (N / 2));
      // Unit-scale-ish globals keep activations in a sane range.
      w.w13_global[e] = f == ScaleFormat::nvfp4 ? 0x1p-9f * float(1 + e % 3) : 1.0f;
      w.w2_global[e] = f == ScaleFormat::nvfp4 ? 0x1p-9f * float(1 + e % 5) : 1.0f;
    });
    GridShape s13{f, ScaleLayout::row_major, g.experts, std::uint32_t(2 * N), std::uint32_t(H / G)};
    GridShape s2{f, ScaleLayout::row_major, g.experts, std::uint32_t(H), std::uint32_t(N / G)};
    w.w13_scales = synthetic_scales(s13, ScaleDistribution::realistic, seed * 3 + 1);
    w.w2_scales = synthetic_scales(s2, ScaleDistribution::realistic, seed * 3 + 2);
    return w;
  }
  cpu_threads::for_each_index(2 * E, 0, [&](std::size_t i) {
    const std::uint64_t e = i / 2;
    const bool down = i % 2;
    const std::uint64_t rows = down ? H : 2 * N, cols = down ? N : H;
    QuantizedMatrix q = synthetic_expert_matrix(f, rows, cols, seed * 0x9E3779B1ull + i);
    std::copy(q.packed.begin(), q.packed.end(), (down ? w.w2 : w.w13).begin() + e * rows * (cols / 2));
    std::copy(q.scales.begin(), q.scales.end(),
              (down ? w.w2_scales : w.w13_scales).begin() + e * rows * (cols / G));
    (down ? w.w2_global : w.w13_global)[e] = q.global_scale;
  });
  return w;
}

std::vector<std::uint8_t> relayout_scales(const GridShape& s, std::span<const std::uint8_t> src,
                                          ScaleLayout layout) {
  if (s.layout != ScaleLayout::row_major)
    throw InvalidArgument("relayout_scales: the source shape must be row_major");
  const std::uint64_t R = s.rows, C = s.cols;
  if (src.size() != std::uint64_t{s.experts} * R * C)
    throw InvalidArgument(fmt::format("relayout_scales: source holds {} bytes, [{}, {}, {}] needs {}",
                                      src.size(), s.experts, R, C, std::uint64_t{s.experts} * R * C));
  if (layout == ScaleLayout::row_major) return {src.begin(), src.end()};
  if (layout != ScaleLayout::swizzled_128x4)
    throw InvalidArgument(fmt::format("relayout_scales: unknown layout {}", unsigned(layout)));
  const std::uint64_t Rp = round_up(R, 128), Cp = round_up(C, 4);
  // Padding cells are 0 (kernels never read them).
  std::vector<std::uint8_t> dst(s.experts * Rp * Cp, 0);
  for (std::uint64_t e = 0; e < s.experts; ++e)
    for (std::uint64_t r = 0; r < R; ++r)
      for (std::uint64_t c = 0; c < C; ++c)
        dst[e * Rp * Cp + swizzled_index(r, c, Cp)] = src[(e * R + r) * C + c];
  return dst;
}

void moe_reference(const MoeHostWeights& w, std::span<const std::uint16_t> hidden, std::uint32_t tokens,
                   std::span<const std::int64_t> ids, std::span<const float> weights, std::span<float> out,
                   unsigned threads) {
  reference_impl<std::int64_t>(w, hidden, tokens, ids, weights, out, threads);
}

void moe_reference(const MoeHostWeights& w, std::span<const std::uint16_t> hidden, std::uint32_t tokens,
                   std::span<const std::int32_t> ids, std::span<const float> weights, std::span<float> out,
                   unsigned threads) {
  reference_impl<std::int32_t>(w, hidden, tokens, ids, weights, out, threads);
}

double relative_error(std::span<const float> a, std::span<const float> b) {
  if (a.size() != b.size())
    throw InvalidArgument(fmt::format("relative_error: sizes differ ({} vs {})", a.size(), b.size()));
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = double(a[i]) - double(b[i]);
    num += d * d;
    den += double(b[i]) * double(b[i]);
  }
  if (std::isnan(num) || std::isnan(den)) return std::numeric_limits<double>::quiet_NaN();
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

}  // namespace csfmoe
