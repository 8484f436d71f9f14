// The MoE routing kernels (src/cuda/moe/routing.cu) against a CPU counting
// sort: the one-block sort (any size) and the two grid-wide passes (above
// one chunk of slots) must write the same tables, slot for slot (stable order
// inside each expert, padding rows -1, the tile -> expert map, the tile and
// invalid-id counts), for both id types, every tile size the GEMMs use,
// uniform and skewed routing and ids outside [0, E).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/moe/launchers.hpp"
#include "moe/grouped_shape.hpp"
#include "moe/routing_tiles.hpp"
#include "test_gpu.hpp"
#include "test_seed.hpp"

namespace csfmoe {
namespace {

using testing::check;

struct Expected {
  int tiles = 0, invalid = 0;
  std::vector<int> tile_expert, sorted_slot;
};

// Stable counting sort of the slots by expert, each expert padded to whole
// tiles of `tile` rows.
Expected sort_on_cpu(const std::vector<std::int64_t>& ids, std::uint32_t experts, int tile) {
  Expected x;
  std::vector<int> count(experts, 0);
  for (const std::int64_t id : ids) {
    if (id >= 0 && id < experts)
      ++count[std::size_t(id)];
    else
      ++x.invalid;
  }
  for (std::uint32_t e = 0; e < experts; ++e) {
    const int first = int(x.sorted_slot.size());
    for (std::size_t s = 0; s < ids.size(); ++s)
      if (ids[s] == std::int64_t(e)) x.sorted_slot.push_back(int(s));
    const int padded = (count[e] + tile - 1) / tile * tile;
    x.sorted_slot.resize(std::size_t(first + padded), -1);
    for (int t = 0; t < padded / tile; ++t) x.tile_expert.push_back(int(e));
  }
  x.tiles = int(x.tile_expert.size());
  return x;
}

struct Case {
  std::uint32_t slots, experts;
  int tile;
  bool skewed, invalid_ids;
};

template <typename Id>
void run_case(const Case& c, std::mt19937_64& rng, bool chunked, bool chained) {
  std::vector<std::int64_t> ids(c.slots);
  std::uniform_int_distribution<std::uint32_t> any(0, c.experts - 1);
  const std::uint32_t hot = any(rng);
  for (auto& id : ids) {
    id = c.skewed && rng() % 4 != 0 ? hot : any(rng);
    if (c.invalid_ids && rng() % 16 == 0)
      id = rng() % 2 ? -1 - std::int64_t(rng() % 5) : c.experts + rng() % 7;
  }
  const Expected want = sort_on_cpu(ids, c.experts, c.tile);

  const std::vector<Id> typed(ids.begin(), ids.end());
  const std::uint64_t tiles_cap = moe_detail::routed_tiles(c.slots, c.experts, std::uint32_t(c.tile));
  const std::uint64_t counts = moe_detail::route_chunks(c.slots) * (c.experts + 1);
  void *d_ids, *d_header, *d_tiles, *d_sorted, *d_counts;
  check(cudaMalloc(&d_ids, typed.size() * sizeof(Id)), "malloc ids");
  check(cudaMalloc(&d_header, 16), "malloc header");
  check(cudaMalloc(&d_tiles, tiles_cap * 4), "malloc tiles");
  check(cudaMalloc(&d_sorted, tiles_cap * c.tile * 4), "malloc sorted");
  check(cudaMalloc(&d_counts, counts * 4), "malloc counts");
  check(cudaMemcpy(d_ids, typed.data(), typed.size() * sizeof(Id), cudaMemcpyHostToDevice), "upload ids");
  // Poison: every table entry the kernels must write reads back as this.
  check(cudaMemset(d_header, 0x5A, 16), "poison");
  check(cudaMemset(d_tiles, 0x5A, tiles_cap * 4), "poison");
  check(cudaMemset(d_sorted, 0x5A, tiles_cap * c.tile * 4), "poison");
  check(cudaMemset(d_counts, 0x5A, counts * 4), "poison");

  moe_detail::Routing r;
  r.header = static_cast<int*>(d_header);
  r.tile_expert = static_cast<int*>(d_tiles);
  r.sorted_slot = static_cast<int*>(d_sorted);
  r.chunk_counts = static_cast<int*>(d_counts);
  r.tile_rows = std::uint32_t(c.tile);
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  moe_detail::launch_routing(d_ids, sizeof(Id) == 8 ? IndexType::int64 : IndexType::int32, c.slots, c.experts,
                             r, chunked, chained, stream);
  check(cudaStreamSynchronize(stream), "routing");
  check(cudaStreamDestroy(stream), "stream");

  int header[2];
  check(cudaMemcpy(header, d_header, 8, cudaMemcpyDeviceToHost), "download header");
  const std::string what = "slots " + std::to_string(c.slots) + ", experts " + std::to_string(c.experts) +
                           ", tile " + std::to_string(c.tile) + (c.skewed ? ", skewed" : "") +
                           (c.invalid_ids ? ", invalid ids" : "") + ", id bytes " +
                           std::to_string(sizeof(Id));
  ASSERT_EQ(header[0], want.tiles) << what;
  ASSERT_EQ(header[1], want.invalid) << what;
  std::vector<int> tiles(std::size_t(want.tiles)), sorted(want.sorted_slot.size());
  check(cudaMemcpy(tiles.data(), d_tiles, tiles.size() * 4, cudaMemcpyDeviceToHost), "download tiles");
  check(cudaMemcpy(sorted.data(), d_sorted, sorted.size() * 4, cudaMemcpyDeviceToHost), "download sorted");
  EXPECT_EQ(tiles, want.tile_expert) << what;
  EXPECT_EQ(sorted, want.sorted_slot) << what;
  for (void* p : {d_ids, d_header, d_tiles, d_sorted, d_counts}) check(cudaFree(p), "free");
}

TEST(GpuRouting, ChunkedAndOneBlockSortsEqualTheCpuSort) {
  REQUIRE_GPU();
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const std::uint32_t chunk = moe_detail::kRouteChunk;
  // Around the one-block / chunked boundary, a partial last chunk, and
  // prefill sizes (T = 8192, k = 8 is 65536 slots).
  const std::uint32_t sizes[] = {1,     7,        chunk - 1, chunk, chunk + 1, 2 * chunk, 3 * chunk + 17,
                                 33000, 65536 + 5};
  const std::uint32_t expert_counts[] = {1, 3, 128, 256, std::uint32_t(MoePlan::kMaxExperts)};
  const int tiles[] = {moe_detail::kTileM, 16, 24, 80, 128};
  int n = 0;
  for (const std::uint32_t slots : sizes)
    for (const std::uint32_t experts : expert_counts) {
      const Case c{slots, experts, tiles[rng() % std::size(tiles)], rng() % 3 == 0, rng() % 3 == 0};
      for (const bool chunked : {false, true}) {
        if (n++ % 2 == 0)
          run_case<std::int64_t>(c, rng, chunked, n % 4 == 1);
        else
          run_case<std::int32_t>(c, rng, chunked, n % 4 == 0);
        if (HasFatalFailure()) return;
      }
    }
}

}  // namespace
}  // namespace csfmoe
