// The CSF layout header (csfmoe/detail/csf_layout.hpp), which the CPU codec,
// the GPU codec and the MoE kernels all address the parts through: every
// (row, col) of small and odd grids of both formats against formulas written
// independently from docs/csf-format.md, bijectivity over a slab, record
// round trips and limits, and agreement with what the CPU encoder writes.
#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <random>
#include <vector>

#include "csfmoe/codec.hpp"
#include "csfmoe/detail/csf_layout.hpp"
#include "csfmoe/errors.hpp"
#include "test_seed.hpp"

namespace csfmoe {
namespace {

using u32 = std::uint32_t;
using u64 = std::uint64_t;

constexpr ScaleFormat kFormats[] = {ScaleFormat::nvfp4, ScaleFormat::mxfp4};

// --- The document's formulas, written out again without the header. -------
u64 doc_padded_rows(ScaleFormat f, u64 r) {
  return f == ScaleFormat::nvfp4 ? (r + 127) / 128 * 128 : (r + 63) / 64 * 64;
}
u64 doc_padded_cols(ScaleFormat f, u64 c) { return f == ScaleFormat::nvfp4 ? (c + 3) / 4 * 4 : c; }
u64 doc_slab_rows(ScaleFormat f) { return f == ScaleFormat::nvfp4 ? 128 : 16; }
u64 doc_slab_bytes(ScaleFormat f, u64 pc) {
  return f == ScaleFormat::nvfp4 ? 128 * (1 + pc / 2) : 16 * (1 + (pc + 7) / 8);
}
// "the base of row r is at (r % 32) * 4 + (r % 128) / 32" / "at r % 16".
u64 doc_base_byte(ScaleFormat f, u64 r) {
  return f == ScaleFormat::nvfp4 ? (r % 32) * 4 + (r % 128) / 32 : r % 16;
}
// NVFP4: "nibble n = (r % 32) * 16 + ((r % 128) / 32) * 4 + (c % 4) of group
// g = c / 4, i.e. byte 128 + g * 256 + n / 2 of the slab, low nibble when n
// is even".
struct DocNibble {
  u64 byte;
  unsigned shift;
};
DocNibble doc_nvfp4_offset(u64 r, u64 c) {
  const u64 n = (r % 32) * 16 + ((r % 128) / 32) * 4 + (c % 4);
  return {128 + (c / 4) * 256 + n / 2, unsigned(n % 2 == 0 ? 0 : 4)};
}
// MXFP4: "per row, in order, ceil(padded_cols / 8) mask bytes: bit j of byte
// k is element 8k + j", after the 16 bases.
DocNibble doc_mxfp4_offset(u64 r, u64 c, u64 pc) {
  return {16 + (r % 16) * ((pc + 7) / 8) + c / 8, unsigned(c % 8)};
}

// Small and odd grids (rows, cols) of one expert.
const std::vector<std::pair<u32, u32>> kGrids = {{1, 1},   {1, 4},   {3, 5},    {16, 8},  {17, 9},
                                                 {63, 15}, {64, 16}, {65, 33},  {127, 3}, {128, 4},
                                                 {129, 7}, {200, 2}, {256, 12}, {31, 64}};

TEST(CsfLayout, GeometryMatchesTheDocumentAndCsfGeometry) {
  for (ScaleFormat f : kFormats)
    for (auto [rows, cols] : kGrids) {
      const u64 pr = csf::padded_rows(f, rows), pc = csf::padded_cols(f, cols);
      EXPECT_EQ(pr, doc_padded_rows(f, rows));
      EXPECT_EQ(pc, doc_padded_cols(f, cols));
      EXPECT_EQ(csf_slab_rows(f), doc_slab_rows(f));
      EXPECT_EQ(csf::slab_base_bytes(f), doc_slab_rows(f));
      EXPECT_EQ(csf::slab_bytes(f, pc), doc_slab_bytes(f, pc));
      EXPECT_EQ(csf::slabs_per_expert(f, pr) * doc_slab_rows(f), pr);
      const CsfGeometry g = CsfGeometry::of({f, ScaleLayout::row_major, 3, rows, cols});
      EXPECT_EQ(g.padded_rows, pr);
      EXPECT_EQ(g.padded_cols, pc);
      EXPECT_EQ(g.slab_bytes, csf::slab_bytes(f, pc));
      EXPECT_EQ(g.fixed_bytes_per_expert, csf::slabs_per_expert(f, pr) * g.slab_bytes);
      const csf::LayoutView v = g.layout();
      EXPECT_EQ(v.padded_rows, g.padded_rows);
      EXPECT_EQ(v.padded_cols, g.padded_cols);
      EXPECT_EQ(v.slab_bytes, g.slab_bytes);
      EXPECT_EQ(v.fixed_bytes_per_expert, g.fixed_bytes_per_expert);
      EXPECT_EQ(v.mask_bytes(), (pc + 7) / 8);
      for (u32 e = 0; e < 3; ++e)
        for (u32 r = 0; r < pr; ++r)
          ASSERT_EQ(f == ScaleFormat::nvfp4 ? v.slab_offset<ScaleFormat::nvfp4>(e, r)
                                            : v.slab_offset<ScaleFormat::mxfp4>(e, r),
                    e * g.fixed_bytes_per_expert + (r / doc_slab_rows(f)) * g.slab_bytes)
              << "e=" << e << " r=" << r;
    }
}

// Every cell of every slab row: the header's byte/shift equals the
// document's, and over one slab the (base bytes, offset slots) of all cells
// are pairwise distinct and tile the slab exactly (NVFP4 nibbles / MXFP4
// bits past the padded columns are the only unused slots).
TEST(CsfLayout, EveryCellOfASlabHasItsOwnSlot) {
  for (ScaleFormat f : kFormats)
    for (auto [rows, cols] : kGrids) {
      const u32 pc = u32(csf::padded_cols(f, cols));
      const u32 sr = csf_slab_rows(f);
      const u64 sb = csf::slab_bytes(f, pc);
      std::vector<int> base_owner(sr, -1);
      std::vector<unsigned> used(sb, 0);  // bit mask of the used bits per slab byte
      for (u32 r = 0; r < sr; ++r) {
        const u32 b = csf::base_index(f, r);
        ASSERT_EQ(b, doc_base_byte(f, r));
        ASSERT_LT(b, sr);
        ASSERT_EQ(base_owner[b], -1) << "two rows share base byte " << b;
        base_owner[b] = int(r);
        // Rows of the next slab reuse the same byte.
        ASSERT_EQ(csf::base_index(f, r + sr), b);
        for (u32 c = 0; c < pc; ++c) {
          DocNibble got{}, want{};
          unsigned width = 0;
          if (f == ScaleFormat::nvfp4) {
            got = {csf::nvfp4_offset_byte(r, c), csf::nvfp4_offset_shift(r, c)};
            want = doc_nvfp4_offset(r, c);
            ASSERT_EQ(csf::nvfp4_offset_nibble(r, c), 2 * (want.byte - 128) + want.shift / 4);
            // The nibble order of a 4-column group is the 128x4 swizzle order.
            ASSERT_EQ(csf::nvfp4_offset_nibble(r, c), swizzled_index(r, c, pc));
            // The row's two bytes of group c / 4.
            ASSERT_EQ(128 + (c / 4) * csf::nvfp4_group_bytes + csf::nvfp4_row_in_group(r) + (c % 4) / 2,
                      got.byte);
            width = 4;
          } else {
            got = {csf::mxfp4_offset_byte(r, c, pc), csf::mxfp4_offset_bit(c)};
            want = doc_mxfp4_offset(r, c, pc);
            width = 1;
          }
          ASSERT_EQ(got.byte, want.byte) << "r=" << r << " c=" << c;
          ASSERT_EQ(got.shift, want.shift) << "r=" << r << " c=" << c;
          ASSERT_GE(got.byte, sr);
          ASSERT_LT(got.byte, sb);
          const unsigned bits = ((1u << width) - 1) << got.shift;
          ASSERT_EQ(used[got.byte] & bits, 0u) << "slot of (" << r << ", " << c << ") taken twice";
          used[got.byte] |= bits;
        }
      }
      // Base bytes all used; offset bytes fully used except the MXFP4 bits
      // past the padded columns of each row's last mask byte.
      for (u32 b = 0; b < sr; ++b) EXPECT_NE(base_owner[b], -1);
      u64 used_bits = 0;
      for (u64 i = sr; i < sb; ++i) used_bits += unsigned(std::popcount(used[i]));
      const u64 slots = u64{sr} * pc * (f == ScaleFormat::nvfp4 ? 4 : 1);
      EXPECT_EQ(used_bits, slots);
      if (f == ScaleFormat::nvfp4)
        EXPECT_EQ((sb - sr) * 8, slots);
      else
        EXPECT_EQ((sb - sr) * 8, u64{sr} * ((pc + 7) / 8) * 8);
    }
}

TEST(CsfLayout, PositionsAreABijectionOfThePaddedGrid) {
  for (ScaleFormat f : kFormats)
    for (auto [rows, cols] : kGrids) {
      const u32 pr = u32(csf::padded_rows(f, rows)), pc = u32(csf::padded_cols(f, cols));
      u32 expect = 0;
      for (u32 r = 0; r < pr; ++r)
        for (u32 c = 0; c < pc; ++c, ++expect) {
          const u32 pos = csf::position(r, c, pc);
          ASSERT_EQ(pos, expect);  // row-major, dense: a bijection onto [0, pr * pc)
          ASSERT_EQ(csf::position_row(pos, pc), r);
          ASSERT_EQ(csf::position_col(pos, pc), c);
        }
    }
}

TEST(CsfLayout, RecordsRoundTripAndKeep24BitPositions) {
  EXPECT_EQ(csf::record_position_bits, 24u);
  EXPECT_EQ(u64{csf::record_position_mask} + 1, csf_max_positions);
  CSFMOE_SEEDED(seed);
  std::mt19937 rng(std::uint32_t(seed ^ (seed >> 32)));
  std::vector<u32> positions = {0, 1, 0xFFFFFE, 0xFFFFFF};
  for (int i = 0; i < 4096; ++i) positions.push_back(rng() & 0xFFFFFFu);
  for (u32 pos : positions)
    for (u32 v = 0; v < 256; ++v) {
      const u32 rec = csf::make_record(pos, std::uint8_t(v));
      ASSERT_EQ(rec, (v << 24) | pos);
      ASSERT_EQ(csf::record_position(rec), pos);
      ASSERT_EQ(csf::record_value(rec), v);
      // The public names are the same functions.
      ASSERT_EQ(make_exception(pos, std::uint8_t(v)), rec);
      ASSERT_EQ(exception_position(rec), pos);
      ASSERT_EQ(exception_value(rec), v);
    }
  // Bits above 24 of a position never leak into the value.
  EXPECT_EQ(csf::make_record(0x1000000u | 5u, 7), (7u << 24) | 5u);
  // The largest accepted grid has its last position inside 24 bits.
  const CsfGeometry g = CsfGeometry::of({ScaleFormat::nvfp4, ScaleLayout::row_major, 1, 4096, 4092});
  EXPECT_LE(csf::position(g.padded_rows - 1, g.padded_cols - 1, g.padded_cols), csf::record_position_mask);
  EXPECT_THROW(CsfGeometry::of({ScaleFormat::nvfp4, ScaleLayout::row_major, 1, 4096, 4096}), InvalidArgument);
}

// What the CPU encoder writes, read back through the header: every base and
// offset slot, and the records' positions and values, against the source.
TEST(CsfLayout, AgreesWithTheCpuEncoder) {
  CSFMOE_SEEDED(seed);
  std::mt19937 rng(std::uint32_t(seed ^ (seed >> 32)));
  for (ScaleFormat f : kFormats)
    for (auto [rows, cols] : kGrids)
      for (bool reference : {false, true}) {
        const GridShape shape{f, ScaleLayout::row_major, 2, rows, cols};
        std::vector<std::uint8_t> src(u64{2} * rows * cols);
        // Mostly in a narrow band (offsets), some far away (records).
        const unsigned w = csf_window(f);
        for (auto& b : src) b = std::uint8_t(rng() % 8 == 0 ? rng() : 100 + rng() % (w + 1));
        const CsfTensor t = encode(shape, src, {1, reference});
        const CsfGeometry& g = t.geometry;
        const csf::LayoutView v = g.layout();
        for (u32 e = 0; e < 2; ++e) {
          const u32 first = t.row_prefix[u64{e} * g.padded_rows];
          std::vector<int> grid(u64{g.padded_rows} * g.padded_cols, -1);
          for (u32 i = first; i < t.row_prefix[u64{e + 1} * g.padded_rows]; ++i)
            grid[csf::record_position(t.exceptions[i])] = csf::record_value(t.exceptions[i]);
          for (u32 r = 0; r < g.padded_rows; ++r) {
            const std::uint8_t* slab =
                t.fixed.data() + csf::slab_offset(f, e, r, v.fixed_bytes_per_expert, v.slab_bytes);
            const std::uint8_t base = slab[csf::base_index(f, r)];
            ASSERT_EQ(base, row_base(t, e, r));
            for (u32 c = 0; c < g.padded_cols; ++c) {
              const unsigned off =
                  f == ScaleFormat::nvfp4
                      ? (slab[csf::nvfp4_offset_byte(r, c)] >> csf::nvfp4_offset_shift(r, c)) & 0xF
                      : (slab[csf::mxfp4_offset_byte(r, c, v.padded_cols)] >> csf::mxfp4_offset_bit(c)) & 1;
              const int rec = grid[v.position(r, c)];
              if (r >= rows || c >= cols) {
                ASSERT_EQ(off, 0u);
                ASSERT_EQ(rec, -1);
                continue;
              }
              const std::uint8_t want = src[(u64{e} * rows + r) * cols + c];
              if (rec >= 0) {
                ASSERT_EQ(off, 0u);
                ASSERT_EQ(rec, want) << "e=" << e << " r=" << r << " c=" << c;
              } else {
                ASSERT_EQ(std::uint8_t(base + off), want) << "e=" << e << " r=" << r << " c=" << c;
              }
            }
          }
        }
      }
}

}  // namespace
}  // namespace csfmoe
