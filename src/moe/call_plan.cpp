#include "moe/call_plan.hpp"

#include <fmt/core.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <limits>

#include "csfmoe/errors.hpp"
#include "moe/routing_tiles.hpp"

namespace csfmoe {

const char* to_string(MoeKernel k) {
  switch (k) {
    case MoeKernel::decode:
      return "decode";
    case MoeKernel::prefill:
      return "prefill";
    case MoeKernel::grouped:
      return "grouped";
    case MoeKernel::tiled:
      break;
  }
  return "tiled";
}

const char* to_string(RoutedExpansion s) {
  switch (s) {
    case RoutedExpansion::all_experts:
      return "all_experts";
    case RoutedExpansion::presence_mask:
      return "presence_mask";
    case RoutedExpansion::dedupe_scan:
      return "dedupe_scan";
    case RoutedExpansion::none:
      break;
  }
  return "none";
}

RoutedExpansion routed_expansion(std::uint64_t tokens, std::uint32_t topk, std::uint32_t experts) {
  if (experts == 0 || topk == 0 || topk > experts)
    throw InvalidArgument(fmt::format(
        "routed_expansion: top-k {} over {} experts: both must be non-zero and a token routes to k distinct "
        "experts (k <= E)",
        topk, experts));
  constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
  const std::uint64_t ids = tokens > kMax / topk ? kMax : tokens * topk;
  if (ids >= kExpandAllIdsPerExpert * experts) return RoutedExpansion::all_experts;
  if (ids >= kExpandMaskMinIds) return RoutedExpansion::presence_mask;
  return RoutedExpansion::dedupe_scan;
}

RoutedExpansion routed_expansion_kernel(RoutedExpansion chosen) {
  return chosen == RoutedExpansion::none ? RoutedExpansion::none : RoutedExpansion::presence_mask;
}

namespace {

void check_range(int value, int lo, int hi, const char* field) {
  if (value != -1 && (value < lo || value > hi))
    throw InvalidArgument(
        fmt::format("MoeBindOptions.tuning.{} is {}: allowed -1 (auto) or {}..{}", field, value, lo, hi));
}

}  // namespace

void validate(const MoeDecodeTuning& t) {
  if (t.warps != -1 && t.warps != 1 && t.warps != 2 && t.warps != 4 && t.warps != 8)
    throw InvalidArgument(
        fmt::format("MoeBindOptions.tuning.warps is {}: allowed -1 (auto), 1, 2, 4 or 8", t.warps));
  check_range(t.row_block_run, 1, 64, "row_block_run");
  if (t.copy_kblocks != -1 && t.copy_kblocks != 1)
    throw InvalidArgument(
        fmt::format("MoeBindOptions.tuning.copy_kblocks is {}: allowed -1 (auto: pairs where possible) or 1",
                    t.copy_kblocks));
  check_range(t.kblocks_per_warp, 1, 1024, "kblocks_per_warp");
  check_range(t.min_kblocks_per_warp, 1, 1024, "min_kblocks_per_warp");
  check_range(t.waves, 1, 1024, "waves");
}

void validate(const MoeBindOptions& o) {
  validate(o.tuning);
  if (o.grouped_token_tile != 0 && !moe_detail::grouped_token_tile_valid(o.grouped_token_tile))
    throw InvalidArgument(fmt::format("MoeBindOptions.grouped_token_tile is {}: allowed 0 (auto), {}",
                                      o.grouped_token_tile, fmt::join(moe_detail::kGroupedTokenTiles, ", ")));
  if (o.grouped_ring_scales < -1 || o.grouped_ring_scales > 1)
    throw InvalidArgument(
        fmt::format("MoeBindOptions.grouped_ring_scales is {}: allowed -1 (auto, by token tile), 0 "
                    "(per-thread loads) or 1 (ring)",
                    o.grouped_ring_scales));
}

namespace moe_detail {

namespace {

// The smallest T with `option` tokens when it is set, else the smallest with
// `rows_per_expert` routed rows per expert on average (T * k >= rows * E).
std::uint32_t token_threshold(std::uint32_t option, std::uint32_t rows_per_expert,
                              const MoeLayerGeometry& g) {
  if (option != 0) return option;
  const std::uint64_t rows = std::uint64_t{rows_per_expert} * g.experts;
  return std::uint32_t(std::max<std::uint64_t>(1, (rows + g.topk - 1) / g.topk));
}

}  // namespace

std::uint32_t prefill_threshold(const MoeBindOptions& o, const MoeLayerGeometry& g) {
  return token_threshold(o.prefill_min_tokens, 16, g);
}

std::uint32_t grouped_threshold(const MoeBindOptions& o, const MoeLayerGeometry& g) {
  return token_threshold(o.grouped_min_tokens, kGroupedMinRowsPerExpert, g);
}

bool decode_possible(const MoePlan& plan, const MoeDeviceCaps& caps, const MoeBindOptions& options) {
  const MoeLayerGeometry& g = plan.geometry;
  if (options.decode_max_tokens == 0 || !decode_shape_ok(g.hidden, g.intermediate)) return false;
  return std::max(decode_smem_bytes(g.hidden), decode_smem_bytes(g.intermediate)) <=
         caps.smem_per_block_optin;
}

MoeDecodeShape decode_shape(std::uint64_t tiles, std::uint32_t k, std::uint32_t row_blocks, std::uint32_t nt,
                            bool csf, std::uint32_t sm_count, const MoeDecodeTuning& t) {
  const std::uint32_t kblocks = k / kDecodeKBlock;
  const std::uint64_t blocks = tiles * row_blocks;  // with one row block each
  MoeDecodeShape s;
  if (t.warps > 0) {
    // The largest power of two up to the request that K's blocks can feed.
    s.warps = 1;
    while (2 * s.warps <= std::uint32_t(t.warps) && 2 * s.warps <= kblocks) s.warps *= 2;
  } else {
    DecodeShapeRule rule;
    if (t.kblocks_per_warp > 0) rule.kblocks_per_warp = std::uint32_t(t.kblocks_per_warp);
    if (t.min_kblocks_per_warp > 0) rule.min_kblocks_per_warp = std::uint32_t(t.min_kblocks_per_warp);
    if (t.waves > 0) rule.waves = std::uint32_t(t.waves);
    s.warps = decode_warps(kblocks, blocks, sm_count, rule);
  }
  const bool can_run = !csf && nt == 1;
  if (t.row_block_run > 0)
    s.row_block_run = decode_runs_possible(can_run, s.warps, kblocks) ? std::uint32_t(t.row_block_run) : 1;
  else
    s.row_block_run = decode_row_block_run(can_run, s.warps, kblocks, blocks, sm_count);
  s.copy_kblocks = t.copy_kblocks == 1 ? 1 : decode_copy_kblocks(s.warps, kblocks);
  s.smem_bytes = decode_smem(s.warps, nt, csf, s.row_block_run > 1).total;
  return s;
}

}  // namespace moe_detail

bool reads_expanded_scales(const MoePlan& plan, const MoeDeviceCaps& caps, std::uint32_t tokens,
                           bool has_scratch, const MoeBindOptions& options) {
  const MoeScaleMode m = plan_call(plan, caps, tokens, false, has_scratch, options).mode;
  return m == MoeScaleMode::expanded || m == MoeScaleMode::routed;
}

MoeCallPlan plan_call(const MoePlan& plan, const MoeDeviceCaps& caps, std::uint32_t tokens,
                      bool scales_expanded, bool has_scratch, const MoeBindOptions& o) {
  using namespace moe_detail;
  validate(o);
  const MoeLayerGeometry& g = plan.geometry;
  const bool grouped_ok = caps.grouped_kernels && grouped_shape_ok(g.hidden, g.intermediate) &&
                          grouped_offsets_fit(tokens, g.topk, g.hidden, g.intermediate);
  const bool grouped_size = tokens >= grouped_threshold(o, g);
  const bool prefill_ok = caps.prefill_kernels && prefill_shape_ok(g.hidden, g.intermediate);
  const bool prefill_size = tokens >= prefill_threshold(o, g);
  // The kernels that read dense scales only, and so expand routed experts.
  const bool dense_kernel = (grouped_ok && grouped_size) || (prefill_ok && prefill_size);
  MoeCallPlan c;
  c.programmatic_launch = o.programmatic_launch && caps.cc_major >= 9;
  const std::uint64_t slots = std::uint64_t(tokens) * g.topk;
  c.routing_chunked = slots >= o.routing_chunked_min_slots && route_chunks(slots) > 1;
  if (o.force_mode) {
    c.mode = *o.force_mode;
  } else if (plan.constraints.compression == ScaleCompression::none) {
    c.mode = MoeScaleMode::native;
  } else if (scales_expanded) {
    c.mode = MoeScaleMode::expanded;
  } else {
    // Calls the grouped or prefill kernel runs expand their routed experts
    // (they read dense scales) where the layer has a scratch.
    const bool dense = dense_kernel && has_scratch;
    c.mode = tokens <= plan.constraints.stage_read_max_tokens && !dense ? MoeScaleMode::stage_read
                                                                        : MoeScaleMode::routed;
  }
  if (c.mode == MoeScaleMode::routed && tokens > 0) {
    c.expansion = routed_expansion(tokens, g.topk, g.experts);
    c.expansion_kernel = routed_expansion_kernel(c.expansion);
  }
  if (grouped_ok && grouped_size && c.mode != MoeScaleMode::stage_read) {
    c.kernel = MoeKernel::grouped;
    c.token_tile = grouped_token_tile(tokens, g.topk, g.experts, o.grouped_token_tile);
    c.tile_group = o.grouped_tile_group != 0 ? o.grouped_tile_group : kGroupedDefaultTileGroup;
    c.bf16_slots = !o.grouped_fp32_slots;
    c.ring_scales = o.grouped_ring_scales == -1 ? grouped_ring_scales_by_default(c.token_tile)
                                                : o.grouped_ring_scales == 1;
    return c;
  }
  if (prefill_ok && prefill_size && c.mode != MoeScaleMode::stage_read)
    c.kernel = MoeKernel::prefill;
  else if (decode_possible(plan, caps, o) && tokens <= o.decode_max_tokens)
    c.kernel = MoeKernel::decode;
  else
    c.kernel = MoeKernel::tiled;
  if (c.kernel != MoeKernel::decode) return c;

  // Passes of 8 tokens while nearly every tile holds at most 8 rows (a wider
  // pass's larger register set costs per pass, and only the 8-token pass
  // prefetches its activations); 16 up to 512 tokens, 32 (the fewest weight
  // re-reads per tile, but spilling) above. Numbers: docs/moe-api.md.
  const bool passes_of_8 = tokens <= 32 || std::uint64_t(tokens) * g.topk <= 4ull * g.experts;
  c.token_pass = passes_of_8 ? 8 : tokens <= 512 ? 16 : 32;
  const std::uint32_t nt = c.token_pass / 8;
  const bool csf = c.mode == MoeScaleMode::stage_read;
  const std::uint64_t tiles = max_tiles(std::uint64_t(tokens) * g.topk, g.experts);
  c.gate_up =
      decode_shape(tiles, g.hidden, g.intermediate / kDecodeHalfRows, nt, csf, caps.sm_count, o.tuning);
  c.down = decode_shape(tiles, g.intermediate, g.hidden / kDecodeRows, nt, csf, caps.sm_count, o.tuning);
  return c;
}

}  // namespace csfmoe
