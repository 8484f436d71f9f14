// Gate/up epilogue: the activation that turns the gate and up projections of
// one output into the value the down projection reads. Every MoE kernel
// (tiled, decode, prefill) calls the same policy, so they round alike; a new
// activation (e.g. gpt-oss's clamped SwiGLU) is another policy here.
#pragma once

#include <cuda_runtime.h>

namespace csfmoe::moe_detail {

// SiLU(gate) * up, in f32 (inputs already carry the global scale); callers
// round the result to bf16 with round-to-nearest-even.
struct SiluMul {
  __device__ __forceinline__ static float apply(float gate, float up) {
    return gate / (1.0f + expf(-gate)) * up;
  }
};

}  // namespace csfmoe::moe_detail
