// Gate/up epilogue: the activation that turns the gate and up projections of
// one output into the value the down projection reads. Every MoE kernel
// (tiled, decode, prefill, grouped) calls the same policy, so they round
// alike. The policies live in csfmoe/detail/activation.hpp, the one home the
// CPU reference and the Python integration share; the kernels run SiluMul in
// f32. ClampedSwiglu (gpt-oss) has no kernel instantiation yet: layers with
// that activation are refused before any launch (docs/moe-api.md).
#pragma once

#include <cuda_runtime.h>

#include "csfmoe/detail/activation.hpp"

namespace csfmoe::moe_detail {

using csfmoe::ClampedSwiglu;
using csfmoe::SiluMul;

}  // namespace csfmoe::moe_detail
