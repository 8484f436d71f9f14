// Instantiations and dispatch of the Hopper prefill (wgmma) MoE GEMMs.
#include <string>

#include "csfmoe/errors.hpp"
#include "cuda/moe/dispatch.hpp"
#include "cuda/moe/prefill_kernel.cuh"
#include "cuda/primitives/cuda_check.hpp"
#include "cuda/primitives/launch.cuh"
#include "moe/call_plan.hpp"

namespace csfmoe::moe_detail {

static_assert(kPrefillHiddenStep == kPrefillRows && kPrefillIntermediateStep == kPrefillKBlock,
              "prefill_shape_ok (moe/call_plan.hpp) describes this kernel's tiles");

namespace {

template <ScaleFormat F, ScaleKind K, Projection P>
void prefill_launch(const GemmParams& p, cudaStream_t stream) {
  constexpr std::uint32_t per_block = is_gate_up(P) ? kPrefillRows / 2 : kPrefillRows;
  const std::uint32_t row_blocks = (is_gate_up(P) ? p.n : p.out_rows) / per_block;
  launch_kernel("moe prefill GEMM", p.chained, &moe_prefill_kernel<F, K, P>, dim3(p.max_tiles, row_blocks),
                dim3(kPrefillThreads), kPrefillSmem, stream, p);
}

}  // namespace

bool configure_prefill_kernels(int device) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  // wgmma exists on sm_90 only (this build's sm_90a code).
  if (prop.major != 9 || prop.minor != 0 || prop.sharedMemPerBlockOptin < kPrefillSmem) return false;
  for_each_value(ScaleFormats{}, [&]<ScaleFormat F>() {
    for_each_value(DenseScaleKinds{}, [&]<ScaleKind K>() {
      for_each_value(Projections{}, [&]<Projection P>() {
        CSFMOE_CUDA_CHECK_WHAT(
            cudaFuncSetAttribute(&moe_prefill_kernel<F, K, P>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 int(kPrefillSmem)),
            "configure the prefill MoE kernels (" + std::to_string(kPrefillSmem) +
                " bytes of shared memory)");
      });
    });
  });
  return true;
}

void launch_prefill_permute(const std::uint16_t* in, std::uint16_t* out, std::uint32_t rows, std::uint32_t k,
                            bool chained, cudaStream_t stream) {
  const std::uint64_t chunks = std::uint64_t(rows) * k / 8;
  if (chunks == 0) return;
  constexpr int kThreads = 256;
  launch_kernel("moe prefill activation permutation", chained, &moe_prefill_permute_kernel,
                dim3(unsigned((chunks + kThreads - 1) / kThreads)), dim3(kThreads), 0, stream, in, out,
                chunks);
}

void launch_prefill(ScaleFormat f, bool gate_up, const GemmParams& p, cudaStream_t stream) {
  if (p.scales.kind == ScaleKind::csf)
    throw Unsupported("prefill MoE kernel: stage-read CSF scales run on the decode kernel");
  dispatch_format(f, [&]<ScaleFormat F>() {
    dispatch_dense_scale_kind(p.scales.kind, [&]<ScaleKind K>() {
      dispatch_projection(gate_up, p.activation, [&]<Projection P>() { prefill_launch<F, K, P>(p, stream); });
    });
  });
}

}  // namespace csfmoe::moe_detail
