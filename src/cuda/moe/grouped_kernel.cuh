// Grouped W4A16 GEMM for mid-range and prefill calls on Hopper: persistent,
// warp-specialized, TMA + wgmma, token tiles sized by the routed rows per
// expert (src/moe/grouped_shape.hpp).
//
//  * Roles. Warpgroup 0 produces (setmaxnreg.dec): one thread streams the
//    item's FP4 weight rows into a ring of stages with 2-D TMA copies (two
//    boxes of 128 rows x 64 bytes per 128-wide K block), all 128 gather the
//    tile's activation rows with cp.async into the 128-byte-swizzled layout
//    wgmma reads (padding rows are zero-filled), with ring scales also the
//    weight rows' block scales of the K block (below), and arrive on the
//    stage's full barrier when their copies land. The other warpgroups
//    consume (setmaxnreg.inc), the item's 256 weight rows as the A operand
//    from registers: two of 128 rows, or four of 64 in the smaller tiles
//    (grouped_consumers).
//  * Overlap. Each k32 step (two k16 wgmmas) converts its A fragment into
//    its own register buffer, issues, commits and waits until at most
//    kGroupedDepth groups are in flight, so the conversion of the next
//    fragment runs while the tensor cores work on the previous ones. A stage
//    is handed back (empty barrier, one arrival per consumer warp) as soon
//    as its last wgmma has retired; the main loop has no CTA barrier.
//  * Persistence. Every CTA walks the work list (grouped_item: raster groups
//    of p.tile_group tiles) with a fixed stride; producer and consumers walk
//    it alike, so the producer streams the next item's weights while the
//    consumers run the epilogue, in which they also read the next item's
//    expert and bring its first scale words into L1.
//  * Operand order and scales as the prefill kernel (prefill_kernel.cuh):
//    activations K-permuted in global memory (prefill_k_source), the decode
//    kernel's E2M1 conversion and LaneScales, whose words each consumer
//    thread loads itself two K blocks ahead; in the 128-row tile, MXFP4
//    scale pairs carry the nibbles' 2^126 (one multiply per pair) where the
//    warp's bytes allow (grouped_fetches_mid_block). Ring scales
//    (RingScaleRows; the plan's choice by token tile,
//    grouped_ring_scales_by_default): the producer copies each stage's 256
//    scale rows beside its weights and a consumer gathers the same words
//    from shared memory (RingScales), so both give the same bits.
//  * Epilogues. gate/up: SiLU(gate) * up to bf16, written per routed slot in
//    the down projection's K order; down: bf16 per slot (FP32 on request)
//    for the combine, which sums in FP32 in slot order. bf16 goes out in
//    pairs of adjacent columns, one shuffle between two lane groups each.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/moe/decode_kernel.cuh"
#include "cuda/moe/dequant.cuh"
#include "cuda/moe/epilogue.cuh"
#include "cuda/primitives/mbarrier.cuh"
#include "cuda/primitives/ptx.cuh"
#include "cuda/primitives/wgmma.cuh"
#include "moe/grouped_shape.hpp"

namespace csfmoe::moe_detail {

// wgmma groups (k32 steps) a consumer keeps in flight while converting the
// next fragment; its fragment buffers (kGroupedDepth + 1) divide the steps
// of a K block (4 per m64 tile), so every buffer index is a compile-time
// constant.
constexpr int kGroupedDepth = 1;
// Step of a K block after which a consumer fetches the next block's operands,
// in the tile classes that fetch mid-block (grouped_fetches_mid_block).
constexpr int kGroupedFetchStep = 5;
// The 128-row tile is latency-bound: fetching the next K block's operands
// mid-block and folding MXFP4's 2^126 into the scale pairs measured 2-8 %
// faster there. Smaller tiles are issue-bound; there the same code measured
// 2-10 % slower than fetching at the block's start with plain pairs
// (bench/results/2026-12-05-grouped-fetch-ab-*.jsonl).
constexpr bool grouped_fetches_mid_block(int nt) { return nt >= 128; }

// Source element offset of a padding row: its copy is zero-filled.
constexpr std::uint32_t kGroupedNoRow = 0xFFFFFFFFu;

using decode_bits::prefill_permuted_column;

// In a two-tile gate/up consumer, the second m64 tile's outputs are the
// first's plus 32 (grouped_out_in_item, bit 5 clear in the first), which the
// K permutation moves to bit 1: its act columns are the first's plus 2.
constexpr std::uint32_t grouped_second_tile_act_step = 2;
constexpr bool grouped_second_tile_act_step_holds() {
  for (std::uint32_t k = 0; k < 256; ++k)
    if ((k & 32u) == 0 &&
        prefill_permuted_column(k + 32) != prefill_permuted_column(k) + grouped_second_tile_act_step)
      return false;
  return true;
}
static_assert(grouped_second_tile_act_step_holds());

template <ScaleFormat F, ScaleKind K, Projection P, int NT, bool RingScaleRows>
__global__ void __launch_bounds__(grouped_consumers(NT).threads, 1)
    moe_grouped_kernel(const __grid_constant__ CUtensorMap wmap, GemmParams p) {
  constexpr bool GateUp = is_gate_up(P);
  static_assert(K != ScaleKind::csf, "stage-read CSF calls run on the decode kernel");
  static_assert(NT % 8 == 0 && NT >= 16 && NT <= 128, "token tile classes: grouped_shape.hpp");
  using namespace decode;
  using namespace ptx;
  using Ring = RingScales<F, K>;
  constexpr GroupedSmem kSmem = grouped_path_smem(NT, F == ScaleFormat::nvfp4, RingScaleRows);
  constexpr GroupedConsumers kCons = grouped_consumers(NT);
  constexpr int kMT = kCons.m_tiles, kChunks = 2 * kMT, kSteps = 4 * kMT;  // k32 steps per K block
  static_assert(kMT * kCons.groups == 4 && kCons.threads == 128 * (1 + kCons.groups));
  static_assert(128 * kCons.producer_regs + 128 * kCons.groups * kCons.consumer_regs <=
                    grouped_register_pool(kCons.threads),
                "the warpgroups' registers fit the CTA's pool from launch");
  static_assert(kSteps % (kGroupedDepth + 1) == 0, "fragment buffers divide the steps of a K block");
  constexpr bool kFetchMidBlock = grouped_fetches_mid_block(NT), kFoldScales = kFetchMidBlock;
  static_assert(!kFetchMidBlock || (kMT == 2 && kGroupedFetchStep < kSteps));
  constexpr std::uint32_t kStages = kSmem.stages;
  constexpr std::uint32_t kHalfBytes = NT * 128;  // one 64-K half of the activation tile
  extern __shared__ unsigned char smem_raw[];

  const std::uint32_t raw_addr = smem_u32(smem_raw);
  unsigned char* smem = smem_raw + (((raw_addr + 1023u) & ~1023u) - raw_addr);
  auto* full = reinterpret_cast<std::uint64_t*>(smem + kSmem.barriers);
  std::uint64_t* empty = full + kStages;
  auto* tables = reinterpret_cast<std::uint32_t*>(smem + kSmem.tables);  // [2][NT], grouped_row_table_index

  const int tid = threadIdx.x;
  if (tid == 0) {
    for (std::uint32_t s = 0; s < kStages; ++s) {
      mbarrier_init(&full[s], 128 + 1);            // producer copies (noinc) + the TMA thread's expect_tx
      mbarrier_init(&empty[s], 4 * kCons.groups);  // one arrival per consumer warp
    }
    fence_barrier_init();
  }
  __syncthreads();

  grid_dependency_wait();  // routing, permuted activations / act come from the kernels before
  allow_dependent_launch();
  const std::uint32_t tiles = std::uint32_t(p.header[0]);
  const std::uint32_t row_blocks = (GateUp ? p.n : p.out_rows) / grouped_outputs_per_item(GateUp);
  const std::uint32_t items = tiles * row_blocks;
  const std::uint32_t kblocks = p.k / kGroupedKBlock;

  if (tid < 128) {
    // ---------------------------------------------------------------- producer
    setmaxnreg_dec<kCons.producer_regs>();
    // Chunk a of the thread: row first.row + 8a, at first.offset + 8a * 128 (grouped_act_chunk).
    constexpr GroupedActChunk first = grouped_act_chunk(NT, 0, 0);
    static_assert(first.row == 0 && first.offset == 0);
    const GroupedActChunk chunk = grouped_act_chunk(NT, tid, 0);
    constexpr int kRowVec = grouped_row_table_vec(NT);
    struct alignas(4 * kRowVec) RowOffsets {  // one shared load
      std::uint32_t v[kRowVec];
    };
    std::uint32_t it = 0, buf = 0;
    for (std::uint32_t item = blockIdx.x; item < items; item += gridDim.x, buf ^= 1u) {
      const GroupedItem w = grouped_item(item, tiles, row_blocks, p.tile_group);
      const int e = p.tile_expert[w.tile];
      std::uint32_t* table = tables + buf * NT;
      for (int n = tid; n < NT; n += 128) {
        const int slot = p.sorted_slot[w.tile * NT + n];
        table[grouped_row_table_index(NT, n)] =
            slot < 0 ? kGroupedNoRow : std::uint32_t(GateUp ? slot / int(p.topk) : slot) * p.k;
      }
      named_barrier_sync(1, 128);
      const int y0 = int(std::uint32_t(e) * p.out_rows +
                         (GateUp ? p.gate_row0 + w.row_block * 128 : w.row_block * kGroupedRows));
      const int y1 = GateUp ? int(std::uint32_t(e) * p.out_rows + p.up_row0 + w.row_block * 128) : y0 + 128;
      // Ring scales: the thread's scale rows of every stage, ring rows tid
      // and tid + 128, the first's words at K block kb, the second's a fixed
      // distance on (recomputed from the parameters at each use: the
      // producer's 24 registers hold no more).
      [[maybe_unused]] const std::uint8_t* scale_src =
          RingScaleRows
              ? expert_scales<K>(p.scales, e) +
                    dense_index_in_expert<K>(
                        p.scales, grouped_weight_row(GateUp, tid, w.row_block, p.gate_row0, p.up_row0), 0)
              : nullptr;
      for (std::uint32_t kb = 0; kb < kblocks; ++kb, ++it) {
        const std::uint32_t s = it % kStages, phase = (it / kStages) & 1u;
        mbarrier_wait(&empty[s], phase ^ 1u);
        unsigned char* stage = smem + s * kSmem.stage_bytes;
        if (tid == 0) {
          mbarrier_arrive_expect_tx(&full[s], kGroupedWeightStageBytes);
          tma_load_2d(stage, &wmap, &full[s], int(kb * 64), y0);
          tma_load_2d(stage + kGroupedWeightStageBytes / 2, &wmap, &full[s], int(kb * 64), y1);
        }
        const std::uint32_t act = smem_u32(stage + kGroupedWeightStageBytes) + chunk.offset;
        const std::uint32_t col = kb * kGroupedKBlock + chunk.half * 64 + chunk.c8 * 8;
        // The thread's rows, kRowVec offsets per shared load (grouped_row_table_index).
        const std::uint32_t* rows = table + grouped_row_table_index(NT, chunk.row);
#pragma unroll
        for (int a0 = 0; a0 < NT / 8; a0 += kRowVec) {
          const RowOffsets offs = *reinterpret_cast<const RowOffsets*>(rows + a0);
#pragma unroll
          for (int v = 0; v < kRowVec; ++v) {
            const std::uint32_t off = offs.v[v];
            const bool real = off != kGroupedNoRow;
            cp_async16_or_zero(act + std::uint32_t(a0 + v) * 8 * 128, p.a + (real ? off : 0u) + col, real);
          }
        }
        if constexpr (RingScaleRows) {
          unsigned char* scale_rows = stage + kSmem.scale_offset;
          Ring::copy(scale_rows + tid * Ring::kRowBytes, scale_src);
          Ring::copy(scale_rows + (tid + 128) * Ring::kRowBytes,
                     scale_src + grouped_scale_rows_apart(
                                     K == ScaleKind::dense_swizzled,
                                     GateUp ? std::int64_t(p.up_row0) - p.gate_row0 : 128, p.scales.cols));
          scale_src += Ring::kStride;
        }
        cp_async_arrive_noinc(&full[s]);
      }
    }
    return;
  }

  // ------------------------------------------------------------------ consumers
  setmaxnreg_inc<kCons.consumer_regs>();
  const int ct = tid - 128, wg = ct / 128, wi = (ct / 32) % 4, lane = ct % 32, g = lane / 4, t = lane % 4;
  // The thread's outputs and ring rows (grouped_shape.hpp's fragment map):
  // chunk c = 2 mt + h is half h of its m64 tile mt.
  const auto out_in_item = [&](int mt) { return grouped_out_in_item(GateUp, wg * kMT + mt, wi, g); };
  std::uint32_t ring_row[kChunks];
#pragma unroll
  for (int c = 0; c < kChunks; ++c) ring_row[c] = grouped_ring_row(GateUp, wg * kMT + c / 2, wi, g, c % 2);

  // The thread's scale reader of an item (pure arithmetic: no loads).
  const auto scales_of = [&](const GroupedItem& w, int e) {
    const std::uint32_t first = GateUp ? w.row_block * 128 : w.row_block * kGroupedRows;
    // Weight rows of the chunks in the expert (gate/up: ring rows 0..127 are
    // gate rows); LaneScales reads four rows, a one-tile consumer's twice.
    std::uint32_t rows[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int cc = c % kChunks;
      rows[c] = GateUp ? (cc % 2 == 0 ? p.gate_row0 : p.up_row0) + first + out_in_item(cc / 2)
                       : first + ring_row[cc];
    }
    return LaneScales<F, K>(p.scales, expert_scales<K>(p.scales, e), rows, t);
  };
  // The next item and its expert are read during this item's epilogue, and
  // the scale words of its first two K blocks brought into L1 there, so
  // that an item starts without two dependent trips to global memory.
  GroupedItem next_w{};
  int next_e = 0;
  if (blockIdx.x < items) {
    next_w = grouped_item(blockIdx.x, tiles, row_blocks, p.tile_group);
    next_e = p.tile_expert[next_w.tile];
  }

  std::uint32_t it = 0;
  for (std::uint32_t item = blockIdx.x; item < items; item += gridDim.x) {
    const GroupedItem w = next_w;
    const int e = next_e;
    const std::uint32_t first = GateUp ? w.row_block * 128 : w.row_block * kGroupedRows;
    const LaneScales<F, K> lane_scales = scales_of(w, e);
    // The scale words of K block kb from global memory (ring scales: none).
    const auto load_words = [&](std::uint32_t kb) {
      uint4 v{};
      if constexpr (RingScaleRows) return v;
      v.x = __ldg(lane_scales.word(0, kb));
      v.y = __ldg(lane_scales.word(1, kb));
      v.z = kMT == 2 ? __ldg(lane_scales.word(2, kb)) : v.x;
      v.w = kMT == 2 ? __ldg(lane_scales.word(3, kb)) : v.y;
      return v;
    };

    float acc[kMT][NT / 2];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int v = 0; v < NT / 2; ++v) acc[mt][v] = 0.0f;

    std::uint32_t frag[kGroupedDepth + 1][8];
    const auto release = [&](std::uint32_t s) {
      __syncwarp();
      if (lane == 0) mbarrier_arrive(&empty[s]);
    };
    // A K block's operands in registers: the thread's weight words and bf16
    // scale pairs read from its stage.
    struct KOperands {
      uint4 wq[kChunks];
      std::uint32_t sp[4][2];
      bool unfolded;  // warp-uniform: MXFP4 pairs without the 2^126 fold
    };
    const auto fetch = [&](std::uint32_t kb, std::uint32_t at, const uint4& words, KOperands& o) {
      const std::uint32_t s = at % kStages, phase = (at / kStages) & 1u;
      mbarrier_wait(&full[s], phase);
      const unsigned char* stage = smem + s * kSmem.stage_bytes;
#pragma unroll
      for (int c = 0; c < kChunks; ++c)
        o.wq[c] = *reinterpret_cast<const uint4*>(stage + ring_row[c] * 64 + std::uint32_t(t) * 16);
      std::uint32_t u[LaneScales<F, K>::kWords];
      if constexpr (RingScaleRows) {
        // Ring rows' words (a one-tile consumer's two, twice); the reader is
        // rebuilt per K block from t (a few integer instructions): held
        // across the item, its registers spill in the 128-row down epilogue.
        const Ring ring_scales{std::uint32_t(t)};
        const unsigned char* scale_rows = stage + kSmem.scale_offset;
        uint4 ring_words;
        ring_words.x = ring_scales.word(scale_rows, ring_row[0]);
        ring_words.y = ring_scales.word(scale_rows, ring_row[1]);
        ring_words.z = kMT == 2 ? ring_scales.word(scale_rows, ring_row[2 % kChunks]) : ring_words.x;
        ring_words.w = kMT == 2 ? ring_scales.word(scale_rows, ring_row[3 % kChunks]) : ring_words.y;
        ring_scales.gather(ring_words, u);
      } else {
        lane_scales.gather(words, kb, u);
      }
      if constexpr (kFoldScales) {
        o.unfolded = scale_pairs_folded<F>(u, o.sp);
      } else {
        scale_pairs<F>(u, o.sp);
        o.unfolded = true;
      }
    };
    std::uint32_t prev_stage = 0;
    // One K block from its operands: convert and issue its k32 steps,
    // calling after_step(step) once each step's wait has returned.
    const auto k_steps = [&](std::uint32_t kb, const KOperands& o, const auto& after_step) {
      const std::uint32_t s = it % kStages;
      const std::uint32_t act = smem_u32(smem + s * kSmem.stage_bytes + kGroupedWeightStageBytes);
#pragma unroll
      for (int step = 0; step < kSteps; ++step) {
        const int wd = step / kMT, mt = step % kMT;
        std::uint32_t(&a)[8] = frag[step % (kGroupedDepth + 1)];
        std::uint32_t lo[4], hi[4];
        const std::uint32_t qlo = (&o.wq[2 * mt].x)[wd], qhi = (&o.wq[2 * mt + 1].x)[wd];
        if (F == ScaleFormat::mxfp4 && (!kFoldScales || o.unfolded))
          dequant_words<F, false>(qlo, o.sp[2 * mt][wd / 2], qhi, o.sp[2 * mt + 1][wd / 2], lo, hi);
        else
          dequant_words<F, true>(qlo, o.sp[2 * mt][wd / 2], qhi, o.sp[2 * mt + 1][wd / 2], lo, hi);
#pragma unroll
        for (int j = 0; j < 4; ++j) a[j] = lo[j], a[4 + j] = hi[j];
        wgmma_fence();
        // Logical K 32wd..32wd+31 of the block: half wd / 2 of the tile, 32 bytes per k16.
        const std::uint32_t b = act + std::uint32_t(wd / 2) * kHalfBytes + std::uint32_t(wd % 2) * 64;
        wgmma_m64nNk16<NT>(acc[mt], a[0], a[4], a[1], a[5], wgmma_smem_desc_sw128(b));
        wgmma_m64nNk16<NT>(acc[mt], a[2], a[6], a[3], a[7], wgmma_smem_desc_sw128(b + 32));
        wgmma_commit();
        wgmma_wait<kGroupedDepth>();
        // Every step of the previous K block has retired: its stage is free.
        if (step == kGroupedDepth - 1 && kb > 0) release(prev_stage);
        after_step(step);
      }
      prev_stage = s;
      ++it;
    };
    // Scale words are loaded two K blocks ahead of their use.
    uint4 words_even = load_words(0), words_odd = kblocks > 1 ? load_words(1) : uint4{};
    if constexpr (kFetchMidBlock) {
      // The next block's barrier wait, shared-memory loads and scale pairs
      // run while this block's last wgmmas are in flight.
      KOperands ops_even, ops_odd;
      const auto k_block = [&](std::uint32_t kb, const KOperands& o, KOperands& next,
                               const uint4& next_words) {
        k_steps(kb, o, [&](int step) {
          if (step == kGroupedFetchStep && kb + 1 < kblocks) fetch(kb + 1, it + 1, next_words, next);
        });
      };
      fetch(0, it, words_even, ops_even);
      if (kblocks > 2) words_even = load_words(2);
      for (std::uint32_t kb = 0; kb < kblocks; kb += 2) {
        k_block(kb, ops_even, ops_odd, words_odd);
        if (kb + 3 < kblocks) words_odd = load_words(kb + 3);
        if (kb + 1 < kblocks) {
          k_block(kb + 1, ops_odd, ops_even, words_even);
          if (kb + 4 < kblocks) words_even = load_words(kb + 4);
        }
      }
    } else {
      const auto k_block = [&](std::uint32_t kb, const uint4& words) {
        KOperands o;
        fetch(kb, it, words, o);
        k_steps(kb, o, [](int) {});
      };
      for (std::uint32_t kb = 0; kb < kblocks; kb += 2) {
        k_block(kb, words_even);
        if (kb + 2 < kblocks) words_even = load_words(kb + 2);
        if (kb + 1 < kblocks) {
          k_block(kb + 1, words_odd);
          if (kb + 3 < kblocks) words_odd = load_words(kb + 3);
        }
      }
    }
    wgmma_wait<0>();
    release(prev_stage);
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int v = 0; v < NT / 2; ++v) fence_operand(acc[mt][v]);

    // Epilogue: acc[mt][4j + v] is (row g, token 8j + 2t + v), acc[mt][4j + 2 + v]
    // (row g + 8, same token) of the warp's m16 tile.
    const float gs = (p.global ? p.global[e] : 1.0f) * kDecodeUnfold<F>;
    const int* tile_slots = p.sorted_slot + std::uint64_t(w.tile) * NT;
    // The next item's expert now, its first scale words into L1 halfway
    // through the epilogue.
    const std::uint32_t next_item = item + gridDim.x;
    if (next_item < items) {
      next_w = grouped_item(next_item, tiles, row_blocks, p.tile_group);
      next_e = p.tile_expert[next_w.tile];
    }
    const auto start_next = [&](int j) {
      if (RingScaleRows || j != NT / 16 || next_item >= items) return;
      const LaneScales<F, K> ls = scales_of(next_w, next_e);
#pragma unroll
      for (int c = 0; c < 2 * kMT; ++c) {
        prefetch_l1(ls.word(c, 0));
        if (kblocks > 1) prefetch_l1(ls.word(c, 1));
      }
    };
    if (GateUp || p.slot_out16 != nullptr) {
      // bf16 outputs leave in pairs of adjacent columns, one 4-byte store per
      // pair: the lane groups g and g ^ kPairBit hold neighbouring columns
      // (gate/up: its K-permuted act columns; down: rows g, g + 1) of the same
      // two tokens, and each trades its values of token 1 - b for its
      // partner's of token b (b = its bit kPairBit), so it holds both columns
      // of token b. All lanes take part in the shuffles; padding slots only
      // skip the store.
      constexpr int kPairBit = GateUp ? 4 : 1;
      constexpr unsigned kAll = 0xFFFFFFFFu;
      // The slots of the lane's tokens (8j + 2t + b), kSlotBatch loads at a
      // time (grouped_slot_batch).
      constexpr int kSlotBatch = grouped_slot_batch(NT);
      static_assert((NT / 8) % kSlotBatch == 0);
      // The lane's coordinates again, computed here: held from the start they
      // would cost the 128-row tile registers beside its accumulators.
      const int el = lane_id_here(), eg = el / 4, et = el % 4;
      const int b = (eg & kPairBit) != 0 ? 1 : 0;
      int slots[kSlotBatch];
      // gate/up: the act column the lane's pairs start at in its first m64
      // tile; the second tile's outputs are 32 further, 2 further in act
      // (grouped_second_tile_act_step).
      const std::uint32_t act_col = prefill_permuted_column(
          (first + grouped_out_in_item(GateUp, wg * kMT, wi, eg)) & ~std::uint32_t(kPairBit));
#pragma unroll
      for (int j = 0; j < NT / 8; ++j) {
        start_next(j);
        if (j % kSlotBatch == 0) {
#pragma unroll
          for (int i = 0; i < kSlotBatch; ++i) slots[i] = tile_slots[8 * (j + i) + 2 * et + b];
        }
        const int slot = slots[j % kSlotBatch];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          const std::uint32_t o = first + grouped_out_in_item(GateUp, wg * kMT + mt, wi, eg);
          const float g0 = acc[mt][4 * j] * gs, g1 = acc[mt][4 * j + 1] * gs;      // row g, tokens 0 / 1
          const float h0 = acc[mt][4 * j + 2] * gs, h1 = acc[mt][4 * j + 3] * gs;  // row g + 8
          if constexpr (GateUp) {
            const float y0 = gate_up_value<P>(p, e, o, g0, h0), y1 = gate_up_value<P>(p, e, o, g1, h1);
            const float theirs = __shfl_xor_sync(kAll, b ? y0 : y1, 4 * kPairBit);
            const float mine = b ? y1 : y0;
            const __nv_bfloat162 pair =
                b ? __floats2bfloat162_rn(theirs, mine) : __floats2bfloat162_rn(mine, theirs);
            // The pair's first column: the b = 0 lane's output, its K-permuted slot even.
            if (slot >= 0)
              *reinterpret_cast<__nv_bfloat162*>(p.act + std::uint64_t(slot) * p.n + act_col +
                                                 std::uint32_t(mt) * grouped_second_tile_act_step) = pair;
          } else {
            const __nv_bfloat162 sent = b ? __floats2bfloat162_rn(g0, h0) : __floats2bfloat162_rn(g1, h1);
            std::uint32_t bits = *reinterpret_cast<const std::uint32_t*>(&sent);
            bits = __shfl_xor_sync(kAll, bits, 4 * kPairBit);
            const __nv_bfloat162 got = *reinterpret_cast<const __nv_bfloat162*>(&bits);
            const __nv_bfloat16 m_lo = __float2bfloat16_rn(b ? g1 : g0),
                                m_hi = __float2bfloat16_rn(b ? h1 : h0);
            const __nv_bfloat162 lo = b ? __halves2bfloat162(got.x, m_lo) : __halves2bfloat162(m_lo, got.x);
            const __nv_bfloat162 hi = b ? __halves2bfloat162(got.y, m_hi) : __halves2bfloat162(m_hi, got.y);
            if (slot >= 0) {
              // Rows o - b, o - b + 1 and the same 8 rows below.
              auto* out = reinterpret_cast<__nv_bfloat162*>(p.slot_out16 + std::uint64_t(slot) * p.out_rows +
                                                            (o - b));
              out[0] = lo;
              out[4] = hi;
            }
          }
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < NT / 8; ++j) {
        start_next(j);
#pragma unroll
        for (int v = 0; v < 2; ++v) {
          const int slot = tile_slots[8 * j + 2 * t + v];
          if (slot < 0) continue;
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            const std::uint32_t o = first + out_in_item(mt);
            float* out = p.slot_out + std::uint64_t(slot) * p.out_rows;
            out[o] = acc[mt][4 * j + v] * gs;
            out[o + 8] = acc[mt][4 * j + 2 + v] * gs;
          }
        }
      }
    }
  }
}

}  // namespace csfmoe::moe_detail
