// Pieces of the call plan (csfmoe/call_plan.hpp) that the launchers share:
// which layer shapes each GEMM kernel takes, and the prefill and grouped
// thresholds.
#pragma once

#include <cstdint>

#include "csfmoe/call_plan.hpp"
#include "moe/decode_shape.hpp"
#include "moe/grouped_shape.hpp"

namespace csfmoe::moe_detail {

// The prefill kernel's block covers 256 weight rows and its pipeline stages
// 128 K (kPrefillRows and kPrefillKBlock, checked in prefill_launch.cu).
constexpr std::uint32_t kPrefillHiddenStep = 256;
constexpr std::uint32_t kPrefillIntermediateStep = 128;
constexpr bool prefill_shape_ok(std::uint32_t hidden, std::uint32_t intermediate) {
  return hidden % kPrefillHiddenStep == 0 && intermediate % kPrefillIntermediateStep == 0;
}

// The smallest T that runs the prefill kernel: the option, or 16 routed rows
// per expert on average (T * k >= 16 * E).
std::uint32_t prefill_threshold(const MoeBindOptions& options, const MoeLayerGeometry& geometry);

// The smallest T that runs the grouped kernel: the option, or with 0 (the
// default) kGroupedMinRowsPerExpert routed rows per expert on average,
// T * k >= 5 * E: between the H200's DeepSeek-V3 T = 128 (4 E, decode 13 %
// faster) and the H100's Kimi K2 T = 256 (5.3 E, grouped 15 % faster;
// bench/RESULTS.md, "Grouped kernel").
std::uint32_t grouped_threshold(const MoeBindOptions& options, const MoeLayerGeometry& geometry);

// Whether the layer's calls may run the decode kernel on the device: the
// option allows it, K of both GEMMs is whole K blocks, and the widest block
// fits the device's opt-in shared memory (decode_smem_bytes).
bool decode_possible(const MoePlan& plan, const MoeDeviceCaps& caps, const MoeBindOptions& options);

// The decode kernel's block shape for one GEMM of K = `k` over `tiles`
// routing tiles of `row_blocks` row blocks each, passes of 8 * nt tokens,
// CSF (stage-read) or dense scales.
MoeDecodeShape decode_shape(std::uint64_t tiles, std::uint32_t k, std::uint32_t row_blocks, std::uint32_t nt,
                            bool csf, std::uint32_t sm_count, const MoeDecodeTuning& tuning);

}  // namespace csfmoe::moe_detail
