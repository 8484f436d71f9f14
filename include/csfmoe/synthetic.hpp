// Synthetic scale grids and MoE layers of real geometries, for tests,
// benchmarks and `csf` demos. Deterministic for a given seed.
#pragma once

#include <cstdint>
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
// Lookup by name ("deepseek-v3", ...); throws InvalidArgument listing the known names.
const MoeGeometry& moe_geometry(std::string_view name);

// Shapes of a layer's two scale tensors: w13 [E, 2N, H/g] and w2 [E, H, N/g].
GridShape w13_scale_shape(const MoeGeometry& g, ScaleFormat f, ScaleLayout l = ScaleLayout::row_major);
GridShape w2_scale_shape(const MoeGeometry& g, ScaleFormat f, ScaleLayout l = ScaleLayout::row_major);

enum class ScaleDistribution {
  realistic,       // like real checkpoints: ~0.03-1.1% exceptions, NVFP4 ~52-55% of bytes
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
