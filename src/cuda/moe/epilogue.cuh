// Gate/up epilogue: the activation that turns the gate and up projections of
// one output into the value the down projection reads. Every MoE kernel
// (tiled, decode, prefill, grouped) calls gate_up_value, so they round alike;
// the activation is the kernels' Projection template argument.
// The policies live in csfmoe/detail/activation.hpp, the one home the CPU
// reference and the Python integration share; the kernels run them in f32.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "csfmoe/detail/activation.hpp"
#include "cuda/moe/launchers.hpp"

namespace csfmoe::moe_detail {

using csfmoe::ClampedSwiglu;
using csfmoe::SiluMul;

// Output o (0..N-1) of expert e from its gate and up sums (global scale
// applied), for a gate/up instantiation P: SiLU * up, or gpt-oss's clamped
// SwiGLU after adding the expert's biases of the output's gate and up rows
// (GemmParams::bias).
template <Projection P>
__device__ __forceinline__ float gate_up_value(const GemmParams& p, int e, std::uint32_t o, float gate,
                                               float up) {
  static_assert(is_gate_up(P), "the down projection has no activation");
  if constexpr (P == Projection::gate_up_silu) {
    return SiluMul::apply(gate, up);
  } else {
    if (p.bias != nullptr) {
      const float* b = p.bias + std::uint64_t(e) * p.out_rows;
      gate += __ldg(b + p.gate_row0 + o);
      up += __ldg(b + p.up_row0 + o);
    }
    return ClampedSwiglu<float>{p.act_alpha, p.act_limit}.apply(gate, up);
  }
}

}  // namespace csfmoe::moe_detail
