// Byte-level slicing of checkpoint tensors along one axis, the pieces a
// tensor-parallel rank keeps (any dtype, row_major or swizzled_128x4 scale
// grids). Below the codec, the checkpoint wing and the MoE layer, which all
// cut tensors with it; parallel.hpp builds TP/EP sharding of layers on top.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "csfmoe/codec.hpp"

namespace csfmoe {

// How an expert projection splits under TP, from its tensor name.
enum class TpSplit : std::uint8_t {
  none,          // not an expert projection (copied unchanged)
  rows,          // separate gate or up projection (w1, w3, gate_proj, up_proj): output rows
  gate_up_rows,  // fused gate/up (w13, w31, gate_up_proj): each half's rows
  cols,          // down projection (w2, down_proj): input columns
};
std::string_view to_string(TpSplit s) noexcept;

// Only names under an MoE experts module ("...experts...") are projections;
// the projection is the first name component after it equal to, or starting
// with "<proj>_", one of the names above ("w13_weight", "gate_up_proj_blocks").
TpSplit tensor_parallel_split_of(std::string_view tensor_name);

struct AxisRange {
  std::uint64_t first = 0;
  std::uint64_t count = 0;
};

// Ranges of an axis of `length` that TP rank `rank` keeps: one range for rows
// and cols, two (one per half) for gate_up_rows. Each kept piece must be a
// whole number of `granule` units; InvalidArgument naming `what` otherwise.
std::vector<AxisRange> tensor_parallel_axis_ranges(std::uint64_t length, TpSplit split, unsigned tp,
                                                   unsigned rank, std::uint64_t granule,
                                                   std::string_view what);

// A dense row-major tensor of `shape` (elements of elem_size bytes) restricted
// along `axis` to the concatenation of `ranges`. InvalidArgument for a size
// that disagrees with the shape or a range outside the axis.
std::vector<std::uint8_t> slice_axis(std::span<const std::uint8_t> src, std::span<const std::uint64_t> shape,
                                     std::size_t elem_size, std::size_t axis,
                                     std::span<const AxisRange> ranges);

// A stack of scale grids as stored (`stored`: row_major [E, rows, cols], or
// swizzled_128x4 with rows, cols already padded) whose true grid is
// true_rows x true_cols, restricted to the true rows in `rows`
// (concatenated) and the true columns in `cols`. The result has the same
// layout; a swizzled result is re-padded (round up to 128 rows, 4 columns)
// with zero padding. `out_shape` receives the stored shape of the result.
std::vector<std::uint8_t> slice_scale_grid(const GridShape& stored, std::uint32_t true_rows,
                                           std::uint32_t true_cols, std::span<const std::uint8_t> src,
                                           std::span<const AxisRange> rows, AxisRange cols,
                                           GridShape* out_shape = nullptr);

}  // namespace csfmoe
