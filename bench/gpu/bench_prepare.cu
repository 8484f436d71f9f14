// Load time and peak host memory of preparing one CSF MoE layer on the GPU
// from a checkpoint's planes, two ways:
//   native  today's path for a CSF checkpoint: decode the planes to native
//           scale grids on the host, upload them, prepare_weights encodes
//           them again on the device;
//   planes  prepare_weights(MoeCsfPlanes): the planes uploaded as they are,
//           the resident parts built on the device (planes_to_device).
// One path per process (--path), so that each peak RSS is its own; the
// planes are built first (as a loader would hold them) and the RSS before
// the path is the baseline. The FP4 weights are not part of the measurement
// (prepare_weights only checks their pointers). Both paths' resident parts
// are compared (--path both, after the timings).
//
//   bench_prepare [--shape ds3|kimi|qwen3] [--format nvfp4|mxfp4] [--path native|planes|both]
//                 [--reps N] [--json FILE]
#include <cuda_runtime.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "csfmoe/b12x_planes.hpp"
#include "csfmoe/moe.hpp"
#include "csfmoe/moe_cuda.hpp"
#include "csfmoe/synthetic.hpp"

using namespace csfmoe;

namespace {

void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "bench_prepare: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

double peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss / 1024.0;  // Linux: KiB
}

std::vector<CsfPlanes> planes_of(const GridShape& shape, std::uint64_t seed) {
  const std::vector<std::uint8_t> grid = synthetic_scales(shape, ScaleDistribution::realistic, seed);
  const std::size_t per = std::size_t{shape.rows} * shape.cols;
  std::vector<CsfPlanes> out;
  out.reserve(shape.experts);
  for (std::uint32_t e = 0; e < shape.experts; ++e)
    out.push_back(
        encode_planes({shape.format, shape.rows, shape.cols}, std::span(grid).subspan(e * per, per)));
  return out;
}

std::uint64_t plane_bytes(const std::vector<CsfPlanes>& v) {
  std::uint64_t n = 0;
  for (const CsfPlanes& p : v) n += p.fixed.size() + 4 * p.exceptions.size();
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  std::string shape_name = "ds3", format_name = "nvfp4", path = "both", json;
  int reps = 3;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto next = [&] {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_prepare: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return std::string(argv[++i]);
    };
    if (a == "--shape")
      shape_name = next();
    else if (a == "--format")
      format_name = next();
    else if (a == "--path")
      path = next();
    else if (a == "--reps")
      reps = std::max(1, std::stoi(next()));
    else if (a == "--json")
      json = next();
    else {
      std::fprintf(stderr, "bench_prepare: unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  if (path != "native" && path != "planes" && path != "both") {
    std::fprintf(stderr, "bench_prepare: --path is native, planes or both\n");
    return 2;
  }
  const MoeGeometry& mg = moe_geometry(shape_name == "ds3"     ? "deepseek-v3"
                                       : shape_name == "kimi"  ? "kimi-k2"
                                       : shape_name == "qwen3" ? "qwen3-30b-a3b"
                                                               : shape_name);
  const ScaleFormat f = format_name == "mxfp4" ? ScaleFormat::mxfp4 : ScaleFormat::nvfp4;
  MoeLayerGeometry g;
  g.experts = mg.experts;
  g.hidden = mg.hidden;
  g.intermediate = mg.intermediate;
  g.topk = mg.topk;
  MoeConstraints c;
  c.compression = ScaleCompression::csf;
  const MoePlan plan = plan_weights(f, g, c);

  const std::vector<CsfPlanes> p13 = planes_of(plan.w13_scales, 13), p2 = planes_of(plan.w2_scales, 2);
  const std::uint64_t stored = plane_bytes(p13) + plane_bytes(p2);
  const std::uint64_t native_bytes = plan.w13_scale_bytes + plan.w2_scale_bytes;

  ck(cudaFree(nullptr), "context");  // the CUDA context is up before any baseline
  cudaStream_t stream;
  ck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  void *w13 = nullptr, *w2 = nullptr, *g13 = nullptr, *g2 = nullptr;
  ck(cudaMalloc(&w13, 256), "w13");
  ck(cudaMalloc(&w2, 256), "w2");
  ck(cudaMalloc(&g13, 4 * g.experts), "globals");
  ck(cudaMalloc(&g2, 4 * g.experts), "globals");
  MoeDeviceWeights dw;
  dw.w13 = static_cast<const std::uint8_t*>(w13);
  dw.w2 = static_cast<const std::uint8_t*>(w2);
  if (f == ScaleFormat::nvfp4) {
    dw.w13_global = static_cast<const float*>(g13);
    dw.w2_global = static_cast<const float*>(g2);
  }

  // Today's path: decode on the host, upload, encode on the device.
  const auto native_path = [&] {
    std::vector<std::uint8_t> s13(plan.w13_scale_bytes), s2(plan.w2_scale_bytes);
    const auto decode_all = [](const std::vector<CsfPlanes>& planes, std::vector<std::uint8_t>& out) {
      std::size_t at = 0;
      for (const CsfPlanes& p : planes) {
        const std::size_t n = std::size_t{p.shape.rows} * p.shape.cols;
        decode_planes(p.shape, p.fixed, p.exceptions, std::span(out).subspan(at, n), "scale");
        at += n;
      }
    };
    decode_all(p13, s13);
    decode_all(p2, s2);
    void *d13 = nullptr, *d2 = nullptr;
    ck(cudaMalloc(&d13, s13.size()), "native w13 scales");
    ck(cudaMalloc(&d2, s2.size()), "native w2 scales");
    ck(cudaMemcpy(d13, s13.data(), s13.size(), cudaMemcpyHostToDevice), "upload");
    ck(cudaMemcpy(d2, s2.data(), s2.size(), cudaMemcpyHostToDevice), "upload");
    MoeDeviceWeights nw = dw;
    nw.w13_scales = static_cast<const std::uint8_t*>(d13);
    nw.w2_scales = static_cast<const std::uint8_t*>(d2);
    MoeWeights w = prepare_weights(plan, nw, nullptr, stream);
    ck(cudaFree(d13), "free");  // the layer holds its own CSF copies
    ck(cudaFree(d2), "free");
    return w;
  };
  const auto planes_path = [&] { return prepare_weights(plan, dw, MoeCsfPlanes{p13, p2}, nullptr, stream); };

  std::FILE* out = json.empty() ? nullptr : std::fopen(json.c_str(), "a");
  std::printf("%s %s: E %u, stored planes %.1f MiB, native scales %.1f MiB\n", std::string(mg.name).c_str(),
              format_name.c_str(), g.experts, stored / 1048576.0, native_bytes / 1048576.0);
  std::unique_ptr<MoeWeights> last_native, last_planes;
  for (const std::string p : {"planes", "native"}) {
    if (path != "both" && path != p) continue;
    const double rss0 = peak_rss_mib();
    std::vector<double> ms;
    for (int r = 0; r < reps; ++r) {
      ck(cudaDeviceSynchronize(), "sync");
      const auto t0 = std::chrono::steady_clock::now();
      MoeWeights w = p == "planes" ? planes_path() : native_path();
      ck(cudaDeviceSynchronize(), "sync");
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      if (r + 1 == reps)
        (p == "planes" ? last_planes : last_native) = std::make_unique<MoeWeights>(std::move(w));
    }
    std::sort(ms.begin(), ms.end());
    const double med = ms[ms.size() / 2], rss = peak_rss_mib() - rss0;
    std::printf(
        "  %-6s: prepare %8.1f ms (median of %d, min %.1f), peak host RSS +%.1f MiB, resident CSF %.1f MiB\n",
        p.c_str(), med, reps, ms.front(), rss,
        (p == "planes" ? last_planes : last_native)->resident_scale_bytes() / 1048576.0);
    if (out)
      std::fprintf(out,
                   "{\"bench\":\"prepare\",\"shape\":\"%s\",\"format\":\"%s\",\"path\":\"%s\",\"experts\":%u,"
                   "\"prepare_ms\":%.2f,\"prepare_min_ms\":%.2f,\"reps\":%d,\"peak_rss_delta_mib\":%.1f,"
                   "\"stored_plane_bytes\":%llu,\"native_scale_bytes\":%llu}\n",
                   std::string(mg.name).c_str(), format_name.c_str(), p.c_str(), g.experts, med, ms.front(),
                   reps, rss, static_cast<unsigned long long>(stored),
                   static_cast<unsigned long long>(native_bytes));
  }
  if (last_native && last_planes) {
    const auto same_parts = [](const DeviceCsfTensor& a, const DeviceCsfTensor& b) {
      const CsfTensor x = a.download(), y = b.download();
      return x.fixed == y.fixed && x.exceptions == y.exceptions && x.row_prefix == y.row_prefix &&
             x.partition_index == y.partition_index;
    };
    const bool same = same_parts(last_native->w13_csf(), last_planes->w13_csf()) &&
                      same_parts(last_native->w2_csf(), last_planes->w2_csf()) &&
                      last_native->stage_read_index_bytes() == last_planes->stage_read_index_bytes();
    std::printf("  resident parts of both paths identical: %s\n", same ? "yes" : "NO");
    if (!same) return 1;
  }
  if (out) std::fclose(out);
  return 0;
}
