// Finding the block-scale tensors of a safetensors header (internal).
#pragma once

#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "csfmoe/codec.hpp"
#include "csfmoe/safetensors.hpp"

namespace csfmoe::detail {

struct ScaleCandidate {
  std::string name;       // the scale tensor
  std::string companion;  // the weight tensor that proves what it is
  GridShape shape;
  std::string layer;  // MoE layer key or ""
};

struct Detection {
  std::vector<ScaleCandidate> scales;
  // Tensors whose names look like block scales but that were not taken, and why.
  std::map<std::string, std::string> rejected;
  const ScaleCandidate* find(std::string_view name) const;
};

// Finds NVFP4 (ModelOpt: X.weight U8 [.., R, K/2] + X.weight_scale F8_E4M3
// [.., R, K/16]) and MXFP4 (gpt-oss: X_blocks U8 [.., R, K/32, 16] + X_scales
// U8 [.., R, K/32]; or X.weight + X.weight_scale with K/32 columns; or
// DeepSeek-V4.1's S.weight + S.scale, F8_E8M0) scale tensors. Leading dimensions are stacked experts. A scale
// whose shape proves its format but whose dtype is wrong throws FormatError naming `label` and the tensor.
Detection detect_scales(const st::Header& header, ScaleLayout layout, const std::string& label);

// The layout of a file's scale tensors: its __metadata__ kScaleLayoutKey tag
// if present, else `requested`, else row_major. A request that contradicts
// the tag, or a tag that names no layout, throws (InvalidArgument /
// FormatError) naming `label`.
ScaleLayout source_layout(const st::Header& header, std::optional<ScaleLayout> requested,
                          const std::string& label);

// "model.layers.3.mlp.experts.17.w1.weight_scale" -> "model.layers.3.mlp.experts"; "" if not an expert
// tensor.
std::string moe_layer_key(std::string_view name);

// "[d0, d1, ...]", as messages name a tensor shape.
std::string shape_str(const std::vector<std::uint64_t>& shape);

}  // namespace csfmoe::detail
