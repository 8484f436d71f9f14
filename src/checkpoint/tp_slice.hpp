// Tensor-parallel slicing of a native checkpoint before it is compressed
// (internal; `csf compress --tp N --rank R`, docs/container-format.md).
#pragma once

#include <filesystem>
#include <optional>

#include "csfmoe/formats.hpp"

namespace csfmoe::detail {

// __metadata__ keys recorded in a sliced file (and so in its container).
inline constexpr const char* kTpKey = "csfmoe.tp";
inline constexpr const char* kTpRankKey = "csfmoe.tp_rank";

// Writes rank `rank`'s TP slice of `in` (a safetensors file or a checkpoint
// folder) to `out` (which must not exist): expert projections are sliced
// along N (gate/up rows, down columns), block scales along their true axes
// in each file's layout (source_layout), every other tensor and file is copied unchanged. Throws
// InvalidArgument for bad tp/rank or a split that does not divide, and
// Unsupported for an expert projection tensor whose split axis is unknown.
void slice_checkpoint_tp(const std::filesystem::path& in, const std::filesystem::path& out, unsigned tp,
                         unsigned rank, std::optional<ScaleLayout> layout);

}  // namespace csfmoe::detail
