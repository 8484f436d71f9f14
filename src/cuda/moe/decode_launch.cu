// Instantiations and dispatch of the decode (weight-streaming) MoE GEMMs. The
// block shape comes from the call plan (GemmParams::decode, plan_call).
#include <cstdio>
#include <string>

#include "csfmoe/errors.hpp"
#include "cuda/moe/decode_kernel.cuh"
#include "cuda/moe/dispatch.hpp"
#include "cuda/primitives/cuda_check.hpp"
#include "cuda/primitives/launch.cuh"

namespace csfmoe::moe_detail {

// The tile constants the kernel, its scale reader and the stage-read index share.
static_assert(sizeof(BlockExceptions::run_prefix) / sizeof(BlockExceptions::run_prefix[0]) *
                      kDecodeHalfRows ==
                  kDecodeRows,
              "one exception run per MMA row tile of the block");
static_assert(sizeof(BlockExceptions::run_prefix[0]) / sizeof(std::uint32_t) == kDecodeHalfRows + 1,
              "a run's row prefix: its rows and one past");
static_assert(sizeof(BlockExceptions::row_range) / sizeof(BlockExceptions::row_range[0]) == kDecodeRows,
              "a record range per block row");

namespace {

template <ScaleFormat F, ScaleKind K, Projection P, int NT>
void decode_launch(const GemmParams& p, cudaStream_t stream) {
  const std::uint32_t per_block = is_gate_up(P) ? kDecodeHalfRows : kDecodeRows;
  const std::uint32_t row_blocks = (is_gate_up(P) ? p.n : p.out_rows) / per_block;
  GemmParams q = p;
  q.row_block_run = p.decode.row_block_run;
  dispatch_ring_copy(p.decode.copy_kblocks, [&]<int Copy>() {
    launch_kernel("moe decode GEMM", p.chained, &moe_decode_kernel<F, K, P, NT, Copy>,
                  dim3(p.max_tiles, (row_blocks + q.row_block_run - 1) / q.row_block_run),
                  dim3(p.decode.warps * 32), p.decode.smem_bytes, stream, q);
  });
}

}  // namespace

void configure_decode_kernels(std::uint32_t smem_bytes) {
  const auto configure = [&](auto kernel) {
    CSFMOE_CUDA_CHECK_WHAT(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem_bytes)),
        "configure the decode MoE kernels (" + std::to_string(smem_bytes) + " bytes of shared memory)");
  };
  for_each_value(ScaleFormats{}, [&]<ScaleFormat F>() {
    for_each_value(ScaleKinds{}, [&]<ScaleKind K>() {
      for_each_value(Projections{}, [&]<Projection P>() {
        for_each_value(DecodeTokenPasses{}, [&]<int NT>() {
          for_each_value(DecodeRingCopies{},
                         [&]<int Copy>() { configure(&moe_decode_kernel<F, K, P, NT, Copy>); });
        });
      });
    });
  });
}

void launch_decode(ScaleFormat f, bool gate_up, GemmPath path, const GemmParams& p, cudaStream_t stream) {
  dispatch_format(f, [&]<ScaleFormat F>() {
    dispatch_scale_kind(p.scales.kind, [&]<ScaleKind K>() {
      dispatch_projection(gate_up, p.activation, [&]<Projection P>() {
        dispatch_token_pass(path, [&]<int NT>() { decode_launch<F, K, P, NT>(p, stream); });
      });
    });
  });
}

#if CSFMOE_DECODE_TIMELINE
// Diagnostic builds (CSFMOE_DECODE_TIMELINE=1): clear the block timeline, and
// append what was recorded since to `f` as JSON lines tagged with `label` (a
// JSON object body, e.g. "\"shape\":\"ds3\""). Returns the events written.
void decode_timeline_reset() {
  const unsigned zero = 0;
  (void)cudaMemcpyToSymbol(g_decode_timeline_count, &zero, sizeof zero);
}

unsigned decode_timeline_dump(std::FILE* f, const char* label) {
  unsigned n = 0;
  if (cudaMemcpyFromSymbol(&n, g_decode_timeline_count, sizeof n) != cudaSuccess) return 0;
  n = n < kDecodeTimelineCapacity ? n : kDecodeTimelineCapacity;
  std::string buf(std::size_t(n) * sizeof(DecodeTimelineEvent), '\0');
  if (n != 0 && cudaMemcpyFromSymbol(buf.data(), g_decode_timeline, buf.size()) != cudaSuccess) return 0;
  const auto* ev = reinterpret_cast<const DecodeTimelineEvent*>(buf.data());
  for (unsigned i = 0; i < n; ++i)
    std::fprintf(f,
                 "{%s,\"gate_up\":%u,\"tile\":%u,\"group\":%u,\"sm\":%u,\"valid\":%u,\"t\":[%llu,%llu,%llu,%"
                 "llu,%llu]}\n",
                 label, ev[i].gate_up, ev[i].tile, ev[i].row_block_group, ev[i].sm, ev[i].valid, ev[i].t[0],
                 ev[i].t[1], ev[i].t[2], ev[i].t[3], ev[i].t[4]);
  return n;
}
#endif

}  // namespace csfmoe::moe_detail
