// Grouped W4A16 GEMM for large calls (prefill) on Hopper: wgmma with the
// dequantized weights as the register operand.
//
// At prefill sizes an expert sees tens to hundreds of tokens and the layer
// is bound by tensor throughput, which on sm_90 only wgmma reaches. The
// kernel keeps the decode kernel's operand roles and dequantization
// (src/cuda/moe/decode_kernel.cuh) and swaps mma.sync for wgmma:
//
//  * Operands. Weight rows are wgmma's M side, taken from registers (the RS
//    form): each thread dequantizes exactly the A fragment it owns, so the
//    bf16 weights never touch shared memory. The kTileM = 64 sorted rows of a
//    routing tile are the N side (m64n64k16), read from shared memory through
//    a 128-byte-swizzled descriptor.
//  * K permutation. The A fragment of a warp is laid out like mma.sync's, so
//    the decode kernel's trick carries over: lane t of a quad owns 32
//    consecutive K of its rows per 128-wide K block (one 16-byte chunk per
//    row) and feeds them to the block's eight k16 steps in the order that
//    makes E2M1 -> bf16 three instructions per pair. The activations must be
//    in the same order; shared memory is filled with 16-byte copies, so the
//    order is applied once in global memory instead (prefill_k_source): the
//    layer permutes the hidden rows before gate/up, and the gate/up epilogue
//    writes its output already permuted for the down projection.
//  * Pipeline. kPrefillStages K blocks in flight through cp.async (weights,
//    scale words and the 64 activation rows of the tile); one barrier per K
//    block. Each warpgroup issues 16 wgmmas per K block, dequantizing the
//    next fragment while the tensor cores work on the previous ones.
//  * Scales. LaneScales (src/cuda/moe/scale_read.cuh) with the thread's four
//    rows, converted by the decode kernel's scale_pairs: identical bits.
//    Dense grids only (native, expanded and routed modes); the layer runs
//    stage-read CSF calls on the decode kernel.
//
// A block is two warpgroups over 256 weight rows: gate/up, 128 outputs (each
// warp's m16 row tile pairs 8 gate rows with the 8 up rows of the same
// outputs, so SiLU(gate) * up is formed in registers); down, 256 output rows.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/moe/decode_kernel.cuh"
#include "cuda/moe/dequant.cuh"
#include "cuda/moe/epilogue.cuh"
#include "cuda/primitives/ptx.cuh"
#include "cuda/primitives/wgmma.cuh"

namespace csfmoe::moe_detail {

constexpr int kPrefillThreads = 256;  // two warpgroups
constexpr int kPrefillRows = 256;     // weight rows per block: 2 warpgroups x 2 m64 tiles
constexpr int kPrefillKBlock = 128;   // K per pipeline stage
constexpr int kPrefillStages = 4;     // cp.async ring depth
constexpr int kPrefillChunks = 4;     // 16-byte weight chunks per thread and K block (its 4 rows)
constexpr std::uint32_t kPrefillActBytes = kTileM * kPrefillKBlock * 2;  // two [64][128 B] halves
constexpr std::uint32_t kPrefillWeightBytes = kPrefillThreads * kPrefillChunks * 16;  // [chunk][thread]
constexpr std::uint32_t kPrefillScaleBytes = kPrefillThreads * 16;                    // [thread] 4 words
constexpr std::uint32_t kPrefillStageBytes = kPrefillActBytes + kPrefillWeightBytes + kPrefillScaleBytes;
static_assert(kPrefillStageBytes % 1024 == 0, "stages keep the 1024-byte alignment of the swizzle atoms");
// Stages, the routing rows (source row and slot per sorted row) and slack to
// align the dynamic shared memory to 1024 bytes.
constexpr std::uint32_t kPrefillSmem = kPrefillStages * kPrefillStageBytes + 2 * kTileM * 4 + 1024;

using decode_bits::prefill_k_source;
using decode_bits::prefill_permuted_column;

template <ScaleFormat F, ScaleKind K, Projection P>
__global__ void __launch_bounds__(kPrefillThreads, 1) moe_prefill_kernel(GemmParams p) {
  constexpr bool GateUp = is_gate_up(P);
  static_assert(K != ScaleKind::csf, "stage-read CSF calls run on the decode kernel");
  using namespace decode;
  using namespace ptx;
  extern __shared__ unsigned char smem_raw[];

  grid_dependency_wait();  // the ring carries activations from the first stage on
  allow_dependent_launch();
  const int tile = blockIdx.x;
  if (tile >= p.header[0]) return;
  const std::uint32_t raw_addr = static_cast<std::uint32_t>(__cvta_generic_to_shared(smem_raw));
  unsigned char* smem = smem_raw + (((raw_addr + 1023u) & ~1023u) - raw_addr);
  const std::uint32_t smem_addr = static_cast<std::uint32_t>(__cvta_generic_to_shared(smem));
  int* arow = reinterpret_cast<int*>(smem + kPrefillStages * kPrefillStageBytes);  // [kTileM]
  int* slot_of = arow + kTileM;                                                    // [kTileM]

  const int tid = threadIdx.x, wg = tid / 128, wi = (tid / 32) % 4, lane = tid % 32, g = lane / 4,
            t = lane % 4;
  const int e = p.tile_expert[tile];
  const std::uint32_t row0 = std::uint32_t(tile) * kTileM;
  constexpr int kOutPerBlock = GateUp ? kPrefillRows / 2 : kPrefillRows;
  const std::uint32_t n0 = blockIdx.y * kOutPerBlock;

  // The thread's rows, chunk c = 2 * mt + h: row g + 8h of m64 tile mt of its warp.
  // Gate/up: h = 0 gate, h = 1 up row of output out_of(mt).
  const auto out_of = [&](int mt) -> std::uint32_t {
    return GateUp ? n0 + 64 * wg + 32 * mt + 8 * wi + g : n0 + 128 * wg + 64 * mt + 16 * wi + g;
  };
  std::uint32_t rows[kPrefillChunks];
  const std::uint64_t row_bytes = p.k / 2;
  const std::uint8_t* w_e = p.w + std::uint64_t(e) * p.out_rows * row_bytes;
  const std::uint8_t* wsrc[kPrefillChunks];
#pragma unroll
  for (int c = 0; c < kPrefillChunks; ++c) {
    const int mt = c / 2, h = c % 2;
    if constexpr (GateUp)
      rows[c] = (h == 0 ? p.gate_row0 : p.up_row0) + out_of(mt);
    else
      rows[c] = out_of(mt) + 8 * h;
    wsrc[c] = w_e + std::uint64_t(rows[c]) * row_bytes + t * 16;
  }
  const LaneScales<F, K> lane_scales(p.scales, expert_scales<K>(p.scales, e), rows, t);

  // Valid rows of the tile are a prefix (routing pads the tail with -1).
  int slot = -1;
  if (tid < kTileM) {
    slot = p.sorted_slot[row0 + tid];
    arow[tid] = slot < 0 ? -1 : (GateUp ? slot / int(p.topk) : int(row0) + tid);
    slot_of[tid] = slot;
  }
  const int valid = __syncthreads_count(tid < kTileM && slot >= 0);

  // Activation chunks of the thread: 4 of the 1024 (64 rows x 2 halves x 8)
  // of a stage, 16 threads per row. Padding rows read row 0 (never stored).
  constexpr int kActChunks = kTileM * 16 / kPrefillThreads;
  const std::uint16_t* xsrc[kActChunks];
  std::uint32_t xdst[kActChunks];
#pragma unroll
  for (int a = 0; a < kActChunks; ++a) {
    const int idx = tid + kPrefillThreads * a, n = idx / 16, half = (idx / 8) % 2, c8 = idx % 8;
    const int src_row = arow[n] < 0 ? arow[0] : arow[n];
    xsrc[a] = p.a + std::uint64_t(src_row) * p.k + half * 64 + c8 * 8;
    xdst[a] =
        std::uint32_t(half) * (kTileM * 128) + std::uint32_t(n) * 128 + std::uint32_t((c8 ^ (n % 8)) * 16);
  }

  const std::uint32_t kblocks = p.k / kPrefillKBlock;
  const auto issue = [&](std::uint32_t i) {
    if (i < kblocks) {
      unsigned char* st = smem + (i % kPrefillStages) * kPrefillStageBytes;
#pragma unroll
      for (int a = 0; a < kActChunks; ++a) cp_async16(st + xdst[a], xsrc[a] + i * kPrefillKBlock);
      auto* wdst = reinterpret_cast<uint4*>(st + kPrefillActBytes) + tid;
#pragma unroll
      for (int c = 0; c < kPrefillChunks; ++c) cp_async16(wdst + c * kPrefillThreads, wsrc[c] + i * 64);
      auto* sdst = reinterpret_cast<std::uint32_t*>(st + kPrefillActBytes + kPrefillWeightBytes) + 4 * tid;
#pragma unroll
      for (int c = 0; c < kPrefillChunks; ++c) cp_async4(sdst + c, lane_scales.word(c, i));
    }
    cp_async_commit();  // empty groups keep the wait counts uniform
  };
  for (int s = 0; s < kPrefillStages - 1; ++s) issue(std::uint32_t(s));

  float acc[2][32];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int v = 0; v < 32; ++v) acc[mt][v] = 0.0f;

  for (std::uint32_t kb = 0; kb < kblocks; ++kb) {
    cp_async_wait<kPrefillStages - 2>();
    fence_proxy_async();  // cp.async wrote the tile through the generic proxy; wgmma reads it through the
                          // async one
    __syncthreads();
    issue(kb + kPrefillStages - 1);  // the stage read by the previous K block, whose wgmmas completed

    const unsigned char* st = smem + (kb % kPrefillStages) * kPrefillStageBytes;
    const std::uint32_t act_addr = smem_addr + (kb % kPrefillStages) * kPrefillStageBytes;
    const uint4* wst = reinterpret_cast<const uint4*>(st + kPrefillActBytes) + tid;
    uint4 wq[kPrefillChunks];
#pragma unroll
    for (int c = 0; c < kPrefillChunks; ++c) wq[c] = wst[c * kPrefillThreads];
    std::uint32_t sp[kPrefillChunks][2];
    {
      constexpr int kWords = LaneScales<F, K>::kWords;
      std::uint32_t u[kWords];
      lane_scales.gather(reinterpret_cast<const uint4*>(st + kPrefillActBytes + kPrefillWeightBytes)[tid], kb,
                         u);
      scale_pairs<F>(u, sp);
    }
#pragma unroll
    for (int w = 0; w < 4; ++w) {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const std::uint32_t qlo = (&wq[2 * mt].x)[w], qhi = (&wq[2 * mt + 1].x)[w];
        std::uint32_t lo[4], hi[4];
        dequant_words<F>(qlo, sp[2 * mt][w / 2], qhi, sp[2 * mt + 1][w / 2], lo, hi);
        wgmma_fence();
        // Steps 2w and 2w + 1: logical K 32w..32w+31 of the block, in the
        // half (2w) / 4 of the activation stage, 32 bytes per step.
        const std::uint32_t b = act_addr + std::uint32_t(w / 2) * (kTileM * 128) + std::uint32_t(w % 2) * 64;
        wgmma_m64n64k16(acc[mt], lo[0], hi[0], lo[1], hi[1], wgmma_smem_desc_sw128(b));
        wgmma_m64n64k16(acc[mt], lo[2], hi[2], lo[3], hi[3], wgmma_smem_desc_sw128(b + 32));
      }
    }
    wgmma_commit();
    wgmma_wait<0>();
  }
  cp_async_wait<0>();
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int v = 0; v < 32; ++v) fence_operand(acc[mt][v]);

  // Epilogue: acc[mt][4j + v] is (row g, token 8j + 2t + v), acc[mt][4j + 2 + v]
  // (row g + 8, same token) of the warp's m16 tile.
  const float gs = (p.global ? p.global[e] : 1.0f) * kDecodeUnfold<F>;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    const std::uint32_t o = out_of(mt);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int v = 0; v < 2; ++v) {
        const int m = 8 * j + 2 * t + v;
        if (m >= valid) continue;
        const float r0 = acc[mt][4 * j + v] * gs, r1 = acc[mt][4 * j + 2 + v] * gs;
        if constexpr (GateUp) {
          const float y = gate_up_value<P>(p, e, o, r0, r1);
          const __nv_bfloat16 hy = __float2bfloat16_rn(y);
          // Permuted for the down projection's K (prefill_k_source).
          p.act[std::uint64_t(row0 + m) * p.n + prefill_permuted_column(o)] =
              *reinterpret_cast<const std::uint16_t*>(&hy);
        } else {
          float* out = p.slot_out + std::uint64_t(slot_of[m]) * p.out_rows;
          out[o] = r0;
          out[o + 8] = r1;
        }
      }
    }
  }
}

// Permuted copy (prefill_k_source) of rows whose length is a multiple of
// 128, so that 128-wide K blocks are 128-aligned in the flat array: one
// thread per 8 outputs (16 bytes).
__global__ void moe_prefill_permute_kernel(const std::uint16_t* __restrict__ in,
                                           std::uint16_t* __restrict__ out, std::uint64_t chunks) {
  grid_dependency_wait();
  allow_dependent_launch();
  const std::uint64_t i = std::uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= chunks) return;
  const std::uint64_t first = i * 8, block = first & ~std::uint64_t(kPrefillKBlock - 1);
  const std::uint32_t l0 = std::uint32_t(first & (kPrefillKBlock - 1));
  std::uint32_t v[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const std::uint32_t lo = __ldg(in + block + prefill_k_source(l0 + 2 * j));
    const std::uint32_t hi = __ldg(in + block + prefill_k_source(l0 + 2 * j + 1));
    v[j] = lo | hi << 16;
  }
  *reinterpret_cast<uint4*>(out + first) = make_uint4(v[0], v[1], v[2], v[3]);
}

}  // namespace csfmoe::moe_detail
