// The grouped MoE GEMMs whose the producer copies the scales into the ring (grouped_path.hpp).
#include "cuda/moe/grouped_path.cuh"

namespace csfmoe::moe_detail {

template bool configure_grouped_path<true>(const cudaDeviceProp& prop);
template void launch_grouped_path<true>(ScaleFormat f, bool gate_up, std::uint32_t token_tile,
                                        const CUtensorMap& map, const GemmParams& p, cudaStream_t stream);

}  // namespace csfmoe::moe_detail
