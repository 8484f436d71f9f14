// Instantiations and dispatch table of the decode (weight-streaming) MoE GEMMs.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "csfmoe/errors.hpp"
#include "cuda/primitives/launch.cuh"
#include "cuda/moe/decode_kernel.cuh"

namespace csfmoe::moe_detail {

namespace {

using DecodeFn = void (*)(const GemmParams&, cudaStream_t);

// Tuning overrides, read once per process (docs/performance.md):
// CSFMOE_DECODE_WARPS fixes the warps per block (1, 2, 4 or 8; fewer when K
// has fewer K blocks); CSFMOE_DECODE_KB_PER_WARP, CSFMOE_DECODE_MIN_KB and
// CSFMOE_DECODE_WAVES replace the fields of DecodeShapeRule;
// CSFMOE_DECODE_RUN fixes the row-block runs where possible, and
// CSFMOE_DECODE_COPY=1 turns paired ring copies off. Values out of range are
// ignored.
std::uint32_t env_choice(const char* name, std::uint32_t lo, std::uint32_t hi) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return 0;
  char* end = nullptr;
  const unsigned long n = std::strtoul(v, &end, 10);
  return *end == '\0' && n >= lo && n <= hi ? std::uint32_t(n) : 0;
}

std::uint32_t launch_warps(std::uint32_t kblocks, std::uint64_t blocks, std::uint32_t sm_count) {
  static const std::uint32_t fixed = env_choice("CSFMOE_DECODE_WARPS", 1, kDecodeMaxWarps);
  static const DecodeShapeRule rule = [] {
    DecodeShapeRule r;
    const auto set = [](std::uint32_t& field, const char* name) {
      if (const std::uint32_t v = env_choice(name, 1, 1024)) field = v;
    };
    set(r.kblocks_per_warp, "CSFMOE_DECODE_KB_PER_WARP");
    set(r.min_kblocks_per_warp, "CSFMOE_DECODE_MIN_KB");
    set(r.waves, "CSFMOE_DECODE_WAVES");
    return r;
  }();
  if (fixed != 0) {
    std::uint32_t w = 1;
    while (2 * w <= fixed && 2 * w <= kblocks) w *= 2;
    return w;
  }
  return decode_warps(kblocks, blocks, sm_count, rule);
}

// Row blocks per block: decode_row_block_run, or CSFMOE_DECODE_RUN
// where runs are possible.
std::uint32_t launch_row_block_run(bool can_run, std::uint32_t warps, std::uint32_t kblocks,
                                   std::uint64_t blocks, std::uint32_t sm_count) {
  static const std::uint32_t fixed = env_choice("CSFMOE_DECODE_RUN", 1, 64);
  if (fixed != 0) return decode_runs_possible(can_run, warps, kblocks) ? fixed : 1;
  return decode_row_block_run(can_run, warps, kblocks, blocks, sm_count);
}

// K blocks per ring copy: decode_copy_kblocks, or 1 with CSFMOE_DECODE_COPY=1.
std::uint32_t launch_copy_kblocks(std::uint32_t warps, std::uint32_t kblocks) {
  static const bool singles = env_choice("CSFMOE_DECODE_COPY", 1, 2) == 1;
  return singles ? 1 : decode_copy_kblocks(warps, kblocks);
}

template <ScaleFormat F, ScaleKind K, bool GateUp, int NT>
void decode_launch(const GemmParams& p, cudaStream_t stream) {
  const std::uint32_t per_block = GateUp ? kDecodeRows / 2 : kDecodeRows;
  const std::uint32_t row_blocks = (GateUp ? p.n : p.out_rows) / per_block;
  const std::uint32_t kblocks = p.k / kDecodeKBlock;
  const std::uint64_t blocks = std::uint64_t(p.max_tiles) * row_blocks;  // with one row block each
  const std::uint32_t warps = launch_warps(kblocks, blocks, p.sm_count);
  GemmParams q = p;
  q.row_block_run = launch_row_block_run(K != ScaleKind::csf && NT == 1, warps, kblocks, blocks, p.sm_count);
  const DecodeSmem s = decode_smem(warps, NT, K == ScaleKind::csf, q.row_block_run > 1);
  launch_kernel("moe decode GEMM", p.chained,
                launch_copy_kblocks(warps, kblocks) == 2 ? &moe_decode_kernel<F, K, GateUp, NT, 2>
                                                         : &moe_decode_kernel<F, K, GateUp, NT, 1>,
                dim3(p.max_tiles, (row_blocks + q.row_block_run - 1) / q.row_block_run), dim3(warps * 32),
                s.total, stream, q);
}

template <ScaleFormat F, ScaleKind K, bool GateUp, int NT>
cudaError_t decode_configure(std::uint32_t smem) {
  const cudaError_t singles = cudaFuncSetAttribute(&moe_decode_kernel<F, K, GateUp, NT, 1>,
                                                   cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (singles != cudaSuccess) return singles;
  return cudaFuncSetAttribute(&moe_decode_kernel<F, K, GateUp, NT, 2>,
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

std::uint32_t decode_smem_bytes(std::uint32_t k) {
  const std::uint32_t kblocks = k / kDecodeKBlock;
  // The largest block decode_warps can choose: the widest token pass, or a
  // run of row blocks (8-token passes, dense scales).
  const std::uint32_t warps = kblocks < kDecodeMaxWarps ? kblocks : kDecodeMaxWarps;
  const std::uint32_t widest = decode_smem(warps, 4, true).total,
                      run = decode_smem(warps, 1, false, true).total;
  return widest > run ? widest : run;
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
