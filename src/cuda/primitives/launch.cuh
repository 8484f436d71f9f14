// Kernel launches of the MoE layer, chained by programmatic dependent launch
// (PDL, sm_90): a kernel launched `chained` may start while the previous
// kernel of its stream is still running, so its launch latency and the
// work that needs nothing from that kernel (the down GEMM's weight stream)
// overlap the previous kernel's tail.
//
// The protocol every kernel of the layer follows:
//   * grid_dependency_wait() before it reads anything the previous kernel
//     writes, or writes anything a running kernel may still read; before the
//     wait it may read only data that was complete when the previous kernel
//     passed its own wait (weights, scales, a routing two launches back);
//   * allow_dependent_launch() only after its own wait, so that a kernel
//     started early never finds an earlier kernel still running.
// Both are no-ops for a launch that is not chained (and below sm_90).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>
#include <utility>

#include "cuda/primitives/cuda_check.hpp"

namespace csfmoe::moe_detail {

__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Launches kernel<<<grid, block, smem, stream>>>(args...), as a programmatic
// dependent of the stream's previous kernel when `chained`; throws CudaError
// naming `what` and the CUDA error when the launch fails.
template <typename... Params, typename... Args>
void launch_kernel(const char* what, bool chained, void (*kernel)(Params...), dim3 grid, dim3 block,
                   std::size_t smem, cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = chained ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear the error so later calls do not report it again
    cuda_detail::throw_cuda_error(err, std::string(what) + ": launch", __FILE__, __LINE__);
  }
}

}  // namespace csfmoe::moe_detail
