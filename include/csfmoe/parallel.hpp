// Splitting an MoE layer over several GPUs, on the host, without touching a
// single FP4 code or scale value (no requantization):
//
//   tensor parallel (TP): every rank holds every expert, restricted to a slice
//     of the intermediate dimension N. w13/w31 keep rows [r*N/tp, (r+1)*N/tp)
//     of both the gate and the up half; w2 keeps the same columns of N. Each
//     rank's output is a partial sum over N; the sum over ranks (an
//     all-reduce) is the layer's output. Global scales are per expert and stay.
//     Expert biases (gpt_oss): w13_bias keeps the same entries of both
//     halves as the rows; w2_bias goes to rank 0 only (the other ranks' is
//     empty, i.e. none), so the sum over ranks adds it once.
//   expert parallel (EP): every rank holds whole experts, a contiguous block of
//     expert ids; a token's slots are sent to the ranks owning their experts.
//     Biases go with their experts.
//
// The byte-level tensor slicer under both (and under `csf compress --tp N
// --rank R`) is tensor_slice.hpp, included here.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "csfmoe/codec.hpp"
#include "csfmoe/formats.hpp"
#include "csfmoe/moe.hpp"
#include "csfmoe/tensor_slice.hpp"

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

}  // namespace csfmoe
