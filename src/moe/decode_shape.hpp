// Launch shape of the decode (weight-streaming) MoE GEMM: its tile constants,
// shared-memory layout and the rules that size its blocks. Host and device
// code agree on them through this header; it needs no CUDA, so the call plan
// (CPU library) and its tests use it too. The kernel is
// src/cuda/moe/decode_kernel.cuh.
#pragma once

#include <cstdint>

#include "csfmoe/formats.hpp"
#include "moe/routing_tiles.hpp"

namespace csfmoe::moe_detail {

constexpr int kDecodeMaxWarps = 8;
constexpr int kDecodeRows = 32;          // weight rows per block: 2 MMA row tiles of 16
constexpr int kDecodeHalfRows = 16;      // one MMA row tile: the gate or up half of a gate/up block
constexpr int kDecodeStages = 4;         // cp.async ring depth per warp (K blocks in flight), a power of 2
constexpr int kDecodeKBlock = 128;       // K per lane quad and step: 4 lanes x 32 values
constexpr int kDecodeChunksPerLane = 4;  // 16-byte chunks per lane and K block (4 rows)

// Token passes the kernel is instantiated for, in units of 8 tokens (the MMA's
// N): passes of 8, 16 and 32 tokens. Dispatch (src/cuda/moe/dispatch.hpp) and
// the shared-memory bound below both walk this list.
inline constexpr int kDecodeTokenPasses[] = {1, 2, 4};
constexpr int kDecodeTokenPassCount = sizeof(kDecodeTokenPasses) / sizeof(kDecodeTokenPasses[0]);

static_assert(kDecodeRows == 2 * 16, "a decode block is two m16 MMA row tiles");
static_assert(kDecodeHalfRows * 2 == kDecodeRows);
static_assert((kDecodeStages & (kDecodeStages - 1)) == 0, "the ring index wraps with a mask");

// Per-warp ring stage: the lanes' weight chunks, then one uint4 of scale
// source words per lane.
constexpr int kDecodeStageVecs = (kDecodeChunksPerLane + 1) * 32;
// Shared memory a CSF block stages its exception records in
// (sizeof(BlockExceptions), checked where that is defined).
constexpr std::uint32_t kDecodeExceptionStagingBytes = 4504;

// Host and device agree on the dynamic shared memory layout through these.
struct DecodeSmem {
  std::uint32_t ring_bytes = 0;  // per-warp rings (one row block: later the partial sums)
  std::uint32_t partial_at = 0;  // the partial sums: 0 (over the dead rings) or their own region
  std::uint32_t total = 0;
};

// Block shape of the decode kernel: how many warps split a block's K blocks.
// Every block pays a start-up and a barrier-bound epilogue, so warps should
// stream many K blocks; but a launch that fills the GPU's warp slots only
// about once runs slower than one of about two waves, and warps of very few K
// blocks lose again. Defaults: about 28 K blocks per warp, then more warps
// while the launch fills fewer than 2 waves and each warp keeps at least 3 K
// blocks (measurements: docs/moe-api.md, "Launch plan").
struct DecodeShapeRule {
  std::uint32_t kblocks_per_warp = 28;
  std::uint32_t min_kblocks_per_warp = 3;
  std::uint32_t waves = 2;
};

// Warps per block for a launch of about `blocks` blocks over `kblocks` K
// blocks on `sm_count` SMs (2 blocks x 8 warps per SM by registers).
CSFMOE_HD std::uint32_t decode_warps(std::uint32_t kblocks, std::uint64_t blocks, std::uint32_t sm_count,
                                     const DecodeShapeRule& rule = {}) {
  std::uint32_t w = 1;
  while (w < kDecodeMaxWarps && 2 * w * rule.kblocks_per_warp <= kblocks) w *= 2;
  const std::uint64_t slots = std::uint64_t(sm_count) * 2 * kDecodeMaxWarps * rule.waves;
  while (w < kDecodeMaxWarps && blocks * w < slots && 2 * w * rule.min_kblocks_per_warp <= kblocks) w *= 2;
  return w;
}

// Whether a launch's blocks can stream runs of row blocks: the kernel allows
// them (`can_run`: dense scales, as a CSF block stages its rows' exception
// records once, and passes of 8 tokens, as the partial sums then need their
// own 8 KB per 8 warps) and every warp holds at least kDecodeStages K blocks
// (the stream's first stages, issued before the block knows its token passes,
// stay inside the first pass).
CSFMOE_HD bool decode_runs_possible(bool can_run, std::uint32_t warps_per_block, std::uint32_t kblocks) {
  return can_run && kblocks >= warps_per_block * kDecodeStages;
}

// Row blocks a block streams in turn, for a launch of `blocks` blocks (one
// row block each) of `warps_per_block` warps over `kblocks` K blocks: runs of
// 2 for blocks of 4 or more warps in launches of at least 1.5 waves, else 1
// (measurements: docs/moe-api.md, "Launch plan").
CSFMOE_HD std::uint32_t decode_row_block_run(bool can_run, std::uint32_t warps_per_block,
                                             std::uint32_t kblocks, std::uint64_t blocks,
                                             std::uint32_t sm_count) {
  if (!decode_runs_possible(can_run, warps_per_block, kblocks)) return 1;
  const std::uint64_t warp_slots = std::uint64_t(sm_count) * 2 * kDecodeMaxWarps;
  return warps_per_block >= 4 && 2 * blocks * warps_per_block >= 3 * warp_slots ? 2 : 1;
}

// K blocks a decode warp copies into its ring at once: 2 (one request per 4
// rows x 128 contiguous bytes) where the block's warps get whole pairs of K
// blocks, the same number each, else 1 (bench/RESULTS.md, "paired ring copies").
CSFMOE_HD std::uint32_t decode_copy_kblocks(std::uint32_t warps_per_block, std::uint32_t kblocks) {
  return kblocks % (2 * warps_per_block) == 0 ? 2 : 1;
}

// Shared memory of a decode block of `warps` warps and token passes of 8 *
// nt; CSF blocks also stage their exception records (BlockExceptions). A
// block streaming a run of row blocks keeps its rings running through each
// row block's reduction, so its partial sums get their own region.
CSFMOE_HD DecodeSmem decode_smem(std::uint32_t warps, std::uint32_t nt, bool csf, bool run = false) {
  DecodeSmem s;
  const std::uint32_t ring = warps * kDecodeStages * kDecodeStageVecs * 16;
  const std::uint32_t partial = warps * kDecodeRows * 8 * nt * 4;
  s.ring_bytes = run || ring > partial ? ring : partial;
  const std::uint32_t rest = s.ring_bytes + kTileM * 4 + (csf ? kDecodeExceptionStagingBytes : 0u);
  s.partial_at = run ? rest : 0u;
  s.total = rest + (run ? partial : 0u);
  return s;
}

// Whether a layer's GEMMs fit the decode kernel: K of both projections is a
// whole number of K blocks.
constexpr bool decode_shape_ok(std::uint32_t hidden, std::uint32_t intermediate) {
  return hidden % kDecodeKBlock == 0 && intermediate % kDecodeKBlock == 0;
}

// The most dynamic shared memory a decode block over K = `k` can ask for: the
// widest block (warps capped by the K blocks) over every instantiated token
// pass and scale kind, and a run of row blocks where the kernel allows runs
// (passes of 8 tokens, dense scales). Both formats: the scales travel in the ring.
inline std::uint32_t decode_smem_bytes(std::uint32_t k) {
  const std::uint32_t kblocks = k / kDecodeKBlock;
  const std::uint32_t warps = kblocks < kDecodeMaxWarps ? kblocks : kDecodeMaxWarps;
  std::uint32_t most = 0;
  for (const int nt : kDecodeTokenPasses)
    for (const bool csf : {false, true}) {
      const bool can_run = nt == 1 && !csf;
      for (const bool run : {false, can_run}) {
        const std::uint32_t bytes = decode_smem(warps, std::uint32_t(nt), csf, run).total;
        most = bytes > most ? bytes : most;
      }
    }
  return most;
}

}  // namespace csfmoe::moe_detail
