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

}  // namespace csfmoe::moe_detail
