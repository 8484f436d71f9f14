// The activations between an MoE layer's gate/up and down projections: one
// home for the CPU reference (float64, src/moe/reference.cpp), the GPU
// kernels' gate/up epilogue (float, src/cuda/moe/epilogue.cuh) and the Python
// integration (through the binding). Host and device code; no CUDA needed to
// include it. The gpt-oss rows come in interleaved (gate, up) pairs; the
// library takes them de-interleaved into its w13 order (gate rows, then up
// rows), as the Python integration and the checkpoint loader do.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define CSFMOE_ACT_FN __host__ __device__ __forceinline__
#else
#define CSFMOE_ACT_FN inline
#endif

namespace csfmoe {

// silu: SiLU(gate) * up. gpt_oss: gpt-oss's clamped SwiGLU with expert
// biases, (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with
// g = min(gate, limit).
enum class MoeActivation : std::uint8_t { silu = 0, gpt_oss = 1 };

// gpt-oss's parameters (transformers GptOssExperts: alpha = 1.702, limit =
// swiglu_limit = 7.0).
inline constexpr double kGptOssAlpha = 1.702;
inline constexpr double kGptOssLimit = 7.0;

// The activation of a layer and its parameters (alpha and limit: gpt_oss only).
struct MoeActivationSpec {
  MoeActivation kind = MoeActivation::silu;
  double alpha = kGptOssAlpha;
  double limit = kGptOssLimit;

  static constexpr MoeActivationSpec silu() { return {}; }
  static constexpr MoeActivationSpec gpt_oss(double alpha = kGptOssAlpha, double limit = kGptOssLimit) {
    return {MoeActivation::gpt_oss, alpha, limit};
  }
};

namespace act_detail {

CSFMOE_ACT_FN double exp_of(double x) {
#if defined(__CUDA_ARCH__)
  return ::exp(x);
#else
  return std::exp(x);
#endif
}

// x / (1 + e^-ax), the sigmoid-gated value both activations share. The
// kernels' epilogue runs it once per output: there it takes the fast
// exponent and division (ex2.approx and rcp.approx, a few ulp of f32, far
// below the bf16 rounding of the result; 0 once 1 + e^-ax exceeds 2^126),
// 6 instructions where the IEEE forms took about 20. The host rounds in
// IEEE f32 or float64.
CSFMOE_ACT_FN float sigmoid_gated(float x, float ax) {
#if defined(__CUDA_ARCH__)
  // e^-ax as 2^(-ax log2 e), flushing a subnormal power to zero: 1 + it is 1 either way.
  float power;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(power) : "f"(ax * -1.4426950408889634f));
  return __fdividef(x, 1.0f + power);
#else
  return x / (1.0f + std::exp(-ax));
#endif
}
CSFMOE_ACT_FN double sigmoid_gated(double x, double ax) { return x / (1.0 + exp_of(-ax)); }

}  // namespace act_detail

// SiLU(gate) * up = gate / (1 + e^-gate) * up. The kernels call it in f32
// (inputs already carry the global scale) and round the result to bf16 with
// round-to-nearest-even; the reference calls it in float64.
struct SiluMul {
  template <class T>
  CSFMOE_ACT_FN static T apply(T gate, T up) {
    return act_detail::sigmoid_gated(gate, gate) * up;
  }
};

// gpt-oss's clamped SwiGLU on biased gate and up (the caller adds the biases:
// they belong to the GEMM's outputs). The clamps are comparisons, not
// fmin/fmax, so a NaN input stays NaN as in torch.clamp.
template <class T>
struct ClampedSwiglu {
  T alpha = T(kGptOssAlpha);
  T limit = T(kGptOssLimit);

  CSFMOE_ACT_FN T apply(T gate, T up) const {
    gate = limit < gate ? limit : gate;
    up = limit < up ? limit : up;
    up = up < -limit ? -limit : up;
    return (up + T(1)) * act_detail::sigmoid_gated(gate, alpha * gate);
  }
};

// The layer's activation of one (gate, up) pair in T.
template <class T>
CSFMOE_ACT_FN T apply_activation(const MoeActivationSpec& spec, T gate, T up) {
  if (spec.kind == MoeActivation::gpt_oss)
    return ClampedSwiglu<T>{T(spec.alpha), T(spec.limit)}.apply(gate, up);
  return SiluMul::apply(gate, up);
}

}  // namespace csfmoe
