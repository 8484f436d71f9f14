// Splitting an MoE layer over several GPUs, on the host, without touching a
// single FP4 code or scale value (no requantization):
//
//   tensor parallel (TP): every rank holds every expert, restricted to a slice
//     of the intermediate dimension N. w13/w31 keep rows [r*N/tp, (r+1)*N/tp)
//     of both the gate and the up half; w2 keeps the same columns of N. Each
//     rank's output is a partial sum over N; the sum over ranks (an
//     all-reduce) is the layer's output. Global scales are per expert and stay.
//   expert parallel (EP): every rank holds whole experts, a contiguous block of
//     expert ids; a token's slots are sent to the ranks owning their experts.
//
// Also the byte-level slicer used by `csf compress --tp N --rank R` on
// checkpoint tensors (any dtype, row_major or swizzled_128x4 scale grids).
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "csfmoe/codec.hpp"
#include "csfmoe/formats.hpp"
#include "csfmoe/moe.hpp"

namespace csfmoe {

// ---------------------------------------------------------------------------
// Tensor parallel
// ---------------------------------------------------------------------------

// Intermediate columns [first, first + count) that TP rank `rank` of `tp` holds.
struct TpRange {
  std::uint32_t first = 0;
  std::uint32_t count = 0;
};

// Validates (tp >= 1, rank < tp, N % tp == 0, N/tp a multiple of the group
// size and of MoePlan::kTile) and returns the rank's range; InvalidArgument
// naming the argument otherwise.
TpRange tensor_parallel_range(ScaleFormat format, const MoeLayerGeometry& geometry, unsigned tp,
                              unsigned rank);

// The rank's slice: geometry.intermediate = N/tp, everything else unchanged.
// tp = 1 returns a copy.
MoeHostWeights slice_tensor_parallel(const MoeHostWeights& w, unsigned tp, unsigned rank);

// ---------------------------------------------------------------------------
// Expert parallel
// ---------------------------------------------------------------------------

// Rank `rank` of `ranks` owns experts [first, first + count): contiguous
// blocks, the first E % ranks ranks one expert more than the others.
struct ExpertPartition {
  std::uint32_t experts = 0;  // E of the whole layer
  std::uint32_t ranks = 1;
  std::uint32_t rank = 0;
  std::uint32_t first = 0;
  std::uint32_t count = 0;
  bool owns(std::uint32_t expert) const { return expert >= first && expert - first < count; }
};

// Requires 1 <= ep <= E and rank < ep (InvalidArgument otherwise).
ExpertPartition expert_parallel_partition(std::uint32_t experts, unsigned ep, unsigned rank);
// The rank owning `expert` (< experts) under the same partition.
unsigned expert_owner(std::uint32_t experts, unsigned ep, std::uint32_t expert);

// The rank's experts only (geometry.experts = partition.count; local expert
// i is global expert partition.first + i).
MoeHostWeights slice_expert_parallel(const MoeHostWeights& w, unsigned ep, unsigned rank);

// ---------------------------------------------------------------------------
// Byte-level slicing of checkpoint tensors
// ---------------------------------------------------------------------------

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
