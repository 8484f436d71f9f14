// Instantiations and dispatch of the grouped MoE GEMMs of one scale path
// (grouped_path.hpp), included by that path's translation unit.
#pragma once

#include <string>

#include "cuda/moe/dispatch.hpp"
#include "cuda/moe/grouped_kernel.cuh"
#include "cuda/moe/grouped_path.hpp"
#include "cuda/primitives/cuda_check.hpp"
#include "cuda/primitives/launch.cuh"

namespace csfmoe::moe_detail {

template <ScaleFormat F, ScaleKind K, Projection P, int NT, bool R>
void grouped_launch(const CUtensorMap& map, const GemmParams& p, cudaStream_t stream) {
  launch_kernel("moe grouped GEMM", p.chained, &moe_grouped_kernel<F, K, P, NT, R>, dim3(p.sm_count),
                dim3(grouped_consumers(NT).threads), grouped_path_smem(NT, F == ScaleFormat::nvfp4, R).total,
                stream, map, p);
}

template <bool R>
bool configure_grouped_path(const cudaDeviceProp& prop) {
  bool fits = true;
  for_each_value(ScaleFormats{}, [&]<ScaleFormat F>() {
    for_each_value(GroupedTokenTiles{}, [&]<int NT>() {
      fits = fits && prop.sharedMemPerBlockOptin >= grouped_path_smem(NT, F == ScaleFormat::nvfp4, R).total;
    });
  });
  if (!fits) return false;
  for_each_value(ScaleFormats{}, [&]<ScaleFormat F>() {
    for_each_value(DenseScaleKinds{}, [&]<ScaleKind K>() {
      for_each_value(Projections{}, [&]<Projection P>() {
        for_each_value(GroupedTokenTiles{}, [&]<int NT>() {
          // setmaxnreg.inc waits until the registers are free in the pool the
          // CTA got at launch: a split beyond it would hang, so such a build
          // leaves the grouped kernels unused.
          cudaFuncAttributes attr{};
          CSFMOE_CUDA_CHECK_WHAT(cudaFuncGetAttributes(&attr, &moe_grouped_kernel<F, K, P, NT, R>),
                                 "read the grouped MoE kernels' attributes");
          constexpr GroupedConsumers c = grouped_consumers(NT);
          fits = fits && 128 * c.producer_regs + 128 * c.groups * c.consumer_regs <= c.threads * attr.numRegs;
          constexpr std::uint32_t smem = grouped_path_smem(NT, F == ScaleFormat::nvfp4, R).total;
          CSFMOE_CUDA_CHECK_WHAT(
              cudaFuncSetAttribute(&moe_grouped_kernel<F, K, P, NT, R>,
                                   cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
              "configure the grouped MoE kernels (" + std::to_string(smem) + " bytes of shared memory)");
        });
      });
    });
  });
  return fits;
}

template <bool R>
void launch_grouped_path(ScaleFormat f, bool gate_up, std::uint32_t token_tile, const CUtensorMap& map,
                         const GemmParams& p, cudaStream_t stream) {
  dispatch_format(f, [&]<ScaleFormat F>() {
    dispatch_dense_scale_kind(p.scales.kind, [&]<ScaleKind K>() {
      dispatch_projection(gate_up, p.activation, [&]<Projection P>() {
        dispatch_token_tile(token_tile, [&]<int NT>() { grouped_launch<F, K, P, NT, R>(map, p, stream); });
      });
    });
  });
}

}  // namespace csfmoe::moe_detail
