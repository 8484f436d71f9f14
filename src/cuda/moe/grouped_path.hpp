// The grouped MoE GEMMs of one scale path (GroupedScalePaths: per-thread scale
// loads, or ring scales), each path's instantiations in its own translation
// unit (grouped_path_lane.cu, grouped_path_ring.cu) so that they compile in
// parallel; grouped_launch.cu dispatches to them.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/moe/launchers.hpp"

namespace csfmoe::moe_detail {

// Whether every instantiation of the path fits the device (shared memory,
// the register split) and lets them use their shared memory there.
template <bool RingScales>
bool configure_grouped_path(const cudaDeviceProp& prop);

template <bool RingScales>
void launch_grouped_path(ScaleFormat f, bool gate_up, std::uint32_t token_tile, const CUtensorMap& map,
                         const GemmParams& p, cudaStream_t stream);

}  // namespace csfmoe::moe_detail
