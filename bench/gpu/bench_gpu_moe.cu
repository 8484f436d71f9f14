// First timing of the fused MoE layer on a DeepSeek-V3 layer (E=256, H=7168,
// N=2048, k=8, NVFP4) at T = 1, 8, 64 for every scale mode, against the
// roofline: distinct routed experts' weight + native scale bytes over the
// measured device copy bandwidth (read + write counted).
//
// Usage: bench_gpu_moe [iters=30] [format=nvfp4|mxfp4]
// Weights: 16 distinct synthetic experts (uniform E2M1 codes, "realistic"
// scale grids) replicated to 256 so the layer has the real size; errors are
// checked against the CPU reference for T = 1 and 8.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "csfmoe/moe.hpp"
#include "csfmoe/moe_cuda.hpp"

using namespace csfmoe;

namespace {

void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "bench_gpu_moe: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

void* dalloc(std::size_t n) {
  void* p = nullptr;
  ck(cudaMalloc(&p, n), "cudaMalloc");
  return p;
}

// Replicates `per` bytes per expert from the first `have` experts to `want`.
void* upload_replicated(const void* host, std::size_t per, std::size_t have, std::size_t want) {
  auto* d = static_cast<unsigned char*>(dalloc(per * want));
  for (std::size_t e = 0; e < want; ++e)
    ck(cudaMemcpy(d + e * per, static_cast<const unsigned char*>(host) + (e % have) * per, per,
                  cudaMemcpyHostToDevice),
       "upload");
  return d;
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double copy_bandwidth() {
  const std::size_t n = std::size_t{1} << 31;
  void* a = dalloc(n);
  void* b = dalloc(n);
  ck(cudaMemset(a, 1, n), "memset");
  cudaEvent_t e0, e1;
  ck(cudaEventCreate(&e0), "ev");
  ck(cudaEventCreate(&e1), "ev");
  std::vector<float> t;
  for (int i = 0; i < 12; ++i) {
    ck(cudaEventRecord(e0), "rec");
    ck(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice), "copy");
    ck(cudaEventRecord(e1), "rec");
    ck(cudaEventSynchronize(e1), "sync");
    float ms = 0;
    ck(cudaEventElapsedTime(&ms, e0, e1), "elapsed");
    if (i >= 2) t.push_back(ms);
  }
  ck(cudaFree(a), "free");
  ck(cudaFree(b), "free");
  return 2.0 * double(n) / (double(median(t)) * 1e-3);
}

}  // namespace

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 30;
  const ScaleFormat f = argc > 2 ? parse_scale_format(argv[2]) : ScaleFormat::nvfp4;
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    std::printf("bench_gpu_moe: no CUDA device, nothing to time\n");
    return 0;
  }
  cudaDeviceProp prop{};
  ck(cudaGetDeviceProperties(&prop, 0), "props");
  const double bw = copy_bandwidth();
  std::printf("device: %s, copy bandwidth %.0f GB/s (read+write)\n", prop.name, bw / 1e9);

  const std::uint32_t E = 256, distinct = 16, H = 7168, N = 2048, K = 8;
  const MoeLayerGeometry g{E, H, N, K, GateUpOrder::w13};
  const MoeLayerGeometry gh{distinct, H, N, K, GateUpOrder::w13};
  const MoeHostWeights hw = synthetic_moe_weights(f, gh, 7, /*fast=*/true);
  const unsigned G = group_size(f);
  const std::size_t w13e = std::size_t{2} * N * H / 2, w2e = std::size_t{H} * N / 2;
  const std::size_t s13e = std::size_t{2} * N * H / G, s2e = std::size_t{H} * N / G;
  MoeDeviceWeights d;
  d.w13 = static_cast<const std::uint8_t*>(upload_replicated(hw.w13.data(), w13e, distinct, E));
  d.w2 = static_cast<const std::uint8_t*>(upload_replicated(hw.w2.data(), w2e, distinct, E));
  d.w13_scales = static_cast<const std::uint8_t*>(upload_replicated(hw.w13_scales.data(), s13e, distinct, E));
  d.w2_scales = static_cast<const std::uint8_t*>(upload_replicated(hw.w2_scales.data(), s2e, distinct, E));
  if (f == ScaleFormat::nvfp4) {
    d.w13_global = static_cast<const float*>(upload_replicated(hw.w13_global.data(), 4, distinct, E));
    d.w2_global = static_cast<const float*>(upload_replicated(hw.w2_global.data(), 4, distinct, E));
  }
  const std::uint32_t max_t = 64;
  MoeConstraints c;
  c.max_tokens = max_t;
  const MoePlan pn = plan_weights(f, g, c);
  c.compression = ScaleCompression::csf;
  const MoePlan pc = plan_weights(f, g, c);
  const ScratchSizes need = moe_scale_scratch_bytes(pc);
  ScaleScratch scratch{static_cast<std::uint8_t*>(dalloc(need.w13)), need.w13,
                       static_cast<std::uint8_t*>(dalloc(need.w2)), need.w2};
  cudaStream_t s;
  ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  const MoeWeights wn = prepare_weights(pn, d, nullptr, s);
  const MoeWeights wc = prepare_weights(pc, d, &scratch, s);
  std::printf("scales resident: native %.1f MB, CSF %.1f MB\n", wn.resident_scale_bytes() / 1e6,
              wc.resident_scale_bytes() / 1e6);
  const std::size_t ws_bytes = moe_workspace_bytes(pc, max_t);
  void* ws = dalloc(ws_bytes);
  void* hid = dalloc(std::size_t{max_t} * H * 2);
  void* ids = dalloc(std::size_t{max_t} * K * 8);
  void* wts = dalloc(std::size_t{max_t} * K * 4);
  void* out = dalloc(std::size_t{max_t} * H * 2);
  cudaEvent_t e0, e1;
  ck(cudaEventCreate(&e0), "ev");
  ck(cudaEventCreate(&e1), "ev");

  std::printf("\n%6s %9s %12s %12s %12s %12s %12s %10s\n", "T", "experts", "roofline_us", "native_us",
              "expanded_us", "routed_us", "stage_rd_us", "rel_err");
  std::mt19937_64 rng(11);
  for (std::uint32_t T : {1u, 8u, 64u}) {
    std::vector<std::uint16_t> h(std::size_t{T} * H);
    std::normal_distribution<float> x(0.0f, 1.0f);
    for (auto& v : h) v = float_to_bf16(x(rng));
    std::vector<std::int64_t> id;
    std::vector<float> w;
    std::vector<char> used(E, 0);
    for (std::uint32_t t = 0; t < T; ++t) {
      std::vector<std::int64_t> perm(E);
      for (std::uint32_t e = 0; e < E; ++e) perm[e] = e;
      std::shuffle(perm.begin(), perm.end(), rng);
      for (std::uint32_t j = 0; j < K; ++j) {
        id.push_back(perm[j]);
        used[perm[j]] = 1;
        w.push_back(std::uniform_real_distribution<float>(0.05f, 1.0f)(rng));
      }
    }
    const std::size_t nd = std::count(used.begin(), used.end(), 1);
    const double roof_us = double(nd) * double(w13e + w2e + s13e + s2e) / bw * 1e6;
    ck(cudaMemcpy(hid, h.data(), h.size() * 2, cudaMemcpyHostToDevice), "h");
    ck(cudaMemcpy(ids, id.data(), id.size() * 8, cudaMemcpyHostToDevice), "ids");
    ck(cudaMemcpy(wts, w.data(), w.size() * 4, cudaMemcpyHostToDevice), "w");
    float times[4] = {0, 0, 0, 0};
    std::vector<std::uint16_t> outs[4];
    const MoeScaleMode modes[4] = {MoeScaleMode::native, MoeScaleMode::expanded, MoeScaleMode::routed,
                                   MoeScaleMode::stage_read};
    for (int m = 0; m < 4; ++m) {
      MoeBindOptions opt;
      opt.force_mode = modes[m];
      const MoeWeights& lw = m == 0 ? wn : wc;
      const BoundMoe b = bind(lw, s, max_t, {ws, ws_bytes}, m == 1, opt);
      if (m == 1) expand_scales(lw, s);
      std::vector<float> t;
      for (int i = 0; i < iters + 3; ++i) {
        ck(cudaEventRecord(e0, s), "rec");
        run(b, hid, T, ids, IndexType::int64, static_cast<const float*>(wts), out);
        ck(cudaEventRecord(e1, s), "rec");
        ck(cudaEventSynchronize(e1), "sync");
        float ms = 0;
        ck(cudaEventElapsedTime(&ms, e0, e1), "elapsed");
        if (i >= 3) t.push_back(ms);
      }
      times[m] = median(t) * 1e3f;
      outs[m].resize(h.size());
      ck(cudaMemcpy(outs[m].data(), out, h.size() * 2, cudaMemcpyDeviceToHost), "out");
    }
    bool same = true;
    for (int m = 1; m < 4; ++m) same = same && outs[m] == outs[0];
    std::string err = "-";
    if (T <= 8) {
      // Replicated experts: expert e holds the data of e % 16.
      std::vector<std::int64_t> id16(id);
      for (auto& v : id16) v %= distinct;
      std::vector<float> ref(h.size()), got(h.size());
      moe_reference(hw, h, T, id16, w, ref);
      for (std::size_t i = 0; i < got.size(); ++i) got[i] = bf16_to_float(outs[0][i]);
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.2e", relative_error(got, ref));
      err = buf;
    }
    std::printf("%6u %9zu %12.1f %12.1f %12.1f %12.1f %12.1f %10s%s\n", T, nd, roof_us, times[0], times[1],
                times[2], times[3], err.c_str(), same ? "" : "  MODES DIFFER");
  }
  return 0;
}
