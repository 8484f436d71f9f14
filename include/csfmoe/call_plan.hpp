// The launch plan of one MoE layer call: which scale mode and GEMM kernel it
// runs, and for the decode kernel the block shape of each GEMM. plan_call is a
// pure host function of the layer plan, the device's capabilities, T and the
// binding's options; bind (moe_cuda.hpp) reads the capabilities once and
// BoundMoe::call_plan applies it per call. Nothing here needs CUDA.
#pragma once

#include <cstdint>
#include <optional>

#include "csfmoe/moe.hpp"

namespace csfmoe {

// The GEMM kernels a call can run on: the weight-streaming decode kernel
// (tokens are the MMA's narrow side; best while experts see few tokens), the
// Hopper prefill kernel (wgmma; large calls on sm_90), the Hopper grouped
// kernel (persistent, warp-specialized TMA + wgmma with token tiles sized by
// the routed rows per expert; mid-range and large calls on sm_90), or the
// tiled kernel (64 x 64 tiles; any shape and device). All give results
// within the same error bound; each is deterministic, and all scale modes
// one kernel runs give identical bits.
enum class MoeKernel { decode, tiled, prefill, grouped };
const char* to_string(MoeKernel k);

// Explicit block shape of the decode kernel (benchmarks, tests); -1 = auto
// (the rules below). Every field is checked by validate(MoeDecodeTuning).
struct MoeDecodeTuning {
  // Warps per block: 1, 2, 4 or 8 (fewer where K has fewer K blocks of 128).
  int warps = -1;
  // Row blocks a block streams in turn, 1..64, where the launch can run them
  // (dense scales, passes of 8 tokens, >= 4 K blocks per warp); else 1.
  int row_block_run = -1;
  // K blocks per ring copy: 1 turns paired copies off (auto: pairs where
  // every warp gets whole pairs, the same number each).
  int copy_kblocks = -1;
  // The automatic warps rule (docs/moe-api.md), 1..1024 each: K blocks per
  // warp to aim for, the fewest per warp, and the launch waves to fill.
  int kblocks_per_warp = -1;
  int min_kblocks_per_warp = -1;
  int waves = -1;
};

// Throws InvalidArgument naming the first field outside its allowed values.
void validate(const MoeDecodeTuning& tuning);

struct MoeBindOptions {
  // Force one scale mode for every call (tests, benchmarks); it must suit the
  // layer: native needs compression none, the others csf, expanded and
  // routed a scratch.
  std::optional<MoeScaleMode> force_mode;
  // Calls with T <= decode_max_tokens run the decode kernel, larger ones the
  // tiled kernel; 0 means always tiled. Layers whose H or N is not a multiple
  // of 128, or whose decode kernel would not fit the device's shared memory,
  // always run tiled. The default covers every measured size (T = 1..8192),
  // where the decode kernel was the faster of the two (docs/moe-api.md).
  std::uint32_t decode_max_tokens = 8192;
  // Calls with T >= prefill_min_tokens run the prefill kernel where it
  // applies: an sm_90 device, H a multiple of 256 and N of 128, a call whose
  // scales are dense (native, expanded or routed; a stage-read call runs the
  // decode kernel). It takes precedence over decode_max_tokens; 0xFFFFFFFF
  // never uses it. 0 (the default): T * top_k >= 16 * E, 16 rows per expert
  // on average (docs/moe-api.md).
  std::uint32_t prefill_min_tokens = 0;
  // Calls with T >= grouped_min_tokens run the grouped kernel where it
  // applies (as the prefill kernel: sm_90, H a multiple of 256 and N of 128,
  // dense scales); it takes precedence over the prefill and decode kernels.
  // 0xFFFFFFFF never uses it; 0 (the default): T * top_k >= 5 * E, 5 routed
  // rows per expert on average, the measured crossover (docs/moe-api.md).
  std::uint32_t grouped_min_tokens = 0;
  // The grouped kernel's token tile (routed rows per tile, the MMA's N):
  // 16, 24, 32, 48, 64, 80, 96 or 128; 0 (the default) picks one from the
  // mean routed rows per expert, T * k / E, by a measured table
  // (src/moe/grouped_shape.hpp).
  std::uint32_t grouped_token_tile = 0;
  // The grouped kernel's work order: token tiles per raster group (each
  // group's row blocks run over its tiles, so activation rows and weights
  // are reused from L2); 0 (the default) = 1, each tile's row blocks back to
  // back; a value >= the call's tiles walks each row block over all tiles.
  std::uint32_t grouped_tile_group = 0;
  // The grouped down GEMM writes each routed slot's output as bf16 (half the
  // bytes of FP32, for it and for the combine, which still sums the slots in
  // FP32 in slot order); true keeps FP32 slots, as the other kernels always
  // do (results differ in the last bits of the bf16 output).
  bool grouped_fp32_slots = false;
  // The grouped kernel's block scales: 1 the producer copies each stage's
  // 256 scale rows into the ring beside the weights and the consumers read
  // them from shared memory (ring scales); 0 each consumer thread loads its
  // own scale words from global memory two K blocks ahead; -1 (the default)
  // ring scales for the token tiles where they measured faster (16 and 24
  // rows, grouped_ring_scales_by_default in src/moe/grouped_shape.hpp).
  // Results are bit-identical either way; bind rejects other values.
  int grouped_ring_scales = -1;
  // On sm_90 and newer, launch the layer's kernels as programmatic dependents
  // of the one before (PDL): each may start while the previous one drains,
  // and the down GEMM streams its first weights before gate/up has finished.
  // Results are bit-identical either way; false launches them strictly in
  // stream order (for profilers, or streams shared with kernels that
  // misuse PDL).
  bool programmatic_launch = true;
  // Calls of T * top_k >= routing_chunked_min_slots (and more than one chunk
  // of 1024 slots) sort their slots by expert in two grid-wide passes (count
  // per chunk, then scatter) instead of one block walking every slot; the
  // tables are the same either way. The default, 0, takes the two passes for
  // every call of more than one chunk (measured faster from two chunks on:
  // docs/moe-api.md); 0xFFFFFFFF always sorts in one block.
  std::uint32_t routing_chunked_min_slots = 0;
  // Decode kernel block shape overrides (-1 = auto).
  MoeDecodeTuning tuning;
};

// validate(options.tuning) and the grouped token tile; bind calls it.
void validate(const MoeBindOptions& options);

// What bind reads from the layer's device.
struct MoeDeviceCaps {
  std::uint32_t sm_count = 0;
  std::uint32_t smem_per_block_optin = 0;  // bytes of dynamic shared memory a block may opt in to
  int cc_major = 0, cc_minor = 0;          // compute capability
  // The prefill kernels run here (sm_90, their shared memory fits) and are
  // configured (bind does so only when the binding can reach prefill_min_tokens).
  bool prefill_kernels = false;
  // Likewise the grouped kernels (grouped_min_tokens).
  bool grouped_kernels = false;
};

// Block shape of one decode-kernel GEMM launch.
struct MoeDecodeShape {
  std::uint32_t warps = 0;          // per block
  std::uint32_t row_block_run = 1;  // row blocks each block streams in turn
  std::uint32_t copy_kblocks = 1;   // K blocks per ring copy (1 or 2)
  std::uint32_t smem_bytes = 0;     // dynamic shared memory per block
};

// How a routed call (MoeScaleMode::routed) rebuilds its routed experts' CSF
// scales in the scratch, chosen from the number of routed ids R = T * k
// against E by one rule (routed_expansion, b12x's thresholds):
//   all_experts    R >= kExpandAllIdsPerExpert * E: nearly every expert is
//                  hit, so expanding all of them costs no more than finding
//                  the routed ones, and skips reading R ids per block;
//   presence_mask  R >= kExpandMaskMinIds: a bitmap of the routed experts,
//                  built from the ids, drives the expansion;
//   dedupe_scan    fewer ids: a scan that dedupes the few ids directly
//                  (decode calls, T = 1..8 on most models);
//   none           the call expands nothing (not routed, or no routed ids).
enum class RoutedExpansion : std::uint8_t { none, all_experts, presence_mask, dedupe_scan };
const char* to_string(RoutedExpansion s);

// Routed ids per expert from which a call expands every expert.
inline constexpr std::uint64_t kExpandAllIdsPerExpert = 16;
// Routed ids from which a call builds a presence mask instead of deduping.
inline constexpr std::uint64_t kExpandMaskMinIds = 64;

// The strategy for T = tokens with top-k = topk over `experts` experts (never
// none; 0 tokens give dedupe_scan, which expands nothing). T * k saturates
// instead of wrapping. Throws InvalidArgument for experts or topk 0, or topk
// > experts (a token routes to k distinct experts).
RoutedExpansion routed_expansion(std::uint64_t tokens, std::uint32_t topk, std::uint32_t experts);

// The strategy the GPU codec runs for a chosen one: the routed kernel (its
// blocks build a bitmap of the ids, presence_mask) for all three until the
// GPU has measured the others in this role: expanding all experts through
// expand_scales at R >= 16 E, and a dedupe-scan kernel (not written yet)
// below 64 ids (docs/moe-api.md).
RoutedExpansion routed_expansion_kernel(RoutedExpansion chosen);

struct MoeCallPlan {
  MoeScaleMode mode = MoeScaleMode::native;
  MoeKernel kernel = MoeKernel::tiled;
  // Decode kernel: tokens per pass over a tile's rows (8, 16 or 32); 0 for
  // the other kernels.
  std::uint32_t token_pass = 0;
  // Grouped kernel: routed rows per token tile (a kGroupedTokenTiles class); 0 for
  // the other kernels.
  std::uint32_t token_tile = 0;
  // Grouped kernel: token tiles per raster group of its work list, and
  // whether the per-slot down outputs are bf16 (else FP32).
  std::uint32_t tile_group = 0;
  bool bf16_slots = false;
  // Grouped kernel: block scales copied into the ring (grouped_ring_scales).
  bool ring_scales = false;
  MoeDecodeShape gate_up, down;  // decode kernel only
  bool programmatic_launch = false;
  // The routing sorts in two grid-wide passes (MoeBindOptions::
  // routing_chunked_min_slots), else in one block.
  bool routing_chunked = false;
  // Routed mode: the expansion strategy the rule chose (routed_expansion)
  // and the one the call launches (routed_expansion_kernel of it); none for
  // the other modes and for calls of 0 tokens.
  RoutedExpansion expansion = RoutedExpansion::none;
  RoutedExpansion expansion_kernel = RoutedExpansion::none;
};

// The plan of a call of T = tokens on a layer bound with `scales_expanded`
// whose weights hold a scale scratch (`has_scratch`). The rules (also in
// docs/moe-api.md):
//   mode: force_mode, else native (compression none), else expanded
//     (scales_expanded), else stage_read for T <= stage_read_max_tokens unless
//     the call runs the grouped or prefill kernel and the layer has a
//     scratch, else routed.
//   kernel: grouped where the device and shape allow it, T >=
//     grouped_min_tokens and the mode is not stage_read; else prefill
//     likewise from the prefill threshold; else decode where the shape and
//     shared memory allow it and T <= decode_max_tokens; else tiled.
//   token tile (grouped): grouped_token_tile, else the measured table by T * k / E
//     (grouped_token_tile in src/moe/grouped_shape.hpp).
//   token pass: 8 while T <= 32 or T * k <= 4 * E, 16 while T <= 512, else 32.
//   expansion (routed mode, T > 0): routed_expansion(T, k, E).
// Throws InvalidArgument for invalid options.tuning or grouped_token_tile.
MoeCallPlan plan_call(const MoePlan& plan, const MoeDeviceCaps& caps, std::uint32_t tokens,
                      bool scales_expanded, bool has_scratch, const MoeBindOptions& options);

// Whether a call of `tokens` tokens on this layer reads a scratch of
// expanded scales (routed expansion inside the call, or expand_scales ahead
// of it) rather than native or compressed scales, answered from the plan,
// the device's capabilities and the options alone, before any binding (as
// b12x's uses_expanded_nvfp4_scales). A caller that expands every expert
// ahead of such calls (expand_scales on a side stream, then run with
// scales_expanded = true) saves their routed expansion. False for a layer
// without CSF scales.
bool reads_expanded_scales(const MoePlan& plan, const MoeDeviceCaps& caps, std::uint32_t tokens,
                           bool has_scratch, const MoeBindOptions& options = {});

}  // namespace csfmoe
