// b12x canonical CSF planes: the encoder against an encoder and a decoder
// written here from the rules of the shared notes, exact round trips on
// realistic and adversarial grids, refusal of tampered planes, TP slices, and
// equality with csfmoe's own CsfTensor where the layouts coincide.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <iterator>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "csfmoe/b12x_planes.hpp"
#include "csfmoe/codec.hpp"
#include "csfmoe/errors.hpp"
#include "csfmoe/parallel.hpp"
#include "test_seed.hpp"

namespace csfmoe {
namespace {

using Bytes = std::vector<std::uint8_t>;
using Records = std::vector<std::uint32_t>;
constexpr ScaleFormat kNv = ScaleFormat::nvfp4;
constexpr ScaleFormat kMx = ScaleFormat::mxfp4;

// --- the rules of the shared notes, written independently -------------------
unsigned window_of(ScaleFormat f) { return f == kNv ? 16 : 2; }
std::size_t row_code_bytes(ScaleFormat f, std::uint32_t cols) { return f == kNv ? cols / 2 : (cols + 7) / 8; }
std::size_t slab_size(ScaleFormat f, std::uint32_t cols) { return 16 * (1 + row_code_bytes(f, cols)); }
std::size_t base_byte(const PlaneShape& s, std::uint32_t r) {
  return (r / 16) * slab_size(s.format, s.cols) + r % 16;
}
std::size_t code_start(const PlaneShape& s, std::uint32_t r) {
  return (r / 16) * slab_size(s.format, s.cols) + 16 + (r % 16) * row_code_bytes(s.format, s.cols);
}

// Lowest base whose window holds the most of the row's bytes, by brute force.
std::uint8_t rule_base(const std::uint8_t* row, std::uint32_t n, unsigned w) {
  int best = -1, best_count = -1;
  for (int b = 0; b + int(w) - 1 <= 255; ++b) {
    int count = 0;
    for (std::uint32_t c = 0; c < n; ++c) count += row[c] >= b && row[c] < b + int(w);
    if (count > best_count) best = b, best_count = count;
  }
  return static_cast<std::uint8_t>(best);
}

CsfPlanes rule_encode(const PlaneShape& s, const Bytes& native) {
  CsfPlanes p;
  p.shape = s;
  p.fixed.assign(std::size_t{s.rows / 16} * slab_size(s.format, s.cols), 0);
  const unsigned w = window_of(s.format);
  for (std::uint32_t r = 0; r < s.rows; ++r) {
    const std::uint8_t* row = native.data() + std::size_t{r} * s.cols;
    const std::uint8_t base = rule_base(row, s.cols, w);
    p.fixed[base_byte(s, r)] = base;
    for (std::uint32_t c = 0; c < s.cols; ++c) {
      const int d = int(row[c]) - int(base);
      if (d >= 0 && d < int(w)) {
        std::uint8_t& slot = p.fixed[code_start(s, r) + (s.format == kNv ? c / 2 : c / 8)];
        slot = static_cast<std::uint8_t>(slot | (s.format == kNv ? d << (4 * (c % 2)) : d << (c % 8)));
      } else {
        p.exceptions.push_back((std::uint32_t{row[c]} << 24) | (r * s.cols + c));
      }
    }
  }
  return p;
}

unsigned code_of(const CsfPlanes& p, std::uint32_t r, std::uint32_t c) {
  const std::uint8_t* codes = p.fixed.data() + code_start(p.shape, r);
  return p.shape.format == kNv ? (codes[c / 2] >> (4 * (c % 2))) & 15u : (codes[c / 8] >> (c % 8)) & 1u;
}

Bytes rule_decode(const CsfPlanes& p) {
  const PlaneShape& s = p.shape;
  Bytes out(std::size_t{s.rows} * s.cols);
  for (std::uint32_t r = 0; r < s.rows; ++r)
    for (std::uint32_t c = 0; c < s.cols; ++c)
      out[std::size_t{r} * s.cols + c] =
          static_cast<std::uint8_t>(p.fixed[base_byte(s, r)] + code_of(p, r, c));
  for (const std::uint32_t rec : p.exceptions) out.at(rec & 0xFFFFFF) = static_cast<std::uint8_t>(rec >> 24);
  return out;
}

// --- grids --------------------------------------------------------------------
enum class Regime { realistic, near_all_exceptions, extremes, ties, uniform };
const Regime kRegimes[] = {Regime::realistic, Regime::near_all_exceptions, Regime::extremes, Regime::ties,
                           Regime::uniform};
const char* name_of(Regime g) {
  switch (g) {
    case Regime::realistic:
      return "realistic";
    case Regime::near_all_exceptions:
      return "near_all_exceptions";
    case Regime::extremes:
      return "extremes";
    case Regime::ties:
      return "ties";
    case Regime::uniform:
      return "uniform";
  }
  return "?";
}

Bytes make_grid(const PlaneShape& s, Regime regime, std::mt19937_64& rng) {
  Bytes g(std::size_t{s.rows} * s.cols);
  const unsigned w = window_of(s.format);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<double> unit(0, 1);
  for (std::uint32_t r = 0; r < s.rows; ++r) {
    std::uint8_t* row = g.data() + std::size_t{r} * s.cols;
    // realistic: a per-row centre, most bytes a few steps from it, ~1% outliers.
    const int centre = s.format == kNv ? std::uniform_int_distribution<int>(0x18, 0x7E)(rng)
                                       : std::uniform_int_distribution<int>(100, 135)(rng);
    std::normal_distribution<double> spread(0, s.format == kNv ? 3.0 : 0.6);
    // ties: two values a window or more apart, each on half of the row.
    const int a = byte(rng), b = (a + int(w) + std::uniform_int_distribution<int>(0, 100)(rng)) % 256;
    for (std::uint32_t c = 0; c < s.cols; ++c) {
      int v = 0;
      switch (regime) {
        case Regime::realistic:
          v = unit(rng) < 0.01 ? byte(rng) : centre + int(std::lround(spread(rng)));
          break;
        case Regime::near_all_exceptions:  // bytes a whole window apart: a window holds one class
          v = int(w) * std::uniform_int_distribution<int>(0, 255 / int(w))(rng);
          break;
        case Regime::extremes: {
          static constexpr int kExtremes[] = {0x00, 0x7F, 0xFF};
          v = kExtremes[std::uniform_int_distribution<int>(0, 2)(rng)];
          break;
        }
        case Regime::ties:
          v = c % 2 ? a : b;
          break;
        case Regime::uniform:
          v = byte(rng);
          break;
      }
      row[c] = static_cast<std::uint8_t>(std::clamp(v, 0, 255));
    }
  }
  return g;
}

// A random valid shape: rows a multiple of 16, NVFP4 columns even, MXFP4
// columns often not a multiple of 8.
PlaneShape random_shape(ScaleFormat f, std::mt19937_64& rng) {
  const std::uint32_t rows = 16 * std::uniform_int_distribution<std::uint32_t>(1, 12)(rng);
  std::uint32_t cols = std::uniform_int_distribution<std::uint32_t>(1, 80)(rng);
  if (f == kNv) cols = 2 * ((cols + 1) / 2);
  return {f, rows, cols};
}

std::vector<PlaneShape> edge_shapes(ScaleFormat f) {
  if (f == kNv) return {{f, 16, 2}, {f, 16, 4}, {f, 16, 6}, {f, 32, 34}, {f, 144, 36}, {f, 128, 64}};
  return {{f, 16, 1}, {f, 16, 2}, {f, 16, 7}, {f, 16, 8}, {f, 32, 9}, {f, 64, 17}, {f, 80, 90}};
}

void expect_same_planes(const CsfPlanes& a, const CsfPlanes& b) {
  EXPECT_EQ(a.shape, b.shape);
  EXPECT_TRUE(a.fixed == b.fixed) << "fixed planes differ";
  EXPECT_TRUE(a.exceptions == b.exceptions)
      << "exceptions differ (" << a.exceptions.size() << " vs " << b.exceptions.size() << ")";
}

// The native slice: rows of `rows` concatenated, columns [cols.first, +count).
Bytes native_slice(const PlaneShape& s, const Bytes& g, const std::vector<AxisRange>& rows, AxisRange cols) {
  Bytes out;
  for (const AxisRange& range : rows)
    for (std::uint64_t r = range.first; r < range.first + range.count; ++r)
      for (std::uint64_t c = cols.first; c < cols.first + cols.count; ++c) out.push_back(g[r * s.cols + c]);
  return out;
}

// --- encode / decode ------------------------------------------------------------
TEST(B12xPlanes, EncoderFollowsTheRulesAndRoundTrips) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (ScaleFormat f : {kNv, kMx}) {
    std::vector<PlaneShape> shapes = edge_shapes(f);
    for (int i = 0; i < 6; ++i) shapes.push_back(random_shape(f, rng));
    for (const PlaneShape& s : shapes)
      for (Regime regime : kRegimes) {
        SCOPED_TRACE(to_string(s) + " " + name_of(regime));
        const Bytes native = make_grid(s, regime, rng);
        const CsfPlanes p = encode_planes(s, native, "t");
        ASSERT_EQ(p.fixed.size(), plane_fixed_bytes(s));
        ASSERT_EQ(p.fixed.size(), std::size_t{s.rows / 16} * slab_size(f, s.cols));
        expect_same_planes(p, rule_encode(s, native));
        EXPECT_TRUE(rule_decode(p) == native);
        EXPECT_NO_THROW(validate_planes(s, p.fixed, p.exceptions, "t"));
        EXPECT_TRUE(decode_planes(p, "t") == native);
        EXPECT_TRUE(in_encoder_form(p));  // what the encoder writes
      }
  }
}

TEST(B12xPlanes, RealisticGridsStoreFewExceptions) {
  // Guards the generator: a realistic grid must exercise codes, not only records.
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (ScaleFormat f : {kNv, kMx}) {
    const PlaneShape s{f, 256, 64};
    const CsfPlanes p = encode_planes(s, make_grid(s, Regime::realistic, rng), "t");
    EXPECT_LT(p.exceptions.size(), std::size_t{s.rows} * s.cols / 5) << to_string(s);
  }
}

TEST(B12xPlanes, HandCheckedLayout) {
  // NVFP4 16 x 4: row r = {r, r + 1, r + 15, 200}; base r (window [r, r + 15]), codes 0, 1, 15, record 200.
  {
    const PlaneShape s{kNv, 16, 4};
    Bytes g;
    for (std::uint8_t r = 0; r < 16; ++r)
      g.insert(g.end(), {r, static_cast<std::uint8_t>(r + 1), static_cast<std::uint8_t>(r + 15), 200});
    const CsfPlanes p = encode_planes(s, g, "t");
    ASSERT_EQ(p.fixed.size(), 16u * 3);
    for (std::uint32_t r = 0; r < 16; ++r) {
      EXPECT_EQ(p.fixed[r], r);
      EXPECT_EQ(p.fixed[16 + 2 * r], 0x10);      // columns 0, 1: codes 0 (low), 1 (high)
      EXPECT_EQ(p.fixed[16 + 2 * r + 1], 0x0F);  // columns 2, 3: code 15, exception slot 0
    }
    ASSERT_EQ(p.exceptions.size(), 16u);
    for (std::uint32_t r = 0; r < 16; ++r) EXPECT_EQ(p.exceptions[r], (200u << 24) | (r * 4 + 3));
  }
  // MXFP4 16 x 9: row r = base 50 everywhere, base + 1 in column r % 9, 7 in column 8 for even rows.
  {
    const PlaneShape s{kMx, 16, 9};
    Bytes g(16 * 9, 50);
    for (std::uint32_t r = 0; r < 16; ++r) {
      g[r * 9 + r % 9] = 51;
      if (r % 2 == 0 && r % 9 != 8) g[r * 9 + 8] = 7;
    }
    const CsfPlanes p = encode_planes(s, g, "t");
    ASSERT_EQ(p.fixed.size(), 16u * 3);
    Records want;
    for (std::uint32_t r = 0; r < 16; ++r) {
      EXPECT_EQ(p.fixed[r], 50);
      const unsigned bit = r % 9;
      EXPECT_EQ(p.fixed[16 + 2 * r], bit < 8 ? 1u << bit : 0u);
      EXPECT_EQ(p.fixed[16 + 2 * r + 1], bit == 8 ? 1u : 0u);
      if (r % 2 == 0 && r % 9 != 8) want.push_back((7u << 24) | (r * 9 + 8));
    }
    EXPECT_EQ(p.exceptions, want);
  }
}

TEST(B12xPlanes, TiesGoToTheLowestBase) {
  // The examples of docs/csf-format.md: NVFP4 {10, 30, 30, 10} -> base 0; MXFP4 {7, 8, 8, 9} -> base 7.
  const Bytes nv_row = {10, 30, 30, 10}, mx_row = {7, 8, 8, 9};
  // NVFP4: the two 30s are records; MXFP4: the 9 is.
  for (const auto& [s, row, base, records] : {std::tuple{PlaneShape{kNv, 16, 4}, nv_row, 0, 2u},
                                              std::tuple{PlaneShape{kMx, 16, 4}, mx_row, 7, 1u}}) {
    Bytes g;
    for (int r = 0; r < 16; ++r) g.insert(g.end(), row.begin(), row.end());
    const CsfPlanes p = encode_planes(s, g, "t");
    for (std::uint32_t r = 0; r < 16; ++r) EXPECT_EQ(p.fixed[r], base) << to_string(s);
    EXPECT_EQ(p.exceptions.size(), 16u * records) << to_string(s);
    EXPECT_TRUE(decode_planes(p, "t") == g);
  }
}

TEST(B12xPlanes, RejectsBadShapes) {
  const Bytes some(16 * 4);
  auto expect_invalid = [](const PlaneShape& s, const char* reason) {
    try {
      check_plane_shape(s, "layers.3.w2.weight_scale");
      ADD_FAILURE() << to_string(s) << " accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("layers.3.w2.weight_scale"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(reason), std::string::npos) << e.what();
    }
  };
  expect_invalid({kNv, 8, 4}, "multiple of 16");
  expect_invalid({kMx, 24, 4}, "multiple of 16");
  expect_invalid({kNv, 16, 3}, "even");
  expect_invalid({kNv, 0, 4}, "at least 1");
  expect_invalid({kMx, 16, 0}, "at least 1");
  expect_invalid({kMx, 16, (1u << 20) + 1}, "24-bit");
  expect_invalid({kNv, 32, 1u << 19 | 2}, "24-bit");
  EXPECT_NO_THROW(check_plane_shape({kMx, 16, 1u << 20}, "t"));           // exactly 2^24 positions
  EXPECT_THROW(encode_planes({kNv, 16, 2}, some, "t"), InvalidArgument);  // wrong source size
  EXPECT_THROW(encode_planes({kNv, 16, 3}, Bytes(48), "t"), InvalidArgument);
  const CsfPlanes p = encode_planes({kNv, 16, 4}, some, "t");
  Bytes small(10);
  EXPECT_THROW(decode_planes(p.shape, p.fixed, p.exceptions, small, "t"), InvalidArgument);
}

// --- tampering ------------------------------------------------------------------
// Expects FormatError naming the tensor and containing `reason`.
void expect_refused(const CsfPlanes& p, const char* reason) {
  const char* name = "model.layers.7.mlp.experts.3.up_proj.weight_scale";
  try {
    validate_planes(p.shape, p.fixed, p.exceptions, name);
    ADD_FAILURE() << "accepted; expected refusal for: " << reason;
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(reason), std::string::npos) << e.what();
  }
  Bytes out(std::size_t{p.shape.rows} * p.shape.cols);
  EXPECT_THROW(decode_planes(p.shape, p.fixed, p.exceptions, out, name), FormatError);
  EXPECT_THROW(slice_planes(p, std::vector<AxisRange>{{0, 16}}, {0, p.shape.cols}, name), FormatError);
  EXPECT_THROW(planes_to_csf(std::vector<CsfPlanes>{p}, name), FormatError);
}

TEST(B12xPlanes, TamperedPlanesAreRefused) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (ScaleFormat f : {kNv, kMx}) {
    const PlaneShape s{f, 48, f == kNv ? 34u : 21u};
    SCOPED_TRACE(to_string(s));
    Bytes native = make_grid(s, Regime::realistic, rng);
    native[5] = 0x00, native[6] = 0xFF, native[s.cols + 1] = 0x7F;  // at least a few records in rows 0, 1
    const CsfPlanes good = encode_planes(s, native, "t");
    ASSERT_GE(good.exceptions.size(), 2u);
    EXPECT_NO_THROW(validate_planes(s, good.fixed, good.exceptions, "t"));
    const std::uint32_t R = s.rows, C = s.cols;
    const std::uint32_t row = std::uniform_int_distribution<std::uint32_t>(0, R - 1)(rng);
    const std::size_t slab = slab_size(f, C);

    {  // base above the last window
      CsfPlanes p = good;
      p.fixed[(row / 16) * slab + row % 16] = f == kNv ? 241 : 255;
      expect_refused(p, f == kNv ? "base 241" : "base 255");
    }
    {  // records out of order
      CsfPlanes p = good;
      std::swap(p.exceptions[0], p.exceptions[1]);
      expect_refused(p, "strictly increasing");
    }
    {  // a duplicate record
      CsfPlanes p = good;
      p.exceptions.insert(p.exceptions.begin() + 1, p.exceptions[0]);
      expect_refused(p, "strictly increasing");
    }
    {  // position past the grid
      CsfPlanes p = good;
      p.exceptions.push_back((0xEEu << 24) | (R * C));
      expect_refused(p, "outside the");
    }
    // Records win over their slot (b12x's and vLLM's readers): a record on a
    // slot holding a non-zero code, or whose byte lies inside its row's
    // window, is legal; its byte is the value, and the planes convert to the
    // encoder's form of that grid.
    const auto wins = [&](const CsfPlanes& p, const Bytes& want) {
      const char* name = "model.layers.7.mlp.experts.3.up_proj.weight_scale";
      EXPECT_NO_THROW(validate_planes(p.shape, p.fixed, p.exceptions, name));
      EXPECT_TRUE(decode_planes(p, name) == want);
      const CsfPlanes canon = canonical_planes(p, name);
      EXPECT_TRUE(decode_planes(canon, name) == want);
      EXPECT_FALSE(in_encoder_form(p));  // the record wins over its slot
      EXPECT_TRUE(in_encoder_form(canon));
      const CsfTensor t = planes_to_csf(std::vector<CsfPlanes>{p}, name);
      EXPECT_NO_THROW(validate(t));
      const CsfPlanes back = csf_to_planes(t, name).at(0);
      expect_same_planes(back, canon);
      expect_same_planes(slice_planes(p, std::vector<AxisRange>{{0, R}}, {0, C}, name), canon);
      for (const std::uint32_t rec : canon.exceptions) {  // the encoder's form
        const std::uint32_t pos = rec & 0xFFFFFF;
        const std::uint8_t base = canon.fixed[(pos / C / 16) * slab + (pos / C) % 16];
        EXPECT_EQ(code_of(canon, pos / C, pos % C), 0u);
        EXPECT_GE(static_cast<std::uint8_t>((rec >> 24) - base), f == kNv ? 16 : 2);
      }
    };
    {  // a record on a slot holding a non-zero code
      CsfPlanes p = good;
      std::vector<std::uint32_t> coded;  // positions whose code is not 0
      for (std::uint32_t pos = 0; pos < R * C; ++pos)
        if (code_of(good, pos / C, pos % C) != 0) coded.push_back(pos);
      ASSERT_FALSE(coded.empty());
      const std::uint32_t pos = coded[std::uniform_int_distribution<std::size_t>(0, coded.size() - 1)(rng)];
      const std::uint8_t base = good.fixed[(pos / C / 16) * slab + (pos / C) % 16];
      const std::uint8_t value = static_cast<std::uint8_t>(base + 128);
      const std::uint32_t rec = (std::uint32_t{value} << 24) | pos;
      p.exceptions.insert(
          std::upper_bound(p.exceptions.begin(), p.exceptions.end(), rec,
                           [](std::uint32_t a, std::uint32_t b) { return (a & 0xFFFFFF) < (b & 0xFFFFFF); }),
          rec);
      Bytes want = native;
      want[pos] = value;
      wins(p, want);
    }
    {  // a record whose byte lies inside the row's window
      CsfPlanes p = good;
      const std::uint32_t pos = p.exceptions[0] & 0xFFFFFF;
      const std::uint8_t base = good.fixed[(pos / C / 16) * slab + (pos / C) % 16];
      p.exceptions[0] = (std::uint32_t{base} << 24) | pos;
      Bytes want = native;
      want[pos] = base;
      wins(p, want);
    }
    {  // truncated and overlong fixed planes
      CsfPlanes p = good;
      p.fixed.pop_back();
      expect_refused(p, "fixed plane holds");
      p = good;
      p.fixed.resize(p.fixed.size() - slab);
      expect_refused(p, "fixed plane holds");
      p = good;
      p.fixed.push_back(0);
      expect_refused(p, "fixed plane holds");
    }
    if (f == kMx) {  // a selector bit past the last column (21 columns: bits 5..7 of byte 2 unused)
      CsfPlanes p = good;
      p.fixed[(row / 16) * slab + 16 + (row % 16) * 3 + 2] |= std::uint8_t(1u << (5 + row % 3));
      expect_refused(p, "selector bits set past");
    }
  }
}

// --- TP slices ------------------------------------------------------------------
TEST(B12xPlanes, SlicesDecodeToTheNativeSlice) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (ScaleFormat f : {kNv, kMx})
    for (int i = 0; i < 40; ++i) {
      PlaneShape s = random_shape(f, rng);
      s.rows = std::max<std::uint32_t>(s.rows, 32);
      const Regime regime = kRegimes[i % std::size(kRegimes)];
      SCOPED_TRACE(to_string(s) + " " + name_of(regime));
      const Bytes native = make_grid(s, regime, rng);
      const CsfPlanes p = encode_planes(s, native, "t");
      const std::uint32_t slabs = s.rows / 16;
      auto slab_range = [&](std::uint32_t lo, std::uint32_t hi) {  // slabs [a, b) inside [lo, hi)
        const std::uint32_t a = std::uniform_int_distribution<std::uint32_t>(lo, hi - 1)(rng);
        const std::uint32_t b = std::uniform_int_distribution<std::uint32_t>(a + 1, hi)(rng);
        return AxisRange{16u * a, 16u * (b - a)};
      };
      std::vector<AxisRange> rows;
      if (i % 3 == 0) {
        rows = {slab_range(0, slabs)};
      } else {  // one piece of each half, as a gate/up split keeps (in either order)
        rows = {slab_range(0, slabs / 2), slab_range(slabs / 2, slabs)};
        if (i % 3 == 2) std::swap(rows[0], rows[1]);
      }
      const std::uint32_t step = f == kNv ? 2 : 1;
      const std::uint32_t units = s.cols / step;
      const std::uint32_t c0 = std::uniform_int_distribution<std::uint32_t>(0, units - 1)(rng);
      const std::uint32_t c1 = std::uniform_int_distribution<std::uint32_t>(c0 + 1, units)(rng);
      const AxisRange cols{c0 * step, (c1 - c0) * step};
      SCOPED_TRACE("cols [" + std::to_string(cols.first) + ", +" + std::to_string(cols.count) + ")");

      const CsfPlanes sl = slice_planes(p, rows, cols, "t");
      const Bytes want = native_slice(s, native, rows, cols);
      EXPECT_EQ(sl.shape, (PlaneShape{f, static_cast<std::uint32_t>(want.size() / cols.count),
                                      static_cast<std::uint32_t>(cols.count)}));
      EXPECT_NO_THROW(validate_planes(sl.shape, sl.fixed, sl.exceptions, "t"));
      EXPECT_TRUE(rule_decode(sl) == want);
      EXPECT_TRUE(decode_planes(sl, "t") == want);
      // Bases keep their full-row values.
      std::uint32_t o = 0;
      for (const AxisRange& range : rows)
        for (std::uint64_t r = range.first; r < range.first + range.count; ++r, ++o)
          EXPECT_EQ(sl.fixed[base_byte(sl.shape, o)], p.fixed[base_byte(s, static_cast<std::uint32_t>(r))]);
      // The whole grid as one slice is the plane itself.
      expect_same_planes(slice_planes(p, std::vector<AxisRange>{{0, s.rows}}, {0, s.cols}, "t"), p);
    }
}

TEST(B12xPlanes, TensorParallelRanksSliceLikeTheNativeGrid) {
  // The ranges a TP rank keeps (tensor_parallel_axis_ranges with the planes'
  // granules) cut planes that decode to what slice_scale_grid cuts from the native grid.
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (ScaleFormat f : {kNv, kMx})
    for (unsigned tp : {1u, 2u, 4u}) {
      // w13: 2N rows split per half; w2: H rows, N columns split.
      const std::uint32_t n = 64 * tp, h = 48;
      const PlaneShape w13{f, 2 * n, f == kNv ? 2u * 9 : 13u};
      const PlaneShape w2{f, h, f == kNv ? 2 * 4 * tp : 5 * tp};
      for (const auto& [s, split] : {std::pair{w13, TpSplit::gate_up_rows}, std::pair{w2, TpSplit::cols}}) {
        const Bytes native = make_grid(s, Regime::realistic, rng);
        const CsfPlanes p = encode_planes(s, native, "t");
        for (unsigned rank = 0; rank < tp; ++rank) {
          SCOPED_TRACE(to_string(s) + " tp " + std::to_string(tp) + " rank " + std::to_string(rank));
          std::vector<AxisRange> rows{{0, s.rows}};
          AxisRange cols{0, s.cols};
          if (split == TpSplit::cols)
            cols = tensor_parallel_axis_ranges(s.cols, split, tp, rank, f == kNv ? 2 : 1, "w2")[0];
          else
            rows = tensor_parallel_axis_ranges(s.rows, split, tp, rank, plane_slab_rows, "w13");
          const GridShape grid{f, ScaleLayout::row_major, 1, s.rows, s.cols};
          const Bytes want = slice_scale_grid(grid, s.rows, s.cols, native, rows, cols);
          EXPECT_TRUE(decode_planes(slice_planes(p, rows, cols, "t"), "t") == want);
        }
      }
    }
}

TEST(B12xPlanes, SliceKeepsTheFullRowBase) {
  // Row {100, 100, 10, 10, 10, 10}: the full row's base is 0 (four 10s), so in
  // the slice of columns [0, 2) both 100s stay records, while encoding the
  // native slice would choose base 85 and store none. Both decode alike.
  const PlaneShape s{kNv, 16, 6};
  Bytes g;
  for (int r = 0; r < 16; ++r) g.insert(g.end(), {100, 100, 10, 10, 10, 10});
  const CsfPlanes p = encode_planes(s, g, "t");
  const std::vector<AxisRange> rows{{0, 16}};
  const CsfPlanes sl = slice_planes(p, rows, {0, 2}, "t");
  const Bytes want = native_slice(s, g, rows, {0, 2});
  const CsfPlanes fresh = encode_planes(sl.shape, want, "t");
  EXPECT_EQ(sl.fixed[0], 0);
  EXPECT_EQ(sl.exceptions.size(), 32u);
  EXPECT_EQ(fresh.fixed[0], 85);
  EXPECT_TRUE(fresh.exceptions.empty());
  EXPECT_TRUE(decode_planes(sl, "t") == want);
  EXPECT_TRUE(decode_planes(fresh, "t") == want);
}

TEST(B12xPlanes, MisalignedSlicesAreRefused) {
  std::mt19937_64 rng(1);
  const CsfPlanes nv = encode_planes({kNv, 64, 8}, make_grid({kNv, 64, 8}, Regime::uniform, rng), "t");
  const CsfPlanes mx = encode_planes({kMx, 64, 9}, make_grid({kMx, 64, 9}, Regime::uniform, rng), "t");
  auto expect_invalid = [](const CsfPlanes& p, std::vector<AxisRange> rows, AxisRange cols,
                           const char* reason) {
    try {
      slice_planes(p, rows, cols, "layers.1.w13.weight_scale");
      ADD_FAILURE() << "accepted; expected: " << reason;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("layers.1.w13.weight_scale"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(reason), std::string::npos) << e.what();
    }
  };
  expect_invalid(nv, {{8, 16}}, {0, 8}, "slab boundary");
  expect_invalid(nv, {{16, 24}}, {0, 8}, "slab boundary");
  expect_invalid(nv, {{0, 16}, {40, 16}}, {0, 8}, "slab boundary");
  expect_invalid(nv, {{48, 32}}, {0, 8}, "outside");
  expect_invalid(nv, {{0, 0}}, {0, 8}, "empty");
  expect_invalid(nv, {}, {0, 8}, "no row ranges");
  expect_invalid(nv, {{0, 16}}, {1, 4}, "even");
  expect_invalid(nv, {{0, 16}}, {2, 3}, "even");
  expect_invalid(nv, {{0, 16}}, {4, 6}, "outside");
  const std::uint64_t huge = ~std::uint64_t{15};  // first + count wraps around to 16
  expect_invalid(nv, {{huge, 32}}, {0, 8}, "outside");
  expect_invalid(nv, {{0, 16}}, {huge, 18}, "outside");
  expect_invalid(mx, {{0, 16}}, {0, 0}, "empty");
  expect_invalid(mx, {{0, 16}}, {5, 5}, "outside");
  EXPECT_NO_THROW(
      slice_planes(mx, std::vector<AxisRange>{{16, 32}}, {3, 5}, "t"));  // odd columns are fine for MXFP4
}

TEST(B12xPlanes, ConcatenationEqualsEncodingTheStackedGrid) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (ScaleFormat f : {kNv, kMx})
    for (int i = 0; i < 10; ++i) {
      const PlaneShape first = random_shape(f, rng);
      const std::size_t n = 1 + rng() % 3;
      std::vector<CsfPlanes> parts;
      Bytes stacked;
      for (std::size_t k = 0; k < n; ++k) {
        const PlaneShape s{f, 16 * (1 + static_cast<std::uint32_t>(rng() % 6)), first.cols};
        const Bytes g = make_grid(s, kRegimes[(i + k) % std::size(kRegimes)], rng);
        stacked.insert(stacked.end(), g.begin(), g.end());
        parts.push_back(encode_planes(s, g, "t"));
      }
      const CsfPlanes joined = concat_planes(parts, "t");
      SCOPED_TRACE(to_string(joined.shape));
      expect_same_planes(joined, encode_planes(joined.shape, stacked, "t"));
      EXPECT_TRUE(decode_planes(joined, "t") == stacked);
    }
}

TEST(B12xPlanes, ConcatenationRefusals) {
  std::mt19937_64 rng(3);
  const CsfPlanes a = encode_planes({kNv, 16, 4}, make_grid({kNv, 16, 4}, Regime::uniform, rng), "t");
  const CsfPlanes b = encode_planes({kNv, 16, 6}, make_grid({kNv, 16, 6}, Regime::uniform, rng), "t");
  const CsfPlanes c = encode_planes({kMx, 16, 4}, make_grid({kMx, 16, 4}, Regime::uniform, rng), "t");
  EXPECT_THROW(concat_planes(std::vector<CsfPlanes>{}, "t"), InvalidArgument);
  EXPECT_THROW(concat_planes(std::vector<CsfPlanes>{a, b}, "t"), InvalidArgument);
  EXPECT_THROW(concat_planes(std::vector<CsfPlanes>{a, c}, "t"), InvalidArgument);
  CsfPlanes bad = a;
  bad.fixed[0] = 250;
  try {
    concat_planes(std::vector<CsfPlanes>{a, bad}, "w31");
    ADD_FAILURE() << "accepted";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("w31 part 1"), std::string::npos) << e.what();
  }
  // 2^24 positions at most: 2 x [16, 2^19] MXFP4 is exactly 2^24, a third part is too many.
  CsfPlanes wide;
  wide.shape = {kMx, 16, 1u << 19};
  wide.fixed.assign(plane_fixed_bytes(wide.shape), 0);
  EXPECT_NO_THROW(concat_planes(std::vector<CsfPlanes>{wide, wide}, "t"));
  EXPECT_THROW(concat_planes(std::vector<CsfPlanes>{wide, wide, wide}, "t"), InvalidArgument);
}

// --- the CsfTensor form -----------------------------------------------------------
TEST(B12xPlanes, SameBasesCodesAndRecordsAsTheCsfTensor) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (ScaleFormat f : {kNv, kMx}) {
    std::vector<PlaneShape> shapes = edge_shapes(f);
    for (int i = 0; i < 4; ++i) shapes.push_back(random_shape(f, rng));
    for (const PlaneShape& s : shapes)
      for (Regime regime : kRegimes) {
        SCOPED_TRACE(to_string(s) + " " + name_of(regime));
        const std::uint32_t E = 1 + static_cast<std::uint32_t>(rng() % 3);
        Bytes native;
        std::vector<CsfPlanes> planes;
        for (std::uint32_t e = 0; e < E; ++e) {
          const Bytes g = make_grid(s, regime, rng);
          native.insert(native.end(), g.begin(), g.end());
          planes.push_back(encode_planes(s, g, "t"));
        }
        const CsfTensor t = encode(GridShape{f, ScaleLayout::row_major, E, s.rows, s.cols}, native);
        // Planes to the resident form: every part equals csfmoe's own encoding.
        const CsfTensor from = planes_to_csf(planes, "t");
        EXPECT_EQ(from.geometry.shape, t.geometry.shape);
        EXPECT_TRUE(from.fixed == t.fixed) << "fixed parts differ";
        EXPECT_TRUE(from.exceptions == t.exceptions) << "records differ";
        EXPECT_TRUE(from.row_prefix == t.row_prefix) << "row_prefix differs";
        EXPECT_TRUE(from.partition_index == t.partition_index) << "partition_index differs";
        EXPECT_NO_THROW(validate(from));
        // And back.
        const std::vector<CsfPlanes> back = csf_to_planes(t, "t");
        ASSERT_EQ(back.size(), E);
        for (std::uint32_t e = 0; e < E; ++e) expect_same_planes(back[e], planes[e]);
        // MXFP4 slabs are 16 rows in both forms: the plane is the fixed part's first R / 16 slabs.
        if (f == kMx)
          for (std::uint32_t e = 0; e < E; ++e)
            EXPECT_TRUE(std::equal(planes[e].fixed.begin(), planes[e].fixed.end(),
                                   t.fixed.begin() + std::ptrdiff_t(e * t.geometry.fixed_bytes_per_expert)));
      }
  }
}

TEST(B12xPlanes, SwizzledCsfTensorGivesThePlanesOfItsLogicalGrid) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (ScaleFormat f : {kNv, kMx}) {
    const PlaneShape s{f, 128, 12};
    const Bytes logical = make_grid(s, Regime::realistic, rng);
    Bytes swizzled(logical.size());
    for (std::uint32_t r = 0; r < s.rows; ++r)
      for (std::uint32_t c = 0; c < s.cols; ++c)
        swizzled[swizzled_index(r, c, s.cols)] = logical[r * s.cols + c];
    const CsfTensor t = encode(GridShape{f, ScaleLayout::swizzled_128x4, 1, s.rows, s.cols}, swizzled);
    const std::vector<CsfPlanes> planes = csf_to_planes(t, "t");
    ASSERT_EQ(planes.size(), 1u);
    expect_same_planes(planes[0], encode_planes(s, logical, "t"));
  }
}

TEST(B12xPlanes, ConversionRefusals) {
  std::mt19937_64 rng(2);
  const PlaneShape s{kNv, 16, 4};
  const CsfPlanes a = encode_planes(s, make_grid(s, Regime::uniform, rng), "t");
  const CsfPlanes b = encode_planes({kNv, 32, 4}, make_grid({kNv, 32, 4}, Regime::uniform, rng), "t");
  EXPECT_THROW(planes_to_csf(std::vector<CsfPlanes>{}, "t"), InvalidArgument);
  EXPECT_THROW(planes_to_csf(std::vector<CsfPlanes>{a, b}, "t"), InvalidArgument);
  // The resident NVFP4 form pads to 128 rows: 16 x 2^19 holds 2^23 positions as planes,
  // 128 x 2^19 = 2^26 padded positions do not fit 24 bits.
  CsfPlanes wide;
  wide.shape = {kNv, 16, 1u << 19};
  wide.fixed.assign(plane_fixed_bytes(wide.shape), 0);
  try {
    planes_to_csf(std::vector<CsfPlanes>{wide}, "wide");
    ADD_FAILURE() << "accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("24-bit"), std::string::npos) << e.what();
  }
  // A CsfTensor whose grid the planes cannot hold (rows not a multiple of 16).
  const CsfTensor odd = encode(GridShape{kMx, ScaleLayout::row_major, 1, 20, 4}, Bytes(80, 3));
  EXPECT_THROW(csf_to_planes(odd, "t"), InvalidArgument);
  // A malformed CsfTensor is refused with the tensor's name.
  CsfTensor bad = encode(GridShape{kNv, ScaleLayout::row_major, 1, 16, 4}, Bytes(64, 3));
  bad.fixed[0] = 250;
  try {
    csf_to_planes(bad, "bad.weight_scale");
    ADD_FAILURE() << "accepted";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("bad.weight_scale"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace csfmoe
