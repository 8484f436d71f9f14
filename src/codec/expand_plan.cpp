#include "codec/expand_plan.hpp"

#include <algorithm>

namespace csfmoe::codec_detail {

using u32 = std::uint32_t;
using u64 = std::uint64_t;

ExpandPlan plan_expand_job(const CsfGeometry& g, const std::uint8_t* fixed, const std::uint32_t* exceptions,
                           const std::uint32_t* partition_index, ScaleLayout layout, std::uint8_t* dst) {
  const bool nv = g.shape.format == ScaleFormat::nvfp4;
  const bool rm = layout == ScaleLayout::row_major;
  ExpandPlan plan;
  ExpandJob& J = plan.job;
  J.fixed = fixed;
  J.exceptions = exceptions;
  J.partition_index = partition_index;
  J.dst = dst;
  J.layout = g.layout();
  J.out_per_expert = g.native_bytes(layout) / g.shape.experts;
  J.rows = g.shape.rows;
  J.cols = g.shape.cols;
  J.out_cols = rm ? g.shape.cols : static_cast<u32>(round_up(g.shape.cols, 4));
  J.out_rows = rm ? g.shape.rows : static_cast<u32>(round_up(g.shape.rows, 128));
  J.mask_bytes = nv ? 0 : J.layout.mask_bytes();
  J.partition_rows = g.partition_rows;
  J.partitions = g.partitions_per_expert;
  if (nv) {
    J.unit_rows = 128;
    J.row_units = g.padded_rows / 128;
    if (rm) {
      const u32 groups = g.padded_cols / 4;
      u32 ug = groups;
      if (128 + u64{groups} * kGroupStride > kMaxExpandStage)
        ug = (kMaxExpandStage - 128) / kGroupStride / 4 * 4;
      J.unit_groups = ug;
      J.col_units = (groups + ug - 1) / ug;
      plan.stage_bytes = static_cast<u32>(round_up(128 + u64{ug} * kGroupStride, 16));
    }
  } else if (rm) {
    const u64 rows = std::max<u64>(64, round_up((kMxUnitTarget + J.cols - 1) / J.cols, 64));
    J.unit_rows = static_cast<u32>(std::min<u64>(rows, g.padded_rows));
    J.row_units = (J.rows + J.unit_rows - 1) / J.unit_rows;
  } else {
    const u64 tile_bytes = u64{128} * J.out_cols;
    const u64 tiles = std::max<u64>(1, kMxUnitTarget / tile_bytes);
    J.unit_rows = static_cast<u32>(std::min<u64>(tiles * 128, J.out_rows));
    J.row_units = (J.out_rows + J.unit_rows - 1) / J.unit_rows;
  }
  if (!nv) {
    // Stage the unit's slabs when they fit (they do for every real geometry).
    const u64 bytes = u64{J.unit_rows / 16} * J.layout.slab_bytes;
    if (bytes <= kMaxExpandStage) {
      J.staged = 1;
      plan.stage_bytes = static_cast<u32>(bytes);
    }
  }
  J.units = J.row_units * J.col_units;
  return plan;
}

}  // namespace csfmoe::codec_detail
