// Instantiations, tensor maps and dispatch of the grouped (warp-specialized,
// persistent) MoE GEMMs.
#include <cudaTypedefs.h>

#include <mutex>
#include <string>

#include "csfmoe/errors.hpp"
#include "cuda/moe/dispatch.hpp"
#include "cuda/moe/grouped_kernel.cuh"
#include "cuda/primitives/cuda_check.hpp"
#include "cuda/primitives/launch.cuh"

namespace csfmoe::moe_detail {

namespace {

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) ==
            cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
    else
      (void)cudaGetLastError();
  });
  return fn;
}

// The weights [E * out_rows, K / 2] bytes as a 2-D tensor, boxes of 128
// rows x one 128-wide K block (64 bytes): the kernel's TMA copies.
CUtensorMap weight_map(const GemmParams& p, std::uint32_t experts) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) throw CudaError("grouped MoE GEMM: the driver has no cuTensorMapEncodeTiled");
  CUtensorMap map{};
  const cuuint64_t dims[2] = {p.k / 2, cuuint64_t(experts) * p.out_rows};
  const cuuint64_t strides[1] = {p.k / 2};
  const cuuint32_t box[2] = {kGroupedKBlock / 2, 128}, elem[2] = {1, 1};
  const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<std::uint8_t*>(p.w), dims,
                            strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw CudaError("grouped MoE GEMM: cuTensorMapEncodeTiled failed (" + std::to_string(int(r)) +
                    ") for weights of " + std::to_string(dims[1]) + " x " + std::to_string(dims[0]) +
                    " bytes");
  return map;
}

template <ScaleFormat F, int NT, bool R>
constexpr GroupedSmem grouped_smem_of() {
  return grouped_smem(NT, R ? grouped_scale_row_bytes(F == ScaleFormat::nvfp4) : 0);
}

template <ScaleFormat F, ScaleKind K, Projection P, int NT, bool R>
void grouped_launch(const CUtensorMap& map, const GemmParams& p, cudaStream_t stream) {
  launch_kernel("moe grouped GEMM", p.chained, &moe_grouped_kernel<F, K, P, NT, R>, dim3(p.sm_count),
                dim3(grouped_consumers(NT).threads), grouped_smem_of<F, NT, R>().total, stream, map, p);
}

}  // namespace

bool configure_grouped_kernels(int device) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  // wgmma, setmaxnreg and TMA: this build's sm_90a code.
  if (prop.major != 9 || prop.minor != 0 || tensor_map_encoder() == nullptr) return false;
  bool fits = true;
  for_each_value(ScaleFormats{}, [&]<ScaleFormat F>() {
    for_each_value(GroupedTokenTiles{}, [&]<int NT>() {
      for_each_value(GroupedScalePaths{}, [&]<bool R>() {
        fits = fits && prop.sharedMemPerBlockOptin >= grouped_smem_of<F, NT, R>().total;
      });
    });
  });
  if (!fits) return false;
  for_each_value(ScaleFormats{}, [&]<ScaleFormat F>() {
    for_each_value(DenseScaleKinds{}, [&]<ScaleKind K>() {
      for_each_value(Projections{}, [&]<Projection P>() {
        for_each_value(GroupedTokenTiles{}, [&]<int NT>() {
          for_each_value(GroupedScalePaths{}, [&]<bool R>() {
            // setmaxnreg.inc waits until the registers are free in the pool the
            // CTA got at launch: a split beyond it would hang, so such a build
            // leaves the grouped kernels unused.
            cudaFuncAttributes attr{};
            CSFMOE_CUDA_CHECK_WHAT(cudaFuncGetAttributes(&attr, &moe_grouped_kernel<F, K, P, NT, R>),
                                   "read the grouped MoE kernels' attributes");
            constexpr GroupedConsumers c = grouped_consumers(NT);
            fits = fits && 128 * c.producer_regs + 128 * c.groups * c.consumer_regs <= c.threads * attr.numRegs;
            constexpr std::uint32_t smem = grouped_smem_of<F, NT, R>().total;
            CSFMOE_CUDA_CHECK_WHAT(cudaFuncSetAttribute(&moe_grouped_kernel<F, K, P, NT, R>,
                                                        cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
                                   "configure the grouped MoE kernels (" + std::to_string(smem) +
                                       " bytes of shared memory)");
          });
        });
      });
    });
  });
  return fits;
}

void launch_grouped(ScaleFormat f, bool gate_up, std::uint32_t token_tile, bool ring_scales,
                    std::uint32_t experts, const GemmParams& p, cudaStream_t stream) {
  if (p.scales.kind == ScaleKind::csf)
    throw Unsupported("grouped MoE kernel: stage-read CSF scales run on the decode kernel");
  const CUtensorMap map = weight_map(p, experts);
  dispatch_format(f, [&]<ScaleFormat F>() {
    dispatch_dense_scale_kind(p.scales.kind, [&]<ScaleKind K>() {
      dispatch_projection(gate_up, p.activation, [&]<Projection P>() {
        dispatch_token_tile(token_tile, [&]<int NT>() {
          dispatch_grouped_scale_path(ring_scales,
                                      [&]<bool R>() { grouped_launch<F, K, P, NT, R>(map, p, stream); });
        });
      });
    });
  });
}

}  // namespace csfmoe::moe_detail
