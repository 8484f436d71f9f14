// Instantiations and dispatch of the grouped (tiled) MoE GEMMs, and the entry
// points that route a GEMM to its kernel family.
#include "cuda/moe/dispatch.hpp"
#include "cuda/moe/tiled_kernel.cuh"
#include "cuda/primitives/launch.cuh"

namespace csfmoe::moe_detail {

namespace {

template <ScaleFormat F, ScaleKind K, Projection P>
void gemm(const GemmParams& p, cudaStream_t stream) {
  const std::uint32_t n_tiles = (is_gate_up(P) ? p.n : p.out_rows) / kTileN;
  launch_kernel("moe tiled GEMM", p.chained, &moe_gemm_kernel<F, K, P>, dim3(p.max_tiles, n_tiles),
                dim3(kGemmThreads), 0, stream, p);
}

void launch_tiled(ScaleFormat f, bool gate_up, const GemmParams& p, cudaStream_t stream) {
  dispatch_format(f, [&]<ScaleFormat F>() {
    dispatch_scale_kind(p.scales.kind, [&]<ScaleKind K>() {
      dispatch_projection(gate_up, p.activation, [&]<Projection P>() { gemm<F, K, P>(p, stream); });
    });
  });
}

void launch_gemm(ScaleFormat f, bool gate_up, GemmPath path, const GemmParams& p, cudaStream_t stream) {
  if (p.max_tiles == 0) return;
  if (path == GemmPath::tiled)
    launch_tiled(f, gate_up, p, stream);
  else if (path == GemmPath::prefill)
    launch_prefill(f, gate_up, p, stream);
  else
    launch_decode(f, gate_up, path, p, stream);
}

}  // namespace

void launch_gate_up(ScaleFormat f, GemmPath path, const GemmParams& p, cudaStream_t stream) {
  launch_gemm(f, true, path, p, stream);
}

void launch_down(ScaleFormat f, GemmPath path, const GemmParams& p, cudaStream_t stream) {
  launch_gemm(f, false, path, p, stream);
}

}  // namespace csfmoe::moe_detail
