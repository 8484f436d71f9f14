// CPU CSF codec throughput on DeepSeek-V3 layer grids (w13 [E, 4096, 448] and
// w2 [E, 7168, 128] for NVFP4; [E, 4096, 224] and [E, 7168, 64] for MXFP4),
// realistic synthetic scales. Bytes processed = native scale bytes; encode
// includes allocating the result, decode writes into a reused buffer.
//
// The expert count defaults to 32 (the full layer has 256): throughput does
// not depend on E once the data is well past the caches, and the full layer
// would need several GB. Override with CSFMOE_BENCH_EXPERTS.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "csfmoe/codec.hpp"
#include "csfmoe/synthetic.hpp"

namespace csfmoe {
namespace {

std::uint32_t bench_experts() {
  if (const char* env = std::getenv("CSFMOE_BENCH_EXPERTS"))
    return std::uint32_t(std::strtoul(env, nullptr, 10));
  return 32;
}

struct Case {
  GridShape shape;
  std::vector<std::uint8_t> src;
  CsfTensor enc;
};

// Grids are built once per (tensor, format, layout) and shared by the runs.
const Case& get_case(int which, ScaleFormat f, ScaleLayout l) {
  static std::map<std::tuple<int, int, int>, std::unique_ptr<Case>> cache;
  auto& slot = cache[{which, int(f), int(l)}];
  if (!slot) {
    MoeGeometry g = kDeepSeekV3;
    g.experts = bench_experts();
    slot = std::make_unique<Case>();
    slot->shape = which == 0 ? w13_scale_shape(g, f, l) : w2_scale_shape(g, f, l);
    slot->src = synthetic_scales(slot->shape, ScaleDistribution::realistic, 1234 + which);
    slot->enc = encode(slot->shape, slot->src);
  }
  return *slot;
}

void label(benchmark::State& state, const Case& c) {
  const CsfStats s = stats(c.enc);
  state.SetLabel(std::to_string(c.shape.experts) + "x" + std::to_string(c.shape.rows) + "x" +
                 std::to_string(c.shape.cols) + " ratio " + std::to_string(s.ratio()).substr(0, 5) + " exc " +
                 std::to_string(100 * s.exception_rate()).substr(0, 5) + "%");
}

// Arguments: tensor (0 = w13, 1 = w2), format, layout, threads (0 = all).
void BM_Encode(benchmark::State& state) {
  const Case& c = get_case(int(state.range(0)), ScaleFormat(state.range(1)), ScaleLayout(state.range(2)));
  const CodecOptions o{unsigned(state.range(3)), false};
  for (auto _ : state) {
    CsfTensor t = encode(c.shape, c.src, o);
    benchmark::DoNotOptimize(t.fixed.data());
  }
  state.SetBytesProcessed(std::int64_t(state.iterations()) * std::int64_t(c.src.size()));
  label(state, c);
}

// Arguments as BM_Encode plus trusted (1: no validation, as after a fresh encode).
void BM_Decode(benchmark::State& state) {
  const Case& c = get_case(int(state.range(0)), ScaleFormat(state.range(1)), ScaleLayout(state.range(2)));
  const CodecOptions o{unsigned(state.range(3)), false};
  const bool trusted = state.range(4) != 0;
  std::vector<std::uint8_t> out(c.src.size());
  for (auto _ : state) {
    decode(c.enc, c.shape.layout, out, o, trusted);
    benchmark::DoNotOptimize(out.data());
  }
  if (out != c.src) state.SkipWithError("decode is not exact");
  state.SetBytesProcessed(std::int64_t(state.iterations()) * std::int64_t(c.src.size()));
  label(state, c);
}

// threads = 1 is timed in CPU time of the calling thread (per-core throughput,
// robust on a shared machine); threads = all in wall time.
void codec_args(benchmark::internal::Benchmark* b, bool decode, int threads) {
  b->ArgNames(decode ? std::vector<std::string>{"w2", "mx", "swz", "threads", "trusted"}
                     : std::vector<std::string>{"w2", "mx", "swz", "threads"});
  for (int which : {0, 1})
    for (int f : {0, 1})
      for (int l : {0, 1}) {
        if (decode) {
          b->Args({which, f, l, threads, 1});
          if (threads == 1) b->Args({which, f, l, threads, 0});
        } else {
          b->Args({which, f, l, threads});
        }
      }
  b->Unit(benchmark::kMillisecond)->MinTime(0.3);
  if (threads != 1) b->UseRealTime();
}

BENCHMARK(BM_Encode)->Apply([](benchmark::internal::Benchmark* b) { codec_args(b, false, 1); });
BENCHMARK(BM_Encode)->Apply([](benchmark::internal::Benchmark* b) { codec_args(b, false, 0); });
BENCHMARK(BM_Decode)->Apply([](benchmark::internal::Benchmark* b) { codec_args(b, true, 1); });
BENCHMARK(BM_Decode)->Apply([](benchmark::internal::Benchmark* b) { codec_args(b, true, 0); });

}  // namespace
}  // namespace csfmoe

BENCHMARK_MAIN();
