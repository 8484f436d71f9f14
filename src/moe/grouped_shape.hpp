// Launch shape of the grouped (warp-specialized, persistent) MoE GEMM for
// mid-range and prefill calls: its token-tile classes, shared-memory layout,
// work list and the rule that picks a class per call. Host and device agree
// on them through this header; it needs no CUDA, so the call plan (CPU
// library) and its tests use it too. The kernel is
// src/cuda/moe/grouped_kernel.cuh.
#pragma once

#include <algorithm>
#include <cstdint>

namespace csfmoe::moe_detail {

// Token tiles (routed rows per tile, the wgmma's N) the kernel is
// instantiated for; dispatch (src/cuda/moe/dispatch.hpp) walks this list.
// Steps of 8 rows (the activation gather's and the swizzle's row group) let
// a class sit just above the mean routed rows per expert, so most experts
// take one tile with little padding.
inline constexpr int kGroupedTokenTiles[] = {16, 24, 32, 48, 64, 80, 96, 128};
constexpr int kGroupedTokenTileCount = sizeof(kGroupedTokenTiles) / sizeof(kGroupedTokenTiles[0]);
constexpr std::uint32_t kGroupedMinTile = 16, kGroupedMaxTile = 128;
// The largest class whose consumers take one m64 tile each (grouped_consumers):
// from 80 rows the accumulators and the epilogue's shuffles pass 112 registers.
constexpr int kGroupedMaxOneTileClass = 64;

constexpr std::uint32_t kGroupedRows = 256;  // weight rows per work item (gate/up: 128 gate + 128 up)
constexpr std::uint32_t kGroupedKBlock = 128;
constexpr std::uint32_t kGroupedWeightStageBytes = kGroupedRows * kGroupedKBlock / 2;  // [row][64 B]
constexpr std::uint32_t kGroupedMaxStages = 8;
// Dynamic shared memory the kernel may use on sm_90 (227 KB opt-in).
constexpr std::uint32_t kGroupedSmemLimit = 232448;

// Consumer layout of a token tile: an item's 256 weight rows are four m64
// tiles, spread over consumer warpgroups of `m_tiles` each. Two warpgroups
// of two m64 tiles hold the largest accumulators (the 128-row tile); four
// of one give each scheduler four converting warps instead of two, so one
// warp's FP4 conversion runs while the others wait on their wgmmas, within
// a smaller register budget per thread.
struct GroupedConsumers {
  int m_tiles;        // m64 tiles per consumer warpgroup (1 or 2)
  int groups;         // consumer warpgroups: 4 / m_tiles
  int producer_regs;  // setmaxnreg of the producer warpgroup and of the
  int consumer_regs;  // consumers, within grouped_register_pool(threads)
  int threads;        // producer warpgroup + consumers
};
// The two-tile consumers take 240 registers, the producer the 24 left: the
// gate/up epilogue's activation spills a few loop-invariant values at 232.
constexpr GroupedConsumers grouped_consumers(int nt) {
  return nt <= kGroupedMaxOneTileClass ? GroupedConsumers{1, 4, 32, 112, 640}
                                       : GroupedConsumers{2, 2, 24, 240, 384};
}
// Registers a CTA of `threads` holds from launch (one CTA per SM, each
// thread's count a multiple of 8): setmaxnreg only moves registers within
// it, so an increase beyond it would wait forever.
constexpr int grouped_register_pool(int threads) { return threads * (65536 / threads / 8 * 8); }

// Outputs of one work item: gate/up 128 (SiLU(gate) * up of 128 gate and
// 128 up rows), down 256 rows.
constexpr std::uint32_t grouped_outputs_per_item(bool gate_up) {
  return gate_up ? kGroupedRows / 2 : kGroupedRows;
}

// The layer shapes it takes: gate/up items of 128 outputs over N, down items
// of 256 rows over H, both K a whole number of 128-wide K blocks.
constexpr bool grouped_shape_ok(std::uint32_t hidden, std::uint32_t intermediate) {
  return hidden % kGroupedRows == 0 && intermediate % kGroupedKBlock == 0 && hidden > 0 && intermediate > 0;
}

// The producer addresses activation rows by 32-bit element offsets (token *
// H for gate/up, slot * N for down, 0xFFFFFFFF marking padding): calls whose
// offsets would not fit run another kernel.
constexpr bool grouped_offsets_fit(std::uint64_t tokens, std::uint32_t topk, std::uint32_t hidden,
                                   std::uint32_t intermediate) {
  return tokens * hidden < 0xFFFFFFFFull && tokens * topk * intermediate < 0xFFFFFFFFull;
}

// Block-scale bytes of one weight row per 128-wide K block: NVFP4 8 (one
// per 16 K), MXFP4 4 (one per 32 K). With ring scales
// (grouped_ring_scales_by_default) the producer copies an item's 256 scale
// rows into each stage beside its weight rows, so the consumers read them
// from shared memory instead of each loading its own words from global
// memory; without, a stage holds no scale rows (scale_row_bytes 0).
constexpr std::uint32_t grouped_scale_row_bytes(bool nvfp4) { return nvfp4 ? 8u : 4u; }

// Shared memory of a token tile of `nt` rows: `stages` ring stages, each
// [weights (TMA): 256 rows x 64 B][activations: two 64-K halves of [nt][128 B],
// 128-byte swizzle][scales: 256 rows x scale_row_bytes (ring row j: weight row
// j of the stage, grouped_weight_row)], then the full / empty mbarrier pairs,
// the producer's two row tables and slack to align the ring to 1024 bytes.
struct GroupedSmem {
  std::uint32_t act_bytes, scale_offset, stage_bytes, stages, barriers, tables, total;
};
constexpr GroupedSmem grouped_smem(std::uint32_t nt, std::uint32_t scale_row_bytes) {
  GroupedSmem s{};
  s.act_bytes = nt * kGroupedKBlock * 2;
  s.scale_offset = kGroupedWeightStageBytes + s.act_bytes;
  s.stage_bytes = s.scale_offset + kGroupedRows * scale_row_bytes;
  const std::uint32_t fixed = 1024 + 2 * 8 * kGroupedMaxStages + 2 * nt * 4;
  s.stages = std::min(kGroupedMaxStages, (kGroupedSmemLimit - fixed) / s.stage_bytes);
  s.barriers = s.stages * s.stage_bytes;  // offset of the barriers from the aligned base
  s.tables = s.barriers + 2 * 8 * s.stages;
  s.total = s.tables + 2 * nt * 4 + 1024;
  return s;
}
// The layout of one kernel instantiation: its format's scale rows in each
// stage with ring scales, none without. Kernel and launcher both size their
// shared memory from this.
constexpr GroupedSmem grouped_path_smem(std::uint32_t nt, bool nvfp4, bool ring_scales) {
  return grouped_smem(nt, ring_scales ? grouped_scale_row_bytes(nvfp4) : 0);
}

// Upper bound on the tiles of a call routed with tiles of `tile` rows.
constexpr std::uint64_t routed_tiles(std::uint64_t slots, std::uint32_t experts, std::uint32_t tile) {
  return (slots + tile - 1) / tile + std::min<std::uint64_t>(slots, experts);
}

// Work items of one GEMM: (token tile, row block) pairs, in raster groups
// of `group` consecutive tiles: within a group the tile is the fast index
// and the row block the slow one, so the items running at the same time
// (neighbours in the order) share weights (tiles of one expert, same row
// block) and, across the group's row blocks, activation rows, each read
// from DRAM about once while it sits in L2. group >= tiles is one group
// (row block major over all tiles). Every CTA walks items blockIdx.x,
// + gridDim.x, ...: each output tile is computed by one CTA in a fixed K
// order (deterministic).
struct GroupedItem {
  std::uint32_t tile, row_block;
};
constexpr GroupedItem grouped_item(std::uint32_t item, std::uint32_t tiles, std::uint32_t row_blocks,
                                   std::uint32_t group) {
  const std::uint32_t per_group = group * row_blocks;
  const std::uint32_t g = item / per_group, first = g * group;
  const std::uint32_t width = tiles - first < group ? tiles - first : group;
  const std::uint32_t in = item - g * per_group;
  return {first + in % width, in / width};
}
// Tiles per raster group when the options leave it to the plan: 1, each
// tile's row blocks back to back (its activation rows come from DRAM about
// once). Measured on the H100 (bench/RESULTS.md, "Grouped kernel"): within
// 1.5 % of groups of 8 up to T = 4096 and 2-8 % faster at 8192; one group
// over all tiles (row block major) 3-12 % slower.
constexpr std::uint32_t kGroupedDefaultTileGroup = 1;

// Fragment map of a consumer thread (m64 tile q = 0..3 of the item's 256
// weight rows, warpgroup wg holding tiles wg * m_tiles .. + m_tiles - 1;
// warp wi 0..3 of the warpgroup, lane group g = lane / 4): the output
// (gate/up) or row (down) within the item of its m16 rows in tile q, and
// the ring row of its half h, the A-fragment rows g (h = 0) and g + 8
// (h = 1) of that m16 tile. Gate/up pairs the gate row (ring rows 0..127,
// h = 0) with the up row of the same output (128..255, h = 1), so
// SiLU(gate) * up forms in registers. Lane t = lane % 4 reads bytes
// 16t..16t+15 of each ring row (64 bytes per K block).
constexpr std::uint32_t grouped_out_in_item(bool gate_up, int q, int wi, int g) {
  return std::uint32_t(gate_up ? 32 * q + 8 * wi + g : 64 * q + 16 * wi + g);
}
constexpr std::uint32_t grouped_ring_row(bool gate_up, int q, int wi, int g, int h) {
  return gate_up ? std::uint32_t(h) * 128 + grouped_out_in_item(true, q, wi, g)
                 : grouped_out_in_item(false, q, wi, g) + 8 * std::uint32_t(h);
}

// The weight row (within its expert) of ring row j (0..255) of an item of
// row block `row_block`: the TMA copies put gate rows gate_row0 + 128 rb ..
// + 127 at ring rows 0..127 and the same up rows at 128..255 (gate/up), or
// rows 256 rb .. + 255 in order (down); the stage's scale rows follow them.
constexpr std::uint32_t grouped_weight_row(bool gate_up, std::uint32_t ring_row, std::uint32_t row_block,
                                           std::uint32_t gate_row0, std::uint32_t up_row0) {
  if (!gate_up) return row_block * kGroupedRows + ring_row;
  return (ring_row < 128 ? gate_row0 : up_row0) + row_block * 128 + ring_row % 128;
}

// Bytes between the scale words of weight rows r and r + rows (rows a
// multiple of 128, possibly negative) in one expert's dense scale grid of
// `cols` columns (the padded count when swizzled): row-major rows * cols,
// 128x4-swizzled whole row tiles of cols / 4 512-byte tiles (swizzled_index
// in csfmoe/formats.hpp). The producer's second scale row of a stage sits
// this far from its first (ring rows tid and tid + 128).
constexpr std::int64_t grouped_scale_rows_apart(bool swizzled, std::int64_t rows, std::uint32_t cols) {
  return swizzled ? rows / 128 * std::int64_t(cols / 4) * 512 : rows * std::int64_t(cols);
}

// Bytes between a scale row's words of consecutive K blocks (as
// LaneScales::kStride): row-major 8 (NVFP4) / 4 (MXFP4), 128x4-swizzled two
// 512-byte tiles (NVFP4: 8 columns) / one (MXFP4). A swizzled NVFP4 row's K
// block is two words a tile apart, each copied on its own.
constexpr std::uint32_t grouped_scale_kb_stride(bool nvfp4, bool swizzled) {
  return swizzled ? (nvfp4 ? 1024u : 512u) : grouped_scale_row_bytes(nvfp4);
}
// The byte of a ring scale row at which consumer lane t (lane % 4) finds its
// scale bytes: NVFP4 columns 2t, 2t + 1 of the K block, MXFP4 column t (its
// aligned word starts at the byte & ~3).
constexpr std::uint32_t grouped_scale_lane_byte(bool nvfp4, std::uint32_t t) { return nvfp4 ? 2 * t : t; }

// The token tiles whose calls copy their block scales into the ring when the
// options leave it to the plan (MoeBindOptions::grouped_ring_scales = -1).
// Measured on the H100 (bench/RESULTS.md, "Grouped kernel: block scales in
// the ring"): 3-7 % faster with 16- and 24-row tiles (DeepSeek-V3 and Qwen3,
// NVFP4 and MXFP4, T = 256-512), where each consumer's own scale loads were
// the longest stall; 4-6 % slower with 32 rows (DeepSeek-V3 T = 768), 1-3 %
// either way at 48 and 64, 2-5 % slower at 128, where the extra copies load
// the producer and the larger stages cost the 48- to 80-row tiles a stage.
constexpr bool grouped_ring_scales_by_default(std::uint32_t nt) { return nt <= 24; }

// Activation chunk a (0 .. nt / 8 - 1) of producer thread p (0..127) in a
// stage: 16 bytes of tile row n = p / 16 + 8a, K half p / 8 % 2 (64 K each),
// 8-element column c8 = p % 8; stored at half * nt * 128 + n * 128 +
// (c8 ^ n % 8) * 16 bytes (the 128-byte swizzle wgmma's descriptor reads).
struct GroupedActChunk {
  std::uint32_t row, half, c8, offset;
};
constexpr GroupedActChunk grouped_act_chunk(std::uint32_t nt, int p, int a) {
  GroupedActChunk c{};
  c.row = std::uint32_t(p / 16 + 8 * a);
  c.half = std::uint32_t(p / 8 % 2);
  c.c8 = std::uint32_t(p % 8);
  c.offset = c.half * nt * 128 + c.row * 128 + ((c.c8 ^ (c.row % 8)) * 16);
  return c;
}

// The producer's row table of a tile (source offsets of its NT rows),
// laid out per thread: producer thread p gathers rows p / 16 + 8a
// (grouped_act_chunk), so row n sits at (n % 8) * NT / 8 + n / 8 and a
// thread's NT / 8 offsets are adjacent, read `grouped_row_table_vec` at a
// time (16- or 8-byte shared loads where the block's alignment allows).
constexpr std::uint32_t grouped_row_table_index(std::uint32_t nt, std::uint32_t row) {
  return (row % 8) * (nt / 8) + row / 8;
}
// Batched reads measured on the H100 (bench/RESULTS.md, "Grouped kernel:
// batched row-table and slot reads"): 2-10 % faster with 48- to 128-row
// tiles, level with 16; the 32-row tile was 3-6 % slower (Kimi K2 T = 1024)
// and keeps one read per row and step, as before.
constexpr bool grouped_batches_reads(std::uint32_t nt) { return nt != 32; }
constexpr int grouped_row_table_vec(std::uint32_t nt) {
  if (!grouped_batches_reads(nt)) return 1;
  return (nt / 8) % 4 == 0 ? 4 : (nt / 8) % 2 == 0 ? 2 : 1;
}
// Slots the bf16 epilogue loads at once (one per 8-token step and lane): a
// one-tile consumer (grouped_consumers) all of the tile's, a two-tile one 4
// or 2 (more live values spill beside its accumulators).
constexpr int grouped_slot_batch(std::uint32_t nt) {
  if (!grouped_batches_reads(nt)) return 1;
  if (int(nt) <= kGroupedMaxOneTileClass) return int(nt / 8);
  return (nt / 8) % 4 == 0 ? 4 : 2;
}

// The token tile of a call (the routing's rows per tile, the most one item
// multiplies), from the mean routed rows per expert R = ceil(T * k / E) by
// a table measured on the H100 over every class (DeepSeek-V3, Kimi K2 and
// Qwen3-30B-A3B, NVFP4 and MXFP4; bench/RESULTS.md, "Grouped kernel"): the
// first entry whose bound holds; `requested` (a class, from
// MoeBindOptions) wins. Each tile converts its expert's weights once, so
// most experts should fit one tile (a class a little above R, where the
// routed counts spread around their mean), while every padding row costs
// MMA work. Between 128 and 192 rows two tiles of 96 pad less than two of
// 128 (Kimi K2 T = 8192: 4-7 % faster).
struct GroupedTileRule {
  std::uint32_t max_rows, tile;
};
inline constexpr GroupedTileRule kGroupedTileTable[] = {
    {12, 16}, {16, 24}, {24, 32}, {32, 48}, {48, 64}, {64, 80}, {128, 128}, {192, 96}, {0xFFFFFFFFu, 128}};
constexpr std::uint32_t grouped_token_tile(std::uint64_t tokens, std::uint32_t topk, std::uint32_t experts,
                                           std::uint32_t requested) {
  if (requested != 0) return requested;
  const std::uint64_t rows = (tokens * topk + experts - 1) / experts;
  for (const GroupedTileRule& r : kGroupedTileTable)
    if (rows <= r.max_rows) return r.tile;
  return kGroupedMaxTile;
}

// Mean routed rows per expert from which the plan runs the grouped kernel
// rather than the decode kernel (call_plan.hpp, grouped_threshold).
constexpr std::uint32_t kGroupedMinRowsPerExpert = 5;

constexpr bool grouped_token_tile_valid(std::uint32_t nt) {
  for (const int v : kGroupedTokenTiles)
    if (std::uint32_t(v) == nt) return true;
  return false;
}

}  // namespace csfmoe::moe_detail
