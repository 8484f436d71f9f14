// Instantiations and dispatch table of the Hopper prefill (wgmma) MoE GEMMs.
#include <string>

#include "csfmoe/errors.hpp"
#include "cuda/primitives/launch.cuh"
#include "cuda/moe/prefill_kernel.cuh"

namespace csfmoe::moe_detail {

namespace {

using PrefillFn = void (*)(const GemmParams&, cudaStream_t);

template <ScaleFormat F, ScaleKind K, bool GateUp>
void prefill_launch(const GemmParams& p, cudaStream_t stream) {
  constexpr std::uint32_t per_block = GateUp ? kPrefillRows / 2 : kPrefillRows;
  const std::uint32_t row_blocks = (GateUp ? p.n : p.out_rows) / per_block;
  launch_kernel("moe prefill GEMM", p.chained, &moe_prefill_kernel<F, K, GateUp>,
                dim3(p.max_tiles, row_blocks), dim3(kPrefillThreads), kPrefillSmem, stream, p);
}

template <ScaleFormat F, ScaleKind K, bool GateUp>
cudaError_t prefill_configure() {
  return cudaFuncSetAttribute(&moe_prefill_kernel<F, K, GateUp>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(kPrefillSmem));
}

// [format][dense scale kind: row-major, swizzled][gate_up]
#define CSFMOE_PREFILL_KIND(F, K, FN) \
  { &FN<F, K, false>, &FN<F, K, true> }
#define CSFMOE_PREFILL_FORMAT(F, FN)                          \
  {                                                           \
    CSFMOE_PREFILL_KIND(F, ScaleKind::dense_row_major, FN),   \
        CSFMOE_PREFILL_KIND(F, ScaleKind::dense_swizzled, FN) \
  }
constexpr PrefillFn kPrefill[2][2][2] = {CSFMOE_PREFILL_FORMAT(ScaleFormat::nvfp4, prefill_launch),
                                         CSFMOE_PREFILL_FORMAT(ScaleFormat::mxfp4, prefill_launch)};
using ConfigureFn = cudaError_t (*)();
constexpr ConfigureFn kConfigure[2][2][2] = {CSFMOE_PREFILL_FORMAT(ScaleFormat::nvfp4, prefill_configure),
                                             CSFMOE_PREFILL_FORMAT(ScaleFormat::mxfp4, prefill_configure)};
#undef CSFMOE_PREFILL_FORMAT
#undef CSFMOE_PREFILL_KIND

}  // namespace

bool prefill_shape_ok(std::uint32_t hidden, std::uint32_t intermediate) {
  return hidden % kPrefillRows == 0 && intermediate % kPrefillKBlock == 0;
}

bool configure_prefill_kernels(int device) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  // wgmma exists on sm_90 only (this build's sm_90a code).
  if (prop.major != 9 || prop.minor != 0 || prop.sharedMemPerBlockOptin < kPrefillSmem) return false;
  for (const auto& by_format : kConfigure)
    for (const auto& by_kind : by_format)
      for (ConfigureFn fn : by_kind) {
        const cudaError_t err = fn();
        if (err != cudaSuccess) {
          (void)cudaGetLastError();
          throw CudaError(std::string("configure the prefill MoE kernels (") + std::to_string(kPrefillSmem) +
                          " bytes of shared memory): " + cudaGetErrorString(err));
        }
      }
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
  kPrefill[int(f)][int(p.scales.kind)][gate_up ? 1 : 0](p, stream);
}

}  // namespace csfmoe::moe_detail
