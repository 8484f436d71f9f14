// Grouped W4A16 GEMM for small calls (decode): a stream of FP4 weight bytes
// at HBM speed, since an expert sees only a handful of tokens.
//
// A block serves one routing tile (kTileM sorted rows of one expert) and 32
// weight rows (gate/up: 16 gate + 16 up rows for 16 outputs; down: 32 output
// rows), split over its warps by K block. Weight rows are the mma.sync M
// side and up to 8 tokens per chunk its N side; each lane reads 32
// consecutive K of a row and feeds them to the k16 steps in the order that
// makes E2M1 -> bf16 cheap (dequant.cuh), with the activations read in the
// same order. Per-warp cp.async rings carry the weights and the raw
// block-scale words (scale_read.cuh) with no block barrier in the loop;
// partial sums meet in shared memory in a fixed order, so results are
// deterministic and identical across scale modes. The design, its measured
// alternatives and the ring layout: docs/decode-kernel.md.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "cuda/moe/decode_timeline.cuh"
#include "cuda/moe/dequant.cuh"
#include "cuda/moe/epilogue.cuh"
#include "cuda/moe/launchers.hpp"
#include "cuda/moe/scale_read.cuh"
#include "cuda/primitives/launch.cuh"
#include "cuda/primitives/ptx.cuh"
#include "moe/decode_shape.hpp"

namespace csfmoe::moe_detail {

static_assert(kDecodeMaxWarps * 32 <= BlockExceptions::kMaxThreads,
              "LaneExceptions keeps a cursor per thread");
static_assert(sizeof(BlockExceptions) == kDecodeExceptionStagingBytes,
              "decode_smem (decode_shape.hpp) sizes the CSF staging area");

namespace decode {

using decode_bits::e2m1_pair;
using decode_bits::scale_bf16;

using ptx::cp_async16;
using ptx::cp_async4;
using ptx::cp_async_commit;
using ptx::cp_async_wait;
using ptx::mma_bf16;

__device__ __forceinline__ std::uint32_t bf16x2_mul(std::uint32_t a, std::uint32_t b) {
  __nv_bfloat162 x = *reinterpret_cast<__nv_bfloat162*>(&a);
  const __nv_bfloat162 y = *reinterpret_cast<__nv_bfloat162*>(&b);
  x = __hmul2(x, y);
  return *reinterpret_cast<std::uint32_t*>(&x);
}

// A operand values of two k16 steps for a lane's two rows of one m16 tile
// (the decode and prefill kernels' lane order): the four bf16 pairs (E2M1
// nibbles j, j + 4 of word q, j = 0..3) of the low row (qlo, scale pair slo)
// and of the high row (qhi, shi). Exact: value * scale * 2^-8 (NVFP4) or
// value * scale (MXFP4, which first restores 2^126, unless Folded: the scale
// pairs already carry it, mxfp4_folded_splat_bf16).
template <ScaleFormat F, bool Folded = false>
__device__ __forceinline__ void dequant_words(std::uint32_t qlo, std::uint32_t slo, std::uint32_t qhi,
                                              std::uint32_t shi, std::uint32_t (&lo)[4],
                                              std::uint32_t (&hi)[4]) {
  lo[0] = e2m1_pair<0>(qlo), lo[1] = e2m1_pair<1>(qlo), lo[2] = e2m1_pair<2>(qlo), lo[3] = e2m1_pair<3>(qlo);
  hi[0] = e2m1_pair<0>(qhi), hi[1] = e2m1_pair<1>(qhi), hi[2] = e2m1_pair<2>(qhi), hi[3] = e2m1_pair<3>(qhi);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if constexpr (F == ScaleFormat::mxfp4 && !Folded) {
      lo[j] = bf16x2_mul(lo[j], 0x7E807E80u);  // 2^126: exact E2M1 values
      hi[j] = bf16x2_mul(hi[j], 0x7E807E80u);
    }
    lo[j] = bf16x2_mul(lo[j], slo);
    hi[j] = bf16x2_mul(hi[j], shi);
  }
}

// Epilogue factor undoing the NVFP4 folding (2^-126 from the nibbles times 2^118).
template <ScaleFormat F>
constexpr float kDecodeUnfold = F == ScaleFormat::nvfp4 ? 256.0f : 1.0f;

// Scale pairs (s, s) of a lane's K block: sp[c][h] multiplies the values of
// row c in half h of the lane's 32 (NVFP4: one scale per half, MXFP4: one for
// both), from the gathered bytes u (LaneScales layout). Each pair is one byte
// permute and one multiply-add (scale_splat_bf16); a word holding a
// subnormal, negative or NaN code takes the exact byte-wise path.
template <ScaleFormat F, int kWords>
__device__ __forceinline__ void scale_pairs(const std::uint32_t (&u)[kWords], std::uint32_t (&sp)[4][2]) {
  bool special = false;
#pragma unroll
  for (int j = 0; j < kWords; ++j) special |= decode_bits::scale_word_special<F>(u[j]);
  if (!special) {
    using decode_bits::scale_splat_bf16;
    if constexpr (F == ScaleFormat::nvfp4) {
      // u[j] = (row 2j col 0, row 2j col 1, row 2j+1 col 0, row 2j+1 col 1)
      sp[0][0] = scale_splat_bf16<F, 0>(u[0]), sp[0][1] = scale_splat_bf16<F, 1>(u[0]);
      sp[1][0] = scale_splat_bf16<F, 2>(u[0]), sp[1][1] = scale_splat_bf16<F, 3>(u[0]);
      sp[2][0] = scale_splat_bf16<F, 0>(u[1]), sp[2][1] = scale_splat_bf16<F, 1>(u[1]);
      sp[3][0] = scale_splat_bf16<F, 2>(u[1]), sp[3][1] = scale_splat_bf16<F, 3>(u[1]);
    } else {
      sp[0][0] = sp[0][1] = scale_splat_bf16<F, 0>(u[0]);
      sp[1][0] = sp[1][1] = scale_splat_bf16<F, 1>(u[0]);
      sp[2][0] = sp[2][1] = scale_splat_bf16<F, 2>(u[0]);
      sp[3][0] = sp[3][1] = scale_splat_bf16<F, 3>(u[0]);
    }
    return;
  }
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const auto cv = [&](int byte) {
      return std::uint32_t(scale_bf16<F>(std::uint8_t(u[byte / 4] >> (8 * (byte % 4))))) * 0x10001u;
    };
    if constexpr (F == ScaleFormat::nvfp4) {
      sp[c][0] = cv(2 * c);
      sp[c][1] = cv(2 * c + 1);
    } else {
      sp[c][0] = sp[c][1] = cv(c);
    }
  }
}

// scale_pairs for dequant_words<F, true> where the warp can: returns whether
// the warp's pairs are unfolded (MXFP4: some lane's word holds a byte above
// 0x80; the warp then converts with dequant_words<F, false>). NVFP4 pairs
// carry their fold already: always false.
template <ScaleFormat F, int kWords>
__device__ __forceinline__ bool scale_pairs_folded(const std::uint32_t (&u)[kWords],
                                                   std::uint32_t (&sp)[4][2]) {
  if constexpr (F == ScaleFormat::nvfp4) {
    scale_pairs<F>(u, sp);
    return false;
  } else {
    const bool unfolded = __any_sync(0xFFFFFFFFu, decode_bits::mxfp4_word_unfoldable(u[0]));
    if (unfolded) {
      scale_pairs<F>(u, sp);
    } else {
      using decode_bits::mxfp4_folded_splat_bf16;
      sp[0][0] = sp[0][1] = mxfp4_folded_splat_bf16<0>(u[0]);
      sp[1][0] = sp[1][1] = mxfp4_folded_splat_bf16<1>(u[0]);
      sp[2][0] = sp[2][1] = mxfp4_folded_splat_bf16<2>(u[0]);
      sp[3][0] = sp[3][1] = mxfp4_folded_splat_bf16<3>(u[0]);
    }
    return unfolded;
  }
}

}  // namespace decode

// At least two resident blocks per SM: the register budget the ring and the
// activation prefetch are sized for (docs/decode-kernel.md, "Occupancy").
template <ScaleFormat F, ScaleKind K, Projection P, int NT, int Copy>
__global__ void __launch_bounds__(kDecodeMaxWarps * 32, 2) moe_decode_kernel(GemmParams p) {
  constexpr bool GateUp = is_gate_up(P);
  static_assert(Copy == 1 || Copy == 2, "K blocks per ring copy: decode_copy_kblocks");
  using namespace decode;
  extern __shared__ __align__(16) unsigned char smem[];
  DecodeTimeline timeline(GateUp);

  // gate/up reads the routing (or the expanded scales, or the permuted
  // hidden rows) of the kernel right before it. The down GEMM's routing and
  // weights were complete when the gate/up GEMM passed its wait: it streams
  // its first weight stages and stages its rows before waiting for act.
  if constexpr (GateUp) {
    grid_dependency_wait();
    allow_dependent_launch();
  }
  timeline.stamp(DecodeStamp::gate_up_waited);
  const int tile = blockIdx.x;
  if (tile >= p.header[0]) {
    timeline.record();
    return;
  }
  const int warps = int(blockDim.x / 32);  // decode_warps
  constexpr bool kCsf = K == ScaleKind::csf;
  // A block streams row blocks rb_first .. rb_first + runs - 1 of its tile in
  // turn (p.row_block_run; more than one only for dense scales, 8-token
  // passes and more than kDecodeStages - 1 K blocks per warp: decode_launch).
  const bool run = NT == 1 && !kCsf && p.row_block_run > 1;
  const DecodeSmem lay = decode_smem(std::uint32_t(warps), NT, kCsf, run);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  auto* ring = reinterpret_cast<uint4*>(smem);                      // [warp][stage][chunk + scales][lane]
  auto* partial = reinterpret_cast<float*>(smem + lay.partial_at);  // [warp][row][token], after the loop
  auto* arow = reinterpret_cast<int*>(smem + lay.ring_bytes);       // [kTileM]
  auto* block_exceptions = reinterpret_cast<BlockExceptions*>(smem + lay.ring_bytes + kTileM * 4);  // csf

  const int e = p.tile_expert[tile];
  const std::uint32_t row0 = std::uint32_t(tile) * kTileM;
  constexpr int kOutPerBlock = GateUp ? kDecodeHalfRows : kDecodeRows;
  const std::uint32_t rb_first = blockIdx.y * p.row_block_run;
  const std::uint32_t row_blocks = (GateUp ? p.n : p.out_rows) / kOutPerBlock;
  const int runs = run ? int(min(p.row_block_run, row_blocks - rb_first)) : 1;
  // First output (gate/up: of each half) of the run's row block j, and the
  // weight row of its block row r (gate/up: rows 0..15 gate, 16..31 up).
  const auto first_output = [&](int j) { return (rb_first + std::uint32_t(j)) * kOutPerBlock; };
  const auto wrow = [&](int r, int j = 0) -> std::uint32_t {
    const std::uint32_t n0 = first_output(j);
    if constexpr (GateUp)
      return r < kOutPerBlock ? p.gate_row0 + n0 + r : p.up_row0 + n0 + (r - kOutPerBlock);
    else
      return n0 + r;
  };
  const std::uint32_t kblocks = p.k / kDecodeKBlock;
  // The warp's K blocks come in copy units of Copy adjacent K blocks (1, or
  // 2: decode_copy_kblocks, which makes them divide evenly): units warp,
  // warp + W, ...; its i-th K block is kblock_of(i).
  const std::uint32_t units = kblocks / Copy;
  const int my_units = warp < int(units) ? (int(units) - 1 - warp) / warps + 1 : 0;
  const int my_blocks = my_units * Copy;
  const auto kblock_of = [&](int i) -> std::uint32_t {
    return (warp + std::uint32_t(i / Copy) * warps) * Copy + std::uint32_t(i % Copy);
  };
  const std::uint64_t row_bytes = p.k / 2;
  const std::uint8_t* w_e = p.w + std::uint64_t(e) * p.out_rows * row_bytes;
  const auto lane_rows = [&](int j, std::uint32_t(&rows)[kDecodeChunksPerLane]) {
#pragma unroll
    for (int c = 0; c < kDecodeChunksPerLane; ++c) rows[c] = wrow(decode_lane_row(c, g), j);
  };
  std::uint32_t rows[kDecodeChunksPerLane];  // the lane's weight rows in the run's first row block
  lane_rows(0, rows);
  // What the lane copies: copy instruction c covers block rows 8c + lane / 4
  // (single K blocks: 64 bytes of 8 rows, the lane's own chunk c) or
  // 4c + lane / 8 (pairs: 128 bytes of 4 rows, the chunk c / 2 of lane
  // (4 (c % 2) + lane / 8, lane % 4) in the pair's first or second slot).
  // Both halves of the block (gate/up: gate rows, then up rows) step by
  // copy_row_step within; the source of copy c is copy_src[c / (2 Copy)] +
  // (c % (2 Copy)) copy_row_step.
  const int pair_row = lane / 8, pair_piece = lane % 8;
  const std::uint32_t copy_row0 = Copy == 2 ? std::uint32_t(pair_row) : std::uint32_t(g);
  const std::uint32_t copy_col = Copy == 2 ? 16u * pair_piece : 16u * t;
  const std::uint8_t* copy_src[2] = {w_e + std::uint64_t(wrow(copy_row0)) * row_bytes + copy_col,
                                     w_e + std::uint64_t(wrow(16 + copy_row0)) * row_bytes + copy_col};
  const std::uint64_t copy_row_step = (Copy == 2 ? 4 : 8) * row_bytes;
  const std::uint8_t* scales_e = expert_scales<K>(p.scales, e);
  // Two readers of the lane's scale words: the issuing side's (addresses) and
  // the converting side's (byte selectors), each at its own row block.
  LaneScales<F, K> lane_scales(p.scales, scales_e, rows, t), issue_scales = lane_scales;
  uint4* my_ring = ring + std::size_t(warp) * kDecodeStages * kDecodeStageVecs + lane;
  // Where the lane's pair copies land, relative to the unit's first slot.
  uint4* const pair_dst =
      my_ring - lane + (pair_piece / 4) * kDecodeStageVecs + 4 * pair_row + pair_piece % 4;
  // The warp's stream: per row block j of the run, per token pass, its copy
  // units. The issuing cursor runs `ahead` units ahead of the converting one
  // (the ring holds kDecodeStages K blocks); in a run it crosses into the next
  // pass or row block (the ring keeps running through the reductions),
  // otherwise it stops at the pass's end (the partial sums overlay the ring)
  // and restarts with the next.
  constexpr int ahead = kDecodeStages / Copy - 1;
  int issue_i = 0, issue_pass = 0, issue_j = 0, passes = 1;  // passes: known once the rows are read
  std::uint32_t issued = 0, consumed = 0;                    // ring positions (K blocks)
  std::uint64_t issue_offset = 0;                            // weight bytes of row block issue_j
  const auto issue = [&]() {
    if (issue_i < my_units && issue_j < runs) {
      const std::uint32_t unit = warp + std::uint32_t(issue_i) * warps;
      const std::uint32_t slot = issued & (kDecodeStages - 1);
      const std::uint64_t offset = issue_offset + std::uint64_t(unit) * Copy * 64;
      const std::uint8_t* half[2] = {copy_src[0] + offset, copy_src[1] + offset};
      if constexpr (Copy == 2) {
        uint4* dst = pair_dst + slot * kDecodeStageVecs;
#pragma unroll
        for (int c = 0; c < 8; ++c) cp_async16(dst + 16 * c, half[c / 4] + (c % 4) * copy_row_step);
      } else {
        uint4* dst = my_ring + slot * kDecodeStageVecs;
#pragma unroll
        for (int c = 0; c < kDecodeChunksPerLane; ++c)
          cp_async16(dst + 32 * c, half[c / 2] + (c % 2) * copy_row_step);
      }
#pragma unroll
      for (int b = 0; b < Copy; ++b) {
        auto* scale_dst = reinterpret_cast<std::uint32_t*>(my_ring + (slot + b) * kDecodeStageVecs +
                                                           kDecodeChunksPerLane * 32);
#pragma unroll
        for (int c = 0; c < kDecodeChunksPerLane; ++c)
          cp_async4(scale_dst + c, issue_scales.word(c, unit * Copy + b));
      }
      issued += Copy;
      if (++issue_i == my_units && run) {
        issue_i = 0;
        if (++issue_pass == passes) {
          issue_pass = 0;
          if (++issue_j < runs) {
            std::uint32_t next[kDecodeChunksPerLane];
            lane_rows(issue_j, next);
            issue_scales = LaneScales<F, K>(p.scales, scales_e, next, t);
            issue_offset = std::uint64_t(issue_j) * kOutPerBlock * row_bytes;
          }
        }
      }
    }
    cp_async_commit();  // empty groups keep the wait counts uniform
  };
  // The weight stream starts before anything else is read (inside the first
  // pass of the first row block: a run's warps hold at least kDecodeStages K
  // blocks, so the cursor does not roll over before `passes` is known).
  for (int s = 0; s < ahead; ++s) issue();

  // CSF: the rows' exception records, already bucketed by the load-time
  // index where the layer has one (read in the same round trip as the
  // routing rows below), else through the row prefix and a per-block sort.
  [[maybe_unused]] const bool have_index = kCsf && p.scales.index != nullptr;
  if constexpr (kCsf) {
    if (have_index)
      block_exceptions->load_index(p.scales, e, rb_first, kblocks, tid, int(blockDim.x));
    else
      block_exceptions->load_prefix(p.scales, e, wrow(0), wrow(16), kblocks, tid, int(blockDim.x));
  }
  // Valid rows of the tile are a prefix (routing pads the tail with -1).
  // Blocks of fewer than kTileM threads take several rows each.
  int valid = 0;
  for (int m0 = 0; m0 < kTileM; m0 += int(blockDim.x)) {
    const int m = m0 + tid;
    const int slot = m < kTileM ? p.sorted_slot[row0 + m] : -1;
    if (m < kTileM) arow[m] = slot < 0 ? -1 : (GateUp ? slot / int(p.topk) : int(row0) + m);
    valid += __syncthreads_count(slot >= 0);
  }
  passes = (valid + 8 * NT - 1) / (8 * NT);
  const float global_scale = p.global ? p.global[e] : 1.0f;
  bool exceptions_staged = false;  // block-uniform: bucketed in shared memory (else LaneExceptions)
  if constexpr (kCsf) {
    bool indexed = false;
    if (have_index) {
      // A row block with more records than the index holds takes the
      // per-block sort; the barrier keeps that off the loaded buckets until
      // every thread has read the overflow mark.
      indexed = __syncthreads_and(block_exceptions->index_complete());
      if (!indexed) {
        block_exceptions->load_prefix(p.scales, e, wrow(0), wrow(16), kblocks, tid, int(blockDim.x));
        __syncthreads();
      }
    }
    exceptions_staged = indexed;
    if (!indexed) {
      exceptions_staged = block_exceptions->stage<F>(p.scales, kblocks, tid, int(blockDim.x));
      __syncthreads();
      if (exceptions_staged && block_exceptions->count() != 0) {
        block_exceptions->scan(kblocks, tid);
        __syncthreads();
        block_exceptions->scatter(tid, int(blockDim.x));
        __syncthreads();
      }
    }
  }
  const std::uint32_t lane_key = BlockExceptions::lane_key(g, t);

  timeline.stamp(DecodeStamp::prologue_done);
  timeline.valid_rows(valid);
  if constexpr (!GateUp) {
    grid_dependency_wait();  // act, written by the gate/up GEMM
    allow_dependent_launch();
  }
  timeline.stamp(DecodeStamp::down_waited);
  const float gs = global_scale * kDecodeUnfold<F>;
  const std::uint16_t* x_base = p.a;
  for (int j = 0; j < runs; ++j) {
    if (j > 0) {
      lane_rows(j, rows);
      lane_scales = LaneScales<F, K>(p.scales, scales_e, rows, t);
    }
    const std::uint32_t n0 = first_output(j);
    for (int tok0 = 0; tok0 < valid; tok0 += 8 * NT) {
      const int left = valid - tok0;
      const int chunks = left >= 8 * NT ? NT : (left + 7) / 8;
      // Chunk n holds tokens (chunk 0 always does: said at compile time, so the
      // single-chunk kernel has no branch around its MMAs).
      const auto live = [&](int n) { return n == 0 || n < chunks; };
      // Activation row of this lane's token in each chunk (a clamped valid row
      // for the padding columns; their results are never stored).
      const std::uint16_t* xrow[NT];
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const int m = tok0 + 8 * n + g;
        const int src_row = arow[m < valid ? m : tok0];
        xrow[n] = x_base + std::uint64_t(src_row) * p.k + t * 32;
      }
      if (tok0 > 0 && !run) {
        __syncthreads();  // the previous pass's partial sums overlaid the rings
        issue_i = 0;
        for (int s = 0; s < ahead; ++s) issue();
      }
      float acc[2][NT][4];
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int v = 0; v < 4; ++v) acc[i][n][v] = 0.0f;

      // The pass's K blocks. CSF blocks get one copy of the loop per way of
      // patching exceptions (staged buckets or per-lane cursors, a block-
      // uniform choice), so the common staged loop carries neither the
      // cursors' registers nor a branch between the two per K block.
      const auto stream_kblocks = [&](auto staged_tag) {
        constexpr bool kStaged = decltype(staged_tag)::value;
        // Staged records need no state; the cursors restart with each pass.
        LaneExceptions<F> exceptions;
        if constexpr (kCsf && !kStaged) exceptions.start(p.scales, *block_exceptions, tid, g);

        // Passes of 8 tokens load the activations of the next K block while this
        // one converts (16 registers; wider passes would spill): the loads are L2
        // hits queued behind the weight stream, which the MMAs otherwise waited on.
        constexpr bool kPrefetchActivations = NT == 1;
        uint4 x_next[NT][4];
        const auto load_activations = [&](int i) {
          const std::uint32_t kb = kblock_of(i);
#pragma unroll
          for (int n = 0; n < NT; ++n)
            if (live(n))
#pragma unroll
              for (int w = 0; w < 4; ++w)
                x_next[n][w] = __ldg(reinterpret_cast<const uint4*>(xrow[n] + kb * kDecodeKBlock + 8 * w));
        };
        if constexpr (kPrefetchActivations) {
          if (my_blocks > 0) load_activations(0);
        }
        // One copy unit per step, its K blocks unrolled (pairs: the activation
        // prefetch's registers alternate instead of being moved).
        for (int i0 = 0; i0 < my_blocks; i0 += Copy) {
#pragma unroll
          for (int in_unit = 0; in_unit < Copy; ++in_unit) {
            const int i = i0 + in_unit;
            uint4 x[NT][4];
            if constexpr (kPrefetchActivations) {
#pragma unroll
              for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int w = 0; w < 4; ++w) x[n][w] = x_next[n][w];
              if (i + 1 < my_blocks) load_activations(i + 1);
            }
            if (in_unit == 0) {
              // Pairs: the lanes' copies of the unit's slots meet at the second
              // __syncwarp; the first keeps the new copies off slots that other
              // lanes may still be reading.
              if constexpr (Copy == 2) __syncwarp();
              issue();
              cp_async_wait<ahead>();
              if constexpr (Copy == 2) __syncwarp();
            }
            const uint4* stage = my_ring + (consumed++ & (kDecodeStages - 1)) * kDecodeStageVecs;
            uint4 wq[kDecodeChunksPerLane];
#pragma unroll
            for (int c = 0; c < kDecodeChunksPerLane; ++c) wq[c] = stage[c * 32];
            const std::uint32_t kb = kblock_of(i);
            // Scale pairs (s, s) per chunk and half of the lane's 32 values.
            std::uint32_t sp[kDecodeChunksPerLane][2];
            {
              constexpr int kWords = LaneScales<F, K>::kWords;
              std::uint32_t u[kWords];
              lane_scales.gather(stage[kDecodeChunksPerLane * 32], kb, u);
              if constexpr (kCsf && kStaged)
                block_exceptions->patch(kb, lane_key, u);
              else if constexpr (kCsf)
                if (exceptions.due(kb)) exceptions.patch(p.scales, *block_exceptions, tid, g, kb, t, u);
              scale_pairs<F>(u, sp);
            }
#pragma unroll
            for (int w = 0; w < 4; ++w) {
              // Activations k = 8w..8w+7 of the lane's 32: pairs (0,4) (1,5) | (2,6) (3,7).
              std::uint32_t b[NT][4];
#pragma unroll
              for (int n = 0; n < NT; ++n) {
                if (live(n)) {
                  const uint4 xv =
                      kPrefetchActivations
                          ? x[n][w]
                          : __ldg(reinterpret_cast<const uint4*>(xrow[n] + kb * kDecodeKBlock + 8 * w));
                  b[n][0] = __byte_perm(xv.x, xv.z, 0x5410);
                  b[n][1] = __byte_perm(xv.x, xv.z, 0x7632);
                  b[n][2] = __byte_perm(xv.y, xv.w, 0x5410);
                  b[n][3] = __byte_perm(xv.y, xv.w, 0x7632);
                }
              }
#pragma unroll
              for (int mt = 0; mt < 2; ++mt) {
                const std::uint32_t qlo = (&wq[2 * mt].x)[w], qhi = (&wq[2 * mt + 1].x)[w];
                std::uint32_t lo[4], hi[4];
                dequant_words<F>(qlo, sp[2 * mt][w / 2], qhi, sp[2 * mt + 1][w / 2], lo, hi);
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                  if (live(n)) {
                    mma_bf16(acc[mt][n], lo[0], hi[0], lo[1], hi[1], b[n][0], b[n][1]);
                    mma_bf16(acc[mt][n], lo[2], hi[2], lo[3], hi[3], b[n][2], b[n][3]);
                  }
                }
              }
            }
          }
        }
      };
      if (!kCsf || exceptions_staged)
        stream_kblocks(std::true_type{});
      else if constexpr (kCsf)
        stream_kblocks(std::false_type{});

      // Partial sums of every warp meet in shared memory: over the drained
      // rings, or (a run) in their own region once the previous reduction has
      // read it.
      if (!run) cp_async_wait<0>();
      __syncthreads();
      const int ptok = 8 * NT;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          if (live(n)) {
#pragma unroll
            for (int v = 0; v < 4; ++v) {
              const int r = 16 * mt + g + 8 * (v / 2), m = 8 * n + 2 * t + (v % 2);
              partial[(warp * kDecodeRows + r) * ptok + m] = acc[mt][n][v];
            }
          }
        }
      __syncthreads();
      const int toks = left < 8 * NT ? left : 8 * NT;
      for (int idx = tid; idx < kOutPerBlock * toks; idx += blockDim.x) {
        const int o = idx % kOutPerBlock, m = idx / kOutPerBlock;
        const auto sum = [&](int r) {
          float s = 0.0f;
          for (int w = 0; w < warps; ++w) s += partial[(w * kDecodeRows + r) * ptok + m];
          return s * gs;
        };
        if constexpr (GateUp) {
          const float gate = sum(o), up = sum(o + kOutPerBlock);
          const float y = gate_up_value<P>(p, e, n0 + o, gate, up);
          const __nv_bfloat16 h = __float2bfloat16_rn(y);
          p.act[std::uint64_t(row0 + tok0 + m) * p.n + n0 + o] = *reinterpret_cast<const std::uint16_t*>(&h);
        } else {
          const int s = p.sorted_slot[row0 + tok0 + m];
          p.slot_out[std::uint64_t(s) * p.out_rows + n0 + o] = sum(o);
        }
      }
    }
  }
  cp_async_wait<0>();  // a tile without valid rows still issued its first stages
  timeline.record();
}

}  // namespace csfmoe::moe_detail
