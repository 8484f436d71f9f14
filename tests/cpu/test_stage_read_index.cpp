// The stage-read index (src/moe/stage_read_index.hpp), built on the host by
// the CPU library: every row block's K-block buckets against a brute-force
// oracle that decodes the records by hand, the patch entries' fields, and
// the builder's checks of malformed inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "csfmoe/codec.hpp"
#include "csfmoe/errors.hpp"
#include "csfmoe/formats.hpp"
#include "csfmoe/moe.hpp"
#include "moe/stage_read_index.hpp"
#include "test_seed.hpp"

namespace csfmoe {
namespace {

// Brute force: every record of a decode row block's 32 rows, as (K block,
// entry) in record order, must be the row block's K-block buckets in order;
// counts above the capacity must be marked.
struct IndexCase {
  ScaleFormat f;
  ScaleLayout layout;
  bool adversarial;
};

std::vector<std::pair<std::uint32_t, std::uint32_t>> expected_block(const CsfTensor& t,
                                                                    const moe_detail::IndexRows& r,
                                                                    std::uint32_t e, std::uint32_t b) {
  const CsfGeometry& g = t.geometry;
  const std::uint32_t cols = 128 / group_size(g.shape.format), kblocks = g.shape.cols / cols;
  std::vector<std::pair<std::uint32_t, std::uint32_t>> out;
  for (std::uint32_t br = 0; br < 32; ++br) {
    const std::uint64_t at = std::uint64_t(e) * g.padded_rows + r.row(b, br);
    for (std::uint32_t i = t.row_prefix[at]; i < t.row_prefix[at + 1]; ++i) {
      const std::uint32_t col = (t.exceptions[i] & 0xFFFFFFu) % g.padded_cols, v = t.exceptions[i] >> 24;
      if (col / cols >= kblocks) continue;
      const std::uint32_t en = g.shape.format == ScaleFormat::nvfp4
                                   ? moe_detail::exception_entry<ScaleFormat::nvfp4>(br, col % cols, v)
                                   : moe_detail::exception_entry<ScaleFormat::mxfp4>(br, col % cols, v);
      out.emplace_back(col / cols, en);
    }
  }
  std::stable_sort(out.begin(), out.end(), [](auto& a, auto& b) { return a.first < b.first; });
  return out;
}

TEST(StageReadIndex, BucketsEveryRecordOfEachDecodeRowBlock) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (const IndexCase c : {IndexCase{ScaleFormat::nvfp4, ScaleLayout::row_major, false},
                            IndexCase{ScaleFormat::nvfp4, ScaleLayout::swizzled_128x4, true},
                            IndexCase{ScaleFormat::mxfp4, ScaleLayout::row_major, true},
                            IndexCase{ScaleFormat::mxfp4, ScaleLayout::swizzled_128x4, false}}) {
    const MoeLayerGeometry geo{3, 512, 256, 2, GateUpOrder::w31};
    MoeHostWeights w = synthetic_moe_weights(c.f, geo, seed);
    if (c.adversarial)  // some row blocks full of exceptions, the rest as generated
      for (std::size_t i = 0; i < w.w13_scales.size() / 8; ++i) w.w13_scales[i] = std::uint8_t(rng());
    MoeConstraints mc;
    mc.scale_layout = c.layout;
    const MoePlan plan = plan_weights(c.f, geo, mc);
    const auto src = relayout_scales(GridShape{c.f, ScaleLayout::row_major, geo.experts, 2 * geo.intermediate,
                                               geo.hidden / group_size(c.f)},
                                     w.w13_scales, c.layout);
    const CsfTensor t = encode(plan.w13_scales, src);
    moe_detail::IndexRows rows;
    rows.first_half = geo.intermediate;  // w31: gate rows second
    rows.second_half = 0;
    rows.stride = 16;
    rows.blocks_per_expert = geo.intermediate / 16;
    for (std::uint32_t limit : {moe_detail::kIndexMaxCapacity, 16u}) {
      SCOPED_TRACE(std::string(to_string(c.f)) + (c.adversarial ? " adversarial" : " realistic") + " limit " +
                   std::to_string(limit));
      const moe_detail::StageReadIndex idx =
          moe_detail::build_stage_read_index(t.geometry, rows, t.exceptions, t.row_prefix, limit);
      const std::uint32_t kblocks = geo.hidden / 128;
      ASSERT_EQ(idx.kblocks, kblocks);
      ASSERT_EQ(idx.capacity % 8, 0u);
      ASSERT_LE(idx.capacity, limit);
      ASSERT_EQ(idx.block_bytes, moe_detail::index_block_bytes(idx.capacity, kblocks));
      ASSERT_EQ(idx.bytes.size(), std::uint64_t(geo.experts) * rows.blocks_per_expert * idx.block_bytes);
      std::uint64_t overflow = 0, largest = 0;
      for (std::uint32_t e = 0; e < geo.experts; ++e)
        for (std::uint32_t b = 0; b < rows.blocks_per_expert; ++b) {
          const auto want = expected_block(t, rows, e, b);
          largest = std::max<std::uint64_t>(largest, want.size());
          const std::uint8_t* blk =
              idx.bytes.data() + (std::uint64_t(e) * rows.blocks_per_expert + b) * idx.block_bytes;
          const std::uint8_t* off = blk + 2 * idx.capacity;
          if (want.size() > idx.capacity) {
            EXPECT_EQ(off[0], moe_detail::kIndexOverflow) << "expert " << e << " block " << b;
            ++overflow;
            continue;
          }
          ASSERT_EQ(off[0], 0u);
          ASSERT_EQ(off[kblocks], want.size()) << "expert " << e << " block " << b;
          for (std::uint32_t kb = 0; kb < kblocks; ++kb) {
            ASSERT_LE(off[kb], off[kb + 1]);
            for (std::uint32_t i = off[kb]; i < off[kb + 1]; ++i) {
              const std::uint32_t en = blk[2 * i] | std::uint32_t(blk[2 * i + 1]) << 8;
              ASSERT_EQ(want[i].first, kb) << "expert " << e << " block " << b << " entry " << i;
              ASSERT_EQ(want[i].second, en) << "expert " << e << " block " << b << " entry " << i;
            }
          }
        }
      EXPECT_EQ(idx.overflow_blocks, overflow);
      if (largest <= limit) EXPECT_EQ(idx.capacity, (largest + 7) / 8 * 8);
      EXPECT_GT(largest, 0u) << "no records: the case tests nothing";
      if (limit == 16u && c.adversarial) EXPECT_GT(overflow, 0u);  // full row blocks overflow a small index
    }
  }
}

TEST(StageReadIndex, EntryFieldsAndBadInputs) {
  // Entry fields: lane g, lane t, byte index p, byte.
  for (std::uint32_t br = 0; br < 32; ++br)
    for (std::uint32_t cb = 0; cb < 8; ++cb) {
      const std::uint32_t n = moe_detail::exception_entry<ScaleFormat::nvfp4>(br, cb, 0xA5);
      EXPECT_EQ(n & 7u, br % 8);
      EXPECT_EQ(n >> 3 & 3u, cb / 2);
      EXPECT_EQ(n >> 5 & 7u, 2 * (br / 8) + cb % 2);
      EXPECT_EQ(n >> 8, 0xA5u);
      if (cb < 4) {
        const std::uint32_t m = moe_detail::exception_entry<ScaleFormat::mxfp4>(br, cb, 0x5A);
        EXPECT_EQ(m >> 3 & 3u, cb);
        EXPECT_EQ(m >> 5 & 7u, br / 8);
      }
    }
  const GridShape shape{ScaleFormat::nvfp4, ScaleLayout::row_major, 2, 64, 16};
  std::vector<std::uint8_t> src(std::size_t{2} * 64 * 16, 0x38);
  src[5] = 0x01, src[700] = 0x7E;  // two exceptions
  const CsfTensor t = encode(shape, src);
  moe_detail::IndexRows rows;
  rows.blocks_per_expert = 2;
  EXPECT_EQ(moe_detail::build_stage_read_index(t.geometry, rows, t.exceptions, t.row_prefix).overflow_blocks,
            0u);
  std::vector<std::uint32_t> prefix = t.row_prefix;
  prefix.pop_back();
  EXPECT_THROW(moe_detail::build_stage_read_index(t.geometry, rows, t.exceptions, prefix), FormatError);
  prefix = t.row_prefix;
  if (t.exceptions.size() >= 2) {
    std::vector<std::uint32_t> moved = t.exceptions;
    moved[0] = (moved[0] & 0xFF000000u) | (moved[1] & 0xFFFFFFu);  // a record in the wrong row
    if ((moved[0] & 0xFFFFFFu) / t.geometry.padded_cols !=
        (t.exceptions[0] & 0xFFFFFFu) / t.geometry.padded_cols)
      EXPECT_THROW(moe_detail::build_stage_read_index(t.geometry, rows, moved, prefix), FormatError);
  }
  rows.blocks_per_expert = 3;  // rows 64..95 of a 64-row grid
  EXPECT_THROW(moe_detail::build_stage_read_index(t.geometry, rows, t.exceptions, prefix), InvalidArgument);
  const GridShape odd{ScaleFormat::nvfp4, ScaleLayout::row_major, 1, 32, 12};  // K = 192: no whole K blocks
  std::vector<std::uint8_t> src_odd(32 * 12, 0x38);
  const CsfTensor t_odd = encode(odd, src_odd);
  rows.blocks_per_expert = 1;
  EXPECT_TRUE(moe_detail::build_stage_read_index(t_odd.geometry, rows, t_odd.exceptions, t_odd.row_prefix)
                  .bytes.empty());
}

}  // namespace
}  // namespace csfmoe
