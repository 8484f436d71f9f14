// Instantiations and dispatch table of the grouped MoE GEMMs.
#include "cuda/primitives/launch.cuh"
#include "cuda/moe/tiled_kernel.cuh"

namespace csfmoe::moe_detail {

namespace {

using GemmFn = void (*)(const GemmParams&, cudaStream_t);

template <ScaleFormat F, ScaleKind K, bool GateUp>
void gemm(const GemmParams& p, cudaStream_t stream) {
  const std::uint32_t n_tiles = (GateUp ? p.n : p.out_rows) / kTileN;
  launch_kernel("moe tiled GEMM", p.chained, &moe_gemm_kernel<F, K, GateUp>, dim3(p.max_tiles, n_tiles),
                dim3(kGemmThreads), 0, stream, p);
}

// [format][scale kind][gate_up]
constexpr GemmFn kGemm[2][3][2] = {
    {{&gemm<ScaleFormat::nvfp4, ScaleKind::dense_row_major, false>,
      &gemm<ScaleFormat::nvfp4, ScaleKind::dense_row_major, true>},
     {&gemm<ScaleFormat::nvfp4, ScaleKind::dense_swizzled, false>,
      &gemm<ScaleFormat::nvfp4, ScaleKind::dense_swizzled, true>},
     {&gemm<ScaleFormat::nvfp4, ScaleKind::csf, false>, &gemm<ScaleFormat::nvfp4, ScaleKind::csf, true>}},
    {{&gemm<ScaleFormat::mxfp4, ScaleKind::dense_row_major, false>,
      &gemm<ScaleFormat::mxfp4, ScaleKind::dense_row_major, true>},
     {&gemm<ScaleFormat::mxfp4, ScaleKind::dense_swizzled, false>,
      &gemm<ScaleFormat::mxfp4, ScaleKind::dense_swizzled, true>},
     {&gemm<ScaleFormat::mxfp4, ScaleKind::csf, false>, &gemm<ScaleFormat::mxfp4, ScaleKind::csf, true>}},
};

}  // namespace

void launch_gate_up(ScaleFormat f, GemmPath path, const GemmParams& p, cudaStream_t stream) {
  if (p.max_tiles == 0) return;
  if (path == GemmPath::tiled)
    kGemm[int(f)][int(p.scales.kind)][1](p, stream);
  else if (path == GemmPath::prefill)
    launch_prefill(f, true, p, stream);
  else
    launch_decode(f, true, path, p, stream);
}

void launch_down(ScaleFormat f, GemmPath path, const GemmParams& p, cudaStream_t stream) {
  if (p.max_tiles == 0) return;
  if (path == GemmPath::tiled)
    kGemm[int(f)][int(p.scales.kind)][0](p, stream);
  else if (path == GemmPath::prefill)
    launch_prefill(f, false, p, stream);
  else
    launch_decode(f, false, path, p, stream);
}

}  // namespace csfmoe::moe_detail
