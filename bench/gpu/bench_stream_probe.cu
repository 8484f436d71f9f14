// Read-only stream ceiling of the device: how fast one kernel launch can read
// S bytes it has not touched before, for S from a Qwen3 decode layer (~20 MB)
// to well past the L2, against the cudaMemcpy copy bandwidth that
// bench_gpu_moe takes as the roofline (bytes read + written / time).
//
// The decode MoE kernels are read streams of 20-200 MB in launches of
// 10-60 us, so launch ramp-up and drain are a real part of their time; this
// bench measures what a plain coalesced read reaches at those sizes, i.e. the
// part of the roofline no kernel layout can recover.
//
//   bench_stream_probe [--iters N] [--json FILE]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/primitives/cuda_check.hpp"

namespace {

// Every thread reads kUnroll independent 16-byte words per step, grid-stride
// over the region; the XOR keeps the loads alive, the impossible store keeps
// the XOR alive.
constexpr int kUnroll = 4;
__global__ void read_linear(const uint4* __restrict__ src, std::size_t words, unsigned* sink) {
  std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x;
  const std::size_t stride = std::size_t(gridDim.x) * blockDim.x;
  unsigned x = 0;
  for (; i + (kUnroll - 1) * stride < words; i += kUnroll * stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = __ldcs(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) x ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < words; i += stride) {
    const uint4 v = __ldcs(src + i);
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x9E3779B9u) *sink = x;
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int run(int argc, char** argv) {
  int iters = 30;
  const char* json = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--iters") && i + 1 < argc)
      iters = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--json") && i + 1 < argc)
      json = argv[++i];
    else {
      std::fprintf(stderr, "usage: bench_stream_probe [--iters N] [--json FILE]\n");
      return 2;
    }
  }
  int dev_count = 0;
  if (cudaGetDeviceCount(&dev_count) != cudaSuccess || dev_count == 0) {
    std::printf("bench_stream_probe: no CUDA device, nothing measured\n");
    return 0;
  }
  cudaDeviceProp prop{};
  CSFMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const std::size_t pool = std::size_t{4} << 30;  // regions rotate through it: every read is cold in L2
  unsigned char* buf = nullptr;
  unsigned* sink = nullptr;
  CSFMOE_CUDA_CHECK(cudaMalloc(&buf, pool));
  CSFMOE_CUDA_CHECK(cudaMalloc(&sink, 4));
  CSFMOE_CUDA_CHECK(cudaMemset(buf, 0x5A, pool));
  cudaEvent_t a, b;
  CSFMOE_CUDA_CHECK(cudaEventCreate(&a));
  CSFMOE_CUDA_CHECK(cudaEventCreate(&b));
  const auto time_us = [&](auto&& fn) {
    CSFMOE_CUDA_CHECK(cudaEventRecord(a));
    fn();
    CSFMOE_CUDA_CHECK(cudaEventRecord(b));
    CSFMOE_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CSFMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    return ms * 1e3f;
  };

  // Roofline of bench_gpu_moe: 2 GiB device-to-device copy, (read + write) / time.
  std::vector<float> t;
  const std::size_t half = pool / 2;
  for (int i = 0; i < 12; ++i) {
    const float us =
        time_us([&] { CSFMOE_CUDA_CHECK(cudaMemcpyAsync(buf + half, buf, half, cudaMemcpyDeviceToDevice)); });
    if (i >= 2) t.push_back(us);
  }
  const double copy_gbs = 2.0 * double(half) / (double(median(t)) * 1e-6) / 1e9;
  std::printf("device: %s, %d SMs, copy bandwidth %.0f GB/s (read + write)\n", prop.name,
              prop.multiProcessorCount, copy_gbs);
  FILE* out = json ? std::fopen(json, "a") : nullptr;

  const std::size_t sizes_mb[] = {20, 66, 132, 198, 512, 2048};
  const int blocks_per_sm[] = {4, 8};
  for (const std::size_t mb : sizes_mb) {
    const std::size_t bytes = mb << 20, regions = pool / bytes;
    for (const int bps : blocks_per_sm) {
      const unsigned grid = unsigned(prop.multiProcessorCount * bps), threads = 2048 / bps;
      // kBatch launches back to back between the events, each on its own
      // region: the launch gaps are those of a layer's kernel chain, not of a
      // host round trip.
      constexpr int kBatch = 8;
      std::vector<float> times;
      std::size_t region = 0;
      for (int i = 0; i < iters + 3; ++i) {
        const float us = time_us([&] {
          for (int j = 0; j < kBatch; ++j, region = (region + 1) % regions)
            read_linear<<<grid, threads>>>(reinterpret_cast<const uint4*>(buf + region * bytes), bytes / 16,
                                           sink);
        });
        CSFMOE_CUDA_CHECK_LAUNCH("read_linear launch");
        if (i >= 3) times.push_back(us / kBatch);
      }
      const double us = median(times), ideal_us = double(bytes) / (copy_gbs * 1e9) * 1e6;
      std::printf(
          "read %5zu MiB, %2d blocks x %4u threads per SM: %9.1f us, %6.0f GB/s = %5.1f %% of the copy "
          "roofline\n",
          mb, bps, threads, us, double(bytes) / (us * 1e-6) / 1e9, 100.0 * ideal_us / us);
      if (out)
        std::fprintf(
            out,
            "{\"bench\":\"stream_probe\",\"gpu\":\"%s\",\"bytes\":%zu,\"blocks_per_sm\":%d,\"us\":%.2f,"
            "\"copy_GBps\":%.1f,\"of_roofline\":%.4f}\n",
            prop.name, bytes, bps, us, copy_gbs, ideal_us / us);
    }
  }
  if (out) std::fclose(out);
  return 0;
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_stream_probe: %s\n", e.what());
    return 1;
  }
}
