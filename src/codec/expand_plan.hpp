// Work split of the GPU codec's expansion kernel (src/cuda/codec/csf_codec.cuh):
// how one CSF tensor is cut into units (ranges of whole partitions and, for
// wide NVFP4 row-major grids, of column groups) and how much shared memory a
// unit stages. Host code without CUDA, so the CPU tests and sanitizers cover
// it; the kernels take ExpandJob as a kernel parameter (keep it POD).
#pragma once

#include <cstdint>
#include <type_traits>

#include "csfmoe/codec.hpp"
#include "csfmoe/detail/csf_layout.hpp"
#include "csfmoe/formats.hpp"

namespace csfmoe::codec_detail {

// Padded stride of one 256-byte NVFP4 nibble group in shared memory: 272 keeps
// 16-byte alignment and spreads the groups of one row over distinct banks.
constexpr std::uint32_t kGroupStride = 272;
// Largest staging area (bytes) for one expansion unit; wider NVFP4 row-major
// grids split their columns over several units. Stays under the 48 KB default
// dynamic shared-memory limit.
constexpr std::uint32_t kMaxExpandStage = 44 * 1024;
// MXFP4 units are grown to at least this many output bytes.
constexpr std::uint64_t kMxUnitTarget = 16 * 1024;

// One tensor to expand. A unit is a range of whole partitions (rows) and,
// for very wide NVFP4 row-major grids, a range of column groups.
struct ExpandJob {
  const std::uint8_t* fixed = nullptr;
  const std::uint32_t* exceptions = nullptr;
  const std::uint32_t* partition_index = nullptr;
  std::uint8_t* dst = nullptr;
  csf::LayoutView layout;            // of the CSF parts
  std::uint64_t out_per_expert = 0;  // native bytes of one expert in the output layout
  std::uint32_t rows = 0, cols = 0;  // true grid
  std::uint32_t out_cols = 0;        // row length of the output layout (cols or round_up(cols, 4))
  std::uint32_t out_rows = 0;        // rows of the output layout (rows, or rows rounded to 128)
  std::uint32_t partition_rows = 0;
  std::uint32_t partitions = 0;   // per expert
  std::uint32_t unit_rows = 0;    // output rows per unit (multiple of partition_rows)
  std::uint32_t row_units = 0;    // units along the rows of one expert
  std::uint32_t col_units = 1;    // NVFP4 row-major: column splits per slab
  std::uint32_t unit_groups = 0;  // NVFP4 row-major: column groups per split
  std::uint32_t units = 0;        // row_units * col_units
  std::uint32_t staged = 0;       // MXFP4: the unit's slabs are staged in shared memory
  // MXFP4: layout.mask_bytes(), precomputed: the expansion loops read it per
  // row, and deriving it there costs them instructions.
  std::uint32_t mask_bytes = 0;
};
static_assert(std::is_trivially_copyable_v<ExpandJob> && std::is_standard_layout_v<ExpandJob>,
              "ExpandJob is a kernel parameter");

struct ExpandPlan {
  ExpandJob job;
  std::uint32_t stage_bytes = 0;  // dynamic shared memory one unit stages (16-byte multiple)
};

// The expansion of the tensor whose parts are `fixed`, `exceptions` and
// `partition_index` (device pointers, only copied) into `dst` in `layout`.
ExpandPlan plan_expand_job(const CsfGeometry& g, const std::uint8_t* fixed, const std::uint32_t* exceptions,
                           const std::uint32_t* partition_index, ScaleLayout layout, std::uint8_t* dst);

}  // namespace csfmoe::codec_detail
