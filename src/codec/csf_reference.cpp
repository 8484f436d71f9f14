// Reference CSF codec: one cell at a time, straight from docs/csf-format.md.
// The fast paths must stay bit-identical to it; tests use it as the oracle.
#include <array>
#include <limits>

#include "codec/csf_internal.hpp"

namespace csfmoe {
namespace csf_internal {
namespace {

u8 reference_base(const std::array<u32, 256>& hist, unsigned w) {
  u32 best_count = 0;
  unsigned best = 0;
  bool any = false;
  for (unsigned b = 0; b + w - 1 <= 255; ++b) {
    u32 count = 0;
    for (unsigned v = b; v < b + w; ++v) count += hist[v];
    if (!any || count > best_count) {  // strictly greater: the lowest base wins ties
      best_count = count;
      best = b;
      any = true;
    }
  }
  return static_cast<u8>(best);
}

std::size_t source_index(const CsfGeometry& g, u32 e, u32 r, u32 c) {
  const std::size_t per = native_per_expert(g, g.shape.layout);
  if (g.shape.layout == ScaleLayout::row_major) return e * per + std::size_t{r} * g.shape.cols + c;
  return e * per + swizzled_index(r, c, g.padded_cols);
}

}  // namespace

CsfTensor reference_encode(const CsfGeometry& g, std::span<const u8> src) {
  CsfTensor t;
  t.geometry = g;
  t.fixed.assign(g.fixed_bytes(), 0);
  t.row_prefix.assign(g.total_rows() + 1, 0);
  const Fixed fx{g, t.fixed.data()};
  const unsigned w = csf_window(g.shape.format);
  const u32 R = g.shape.rows, C = g.shape.cols;
  u64 count = 0;
  for (u32 e = 0; e < g.shape.experts; ++e) {
    for (u32 r = 0; r < g.padded_rows; ++r) {
      if (count > std::numeric_limits<u32>::max()) too_many_exceptions(g, count);
      t.row_prefix[std::size_t{e} * g.padded_rows + r] = static_cast<u32>(count);
      if (r >= R) continue;  // padding row: base 0, offsets 0, no records
      std::array<u32, 256> hist{};
      for (u32 c = 0; c < C; ++c) ++hist[src[source_index(g, e, r, c)]];
      const u8 base = reference_base(hist, w);
      fx.set_base(e, r, base);
      for (u32 c = 0; c < C; ++c) {
        const u8 v = src[source_index(g, e, r, c)];
        if (v >= base && v < base + w) {
          fx.set_offset(e, r, c, static_cast<u8>(v - base));
        } else {
          t.exceptions.push_back(make_exception(csf::position(r, c, g.padded_cols), v));
          ++count;
        }
      }
    }
  }
  if (count > std::numeric_limits<u32>::max()) too_many_exceptions(g, count);
  t.row_prefix.back() = static_cast<u32>(count);
  finish_partition_index(t);
  return t;
}

// Logical padded grid (padded_rows x padded_cols) of one expert.
namespace {
std::vector<u8> reference_expert_grid(const CsfTensor& t, u32 e) {
  const CsfGeometry& g = t.geometry;
  const Fixed fx{g, const_cast<u8*>(t.fixed.data())};
  std::vector<u8> grid(std::size_t{g.padded_rows} * g.padded_cols);
  for (u32 r = 0; r < g.padded_rows; ++r)
    for (u32 c = 0; c < g.padded_cols; ++c)
      grid[std::size_t{r} * g.padded_cols + c] = static_cast<u8>(fx.base(e, r) + fx.offset(e, r, c));
  const u64 first = t.row_prefix[std::size_t{e} * g.padded_rows];
  const u64 last = t.row_prefix[std::size_t{e + 1} * g.padded_rows];
  for (u64 i = first; i < last; ++i)
    grid[exception_position(t.exceptions[i])] = exception_value(t.exceptions[i]);
  return grid;
}
}  // namespace

void reference_decode_expert(const CsfTensor& t, u32 e, ScaleLayout layout, std::span<u8> dst) {
  const CsfGeometry& g = t.geometry;
  const Fixed fx{g, const_cast<u8*>(t.fixed.data())};
  const std::vector<u8> grid = reference_expert_grid(t, e);
  const std::size_t per = native_per_expert(g, layout);
  u8* out = dst.data() + std::size_t{e} * per;
  const u32 R = g.shape.rows, C = g.shape.cols;
  if (layout == ScaleLayout::row_major) {
    for (u32 r = 0; r < R; ++r)
      for (u32 c = 0; c < C; ++c) out[std::size_t{r} * C + c] = grid[std::size_t{r} * g.padded_cols + c];
    return;
  }
  const u64 rows = swz_rows(R), cols = swz_cols(C);
  for (u32 r = 0; r < rows; ++r)
    for (u32 c = 0; c < cols; ++c) {
      u8 v = 0;  // rows beyond the CSF grid (MXFP4 rounded to 128) decode to 0x00
      if (r < g.padded_rows) v = c < g.padded_cols ? grid[std::size_t{r} * g.padded_cols + c] : fx.base(e, r);
      out[swizzled_index(r, c, cols)] = v;
    }
}

}  // namespace csf_internal

}  // namespace csfmoe
