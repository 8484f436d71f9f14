// Tensor-parallel slicing of a native checkpoint before it is compressed
// (internal; `csf compress --tp N --rank R`, docs/container-format.md).
#pragma once

#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "csfmoe/b12x_planes.hpp"
#include "csfmoe/checkpoint.hpp"
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
//
// The input may also be compressed (a container or a file written by
// b12x / vLLM, or a folder of them): its tensors are read (CRC-checked,
// decoded) and the slice written native as above. With `planes`, each CSF
// tensor whose slice falls on plane boundaries (rows on 16-row slabs, NVFP4
// columns on even pairs) also gets its planes sliced without re-encoding
// (slice_planes: bases keep their full-row values, records filtered and
// re-addressed), keyed by file name ("" for a single file) and tensor, for
// the compressor to store instead of encoding the slice again.
//
// A folder's model.safetensors.index.json is copied with its
// metadata.total_size set to the slice's data bytes. `progress` gets the
// source bytes read, out of source + slice bytes (the rest of the job:
// compressing the slice); the sizes are returned.
using SlicedPlanes = std::map<std::string, std::map<std::string, std::vector<CsfPlanes>>>;
struct TpSliceBytes {
  std::uint64_t source = 0;  // logical bytes of the input's tensors
  std::uint64_t sliced = 0;  // data bytes of the slice written
  std::uint64_t done = 0;
};
TpSliceBytes slice_checkpoint_tp(const std::filesystem::path& in, const std::filesystem::path& out,
                                 unsigned tp, unsigned rank, std::optional<ScaleLayout> layout,
                                 SlicedPlanes* planes = nullptr, const ProgressFn& progress = {});

}  // namespace csfmoe::detail
