// Synthetic scale grids built from a model of weights rather than from a
// tuned byte histogram.
//
// Model (per expert matrix): weight w = sigma_row * f_col * t_block * z, with
//   sigma_row = exp(N(0, row_sigma))     per output row,
//   f_col     = exp(N(0, col_sigma))     per block column (input channels):
//               a share col_shared of its log-variance is common to all
//               experts of the tensor, the rest is the expert's own,
//   t_block   = exp(N(0, block_sigma))   per block,
//   z         = N(0, 1), or N(0, k^2) with a small probability p: a scale
//               mixture of gaussians, i.e. a student-t-like heavy tail.
// A block's amax is then sigma_row * f_col * t_block * max_g |z|. Instead of
// drawing g values per block we draw max_g |z| * t_block in one step from its
// exact CDF, F(m) = E_t[G(m / t)^g] with G the CDF of |z|, tabulated once and
// inverted by table lookup (three levels so the tails stay resolved down to
// probabilities of 2^-24). The recipe then maps amax to the scale byte:
//   NVFP4: global = tensor amax / 2688, byte = e4m3((amax / 6) / global);
//   MXFP4: byte = floor(log2(amax)) - 2 + 127, clamped.
// "dispersed" uses the same model with a much larger block_sigma, chosen so
// that about 12.5% of NVFP4 bytes fall outside a row's 16-code window.
#include "csfmoe/synthetic.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "csfmoe/errors.hpp"
#include "csfmoe/formats.hpp"

namespace csfmoe {
namespace {

// ---------------------------------------------------------------------------
// Random numbers: xoshiro256** seeded through splitmix64 (csfmoe/synthetic.hpp).
// ---------------------------------------------------------------------------

class Rng {
 public:
  Rng(std::uint64_t seed, std::uint64_t stream) {
    std::uint64_t s = seed ^ (stream * 0xD1B54A32D192ED03ull);
    for (auto& w : s_) w = splitmix64(s);
  }
  std::uint64_t next() {
    const std::uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const std::uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }
  double uniform() { return double(next() >> 11) * 0x1p-53; }  // [0, 1)
  double normal() {
    // Box-Muller; only used per row / per value in small matrices.
    const double u1 = 1.0 - uniform();  // (0, 1]
    const double u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  static std::uint64_t rotl(std::uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  std::uint64_t s_[4];
};

// ---------------------------------------------------------------------------
// The weight model and its block-amax quantile table.
// ---------------------------------------------------------------------------
struct WeightModel {
  double row_sigma;    // log-sd of the per-row magnitude
  double col_sigma;    // log-sd of the per-column (input channel block) magnitude
  double col_shared;   // share of the column log-variance common to all experts
  double block_sigma;  // log-sd of the per-block magnitude
  double p_out;        // probability that a weight comes from the wide component
  double k_out;        // sd of the wide component relative to the narrow one

  // Only what shapes the block-amax table.
  auto key() const { return std::tuple(block_sigma, p_out, k_out); }
};

// Realistic: calibrated on the FFN scales of real weights that scripts/real-weights
// fetches and quantizes with `csf quantize` (SmolLM2-135M, 30 layers stacked as
// experts, and all-MiniLM-L6-v2; docs/csf-format.md, "Real weights"). Measured
// there (SmolLM2 w13 C = 36 / w2 C = 96; MiniLM in brackets), and what this
// model gives on the same geometry (smollm2-135m-ffn, seeds 1-6):
//   NVFP4 exceptions 0.35 % / 0.65 % (0.41 % / 2.2 %); model 0.28 % / 0.39 %.
//   SD of the bytes within a row 2.8 / 3.0 E4M3 codes (2.9 / 3.4); model 2.7.
//   SD of the row bases within an expert 2.1 / 1.7 codes (2.6 / 2.4); model
//   2.0 / 1.7 (row_sigma).
//   Column structure: the SD across columns of the row-centred column means
//   is 0.07 / 0.28 codes where row-independent noise alone gives 0.05 / 0.12
//   (0.27 / 0.83 vs 0.07 / 0.18); w13's column means correlate 0.5 (0.8)
//   between layers, w2's hardly; model 0.22 / 0.25 codes, correlation
//   0.4 - 0.6 between experts (col_sigma, col_shared).
//   MXFP4: 62.6 % of bytes at the row base, 36.8 % at base + 1, 0.66 %
//   exceptions (w2: 65.2 / 34.0 / 0.79 %; MiniLM w13 39.9 / 59.3 / 0.80 %,
//   w2 58.8 / 37.5 / 3.7 %); within-row SD 0.40 - 0.45 octaves, row-base SD
//   0.2 - 0.3. The split is set by where a tensor's typical block amax falls
//   between two powers of two (a layer's rows sit within ~0.3 octave of each
//   other), so it is a property of the tensor, not of the format: the model
//   draws that position per tensor and gives splits from 30 / 69 to 64 / 35
//   across seeds, exceptions 0.57 - 1.4 %, within-row SD 0.30 - 0.45.
// block_sigma is 0: the spread of the max of g gaussians alone already gives
// the measured within-row SD.
constexpr WeightModel kRealistic{0.12, 0.02, 0.5, 0.0, 0.001, 3.0};
// Dispersed: ~12 % NVFP4 exceptions (the break-even), ~14 % MXFP4.
constexpr WeightModel kDispersed{0.25, 0.0, 0.0, 0.39, 0.001, 3.0};

class QuantileTable {
 public:
  QuantileTable(const WeightModel& m, unsigned g) { build(m, g); }

  // Block amax / sigma_row for a 32-bit uniform u (p = u / 2^32).
  float operator()(std::uint32_t u) const {
    const std::uint32_t i = u >> 20;
    if (i - 1u < 4094u) return lerp(main_, i, float(u & 0xFFFFFu) * 0x1p-20f);
    const std::uint32_t j = (u >> 8) & 0xFFFu;
    const float f = float(u & 0xFFu) * 0x1p-8f;
    return i == 0 ? lerp(lo_, j, f) : lerp(hi_, j, f);
  }

 private:
  static float lerp(const std::array<float, 4097>& t, std::uint32_t i, float f) {
    return t[i] + f * (t[i + 1] - t[i]);
  }

  void build(const WeightModel& m, unsigned g) {
    // Block factor t = exp(block_sigma * z) by a 41-point rule on [-4, 4].
    constexpr int kQ = 41;
    std::vector<double> tw, tv;
    if (m.block_sigma == 0.0) {
      tw = {1.0};
      tv = {1.0};
    } else {
      double sum = 0.0;
      for (int q = 0; q < kQ; ++q) {
        const double z = -4.0 + 8.0 * q / (kQ - 1);
        tw.push_back(std::exp(-0.5 * z * z));
        tv.push_back(std::exp(m.block_sigma * z));
        sum += tw.back();
      }
      for (double& w : tw) w /= sum;
    }
    // logit F on a grid of log2 m; F and 1 - F are both summed directly so
    // that neither tail loses precision to cancellation.
    constexpr double kLo = -10.0, kHi = 12.0, kStep = 1.0 / 256.0;
    const int n = int((kHi - kLo) / kStep) + 1;
    std::vector<double> x(n), logit(n);
    const double inv_sqrt2 = 0.7071067811865476;
    for (int i = 0; i < n; ++i) {
      x[i] = kLo + i * kStep;
      const double mm = std::exp2(x[i]);
      double f = 0.0, f1 = 0.0;
      for (std::size_t q = 0; q < tw.size(); ++q) {
        const double y = mm / tv[q] * inv_sqrt2;
        const double tail = (1.0 - m.p_out) * std::erfc(y) + m.p_out * std::erfc(y / m.k_out);  // 1 - G
        const double lg = std::log1p(-tail) * g;                                                // log G^g
        f += tw[q] * std::exp(lg);
        f1 += tw[q] * -std::expm1(lg);
      }
      logit[i] = std::log(f) - std::log(f1);
    }
    auto inverse = [&](double p, double p1) {  // p1 = 1 - p, passed exactly
      const double target = std::log(p) - std::log(p1);
      const auto it = std::lower_bound(logit.begin(), logit.end(), target);
      if (it == logit.begin()) return float(std::exp2(x.front()));
      if (it == logit.end()) return float(std::exp2(x.back()));
      const std::size_t k = std::size_t(it - logit.begin());
      const double a = (target - logit[k - 1]) / (logit[k] - logit[k - 1]);
      return float(std::exp2(x[k - 1] + a * kStep));
    };
    for (int i = 1; i < 4096; ++i) main_[i] = inverse(i * 0x1p-12, (4096 - i) * 0x1p-12);
    for (int j = 1; j <= 4096; ++j) {
      lo_[j] = inverse(j * 0x1p-24, 1.0 - j * 0x1p-24);
      hi_[4096 - j] = inverse(1.0 - j * 0x1p-24, j * 0x1p-24);
    }
    lo_[0] = inverse(0x1p-26, 1.0 - 0x1p-26);
    hi_[4096] = inverse(1.0 - 0x1p-26, 0x1p-26);
    main_[0] = lo_[4096];
    main_[4096] = hi_[0];
  }

  std::array<float, 4097> main_{}, lo_{}, hi_{};
};

const QuantileTable& quantile_table(const WeightModel& m, unsigned g) {
  static std::mutex mu;
  static std::map<std::tuple<double, double, double, unsigned>, std::unique_ptr<QuantileTable>> cache;
  const std::lock_guard<std::mutex> lock(mu);
  auto& slot = cache[std::tuple_cat(m.key(), std::tuple(g))];
  if (!slot) slot = std::make_unique<QuantileTable>(m, g);
  return *slot;
}

// float_to_e4m3fn for finite a in (0, 448], inlined so the grid loop stays
// fast; same bit trick as the normal range of the public encoder.
inline std::uint8_t positive_to_e4m3fn(float a) {
  if (a < 0.015625f) return float_to_e4m3fn(a);  // subnormal range: rare
  const std::uint32_t u = detail::float_to_bits(a);
  const std::uint32_t code = ((u + 0x7FFFFu + ((u >> 20) & 1u)) >> 20) - (120u << 3);
  return std::uint8_t(std::min(code, 0x7Eu));
}

// ---------------------------------------------------------------------------
// Scale bytes of one expert grid (rows x cols, row-major) from the model.
// `tensor_sigma` is the tensor's weight sd (MXFP4 only) and `shared_col` the
// tensor-wide part of the column effects (cols normals).
// ---------------------------------------------------------------------------
void model_grid(const WeightModel& m, ScaleFormat f, std::uint32_t rows, std::uint32_t cols,
                double tensor_sigma, const std::vector<double>& shared_col, Rng& rng, std::uint8_t* out) {
  const QuantileTable& table = quantile_table(m, group_size(f));
  // MXFP4 scales are absolute: the tensor has a typical LLM weight sd, and
  // its experts sit close to it (as a real model's layers do). Where that sd
  // falls between two powers of two sets the tensor's split between base and
  // base + 1, so the split varies from tensor to tensor as it does in real
  // weights (see kRealistic).
  const float sigma = f == ScaleFormat::mxfp4 ? float(tensor_sigma * std::exp(0.05 * rng.normal())) : 1.0f;
  std::vector<float> col(cols);
  const double own = std::sqrt(1.0 - m.col_shared), common = std::sqrt(m.col_shared);
  for (std::uint32_t c = 0; c < cols; ++c)
    col[c] = m.col_sigma == 0.0
                 ? 1.0f
                 : float(std::exp(m.col_sigma * (common * shared_col[c] + own * rng.normal())));

  // Block amax of every block first: the NVFP4 global needs the tensor amax.
  std::vector<float> amax(std::size_t{rows} * cols);
  float tensor_amax = 0.0f;
  for (std::uint32_t r = 0; r < rows; ++r) {
    const float mag = sigma * float(std::exp(m.row_sigma * rng.normal()));
    float* a = amax.data() + std::size_t{r} * cols;
    std::uint32_t c = 0;
    for (; c + 2 <= cols; c += 2) {
      const std::uint64_t u = rng.next();
      a[c] = mag * col[c] * table(std::uint32_t(u));
      a[c + 1] = mag * col[c + 1] * table(std::uint32_t(u >> 32));
    }
    if (c < cols) a[c] = mag * col[c] * table(std::uint32_t(rng.next()));
    for (c = 0; c < cols; ++c) tensor_amax = std::max(tensor_amax, a[c]);
  }
  // NVFP4, ModelOpt recipe: global = tensor amax / 2688, byte =
  // e4m3((amax / 6) / global). The two divisions are folded into one
  // multiply; that moves a few ties by one ulp, which synthetic data can
  // afford (the real recipe is quantize_nvfp4).
  const float to_scale = 1.0f / (6.0f * (tensor_amax / (6.0f * 448.0f)));
  const std::size_t n = amax.size();
  if (f == ScaleFormat::nvfp4) {
    for (std::size_t i = 0; i < n; ++i) out[i] = positive_to_e4m3fn(std::min(amax[i] * to_scale, 448.0f));
  } else {
    for (std::size_t i = 0; i < n; ++i) {
      // MXFP4: floor(log2(amax)) - 2 from the binary32 exponent (amax is a
      // normal float here), clamped to E8M0's range.
      const int e = int(detail::float_to_bits(amax[i]) >> 23) - 127 - 2;
      out[i] = std::uint8_t(std::clamp(e, -127, 127) + 127);
    }
  }
}

void check_shape(const GridShape& s) {
  if (s.format != ScaleFormat::nvfp4 && s.format != ScaleFormat::mxfp4)
    throw InvalidArgument("synthetic_scales: shape has an unknown scale format " +
                          std::to_string(unsigned(s.format)));
  if (s.layout != ScaleLayout::row_major && s.layout != ScaleLayout::swizzled_128x4)
    throw InvalidArgument("synthetic_scales: shape has an unknown layout " +
                          std::to_string(unsigned(s.layout)));
  if (s.experts == 0 || s.rows == 0 || s.cols == 0)
    throw InvalidArgument("synthetic_scales: shape " + std::to_string(s.experts) + " x " +
                          std::to_string(s.rows) + " x " + std::to_string(s.cols) + " has a zero dimension");
  if (s.layout == ScaleLayout::swizzled_128x4 && (s.rows % 128 != 0 || s.cols % 4 != 0))
    throw InvalidArgument(
        "synthetic_scales: a swizzled_128x4 shape must be padded to rows % 128 == 0 and "
        "cols % 4 == 0, got " +
        std::to_string(s.rows) + " x " + std::to_string(s.cols));
}

GridShape scale_shape(const MoeGeometry& g, ScaleFormat f, ScaleLayout l, std::uint32_t rows, std::uint32_t k,
                      const char* which) {
  if (f != ScaleFormat::nvfp4 && f != ScaleFormat::mxfp4)
    throw InvalidArgument(std::string(which) + ": unknown scale format " + std::to_string(unsigned(f)));
  if (l != ScaleLayout::row_major && l != ScaleLayout::swizzled_128x4)
    throw InvalidArgument(std::string(which) + ": unknown layout " + std::to_string(unsigned(l)));
  const unsigned gs = group_size(f);
  if (g.experts == 0 || rows == 0 || k == 0 || k % gs != 0)
    throw InvalidArgument(std::string(which) + ": geometry '" + std::string(g.name) + "' (E " +
                          std::to_string(g.experts) + ", K " + std::to_string(k) +
                          ") needs non-zero sizes and K a multiple of " + std::to_string(gs));
  GridShape s{f, l, g.experts, rows, k / gs};
  if (l == ScaleLayout::swizzled_128x4) {
    // The swizzled tensor is stored padded to whole 128x4 tiles.
    s.rows = std::uint32_t(round_up(s.rows, 128));
    s.cols = std::uint32_t(round_up(s.cols, 4));
  }
  return s;
}

}  // namespace

std::span<const MoeGeometry* const> moe_geometries() {
  static constexpr const MoeGeometry* kAll[] = {
      &kDeepSeekV3, &kKimiK2,         &kQwen3_30B_A3B, &kQwen3_235B_A22B, &kGlm5_3,         &kGlm5_3Tp2,
      &kQwen3_8Tp2, &kDeepSeek4_1Tp4, &kKimiTp12,      &kKimiTp16,        &kSmolLM2_135MFfn};
  return kAll;
}

const MoeGeometry& moe_geometry(std::string_view name) {
  for (const MoeGeometry* g : moe_geometries())
    if (g->name == name) return *g;
  std::string known;
  for (const MoeGeometry* g : moe_geometries()) known += (known.empty() ? "" : ", ") + std::string(g->name);
  throw InvalidArgument("MoE geometry '" + std::string(name) + "' is not known (known: " + known + ")");
}

GridShape w13_scale_shape(const MoeGeometry& g, ScaleFormat f, ScaleLayout l) {
  return scale_shape(g, f, l, 2 * g.intermediate, g.hidden, "w13_scale_shape");
}

GridShape w2_scale_shape(const MoeGeometry& g, ScaleFormat f, ScaleLayout l) {
  return scale_shape(g, f, l, g.hidden, g.intermediate, "w2_scale_shape");
}

std::vector<std::uint8_t> synthetic_scales(const GridShape& shape, ScaleDistribution dist,
                                           std::uint64_t seed) {
  check_shape(shape);
  const std::size_t per_expert = std::size_t{shape.rows} * shape.cols;
  std::vector<std::uint8_t> out(per_expert * shape.experts);
  const unsigned w = csf_window(shape.format);
  std::vector<std::uint8_t> grid(shape.layout == ScaleLayout::swizzled_128x4 ? per_expert : 0);

  // The tensor-wide part of the column effects, shared by every expert.
  std::vector<double> shared_col(shape.cols);
  double tensor_sigma = 0.0;
  if (dist == ScaleDistribution::realistic || dist == ScaleDistribution::dispersed) {
    Rng tensor_rng(seed, 0xC01u + std::uint64_t(dist));
    tensor_sigma = 0x1p-6 * std::exp(0.3 * tensor_rng.normal());
    for (double& z : shared_col) z = tensor_rng.normal();
  }
  for (std::uint32_t e = 0; e < shape.experts; ++e) {
    // One stream per expert: experts are reproducible alone (given the seed).
    Rng rng(seed, std::uint64_t{e} * 8 + std::uint64_t(dist) + 1);
    std::uint8_t* dst =
        shape.layout == ScaleLayout::swizzled_128x4 ? grid.data() : out.data() + e * per_expert;
    switch (dist) {
      case ScaleDistribution::realistic:
        model_grid(kRealistic, shape.format, shape.rows, shape.cols, tensor_sigma, shared_col, rng, dst);
        break;
      case ScaleDistribution::dispersed:
        model_grid(kDispersed, shape.format, shape.rows, shape.cols, tensor_sigma, shared_col, rng, dst);
        break;
      case ScaleDistribution::uniform_random: {
        std::size_t i = 0;
        for (; i + 8 <= per_expert; i += 8) {
          const std::uint64_t u = rng.next();
          for (int b = 0; b < 8; ++b) dst[i + b] = std::uint8_t(u >> (8 * b));
        }
        for (; i < per_expert; ++i) dst[i] = std::uint8_t(rng.next());
        break;
      }
      case ScaleDistribution::constant: {
        // The byte depends on the seed only, so every expert shares it.
        Rng pick(seed, 0);
        std::fill(dst, dst + per_expert, std::uint8_t(pick.next()));
        break;
      }
      case ScaleDistribution::extremes: {
        // A quarter of the bytes are edge patterns (zero, NaN, sign-only,
        // saturation); the rest sit in a narrow band of one window so that
        // rows still have a clear base.
        static constexpr std::uint8_t kSpecial[] = {0x00, 0x01, 0x7E, 0x7F, 0x80, 0xFE, 0xFF};
        Rng pick(seed, 0);
        const std::uint8_t band = std::uint8_t(0x20 + pick.next() % 0x40);
        for (std::size_t i = 0; i < per_expert; ++i) {
          const std::uint64_t u = rng.next();
          dst[i] = (u & 3) == 0 ? kSpecial[(u >> 8) % 7] : std::uint8_t(band + (u >> 16) % w);
        }
        break;
      }
      default:
        throw InvalidArgument("synthetic_scales: unknown distribution " + std::to_string(int(dist)));
    }
    if (shape.layout == ScaleLayout::swizzled_128x4) {
      std::uint8_t* o = out.data() + e * per_expert;
      for (std::uint32_t r = 0; r < shape.rows; ++r)
        for (std::uint32_t c = 0; c < shape.cols; ++c)
          o[swizzled_index(r, c, shape.cols)] = grid[std::size_t{r} * shape.cols + c];
    }
  }
  return out;
}

QuantizedMatrix synthetic_expert_matrix(ScaleFormat f, std::size_t rows, std::size_t cols,
                                        std::uint64_t seed) {
  if (f != ScaleFormat::nvfp4 && f != ScaleFormat::mxfp4)
    throw InvalidArgument("synthetic_expert_matrix: unknown scale format " + std::to_string(unsigned(f)));
  const unsigned g = group_size(f);
  if (rows == 0 || cols == 0 || cols % g != 0)
    throw InvalidArgument("synthetic_expert_matrix: shape " + std::to_string(rows) + " x " +
                          std::to_string(cols) + " needs non-zero sizes and cols a multiple of " +
                          std::to_string(g));
  // Draw every weight of the model explicitly (same parameters as the
  // "realistic" scale grids), then quantize with the real recipe.
  const WeightModel& m = kRealistic;
  Rng rng(seed, 0x5EED);
  const double sigma = 0x1p-6 * std::exp(0.3 * rng.normal());
  std::vector<double> col(cols / g);
  for (double& c : col) c = std::exp(m.col_sigma * rng.normal());
  std::vector<float> x(rows * cols);
  for (std::size_t r = 0; r < rows; ++r) {
    const double row_mag = sigma * std::exp(m.row_sigma * rng.normal());
    for (std::size_t b = 0; b < cols / g; ++b) {
      const double t = row_mag * col[b] * std::exp(m.block_sigma * rng.normal());
      for (std::size_t i = 0; i < g; ++i) {
        const double z = rng.normal() * (rng.uniform() < m.p_out ? m.k_out : 1.0);
        x[r * cols + b * g + i] = float(t * z);
      }
    }
  }
  return f == ScaleFormat::nvfp4 ? quantize_nvfp4(x, rows, cols) : quantize_mxfp4(x, rows, cols);
}

}  // namespace csfmoe
