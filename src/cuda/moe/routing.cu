// Token permutation per expert: one block sorts the call's T*k slots by
// expert (stable: slot order inside an expert), pads every expert to whole
// tiles of r.tile_rows rows and writes the tile -> expert map. No host sync, no
// allocation, deterministic (the only atomics count, and counts commute).
#include <cub/block/block_scan.cuh>

#include "cuda/moe/launchers.hpp"
#include "cuda/primitives/launch.cuh"

namespace csfmoe::moe_detail {

namespace {

template <typename Id>
__global__ void __launch_bounds__(kRouteThreads)
    route_kernel(const Id* __restrict__ ids, std::uint32_t slots, std::uint32_t experts, Routing r) {
  __shared__ int count[1024];
  __shared__ int offset[1025];
  __shared__ int cursor[1024];
  __shared__ int invalid;
  const int tid = threadIdx.x;
  // The ids come from the previous kernel, and the tables written here may
  // still be read by the previous call's down GEMM (launch.cuh).
  grid_dependency_wait();
  allow_dependent_launch();
  for (int e = tid; e < int(experts); e += blockDim.x) count[e] = cursor[e] = 0;
  if (tid == 0) invalid = 0;
  __syncthreads();
  for (std::uint32_t s = tid; s < slots; s += blockDim.x) {
    const long long id = static_cast<long long>(ids[s]);
    if (id >= 0 && id < experts)
      atomicAdd(&count[id], 1);
    else
      atomicAdd(&invalid, 1);
  }
  __syncthreads();
  {
    // Tile-padded expert offsets: one block-wide scan (E <= kRouteThreads).
    using Scan = cub::BlockScan<int, kRouteThreads>;
    __shared__ typename Scan::TempStorage scan_storage;
    const int tile = int(r.tile_rows);
    const int padded = tid < int(experts) ? (count[tid] + tile - 1) / tile * tile : 0;
    int start = 0, run = 0;
    Scan(scan_storage).ExclusiveSum(padded, start, run);
    if (tid < int(experts)) offset[tid] = start;
    if (tid == 0) {
      offset[experts] = run;
      r.header[0] = run / tile;
      r.header[1] = invalid;
    }
  }
  __syncthreads();
  for (int e = tid; e < int(experts); e += blockDim.x) {
    for (int t = offset[e] / int(r.tile_rows); t < offset[e + 1] / int(r.tile_rows); ++t)
      r.tile_expert[t] = e;
    for (int p = offset[e] + count[e]; p < offset[e + 1]; ++p) r.sorted_slot[p] = -1;
  }
  // Stable scatter: warps take turns so that every slot's rank is the number
  // of earlier slots routed to the same expert.
  const int warp = tid / 32, lane = tid % 32;
  const unsigned lt = (1u << lane) - 1u;
  for (std::uint32_t base = 0; base < slots; base += blockDim.x) {
    const std::uint32_t s = base + tid;
    int e = -1;
    if (s < slots) {
      const long long id = static_cast<long long>(ids[s]);
      e = (id >= 0 && id < experts) ? int(id) : -1;
    }
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
    if (e >= 0) r.sorted_slot[offset[e] + pos] = int(s);
  }
}

using RouteFn = void (*)(const void*, std::uint32_t, std::uint32_t, const Routing&, bool, cudaStream_t);
template <typename Id>
void route(const void* ids, std::uint32_t slots, std::uint32_t experts, const Routing& r, bool chained,
           cudaStream_t stream) {
  launch_kernel("moe routing kernel", chained, &route_kernel<Id>, dim3(1), dim3(kRouteThreads), 0, stream,
                static_cast<const Id*>(ids), slots, experts, r);
}
// Dispatch table: index by IndexType.
constexpr RouteFn kRoute[2] = {&route<std::int32_t>, &route<std::int64_t>};

}  // namespace

void launch_routing(const void* ids, IndexType id_type, std::uint32_t slots, std::uint32_t experts,
                    const Routing& r, bool chained, cudaStream_t stream) {
  kRoute[static_cast<int>(id_type)](ids, slots, experts, r, chained, stream);
}

}  // namespace csfmoe::moe_detail
