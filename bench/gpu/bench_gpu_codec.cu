// GPU CSF codec benchmark on a full DeepSeek-V3 MoE layer (w13 [256, 4096,
// H/g], w2 [256, 7168, N/g]), NVFP4 and MXFP4, in one run:
//   - cudaMemcpy device-to-device bandwidth (the ceiling; bytes read + written),
//   - expand_all (expand_scales of the layer, fused launch) per output layout:
//     GB/s of bytes read (fixed + exceptions + index) + bytes written, and the
//     fraction of the copy bandwidth,
//   - expand_routed for T = 1, 8, 64 tokens, top-8, fresh random routing per
//     run: per-call time (events around a plain launch) and graph-replay time,
//     with the bandwidth floor of the experts actually used,
//   - encode_on_device throughput (native bytes / s, including its one sync).
// CUDA events, warm-up, median of >= 50 runs; several layer copies are
// rotated so that routed runs do not hit L2 (50 MB).
// Usage: bench_gpu_codec [--reps N] [--layers L] [--format nvfp4|mxfp4|all] [--json FILE]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "csfmoe/codec.hpp"
#include "csfmoe/device_codec.hpp"
#include "csfmoe/synthetic.hpp"
#include "cuda/primitives/cuda_check.hpp"

using namespace csfmoe;

namespace {

struct Options {
  int reps = 60;
  int layers = 4;
  std::string format = "all";
  std::string json;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Events {
  cudaEvent_t a, b;
  Events() {
    CSFMOE_CUDA_CHECK(cudaEventCreate(&a));
    CSFMOE_CUDA_CHECK(cudaEventCreate(&b));
  }
  ~Events() {
    (void)cudaEventDestroy(a);
    (void)cudaEventDestroy(b);
  }
  // Milliseconds of fn() on `stream`.
  template <class F>
  double time(cudaStream_t s, F&& fn) {
    CSFMOE_CUDA_CHECK(cudaEventRecord(a, s));
    fn();
    CSFMOE_CUDA_CHECK(cudaEventRecord(b, s));
    CSFMOE_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CSFMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    return ms;
  }
};

std::uint8_t* dev_alloc(std::size_t n) {
  void* p = nullptr;
  CSFMOE_CUDA_CHECK(cudaMalloc(&p, n));
  return static_cast<std::uint8_t*>(p);
}

FILE* g_json = nullptr;
// One JSON object per line: {"bench": name, <printf-formatted fields>}.
__attribute__((format(printf, 2, 3))) void json_line(const char* name, const char* fields, ...) {
  if (!g_json) return;
  char buf[1024];
  va_list ap;
  va_start(ap, fields);
  std::vsnprintf(buf, sizeof buf, fields, ap);
  va_end(ap);
  std::fprintf(g_json, "{\"bench\":\"%s\",%s}\n", name, buf);
  std::fflush(g_json);
}

double copy_bandwidth(const Options& o, cudaStream_t s) {
  const std::size_t n = std::size_t{2} << 30;  // 2 GiB each way: 40x L2
  std::uint8_t* a = dev_alloc(n);
  std::uint8_t* b = dev_alloc(n);
  CSFMOE_CUDA_CHECK(cudaMemsetAsync(a, 0x3C, n, s));
  Events ev;
  for (int i = 0; i < 3; ++i)
    ev.time(s, [&] { CSFMOE_CUDA_CHECK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, s)); });
  std::vector<double> t;
  for (int i = 0; i < o.reps; ++i)
    t.push_back(ev.time(s, [&] {
      CSFMOE_CUDA_CHECK(cudaMemcpyAsync(i % 2 ? a : b, i % 2 ? b : a, n, cudaMemcpyDeviceToDevice, s));
    }));
  const double ms = median(t);
  const double gbs = 2.0 * double(n) / (ms * 1e-3) / 1e9;
  std::printf("copy  D2D %zu MiB: median %.3f ms -> %.1f GB/s (read + write)\n", n >> 20, ms, gbs);
  json_line("copy_d2d", "\"bytes\":%.0f,\"ms\":%.6f,\"gbs\":%.2f", double(2 * n), ms, gbs);
  CSFMOE_CUDA_CHECK(cudaFree(a));
  CSFMOE_CUDA_CHECK(cudaFree(b));
  return gbs;
}

// Native grid of all experts: realistic synthetic bytes for a few experts,
// replicated (the codec's speed depends on the byte statistics, not on
// which expert holds them).
std::uint8_t* make_native(const GridShape& shape, std::uint64_t seed) {
  GridShape few = shape;
  few.experts = std::min<std::uint32_t>(shape.experts, 16);
  const std::vector<std::uint8_t> host = synthetic_scales(few, ScaleDistribution::realistic, seed);
  const std::size_t per = host.size() / few.experts;
  std::uint8_t* d = dev_alloc(per * shape.experts);
  for (std::uint32_t e = 0; e < shape.experts; e += few.experts) {
    const std::uint32_t n = std::min(few.experts, shape.experts - e);
    CSFMOE_CUDA_CHECK(cudaMemcpy(d + e * per, host.data(), n * per, cudaMemcpyHostToDevice));
  }
  return d;
}

std::uint64_t expand_read_bytes(const CsfDeviceView& v) {
  const CsfGeometry& g = v.geometry;
  return g.fixed_bytes() +
         4 * (v.num_exceptions + std::uint64_t{g.partitions_per_expert} * g.shape.experts + 1);
}

// Distinct experts of each routing.
std::uint32_t distinct(const std::int32_t* ids, std::size_t n) {
  std::vector<std::int32_t> v(ids, ids + n);
  std::sort(v.begin(), v.end());
  return static_cast<std::uint32_t>(std::unique(v.begin(), v.end()) - v.begin());
}

void bench_format(ScaleFormat f, const Options& o, double copy_gbs, cudaStream_t s) {
  const char* fname = f == ScaleFormat::nvfp4 ? "nvfp4" : "mxfp4";
  const MoeGeometry& m = kDeepSeekV3;
  const GridShape s13 = w13_scale_shape(m, f, ScaleLayout::row_major);
  const GridShape s2 = w2_scale_shape(m, f, ScaleLayout::row_major);
  const std::uint64_t n13 = CsfGeometry::of(s13).native_bytes(ScaleLayout::row_major);
  const std::uint64_t n2 = CsfGeometry::of(s2).native_bytes(ScaleLayout::row_major);
  std::printf("\n== %s DeepSeek-V3 layer: w13 [%u, %u, %u] + w2 [%u, %u, %u], native %.1f MB\n", fname,
              s13.experts, s13.rows, s13.cols, s2.experts, s2.rows, s2.cols, double(n13 + n2) / 1e6);
  std::uint8_t* d13 = make_native(s13, 13);
  std::uint8_t* d2 = make_native(s2, 2);

  // Encode throughput (includes the one host sync and the exception allocation).
  {
    std::vector<double> t13, t2;
    for (int i = 0; i < 7; ++i) {
      CSFMOE_CUDA_CHECK(cudaStreamSynchronize(s));
      auto t0 = std::chrono::steady_clock::now();
      DeviceCsfTensor a = encode_on_device(s13, d13, 0, s);
      CSFMOE_CUDA_CHECK(cudaStreamSynchronize(s));
      auto t1 = std::chrono::steady_clock::now();
      DeviceCsfTensor b = encode_on_device(s2, d2, 0, s);
      CSFMOE_CUDA_CHECK(cudaStreamSynchronize(s));
      auto t2c = std::chrono::steady_clock::now();
      if (i >= 2) {  // first runs: module load, pool growth
        t13.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
        t2.push_back(std::chrono::duration<double, std::milli>(t2c - t1).count());
      }
    }
    const double m13 = median(t13), m2 = median(t2);
    std::printf("encode_on_device  w13 %.3f ms (%.1f GB/s native)  w2 %.3f ms (%.1f GB/s native)\n", m13,
                double(n13) / (m13 * 1e-3) / 1e9, m2, double(n2) / (m2 * 1e-3) / 1e9);
    json_line("encode", "\"format\":\"%s\",\"w13_ms\":%.4f,\"w2_ms\":%.4f,\"w13_gbs\":%.2f,\"w2_gbs\":%.2f",
              fname, m13, m2, double(n13) / (m13 * 1e-3) / 1e9, double(n2) / (m2 * 1e-3) / 1e9);
  }

  // Layer copies (identical bytes, distinct memory) rotated across runs.
  std::vector<DeviceCsfTensor> w13(o.layers), w2(o.layers);
  for (int l = 0; l < o.layers; ++l) {
    w13[l] = encode_on_device(s13, d13, 0, s);
    w2[l] = encode_on_device(s2, d2, 0, s);
  }
  CSFMOE_CUDA_CHECK(cudaStreamSynchronize(s));
  const std::uint64_t read = expand_read_bytes(w13[0].view()) + expand_read_bytes(w2[0].view());
  std::printf("CSF resident %.1f MB (%.1f%% of native); exceptions w13 %llu (%.3f%%), w2 %llu (%.3f%%)\n",
              double(w13[0].resident_bytes() + w2[0].resident_bytes()) / 1e6,
              100.0 * double(w13[0].resident_bytes() + w2[0].resident_bytes()) / double(n13 + n2),
              static_cast<unsigned long long>(w13[0].view().num_exceptions),
              100.0 * double(w13[0].view().num_exceptions) / double(n13),
              static_cast<unsigned long long>(w2[0].view().num_exceptions),
              100.0 * double(w2[0].view().num_exceptions) / double(n2));

  Events ev;
  for (ScaleLayout layout : {ScaleLayout::row_major, ScaleLayout::swizzled_128x4}) {
    const char* lname = layout == ScaleLayout::row_major ? "row_major" : "swizzled";
    const std::uint64_t o13 = w13[0].view().geometry.native_bytes(layout);
    const std::uint64_t o2 = w2[0].view().geometry.native_bytes(layout);
    std::uint8_t* sc13 = dev_alloc(o13);
    std::uint8_t* sc2 = dev_alloc(o2);
    const ScaleScratch scratch{sc13, o13, sc2, o2};
    auto layer = [&](int l) {
      return LayerScales{ScaleTensorRef::of_csf(w13[l]), ScaleTensorRef::of_csf(w2[l])};
    };

    // Correctness on the full layer: row-major expansion == the source bytes.
    if (layout == ScaleLayout::row_major) {
      CSFMOE_CUDA_CHECK(cudaMemsetAsync(sc13, 0xA5, o13, s));
      CSFMOE_CUDA_CHECK(cudaMemsetAsync(sc2, 0xA5, o2, s));
      expand_scales(layer(0), scratch, layout, s);
      CSFMOE_CUDA_CHECK(cudaStreamSynchronize(s));
      std::vector<std::uint8_t> a(o13), b(o13);
      CSFMOE_CUDA_CHECK(cudaMemcpy(a.data(), sc13, o13, cudaMemcpyDeviceToHost));
      CSFMOE_CUDA_CHECK(cudaMemcpy(b.data(), d13, o13, cudaMemcpyDeviceToHost));
      const bool ok13 = a == b;
      a.resize(o2), b.resize(o2);
      CSFMOE_CUDA_CHECK(cudaMemcpy(a.data(), sc2, o2, cudaMemcpyDeviceToHost));
      CSFMOE_CUDA_CHECK(cudaMemcpy(b.data(), d2, o2, cudaMemcpyDeviceToHost));
      const bool ok2 = a == b;
      std::printf("check: full-layer expand_all == source: w13 %s, w2 %s\n", ok13 ? "exact" : "MISMATCH",
                  ok2 ? "exact" : "MISMATCH");
      if (!ok13 || !ok2) std::exit(2);
    }

    // expand_all, fused layer launch.
    for (int i = 0; i < 3; ++i) expand_scales(layer(i % o.layers), scratch, layout, s);
    std::vector<double> t;
    for (int i = 0; i < o.reps; ++i)
      t.push_back(ev.time(s, [&] { expand_scales(layer(i % o.layers), scratch, layout, s); }));
    const double ms = median(t);
    const double bytes = double(read + o13 + o2);
    const double gbs = bytes / (ms * 1e-3) / 1e9;
    std::printf("expand_all %-9s layer: median %.3f ms, %.1f MB moved -> %.1f GB/s = %.1f%% of copy\n", lname,
                ms, bytes / 1e6, gbs, 100.0 * gbs / copy_gbs);
    json_line("expand_all",
              "\"format\":\"%s\",\"layout\":\"%s\",\"ms\":%.6f,\"bytes\":%.0f,\"gbs\":%.2f,\"fraction_of_"
              "copy\":%.4f",
              fname, lname, ms, bytes, gbs, gbs / copy_gbs);
    // Per tensor (separate launches), for reference.
    for (int which = 0; which < 2; ++which) {
      std::vector<double> tt;
      for (int i = 0; i < o.reps; ++i) {
        const DeviceCsfTensor& tensor = which == 0 ? w13[i % o.layers] : w2[i % o.layers];
        tt.push_back(ev.time(s, [&] { expand_all(tensor.view(), layout, which == 0 ? sc13 : sc2, s); }));
      }
      const double mt = median(tt);
      const double b = double(expand_read_bytes((which == 0 ? w13 : w2)[0].view()) + (which == 0 ? o13 : o2));
      std::printf("   expand_all %s alone: %.3f ms -> %.1f GB/s = %.1f%% of copy\n",
                  which == 0 ? "w13" : "w2 ", mt, b / (mt * 1e-3) / 1e9,
                  100.0 * b / (mt * 1e-3) / 1e9 / copy_gbs);
    }

    // expand_routed, top-8, fresh random routing every run.
    const std::uint32_t k = m.topk, E = m.experts;
    std::mt19937_64 rng(1234);
    for (std::uint32_t T : {1u, 8u, 64u}) {
      const int slots = o.reps + 8;
      std::vector<std::int32_t> ids(static_cast<std::size_t>(slots) * T * k);
      std::vector<std::int32_t> all(E);
      for (std::uint32_t e = 0; e < E; ++e) all[e] = static_cast<std::int32_t>(e);
      for (int r = 0; r < slots; ++r)
        for (std::uint32_t tok = 0; tok < T; ++tok) {
          std::shuffle(all.begin(), all.end(), rng);
          std::copy(all.begin(), all.begin() + k, ids.begin() + (static_cast<std::size_t>(r) * T + tok) * k);
        }
      std::int32_t* d_ids = reinterpret_cast<std::int32_t*>(dev_alloc(ids.size() * 4));
      CSFMOE_CUDA_CHECK(cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
      const std::size_t per = std::size_t{T} * k;
      auto call = [&](int r) {
        expand_scales_routed(layer(r % o.layers), scratch, layout, d_ids + r * per, IndexType::int32, per, s);
      };
      for (int r = 0; r < 3; ++r) call(r);
      std::vector<double> tp;
      double used_sum = 0;
      for (int r = 0; r < o.reps; ++r) {
        tp.push_back(ev.time(s, [&] { call(r + 8); }));
        used_sum += distinct(ids.data() + (r + 8) * per, per);
      }
      // Graph replays: one graph per (layer, routing slot), each replayed once per round.
      const int graphs = std::min(o.reps, 16);
      std::vector<cudaGraphExec_t> execs(graphs);
      for (int gi = 0; gi < graphs; ++gi) {
        cudaGraph_t g;
        CSFMOE_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
        call(gi);
        CSFMOE_CUDA_CHECK(cudaStreamEndCapture(s, &g));
        CSFMOE_CUDA_CHECK(cudaGraphInstantiate(&execs[gi], g, 0));
        CSFMOE_CUDA_CHECK(cudaGraphDestroy(g));
      }
      for (int gi = 0; gi < graphs; ++gi) CSFMOE_CUDA_CHECK(cudaGraphLaunch(execs[gi], s));
      std::vector<double> tg;
      for (int r = 0; r < o.reps; ++r)
        tg.push_back(ev.time(s, [&] { CSFMOE_CUDA_CHECK(cudaGraphLaunch(execs[r % graphs], s)); }));
      for (auto& e : execs) CSFMOE_CUDA_CHECK(cudaGraphExecDestroy(e));
      const double used = used_sum / o.reps;
      const double per_expert = double(read + o13 + o2) / E;
      const double floor_us = used * per_expert / (copy_gbs * 1e9) * 1e6;
      const double mp = median(tp) * 1e3, mg = median(tg) * 1e3;
      std::printf(
          "expand_routed %-9s T=%-3u (%5.1f experts avg): call %.2f us, graph %.2f us; copy-bandwidth floor "
          "%.2f us\n",
          lname, T, used, mp, mg, floor_us);
      json_line("expand_routed",
                "\"format\":\"%s\",\"layout\":\"%s\",\"tokens\":%u,\"experts_used\":%.2f,\"call_us\":%.3f,"
                "\"graph_us\":%.3f,\"floor_us\":%.3f",
                fname, lname, T, used, mp, mg, floor_us);
      CSFMOE_CUDA_CHECK(cudaFree(d_ids));
    }
    CSFMOE_CUDA_CHECK(cudaFree(sc13));
    CSFMOE_CUDA_CHECK(cudaFree(sc2));
  }
  CSFMOE_CUDA_CHECK(cudaFree(d13));
  CSFMOE_CUDA_CHECK(cudaFree(d2));
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(1);
      }
      return argv[++i];
    };
    if (a == "--reps")
      o.reps = std::max(1, std::atoi(next().c_str()));
    else if (a == "--layers")
      o.layers = std::max(1, std::atoi(next().c_str()));
    else if (a == "--format")
      o.format = next();
    else if (a == "--json")
      o.json = next();
    else {
      std::fprintf(stderr, "usage: %s [--reps N] [--layers L] [--format nvfp4|mxfp4|all] [--json FILE]\n",
                   argv[0]);
      return 1;
    }
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("no CUDA device: nothing to measure\n");
    return 0;
  }
  try {
    cudaDeviceProp p{};
    CSFMOE_CUDA_CHECK(cudaGetDeviceProperties(&p, 0));
    std::printf("device 0: %s, %d SMs, L2 %d MB, %.1f GB\n", p.name, p.multiProcessorCount,
                p.l2CacheSize >> 20, double(p.totalGlobalMem) / 1e9);
    if (!o.json.empty()) g_json = std::fopen(o.json.c_str(), "w");
    cudaStream_t s;
    CSFMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const double copy = copy_bandwidth(o, s);
    if (o.format == "all" || o.format == "nvfp4") bench_format(ScaleFormat::nvfp4, o, copy, s);
    if (o.format == "all" || o.format == "mxfp4") bench_format(ScaleFormat::mxfp4, o, copy, s);
    CSFMOE_CUDA_CHECK(cudaStreamDestroy(s));
    if (g_json) std::fclose(g_json);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gpu_codec: %s\n", e.what());
    return 1;
  }
  return 0;
}
