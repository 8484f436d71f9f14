// Token permutation per expert: the call's T*k slots sorted by expert
// (stable: slot order inside an expert), every expert padded to whole tiles
// of r.tile_rows rows, and the tile -> expert map. No host sync, no
// allocation, deterministic (the only atomics count, and counts commute).
//
// One block sorts a call of one chunk of slots (kRouteChunk), and any call
// the plan does not send to the chunked sort (MoeCallPlan::routing_chunked):
// one round of warp turns per 1024 slots, in one SM. The chunked sort spreads
// that over the GPU in two grid-wide passes: each block counts its chunk's
// slots per expert into r.chunk_counts, then each block derives the padded
// expert offsets and its chunk's place within each expert from the counts
// and scatters its chunk.
#include <cub/block/block_scan.cuh>

#include "cuda/moe/launchers.hpp"
#include "cuda/primitives/launch.cuh"

namespace csfmoe::moe_detail {

namespace {

template <typename Id>
__device__ __forceinline__ int expert_of(const Id* ids, std::uint32_t s, std::uint32_t slots,
                                         std::uint32_t experts) {
  if (s >= slots) return -1;
  const long long id = static_cast<long long>(ids[s]);
  return id >= 0 && id < experts ? int(id) : -1;
}

// Tile-padded expert offsets from per-expert row counts: one block-wide scan
// (E <= kRouteThreads); offset[E] is the padded total. Ends with a barrier.
__device__ __forceinline__ int padded_offsets(const int* count, std::uint32_t experts, int tile,
                                              int* offset) {
  using Scan = cub::BlockScan<int, kRouteThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  const int tid = threadIdx.x;
  const int padded = tid < int(experts) ? (count[tid] + tile - 1) / tile * tile : 0;
  int start = 0, run = 0;
  Scan(scan_storage).ExclusiveSum(padded, start, run);
  if (tid < int(experts)) offset[tid] = start;
  if (tid == 0) offset[experts] = run;
  __syncthreads();
  return run;
}

// The tile -> expert map and the padding rows (-1) of experts `first`,
// `first + stride`, ..., one warp per expert.
__device__ __forceinline__ void write_tiles(const int* count, const int* offset, std::uint32_t experts,
                                            int first, int stride, const Routing& r) {
  const int lane = threadIdx.x % 32, tile = int(r.tile_rows);
  for (int e = first; e < int(experts); e += stride) {
    for (int t = offset[e] / tile + lane; t < offset[e + 1] / tile; t += 32) r.tile_expert[t] = e;
    for (int p = offset[e] + count[e] + lane; p < offset[e + 1]; p += 32) r.sorted_slot[p] = -1;
  }
}

// Stable scatter of slots base .. base + blockDim.x - 1: warps take turns so
// that every slot's rank is the number of earlier slots routed to the same
// expert; cursor[e] is expert e's next free row and advances past the round.
template <typename Id>
__device__ __forceinline__ void scatter_round(const Id* ids, std::uint32_t base, std::uint32_t slots,
                                              std::uint32_t experts, int* cursor, const Routing& r) {
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const unsigned lt = (1u << lane) - 1u;
  const std::uint32_t s = base + tid;
  const int e = expert_of(ids, s, slots, experts);
  const unsigned peers = __match_any_sync(0xFFFFFFFFu, e);
  const int rank = __popc(peers & lt);
  int pos = 0;
  // Only warps holding slots of this round take a turn (block-uniform count).
  const int turns = min(int(blockDim.x / 32), int((slots - base + 31) / 32));
  for (int w = 0; w < turns; ++w) {
    if (warp == w) {
      const int c = e >= 0 ? cursor[e] : 0;
      __syncwarp();
      if (e >= 0 && rank == 0) cursor[e] = c + __popc(peers);
      pos = c + rank;
    }
    __syncthreads();
  }
  if (e >= 0) r.sorted_slot[pos] = int(s);
}

// One block: every slot of the call, in rounds of blockDim.x slots (calls of
// one chunk; the chunked passes below write the same tables with the same
// helpers).
template <typename Id>
__global__ void __launch_bounds__(kRouteThreads)
    route_block_kernel(const Id* __restrict__ ids, std::uint32_t slots, std::uint32_t experts, Routing r) {
  __shared__ int count[1024];
  __shared__ int offset[1025];
  __shared__ int cursor[1024];
  __shared__ int invalid;
  const int tid = threadIdx.x;
  // The ids come from the previous kernel, and the tables written here may
  // still be read by the previous call's down GEMM (launch.cuh).
  grid_dependency_wait();
  allow_dependent_launch();
  for (int e = tid; e < int(experts); e += blockDim.x) count[e] = 0;
  if (tid == 0) invalid = 0;
  __syncthreads();
  for (std::uint32_t s = tid; s < slots; s += blockDim.x) {
    const int e = expert_of(ids, s, slots, experts);
    if (e >= 0)
      atomicAdd(&count[e], 1);
    else
      atomicAdd(&invalid, 1);
  }
  __syncthreads();
  const int tile = int(r.tile_rows);
  const int run = padded_offsets(count, experts, tile, offset);
  if (tid == 0) {
    r.header[0] = run / tile;
    r.header[1] = invalid;
  }
  if (tid < int(experts)) cursor[tid] = offset[tid];
  write_tiles(count, offset, experts, tid / 32, int(blockDim.x / 32), r);
  __syncthreads();
  for (std::uint32_t base = 0; base < slots; base += blockDim.x)
    scatter_round(ids, base, slots, experts, cursor, r);
}

// Pass 1 of the chunked sort: block c counts chunk c's slots per expert
// (column E: ids outside [0, E)) into r.chunk_counts[c][0..E].
template <typename Id>
__global__ void __launch_bounds__(kRouteThreads)
    route_count_kernel(const Id* __restrict__ ids, std::uint32_t slots, std::uint32_t experts, Routing r) {
  __shared__ int count[1025];
  const int tid = threadIdx.x;
  grid_dependency_wait();
  allow_dependent_launch();
  for (int e = tid; e <= int(experts); e += blockDim.x) count[e] = 0;
  __syncthreads();
  const int e = expert_of(ids, blockIdx.x * kRouteChunk + tid, slots, experts);
  if (blockIdx.x * kRouteChunk + tid < slots) atomicAdd(&count[e >= 0 ? e : int(experts)], 1);
  __syncthreads();
  int* out = r.chunk_counts + std::uint64_t(blockIdx.x) * (experts + 1);
  for (int x = tid; x <= int(experts); x += blockDim.x) out[x] = count[x];
}

// Pass 2: every block sums the chunk counts (expert totals -> padded
// offsets; the chunks before its own -> where its rows start in each
// expert), writes its share of the tile map and padding, and scatters its
// chunk.
template <typename Id>
__global__ void __launch_bounds__(kRouteThreads)
    route_scatter_kernel(const Id* __restrict__ ids, std::uint32_t slots, std::uint32_t experts, Routing r) {
  __shared__ int total[1024];
  __shared__ int offset[1025];
  __shared__ int cursor[1024];
  const int tid = threadIdx.x;
  const std::uint32_t chunks = gridDim.x, chunk = blockIdx.x, stride = experts + 1;
  grid_dependency_wait();  // the counts of pass 1
  allow_dependent_launch();
  int before = 0;
  if (tid < int(experts)) {
    int sum = 0;
    for (std::uint32_t c = 0; c < chunks; ++c) {
      const int v = r.chunk_counts[std::uint64_t(c) * stride + tid];
      if (c == chunk) before = sum;
      sum += v;
    }
    total[tid] = sum;
  }
  if (tid == 0 && chunk == 0) {
    int invalid = 0;
    for (std::uint32_t c = 0; c < chunks; ++c) invalid += r.chunk_counts[std::uint64_t(c) * stride + experts];
    r.header[1] = invalid;
  }
  __syncthreads();
  const int run = padded_offsets(total, experts, int(r.tile_rows), offset);
  if (tid == 0 && chunk == 0) r.header[0] = run / int(r.tile_rows);
  if (tid < int(experts)) cursor[tid] = offset[tid] + before;
  const int warps = int(blockDim.x / 32);
  write_tiles(total, offset, experts, int(chunk) * warps + tid / 32, int(chunks) * warps, r);
  __syncthreads();
  scatter_round(ids, chunk * kRouteChunk, slots, experts, cursor, r);
}

using RouteFn = void (*)(const void*, std::uint32_t, std::uint32_t, const Routing&, bool, bool, cudaStream_t);
template <typename Id>
void route(const void* ids, std::uint32_t slots, std::uint32_t experts, const Routing& r, bool chunked,
           bool chained, cudaStream_t stream) {
  const auto* typed = static_cast<const Id*>(ids);
  if (!chunked || route_chunks(slots) == 1) {
    launch_kernel("moe routing kernel", chained, &route_block_kernel<Id>, dim3(1), dim3(kRouteThreads), 0,
                  stream, typed, slots, experts, r);
    return;
  }
  const dim3 grid(unsigned(route_chunks(slots)));
  launch_kernel("moe routing count kernel", chained, &route_count_kernel<Id>, grid, dim3(kRouteThreads), 0,
                stream, typed, slots, experts, r);
  launch_kernel("moe routing scatter kernel", chained, &route_scatter_kernel<Id>, grid, dim3(kRouteThreads),
                0, stream, typed, slots, experts, r);
}
// Dispatch table: index by IndexType.
constexpr RouteFn kRoute[2] = {&route<std::int32_t>, &route<std::int64_t>};

}  // namespace

void launch_routing(const void* ids, IndexType id_type, std::uint32_t slots, std::uint32_t experts,
                    const Routing& r, bool chunked, bool chained, cudaStream_t stream) {
  kRoute[static_cast<int>(id_type)](ids, slots, experts, r, chunked, chained, stream);
}

}  // namespace csfmoe::moe_detail
