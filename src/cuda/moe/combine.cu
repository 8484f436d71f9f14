// Weighted combine: out[t] = sum over slots j in order of w[t, j] * y[t*k + j],
// y the per-slot outputs in FP32 or bf16 (the grouped kernel's) plus the
// expert's down bias where the layer has one, summed in FP32. One thread
// owns 4 consecutive outputs of one token, so the sum order is fixed and the
// result identical run to run (no atomics).
#include <cuda_bf16.h>

#include "cuda/moe/dispatch.hpp"
#include "cuda/moe/launchers.hpp"
#include "cuda/primitives/launch.cuh"

namespace csfmoe::moe_detail {

namespace {

constexpr int kCombineThreads = 256;

// The 4 per-slot outputs at y + h, as floats.
template <bool Bf16>
__device__ __forceinline__ float4 slot_values(const CombineParams& p, std::uint64_t at) {
  if constexpr (Bf16) {
    const uint2 v = *reinterpret_cast<const uint2*>(p.slot_out16 + at);
    const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v.x));
    const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v.y));
    return make_float4(lo.x, lo.y, hi.x, hi.y);
  } else {
    return *reinterpret_cast<const float4*>(p.slot_out + at);
  }
}

// Bias: the layer has down biases (gpt_oss), a template argument so layers
// without them run the loop they ran before.
template <typename Id, bool Bf16, bool Bias>
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(CombineParams p) {
  // Not allow_dependent_launch(): the caller's next kernel, and the next
  // call's routing, start only when the combine has finished.
  grid_dependency_wait();
  const std::uint32_t t = blockIdx.x;
  const std::uint32_t h = (blockIdx.y * blockDim.x + threadIdx.x) * 4;
  if (h >= p.hidden) return;
  const Id* ids = static_cast<const Id*>(p.ids) + std::uint64_t{t} * p.topk;
  const float* wt = p.weights + std::uint64_t{t} * p.topk;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (std::uint32_t j = 0; j < p.topk; ++j) {
    const long long id = static_cast<long long>(ids[j]);
    if (id < 0 || id >= p.experts) continue;  // counted by the routing kernel
    const float w = wt[j];
    float4 y = slot_values<Bf16>(p, (std::uint64_t{t} * p.topk + j) * p.hidden + h);
    if constexpr (Bias) {
      const float4 b = __ldg(reinterpret_cast<const float4*>(p.bias + std::uint64_t(id) * p.hidden + h));
      y.x += b.x, y.y += b.y, y.z += b.z, y.w += b.w;
    }
    acc.x = fmaf(w, y.x, acc.x);
    acc.y = fmaf(w, y.y, acc.y);
    acc.z = fmaf(w, y.z, acc.z);
    acc.w = fmaf(w, y.w, acc.w);
  }
  __nv_bfloat162 lo = __floats2bfloat162_rn(acc.x, acc.y);
  __nv_bfloat162 hi = __floats2bfloat162_rn(acc.z, acc.w);
  uint2 v;
  v.x = *reinterpret_cast<unsigned*>(&lo);
  v.y = *reinterpret_cast<unsigned*>(&hi);
  *reinterpret_cast<uint2*>(p.out + std::uint64_t{t} * p.hidden + h) = v;
}

using CombineFn = void (*)(const CombineParams&, cudaStream_t);
template <typename Id>
void combine(const CombineParams& p, cudaStream_t stream) {
  const dim3 grid(p.tokens, (p.hidden / 4 + kCombineThreads - 1) / kCombineThreads);
  using Flags = ValueList<false, true>;
  (void)dispatch_value(Flags{}, p.slot_out16 != nullptr, [&]<bool Bf16>() {
    (void)dispatch_value(Flags{}, p.bias != nullptr, [&]<bool Bias>() {
      launch_kernel("moe combine kernel", p.chained, &combine_kernel<Id, Bf16, Bias>, grid,
                    dim3(kCombineThreads), 0, stream, p);
    });
  });
}
constexpr CombineFn kCombine[2] = {&combine<std::int32_t>, &combine<std::int64_t>};

}  // namespace

void launch_combine(IndexType id_type, const CombineParams& p, cudaStream_t stream) {
  if (p.tokens == 0) return;
  kCombine[static_cast<int>(id_type)](p, stream);
}

}  // namespace csfmoe::moe_detail
