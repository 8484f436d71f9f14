// How fuzz_csf_decode reads its input, shared with the corpus generator so
// that seeds can be written in the same form.
//
//   byte 0      flags: bit 0 format (0 nvfp4, 1 mxfp4), bit 1 swizzled_128x4
//               source, bit 2 raw parts instead of an encoded grid, bit 3
//               also compare with the (slow) reference encoder
//   byte 1      experts - 1 (mod 3)
//   bytes 2-3   rows selector (little-endian)
//   byte 4      cols selector
//   then        the grid "recipe", row by row in logical order: one base byte,
//               then per element a byte b < 0xE0 meaning base + b % W, or 0xE0
//               followed by the byte itself (an exception). Rows cut short
//               repeat their base.
// Everything after that (read from the end by FuzzedDataProvider) drives the
// edits. Shapes are bounded: <= 3 experts, <= 256 rows, <= 40 cols.
#pragma once

#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "csfmoe/codec.hpp"
#include "csfmoe/formats.hpp"

namespace csfmoe_fuzz {

inline constexpr std::uint8_t kExceptionMark = 0xE0;
inline constexpr std::uint32_t kMaxExperts = 3, kMaxRows = 256, kMaxCols = 40;

struct ShapeChoice {
  csfmoe::GridShape shape;
  bool raw = false;
  bool compare_encoders = false;
};

inline ShapeChoice shape_from_header(const std::uint8_t h[5]) {
  ShapeChoice c;
  c.shape.format = (h[0] & 1) ? csfmoe::ScaleFormat::mxfp4 : csfmoe::ScaleFormat::nvfp4;
  const bool swz = (h[0] >> 1) & 1;
  c.shape.layout = swz ? csfmoe::ScaleLayout::swizzled_128x4 : csfmoe::ScaleLayout::row_major;
  c.raw = (h[0] >> 2) & 1;
  c.compare_encoders = (h[0] >> 3) & 1;
  c.shape.experts = 1 + h[1] % kMaxExperts;
  const unsigned rsel = h[2] | (unsigned{h[3]} << 8);
  c.shape.rows = swz ? 128 * (1 + rsel % (kMaxRows / 128)) : 1 + rsel % kMaxRows;
  c.shape.cols = swz ? 4 * (1 + h[4] % (kMaxCols / 4)) : 1 + h[4] % kMaxCols;
  return c;
}

inline ShapeChoice read_shape(FuzzedDataProvider& in) {
  std::uint8_t h[5] = {};
  const auto b = in.ConsumeBytes<std::uint8_t>(5);
  std::copy(b.begin(), b.end(), h);
  return shape_from_header(h);
}

// Index of logical (e, r, c) in the source buffer of this shape.
inline std::size_t source_index(const csfmoe::GridShape& s, std::uint32_t e, std::uint32_t r,
                                std::uint32_t c) {
  const std::size_t per = std::size_t{s.rows} * s.cols;
  if (s.layout == csfmoe::ScaleLayout::row_major) return e * per + std::size_t{r} * s.cols + c;
  return e * per + csfmoe::swizzled_index(r, c, s.cols);
}

inline std::vector<std::uint8_t> read_grid(FuzzedDataProvider& in, const csfmoe::CsfGeometry& g) {
  const auto& s = g.shape;
  const unsigned w = csfmoe::csf_window(s.format);
  std::vector<std::uint8_t> out(std::size_t{s.experts} * s.rows * s.cols);
  // The recipe is consumed from the front, one byte at a time.
  auto next = [&](std::uint8_t& v) {
    if (!in.remaining_bytes()) return false;
    v = in.ConsumeBytes<std::uint8_t>(1)[0];
    return true;
  };
  for (std::uint32_t e = 0; e < s.experts; ++e)
    for (std::uint32_t r = 0; r < s.rows; ++r) {
      std::uint8_t base = 0;
      bool live = next(base);
      for (std::uint32_t c = 0; c < s.cols; ++c) {
        std::uint8_t b = 0, v = base;
        if (live && (live = next(b))) {
          if (b == kExceptionMark) {
            if (!(live = next(v))) v = base;
          } else {
            v = static_cast<std::uint8_t>(std::min(255u, base + b % w));
          }
        }
        out[source_index(s, e, r, c)] = v;
      }
    }
  return out;
}

// Inverse of read_grid for the corpus generator: the recipe for a source grid.
inline std::vector<std::uint8_t> write_recipe(const csfmoe::CsfTensor& t,
                                              const std::vector<std::uint8_t>& src) {
  const auto& s = t.geometry.shape;
  const unsigned w = csfmoe::csf_window(s.format);
  std::vector<std::uint8_t> out;
  for (std::uint32_t e = 0; e < s.experts; ++e)
    for (std::uint32_t r = 0; r < s.rows; ++r) {
      const std::uint8_t base = csfmoe::row_base(t, e, r);
      out.push_back(base);
      for (std::uint32_t c = 0; c < s.cols; ++c) {
        const std::uint8_t v = src[source_index(s, e, r, c)];
        if (v >= base && v < base + w) {
          out.push_back(static_cast<std::uint8_t>(v - base));
        } else {
          out.push_back(kExceptionMark);
          out.push_back(v);
        }
      }
    }
  return out;
}

}  // namespace csfmoe_fuzz
