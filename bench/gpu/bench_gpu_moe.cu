// Fused MoE layer on real layer geometries against the hardware limit and a
// BF16 peer, all in one run.
//
//   bench_gpu_moe [--iters N] [--shapes ds3,kimi,qwen3] [--format nvfp4|mxfp4] [--tokens 1,8,...]
//                 [--prefill-tokens 1024,4096 | --no-prefill] [--json FILE] [--no-peer] [--no-overlap]
//                 [--timeline FILE]   (builds with -DCSFMOE_DECODE_TIMELINE=1 only)
//                 [--decode-warps 1|2|4|8] [--decode-run R] [--decode-copy 1] [--decode-kb-per-warp N]
//                 [--decode-min-kb N] [--decode-waves N]   (MoeBindOptions::tuning of every binding)
//                 [--grouped-tiles 0,16,32,64,128] [--grouped-groups 0,1,...] [--grouped-from T]
//                 [--dump-draws DIR] [--routing-one-block] [--native-only]
//
// Per shape and token count T (top-8 routing, distinct experts per token):
//   roofline  = bytes of the distinct experts the call touches (FP4 weights +
//               scales as stored: native for native/expanded/routed, CSF for
//               stage_read) / the device copy bandwidth measured here
//               (cudaMemcpy D2D, read + write counted);
//   times     = median over `iters` CUDA-graph replays of one run() each,
//               timed with CUDA events; between replays the routing ids
//               switch among 8 random sets, so the weights come from HBM, not L2
//               (every layer is several times the 50 MB L2);
//   modes     = native, expanded (scales expanded ahead), routed (expand the
//               routed experts, then GEMM), stage_read (CSF read in the GEMM),
//               each on the kernel bind() picks (the wgmma prefill kernel
//               on sm_90 from T * k >= 16 * E, where stage-read calls stay on
//               decode; decode below), and native on the tiled, the decode
//               and (T >= 256) the prefill kernel for comparison;
//   peer      = the same layer with BF16 weights through cuBLAS: per touched
//               expert a gate/up and a down GEMM (cublasGemmEx, FP32 accumulate),
//               captured in a CUDA graph; routing, SiLU and combine are not
//               counted for the peer (its time is a lower bound).
// Grouped: native on the grouped kernel forced, per token tile of
//               --grouped-tiles (0 = the call plan's choice), from T >=
//               --grouped-from (default 64); the first tile also per raster
//               group of --grouped-groups (MoeBindOptions::grouped_tile_group,
//               0 = the plan's) and routed (CSF), bitwise against native,
//               and every run against the decode kernel (relative difference).
// --grouped-ring-scales N: every binding of the run sets
//               MoeBindOptions::grouped_ring_scales to N (1: the grouped kernel
//               copies its block scales into the ring, 0: per-thread loads,
//               -1, the default: by token tile).
// --routing-one-block: native on the bound kernel again with the routing
//               in one block (MoeBindOptions::routing_chunked_min_slots =
//               0xFFFFFFFF) where the plan sorts in two passes (more than one
//               chunk of slots), timed and checked bitwise against it.
// --native-only: only native on the kernel bind() picks (the number the peer
//               tables compare); the other modes and forced kernels report 0 and
//               modes_identical null (nothing compared).
// --dump-draws DIR writes each shape's routing draws (DIR/<shape>-T<T>.bin:
//               int64 ids [8][T][k] then float32 weights [8][T][k]) for the
//               peer bench (bench/humming_peer.py).
// Prefill: FLOPs 2 * T * k * 3 * H * N over the time, against the dense BF16
// tensor rate measured here (cuBLAS 8192^3).
// Overlap: expand_scales of a whole layer on a low-priority side stream while
// a high-priority stream runs (a) a dense BF16 GEMM, (b) the first shape's
// layer call at the largest token count of the run; hidden when the pair
// takes the concurrent work's time.
// Correctness: T = 1 and 8 against the float64 CPU reference (experts are 16
// distinct synthetic ones replicated to E), all modes of one kernel bitwise
// equal; prefill calls against the decode kernel's output (relative difference).
// The JSON lines carry FNV-1a hashes of the native and stage-read outputs
// (out_hash, stage_hash), so that two builds can be compared bitwise
// (scripts/lab/gpu-ab-commits).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <execinfo.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "csfmoe/moe.hpp"
#include "csfmoe/moe_cuda.hpp"

using namespace csfmoe;

// FNV-1a 64 over the bf16 output bytes.
static unsigned long long output_hash(const std::vector<std::uint16_t>& v) {
  unsigned long long h = 1469598103934665603ull;
  for (std::uint16_t x : v) {
    h = (h ^ (x & 0xFFu)) * 1099511628211ull;
    h = (h ^ (x >> 8)) * 1099511628211ull;
  }
  return h;
}

#if CSFMOE_DECODE_TIMELINE
namespace csfmoe::moe_detail {  // src/cuda/moe/decode_launch.cu, diagnostic builds
void decode_timeline_reset();
unsigned decode_timeline_dump(std::FILE* f, const char* label);
}  // namespace csfmoe::moe_detail
#endif

namespace {

void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "bench_gpu_moe: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}
void ckb(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "bench_gpu_moe: %s: cuBLAS status %d\n", what, int(s));
    std::exit(1);
  }
}

void* dalloc(std::size_t n) {
  void* p = nullptr;
  ck(cudaMalloc(&p, n ? n : 1), "cudaMalloc");
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

__global__ void fill_bf16(__nv_bfloat16* p, std::size_t n, std::uint64_t seed) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x) {
    std::uint64_t z = (i + seed) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 31)) * 0xBF58476D1CE4E5B9ull;
    p[i] = __float2bfloat16(float(int(z >> 40) % 2001 - 1000) * 1e-4f);
  }
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0f : v[v.size() / 2];
}

struct Timer {
  cudaEvent_t a, b;
  Timer() {
    ck(cudaEventCreate(&a), "event");
    ck(cudaEventCreate(&b), "event");
  }
  template <typename Fn>
  float time_us(cudaStream_t s, Fn&& fn) {
    ck(cudaEventRecord(a, s), "record");
    fn();
    ck(cudaEventRecord(b, s), "record");
    ck(cudaEventSynchronize(b), "sync");
    float ms = 0;
    ck(cudaEventElapsedTime(&ms, a, b), "elapsed");
    return ms * 1e3f;
  }
};

double copy_bandwidth(Timer& tm) {
  const std::size_t n = std::size_t{1} << 31;
  void* a = dalloc(n);
  void* b = dalloc(n);
  ck(cudaMemset(a, 1, n), "memset");
  std::vector<float> t;
  for (int i = 0; i < 12; ++i) {
    const float us =
        tm.time_us(nullptr, [&] { ck(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice), "copy"); });
    if (i >= 2) t.push_back(us);
  }
  ck(cudaFree(a), "free");
  ck(cudaFree(b), "free");
  return 2.0 * double(n) / (double(median(t)) * 1e-6);
}

// Dense BF16 C = A * B, n x n x n, on `s`.
struct DenseGemm {
  cublasHandle_t h;
  std::size_t n;
  void *a, *b, *c;
  DenseGemm(cublasHandle_t handle, std::size_t size) : h(handle), n(size) {
    a = dalloc(n * n * 2);
    b = dalloc(n * n * 2);
    c = dalloc(n * n * 2);
    fill_bf16<<<1024, 256>>>(static_cast<__nv_bfloat16*>(a), n * n, 1);
    fill_bf16<<<1024, 256>>>(static_cast<__nv_bfloat16*>(b), n * n, 2);
  }
  void run(cudaStream_t s) {
    const float one = 1.0f, zero = 0.0f;
    ckb(cublasSetStream(h, s), "stream");
    ckb(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, int(n), int(n), int(n), &one, a, CUDA_R_16BF, int(n), b,
                     CUDA_R_16BF, int(n), &zero, c, CUDA_R_16BF, int(n), CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT),
        "dense gemm");
  }
  double flops() const { return 2.0 * double(n) * double(n) * double(n); }
  ~DenseGemm() {
    cudaFree(a);
    cudaFree(b);
    cudaFree(c);
  }
};

struct Shape {
  std::string name;
  std::uint32_t experts, hidden, intermediate, topk;
};

std::vector<std::uint32_t> parse_list(const std::string& s) {
  std::vector<std::uint32_t> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(std::uint32_t(std::stoul(item)));
  return v;
}

struct Args {
  int iters = 30;
  std::vector<std::string> shapes = {"ds3", "kimi", "qwen3"};
  ScaleFormat format = ScaleFormat::nvfp4;
  std::vector<std::uint32_t> tokens = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512};
  std::vector<std::uint32_t> prefill = {1024, 2048, 4096, 8192};
  std::string json;
  std::string timeline;  // decode block timelines of one extra replay per binding (diagnostic builds)
  bool peer = true, overlap = true;
  MoeDecodeTuning tuning;  // decode block shape overrides (-1 = auto)
  std::vector<std::uint32_t> grouped_tiles = {0};
  std::vector<std::uint32_t> grouped_groups = {0};
  std::uint32_t grouped_from = 64;
  std::string dump_draws;
  bool routing_one_block = false;
  int ring_scales = -1;
  bool native_only = false;  // --native-only: skip the comparison modes 1-7
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    const auto val = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_gpu_moe: %s needs a value\n", k.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (k == "--iters") {
      a.iters = std::stoi(val());
    } else if (k == "--shapes") {
      a.shapes.clear();
      std::stringstream ss(val());
      std::string s;
      while (std::getline(ss, s, ',')) a.shapes.push_back(s);
    } else if (k == "--format") {
      a.format = parse_scale_format(val());
    } else if (k == "--tokens") {
      a.tokens = parse_list(val());
    } else if (k == "--prefill-tokens") {
      a.prefill = parse_list(val());
    } else if (k == "--json") {
      a.json = val();
    } else if (k == "--timeline") {
      a.timeline = val();
#if !CSFMOE_DECODE_TIMELINE
      std::fprintf(stderr, "bench_gpu_moe: --timeline needs a build with -DCSFMOE_DECODE_TIMELINE=1\n");
      std::exit(2);
#endif
    } else if (k == "--decode-warps") {
      a.tuning.warps = std::stoi(val());
    } else if (k == "--decode-run") {
      a.tuning.row_block_run = std::stoi(val());
    } else if (k == "--decode-copy") {
      a.tuning.copy_kblocks = std::stoi(val());
    } else if (k == "--decode-kb-per-warp") {
      a.tuning.kblocks_per_warp = std::stoi(val());
    } else if (k == "--decode-min-kb") {
      a.tuning.min_kblocks_per_warp = std::stoi(val());
    } else if (k == "--decode-waves") {
      a.tuning.waves = std::stoi(val());
    } else if (k == "--grouped-tiles") {
      a.grouped_tiles = parse_list(val());
    } else if (k == "--grouped-groups") {
      a.grouped_groups = parse_list(val());
    } else if (k == "--grouped-from") {
      a.grouped_from = std::uint32_t(std::stoul(val()));
    } else if (k == "--dump-draws") {
      a.dump_draws = val();
    } else if (k == "--routing-one-block") {
      a.routing_one_block = true;
    } else if (k == "--native-only") {
      a.native_only = true;
    } else if (k == "--grouped-ring-scales") {
      a.ring_scales = std::stoi(val());
    } else if (k == "--no-prefill") {
      a.prefill.clear();
    } else if (k == "--no-peer") {
      a.peer = false;
    } else if (k == "--no-overlap") {
      a.overlap = false;
    } else {
      std::fprintf(stderr, "bench_gpu_moe: unknown argument %s\n", k.c_str());
      std::exit(2);
    }
  }
  try {
    validate(a.tuning);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gpu_moe: %s\n", e.what());
    std::exit(2);
  }
  return a;
}

Shape shape_of(const std::string& n) {
  if (n == "ds3") return {"DeepSeek-V3", 256, 7168, 2048, 8};
  if (n == "kimi") return {"Kimi-K2", 384, 7168, 2048, 8};
  if (n == "qwen3") return {"Qwen3-30B-A3B", 128, 2048, 768, 8};
  std::fprintf(stderr, "bench_gpu_moe: unknown shape %s (ds3, kimi, qwen3)\n", n.c_str());
  std::exit(2);
}

// One routing draw: ids, weights and per-expert token counts.
struct Draw {
  std::vector<std::int64_t> ids;
  std::vector<float> weights;
  std::vector<std::uint32_t> count;  // tokens per expert
  std::size_t distinct = 0;
};

Draw draw(std::mt19937_64& rng, std::uint32_t T, std::uint32_t E, std::uint32_t k) {
  Draw d;
  d.count.assign(E, 0);
  std::vector<std::int64_t> perm(E);
  for (std::uint32_t e = 0; e < E; ++e) perm[e] = e;
  std::uniform_real_distribution<float> w(0.05f, 1.0f);
  for (std::uint32_t t = 0; t < T; ++t)
    for (std::uint32_t j = 0; j < k; ++j) {
      std::uniform_int_distribution<std::uint32_t> pick(j, E - 1);
      std::swap(perm[j], perm[pick(rng)]);
      d.ids.push_back(perm[j]);
      d.weights.push_back(w(rng));
      d.count[perm[j]]++;
    }
  d.distinct =
      std::size_t(std::count_if(d.count.begin(), d.count.end(), [](std::uint32_t c) { return c > 0; }));
  return d;
}

// BF16 peer: per touched expert, gate/up [m, H] x [H, 2N] and down [m, N] x [N, H].
struct Bf16Peer {
  cublasHandle_t h;
  Shape s;
  void *w13, *w2, *x, *y13, *y2;
  Bf16Peer(cublasHandle_t handle, const Shape& shape, std::uint32_t max_slots) : h(handle), s(shape) {
    const std::size_t E = s.experts, H = s.hidden, N = s.intermediate;
    w13 = dalloc(E * 2 * N * H * 2);
    w2 = dalloc(E * H * N * 2);
    x = dalloc(std::size_t{max_slots} * H * 2);
    y13 = dalloc(std::size_t{max_slots} * 2 * N * 2);
    y2 = dalloc(std::size_t{max_slots} * H * 2);
    fill_bf16<<<4096, 256>>>(static_cast<__nv_bfloat16*>(w13), E * 2 * N * H, 3);
    fill_bf16<<<4096, 256>>>(static_cast<__nv_bfloat16*>(w2), E * H * N, 4);
    fill_bf16<<<1024, 256>>>(static_cast<__nv_bfloat16*>(x), std::size_t{max_slots} * H, 5);
    ck(cudaDeviceSynchronize(), "peer fill");
  }
  ~Bf16Peer() {
    cudaFree(w13);
    cudaFree(w2);
    cudaFree(x);
    cudaFree(y13);
    cudaFree(y2);
  }
  void enqueue(const Draw& d, cudaStream_t st) {
    const float one = 1.0f, zero = 0.0f;
    const std::size_t H = s.hidden, N = s.intermediate;
    ckb(cublasSetStream(h, st), "stream");
    std::size_t row = 0;
    for (std::uint32_t e = 0; e < s.experts; ++e) {
      const int m = int(d.count[e]);
      if (m == 0) continue;
      auto* we13 = static_cast<__nv_bfloat16*>(w13) + std::size_t(e) * 2 * N * H;
      auto* we2 = static_cast<__nv_bfloat16*>(w2) + std::size_t(e) * H * N;
      auto* xe = static_cast<__nv_bfloat16*>(x) + row * H;
      auto* ye13 = static_cast<__nv_bfloat16*>(y13) + row * 2 * N;
      auto* ye2 = static_cast<__nv_bfloat16*>(y2) + row * H;
      // Row-major Y[m, 2N] = X[m, H] W13^T: column-major Y^T = W13 X^T.
      ckb(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(2 * N), m, int(H), &one, we13, CUDA_R_16BF, int(H),
                       xe, CUDA_R_16BF, int(H), &zero, ye13, CUDA_R_16BF, int(2 * N), CUBLAS_COMPUTE_32F,
                       CUBLAS_GEMM_DEFAULT),
          "peer gate/up");
      // Down on the first N columns of the gate/up output (stands in for SiLU(gate) * up).
      ckb(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(H), m, int(N), &one, we2, CUDA_R_16BF, int(N), ye13,
                       CUDA_R_16BF, int(2 * N), &zero, ye2, CUDA_R_16BF, int(H), CUBLAS_COMPUTE_32F,
                       CUBLAS_GEMM_DEFAULT),
          "peer down");
      row += std::size_t(m);
    }
  }
};

struct Layer {
  Shape s;
  MoeHostWeights host;
  MoeDeviceWeights d;
  MoePlan pn, pc;
  std::unique_ptr<MoeWeights> wn, wc;
  ScaleScratch scratch{};
  std::size_t expert_fp4 = 0, expert_native_scales = 0;
  double expert_csf_scales = 0;
  static constexpr std::uint32_t kDistinct = 16;

  Layer(const Shape& shape, ScaleFormat f, std::uint32_t max_t, cudaStream_t st) : s(shape) {
    const MoeLayerGeometry g{s.experts, s.hidden, s.intermediate, s.topk, GateUpOrder::w13};
    const MoeLayerGeometry gh{kDistinct, s.hidden, s.intermediate, s.topk, GateUpOrder::w13};
    host = synthetic_moe_weights(f, gh, 7, /*fast=*/true);
    const unsigned G = group_size(f);
    const std::size_t H = s.hidden, N = s.intermediate;
    const std::size_t w13e = 2 * N * H / 2, w2e = H * N / 2, s13e = 2 * N * H / G, s2e = H * N / G;
    expert_fp4 = w13e + w2e;
    expert_native_scales = s13e + s2e;
    d.w13 = static_cast<const std::uint8_t*>(upload_replicated(host.w13.data(), w13e, kDistinct, s.experts));
    d.w2 = static_cast<const std::uint8_t*>(upload_replicated(host.w2.data(), w2e, kDistinct, s.experts));
    d.w13_scales = static_cast<const std::uint8_t*>(
        upload_replicated(host.w13_scales.data(), s13e, kDistinct, s.experts));
    d.w2_scales =
        static_cast<const std::uint8_t*>(upload_replicated(host.w2_scales.data(), s2e, kDistinct, s.experts));
    if (f == ScaleFormat::nvfp4) {
      d.w13_global =
          static_cast<const float*>(upload_replicated(host.w13_global.data(), 4, kDistinct, s.experts));
      d.w2_global =
          static_cast<const float*>(upload_replicated(host.w2_global.data(), 4, kDistinct, s.experts));
    }
    MoeConstraints c;
    c.max_tokens = max_t;
    pn = plan_weights(f, g, c);
    c.compression = ScaleCompression::csf;
    pc = plan_weights(f, g, c);
    const ScratchSizes need = moe_scale_scratch_bytes(pc);
    scratch = {static_cast<std::uint8_t*>(dalloc(need.w13)), need.w13,
               static_cast<std::uint8_t*>(dalloc(need.w2)), need.w2};
    wn = std::make_unique<MoeWeights>(prepare_weights(pn, d, nullptr, st));
    wc = std::make_unique<MoeWeights>(prepare_weights(pc, d, &scratch, st));
    expert_csf_scales = double(wc->resident_scale_bytes()) / s.experts;
  }
};

struct Row {
  std::string mode, kernel;
  float us = 0;
  double roof_us = 0;
};

// A crash names its frames on stderr (the bench runs on a remote machine).
void on_fatal_signal(int sig) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
  _exit(128 + sig);
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::signal(SIGSEGV, on_fatal_signal);
  std::signal(SIGABRT, on_fatal_signal);
  const Args args = parse(argc, argv);
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    std::printf("bench_gpu_moe: no CUDA device, nothing to time\n");
    return 0;
  }
  cudaDeviceProp prop{};
  ck(cudaGetDeviceProperties(&prop, 0), "props");
  Timer tm;
  const double bw = copy_bandwidth(tm);
  cublasHandle_t blas;
  ckb(cublasCreate(&blas), "cublasCreate");
  cudaStream_t st;
  ck(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream");
  double dense_rate = 0;
  float dense_us = 0;
  {
    DenseGemm dg(blas, 8192);
    std::vector<float> t;
    for (int i = 0; i < 12; ++i) {
      const float us = tm.time_us(st, [&] { dg.run(st); });
      if (i >= 2) t.push_back(us);
    }
    dense_us = median(t);
    dense_rate = dg.flops() / (double(dense_us) * 1e-6);
  }
  std::printf("device: %s, copy bandwidth %.0f GB/s (read+write), dense BF16 %.0f TFLOP/s (cuBLAS 8192^3)\n",
              prop.name, bw / 1e9, dense_rate / 1e12);
  std::FILE* json = args.json.empty() ? nullptr : std::fopen(args.json.c_str(), "a");
  if (!args.json.empty() && !json) {
    std::fprintf(stderr, "bench_gpu_moe: cannot open %s\n", args.json.c_str());
    return 1;
  }
  if (json)
    std::fprintf(json,
                 "{\"bench\":\"moe_device\",\"gpu\":\"%s\",\"copy_GBps\":%.1f,\"dense_bf16_TFLOPs\":%.1f}\n",
                 prop.name, bw / 1e9, dense_rate / 1e12);
  std::fflush(json);

  const MoeScaleMode modes[4] = {MoeScaleMode::native, MoeScaleMode::expanded, MoeScaleMode::routed,
                                 MoeScaleMode::stage_read};
  for (const std::string& sn : args.shapes) {
    const Shape shape = shape_of(sn);
    const bool prefill = sn == "ds3";
    std::vector<std::uint32_t> tokens = args.tokens;
    if (prefill) tokens.insert(tokens.end(), args.prefill.begin(), args.prefill.end());
    const std::uint32_t max_t = *std::max_element(tokens.begin(), tokens.end());
    std::fprintf(stderr, "bench_gpu_moe: %s: preparing the layer\n", shape.name.c_str());
    Layer layer(shape, args.format, max_t, st);
    std::fprintf(stderr, "bench_gpu_moe: %s: layer ready\n", shape.name.c_str());
    std::unique_ptr<Bf16Peer> peer;
    if (args.peer) peer = std::make_unique<Bf16Peer>(blas, shape, max_t * shape.topk);
    const std::size_t H = shape.hidden;
    const std::size_t ws_bytes = moe_workspace_bytes(layer.pc, max_t);
    void* ws = dalloc(ws_bytes);
    void* hid = dalloc(std::size_t{max_t} * H * 2);
    void* ids = dalloc(std::size_t{max_t} * shape.topk * 8);
    void* wts = dalloc(std::size_t{max_t} * shape.topk * 4);
    void* out = dalloc(std::size_t{max_t} * H * 2);
    std::printf("\n== %s: E=%u H=%u N=%u top-%u, %s; expert = %.2f MB FP4 + %.2f MB scales (CSF %.2f MB)\n",
                shape.name.c_str(), shape.experts, shape.hidden, shape.intermediate, shape.topk,
                std::string(to_string(args.format)).c_str(), layer.expert_fp4 / 1e6,
                layer.expert_native_scales / 1e6, layer.expert_csf_scales / 1e6);
    std::printf("%6s %7s %9s %9s %6s %9s %9s %9s %6s %9s %9s %7s %8s\n", "T", "experts", "roof_us", "native",
                "%roof", "expanded", "routed", "stage_rd", "%roof", "tiled", "bf16_blas", "x_blas",
                "rel_err");
    std::mt19937_64 rng(11);
    for (std::uint32_t T : tokens) {
      constexpr int kDraws = 8;
      std::vector<Draw> draws;
      for (int i = 0; i < kDraws; ++i) draws.push_back(draw(rng, T, shape.experts, shape.topk));
      void* id_sets = dalloc(std::size_t{kDraws} * T * shape.topk * 8);
      void* wt_sets = dalloc(std::size_t{kDraws} * T * shape.topk * 4);
      for (int i = 0; i < kDraws; ++i) {
        ck(cudaMemcpy(static_cast<std::int64_t*>(id_sets) + std::size_t(i) * T * shape.topk,
                      draws[i].ids.data(), draws[i].ids.size() * 8, cudaMemcpyHostToDevice),
           "ids");
        ck(cudaMemcpy(static_cast<float*>(wt_sets) + std::size_t(i) * T * shape.topk, draws[i].weights.data(),
                      draws[i].weights.size() * 4, cudaMemcpyHostToDevice),
           "weights");
      }
      if (!args.dump_draws.empty()) {
        const std::string path = args.dump_draws + "/" + sn + "-T" + std::to_string(T) + ".bin";
        std::FILE* f = std::fopen(path.c_str(), "wb");
        if (f == nullptr) {
          std::fprintf(stderr, "bench_gpu_moe: cannot write %s\n", path.c_str());
          return 1;
        }
        for (const Draw& d : draws) std::fwrite(d.ids.data(), 8, d.ids.size(), f);
        for (const Draw& d : draws) std::fwrite(d.weights.data(), 4, d.weights.size(), f);
        std::fclose(f);
      }
      std::vector<std::uint16_t> h(std::size_t{T} * H);
      std::normal_distribution<float> x(0.0f, 1.0f);
      for (auto& v : h) v = float_to_bf16(x(rng));
      ck(cudaMemcpy(hid, h.data(), h.size() * 2, cudaMemcpyHostToDevice), "hidden");
      double distinct = 0;
      for (const Draw& d : draws) distinct += double(d.distinct);
      distinct /= kDraws;
      const double roof_native = distinct * double(layer.expert_fp4 + layer.expert_native_scales) / bw * 1e6;
      const double roof_csf = distinct * (double(layer.expert_fp4) + layer.expert_csf_scales) / bw * 1e6;
      const int iters = T >= 1024 ? std::max(5, args.iters / 6) : args.iters;

      // Copies routing draw dsel into the call's ids and weights (on st).
      const auto select_draw = [&](int dsel) {
        ck(cudaMemcpyAsync(ids, static_cast<std::int64_t*>(id_sets) + std::size_t(dsel) * T * shape.topk,
                           std::size_t{T} * shape.topk * 8, cudaMemcpyDeviceToDevice, st),
           "ids");
        ck(cudaMemcpyAsync(wts, static_cast<float*>(wt_sets) + std::size_t(dsel) * T * shape.topk,
                           std::size_t{T} * shape.topk * 4, cudaMemcpyDeviceToDevice, st),
           "weights");
      };
      const int last = (iters + 2) % kDraws;  // the draw the timed replays end on

      // One graph per binding; each replay switches the routing draw first.
      const auto time_binding = [&](const BoundMoe& b, int mode) {
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        ck(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), "capture");
        run(b, hid, T, ids, IndexType::int64, static_cast<const float*>(wts), out);
        ck(cudaStreamEndCapture(st, &graph), "end capture");
        ck(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
        std::vector<float> t;
        for (int i = 0; i < iters + 3; ++i) {
          select_draw(i % kDraws);
          const float us = tm.time_us(st, [&] { ck(cudaGraphLaunch(exec, st), "launch"); });
          if (i >= 3) t.push_back(us);
        }
        // Leave the last draw's output for the checks.
        ck(cudaStreamSynchronize(st), "sync");
#if CSFMOE_DECODE_TIMELINE
        if (!args.timeline.empty()) {
          // One more replay, of the next draw (its weights not in L2), its
          // blocks recorded; then the last draw again for the checks.
          select_draw((last + 1) % kDraws);
          ck(cudaStreamSynchronize(st), "sync");
          moe_detail::decode_timeline_reset();
          const float us = tm.time_us(st, [&] { ck(cudaGraphLaunch(exec, st), "launch"); });
          ck(cudaStreamSynchronize(st), "sync");
          std::FILE* f = std::fopen(args.timeline.c_str(), "a");
          if (f == nullptr) {
            std::fprintf(stderr, "bench_gpu_moe: cannot append to %s\n", args.timeline.c_str());
            std::exit(1);
          }
          char label[160];
          std::snprintf(label, sizeof label, "\"shape\":\"%s\",\"T\":%u,\"mode\":%d,\"call_us\":%.2f",
                        shape.name.c_str(), T, mode, us);
          moe_detail::decode_timeline_dump(f, label);
          std::fclose(f);
          select_draw(last);
          ck(cudaGraphLaunch(exec, st), "launch");
          ck(cudaStreamSynchronize(st), "sync");
        }
#endif
        ck(cudaGraphExecDestroy(exec), "destroy");
        ck(cudaGraphDestroy(graph), "destroy");
        return median(t);
      };

      // 0-3: the modes on the kernel bind() picks; 4: native, tiled kernel; 5: native, decode kernel.
      // 6: native, prefill kernel forced (T >= 256 on sm_90: the crossover).
      // 7: native on the kernel bind() picks, launched in strict stream order (no PDL).
      float us[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      std::vector<std::uint16_t> outs[9];  // [8]: the grouped kernel's native output (first tile)
      std::string kernel, stage_kernel;
      bool pdl = false;  // whether bind() chains the launches on this device (m = 0)
      for (int m = 0; m < (args.native_only ? 1 : 8); ++m) {
        if (m == 5 && kernel == "decode") {
          us[5] = us[0];
          outs[5] = outs[0];
          continue;
        }
        if (m == 6 && (kernel == "prefill" || T < 256)) {
          us[6] = kernel == "prefill" ? us[0] : 0.0f;
          continue;
        }
        MoeBindOptions opt;
        opt.tuning = args.tuning;
        opt.grouped_ring_scales = args.ring_scales;
        opt.force_mode = modes[m >= 4 ? 0 : m];
        if (m == 7) opt.programmatic_launch = false;
        if (m >= 4 && m <= 6) opt.grouped_min_tokens = 0xFFFFFFFFu;  // the forced kernel, not the grouped one
        if (m == 4 || m == 5) opt.prefill_min_tokens = 0xFFFFFFFFu;
        if (m == 6) opt.prefill_min_tokens = 1;
        if (m == 4) opt.decode_max_tokens = 0;
        if (m == 5) opt.decode_max_tokens = 0xFFFFFFFFu;
        const MoeWeights& lw = (m == 0 || m >= 4) ? *layer.wn : *layer.wc;
        if (m == 7 && !pdl) continue;  // no PDL on this device: nothing to compare
        const BoundMoe b = bind(lw, st, max_t, {ws, ws_bytes}, m == 1, opt);
        if (m == 0) kernel = to_string(b.kernel_for(T));
        if (m == 0) pdl = b.programmatic_launch();
        if (m == 3) stage_kernel = to_string(b.kernel_for(T));
        if (m == 1) expand_scales(lw, st);
        us[m] = time_binding(b, m);
        outs[m].resize(h.size());
        ck(cudaMemcpy(outs[m].data(), out, h.size() * 2, cudaMemcpyDeviceToHost), "out");
      }
      // The same native call with the routing in one block where the plan
      // sorts in two passes: the same tables, so the same bits.
      float one_block_us = 0;
      bool one_block_same = true;
      if (args.routing_one_block) {
        MoeBindOptions opt;
        opt.tuning = args.tuning;
        opt.grouped_ring_scales = args.ring_scales;
        opt.force_mode = modes[0];
        const bool two_passes =
            bind(*layer.wn, st, max_t, {ws, ws_bytes}, false, opt).call_plan(T).routing_chunked;
        opt.routing_chunked_min_slots = 0xFFFFFFFFu;
        const BoundMoe b = bind(*layer.wn, st, max_t, {ws, ws_bytes}, false, opt);
        if (two_passes) one_block_us = time_binding(b, 0);
        if (one_block_us > 0) {
          std::vector<std::uint16_t> o(h.size());
          ck(cudaMemcpy(o.data(), out, h.size() * 2, cudaMemcpyDeviceToHost), "out");
          one_block_same = o == outs[0];
        }
      }
      // Modes on one kernel give identical bits; stage-read calls at prefill
      // sizes run on the decode kernel (outs[5]).
      // --native-only compares nothing (its JSON line says null).
      bool same =
          args.native_only || ((outs[7].empty() || outs[7] == outs[0]) && outs[1] == outs[0] &&
                               outs[2] == outs[0] && outs[3] == (stage_kernel == kernel ? outs[0] : outs[5]));
      // At prefill sizes the CPU reference is too slow: the prefill kernel
      // against the decode kernel (different summation order, same bound).
      double vs_decode = -1;
      const std::vector<std::uint16_t>& pre = kernel == "prefill" ? outs[0] : outs[6];
      if (!pre.empty() && !outs[5].empty()) {
        std::vector<float> a(h.size()), d(h.size());
        for (std::size_t i = 0; i < a.size(); ++i) {
          a[i] = bf16_to_float(pre[i]);
          d[i] = bf16_to_float(outs[5][i]);
        }
        vs_decode = relative_error(a, d);
      }
      // The grouped kernel forced, per token tile; the first tile also routed (CSF).
      struct GroupedRun {
        std::uint32_t tile = 0, group = 0;
        float us = 0;
        double vs_decode = -1;
      };
      std::vector<GroupedRun> grouped;
      bool grouped_same = true;
      float grouped_routed_us = 0;
      const auto run_grouped = [&](std::uint32_t tile, std::uint32_t group, bool routed) {
        MoeBindOptions opt;
        opt.force_mode = routed ? MoeScaleMode::routed : MoeScaleMode::native;
        opt.grouped_min_tokens = 1;
        opt.grouped_ring_scales = args.ring_scales;
        opt.grouped_token_tile = tile;
        opt.grouped_tile_group = group;
        const BoundMoe b = bind(routed ? *layer.wc : *layer.wn, st, max_t, {ws, ws_bytes}, false, opt);
        if (b.kernel_for(T) != MoeKernel::grouped) return false;  // not on this device or shape
        const float t_us = time_binding(b, 8);
        std::vector<std::uint16_t> o(h.size());
        ck(cudaMemcpy(o.data(), out, h.size() * 2, cudaMemcpyDeviceToHost), "out");
        if (routed) {
          grouped_routed_us = t_us;
          grouped_same = grouped_same && o == outs[8];
          return true;
        }
        GroupedRun r;
        r.tile = b.call_plan(T).token_tile;
        r.group = b.call_plan(T).tile_group;
        r.us = t_us;
        if (!outs[5].empty()) {
          std::vector<float> a(h.size()), d(h.size());
          for (std::size_t i = 0; i < a.size(); ++i) {
            a[i] = bf16_to_float(o[i]);
            d[i] = bf16_to_float(outs[5][i]);
          }
          r.vs_decode = relative_error(a, d);
        }
        if (outs[8].empty())
          outs[8] = o;
        else  // every tile and group: same inputs, other summation blocks; same bits across groups
          grouped_same = grouped_same && (r.tile != grouped.front().tile || o == outs[8]);
        grouped.push_back(r);
        return true;
      };
      if (T >= args.grouped_from) {
        bool runs = true;
        for (std::size_t gi = 0; gi < args.grouped_groups.size() && runs; ++gi)
          runs = run_grouped(args.grouped_tiles[0], args.grouped_groups[gi], false);
        if (runs) run_grouped(args.grouped_tiles[0], args.grouped_groups[0], true);
        for (std::size_t ti = 1; ti < args.grouped_tiles.size() && runs; ++ti)
          run_grouped(args.grouped_tiles[ti], args.grouped_groups[0], false);
      }
      float peer_us = 0;
      if (peer) {
        std::vector<float> t;
        for (int i = 0; i < kDraws; ++i) {
          cudaGraph_t graph;
          cudaGraphExec_t exec;
          ck(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), "capture");
          peer->enqueue(draws[i], st);
          ck(cudaStreamEndCapture(st, &graph), "end capture");
          ck(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
          const int reps = std::max(2, iters / kDraws + 1);
          for (int r = 0; r < reps + 1; ++r) {
            const float u = tm.time_us(st, [&] { ck(cudaGraphLaunch(exec, st), "launch"); });
            if (r > 0) t.push_back(u);
          }
          ck(cudaGraphExecDestroy(exec), "destroy");
          ck(cudaGraphDestroy(graph), "destroy");
        }
        peer_us = median(t);
      }
      std::string err = "-";
      double err_v = -1;
      if (T == 1 || T == 8) {
        std::vector<std::int64_t> id16(draws[last].ids);
        for (auto& v : id16) v %= Layer::kDistinct;
        std::vector<float> ref(h.size()), got(h.size());
        moe_reference(layer.host, h, T, id16, draws[last].weights, ref);
        for (std::size_t i = 0; i < got.size(); ++i) got[i] = bf16_to_float(outs[0][i]);
        err_v = relative_error(got, ref);
        char buf[32];
        std::snprintf(buf, sizeof buf, "%.2e", err_v);
        err = buf;
      }
      const double flops = 2.0 * T * shape.topk * 3.0 * double(shape.hidden) * shape.intermediate;
      std::printf("%6u %7.1f %9.1f %9.1f %6.1f %9.1f %9.1f %9.1f %6.1f %9.1f %9.1f %7.2f %8s %s%s\n", T,
                  distinct, roof_native, us[0], 100.0 * roof_native / us[0], us[1], us[2], us[3],
                  100.0 * roof_csf / us[3], us[4], peer_us, peer_us > 0 ? peer_us / us[0] : 0.0, err.c_str(),
                  kernel.c_str(), same ? "" : "  MODES DIFFER");
      if (us[7] > 0)
        std::printf("%6s native without programmatic launch: %.1f us (PDL saves %.1f%%)\n", "", us[7],
                    100.0 * (1.0 - us[0] / us[7]));
      if (one_block_us > 0)
        std::printf("%6s native with the routing in one block: %.1f us (x%.3f)%s\n", "", one_block_us,
                    one_block_us / us[0], one_block_same ? ", bitwise equal" : "  ROUTING DIFFERS");
      if (T >= 256 && !args.native_only) {
        std::printf(
            "%6s prefill: native %.1f TFLOP/s = %.1f%% of dense BF16; tiled kernel %.1f, decode kernel %.1f "
            "TFLOP/s (%.1f us)",
            "", flops / (us[0] * 1e-6) / 1e12, 100.0 * flops / (us[0] * 1e-6) / dense_rate,
            flops / (us[4] * 1e-6) / 1e12, flops / (us[5] * 1e-6) / 1e12, us[5]);
        if (us[6] > 0)
          std::printf(", prefill kernel %.1f TFLOP/s (%.1f us)", flops / (us[6] * 1e-6) / 1e12, us[6]);
        if (vs_decode >= 0) std::printf("; relative difference to the decode kernel %.2e", vs_decode);
        std::printf("\n");
      }
      for (const GroupedRun& r : grouped)
        std::printf(
            "%6s grouped tile %3u group %3u: %.1f us = %.1f%% of roofline, %.1f TFLOP/s, x%.2f vs the bound "
            "kernel; rel. diff to decode %.2e\n",
            "", r.tile, r.group, r.us, 100.0 * roof_native / r.us, flops / (r.us * 1e-6) / 1e12, us[0] / r.us,
            r.vs_decode);
      if (!grouped.empty())
        std::printf("%6s grouped routed (CSF): %.1f us%s\n", "", grouped_routed_us,
                    grouped_same ? ", bitwise equal to native" : "  GROUPED MODES DIFFER");
      if (json)
        for (const GroupedRun& r : grouped)
          std::fprintf(
              json,
              "{\"bench\":\"moe_grouped\",\"shape\":\"%s\",\"format\":\"%s\",\"T\":%u,\"tile\":%u,"
              "\"group\":%u,\"us\":%.2f,\"roof_native_us\":%.2f,\"flops\":%.4g,\"bound_kernel\":\"%s\","
              "\"bound_us\":%.2f,\"routed_us\":%.2f,\"modes_identical\":%s,\"rel_diff_decode\":%.3g}\n",
              shape.name.c_str(), std::string(to_string(args.format)).c_str(), T, r.tile, r.group, r.us,
              roof_native, flops, kernel.c_str(), us[0], grouped_routed_us, grouped_same ? "true" : "false",
              r.vs_decode);
      if (json)
        std::fprintf(json,
                     "{\"bench\":\"moe_layer\",\"shape\":\"%s\",\"format\":\"%s\",\"T\":%u,\"experts\":%.2f,"
                     "\"kernel\":\"%s\",\"roof_native_us\":%.2f,\"roof_csf_us\":%.2f,\"native_us\":%.2f,"
                     "\"expanded_us\":%.2f,\"routed_us\":%.2f,\"stage_read_us\":%.2f,\"tiled_us\":%.2f,"
                     "\"decode_us\":%.2f,\"prefill_us\":%.2f,\"serial_us\":%.2f,"
                     "\"bf16_cublas_us\":%.2f,\"flops\":%.4g,\"dense_bf16_TFLOPs\":%.1f,\"copy_GBps\":%.1f,"
                     "\"rel_err\":%.3g,\"rel_diff_decode\":%.3g,\"modes_identical\":%s,"
                     "\"routing_one_block_us\":%.2f,\"routing_one_block_identical\":%s,"
                     "\"out_hash\":\"%016llx\",\"stage_hash\":\"%016llx\"}\n",
                     shape.name.c_str(), std::string(to_string(args.format)).c_str(), T, distinct,
                     kernel.c_str(), roof_native, roof_csf, us[0], us[1], us[2], us[3], us[4], us[5], us[6],
                     us[7], peer_us, flops, dense_rate / 1e12, bw / 1e9, err_v, vs_decode,
                     args.native_only ? "null"
                     : same           ? "true"
                                      : "false",
                     one_block_us, one_block_same ? "true" : "false", output_hash(outs[0]),
                     output_hash(outs[3]));
      std::fflush(json);
      ck(cudaFree(id_sets), "free");
      ck(cudaFree(wt_sets), "free");
    }

    if (args.overlap && sn == args.shapes.front()) {
      // expand_scales of the whole layer (the CSF binding's scratch) on a
      // side stream of the lowest priority against a concurrent call on a
      // stream of the highest: (a) a dense BF16 GEMM (cuBLAS), (b) this
      // layer's native call at the largest prefill size run here (the
      // scenario of expanding the next layer while this one runs).
      int least = 0, greatest = 0;
      ck(cudaDeviceGetStreamPriorityRange(&least, &greatest), "priorities");
      cudaStream_t hi, lo;
      ck(cudaStreamCreateWithPriority(&hi, cudaStreamNonBlocking, greatest), "stream");
      ck(cudaStreamCreateWithPriority(&lo, cudaStreamNonBlocking, least), "stream");
      cudaEvent_t done;
      ck(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "event");
      // work: the concurrent work, enqueued on hi.
      const auto overlap = [&](const std::string& against, std::uint32_t T,
                               const std::function<void()>& work) {
        for (const std::uint32_t per_sm : {0u, 1u}) {  // ExpandLaunch: every SM full, or background
          const ExpandLaunch launch{per_sm};
          std::vector<float> alone, expand, both;
          for (int i = 0; i < 12; ++i) {
            const float a = tm.time_us(hi, [&] { work(); });
            const float e = tm.time_us(lo, [&] { expand_scales(*layer.wc, lo, launch); });
            const float b = tm.time_us(hi, [&] {
              // lo joins the timed region through the start event, hi waits for it at the end.
              ck(cudaStreamWaitEvent(lo, tm.a), "wait");
              expand_scales(*layer.wc, lo, launch);
              ck(cudaEventRecord(done, lo), "record");
              work();
              ck(cudaStreamWaitEvent(hi, done), "wait");
            });
            if (i >= 2) {
              alone.push_back(a);
              expand.push_back(e);
              both.push_back(b);
            }
          }
          const float hidden =
              100.0f * (1.0f - (median(both) - median(alone)) / std::max(median(expand), 1e-3f));
          const std::string how = per_sm == 0 ? "every SM" : "1 block per SM";
          std::printf(
              "\noverlap against %s: alone %.1f us, expand_scales (whole layer, %s) alone %.1f us, both on "
              "two streams %.1f us -> %.1f%% of the expansion hidden\n",
              against.c_str(), median(alone), how.c_str(), median(expand), median(both), hidden);
          if (json)
            std::fprintf(json,
                         "{\"bench\":\"moe_overlap\",\"shape\":\"%s\",\"against\":\"%s\",\"T\":%u,"
                         "\"expand_blocks_per_sm\":%u,\"gemm_us\":%.2f,\"expand_us\":%.2f,\"both_us\":%.2f,"
                         "\"hidden\":%.4f}\n",
                         shape.name.c_str(), against.c_str(), T, per_sm, median(alone), median(expand),
                         median(both), hidden / 100.0f);
          std::fflush(json);
        }
      };
      {
        DenseGemm dg(blas, 8192);
        overlap("dense BF16 GEMM 8192^3", 0, [&] { dg.run(hi); });
      }
      // The layer call: native weights, the kernel bind() picks, routing drawn once.
      const std::uint32_t T = max_t;
      const Draw d = draw(rng, T, shape.experts, shape.topk);
      ck(cudaMemcpy(ids, d.ids.data(), d.ids.size() * 8, cudaMemcpyHostToDevice), "ids");
      ck(cudaMemcpy(wts, d.weights.data(), d.weights.size() * 4, cudaMemcpyHostToDevice), "weights");
      std::vector<std::uint16_t> h(std::size_t{T} * H);
      std::normal_distribution<float> x(0.0f, 1.0f);
      for (auto& v : h) v = float_to_bf16(x(rng));
      ck(cudaMemcpy(hid, h.data(), h.size() * 2, cudaMemcpyHostToDevice), "hidden");
      MoeBindOptions opt;
      opt.tuning = args.tuning;
      opt.grouped_ring_scales = args.ring_scales;
      const BoundMoe b = bind(*layer.wn, hi, max_t, {ws, ws_bytes}, false, opt);
      // b is bound to hi: the call runs there.
      overlap("the " + shape.name + " layer call, T = " + std::to_string(T) + " (" +
                  std::string(to_string(b.kernel_for(T))) + " kernel)",
              T, [&] { run(b, hid, T, ids, IndexType::int64, static_cast<const float*>(wts), out); });
      ck(cudaEventDestroy(done), "event");
      ck(cudaStreamDestroy(hi), "stream");
      ck(cudaStreamDestroy(lo), "stream");
    }
    for (void* p : {ws, hid, ids, wts, out}) ck(cudaFree(p), "free");
    for (const void* p :
         {static_cast<const void*>(layer.d.w13), static_cast<const void*>(layer.d.w2),
          static_cast<const void*>(layer.d.w13_scales), static_cast<const void*>(layer.d.w2_scales),
          static_cast<const void*>(layer.d.w13_global), static_cast<const void*>(layer.d.w2_global),
          static_cast<const void*>(layer.scratch.w13), static_cast<const void*>(layer.scratch.w2)})
      if (p) ck(cudaFree(const_cast<void*>(p)), "free");
  }
  if (json) std::fclose(json);
  ckb(cublasDestroy(blas), "cublasDestroy");
  return 0;
}
