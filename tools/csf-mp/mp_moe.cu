// csf-mp: one process per GPU runs one MoE layer tensor- or expert-parallel
// through NCCL, checks it against the single-GPU layer on its own device
// (and optionally the CPU float64 reference), and times it per call.
// Launched by scripts/mp-moe; see docs/multi-gpu.md. Prints one JSON line
// per rank and token count; exits 1 when an error bound is exceeded.
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "csfmoe/errors.hpp"
#include "csfmoe/moe_nccl.hpp"
#include "cuda/primitives/cuda_check.hpp"

using namespace csfmoe;

namespace {

template <class T>
T* upload(const std::vector<T>& v) {
  void* p = nullptr;
  CSFMOE_CUDA_CHECK(cudaMalloc(&p, std::max<std::size_t>(v.size(), 1) * sizeof(T)));
  CSFMOE_CUDA_CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return static_cast<T*>(p);
}

// A layer on this GPU: weights, prepared layer and a binding (kept in place: the binding points into it).
struct Layer {
  std::vector<void*> owned;
  std::unique_ptr<MoeWeights> w;
  std::unique_ptr<BoundMoe> b;
  Layer(const MoeHostWeights& h, std::uint32_t max_tokens, cudaStream_t s, int device) {
    MoeConstraints c;
    c.max_tokens = max_tokens;
    const MoePlan plan = plan_weights(h.format, h.geometry, c);
    MoeDeviceWeights d;
    d.device = device;
    d.w13 = upload(h.w13);
    d.w13_scales = upload(h.w13_scales);
    d.w2 = upload(h.w2);
    d.w2_scales = upload(h.w2_scales);
    if (h.format == ScaleFormat::nvfp4) {
      d.w13_global = upload(h.w13_global);
      d.w2_global = upload(h.w2_global);
    }
    for (const void* p : {(const void*)d.w13, (const void*)d.w13_scales, (const void*)d.w2,
                          (const void*)d.w2_scales, (const void*)d.w13_global, (const void*)d.w2_global})
      if (p) owned.push_back(const_cast<void*>(p));
    w = std::make_unique<MoeWeights>(prepare_weights(plan, d, nullptr, s));
    MoeWorkspace ws;
    ws.bytes = moe_workspace_bytes(plan, max_tokens);
    CSFMOE_CUDA_CHECK(cudaMalloc(&ws.data, std::max<std::uint64_t>(ws.bytes, 256)));
    owned.push_back(ws.data);
    b = std::make_unique<BoundMoe>(bind(*w, s, max_tokens, ws, false));
  }
  ~Layer() {
    b.reset();
    w.reset();
    for (void* p : owned) (void)cudaFree(p);
  }
};

double rel_bf16(const std::vector<std::uint16_t>& a, const std::vector<float>& ref) {
  std::vector<float> af(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) af[i] = bf16_to_float(a[i]);
  return relative_error(af, ref);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"csf-mp: tensor/expert-parallel MoE layer over NCCL, one process per GPU"};
  std::string mode = "tp", format = "nvfp4", id_file, tokens_arg = "1,8,128,1024";
  int rank = 0, world = 1, device = -1;
  std::uint32_t E = 16, H = 2048, N = 1024, k = 4, iters = 20;
  std::uint64_t seed = 1;
  bool cpu_check = false;
  double tol = 2e-2;
  app.add_option("--mode", mode, "tp or ep")->check(CLI::IsMember({"tp", "ep"}));
  app.add_option("--rank", rank, "this process's rank")->required();
  app.add_option("--world", world, "number of processes (GPUs)")->required();
  app.add_option("--device", device, "CUDA device (default: rank modulo the visible devices)");
  app.add_option("--id-file", id_file, "file in a shared folder for the NCCL unique id")->required();
  app.add_option("--format", format)->check(CLI::IsMember({"nvfp4", "mxfp4"}));
  app.add_option("--experts", E);
  app.add_option("--hidden", H);
  app.add_option("--intermediate", N);
  app.add_option("--topk", k);
  app.add_option("--tokens", tokens_arg, "comma-separated token counts (decode: 1..8, prefill: larger)");
  app.add_option("--iters", iters);
  app.add_option("--seed", seed);
  app.add_option("--tol", tol, "largest relative error against the single-GPU layer");
  app.add_flag("--cpu-check", cpu_check, "also compare with the CPU float64 reference (small layers)");
  CLI11_PARSE(app, argc, argv);
  try {
    std::vector<std::uint32_t> tokens;
    for (std::size_t p = 0; p < tokens_arg.size();) {
      const std::size_t q = std::min(tokens_arg.find(',', p), tokens_arg.size());
      tokens.push_back(std::uint32_t(std::stoul(tokens_arg.substr(p, q - p))));
      p = q + 1;
    }
    const std::uint32_t max_t = *std::max_element(tokens.begin(), tokens.end());
    int ndev = 0;
    CSFMOE_CUDA_CHECK(cudaGetDeviceCount(&ndev));
    if (device < 0) device = rank % std::max(ndev, 1);
    NcclContext ctx = nccl_init_from_file(id_file, rank, world, device);
    cudaStream_t s;
    CSFMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const ScaleFormat f = parse_scale_format(format);
    const MoeLayerGeometry g{E, H, N, k, GateUpOrder::w13};
    // Every rank draws the same layer (same seed) and keeps its part.
    const MoeHostWeights full = synthetic_moe_weights(f, g, seed, /*fast=*/!cpu_check);
    Layer single(full, max_t, s, device);
    std::unique_ptr<Layer> local;
    std::unique_ptr<ExpertParallelMoe> ep;
    if (mode == "tp") {
      local = std::make_unique<Layer>(slice_tensor_parallel(full, unsigned(world), unsigned(rank)), max_t, s,
                                      device);
    } else {
      MoeHostWeights part = slice_expert_parallel(full, unsigned(world), unsigned(rank));
      part.geometry.topk = 1;
      const std::uint32_t max_recv = std::uint32_t(std::uint64_t{max_t} * k * unsigned(world));
      local = std::make_unique<Layer>(part, max_recv, s, device);
      ep = std::make_unique<ExpertParallelMoe>(ctx, *local->b, E, H, k, max_t);
    }
    // Inputs: TP ranks share the tokens; EP ranks each bring their own (data-parallel attention).
    std::mt19937_64 rng(seed * 7919 + (mode == "ep" ? unsigned(rank) + 1 : 0));
    std::normal_distribution<float> xd(0.f, 1.f);
    std::uniform_int_distribution<std::int32_t> idd(0, std::int32_t(E) - 1);
    std::uniform_real_distribution<float> wd(0.05f, 1.f);
    std::vector<std::uint16_t> hx(std::uint64_t{max_t} * H);
    std::vector<std::int32_t> hid(std::uint64_t{max_t} * k);
    std::vector<float> hw(hid.size());
    for (auto& x : hx) x = float_to_bf16(xd(rng));
    for (auto& i : hid) i = idd(rng);
    for (auto& w : hw) w = wd(rng);
    auto* dx = upload(hx);
    auto* dids = upload(hid);
    auto* dw = upload(hw);
    std::uint16_t *dout = nullptr, *dref = nullptr;
    CSFMOE_CUDA_CHECK(cudaMalloc(&dout, hx.size() * 2));
    CSFMOE_CUDA_CHECK(cudaMalloc(&dref, hx.size() * 2));
    float* barrier = nullptr;
    CSFMOE_CUDA_CHECK(cudaMalloc(&barrier, 4));
    auto sync_all = [&] {
      if (ncclAllReduce(barrier, barrier, 1, ncclFloat32, ncclSum, ctx.comm, s) != ncclSuccess)
        throw CudaError("barrier all-reduce failed");
      CSFMOE_CUDA_CHECK(cudaStreamSynchronize(s));
    };
    auto call = [&](std::uint32_t T) {
      if (mode == "tp")
        run_tensor_parallel(ctx, *local->b, dx, T, dids, IndexType::int32, dw, dout);
      else
        ep->run(dx, T, dids, IndexType::int32, dw, dout);
    };
    cudaEvent_t e0, e1;
    CSFMOE_CUDA_CHECK(cudaEventCreate(&e0));
    CSFMOE_CUDA_CHECK(cudaEventCreate(&e1));
    auto time_it = [&](auto&& fn) {
      std::vector<float> ms;
      for (std::uint32_t i = 0; i < iters + 3; ++i) {
        sync_all();
        CSFMOE_CUDA_CHECK(cudaEventRecord(e0, s));
        fn();
        CSFMOE_CUDA_CHECK(cudaEventRecord(e1, s));
        CSFMOE_CUDA_CHECK(cudaEventSynchronize(e1));
        float m = 0;
        CSFMOE_CUDA_CHECK(cudaEventElapsedTime(&m, e0, e1));
        if (i >= 3) ms.push_back(m);
      }
      std::sort(ms.begin(), ms.end());
      return ms[ms.size() / 2];
    };
    int rc = 0;
    for (std::uint32_t T : tokens) {
      call(T);
      run(*single.b, dx, T, dids, IndexType::int32, dw, dref);
      CSFMOE_CUDA_CHECK(cudaStreamSynchronize(s));
      std::vector<std::uint16_t> out(std::uint64_t{T} * H), ref(out.size());
      CSFMOE_CUDA_CHECK(cudaMemcpy(out.data(), dout, out.size() * 2, cudaMemcpyDeviceToHost));
      CSFMOE_CUDA_CHECK(cudaMemcpy(ref.data(), dref, ref.size() * 2, cudaMemcpyDeviceToHost));
      std::vector<float> reff(ref.size());
      for (std::size_t i = 0; i < ref.size(); ++i) reff[i] = bf16_to_float(ref[i]);
      const double err = rel_bf16(out, reff);
      double cpu_err = -1;
      if (cpu_check) {
        std::vector<float> cpu(out.size());
        moe_reference(full, std::span(hx).first(out.size()), T,
                      std::span<const std::int32_t>(hid).first(T * k),
                      std::span<const float>(hw).first(T * k), cpu);
        cpu_err = rel_bf16(out, cpu);
      }
      const float ms = time_it([&] { call(T); });
      const float ms1 = time_it([&] { run(*single.b, dx, T, dids, IndexType::int32, dw, dref); });
      const bool ok = err <= tol && (cpu_err < 0 || cpu_err <= tol);
      if (!ok) rc = 1;
      std::printf(
          "{\"mode\":\"%s\",\"world\":%d,\"rank\":%d,\"format\":\"%s\",\"E\":%u,\"H\":%u,\"N\":%u,\"k\":%u,"
          "\"tokens\":%u,\"ms_per_layer\":%.4f,\"single_gpu_ms\":%.4f,\"rel_err_vs_single\":%.3e,"
          "\"rel_err_vs_cpu\":%.3e,\"ok\":%s}\n",
          mode.c_str(), world, rank, format.c_str(), E, H, N, k, T, double(ms), double(ms1), err, cpu_err,
          ok ? "true" : "false");
      std::fflush(stdout);
    }
    ep.reset();
    local.reset();
    nccl_destroy(ctx);
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "csf-mp rank %d: error: %s\n", rank, e.what());
    return 1;
  }
}
