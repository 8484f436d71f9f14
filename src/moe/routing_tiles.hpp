// The routing tiles every MoE GEMM reads: the T * k slots of a call sorted by
// expert and padded per expert to whole tiles of kTileM rows. Host code sizes
// the workspace and the grids with these; the routing kernel writes them.
#pragma once

#include <cstdint>

namespace csfmoe::moe_detail {

constexpr int kTileM = 64;  // rows (token slots, padded per expert) per tile

// Upper bound on the padded tiles of a call with `slots` = T * k slots.
inline std::uint64_t max_tiles(std::uint64_t slots, std::uint32_t experts) {
  return (slots + kTileM - 1) / kTileM + (slots < experts ? slots : experts);
}

// Slots per block of the routing's count and scatter kernels: calls of more
// slots than one block holds sort in two grid-wide passes (routing.cu), and
// the workspace keeps one row of E + 1 counts per chunk (the last column
// counts ids outside [0, E)).
constexpr std::uint32_t kRouteChunk = 1024;
inline std::uint64_t route_chunks(std::uint64_t slots) { return (slots + kRouteChunk - 1) / kRouteChunk; }

}  // namespace csfmoe::moe_detail
