// `csf moe`: one MoE layer call on the GPU (if present) or the CPU reference.
#include "moe_command.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "csfmoe/errors.hpp"
#include "csfmoe/moe.hpp"
#include "csfmoe/moe_checkpoint.hpp"
#include "csfmoe/synthetic.hpp"
#if defined(CSFMOE_HAVE_CUDA)
#include <cuda_runtime_api.h>

#include "csfmoe/moe_cuda.hpp"
#include "cuda/primitives/cuda_check.hpp"
#endif

namespace csfmoe::cli {

namespace {

struct MoeArgs {
  std::string model = "qwen3-30b-a3b";
  std::optional<std::uint32_t> experts, hidden, intermediate, topk;
  std::string format = "nvfp4";
  std::uint32_t tokens = 16;
  std::string mode = "auto";
  std::uint32_t iters = 20;
  std::uint64_t seed = 1;
  bool cpu = false;
  bool no_check = false;
  double max_error = 1e-2;
  std::optional<std::filesystem::path> checkpoint;
  std::optional<std::string> layer;
};

// The layer named by --layer, or the checkpoint's only MoE layer.
std::string pick_layer(const MoeArgs& a) {
  if (a.layer) return *a.layer;
  const auto layers = list_moe_layers(*a.checkpoint);
  if (layers.size() == 1) return layers[0];
  if (layers.empty())
    throw InvalidArgument(fmt::format("csf moe: {} has no MoE layer (no expert block-scale tensors found)",
                                      a.checkpoint->string()));
  std::string list;
  for (const auto& l : layers) list += (list.empty() ? "" : ", ") + l;
  throw InvalidArgument(fmt::format("csf moe: {} has {} MoE layers; pick one with --layer: {}",
                                    a.checkpoint->string(), layers.size(), list));
}

struct Inputs {
  std::vector<std::uint16_t> hidden;
  std::vector<std::int64_t> ids;
  std::vector<float> weights;
};

Inputs make_inputs(const MoeLayerGeometry& g, std::uint32_t T, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> x(0.0f, 1.0f);
  std::uniform_real_distribution<float> w(0.05f, 1.0f);
  Inputs in;
  in.hidden.resize(std::size_t{T} * g.hidden);
  for (auto& v : in.hidden) v = float_to_bf16(x(rng));
  std::vector<std::int64_t> perm(g.experts);
  for (std::uint32_t e = 0; e < g.experts; ++e) perm[e] = e;
  for (std::uint32_t t = 0; t < T; ++t)
    for (std::uint32_t j = 0; j < g.topk; ++j) {
      // Distinct experts per token (when k <= E), like a real router.
      std::uniform_int_distribution<std::uint32_t> pick(j % g.experts, g.experts - 1);
      std::swap(perm[j % g.experts], perm[pick(rng)]);
      in.ids.push_back(perm[j % g.experts]);
      in.weights.push_back(w(rng));
    }
  return in;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

#if defined(CSFMOE_HAVE_CUDA)
bool gpu_present() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return n > 0;
}

void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    cuda_detail::throw_cuda_error(e, fmt::format("csf moe: {}", what), __FILE__, __LINE__);
}

struct DevBuf {
  void* p = nullptr;
  explicit DevBuf(std::size_t n) { ck(cudaMalloc(&p, n ? n : 1), "cudaMalloc"); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  ~DevBuf() { (void)cudaFree(p); }
  template <typename T>
  static std::unique_ptr<DevBuf> of(const std::vector<T>& v) {
    auto b = std::make_unique<DevBuf>(v.size() * sizeof(T));
    ck(cudaMemcpy(b->p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
    return b;
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

// Returns the output and the median milliseconds per call.
std::vector<float> run_gpu(const MoeArgs& a, const MoeHostWeights& hw, const Inputs& in, double& ms,
                           std::string& mode_name) {
  const MoeLayerGeometry& g = hw.geometry;
  const bool native = a.mode == "native";
  MoeConstraints c;
  c.max_tokens = a.tokens;
  c.compression = native ? ScaleCompression::none : ScaleCompression::csf;
  const MoePlan plan = plan_weights(hw.format, g, c);
  auto w13 = DevBuf::of(hw.w13), w2 = DevBuf::of(hw.w2);
  auto s13 = DevBuf::of(hw.w13_scales), s2 = DevBuf::of(hw.w2_scales);
  std::unique_ptr<DevBuf> g13, g2, b13, b2;
  MoeDeviceWeights d;
  d.w13 = w13->as<std::uint8_t>();
  d.w2 = w2->as<std::uint8_t>();
  d.w13_scales = s13->as<std::uint8_t>();
  d.w2_scales = s2->as<std::uint8_t>();
  if (hw.format == ScaleFormat::nvfp4) {
    g13 = DevBuf::of(hw.w13_global);
    g2 = DevBuf::of(hw.w2_global);
    d.w13_global = g13->as<float>();
    d.w2_global = g2->as<float>();
  }
  // A gpt-oss layer's expert biases (each optional), FP32 as the reference takes them.
  if (!hw.w13_bias.empty()) {
    b13 = DevBuf::of(hw.w13_bias);
    d.w13_bias = b13->as<float>();
  }
  if (!hw.w2_bias.empty()) {
    b2 = DevBuf::of(hw.w2_bias);
    d.w2_bias = b2->as<float>();
  }
  const ScratchSizes need = moe_scale_scratch_bytes(plan);
  DevBuf sc13(native ? 0 : need.w13), sc2(native ? 0 : need.w2);
  ScaleScratch scratch{sc13.as<std::uint8_t>(), need.w13, sc2.as<std::uint8_t>(), need.w2};
  cudaStream_t stream;
  ck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  const MoeWeights weights = prepare_weights(plan, d, native ? nullptr : &scratch, stream);
  DevBuf ws(moe_workspace_bytes(plan, a.tokens));
  MoeBindOptions opt;
  if (a.mode != "auto") opt.force_mode = parse_moe_scale_mode(a.mode);
  const bool expanded = a.mode == "expanded";
  const BoundMoe bound =
      bind(weights, stream, a.tokens, {ws.p, moe_workspace_bytes(plan, a.tokens)}, expanded, opt);
  mode_name = std::string(to_string(bound.mode_for(a.tokens)));
  if (expanded) expand_scales(weights, stream);
  auto hid = DevBuf::of(in.hidden), ids = DevBuf::of(in.ids), wts = DevBuf::of(in.weights);
  DevBuf out(in.hidden.size() * 2);
  const auto call = [&] { run(bound, hid->p, a.tokens, ids->p, IndexType::int64, wts->as<float>(), out.p); };
  call();
  ck(cudaStreamSynchronize(stream), "warm-up");
  cudaEvent_t e0, e1;
  ck(cudaEventCreate(&e0), "event");
  ck(cudaEventCreate(&e1), "event");
  std::vector<float> times;
  for (std::uint32_t i = 0; i < std::max(1u, a.iters); ++i) {
    ck(cudaEventRecord(e0, stream), "record");
    call();
    ck(cudaEventRecord(e1, stream), "record");
    ck(cudaEventSynchronize(e1), "sync");
    float t = 0;
    ck(cudaEventElapsedTime(&t, e0, e1), "elapsed");
    times.push_back(t);
  }
  std::sort(times.begin(), times.end());
  ms = times[times.size() / 2];
  std::vector<std::uint16_t> o(in.hidden.size());
  ck(cudaMemcpy(o.data(), out.p, o.size() * 2, cudaMemcpyDeviceToHost), "download");
  (void)cudaEventDestroy(e0);
  (void)cudaEventDestroy(e1);
  (void)cudaStreamDestroy(stream);
  std::vector<float> f(o.size());
  for (std::size_t i = 0; i < o.size(); ++i) f[i] = bf16_to_float(o[i]);
  return f;
}
#endif

int run_moe(const MoeArgs& a) {
  if (a.tokens == 0) throw InvalidArgument("csf moe: --tokens must be at least 1");
  if (a.mode != "auto") (void)parse_moe_scale_mode(a.mode);
  std::optional<MoeHostWeights> loaded;
  std::string layer_name = a.model;
  auto t0 = std::chrono::steady_clock::now();
  if (a.checkpoint) {
    layer_name = pick_layer(a);
    // Without --topk: k = min(8, E), so a small layer still routes to distinct experts.
    loaded = load_moe_layer(*a.checkpoint, layer_name, a.topk.value_or(1));
    if (!a.topk) loaded->geometry.topk = std::min(8u, loaded->geometry.experts);
    layer_name = a.checkpoint->string() + " : " + layer_name;
  }
  MoeLayerGeometry g;
  const MoeGeometry& base = moe_geometry(a.model);
  if (loaded) {
    g = loaded->geometry;
  } else {
    g.experts = a.experts.value_or(base.experts);
    g.hidden = a.hidden.value_or(base.hidden);
    g.intermediate = a.intermediate.value_or(base.intermediate);
    g.topk = a.topk.value_or(base.topk);
  }
  const ScaleFormat f = loaded ? loaded->format : parse_scale_format(a.format);
  (void)plan_weights(f, g, MoeConstraints{ScaleCompression::none, a.tokens});  // validate before the big work
  const std::uint64_t elems = std::uint64_t{g.experts} * 3 * g.hidden * g.intermediate;
  const bool fast = elems > (std::uint64_t{1} << 27);
  const MoeHostWeights hw = loaded ? std::move(*loaded) : synthetic_moe_weights(f, g, a.seed, fast);
  const Inputs in = make_inputs(g, a.tokens, a.seed + 1);
  const bool custom = !a.checkpoint && (a.experts || a.hidden || a.intermediate || a.topk);
  // The activation a checkpoint's layer runs with (gpt_oss: a gpt-oss layer with expert biases).
  std::string act(to_string(g.activation.kind));
  if (g.activation.kind == MoeActivation::gpt_oss) {
    const bool b13 = !hw.w13_bias.empty(), b2 = !hw.w2_bias.empty();
    act += fmt::format(" (alpha {}, limit {}, {})", g.activation.alpha, g.activation.limit,
                       b13 && b2 ? "gate/up and down biases"
                       : b13     ? "gate/up bias"
                       : b2      ? "down bias"
                                 : "no biases");
  }
  fmt::print("layer: {}{} E={} H={} N={} k={} {} {} ({} weights, {:.1f} s to {}), T={}\n", layer_name,
             custom ? " (overridden)" : "", g.experts, g.hidden, g.intermediate, g.topk, to_string(f), act,
             a.checkpoint ? "checkpoint"
             : fast       ? "uniform-code"
                          : "quantized",
             seconds_since(t0), a.checkpoint ? "load" : "make", a.tokens);

  std::vector<float> out;
  double ms = 0;
  std::string device = "cpu-reference", mode = "reference";
  bool on_gpu = false;
#if defined(CSFMOE_HAVE_CUDA)
  if (!a.cpu && gpu_present()) {
    out = run_gpu(a, hw, in, ms, mode);
    cudaDeviceProp prop{};
    ck(cudaGetDeviceProperties(&prop, 0), "properties");
    device = prop.name;
    on_gpu = true;
  }
#endif
  std::vector<float> ref;
  if (!on_gpu || !a.no_check) {
    ref.resize(in.hidden.size());
    t0 = std::chrono::steady_clock::now();
    moe_reference(hw, in.hidden, a.tokens, in.ids, in.weights, ref);
    const double ref_ms = seconds_since(t0) * 1e3;
    if (!on_gpu) ms = ref_ms;
  }
  fmt::print("device: {}  mode: {}  time per call: {:.3f} ms\n", device, mode, ms);
  if (!on_gpu) {
    fmt::print("error vs reference: 0 (this is the reference; no GPU{})\n", a.cpu ? " requested" : " found");
    return 0;
  }
  if (a.no_check) {
    fmt::print("error vs reference: not checked (--no-check)\n");
    return 0;
  }
  const double err = relative_error(out, ref);
  fmt::print("error vs reference: {:.3e} (relative L2; limit {:.1e})\n", err, a.max_error);
  return err < a.max_error ? 0 : 3;
}

}  // namespace

void register_moe_command(CLI::App& app) {
  auto args = std::make_shared<MoeArgs>();
  auto* c = app.add_subcommand(
      "moe",
      "Run one fused MoE layer of a checkpoint or of a synthetic geometry on the GPU (or CPU reference)");
  auto* ck = c->add_option("--checkpoint", args->checkpoint,
                           "safetensors file or folder (plain or CSF-compressed) to read the layer from");
  auto* layer = c->add_option("--layer", args->layer,
                              "MoE layer key, e.g. model.layers.3.mlp.experts (default: the only one)");
  layer->needs(ck);
  auto* model = c->add_option("--model", args->model, "geometry, one of the names csf synth --model takes")
                    ->capture_default_str();
  auto* experts = c->add_option("--experts", args->experts, "override E");
  auto* hidden = c->add_option("--hidden", args->hidden, "override H (multiple of 64)");
  auto* inter = c->add_option("--intermediate", args->intermediate, "override N (multiple of 64)");
  c->add_option("--topk", args->topk, "override k (with --checkpoint: default min(8, experts))")
      ->check(CLI::Range(1u, 65536u));
  auto* format = c->add_option("--format", args->format, "nvfp4 or mxfp4")
                     ->check(CLI::IsMember({"nvfp4", "mxfp4"}))
                     ->capture_default_str();
  // A checkpoint fixes the geometry and format.
  for (auto* o : {model, experts, hidden, inter, format}) ck->excludes(o);
  c->add_option("--tokens,-t", args->tokens, "tokens per call")
      ->check(CLI::Range(1u, 1u << 20))
      ->capture_default_str();
  c->add_option("--mode", args->mode, "auto (CSF, frozen rule), native, expanded, routed, stage_read")
      ->check(CLI::IsMember({"auto", "native", "expanded", "routed", "stage_read"}))
      ->capture_default_str();
  c->add_option("--iters", args->iters, "timed calls (median reported)")
      ->check(CLI::Range(1u, 1000000u))
      ->capture_default_str();
  c->add_option("--seed", args->seed, "random seed")->capture_default_str();
  c->add_option("--max-error", args->max_error, "exit 3 if the GPU error is not below this")
      ->capture_default_str();
  c->add_flag("--cpu", args->cpu, "use the CPU reference even if a GPU is present");
  c->add_flag("--no-check", args->no_check, "skip the CPU reference on the GPU path");
  c->callback([args] {
    // Runs inside parse(): report errors here in the tool's format.
    if (args->cpu && args->mode != "auto" && args->mode != "native") {
      // The CPU reference reads native scales and has no scale modes to choose from.
      fmt::print(stderr,
                 "csf: usage error: --mode {} selects how the GPU reads scales; --cpu runs the float64 "
                 "reference on native scales (drop --mode, or --cpu)\n",
                 args->mode);
      std::fflush(stderr);
      std::exit(2);
    }
    int rc = 1;
    try {
      rc = run_moe(*args);
    } catch (const std::exception& e) {
      std::string m = e.what();
      std::replace(m.begin(), m.end(), '\n', ' ');
      fmt::print(stderr, "csf: error: {}\n", m);
      rc = 1;
    }
    std::fflush(stdout);
    std::exit(rc);
  });
}

}  // namespace csfmoe::cli
