// Synthetic scale grids and MoE layers of real geometries, for tests,
// benchmarks and `csf` demos. Deterministic for a given seed.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "csfmoe/codec.hpp"
#include "csfmoe/quantize.hpp"

namespace csfmoe {

// splitmix64: advances `state` and returns the next 64 random bits. The seed
// expander of every generator here; its output is fixed (the bundled sample
// and the tests' expected data depend on it).
inline std::uint64_t splitmix64(std::uint64_t& s) {
  std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

struct MoeGeometry {
  std::string_view name;
  std::uint32_t hidden = 0;        // H
  std::uint32_t intermediate = 0;  // N (moe intermediate size)
  std::uint32_t experts = 0;       // E
  std::uint32_t topk = 0;
};

inline constexpr MoeGeometry kDeepSeekV3{"deepseek-v3", 7168, 2048, 256, 8};
inline constexpr MoeGeometry kKimiK2{"kimi-k2", 7168, 2048, 384, 8};
inline constexpr MoeGeometry kQwen3_30B_A3B{"qwen3-30b-a3b", 2048, 768, 128, 8};
inline constexpr MoeGeometry kQwen3_235B_A22B{"qwen3-235b-a22b", 4096, 1536, 128, 8};

// The layers b12x reports CSF numbers on. A "-tpN" geometry is one rank's
// shard: intermediate = N / TP, so w13 has 2N / TP rows and w2 rows of
// C = N / (TP * g) scales. Where no public config was at hand the sizes are
// derived, as each comment says; the quoted C is the one b12x reports.
// GLM-5.3: assumed GLM-5-class (H 6144, N 2048, 256 experts, top-8).
inline constexpr MoeGeometry kGlm5_3{"glm-5.3", 6144, 2048, 256, 8};
inline constexpr MoeGeometry kGlm5_3Tp2{"glm-5.3-tp2", 6144, 1024, 256, 8};
// Qwen3.8 TP2, C = 20 on MXFP4 w2 (40 on NVFP4): N / 2 = 640, so N = 1280;
// H, experts and top-k taken from the Qwen3.5-class layout (4096, 512, 10).
inline constexpr MoeGeometry kQwen3_8Tp2{"qwen3.8-tp2", 4096, 640, 512, 10};
// DeepSeek-4.1 TP4, C = 18 on MXFP4 w2: N / 4 = 576, so N = 2304; H,
// experts and top-k as DeepSeek-V3.
inline constexpr MoeGeometry kDeepSeek4_1Tp4{"deepseek-4.1-tp4", 7168, 576, 256, 8};
// Kimi TP12 / TP16, C = 8 / 6 on MXFP4 w2 (b12x's ~35 % at C = 6 is MXFP4's
// 2 bytes per 6): both give N = 96 * 32 = 3072; H, experts, top-k as Kimi-K2.
inline constexpr MoeGeometry kKimiTp12{"kimi-tp12", 7168, 256, 384, 8};
inline constexpr MoeGeometry kKimiTp16{"kimi-tp16", 7168, 192, 384, 8};
// Not an MoE: SmolLM2-135M's 30 dense SwiGLU FFNs stacked as 30 experts, the
// real weights the "realistic" scales are calibrated on (scripts/real-weights).
inline constexpr MoeGeometry kSmolLM2_135MFfn{"smollm2-135m-ffn", 576, 1536, 30, 1};

// Every geometry above, in a fixed order.
std::span<const MoeGeometry* const> moe_geometries();
// Lookup by name ("deepseek-v3", ...); throws InvalidArgument listing the known names.
const MoeGeometry& moe_geometry(std::string_view name);

// Shapes of a layer's two scale tensors: w13 [E, 2N, H/g] and w2 [E, H, N/g].
GridShape w13_scale_shape(const MoeGeometry& g, ScaleFormat f, ScaleLayout l = ScaleLayout::row_major);
GridShape w2_scale_shape(const MoeGeometry& g, ScaleFormat f, ScaleLayout l = ScaleLayout::row_major);

enum class ScaleDistribution {
  realistic,       // like real FFN weights' scales (calibration: src/codec/synthetic.cpp)
  dispersed,       // near the NVFP4 break-even (~12.5% exceptions)
  uniform_random,  // every byte uniform in 0..255 (almost all exceptions)
  constant,        // one byte everywhere
  extremes,        // mix of 0x00, 0x7F, 0xFF, 0x80, NaN patterns and a narrow band
};

// A native scale tensor (shape.layout) with the given byte distribution.
std::vector<std::uint8_t> synthetic_scales(const GridShape& shape, ScaleDistribution dist,
                                           std::uint64_t seed);

// A quantized expert matrix (rows x cols) from random weights with
// realistic per-row and per-block magnitude variation.
QuantizedMatrix synthetic_expert_matrix(ScaleFormat f, std::size_t rows, std::size_t cols,
                                        std::uint64_t seed);

}  // namespace csfmoe
