// The GPU codec's expansion plan (src/codec/expand_plan.hpp), checked on the
// CPU over many geometries against what the expansion kernel relies on: the
// units of an expert cover every output row (and, for split NVFP4 row-major
// grids, every column group) exactly once with whole partitions, the staged
// bytes fit the shared-memory limit in 16-byte multiples, and the job carries
// the tensor's geometry. The expected values are written from
// docs/csf-format.md and docs/gpu-codec.md, not from the planner.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "codec/expand_plan.hpp"
#include "csfmoe/codec.hpp"

namespace csfmoe {
namespace {

using codec_detail::ExpandJob;
using codec_detail::ExpandPlan;
using codec_detail::kMaxExpandStage;
using codec_detail::plan_expand_job;
using u32 = std::uint32_t;
using u64 = std::uint64_t;

constexpr ScaleFormat kFormats[] = {ScaleFormat::nvfp4, ScaleFormat::mxfp4};
constexpr ScaleLayout kLayouts[] = {ScaleLayout::row_major, ScaleLayout::swizzled_128x4};
constexpr u64 kDefaultSharedLimit = 48 * 1024;  // dynamic shared memory without an opt-in

u64 up(u64 x, u64 m) { return (x + m - 1) / m * m; }
u64 div_up(u64 x, u64 m) { return (x + m - 1) / m; }

// Distinct addresses the plan must pass through untouched (never dereferenced).
const auto* const kFixed = reinterpret_cast<const std::uint8_t*>(std::uintptr_t{0x1000});
const auto* const kExceptions = reinterpret_cast<const u32*>(std::uintptr_t{0x2000});
const auto* const kPartitionIndex = reinterpret_cast<const u32*>(std::uintptr_t{0x3000});
auto* const kDst = reinterpret_cast<std::uint8_t*>(std::uintptr_t{0x4000});

ExpandPlan plan_of(const CsfGeometry& g, ScaleLayout out) {
  return plan_expand_job(g, kFixed, kExceptions, kPartitionIndex, out, kDst);
}

// Every property of one plan.
void check_plan(const GridShape& shape, ScaleLayout out) {
  const CsfGeometry g = CsfGeometry::of(shape);
  const ExpandPlan plan = plan_of(g, out);
  const ExpandJob& J = plan.job;
  SCOPED_TRACE(to_string(shape) + " -> " +
               std::string(out == ScaleLayout::row_major ? "row_major" : "swizzled"));
  const bool nv = shape.format == ScaleFormat::nvfp4;
  const bool rm = out == ScaleLayout::row_major;

  // The job carries the parts and the geometry.
  EXPECT_EQ(J.fixed, kFixed);
  EXPECT_EQ(J.exceptions, kExceptions);
  EXPECT_EQ(J.partition_index, kPartitionIndex);
  EXPECT_EQ(J.dst, kDst);
  EXPECT_EQ(J.rows, shape.rows);
  EXPECT_EQ(J.cols, shape.cols);
  EXPECT_EQ(J.layout.padded_rows, g.padded_rows);
  EXPECT_EQ(J.layout.padded_cols, g.padded_cols);
  EXPECT_EQ(J.layout.slab_bytes, g.slab_bytes);
  EXPECT_EQ(J.layout.fixed_bytes_per_expert, g.fixed_bytes_per_expert);
  EXPECT_EQ(J.partition_rows, g.partition_rows);
  EXPECT_EQ(J.partitions, g.partitions_per_expert);
  EXPECT_EQ(J.out_per_expert, g.native_bytes(out) / shape.experts);
  // Output grid: row-major is the true grid; swizzled pads to 128x4 tiles.
  const u64 out_rows = rm ? shape.rows : up(shape.rows, 128);
  const u64 out_cols = rm ? shape.cols : up(shape.cols, 4);
  EXPECT_EQ(J.out_rows, out_rows);
  EXPECT_EQ(J.out_cols, out_cols);
  EXPECT_EQ(J.out_per_expert, out_rows * out_cols);
  EXPECT_EQ(J.mask_bytes, nv ? 0u : div_up(g.padded_cols, 8));  // MXFP4: one offset bit per column

  // Units hold whole partitions (and whole 128-row tiles when swizzled).
  ASSERT_GT(J.unit_rows, 0u);
  EXPECT_EQ(J.unit_rows % g.partition_rows, 0u);
  if (!rm) EXPECT_EQ(J.unit_rows % 128, 0u);
  EXPECT_EQ(J.units, u64{J.row_units} * J.col_units);

  // Row units [u * unit_rows, (u + 1) * unit_rows) tile the output rows of an
  // expert exactly once, none empty.
  std::vector<int> row_hits(out_rows, 0);
  for (u64 u = 0; u < J.row_units; ++u) {
    const u64 begin = u * J.unit_rows;
    EXPECT_LT(begin, out_rows) << "row unit " << u << " is empty";
    for (u64 r = begin; r < std::min<u64>(begin + J.unit_rows, out_rows); ++r) ++row_hits[r];
  }
  for (u64 r = 0; r < out_rows; ++r) ASSERT_EQ(row_hits[r], 1) << "output row " << r;
  // The CSF rows a unit reads stay inside the padded grid.
  if (nv) EXPECT_LE(u64{J.row_units} * J.unit_rows, g.padded_rows);

  if (nv && rm) {
    // Column units [c * unit_groups, (c + 1) * unit_groups) tile the 4-column
    // groups of a slab exactly once, none empty.
    const u64 groups = g.padded_cols / 4;
    ASSERT_GT(J.unit_groups, 0u);
    ASSERT_GE(J.col_units, 1u);
    std::vector<int> group_hits(groups, 0);
    for (u64 c = 0; c < J.col_units; ++c) {
      const u64 begin = c * J.unit_groups;
      EXPECT_LT(begin, groups) << "column unit " << c << " is empty";
      for (u64 k = begin; k < std::min<u64>(begin + J.unit_groups, groups); ++k) ++group_hits[k];
    }
    for (u64 k = 0; k < groups; ++k) ASSERT_EQ(group_hits[k], 1) << "column group " << k;
    // The staged slab piece: 128 bases, then the unit's groups at their
    // padded shared-memory stride.
    EXPECT_GE(plan.stage_bytes, 128 + u64{J.unit_groups} * codec_detail::kGroupStride);
  } else {
    EXPECT_EQ(J.col_units, 1u);
  }

  if (nv) {
    EXPECT_EQ(J.staged, 0u);
    if (!rm) EXPECT_EQ(plan.stage_bytes, 0u);  // swizzled NVFP4 reads the slabs in place
  } else {
    // The slabs of one unit (16 rows each), staged whenever they fit.
    const u64 slab_bytes = 16 * (1 + div_up(g.padded_cols, 8));
    const u64 unit_slab_bytes = J.unit_rows / 16 * slab_bytes;
    EXPECT_EQ(J.staged, unit_slab_bytes <= kMaxExpandStage ? 1u : 0u);
    EXPECT_EQ(plan.stage_bytes, J.staged ? unit_slab_bytes : 0u);
    // Row-major units grow to the target size unless one unit holds the expert.
    if (rm && J.row_units > 1) EXPECT_GE(u64{J.unit_rows} * shape.cols, codec_detail::kMxUnitTarget);
  }
  EXPECT_EQ(plan.stage_bytes % 16, 0u);
  EXPECT_LE(plan.stage_bytes, kMaxExpandStage);
  EXPECT_LE(kMaxExpandStage, kDefaultSharedLimit);
}

TEST(ExpandPlan, TilesEveryGeometry) {
  const u32 rows[] = {1, 2, 15, 16, 63, 64, 65, 127, 128, 129, 200, 256, 384, 1000, 4096};
  const u32 cols[] = {1,   2,   3,   4,   5,   7,   8,    16,   31,   64,  100,
                      224, 448, 660, 664, 668, 700, 1024, 2051, 4096, 8192};
  int checked = 0;
  for (const ScaleFormat f : kFormats)
    for (const ScaleLayout source : kLayouts)
      for (const u32 experts : {1u, 3u})
        for (const u32 r : rows)
          for (const u32 c : cols) {
            const GridShape shape{f, source, experts, r, c};
            if (source == ScaleLayout::swizzled_128x4 && (r % 128 != 0 || c % 4 != 0)) continue;
            if (u64{up(r, 128)} * up(c, 4) >= (u64{1} << 24)) continue;  // over the 24-bit positions
            for (const ScaleLayout out : kLayouts) {
              check_plan(shape, out);
              ++checked;
            }
            if (::testing::Test::HasFatalFailure()) return;
          }
  EXPECT_GT(checked, 1000);
}

// DeepSeek-V3 w13 scales: the NVFP4 slab fits one unit, the MXFP4 units are staged.
TEST(ExpandPlan, DeepSeekV3W13) {
  for (const ScaleLayout out : kLayouts) {
    const GridShape nv{ScaleFormat::nvfp4, ScaleLayout::swizzled_128x4, 256, 4096, 448};
    check_plan(nv, out);
    const ExpandPlan pn = plan_of(CsfGeometry::of(nv), out);
    EXPECT_EQ(pn.job.col_units, 1u);
    EXPECT_EQ(pn.job.units, 4096u / 128);

    const GridShape mx{ScaleFormat::mxfp4, ScaleLayout::swizzled_128x4, 256, 4096, 224};
    check_plan(mx, out);
    EXPECT_EQ(plan_of(CsfGeometry::of(mx), out).job.staged, 1u);
  }
}

// A slab too wide for one staging area: NVFP4 row-major splits its columns.
TEST(ExpandPlan, WideNvfp4RowMajorSplitsColumns) {
  for (const u32 cols : {1024u, 2051u, 8192u}) {
    const GridShape shape{ScaleFormat::nvfp4, ScaleLayout::row_major, 2, 256, cols};
    check_plan(shape, ScaleLayout::row_major);
    const ExpandPlan plan = plan_of(CsfGeometry::of(shape), ScaleLayout::row_major);
    EXPECT_GT(plan.job.col_units, 1u) << cols;
    EXPECT_EQ(plan.job.units, 2 * plan.job.col_units) << cols;
  }
}

// Very wide MXFP4 rows whose unit slabs exceed the limit are read in place.
TEST(ExpandPlan, WideMxfp4UnitsUnstaged) {
  const GridShape shape{ScaleFormat::mxfp4, ScaleLayout::row_major, 1, 256, 8192};
  check_plan(shape, ScaleLayout::row_major);
  const ExpandPlan plan = plan_of(CsfGeometry::of(shape), ScaleLayout::row_major);
  EXPECT_EQ(plan.job.staged, 0u);
  EXPECT_EQ(plan.stage_bytes, 0u);
}

}  // namespace
}  // namespace csfmoe
