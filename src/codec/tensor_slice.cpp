// Byte-level slicing of checkpoint tensors (include/csfmoe/tensor_slice.hpp).
#include "csfmoe/tensor_slice.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <string>

#include "csfmoe/errors.hpp"

namespace csfmoe {
namespace {

// Copies rows [first, first + count) of each of `blocks` consecutive blocks
// of `rows_per_block` rows of `row_bytes` bytes.
void copy_rows(const std::uint8_t* src, std::uint8_t* dst, std::uint64_t blocks, std::uint64_t rows_per_block,
               std::uint64_t row_bytes, std::span<const AxisRange> ranges) {
  for (std::uint64_t b = 0; b < blocks; ++b)
    for (const AxisRange& r : ranges) {
      const std::uint64_t n = r.count * row_bytes;
      if (n) std::memcpy(dst, src + (b * rows_per_block + r.first) * row_bytes, n);
      dst += n;
    }
}

std::uint64_t total(std::span<const AxisRange> ranges) {
  std::uint64_t n = 0;
  for (const auto& r : ranges) n += r.count;
  return n;
}

}  // namespace

std::string_view to_string(TpSplit s) noexcept {
  switch (s) {
    case TpSplit::none:
      return "none";
    case TpSplit::rows:
      return "rows";
    case TpSplit::gate_up_rows:
      return "gate_up_rows";
    case TpSplit::cols:
      return "cols";
  }
  return "?";
}

TpSplit tensor_parallel_split_of(std::string_view name) {
  constexpr std::string_view kExperts = "experts.";
  std::size_t pos = name.rfind(kExperts);
  // "experts." must start a component ("mlp.experts." or a leading "experts."),
  // so that "shared_experts." (a dense MLP) does not count.
  while (pos != std::string_view::npos && pos > 0 && name[pos - 1] != '.')
    pos = pos == 0 ? std::string_view::npos : name.rfind(kExperts, pos - 1);
  if (pos == std::string_view::npos) return TpSplit::none;
  std::string_view rest = name.substr(pos + kExperts.size());
  // Longest names first so that "w13" is not taken for "w1".
  static constexpr std::array<std::pair<std::string_view, TpSplit>, 9> kProj{{
      {"gate_up_proj", TpSplit::gate_up_rows},
      {"gate_proj", TpSplit::rows},
      {"down_proj", TpSplit::cols},
      {"up_proj", TpSplit::rows},
      {"w13", TpSplit::gate_up_rows},
      {"w31", TpSplit::gate_up_rows},
      {"w1", TpSplit::rows},
      {"w2", TpSplit::cols},
      {"w3", TpSplit::rows},
  }};
  while (!rest.empty()) {
    const std::size_t dot = rest.find('.');
    const std::string_view comp = rest.substr(0, dot);
    for (const auto& [p, split] : kProj)
      if (comp == p || (comp.size() > p.size() && comp.substr(0, p.size()) == p && comp[p.size()] == '_'))
        return split;
    if (dot == std::string_view::npos) break;
    rest = rest.substr(dot + 1);
  }
  return TpSplit::none;
}

std::vector<AxisRange> tensor_parallel_axis_ranges(std::uint64_t length, TpSplit split, unsigned tp,
                                                   unsigned rank, std::uint64_t granule,
                                                   std::string_view what) {
  if (tp == 0) throw InvalidArgument(fmt::format("{}: tp must be at least 1", what));
  if (rank >= tp) throw InvalidArgument(fmt::format("{}: rank {} is not below tp = {}", what, rank, tp));
  if (granule == 0) granule = 1;
  if (split == TpSplit::none) return {AxisRange{0, length}};
  const std::uint64_t parts = split == TpSplit::gate_up_rows ? 2ull * tp : tp;
  if (length % parts || (length / parts) % granule) {
    const std::string units = granule > 1 ? fmt::format(" of whole {}-element groups", granule) : "";
    if (split == TpSplit::gate_up_rows)
      throw InvalidArgument(fmt::format(
          "{}: cannot cut its {} rows (gate half and up half) into tp = {} equal slices per half{}: "
          "for tp = {} the row count must be a multiple of {}",
          what, length, tp, units, tp, parts * granule));
    throw InvalidArgument(
        fmt::format("{}: cannot cut an axis of {} elements into tp = {} equal slices{}: for tp = {} it must "
                    "be a multiple of {}",
                    what, length, tp, units, tp, parts * granule));
  }
  const std::uint64_t n = length / parts;
  if (split == TpSplit::gate_up_rows) return {AxisRange{rank * n, n}, AxisRange{length / 2 + rank * n, n}};
  return {AxisRange{rank * n, n}};
}

std::vector<std::uint8_t> slice_axis(std::span<const std::uint8_t> src, std::span<const std::uint64_t> shape,
                                     std::size_t elem_size, std::size_t axis,
                                     std::span<const AxisRange> ranges) {
  if (axis >= shape.size())
    throw InvalidArgument(fmt::format("slice_axis: axis {} of a rank-{} tensor", axis, shape.size()));
  std::uint64_t outer = 1, inner = elem_size;
  for (std::size_t i = 0; i < axis; ++i) outer *= shape[i];
  for (std::size_t i = axis + 1; i < shape.size(); ++i) inner *= shape[i];
  const std::uint64_t len = shape[axis];
  if (src.size() != outer * len * inner)
    throw InvalidArgument(fmt::format("slice_axis: {} bytes do not hold a tensor of {} elements of {} bytes",
                                      src.size(), outer * len * inner / std::max<std::size_t>(elem_size, 1),
                                      elem_size));
  for (const auto& r : ranges)
    if (r.first > len || r.count > len - r.first)
      throw InvalidArgument(fmt::format("slice_axis: range [{}, {}) is outside axis {} of length {}", r.first,
                                        r.first + r.count, axis, len));
  std::vector<std::uint8_t> out(outer * total(ranges) * inner);
  copy_rows(src.data(), out.data(), outer, len, inner, ranges);
  return out;
}

std::vector<std::uint8_t> slice_scale_grid(const GridShape& stored, std::uint32_t true_rows,
                                           std::uint32_t true_cols, std::span<const std::uint8_t> src,
                                           std::span<const AxisRange> rows, AxisRange cols,
                                           GridShape* out_shape) {
  const std::uint64_t E = stored.experts, R = stored.rows, C = stored.cols;
  if (src.size() != E * R * C)
    throw InvalidArgument(
        fmt::format("slice_scale_grid: {} bytes do not hold a [{}, {}, {}] grid", src.size(), E, R, C));
  const bool swz = stored.layout == ScaleLayout::swizzled_128x4;
  if (stored.layout != ScaleLayout::row_major && !swz)
    throw InvalidArgument(fmt::format("slice_scale_grid: unknown layout {}", unsigned(stored.layout)));
  if (swz ? (R != round_up(true_rows, 128) || C != round_up(true_cols, 4))
          : (R != true_rows || C != true_cols))
    throw InvalidArgument(
        fmt::format("slice_scale_grid: stored {}x{} {} grid does not hold a true {}x{} grid", R, C,
                    to_string(stored.layout), true_rows, true_cols));
  for (const auto& r : rows)
    if (r.first > true_rows || r.count > true_rows - r.first)
      throw InvalidArgument(fmt::format("slice_scale_grid: rows [{}, {}) outside the {} true rows", r.first,
                                        r.first + r.count, true_rows));
  if (cols.first > true_cols || cols.count > true_cols - cols.first)
    throw InvalidArgument(fmt::format("slice_scale_grid: columns [{}, {}) outside the {} true columns",
                                      cols.first, cols.first + cols.count, true_cols));
  const std::uint64_t r_out = total(rows), c_out = cols.count;
  GridShape res = stored;
  res.rows = static_cast<std::uint32_t>(swz ? round_up(r_out, 128) : r_out);
  res.cols = static_cast<std::uint32_t>(swz ? round_up(c_out, 4) : c_out);
  if (out_shape) *out_shape = res;
  std::vector<std::uint8_t> out(E * res.rows * res.cols, 0);
  if (!swz) {
    // Row-major: plain row blocks then a column window of each row.
    std::uint8_t* d = out.data();
    for (std::uint64_t e = 0; e < E; ++e)
      for (const auto& r : rows)
        for (std::uint64_t i = 0; i < r.count; ++i) {
          if (c_out) std::memcpy(d, src.data() + (e * R + r.first + i) * C + cols.first, c_out);
          d += c_out;
        }
    return out;
  }
  // Swizzled: move each true cell to its new tile position; padding stays 0.
  const std::uint64_t in_grid = R * C, out_grid = std::uint64_t{res.rows} * res.cols;
  for (std::uint64_t e = 0; e < E; ++e) {
    std::uint64_t ro = 0;
    for (const auto& r : rows)
      for (std::uint64_t i = 0; i < r.count; ++i, ++ro)
        for (std::uint64_t c = 0; c < c_out; ++c)
          out[e * out_grid + swizzled_index(ro, c, res.cols)] =
              src[e * in_grid + swizzled_index(r.first + i, cols.first + c, C)];
  }
  return out;
}

}  // namespace csfmoe
