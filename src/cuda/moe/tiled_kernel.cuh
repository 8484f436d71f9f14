// Grouped W4A16 GEMM of the fused MoE layer (correct-first version).
//
// One block computes a tile of kTileM sorted rows (one expert) by kTileN
// output rows; for gate/up it computes the matching gate and up rows together
// and applies SiLU(gate) * up in the epilogue. Each K slice of kTileK:
//   1. activations (bf16) gathered into shared memory,
//   2. the slice's block-scale bytes placed in shared memory by the
//      ScaleKind policy (dense read, or CSF base + offset + exceptions),
//   3. FP4 weights dequantized with those scales to bf16 in shared memory,
//   4. bf16 tensor-core MMA (wmma 16x16x16), FP32 accumulation.
// Only step 2 differs between scale modes, so every mode computes the same
// bits. The FP32 global scale multiplies the accumulator once per output.
#pragma once

#include <cuda_bf16.h>
#include <mma.h>

#include "cuda/moe/epilogue.cuh"
#include "cuda/moe/launchers.hpp"
#include "cuda/moe/scale_read.cuh"
#include "cuda/primitives/launch.cuh"

namespace csfmoe::moe_detail {

constexpr int kLds = kTileK + 8;  // bf16 row pitch in shared memory (bank spread)
constexpr int kLdc = kTileN + 4;  // f32 row pitch of the epilogue staging

template <bool GateUp>
struct TileRows {
  static constexpr int kRows = GateUp ? 2 * kTileN : kTileN;  // weight rows per block
};

template <ScaleFormat F, ScaleKind K, bool GateUp>
struct SharedMain {
  static constexpr int kRows = TileRows<GateUp>::kRows;
  static constexpr int kGroups = kTileK / int(group_size(F));
  __nv_bfloat16 a[kTileM][kLds];
  __nv_bfloat16 b[kRows][kLds];
  std::uint8_t sc[kRows][kGroups];
  std::uint32_t cur[kRows];  // next exception record of each weight row (csf)
  std::uint32_t end[kRows];
  int arow[kTileM];  // source row of each A row (-1: padding)
};
template <bool GateUp>
struct SharedEpi {
  float c[GateUp ? 2 : 1][kTileM][kLdc];
};

template <ScaleFormat F, ScaleKind K, Projection P>
__global__ void __launch_bounds__(kGemmThreads) moe_gemm_kernel(GemmParams p) {
  constexpr bool GateUp = is_gate_up(P);
  using namespace nvcuda;
  using Main = SharedMain<F, K, GateUp>;
  constexpr int kRows = Main::kRows;
  constexpr int kGroups = Main::kGroups;
  constexpr int kG = int(group_size(F));
  constexpr int kHalves = GateUp ? 2 : 1;
  constexpr std::size_t kSmem =
      sizeof(Main) > sizeof(SharedEpi<GateUp>) ? sizeof(Main) : sizeof(SharedEpi<GateUp>);
  __shared__ __align__(128) unsigned char smem_raw[kSmem];
  Main& sm = *reinterpret_cast<Main*>(smem_raw);
  SharedEpi<GateUp>& se = *reinterpret_cast<SharedEpi<GateUp>*>(smem_raw);

  grid_dependency_wait();
  allow_dependent_launch();
  const int tile = blockIdx.x;
  if (tile >= p.header[0]) return;
  const int e = p.tile_expert[tile];
  const std::uint32_t row0 = std::uint32_t(tile) * kTileM;
  const std::uint32_t n0 = blockIdx.y * kTileN;
  const int tid = threadIdx.x;

  // Weight row of block row r.
  const auto wrow = [&](int r) -> std::uint32_t {
    if constexpr (GateUp)
      return r < kTileN ? p.gate_row0 + n0 + r : p.up_row0 + n0 + (r - kTileN);
    else
      return n0 + r;
  };

  for (int m = tid; m < kTileM; m += kGemmThreads) {
    const int slot = p.sorted_slot[row0 + m];
    if constexpr (GateUp)
      sm.arow[m] = slot >= 0 ? slot / int(p.topk) : -1;
    else
      sm.arow[m] = slot >= 0 ? int(row0 + m) : -1;
  }
  if constexpr (K == ScaleKind::csf) {
    for (int r = tid; r < kRows; r += kGemmThreads) {
      const std::uint64_t pr = std::uint64_t(e) * p.scales.layout.padded_rows + wrow(r);
      sm.cur[r] = p.scales.row_prefix[pr];
      sm.end[r] = p.scales.row_prefix[pr + 1];
    }
  }
  __syncthreads();

  const int warp = tid / 32;
  const int wm = (warp / 2) * 32, wn = (warp % 2) * 32;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kHalves][2][2];
#pragma unroll
  for (int h = 0; h < kHalves; ++h)
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[h][i][j], 0.0f);

  const std::uint8_t* w_e = p.w + std::uint64_t(e) * p.out_rows * (p.k / 2);
  for (std::uint32_t k0 = 0; k0 < p.k; k0 += kTileK) {
    // 1. activations: 64 rows x 8 chunks of 16 bytes.
    for (int idx = tid; idx < kTileM * (kTileK / 8); idx += kGemmThreads) {
      const int m = idx / (kTileK / 8), c = idx % (kTileK / 8);
      uint4 v = make_uint4(0, 0, 0, 0);
      const int src = sm.arow[m];
      if (src >= 0) v = *reinterpret_cast<const uint4*>(p.a + std::uint64_t(src) * p.k + k0 + c * 8);
      *reinterpret_cast<uint4*>(&sm.a[m][c * 8]) = v;
    }
    // 2. scale bytes of this K slice.
    const std::uint32_t g0 = k0 / kG;
    for (int idx = tid; idx < kRows * kGroups; idx += kGemmThreads) {
      const int r = idx / kGroups, q = idx % kGroups;
      if constexpr (K == ScaleKind::csf)
        sm.sc[r][q] = csf_fixed_scale<F>(p.scales, e, wrow(r), g0 + q);
      else
        sm.sc[r][q] = dense_scale<K>(p.scales, e, wrow(r), g0 + q);
    }
    if constexpr (K == ScaleKind::csf) {
      __syncthreads();
      // Records of a row are sorted by column: consume those of this slice.
      for (int r = tid; r < kRows; r += kGemmThreads) {
        const std::uint32_t first = p.scales.layout.position(wrow(r), 0);
        std::uint32_t c = sm.cur[r];
        const std::uint32_t end = sm.end[r];
        while (c < end) {
          const std::uint32_t rec = p.scales.exceptions[c];
          const std::uint32_t col = csf::record_position(rec) - first;
          if (col >= g0 + kGroups) break;
          sm.sc[r][col - g0] = csf::record_value(rec);
          ++c;
        }
        sm.cur[r] = c;
      }
    }
    __syncthreads();
    // 3. dequantize: each task is 32 consecutive K elements (16 bytes) of one row.
    for (int idx = tid; idx < kRows * 2; idx += kGemmThreads) {
      const int r = idx / 2, half = idx % 2;
      const uint4 q =
          *reinterpret_cast<const uint4*>(w_e + std::uint64_t(wrow(r)) * (p.k / 2) + k0 / 2 + half * 16);
      const std::uint32_t words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int wi = 0; wi < 4; ++wi) {
#pragma unroll
        for (int bi = 0; bi < 4; ++bi) {
          const std::uint32_t byte = (words[wi] >> (8 * bi)) & 0xFFu;
          const int kl = half * 32 + (wi * 4 + bi) * 2;
          const float s = scale_to_float<F>(sm.sc[r][kl / kG]);
          const float v0 = e2m1_bits_to_float(byte & 0xFu) * s;
          const float v1 = e2m1_bits_to_float(byte >> 4) * s;
          *reinterpret_cast<__nv_bfloat162*>(&sm.b[r][kl]) = __floats2bfloat162_rn(v0, v1);
        }
      }
    }
    __syncthreads();
    // 4. tensor-core MMA.
#pragma unroll
    for (int kk = 0; kk < kTileK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(fa[i], &sm.a[wm + i * 16][kk], kLds);
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
          wmma::load_matrix_sync(fb, &sm.b[h * kTileN + wn + j * 16][kk], kLds);
#pragma unroll
          for (int i = 0; i < 2; ++i) wmma::mma_sync(acc[h][i][j], fa[i], fb, acc[h][i][j]);
        }
      }
    }
    __syncthreads();
  }

  // Epilogue: stage the accumulators (the main buffers are dead now).
#pragma unroll
  for (int h = 0; h < kHalves; ++h)
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j)
        wmma::store_matrix_sync(&se.c[h][wm + i * 16][wn + j * 16], acc[h][i][j], kLdc, wmma::mem_row_major);
  __syncthreads();
  const float gs = p.global ? p.global[e] : 1.0f;
  if constexpr (GateUp) {
    for (int idx = tid; idx < kTileM * (kTileN / 2); idx += kGemmThreads) {
      const int m = idx / (kTileN / 2), n = (idx % (kTileN / 2)) * 2;
      float out[2];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const float g = se.c[0][m][n + u] * gs;
        const float up = se.c[1][m][n + u] * gs;
        out[u] = gate_up_value<P>(p, e, n0 + n + u, g, up);
      }
      *reinterpret_cast<__nv_bfloat162*>(p.act + std::uint64_t(row0 + m) * p.n + n0 + n) =
          __floats2bfloat162_rn(out[0], out[1]);
    }
  } else {
    for (int idx = tid; idx < kTileM * (kTileN / 4); idx += kGemmThreads) {
      const int m = idx / (kTileN / 4), n = (idx % (kTileN / 4)) * 4;
      const int slot = p.sorted_slot[row0 + m];
      if (slot < 0) continue;
      const float4 v = make_float4(se.c[0][m][n] * gs, se.c[0][m][n + 1] * gs, se.c[0][m][n + 2] * gs,
                                   se.c[0][m][n + 3] * gs);
      *reinterpret_cast<float4*>(p.slot_out + std::uint64_t(slot) * p.out_rows + n0 + n) = v;
    }
  }
}

}  // namespace csfmoe::moe_detail
