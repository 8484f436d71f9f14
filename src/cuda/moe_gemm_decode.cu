// Instantiations and dispatch table of the decode (weight-streaming) MoE GEMMs.
#include <string>

#include "csfmoe/errors.hpp"
#include "cuda/moe_decode.cuh"

namespace csfmoe::moe_detail {

namespace {

using DecodeFn = void (*)(const GemmParams&, cudaStream_t);

template <ScaleFormat F, ScaleKind K, bool GateUp, int NT>
void decode_launch(const GemmParams& p, cudaStream_t stream) {
  const DecodeSmem s = decode_smem(p.k, NT);
  const std::uint32_t per_block = GateUp ? kDecodeRows / 2 : kDecodeRows;
  const std::uint32_t row_blocks = (GateUp ? p.n : p.out_rows) / per_block;
  moe_decode_kernel<F, K, GateUp, NT><<<dim3(p.max_tiles, row_blocks), s.warps * 32, s.total, stream>>>(p);
}

template <ScaleFormat F, ScaleKind K, bool GateUp, int NT>
cudaError_t decode_configure(std::uint32_t smem) {
  return cudaFuncSetAttribute(&moe_decode_kernel<F, K, GateUp, NT>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
}

// [format][scale kind][gate_up][token pass: 8, 16, 32]
#define CSFMOE_DECODE_ROW(F, K, FN)                                    \
  {                                                                    \
    {&FN<F, K, false, 1>, &FN<F, K, false, 2>, &FN<F, K, false, 4>}, { \
      &FN<F, K, true, 1>, &FN<F, K, true, 2>, &FN<F, K, true, 4>       \
    }                                                                  \
  }
#define CSFMOE_DECODE_FORMAT(F, FN)                                                                   \
  {                                                                                                   \
    CSFMOE_DECODE_ROW(F, ScaleKind::dense_row_major, FN),                                             \
        CSFMOE_DECODE_ROW(F, ScaleKind::dense_swizzled, FN), CSFMOE_DECODE_ROW(F, ScaleKind::csf, FN) \
  }
constexpr DecodeFn kDecode[2][3][2][3] = {CSFMOE_DECODE_FORMAT(ScaleFormat::nvfp4, decode_launch),
                                          CSFMOE_DECODE_FORMAT(ScaleFormat::mxfp4, decode_launch)};
using ConfigureFn = cudaError_t (*)(std::uint32_t);
constexpr ConfigureFn kConfigure[2][3][2][3] = {CSFMOE_DECODE_FORMAT(ScaleFormat::nvfp4, decode_configure),
                                                CSFMOE_DECODE_FORMAT(ScaleFormat::mxfp4, decode_configure)};
#undef CSFMOE_DECODE_FORMAT
#undef CSFMOE_DECODE_ROW

}  // namespace

bool decode_shape_ok(std::uint32_t hidden, std::uint32_t intermediate) {
  return hidden % kDecodeKBlock == 0 && intermediate % kDecodeKBlock == 0;
}

std::uint32_t decode_smem_bytes(ScaleFormat f, std::uint32_t k) {
  (void)f;                         // the scales travel in the weight ring: the same layout for both formats
  return decode_smem(k, 4).total;  // the larger token pass bounds both
}

void configure_decode_kernels(std::uint32_t smem_bytes) {
  for (const auto& by_format : kConfigure)
    for (const auto& by_kind : by_format)
      for (const auto& by_proj : by_kind)
        for (ConfigureFn fn : by_proj) {
          const cudaError_t err = fn(smem_bytes);
          if (err != cudaSuccess) {
            (void)cudaGetLastError();
            throw CudaError(std::string("configure the decode MoE kernels (") + std::to_string(smem_bytes) +
                            " bytes of shared memory): " + cudaGetErrorString(err));
          }
        }
}

void launch_decode(ScaleFormat f, bool gate_up, GemmPath path, const GemmParams& p, cudaStream_t stream) {
  kDecode[int(f)][int(p.scales.kind)][gate_up ? 1 : 0][int(path) - int(GemmPath::decode_8)](p, stream);
}

}  // namespace csfmoe::moe_detail
