// Host side of the grouped (warp-specialized, persistent) MoE GEMMs: the
// weights' tensor map, the device check and the dispatch to the scale path's
// instantiations (grouped_path.cuh, one translation unit per path so that
// they compile in parallel).
#include <cudaTypedefs.h>

#include <mutex>
#include <string>

#include "csfmoe/errors.hpp"
#include "cuda/moe/dispatch.hpp"
#include "cuda/moe/grouped_path.hpp"

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
  for_each_value(GroupedScalePaths{}, [&]<bool R>() { fits = configure_grouped_path<R>(prop) && fits; });
  return fits;
}

void launch_grouped(ScaleFormat f, bool gate_up, std::uint32_t token_tile, bool ring_scales,
                    std::uint32_t experts, const GemmParams& p, cudaStream_t stream) {
  if (p.scales.kind == ScaleKind::csf)
    throw Unsupported("grouped MoE kernel: stage-read CSF scales run on the decode kernel");
  const CUtensorMap map = weight_map(p, experts);
  dispatch_grouped_scale_path(
      ring_scales, [&]<bool R>() { launch_grouped_path<R>(f, gate_up, token_tile, map, p, stream); });
}

}  // namespace csfmoe::moe_detail
