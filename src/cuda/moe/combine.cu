// Weighted combine: out[t] = sum over slots j in order of w[t, j] * y[t*k + j],
// y the per-slot outputs in FP32 or bf16 (the grouped kernel's) plus the
// expert's down bias where the layer has one, summed in FP32. One thread
// owns 8 (bf16 slots) or 4 (FP32 slots) consecutive outputs of one token, a
// 16-byte load per slot, so the sum order is fixed and the result identical
// run to run (no atomics).
#include <cuda_bf16.h>

#include "csfmoe/moe.hpp"
#include "cuda/moe/dispatch.hpp"
#include "cuda/moe/launchers.hpp"
#include "cuda/primitives/launch.cuh"

namespace csfmoe::moe_detail {

namespace {

constexpr int kCombineThreads = 256;
// Slots whose loads a thread has in flight at once.
constexpr int kCombineBatch = 4;
// Outputs per thread: one 16-byte load per slot.
template <bool Bf16>
constexpr int kCombineWidth = Bf16 ? 8 : 4;
static_assert(MoePlan::kTile % kCombineWidth<true> == 0, "a thread's outputs never cross the hidden size");

// The per-slot outputs at y + h, as floats.
template <bool Bf16>
__device__ __forceinline__ void slot_values(const CombineParams& p, std::uint64_t at,
                                            float (&y)[kCombineWidth<Bf16>]) {
  if constexpr (Bf16) {
    const uint4 v = *reinterpret_cast<const uint4*>(p.slot_out16 + at);
    const std::uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[i]));
      y[2 * i] = f.x, y[2 * i + 1] = f.y;
    }
  } else {
    const float4 v = *reinterpret_cast<const float4*>(p.slot_out + at);
    y[0] = v.x, y[1] = v.y, y[2] = v.z, y[3] = v.w;
  }
}

// Bias: the layer has down biases (gpt_oss), a template argument so layers
// without them run the loop they ran before.
template <typename Id, bool Bf16, bool Bias>
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(CombineParams p) {
  constexpr int V = kCombineWidth<Bf16>;
  // Not allow_dependent_launch(): the caller's next kernel, and the next
  // call's routing, start only when the combine has finished.
  grid_dependency_wait();
  const std::uint32_t t = blockIdx.x;
  const std::uint32_t h = (blockIdx.y * blockDim.x + threadIdx.x) * V;
  if (h >= p.hidden) return;
  const Id* ids = static_cast<const Id*>(p.ids) + std::uint64_t{t} * p.topk;
  const float* wt = p.weights + std::uint64_t{t} * p.topk;
  float acc[V];
#pragma unroll
  for (int v = 0; v < V; ++v) acc[v] = 0.0f;
  // A batch of slots is loaded before any is summed, so their reads overlap;
  // the sum still runs in slot order (the same FMAs as one slot at a time).
  for (std::uint32_t j0 = 0; j0 < p.topk; j0 += kCombineBatch) {
    float y[kCombineBatch][V], w[kCombineBatch];
    long long id[kCombineBatch];
#pragma unroll
    for (int b = 0; b < kCombineBatch; ++b) {
      const std::uint32_t j = j0 + b;
      id[b] = j < p.topk ? static_cast<long long>(ids[j]) : -1;
      if (id[b] < 0 || id[b] >= p.experts) continue;  // counted by the routing kernel
      w[b] = wt[j];
      slot_values<Bf16>(p, (std::uint64_t{t} * p.topk + j) * p.hidden + h, y[b]);
    }
#pragma unroll
    for (int b = 0; b < kCombineBatch; ++b) {
      if (id[b] < 0 || id[b] >= p.experts) continue;
      if constexpr (Bias) {
        const float* bias = p.bias + std::uint64_t(id[b]) * p.hidden + h;
#pragma unroll
        for (int v = 0; v < V; v += 4) {
          const float4 c = __ldg(reinterpret_cast<const float4*>(bias + v));
          y[b][v] += c.x, y[b][v + 1] += c.y, y[b][v + 2] += c.z, y[b][v + 3] += c.w;
        }
      }
#pragma unroll
      for (int v = 0; v < V; ++v) acc[v] = fmaf(w[b], y[b][v], acc[v]);
    }
  }
  std::uint32_t packed[V / 2];
#pragma unroll
  for (int i = 0; i < V / 2; ++i) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
    packed[i] = *reinterpret_cast<const std::uint32_t*>(&pair);
  }
  if constexpr (V == 8)
    *reinterpret_cast<uint4*>(p.out + std::uint64_t{t} * p.hidden + h) =
        make_uint4(packed[0], packed[1], packed[2], packed[3]);
  else
    *reinterpret_cast<uint2*>(p.out + std::uint64_t{t} * p.hidden + h) = make_uint2(packed[0], packed[1]);
}

using CombineFn = void (*)(const CombineParams&, cudaStream_t);
template <typename Id>
void combine(const CombineParams& p, cudaStream_t stream) {
  using Flags = ValueList<false, true>;
  (void)dispatch_value(Flags{}, p.slot_out16 != nullptr, [&]<bool Bf16>() {
    const std::uint32_t width = kCombineWidth<Bf16>;
    const dim3 grid(p.tokens, (p.hidden / width + kCombineThreads - 1) / kCombineThreads);
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
