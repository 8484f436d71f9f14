// Internal interface between the MoE host code (layer.cpp) and the kernel
// families (routing.cu, tiled_launch.cu, decode_launch.cu, prefill_launch.cu,
// combine.cu). Launchers take checked arguments and the call plan's decisions
// (GemmParams::decode); each family dispatches through dispatch.hpp.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "csfmoe/call_plan.hpp"
#include "csfmoe/detail/activation.hpp"
#include "csfmoe/device_codec.hpp"
#include "csfmoe/formats.hpp"
#include "moe/routing_tiles.hpp"

namespace csfmoe::moe_detail {

constexpr int kTileN = 64;  // output rows of the weight per tile
constexpr int kTileK = 64;  // K slice
constexpr int kGemmThreads = 128;
constexpr int kRouteThreads = 1024;
static_assert(kRouteChunk == kRouteThreads, "a scatter block ranks its chunk in one round");

// Token permutation written by the routing kernel, in tiles of `tile_rows`
// sorted rows (kTileM for the decode, tiled and prefill kernels, the call's
// token tile for the grouped kernel).
struct Routing {
  int* header = nullptr;        // [0] tiles in use, [1] ids outside [0, E)
  int* tile_expert = nullptr;   // [routed_tiles] expert of each tile
  int* sorted_slot = nullptr;   // [routed_tiles * tile_rows] slot t*k+j per sorted row, -1 = padding
  int* chunk_counts = nullptr;  // [route_chunks(slots)][E + 1] scratch of calls above one chunk
  std::uint32_t tile_rows = kTileM;
};

// `chained`: launched as a programmatic dependent of the stream's previous
// kernel (launch.cuh), as every launch below can be. `chunked`: two
// grid-wide passes over chunks of kRouteChunk slots (r.chunk_counts), where
// the call has more than one chunk; else one block.
void launch_routing(const void* ids, IndexType id_type, std::uint32_t slots, std::uint32_t experts,
                    const Routing& r, bool chunked, bool chained, cudaStream_t stream);

// Where one projection's scale bytes come from.
enum class ScaleKind : int { dense_row_major = 0, dense_swizzled = 1, csf = 2 };
struct ScaleSource {
  ScaleKind kind = ScaleKind::dense_row_major;
  // dense: byte (e, row, col) at dense[e * expert_stride + row * cols + col]
  // (row-major) or dense[e * expert_stride + swizzled_index(row, col, cols)].
  const std::uint8_t* dense = nullptr;
  std::uint64_t expert_stride = 0;
  std::uint32_t cols = 0;
  // csf: fixed-part slabs and exception records, addressed through the
  // layout (csfmoe/detail/csf_layout.hpp).
  const std::uint8_t* fixed = nullptr;
  const std::uint32_t* exceptions = nullptr;
  const std::uint32_t* row_prefix = nullptr;
  csf::LayoutView layout;
  // csf, optional: the stage-read index (stage_read_index.hpp); decode row
  // block b of expert e at index + (e * index_blocks_per_expert + b) *
  // index_block_bytes. Null: the decode kernel sorts the records per block.
  const std::uint8_t* index = nullptr;
  std::uint32_t index_capacity = 0, index_block_bytes = 0, index_blocks_per_expert = 0;
};

struct GemmParams {
  const int* header = nullptr;
  const int* tile_expert = nullptr;
  const int* sorted_slot = nullptr;
  std::uint32_t max_tiles = 0;       // grid size along tiles
  std::uint32_t sm_count = 0;        // of the device (the call plan sized the decode blocks from it)
  const std::uint16_t* a = nullptr;  // bf16: hidden [T, K] (gate/up) or act [rows, K] (down)
  std::uint32_t topk = 1;            // slot -> token divisor (gate/up)
  const std::uint8_t* w = nullptr;   // [E, out_rows, K/2]
  std::uint32_t k = 0;               // K
  std::uint32_t out_rows = 0;        // rows of one expert's weight (2N or H)
  ScaleSource scales;
  const float* global = nullptr;  // [E] or nullptr (unit)
  // gate/up: N outputs per half, act [rows, N] bf16; gate rows start at gate_row0.
  std::uint32_t n = 0;
  std::uint32_t gate_row0 = 0, up_row0 = 0;
  std::uint16_t* act = nullptr;
  // down: per-slot outputs [T * k, H] f32, or bf16 where slot_out16 is set
  // (grouped kernel).
  float* slot_out = nullptr;
  std::uint16_t* slot_out16 = nullptr;
  bool chained = false;  // programmatic dependent launch (launch.cuh)
  // Decode kernel: row blocks each block streams in turn (its launcher copies
  // decode.row_block_run here).
  std::uint32_t row_block_run = 1;
  // Decode kernel: the block shape the call plan chose (plan_call).
  MoeDecodeShape decode;
  // Grouped kernel: tiles per raster group of its work list (grouped_item).
  std::uint32_t tile_group = 1;
  // gate/up: the layer's activation, which picks the kernel's Projection
  // (dispatch_projection); gpt_oss first adds bias [E, out_rows] (FP32, w13
  // row order; null: none) to the gate and up rows (epilogue.cuh). Last in
  // the struct, so the fields above keep their offsets.
  MoeActivation activation = MoeActivation::silu;
  float act_alpha = 0.0f, act_limit = 0.0f;
  const float* bias = nullptr;
};

// What a GEMM kernel instantiation computes: the down projection, or gate/up
// with the epilogue of one activation (gate_up_value). A template axis, so
// each activation's epilogue is compiled on its own and SiLU layers run the
// code they ran before gpt-oss's was added.
enum class Projection : std::uint8_t { down = 0, gate_up_silu = 1, gate_up_gpt_oss = 2 };
constexpr bool is_gate_up(Projection p) { return p != Projection::down; }
constexpr Projection projection_of(bool gate_up, MoeActivation activation) {
  if (!gate_up) return Projection::down;
  return activation == MoeActivation::gpt_oss ? Projection::gate_up_gpt_oss : Projection::gate_up_silu;
}

// Which GEMM kernel runs a call: the tiled kernel (tiled_kernel.cuh), the
// weight-streaming decode kernel (decode_kernel.cuh) with token passes of 8, 16
// or 32, the Hopper wgmma prefill kernel (prefill_kernel.cuh) or the grouped
// one (grouped_kernel.cuh, launched through launch_grouped).
enum class GemmPath : int { tiled = 0, decode_8 = 1, decode_16 = 2, decode_32 = 3, prefill = 4 };

void launch_gate_up(ScaleFormat f, GemmPath path, const GemmParams& p, cudaStream_t stream);
void launch_down(ScaleFormat f, GemmPath path, const GemmParams& p, cudaStream_t stream);

// Decode kernels: usable where decode_possible (moe/call_plan.hpp);
// configure_decode_kernels lets every instantiation use `smem_bytes` of
// dynamic shared memory on the current device.
void configure_decode_kernels(std::uint32_t smem_bytes);
void launch_decode(ScaleFormat f, bool gate_up, GemmPath path, const GemmParams& p, cudaStream_t stream);

// Prefill kernels: H a multiple of 256 and N of 128, dense scales only (not
// stage-read CSF), on sm_90. configure_prefill_kernels returns whether the
// device runs them (and lets them use their shared memory there). Their
// activations are K-permuted (prefill_k_source): launch_prefill_permute
// writes the permuted copy of the hidden rows for gate/up, whose epilogue
// writes act permuted for down.
// prefill_shape_ok is in moe/call_plan.hpp.
bool configure_prefill_kernels(int device);
void launch_prefill_permute(const std::uint16_t* in, std::uint16_t* out, std::uint32_t rows, std::uint32_t k,
                            bool chained, cudaStream_t stream);
void launch_prefill(ScaleFormat f, bool gate_up, const GemmParams& p, cudaStream_t stream);

// Grouped kernels: H a multiple of 256 and N of 128, dense scales only, on
// sm_90 with a driver that encodes tensor maps. configure_grouped_kernels
// returns whether the device runs them (and lets them use their shared
// memory there). They read the prefill kernel's K-permuted activations; the
// routing must be in tiles of `token_tile` rows, act is indexed by slot
// (t * k + j) and gate/up writes it K-permuted for down. The grid is one
// persistent CTA per SM (p.sm_count). ring_scales: the producer copies the
// block scales into the ring (MoeBindOptions::grouped_ring_scales).
bool configure_grouped_kernels(int device);
void launch_grouped(ScaleFormat f, bool gate_up, std::uint32_t token_tile, bool ring_scales,
                    std::uint32_t experts, const GemmParams& p, cudaStream_t stream);

struct CombineParams {
  const float* slot_out = nullptr;            // per-slot outputs, f32 ...
  const std::uint16_t* slot_out16 = nullptr;  // ... or bf16 where set
  const void* ids = nullptr;
  const float* weights = nullptr;
  std::uint16_t* out = nullptr;  // bf16 [T, H]
  std::uint32_t tokens = 0, topk = 0, hidden = 0, experts = 0;
  bool chained = false;  // programmatic dependent launch (launch.cuh)
  // Down-projection bias [E, H] (FP32, gpt_oss layers; null: none): slot j
  // of token t adds bias[id] to its output before the weighting.
  const float* bias = nullptr;
};
void launch_combine(IndexType id_type, const CombineParams& p, cudaStream_t stream);

}  // namespace csfmoe::moe_detail
