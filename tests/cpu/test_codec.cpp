// CSF codec: reference vs fast bit-identity, exact round trips on random and
// adversarial grids, hand-checked layout cases, validation of corrupt parts.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/cpu_threads.hpp"
#include "csfmoe/codec.hpp"
#include "csfmoe/errors.hpp"
#include "csfmoe/synthetic.hpp"
#include "test_seed.hpp"

namespace csfmoe {
namespace {

using Bytes = std::vector<std::uint8_t>;

const CodecOptions kRef{1, true};
const CodecOptions kFast1{1, false};
const CodecOptions kFast3{3, false};

// --- independent helpers ---------------------------------------------------
std::uint64_t rows_swz(const GridShape& s) { return round_up(s.rows, 128); }
std::uint64_t cols_swz(const GridShape& s) { return round_up(s.cols, 4); }

// Row-major [E, R, C] of a swizzled tensor whose shape is already padded.
Bytes unswizzle(const GridShape& s, const Bytes& src) {
  Bytes out(src.size());
  const std::size_t per = std::size_t{s.rows} * s.cols;
  for (std::uint32_t e = 0; e < s.experts; ++e)
    for (std::uint32_t r = 0; r < s.rows; ++r)
      for (std::uint32_t c = 0; c < s.cols; ++c)
        out[e * per + std::size_t{r} * s.cols + c] = src[e * per + swizzled_index(r, c, s.cols)];
  return out;
}

// What a row-major source decodes to in the swizzled layout: padding columns
// hold the row's base, padding rows 0x00.
Bytes expected_swizzled(const CsfTensor& t, const Bytes& src) {
  const GridShape& s = t.geometry.shape;
  const std::uint64_t R128 = rows_swz(s), C4 = cols_swz(s);
  Bytes out(std::size_t(s.experts * R128 * C4));
  for (std::uint32_t e = 0; e < s.experts; ++e)
    for (std::uint32_t r = 0; r < R128; ++r)
      for (std::uint32_t c = 0; c < C4; ++c) {
        std::uint8_t v = 0;
        if (r < s.rows) v = c < s.cols ? src[(std::size_t{e} * s.rows + r) * s.cols + c] : row_base(t, e, r);
        out[e * R128 * C4 + swizzled_index(r, c, C4)] = v;
      }
  return out;
}

void expect_same_parts(const CsfTensor& a, const CsfTensor& b, const char* what) {
  SCOPED_TRACE(what);
  EXPECT_EQ(a.geometry.shape, b.geometry.shape);
  EXPECT_EQ(a.geometry.padded_rows, b.geometry.padded_rows);
  EXPECT_EQ(a.geometry.padded_cols, b.geometry.padded_cols);
  EXPECT_TRUE(a.fixed == b.fixed) << "fixed parts differ";
  EXPECT_TRUE(a.exceptions == b.exceptions)
      << "exceptions differ (" << a.exceptions.size() << " vs " << b.exceptions.size() << ")";
  EXPECT_TRUE(a.row_prefix == b.row_prefix) << "row_prefix differs";
  EXPECT_TRUE(a.partition_index == b.partition_index) << "partition_index differs";
}

Bytes decode_to(const CsfTensor& t, ScaleLayout l, const CodecOptions& o, bool trusted = false) {
  Bytes out(t.geometry.native_bytes(l), 0xA5);  // poisoned: every byte must be written
  decode(t, l, out, o, trusted);
  return out;
}

// Encodes with every implementation, checks they agree, and checks the round
// trip to both layouts. Returns the reference encoding.
CsfTensor check_round_trip(const GridShape& s, const Bytes& src) {
  SCOPED_TRACE("grid [" + std::to_string(s.experts) + ", " + std::to_string(s.rows) + ", " +
               std::to_string(s.cols) + "] " + std::string(to_string(s.format)) + " " +
               std::string(to_string(s.layout)));
  CsfTensor ref = encode(s, src, kRef);
  expect_same_parts(ref, encode(s, src, kFast1), "fast, 1 thread");
  expect_same_parts(ref, encode(s, src, kFast3), "fast, 3 threads");
  EXPECT_NO_THROW(validate(ref));

  for (const CodecOptions& o : {kRef, kFast1, kFast3}) {
    EXPECT_TRUE(decode_to(ref, s.layout, o) == src) << "decode to the source layout is not exact";
  }
  const ScaleLayout other =
      s.layout == ScaleLayout::row_major ? ScaleLayout::swizzled_128x4 : ScaleLayout::row_major;
  const Bytes want_other =
      s.layout == ScaleLayout::row_major ? expected_swizzled(ref, src) : unswizzle(s, src);
  for (const CodecOptions& o : {kRef, kFast1, kFast3}) {
    EXPECT_TRUE(decode_to(ref, other, o) == want_other) << "decode to the other layout differs";
  }
  return ref;
}

GridShape random_shape(std::mt19937_64& rng) {
  GridShape s;
  s.format = rng() % 2 ? ScaleFormat::nvfp4 : ScaleFormat::mxfp4;
  s.layout = rng() % 3 == 0 ? ScaleLayout::swizzled_128x4 : ScaleLayout::row_major;
  s.experts = 1 + std::uint32_t(rng() % 5);
  if (s.layout == ScaleLayout::swizzled_128x4) {
    s.rows = 128 * (1 + std::uint32_t(rng() % 3));
    s.cols = 4 * (1 + std::uint32_t(rng() % 24));
  } else {
    s.rows = 1 + std::uint32_t(rng() % 300);
    s.cols = 1 + std::uint32_t(rng() % 90);
  }
  return s;
}

// Rows with a random centre and spread plus sprinkled outliers.
Bytes banded_bytes(const GridShape& s, std::mt19937_64& rng) {
  const std::size_t n = CsfGeometry::of(s).native_bytes(s.layout);
  Bytes out(n);
  const std::size_t row = s.cols;  // approximate rows, the layout does not matter for coverage
  int centre = 0, spread = 1;
  const double outliers = std::uniform_real_distribution<double>(0.0, 0.2)(rng);
  std::bernoulli_distribution is_outlier(outliers);
  for (std::size_t i = 0; i < n; ++i) {
    if (i % row == 0) {
      centre = int(rng() % 256);
      spread = 1 + int(rng() % 24);
    }
    int v = centre + int(rng() % spread) - spread / 2;
    if (is_outlier(rng)) v = int(rng() % 256);
    out[i] = std::uint8_t(std::clamp(v, 0, 255));
  }
  return out;
}

// --- cpu_threads::for_each_index ------------------------------------------------------------
TEST(CpuThreads, VisitsEveryIndexOnce) {
  for (unsigned threads : {0u, 1u, 2u, 7u}) {
    const std::size_t n = 1000 + threads;
    std::vector<std::atomic<int>> hits(n);
    cpu_threads::for_each_index(n, threads, [&](std::size_t i) { hits[i].fetch_add(1); });
    for (std::size_t i = 0; i < n; ++i)
      ASSERT_EQ(hits[i].load(), 1) << "index " << i << " threads " << threads;
  }
  cpu_threads::for_each_index(0, 4, [](std::size_t) { FAIL() << "called for an empty range"; });
  EXPECT_GE(cpu_threads::resolve_count(0), 1u);
  EXPECT_EQ(cpu_threads::resolve_count(5), 5u);
}

TEST(CpuThreads, RethrowsTheFirstError) {
  for (unsigned threads : {1u, 3u}) {
    EXPECT_THROW(cpu_threads::for_each_index(100, threads,
                                             [](std::size_t i) {
                                               if (i == 42) throw FormatError("boom");
                                             }),
                 FormatError);
  }
}

// --- geometry ----------------------------------------------------------------
TEST(CsfGeometry, DerivedSizes) {
  const CsfGeometry nv = CsfGeometry::of({ScaleFormat::nvfp4, ScaleLayout::row_major, 3, 130, 7});
  EXPECT_EQ(nv.padded_rows, 256u);
  EXPECT_EQ(nv.padded_cols, 8u);
  EXPECT_EQ(nv.slab_rows, 128u);
  EXPECT_EQ(nv.slab_bytes, 128u * (1 + 8 / 2));
  EXPECT_EQ(nv.fixed_bytes_per_expert, 2 * nv.slab_bytes);
  EXPECT_EQ(nv.partitions_per_expert, 2u);
  EXPECT_EQ(nv.native_bytes(ScaleLayout::row_major), 3u * 130 * 7);
  EXPECT_EQ(nv.native_bytes(ScaleLayout::swizzled_128x4), 3u * 256 * 8);

  const CsfGeometry mx = CsfGeometry::of({ScaleFormat::mxfp4, ScaleLayout::row_major, 2, 65, 13});
  EXPECT_EQ(mx.padded_rows, 128u);
  EXPECT_EQ(mx.padded_cols, 13u);
  EXPECT_EQ(mx.slab_rows, 16u);
  EXPECT_EQ(mx.slab_bytes, 16u * (1 + 2));
  EXPECT_EQ(mx.fixed_bytes_per_expert, 8 * mx.slab_bytes);
  EXPECT_EQ(mx.partition_rows, 64u);
  EXPECT_EQ(mx.partitions_per_expert, 2u);
  EXPECT_EQ(mx.native_bytes(ScaleLayout::swizzled_128x4), 2u * 128 * 16);
  const CsfGeometry mx2 = CsfGeometry::of({ScaleFormat::mxfp4, ScaleLayout::row_major, 1, 10, 3});
  EXPECT_EQ(mx2.padded_rows, 64u);
  EXPECT_EQ(mx2.native_bytes(ScaleLayout::swizzled_128x4), 128u * 4);
}

TEST(CsfGeometry, RejectsBadShapes) {
  auto bad = [](GridShape s, const char* needle) {
    try {
      CsfGeometry::of(s);
      ADD_FAILURE() << "accepted a bad shape, expected: " << needle;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  bad({ScaleFormat::nvfp4, ScaleLayout::row_major, 0, 128, 4}, "at least 1");
  bad({ScaleFormat::nvfp4, ScaleLayout::row_major, 1, 0, 4}, "at least 1");
  bad({ScaleFormat::mxfp4, ScaleLayout::row_major, 1, 64, 0}, "at least 1");
  bad({ScaleFormat::nvfp4, ScaleLayout::swizzled_128x4, 1, 100, 4}, "multiple of 128");
  bad({ScaleFormat::mxfp4, ScaleLayout::swizzled_128x4, 1, 128, 6}, "multiple of 4");
  bad({ScaleFormat(7), ScaleLayout::row_major, 1, 128, 4}, "unknown scale format");
  bad({ScaleFormat::nvfp4, ScaleLayout(9), 1, 128, 4}, "unknown scale layout");
}

// Positions are 24-bit: an expert's padded grid must have fewer than 2^24 cells.
TEST(CsfGeometry, PositionLimit) {
  // NVFP4: 4096 x 4096 is exactly 2^24 positions, rejected; 4096 x 4092 fits.
  EXPECT_NO_THROW(CsfGeometry::of({ScaleFormat::nvfp4, ScaleLayout::row_major, 1, 4096, 4092}));
  for (GridShape s :
       {GridShape{ScaleFormat::nvfp4, ScaleLayout::row_major, 1, 4096, 4096},
        GridShape{ScaleFormat::nvfp4, ScaleLayout::row_major, 1, 4096, 4093},  // pads to 4096
        GridShape{ScaleFormat::nvfp4, ScaleLayout::row_major, 1, 4097, 4092},  // pads to 4224 rows
        GridShape{ScaleFormat::mxfp4, ScaleLayout::row_major, 1, 64, 262144},
        GridShape{ScaleFormat::mxfp4, ScaleLayout::row_major, 2, 0xFFFFFFFFu, 0xFFFFFFFFu}}) {
    try {
      CsfGeometry::of(s);
      ADD_FAILURE() << "accepted " << s.rows << "x" << s.cols;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("24-bit"), std::string::npos) << e.what();
    }
  }
  EXPECT_NO_THROW(CsfGeometry::of({ScaleFormat::mxfp4, ScaleLayout::row_major, 1, 64, 262143}));
}

TEST(CsfCodec, RoundTripAtThePositionLimit) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  // Largest grids below 2^24 cells; exceptions at the very last cells exercise
  // the highest positions.
  for (GridShape s : {GridShape{ScaleFormat::mxfp4, ScaleLayout::row_major, 1, 64, 262143},
                      GridShape{ScaleFormat::nvfp4, ScaleLayout::swizzled_128x4, 1, 4096, 4092}}) {
    Bytes src(CsfGeometry::of(s).native_bytes(s.layout));
    const std::uint8_t centre = std::uint8_t(100 + rng() % 50);
    for (auto& b : src) b = std::uint8_t(centre + rng() % 2);
    for (int i = 0; i < 200; ++i) src[rng() % src.size()] = std::uint8_t(rng());
    src.back() = std::uint8_t(centre + 77);
    src[src.size() - 2] = 0;
    const CsfTensor t = check_round_trip(s, src);
    ASSERT_FALSE(t.exceptions.empty());
    const std::uint32_t last = exception_position(t.exceptions.back());
    EXPECT_EQ(last, t.geometry.padded_rows * t.geometry.padded_cols - 1);
  }
}

// --- round trips ---------------------------------------------------------------
TEST(CsfCodec, RandomShapesRoundTrip) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const ScaleDistribution dists[] = {ScaleDistribution::realistic, ScaleDistribution::dispersed,
                                     ScaleDistribution::uniform_random, ScaleDistribution::constant,
                                     ScaleDistribution::extremes};
  for (int iter = 0; iter < 40; ++iter) {
    const GridShape s = random_shape(rng);
    SCOPED_TRACE("iteration " + std::to_string(iter));
    if (iter % 2 == 0) {
      check_round_trip(s, banded_bytes(s, rng));
    } else {
      const ScaleDistribution d = dists[rng() % 5];
      SCOPED_TRACE("distribution " + std::to_string(int(d)));
      check_round_trip(s, synthetic_scales(s, d, rng()));
    }
  }
}

TEST(CsfCodec, SingleExpertAndTinyGrids) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4})
    for (std::uint32_t rows : {1u, 2u, 63u, 64u, 65u, 127u, 128u, 129u})
      for (std::uint32_t cols : {1u, 3u, 4u, 5u, 8u, 15u, 16u, 17u, 33u}) {
        const GridShape s{f, ScaleLayout::row_major, 1, rows, cols};
        check_round_trip(s, banded_bytes(s, rng));
      }
}

// Values 16 (NVFP4) or 2 (MXFP4) apart: every window holds one byte, the rest
// of the row is exceptions.
TEST(CsfCodec, AllExceptionRows) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4})
    for (ScaleLayout l : {ScaleLayout::row_major, ScaleLayout::swizzled_128x4}) {
      const unsigned w = csf_window(f);
      const GridShape s{f, l, 2, 128, l == ScaleLayout::row_major ? 16u : 16u};
      const std::uint32_t distinct = 256 / w;
      ASSERT_LE(s.cols, distinct);
      Bytes grid(std::size_t{s.experts} * s.rows * s.cols);
      for (std::size_t r = 0; r < std::size_t{s.experts} * s.rows; ++r) {
        std::vector<std::uint32_t> picks(distinct);
        std::iota(picks.begin(), picks.end(), 0u);
        std::shuffle(picks.begin(), picks.end(), rng);
        for (std::uint32_t c = 0; c < s.cols; ++c) grid[r * s.cols + c] = std::uint8_t(picks[c] * w);
      }
      GridShape rm = s;
      rm.layout = ScaleLayout::row_major;
      Bytes src = grid;
      if (l == ScaleLayout::swizzled_128x4) {
        // swizzle the row-major grid
        const std::size_t per = std::size_t{s.rows} * s.cols;
        for (std::uint32_t e = 0; e < s.experts; ++e)
          for (std::uint32_t r = 0; r < s.rows; ++r)
            for (std::uint32_t c = 0; c < s.cols; ++c)
              src[e * per + swizzled_index(r, c, s.cols)] = grid[e * per + std::size_t{r} * s.cols + c];
      }
      const CsfTensor t = check_round_trip(s, src);
      EXPECT_EQ(t.exceptions.size(), std::size_t{s.experts} * s.rows * (s.cols - 1));
      // Every row ties at one byte per window, so the lowest base wins: the
      // smallest byte of the row, lowered as far as its window allows.
      for (std::uint32_t e = 0; e < s.experts; ++e)
        for (std::uint32_t r = 0; r < s.rows; ++r) {
          const auto* row = &grid[(std::size_t{e} * s.rows + r) * s.cols];
          const int mn = *std::min_element(row, row + s.cols);
          EXPECT_EQ(row_base(t, e, r), std::max(0, mn - int(w) + 1)) << "expert " << e << " row " << r;
        }
    }
}

TEST(CsfCodec, ConstantRows) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4}) {
    const GridShape s{f, ScaleLayout::row_major, 3, 100, 37};
    Bytes src(std::size_t{s.experts} * s.rows * s.cols);
    std::vector<std::uint8_t> value(std::size_t{s.experts} * s.rows);
    for (std::size_t r = 0; r < value.size(); ++r) {
      value[r] = std::uint8_t(r % 7 == 0 ? (r % 2 ? 0 : 255) : rng());
      std::fill_n(src.begin() + std::ptrdiff_t(r * s.cols), s.cols, value[r]);
    }
    const CsfTensor t = check_round_trip(s, src);
    EXPECT_TRUE(t.exceptions.empty());
    const int w = int(csf_window(f));
    for (std::uint32_t e = 0; e < s.experts; ++e)
      for (std::uint32_t r = 0; r < s.rows; ++r)
        EXPECT_EQ(row_base(t, e, r), std::max(0, value[e * s.rows + r] - w + 1));
  }
}

TEST(CsfCodec, SpecialBytesAndWindowEdges) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const std::uint8_t specials[] = {0x00, 0x01, 0x7F, 0x80, 0xFE, 0xFF, 0xF0, 0xEF, 0x0F, 0x10};
  for (ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4})
    for (ScaleLayout l : {ScaleLayout::row_major, ScaleLayout::swizzled_128x4}) {
      const GridShape s{f, l, 2, l == ScaleLayout::row_major ? 70u : 128u,
                        l == ScaleLayout::row_major ? 45u : 44u};
      Bytes src(CsfGeometry::of(s).native_bytes(l));
      // Mostly special bytes, some rows banded at the top or bottom edge.
      for (std::size_t i = 0; i < src.size(); ++i) {
        const unsigned kind = unsigned((i / s.cols) % 4);
        if (kind == 0) src[i] = specials[rng() % std::size(specials)];
        if (kind == 1) src[i] = std::uint8_t(255 - rng() % 3);  // 253..255
        if (kind == 2) src[i] = std::uint8_t(rng() % 3);        // 0..2
        if (kind == 3) src[i] = rng() % 2 ? 0xFF : 0x00;
      }
      check_round_trip(s, src);
    }
}

// --- hand-checked cases ----------------------------------------------------------
struct RowCase {
  ScaleFormat f;
  std::vector<std::uint8_t> row;
  std::uint8_t base;
  std::vector<std::uint32_t> exception_cols;
};

TEST(CsfCodec, BaseRuleHandChecked) {
  const std::vector<RowCase> cases = {
      // one value: the lowest window that holds it
      {ScaleFormat::nvfp4, {20, 20, 20}, 5, {}},
      {ScaleFormat::nvfp4, {3}, 0, {}},
      // windows clipped at 255: [240, 255] is the last one
      {ScaleFormat::nvfp4, {255, 255}, 240, {}},
      {ScaleFormat::nvfp4, {254, 255, 0}, 240, {2}},
      // tie between {10, 10} and {30, 30}: lowest base wins
      {ScaleFormat::nvfp4, {10, 30, 30, 10}, 0, {1, 2}},
      // 100 and 115 share [100, 115]; 115 and 116 share [101, 116]: tie -> 100
      {ScaleFormat::nvfp4, {100, 115, 116}, 100, {2}},
      // four bytes in [0x52, 0x61] beat three 0x50
      {ScaleFormat::nvfp4, {0x50, 0x60, 0x50, 0x60, 0x61, 0x50, 0x60}, 0x52, {0, 2, 5}},
      // 0 and 255 tie at one byte each
      {ScaleFormat::nvfp4, {255, 0}, 0, {0}},
      {ScaleFormat::mxfp4, {7, 8, 8, 9}, 7, {3}},
      {ScaleFormat::mxfp4, {255}, 254, {}},
      {ScaleFormat::mxfp4, {254, 255, 253}, 253, {1}},
      {ScaleFormat::mxfp4, {0, 0, 1, 2, 2, 2}, 1, {0, 1}},
      {ScaleFormat::mxfp4, {5}, 4, {}},
      {ScaleFormat::mxfp4, {0x7F, 0xFF, 0x00}, 0, {0, 1}},
  };
  for (const RowCase& rc : cases) {
    const std::uint32_t n = std::uint32_t(rc.row.size());
    const GridShape s{rc.f, ScaleLayout::row_major, 1, 1, n};
    for (const CodecOptions& o : {kRef, kFast1}) {
      const CsfTensor t = encode(s, rc.row, o);
      SCOPED_TRACE("row of " + std::to_string(n) + " bytes, first " + std::to_string(rc.row[0]));
      EXPECT_EQ(row_base(t, 0, 0), rc.base);
      ASSERT_EQ(t.exceptions.size(), rc.exception_cols.size());
      for (std::size_t i = 0; i < rc.exception_cols.size(); ++i) {
        EXPECT_EQ(exception_position(t.exceptions[i]), rc.exception_cols[i]);  // row 0: position = column
        EXPECT_EQ(exception_value(t.exceptions[i]), rc.row[rc.exception_cols[i]]);
      }
      EXPECT_EQ(t.row_prefix[0], 0u);
      EXPECT_EQ(t.row_prefix[1], rc.exception_cols.size());
      EXPECT_TRUE(decode_to(t, ScaleLayout::row_major, o) == rc.row);
    }
  }
}

TEST(CsfCodec, RecordFormat) {
  EXPECT_EQ(make_exception(0x123456, 0xAB), 0xAB123456u);
  EXPECT_EQ(make_exception(0xFFFFFF, 0x00), 0x00FFFFFFu);
  EXPECT_EQ(exception_position(0xAB123456u), 0x123456u);
  EXPECT_EQ(exception_value(0xAB123456u), 0xABu);
  // A 3 x 6 NVFP4 grid pads its columns to 8: position = row * 8 + col.
  const GridShape s{ScaleFormat::nvfp4, ScaleLayout::row_major, 2, 3, 6};
  Bytes src(2 * 3 * 6, 0x40);
  src[(1 * 3 + 2) * 6 + 5] = 0xC3;  // expert 1, row 2, col 5
  src[(0 * 3 + 1) * 6 + 0] = 0x01;  // expert 0, row 1, col 0
  for (const CodecOptions& o : {kRef, kFast1}) {
    const CsfTensor t = encode(s, src, o);
    ASSERT_EQ(t.exceptions.size(), 2u);
    EXPECT_EQ(t.exceptions[0], (0x01u << 24) | (1 * 8 + 0));
    EXPECT_EQ(t.exceptions[1], (0xC3u << 24) | (2 * 8 + 5));
    // row_prefix: expert 0 rows 0..127, expert 1 rows 128..255
    EXPECT_EQ(t.row_prefix[1], 0u);
    EXPECT_EQ(t.row_prefix[2], 1u);
    EXPECT_EQ(t.row_prefix[128 + 2], 1u);
    EXPECT_EQ(t.row_prefix[128 + 3], 2u);
    EXPECT_EQ(t.row_prefix.back(), 2u);
    EXPECT_EQ(t.partition_index, (std::vector<std::uint32_t>{0, 1, 2}));
  }
}

TEST(CsfCodec, NvSlabLayoutHandChecked) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  // 2 experts of 200 x 10: rows pad to 256 (2 slabs), columns to 12.
  const GridShape s{ScaleFormat::nvfp4, ScaleLayout::row_major, 2, 200, 10};
  Bytes src(2 * 200 * 10);
  std::vector<std::uint8_t> base(2 * 200);
  for (std::size_t r = 0; r < base.size(); ++r) {
    base[r] = std::uint8_t(rng() % 241);
    for (std::uint32_t c = 0; c < 10; ++c) src[r * 10 + c] = std::uint8_t(base[r] + (c * 7 + r) % 16);
    // pin the window: the row holds base and base + 15 (if it has both, the window is fixed)
    src[r * 10 + 0] = base[r];
    src[r * 10 + 1] = std::uint8_t(base[r] + 15);
  }
  for (const CodecOptions& o : {kRef, kFast1}) {
    const CsfTensor t = encode(s, src, o);
    const CsfGeometry& g = t.geometry;
    ASSERT_EQ(g.slab_bytes, 128u * (1 + 12 / 2));
    EXPECT_TRUE(t.exceptions.empty());
    for (std::uint32_t e = 0; e < 2; ++e)
      for (std::uint32_t r = 0; r < 256; ++r) {
        const std::uint8_t* slab = t.fixed.data() + e * g.fixed_bytes_per_expert + (r / 128) * g.slab_bytes;
        const std::uint8_t want_base = r < 200 ? base[e * 200 + r] : 0;
        ASSERT_EQ(slab[(r % 32) * 4 + (r % 128) / 32], want_base) << "expert " << e << " row " << r;
        for (std::uint32_t c = 0; c < 12; ++c) {
          const std::size_t n = (r % 32) * 16 + ((r % 128) / 32) * 4 + (c % 4);  // nibble index in the group
          const std::uint8_t byte = slab[128 + (c / 4) * 256 + n / 2];
          const unsigned nibble = n % 2 == 0 ? byte & 0xF : byte >> 4;
          const unsigned want = (r < 200 && c < 10) ? unsigned(src[(e * 200 + r) * 10 + c] - want_base) : 0;
          ASSERT_EQ(nibble, want) << "expert " << e << " row " << r << " col " << c;
        }
      }
  }
}

TEST(CsfCodec, MxSlabLayoutHandChecked) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const GridShape s{ScaleFormat::mxfp4, ScaleLayout::row_major, 1, 40, 20};  // 64 padded rows, 3 mask bytes
  Bytes src(40 * 20);
  std::vector<std::uint8_t> base(40);
  for (std::uint32_t r = 0; r < 40; ++r) {
    base[r] = std::uint8_t(rng() % 255);
    for (std::uint32_t c = 0; c < 20; ++c) src[r * 20 + c] = std::uint8_t(base[r] + rng() % 2);
    src[r * 20 + 3] = base[r];
    src[r * 20 + 4] = std::uint8_t(base[r] + 1);
  }
  for (const CodecOptions& o : {kRef, kFast1}) {
    const CsfTensor t = encode(s, src, o);
    ASSERT_EQ(t.geometry.slab_bytes, 16u * (1 + 3));
    ASSERT_EQ(t.fixed.size(), 4 * t.geometry.slab_bytes);
    EXPECT_TRUE(t.exceptions.empty());
    for (std::uint32_t r = 0; r < 64; ++r) {
      const std::uint8_t* slab = t.fixed.data() + (r / 16) * t.geometry.slab_bytes;
      ASSERT_EQ(slab[r % 16], r < 40 ? base[r] : 0) << "row " << r;
      for (std::uint32_t k = 0; k < 3; ++k)
        for (std::uint32_t j = 0; j < 8; ++j) {
          const std::uint32_t c = 8 * k + j;
          const bool want = r < 40 && c < 20 && src[r * 20 + c] == base[r] + 1;
          ASSERT_EQ(bool((slab[16 + (r % 16) * 3 + k] >> j) & 1), want) << "row " << r << " col " << c;
        }
    }
  }
}

TEST(CsfCodec, SwizzledPaddingDecodesToBaseAndZero) {
  // Row-major 130 x 6 NVFP4 decoded to swizzled 256 x 8: padding columns of a
  // true row hold its base, padding rows are 0x00.
  const GridShape s{ScaleFormat::nvfp4, ScaleLayout::row_major, 1, 130, 6};
  Bytes src(130 * 6);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = std::uint8_t(60 + i % 5);
  const CsfTensor t = encode(s, src);
  const Bytes out = decode_to(t, ScaleLayout::swizzled_128x4, kFast1);
  ASSERT_EQ(out.size(), 256u * 8);
  EXPECT_EQ(row_base(t, 0, 0), 60 + 4 - 15);
  EXPECT_EQ(out[swizzled_index(0, 6, 8)], 60 + 4 - 15);
  EXPECT_EQ(out[swizzled_index(0, 7, 8)], 60 + 4 - 15);
  EXPECT_EQ(out[swizzled_index(130, 0, 8)], 0);
  EXPECT_EQ(out[swizzled_index(255, 7, 8)], 0);
  EXPECT_EQ(out[swizzled_index(129, 5, 8)], src[129 * 6 + 5]);
}

// --- decode_experts, argument checks, stats --------------------------------------
TEST(CsfCodec, DecodeExperts) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (int iter = 0; iter < 8; ++iter) {
    GridShape s = random_shape(rng);
    s.experts = 2 + std::uint32_t(rng() % 5);
    const Bytes src = synthetic_scales(s, ScaleDistribution::realistic, rng());
    const CsfTensor t = encode(s, src);
    std::vector<std::uint32_t> ids;
    for (int i = 0; i < 4; ++i) ids.push_back(std::uint32_t(rng() % s.experts));
    ids.push_back(ids.front());  // duplicates are allowed
    for (ScaleLayout l : {ScaleLayout::row_major, ScaleLayout::swizzled_128x4}) {
      const Bytes full = decode_to(t, l, kRef);
      const std::size_t per = full.size() / s.experts;
      for (const CodecOptions& o : {kRef, kFast1, kFast3}) {
        Bytes out(full.size(), 0x5A);
        decode_experts(t, ids, l, out, o);
        for (std::uint32_t e = 0; e < s.experts; ++e) {
          const bool listed = std::find(ids.begin(), ids.end(), e) != ids.end();
          const bool same =
              std::equal(out.begin() + std::ptrdiff_t(e * per), out.begin() + std::ptrdiff_t((e + 1) * per),
                         full.begin() + std::ptrdiff_t(e * per));
          const bool untouched =
              std::all_of(out.begin() + std::ptrdiff_t(e * per), out.begin() + std::ptrdiff_t((e + 1) * per),
                          [](std::uint8_t b) { return b == 0x5A; });
          EXPECT_TRUE(listed ? same : untouched) << "expert " << e << (listed ? " wrong" : " touched");
        }
      }
    }
    Bytes out(t.geometry.native_bytes(s.layout));
    const std::vector<std::uint32_t> bad_ids{0, s.experts};
    EXPECT_THROW(decode_experts(t, bad_ids, s.layout, out), InvalidArgument);
  }
}

TEST(CsfCodec, ArgumentChecks) {
  const GridShape s{ScaleFormat::nvfp4, ScaleLayout::row_major, 2, 10, 10};
  Bytes src(200, 7);
  EXPECT_THROW(encode(s, std::span<const std::uint8_t>(src.data(), 199)), InvalidArgument);
  GridShape zero = s;
  zero.rows = 0;
  EXPECT_THROW(encode(zero, src), InvalidArgument);
  const CsfTensor t = encode(s, src);
  Bytes small(199), swz(t.geometry.native_bytes(ScaleLayout::swizzled_128x4) + 1);
  EXPECT_THROW(decode(t, ScaleLayout::row_major, small), InvalidArgument);
  EXPECT_THROW(decode(t, ScaleLayout::swizzled_128x4, swz), InvalidArgument);
  EXPECT_THROW(decode(t, ScaleLayout(5), small), InvalidArgument);
  EXPECT_THROW(row_base(t, 2, 0), InvalidArgument);
  EXPECT_THROW(row_base(t, 0, 128), InvalidArgument);
  EXPECT_NO_THROW(row_base(t, 0, 127));
}

TEST(CsfCodec, StatsMatchTheParts) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (int iter = 0; iter < 6; ++iter) {
    const GridShape s = random_shape(rng);
    const Bytes src = banded_bytes(s, rng);
    const CsfTensor t = encode(s, src);
    const CsfStats st = stats(t);
    EXPECT_EQ(st.rows, std::uint64_t{s.experts} * s.rows);
    EXPECT_EQ(st.values, std::uint64_t{s.experts} * s.rows * s.cols);
    EXPECT_EQ(st.exceptions, t.exceptions.size());
    EXPECT_EQ(st.source_bytes, src.size());
    EXPECT_EQ(st.encoded_bytes,
              t.fixed.size() + 4 * (t.exceptions.size() + t.row_prefix.size() + t.partition_index.size()));
    EXPECT_EQ(st.encoded_bytes, t.encoded_bytes());
    std::vector<bool> seen(256);
    for (std::uint32_t e = 0; e < s.experts; ++e)
      for (std::uint32_t r = 0; r < s.rows; ++r) seen[row_base(t, e, r)] = true;
    EXPECT_EQ(st.distinct_bases, std::uint32_t(std::count(seen.begin(), seen.end(), true)));
    // brute-force exception count: bytes outside their row's window
    std::uint64_t outside = 0;
    const Bytes rm = s.layout == ScaleLayout::row_major ? src : unswizzle(s, src);
    for (std::uint32_t e = 0; e < s.experts; ++e)
      for (std::uint32_t r = 0; r < s.rows; ++r) {
        const unsigned b = row_base(t, e, r);
        for (std::uint32_t c = 0; c < s.cols; ++c) {
          const unsigned v = rm[(std::size_t{e} * s.rows + r) * s.cols + c];
          outside += !(v >= b && v < b + csf_window(s.format));
        }
      }
    EXPECT_EQ(outside, st.exceptions);
    EXPECT_DOUBLE_EQ(st.exception_rate(), double(st.exceptions) / double(st.values));
  }
}

// --- validation -----------------------------------------------------------------
void expect_format_error(const CsfTensor& t, const char* needle, const char* what) {
  SCOPED_TRACE(what);
  try {
    validate(t);
    ADD_FAILURE() << "validate accepted: " << what;
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
  }
  // decode of untrusted parts validates first
  const std::uint64_t n = t.geometry.native_bytes(ScaleLayout::row_major);
  if (n < (std::uint64_t{1} << 28)) {
    Bytes out(n);
    EXPECT_THROW(decode(t, ScaleLayout::row_major, out), FormatError);
  }
}

// A tensor with several exceptions in most rows; NVFP4 with padded columns.
CsfTensor corruptible(ScaleFormat f, std::mt19937_64& rng) {
  const GridShape s{f, ScaleLayout::row_major, 3, 70, 10};
  Bytes src(3 * 70 * 10);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = std::uint8_t(120 + rng() % 2);
  for (std::size_t r = 0; r < 3 * 70; ++r) {
    src[r * 10 + 2] = std::uint8_t(rng() % 100);
    src[r * 10 + 7] = std::uint8_t(160 + rng() % 90);
  }
  return encode(s, src);
}

// Index of the first record of (expert, row).
std::uint32_t first_record(const CsfTensor& t, std::uint32_t e, std::uint32_t r) {
  return t.row_prefix[std::size_t{e} * t.geometry.padded_rows + r];
}

void set_nibble(CsfTensor& t, std::uint32_t e, std::uint32_t r, std::uint32_t c, unsigned v) {
  const CsfGeometry& g = t.geometry;
  std::uint8_t* slab = t.fixed.data() + e * g.fixed_bytes_per_expert + (r / 128) * g.slab_bytes;
  const std::size_t n = (r % 32) * 16 + ((r % 128) / 32) * 4 + (c % 4);
  std::uint8_t& b = slab[128 + (c / 4) * 256 + n / 2];
  b = n % 2 ? std::uint8_t((b & 0x0F) | (v << 4)) : std::uint8_t((b & 0xF0) | v);
}

TEST(CsfValidate, AcceptsFreshEncodings) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4})
    EXPECT_NO_THROW(validate(corruptible(f, rng)));
}

TEST(CsfValidate, CorruptRecords) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4}) {
    SCOPED_TRACE(std::string(to_string(f)));
    const CsfTensor good = corruptible(f, rng);
    const std::uint32_t e = std::uint32_t(rng() % 3), r = std::uint32_t(rng() % 70);
    const std::uint32_t i = first_record(good, e, r);
    ASSERT_EQ(first_record(good, e, r + 1) - i, 2u) << "test grid must have two exceptions per row";
    const std::uint32_t Cp = good.geometry.padded_cols;
    {
      CsfTensor t = good;
      std::swap(t.exceptions[i], t.exceptions[i + 1]);
      expect_format_error(t, "sorted", "records of a row out of order");
    }
    {
      CsfTensor t = good;
      t.exceptions[i + 1] = t.exceptions[i];
      expect_format_error(t, "without duplicates", "duplicate record");
    }
    {
      CsfTensor t = good;
      t.exceptions[i] = make_exception(9000000, 0);
      expect_format_error(t, "position 9000000 outside the 70x10 grid", "position beyond the grid");
    }
    if (f == ScaleFormat::nvfp4) {  // only NVFP4 pads columns (10 -> 12)
      CsfTensor t = good;
      t.exceptions[i] = make_exception(r * Cp + 10, exception_value(t.exceptions[i]));
      expect_format_error(t, "outside the 70x10 grid", "position in a padding column");
    }
    {
      CsfTensor t = good;
      t.exceptions[i] = make_exception(70 * Cp + 1, 0);  // padding row
      expect_format_error(t, "outside the 70x10 grid", "position in a padding row");
    }
    {
      CsfTensor t = good;
      const std::uint32_t other = (r + 1) % 70;
      t.exceptions[i] = make_exception(other * Cp + 0, exception_value(t.exceptions[i]));
      expect_format_error(t, "row_prefix places it", "record in another row");
    }
    {
      CsfTensor t = good;
      const std::uint8_t base = row_base(t, e, r);
      t.exceptions[i] = make_exception(exception_position(t.exceptions[i]), base);
      expect_format_error(t, "inside the row's window", "exception value inside the window");
    }
    {
      CsfTensor t = good;
      const std::uint32_t col = exception_position(t.exceptions[i]) - r * Cp;
      if (f == ScaleFormat::nvfp4) {
        set_nibble(t, e, r, col, 3);
      } else {
        std::uint8_t* slab =
            t.fixed.data() + e * t.geometry.fixed_bytes_per_expert + (r / 16) * t.geometry.slab_bytes;
        slab[16 + (r % 16) * ((Cp + 7) / 8) + col / 8] |= std::uint8_t(1u << (col % 8));
      }
      expect_format_error(t, "under exception record", "non-zero offset under an exception");
    }
  }
}

TEST(CsfValidate, CorruptPrefixAndSizes) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4}) {
    SCOPED_TRACE(std::string(to_string(f)));
    const CsfTensor good = corruptible(f, rng);
    const std::size_t k = 1 + rng() % (good.row_prefix.size() - 2);
    {
      CsfTensor t = good;
      t.row_prefix[k] = t.row_prefix[k + 1] + 1;
      expect_format_error(t, "must not decrease", "prefix decreasing");
    }
    {
      CsfTensor t = good;
      t.row_prefix[0] = 1;
      expect_format_error(t, "first entry", "prefix not starting at 0");
    }
    {
      CsfTensor t = good;
      t.row_prefix.back() += 1;
      expect_format_error(t, "CSF row_prefix", "prefix total not matching the records");
    }
    {
      CsfTensor t = good;
      t.exceptions.pop_back();
      expect_format_error(t, "CSF row_prefix", "record missing");
    }
    {
      CsfTensor t = good;
      t.partition_index[1] += 1;
      expect_format_error(t, "CSF partition_index", "partition index not matching");
    }
    {
      CsfTensor t = good;
      t.partition_index.push_back(t.partition_index.back());
      expect_format_error(t, "CSF partition_index", "partition index too long");
    }
    {
      CsfTensor t = good;
      t.row_prefix.pop_back();
      expect_format_error(t, "CSF row_prefix", "prefix too short");
    }
    {
      CsfTensor t = good;
      t.fixed.pop_back();
      expect_format_error(t, "CSF fixed part", "fixed part short");
    }
    {
      CsfTensor t = good;
      t.fixed.clear();
      expect_format_error(t, "CSF fixed part", "fixed part empty");
    }
    {
      CsfTensor t = good;
      t.geometry.padded_rows += 64;
      expect_format_error(t, "CSF header", "padded_rows tampered");
    }
    {
      CsfTensor t = good;
      t.geometry.shape.experts = 1u << 30;  // sizes derived from a hostile header
      expect_format_error(t, "CSF fixed part", "expert count tampered");
    }
    {
      CsfTensor t = good;
      t.geometry.shape.cols = 1u << 30;
      expect_format_error(t, "CSF header", "grid beyond 2^24 positions");
    }
    {
      CsfTensor t;
      t.geometry.shape = {f, ScaleLayout::row_major, 1, 64, 8};
      expect_format_error(t, "CSF header", "default geometry fields");
    }
  }
}

TEST(CsfValidate, CorruptFixedPart) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4}) {
    SCOPED_TRACE(std::string(to_string(f)));
    const CsfTensor good = corruptible(f, rng);
    const CsfGeometry& g = good.geometry;
    auto base_byte = [&](CsfTensor& t, std::uint32_t e, std::uint32_t r) -> std::uint8_t& {
      std::uint8_t* slab = t.fixed.data() + e * g.fixed_bytes_per_expert + (r / g.slab_rows) * g.slab_bytes;
      return f == ScaleFormat::nvfp4 ? slab[(r % 32) * 4 + (r % 128) / 32] : slab[r % 16];
    };
    {
      CsfTensor t = good;
      base_byte(t, 1, 5) = f == ScaleFormat::nvfp4 ? 241 : 255;
      expect_format_error(t, "must fit in a byte", "base above 256 - W");
    }
    {
      CsfTensor t = good;
      base_byte(t, 2, 70 + std::uint32_t(rng() % (g.padded_rows - 70))) = 3;
      expect_format_error(t, "padding row", "padding row base");
    }
    if (f == ScaleFormat::nvfp4) {
      CsfTensor t = good;
      set_nibble(t, 0, std::uint32_t(rng() % 70), 10 + std::uint32_t(rng() % 2), 1);
      expect_format_error(t, "padding column", "offset in a padding column");
      CsfTensor u = good;
      set_nibble(u, 1, 70 + std::uint32_t(rng() % 58), std::uint32_t(rng() % 12), 9);
      expect_format_error(u, "padding row", "offset in a padding row");
    } else {
      CsfTensor t = good;
      const std::uint32_t r = std::uint32_t(rng() % 70);
      std::uint8_t* slab = t.fixed.data() + (r / 16) * g.slab_bytes;
      slab[16 + (r % 16) * 2 + 1] |= 0x80;  // bit 15: column 15 of 10
      expect_format_error(t, "padding column", "mask bit past the last column");
      CsfTensor u = good;
      const std::uint32_t pr = 70 + std::uint32_t(rng() % 58);
      std::uint8_t* pslab = u.fixed.data() + 2 * g.fixed_bytes_per_expert + (pr / 16) * g.slab_bytes;
      pslab[16 + (pr % 16) * 2] = 1;
      expect_format_error(u, "padding row", "mask bit in a padding row");
    }
  }
}

// Random damage to the parts: validate either rejects it with FormatError, or
// accepts it and then every decoder agrees (and stays inside its buffers).
TEST(CsfValidate, RandomDamageIsRejectedOrDecodesConsistently) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  int rejected = 0, accepted = 0;
  for (int iter = 0; iter < 300; ++iter) {
    const ScaleFormat f = iter % 2 ? ScaleFormat::nvfp4 : ScaleFormat::mxfp4;
    CsfTensor t = corruptible(f, rng);
    const int hits = 1 + int(rng() % 3);
    for (int h = 0; h < hits; ++h) {
      switch (rng() % 5) {
        case 0:
          t.fixed[rng() % t.fixed.size()] ^= std::uint8_t(1u << (rng() % 8));
          break;
        case 1:
          t.exceptions[rng() % t.exceptions.size()] ^= 1u << (rng() % 32);
          break;
        case 2:
          t.row_prefix[rng() % t.row_prefix.size()] += std::uint32_t(rng() % 3) - 1;
          break;
        case 3:
          t.partition_index[rng() % t.partition_index.size()] ^= 1u << (rng() % 4);
          break;
        default:
          t.exceptions.resize(t.exceptions.size() + (rng() % 2 ? 1 : -1));
      }
    }
    bool ok = true;
    try {
      validate(t);
    } catch (const FormatError&) {
      ok = false;
    }
    if (!ok) {
      ++rejected;
      continue;
    }
    ++accepted;
    for (ScaleLayout l : {ScaleLayout::row_major, ScaleLayout::swizzled_128x4}) {
      const Bytes a = decode_to(t, l, kRef);
      EXPECT_TRUE(decode_to(t, l, kFast1) == a);
      EXPECT_TRUE(decode_to(t, l, kFast3) == a);
    }
  }
  EXPECT_GT(rejected, 0);
  SCOPED_TRACE("accepted " + std::to_string(accepted));
}

}  // namespace
}  // namespace csfmoe
