// Fused MoE layer on the GPU against the float64 CPU reference, for every
// scale mode. Skips when no CUDA device is present.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "csfmoe/errors.hpp"
#include "csfmoe/moe.hpp"
#include "csfmoe/moe_cuda.hpp"
#include "cuda/moe/decode_kernel.cuh"
#include "moe/grouped_shape.hpp"
#include "moe/stage_read_index.hpp"
#include "test_gpu.hpp"
#include "test_seed.hpp"

namespace csfmoe {
namespace {

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << #x << ": " << cudaGetErrorString(x)

using testing::check;

// Owning device buffer.
struct Buf {
  void* p = nullptr;
  std::size_t n = 0;
  Buf() = default;
  explicit Buf(std::size_t bytes) : n(bytes) { check(cudaMalloc(&p, bytes ? bytes : 1), "cudaMalloc"); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  Buf(Buf&& o) noexcept : p(o.p), n(o.n) { o.p = nullptr; }
  Buf& operator=(Buf&& o) noexcept {
    std::swap(p, o.p);
    std::swap(n, o.n);
    return *this;
  }
  ~Buf() {
    if (p) (void)cudaFree(p);
  }
  template <typename T>
  static Buf of(const std::vector<T>& v) {
    Buf b(v.size() * sizeof(T));
    check(cudaMemcpy(b.p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
    return b;
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

template <typename T>
std::vector<T> download(const void* p, std::size_t count) {
  std::vector<T> v(count);
  check(cudaMemcpy(v.data(), p, count * sizeof(T), cudaMemcpyDeviceToHost), "download");
  return v;
}

// One layer on the device in every configuration the tests need: the same
// weights kept native (row-major), and CSF with a scale scratch.
struct Layer {
  MoeHostWeights host;
  Buf w13, w2, s13, s2, g13, g2, b13, b2, scratch13, scratch2;
  MoePlan plan_native, plan_csf;
  std::unique_ptr<MoeWeights> native, csf;

  Layer(ScaleFormat f, const MoeLayerGeometry& g, std::uint64_t seed, std::uint32_t max_tokens = 4096,
        ScaleLayout layout = ScaleLayout::row_major,
        const std::function<void(MoeHostWeights&)>& mutate = nullptr) {
    host = synthetic_moe_weights(f, g, seed);
    if (mutate) mutate(host);
    w13 = Buf::of(host.w13);
    w2 = Buf::of(host.w2);
    MoeConstraints c;
    c.max_tokens = max_tokens;
    c.scale_layout = layout;
    plan_native = plan_weights(f, g, c);
    s13 = Buf::of(relayout_scales(row_major(plan_native.w13_scales, g, f, true), host.w13_scales, layout));
    s2 = Buf::of(relayout_scales(row_major(plan_native.w2_scales, g, f, false), host.w2_scales, layout));
    if (f == ScaleFormat::nvfp4) {
      g13 = Buf::of(host.w13_global);
      g2 = Buf::of(host.w2_global);
    }
    MoeDeviceWeights d;
    d.w13 = w13.as<std::uint8_t>();
    d.w2 = w2.as<std::uint8_t>();
    d.w13_scales = s13.as<std::uint8_t>();
    d.w2_scales = s2.as<std::uint8_t>();
    d.w13_global = g13.as<float>();
    d.w2_global = g2.as<float>();
    if (!host.w13_bias.empty()) b13 = Buf::of(host.w13_bias);
    if (!host.w2_bias.empty()) b2 = Buf::of(host.w2_bias);
    d.w13_bias = b13.as<float>();
    d.w2_bias = b2.as<float>();
    native = std::make_unique<MoeWeights>(prepare_weights(plan_native, d, nullptr, nullptr));
    c.compression = ScaleCompression::csf;
    plan_csf = plan_weights(f, g, c);
    const ScratchSizes need = moe_scale_scratch_bytes(plan_csf);
    scratch13 = Buf(need.w13);
    scratch2 = Buf(need.w2);
    ScaleScratch sc;
    sc.w13 = scratch13.as<std::uint8_t>();
    sc.w13_bytes = need.w13;
    sc.w2 = scratch2.as<std::uint8_t>();
    sc.w2_bytes = need.w2;
    csf = std::make_unique<MoeWeights>(prepare_weights(plan_csf, d, &sc, nullptr));
  }
  static GridShape row_major(const GridShape& s, const MoeLayerGeometry& g, ScaleFormat f, bool w13) {
    GridShape r = s;
    r.layout = ScaleLayout::row_major;
    r.rows = w13 ? 2 * g.intermediate : g.hidden;
    r.cols = (w13 ? g.hidden : g.intermediate) / group_size(f);
    return r;
  }
  const MoeWeights& weights_for(MoeScaleMode m) const { return m == MoeScaleMode::native ? *native : *csf; }
};

struct Inputs {
  std::uint32_t tokens = 0;
  std::vector<std::uint16_t> hidden;
  std::vector<std::int64_t> ids;
  std::vector<float> weights;
};

Inputs random_inputs(std::mt19937_64& rng, std::uint32_t T, const MoeLayerGeometry& g) {
  Inputs in;
  in.tokens = T;
  std::normal_distribution<float> x(0.0f, 1.0f);
  std::uniform_real_distribution<float> w(0.05f, 1.0f);
  in.hidden.resize(std::size_t{T} * g.hidden);
  for (auto& v : in.hidden) v = float_to_bf16(x(rng));
  // Distinct experts per token (like a real top-k), so some experts get none.
  std::vector<std::int64_t> perm(g.experts);
  for (std::uint32_t e = 0; e < g.experts; ++e) perm[e] = e;
  for (std::uint32_t t = 0; t < T; ++t) {
    for (std::uint32_t j = 0; j < g.topk; ++j) {
      std::uniform_int_distribution<std::uint32_t> pick(j, g.experts - 1);
      std::swap(perm[j], perm[pick(rng)]);
      in.ids.push_back(perm[j]);
      in.weights.push_back(w(rng));
    }
  }
  return in;
}

std::vector<float> reference(const Layer& l, const Inputs& in) {
  std::vector<float> out(std::size_t{in.tokens} * l.host.geometry.hidden);
  moe_reference(l.host, in.hidden, in.tokens, in.ids, in.weights, out);
  return out;
}

std::vector<float> to_float(const std::vector<std::uint16_t>& v) {
  std::vector<float> f(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) f[i] = bf16_to_float(v[i]);
  return f;
}

// Device-side inputs and workspace for calls of up to max_tokens tokens.
struct Call {
  Buf hidden, ids, weights, out, ws;
  std::uint32_t max_tokens;
  IndexType id_type;
  Call(const MoePlan& plan, std::uint32_t max_t, IndexType type = IndexType::int64)
      : max_tokens(max_t), id_type(type) {
    const auto& g = plan.geometry;
    hidden = Buf(std::size_t{max_t} * g.hidden * 2);
    ids = Buf(std::size_t{max_t} * g.topk * 8);
    weights = Buf(std::size_t{max_t} * g.topk * 4);
    out = Buf(std::size_t{max_t} * g.hidden * 2);
    ws = Buf(moe_workspace_bytes(plan, max_t));
  }
  MoeWorkspace workspace() const { return {ws.p, ws.n}; }
  void upload(const Inputs& in, cudaStream_t s) {
    check(cudaMemcpyAsync(hidden.p, in.hidden.data(), in.hidden.size() * 2, cudaMemcpyHostToDevice, s), "h");
    if (id_type == IndexType::int64) {
      check(cudaMemcpyAsync(ids.p, in.ids.data(), in.ids.size() * 8, cudaMemcpyHostToDevice, s), "ids");
    } else {
      ids32.assign(in.ids.begin(), in.ids.end());
      check(cudaMemcpyAsync(ids.p, ids32.data(), ids32.size() * 4, cudaMemcpyHostToDevice, s), "ids");
    }
    check(cudaMemcpyAsync(weights.p, in.weights.data(), in.weights.size() * 4, cudaMemcpyHostToDevice, s),
          "w");
    check(cudaStreamSynchronize(s), "upload sync");
  }
  // NaN bit patterns everywhere, so an unwritten element cannot pass.
  void poison(std::size_t elems, cudaStream_t s) {
    check(cudaMemsetAsync(out.p, 0xFF, elems * 2, s), "poison");
  }
  void run(const BoundMoe& b, std::uint32_t T, std::optional<bool> scales_expanded = std::nullopt) {
    csfmoe::run(b, hidden.p, T, ids.p, id_type, weights.as<float>(), out.p, scales_expanded);
  }
  std::vector<std::int32_t> ids32;
};

// Runs one call in `mode` with poisoned output; returns the bf16 output.
// The decode kernel needs H and N to be multiples of 128; others run tiled.
bool decode_fits(const MoeLayerGeometry& g) { return g.hidden % 128 == 0 && g.intermediate % 128 == 0; }
// The prefill kernel needs H % 256, N % 128 and an sm_90 device.
bool sm90() {
  int dev = 0, major = 0, minor = 0;
  check(cudaGetDevice(&dev), "device");
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), "cc major");
  check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev), "cc minor");
  return major == 9 && minor == 0;
}
bool prefill_fits(const MoeLayerGeometry& g) {
  return g.hidden % 256 == 0 && g.intermediate % 128 == 0 && sm90();
}

// The kernel a call asking for `kernel` runs on (the others' fallbacks).
MoeKernel expected_kernel(const MoeLayerGeometry& g, MoeScaleMode mode, MoeKernel kernel) {
  // The grouped kernel takes the prefill kernel's shapes and scale modes.
  if ((kernel == MoeKernel::prefill || kernel == MoeKernel::grouped) && prefill_fits(g) &&
      mode != MoeScaleMode::stage_read)
    return kernel;
  return kernel != MoeKernel::tiled && decode_fits(g) ? MoeKernel::decode : MoeKernel::tiled;
}

// ctest runs the decode tests again with each decode block shape forced
// (tests/CMakeLists.txt): CSFMOE_TEST_DECODE_WARPS, CSFMOE_TEST_DECODE_RUN and
// CSFMOE_TEST_DECODE_COPY set the fields of MoeBindOptions::tuning.
MoeDecodeTuning test_tuning() {
  const auto read = [](const char* name) {
    const char* v = std::getenv(name);
    return v != nullptr && *v != '\0' ? std::atoi(v) : -1;
  };
  MoeDecodeTuning t;
  t.warps = read("CSFMOE_TEST_DECODE_WARPS");
  t.row_block_run = read("CSFMOE_TEST_DECODE_RUN");
  t.copy_kblocks = read("CSFMOE_TEST_DECODE_COPY");
  return t;
}

MoeBindOptions options_for(MoeScaleMode mode, MoeKernel kernel) {
  MoeBindOptions opt;
  opt.tuning = test_tuning();
  opt.force_mode = mode;
  opt.decode_max_tokens = kernel == MoeKernel::tiled ? 0u : 0xFFFFFFFFu;
  opt.prefill_min_tokens = kernel == MoeKernel::prefill ? 1u : 0xFFFFFFFFu;
  opt.grouped_min_tokens = kernel == MoeKernel::grouped ? 1u : 0xFFFFFFFFu;
  return opt;
}

std::vector<std::uint16_t> run_mode(const Layer& l, MoeScaleMode mode, const Inputs& in, Call& call,
                                    cudaStream_t s = nullptr, MoeKernel kernel = MoeKernel::decode,
                                    std::uint32_t token_tile = 0, bool fp32_slots = false,
                                    int ring_scales = -1) {
  const MoeWeights& w = l.weights_for(mode);
  MoeBindOptions opt = options_for(mode, kernel);
  opt.grouped_token_tile = token_tile;
  opt.grouped_fp32_slots = fp32_slots;
  opt.grouped_ring_scales = ring_scales;
  const BoundMoe b = bind(w, s, call.max_tokens, call.workspace(), mode == MoeScaleMode::expanded, opt);
  EXPECT_EQ(b.mode_for(in.tokens), mode);
  EXPECT_EQ(b.kernel_for(in.tokens), expected_kernel(l.host.geometry, mode, kernel));
  if (mode == MoeScaleMode::expanded) {
    // Clear the scratch first so a mode that skipped expansion would fail.
    check(cudaMemsetAsync(l.scratch13.p, 0xFF, l.scratch13.n, s), "scratch poison");
    check(cudaMemsetAsync(l.scratch2.p, 0xFF, l.scratch2.n, s), "scratch poison");
    expand_scales(w, s);
  }
  call.upload(in, s);
  const std::size_t elems = std::size_t{in.tokens} * l.host.geometry.hidden;
  call.poison(elems, s);
  call.run(b, in.tokens);
  check(cudaStreamSynchronize(s), "run sync");
  check(cudaGetLastError(), "run");
  return download<std::uint16_t>(call.out.p, elems);
}

constexpr MoeScaleMode kModes[] = {MoeScaleMode::native, MoeScaleMode::expanded, MoeScaleMode::routed,
                                   MoeScaleMode::stage_read};

// All modes of every kernel against the reference, and bitwise against each
// other within a kernel (the prefill and grouped kernels run the dense-scale
// modes; their stage-read calls run on the decode kernel, checked there).
void check_all_modes(const Layer& l, const Inputs& in, Call& call, const std::string& what) {
  const std::vector<float> ref = reference(l, in);
  for (MoeKernel kernel : {MoeKernel::decode, MoeKernel::tiled, MoeKernel::prefill, MoeKernel::grouped}) {
    const bool wgmma = kernel == MoeKernel::prefill || kernel == MoeKernel::grouped;
    if (kernel == MoeKernel::decode && !decode_fits(l.host.geometry)) continue;
    if (wgmma && !prefill_fits(l.host.geometry)) continue;
    std::vector<std::uint16_t> first;
    for (MoeScaleMode m : kModes) {
      if (wgmma && m == MoeScaleMode::stage_read) continue;
      SCOPED_TRACE(what + " kernel " + to_string(kernel) + " mode " + std::string(to_string(m)));
      if (m == MoeScaleMode::routed) {
        // Routed expansion only touches routed experts: poison the rest.
        check(cudaMemset(l.scratch13.p, 0xFF, l.scratch13.n), "scratch poison");
        check(cudaMemset(l.scratch2.p, 0xFF, l.scratch2.n), "scratch poison");
      }
      const auto out = run_mode(l, m, in, call, nullptr, kernel);
      const auto f = to_float(out);
      const double err = relative_error(f, ref);
      EXPECT_LT(err, 1e-2) << "relative error " << err;
      if (first.empty())
        first = out;
      else
        EXPECT_TRUE(out == first) << "differs bitwise from native";
      // The grouped kernel's other scale path (scales copied into the ring or
      // per-thread loads; the plan picks one by token tile, the run above):
      // the same bits.
      if (kernel == MoeKernel::grouped) {
        const BoundMoe planned = bind(l.weights_for(m), nullptr, call.max_tokens, call.workspace(),
                                      m == MoeScaleMode::expanded, options_for(m, kernel));
        const int other = planned.call_plan(in.tokens).ring_scales ? 0 : 1;
        if (m == MoeScaleMode::routed) {
          check(cudaMemset(l.scratch13.p, 0xFF, l.scratch13.n), "scratch poison");
          check(cudaMemset(l.scratch2.p, 0xFF, l.scratch2.n), "scratch poison");
        }
        EXPECT_TRUE(run_mode(l, m, in, call, nullptr, kernel, 0, false, other) == first)
            << "grouped_ring_scales " << other << " differs bitwise";
      }
    }
  }
}

// Under compute-sanitizer (CSFMOE_GPU_TEST_SMALL=1) the largest calls take minutes.
bool small_run() {
  const char* v = std::getenv("CSFMOE_GPU_TEST_SMALL");
  return v != nullptr && *v != '\0' && *v != '0';
}

class GpuMoe : public ::testing::Test {
 protected:
  void SetUp() override { REQUIRE_GPU(); }
};

// A CSF layer whose exception records overflow the index in some decode row
// blocks and not in others: stage-read must still give native's bits (the
// overflowing blocks sort per block), and the layer must report the index.
TEST_F(GpuMoe, StageReadIndexWithOverflowingRowBlocksMatchesNative) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const MoeLayerGeometry g{8, 1024, 512, 4, GateUpOrder::w13};
  const auto mutate = [&](MoeHostWeights& w) {
    const std::uint32_t c13 = g.hidden / 16, c2 = g.intermediate / 16;
    // Expert 1: gate rows 0..15 (row block 0) full of exceptions; expert 2: down rows 64..95.
    for (std::size_t i = 0; i < std::size_t{16} * c13; ++i)
      w.w13_scales[std::size_t{1} * 2 * g.intermediate * c13 + i] = std::uint8_t(rng() % 0x7F);
    for (std::size_t i = 0; i < std::size_t{32} * c2; ++i)
      w.w2_scales[(std::size_t{2} * g.hidden + 64) * c2 + i] = std::uint8_t(rng() % 0x7F);
  };
  Layer l(ScaleFormat::nvfp4, g, seed, 64, ScaleLayout::row_major, mutate);
  EXPECT_GT(l.csf->stage_read_index_bytes(), 0u);
  EXPECT_EQ(l.csf->stage_read_index_bytes(),
            l.csf->w13_stage_read_index().bytes + l.csf->w2_stage_read_index().bytes);
  EXPECT_EQ(
      l.csf->resident_scale_bytes(),
      l.csf->w13_csf().resident_bytes() + l.csf->w2_csf().resident_bytes() + l.csf->stage_read_index_bytes());
  EXPECT_EQ(l.native->stage_read_index_bytes(), 0u);
  {  // a layer that never stage-reads keeps no index, and its forced stage-read calls sort per block
    MoeConstraints c = l.plan_csf.constraints;
    c.stage_read_max_tokens = 0;
    const MoePlan plan0 = plan_weights(ScaleFormat::nvfp4, g, c);
    MoeDeviceWeights d = l.native->source();
    d.w13_scales = l.s13.as<std::uint8_t>();
    d.w2_scales = l.s2.as<std::uint8_t>();
    const MoeWeights w0 = prepare_weights(plan0, d, nullptr, nullptr);
    EXPECT_EQ(w0.stage_read_index_bytes(), 0u);
    EXPECT_EQ(w0.w13_stage_read_index().data, nullptr);
    Call call0(plan0, 64);
    const Inputs in = random_inputs(rng, 5, g);
    MoeBindOptions opt = options_for(MoeScaleMode::stage_read, MoeKernel::decode);
    const BoundMoe b0 = bind(w0, nullptr, 64, call0.workspace(), false, opt);
    call0.upload(in, nullptr);
    call0.poison(std::size_t{5} * g.hidden, nullptr);
    call0.run(b0, 5);
    CUDA_OK(cudaDeviceSynchronize());
    const auto out0 = download<std::uint16_t>(call0.out.p, std::size_t{5} * g.hidden);
    Call call1(l.plan_csf, 64);
    EXPECT_TRUE(out0 == run_mode(l, MoeScaleMode::native, in, call1)) << "stage-read without the index";
  }
  // The same index on the host: some row blocks overflow, most do not.
  const CsfTensor h13 = l.csf->w13_csf().download();
  moe_detail::IndexRows r13;
  r13.first_half = 0, r13.second_half = g.intermediate, r13.stride = 16,
  r13.blocks_per_expert = g.intermediate / 16;
  const auto i13 = moe_detail::build_stage_read_index(h13.geometry, r13, h13.exceptions, h13.row_prefix);
  EXPECT_GT(i13.overflow_blocks, 0u);
  EXPECT_LT(i13.overflow_blocks, std::uint64_t(g.experts) * r13.blocks_per_expert);
  EXPECT_EQ(i13.bytes.size(), l.csf->w13_stage_read_index().bytes);
  Call call(l.plan_csf, 64);
  for (std::uint32_t T : {1u, 9u, 64u}) {
    Inputs in = random_inputs(rng, T, g);
    for (std::uint32_t t = 0; t < T; ++t) in.ids[std::size_t{t} * g.topk] = 1 + t % 2;  // experts 1 and 2
    check_all_modes(l, in, call, "T=" + std::to_string(T));
  }
}

TEST_F(GpuMoe, EveryModeMatchesReferenceAcrossTokenCountsAndTopk) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4}) {
    for (std::uint32_t k : {1u, 2u, 8u}) {
      const MoeLayerGeometry g{16, 256, 128, k, GateUpOrder::w13};
      Layer l(f, g, seed + k);
      Call call(l.plan_csf, 4096);
      const std::vector<std::uint32_t> sizes =
          small_run() ? std::vector<std::uint32_t>{1, 9, 64, 257}
                      : std::vector<std::uint32_t>{1, 2, 7, 9, 16, 64, 257, 1024, 4096};
      for (std::uint32_t T : sizes) {
        const Inputs in = random_inputs(rng, T, g);
        check_all_modes(l, in, call,
                        std::string(to_string(f)) + " k=" + std::to_string(k) + " T=" + std::to_string(T));
      }
    }
  }
}

// gpt-oss's clamped SwiGLU with expert biases in every kernel's gate/up
// epilogue and the combine's down bias: every kernel and scale mode against
// the float64 reference, both gate/up orders. A quarter of the bias rows lie
// beyond the clamp limit on either side, so both clamps and the linear part
// are exercised.
TEST_F(GpuMoe, GptOssActivationWithBiasesEveryKernelAndMode) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const auto add_biases = [&](MoeHostWeights& w) {
    const auto& g = w.geometry;
    std::normal_distribution<float> small(0.0f, 0.5f);
    std::uniform_real_distribution<float> wide(-12.0f, 12.0f);
    std::bernoulli_distribution far(0.25);
    w.w13_bias.resize(std::size_t{g.experts} * 2 * g.intermediate);
    w.w2_bias.resize(std::size_t{g.experts} * g.hidden);
    for (auto& b : w.w13_bias) b = far(rng) ? wide(rng) : small(rng);
    for (auto& b : w.w2_bias) b = small(rng);
  };
  for (const GateUpOrder order : {GateUpOrder::w13, GateUpOrder::w31}) {
    for (ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4}) {
      MoeLayerGeometry g{16, 256, 128, 4, order};
      g.activation = MoeActivationSpec::gpt_oss();
      Layer l(f, g, seed + 7, 512, ScaleLayout::row_major, add_biases);
      Call call(l.plan_csf, 512);
      for (std::uint32_t T : {1u, 9u, 64u, 257u})
        check_all_modes(
            l, random_inputs(rng, T, g), call,
            std::string(to_string(f)) + " " + std::string(to_string(order)) + " T=" + std::to_string(T));
    }
  }
  // Biases are optional: gate/up ones only, and none (the epilogue's and the
  // combine's bias-free branches), with non-default alpha and limit.
  for (const bool gate_up_bias : {true, false}) {
    MoeLayerGeometry g{16, 256, 128, 4, GateUpOrder::w13};
    g.activation = MoeActivationSpec::gpt_oss(1.1, 4.5);
    Layer l(ScaleFormat::nvfp4, g, seed + 11, 512, ScaleLayout::row_major, [&](MoeHostWeights& w) {
      add_biases(w);
      w.w2_bias.clear();
      if (!gate_up_bias) w.w13_bias.clear();
    });
    Call call(l.plan_csf, 512);
    for (std::uint32_t T : {9u, 257u})
      check_all_modes(
          l, random_inputs(rng, T, g), call,
          std::string(gate_up_bias ? "gate/up biases only" : "no biases") + " T=" + std::to_string(T));
  }
}

TEST_F(GpuMoe, SwizzledNativeScalesW31AndInt32Ids) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  // 2N = 192 and H/16 = 10 columns: exercises row and column padding (tiled
  // kernel only); H = 256, N = 128 runs the decode and prefill kernels too.
  for (const MoeLayerGeometry g : {MoeLayerGeometry{12, 320, 64, 4, GateUpOrder::w31},
                                   MoeLayerGeometry{12, 256, 128, 4, GateUpOrder::w31}}) {
    for (ScaleLayout lay : {ScaleLayout::swizzled_128x4, ScaleLayout::row_major}) {
      Layer l(ScaleFormat::nvfp4, g, seed, 512, lay);
      Call call(l.plan_csf, 512, IndexType::int32);
      for (std::uint32_t T : {3u, 200u})
        check_all_modes(l, random_inputs(rng, T, g), call,
                        "H=" + std::to_string(g.hidden) + " T=" + std::to_string(T));
    }
  }
}

TEST_F(GpuMoe, AllTokensToOneExpertAndDuplicateIds) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  // The second geometry runs the decode kernel too: a hot expert makes it
  // repeat its weight stream for each pass of 8 (T <= 8) or 32 tokens.
  for (const MoeLayerGeometry g : {MoeLayerGeometry{8, 128, 64, 2, GateUpOrder::w13},
                                   MoeLayerGeometry{8, 256, 128, 8, GateUpOrder::w31}}) {
    Layer l(ScaleFormat::nvfp4, g, seed, 1024);
    Call call(l.plan_csf, 1024);
    for (std::uint32_t T : {1u, 5u, 8u, 33u, 300u, 1024u}) {
      Inputs in = random_inputs(rng, T, g);
      const std::int64_t e = std::int64_t(rng() % g.experts);
      for (auto& id : in.ids) id = e;  // every slot of every token: duplicates, one expert
      check_all_modes(l, in, call, "one expert T=" + std::to_string(T) + " k=" + std::to_string(g.topk));
    }
  }
}

// The grouped kernel at every token tile against the reference and bitwise
// across its scale modes: odd K-block counts (N = 384: 3 per down item),
// several row blocks per expert, uniform routing and routing where most
// slots go to one expert (many tiles of one expert, most others empty),
// calls with fewer and with many more work items than SMs.
TEST_F(GpuMoe, GroupedKernelEveryTokenTileUniformAndSkewedRouting) {
  if (!sm90()) GTEST_SKIP() << "the grouped kernel needs sm_90";
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const MoeLayerGeometry g{8, 512, 384, 4, GateUpOrder::w31};
  for (ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4}) {
    Layer l(f, g, seed + 3, 2048);
    Call call(l.plan_csf, 2048);
    // Under compute-sanitizer: one call size, the smallest and largest tiles
    // and one of an odd number of 8-row groups.
    const std::vector<std::uint32_t> sizes =
        small_run() ? std::vector<std::uint32_t>{300} : std::vector<std::uint32_t>{1, 37, 300, 2048};
    for (std::uint32_t T : sizes) {
      for (int skew = 0; skew < 2; ++skew) {
        Inputs in = random_inputs(rng, T, g);
        if (skew) {
          const std::int64_t hot = std::int64_t(rng() % g.experts);
          for (std::size_t i = 0; i < in.ids.size(); i += g.topk)
            if (rng() % 5 != 0) in.ids[i] = hot;                   // the first choice of 80 % of the tokens
          for (std::size_t i = 0; i < in.ids.size(); i += g.topk)  // keep each token's ids distinct
            for (std::uint32_t j = 1; j < g.topk; ++j)
              if (in.ids[i + j] == in.ids[i]) in.ids[i + j] = (in.ids[i] + j) % g.experts;
        }
        const std::vector<float> ref = reference(l, in);
        for (int nt : moe_detail::kGroupedTokenTiles) {
          if (small_run() && nt != 16 && nt != 24 && nt != 128) continue;
          std::vector<std::uint16_t> first;
          for (MoeScaleMode m : {MoeScaleMode::native, MoeScaleMode::expanded, MoeScaleMode::routed}) {
            SCOPED_TRACE(std::string(to_string(f)) + " T=" + std::to_string(T) +
                         " skew=" + std::to_string(skew) + " tile=" + std::to_string(nt) + " mode " +
                         std::string(to_string(m)));
            if (m == MoeScaleMode::routed) {
              check(cudaMemset(l.scratch13.p, 0xFF, l.scratch13.n), "scratch poison");
              check(cudaMemset(l.scratch2.p, 0xFF, l.scratch2.n), "scratch poison");
            }
            const auto out = run_mode(l, m, in, call, nullptr, MoeKernel::grouped, std::uint32_t(nt),
                                      /*fp32_slots=*/false, /*ring_scales=*/0);
            const double err = relative_error(to_float(out), ref);
            EXPECT_LT(err, 1e-2) << "relative error " << err;
            if (first.empty())
              first = out;
            else
              EXPECT_TRUE(out == first) << "differs bitwise from native";
          }
          // Scales copied into the ring: the same bits, bf16 and FP32 slots.
          SCOPED_TRACE("ring scales, tile " + std::to_string(nt));
          EXPECT_TRUE(run_mode(l, MoeScaleMode::native, in, call, nullptr, MoeKernel::grouped,
                               std::uint32_t(nt), false, /*ring_scales=*/1) == first)
              << "ring scales differ bitwise";
          // FP32 per-slot outputs instead of bf16: the same bound, other last bits.
          SCOPED_TRACE("fp32 slots, tile " + std::to_string(nt));
          const auto f32 =
              run_mode(l, MoeScaleMode::native, in, call, nullptr, MoeKernel::grouped, std::uint32_t(nt),
                       /*fp32_slots=*/true, /*ring_scales=*/0);
          EXPECT_LT(relative_error(to_float(f32), ref), 1e-2);
          EXPECT_LT(relative_error(to_float(f32), to_float(first)), 1e-2);
          EXPECT_TRUE(run_mode(l, MoeScaleMode::native, in, call, nullptr, MoeKernel::grouped,
                               std::uint32_t(nt),
                               /*fp32_slots=*/true, /*ring_scales=*/1) == f32)
              << "ring scales differ bitwise (fp32 slots)";
        }
      }
    }
  }
}

// Every E2M1 code (the +-0.5 subnormal among them), scales across the E4M3
// range (subnormals included) and E8M0 exponents far from 1, K of several
// decode K blocks per warp, MXFP4 and NVFP4.
TEST_F(GpuMoe, DecodeKernelOnAdversarialCodesAndScales) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4}) {
    const MoeLayerGeometry g{6, 2048, 384, 4, GateUpOrder::w13};
    const auto mutate = [&](MoeHostWeights& w) {
      for (auto* v : {&w.w13, &w.w2})
        for (auto& b : *v) b = std::uint8_t(rng());
      for (auto* v : {&w.w13_scales, &w.w2_scales})
        for (auto& b : *v) {
          if (f == ScaleFormat::nvfp4)  // every finite E4M3 code: 0, subnormals, one in eight negative
            b = std::uint8_t(rng() % 0x7F | (rng() % 8 == 0 ? 0x80 : 0));
          else
            b = std::uint8_t(112 + rng() % 24);  // 2^-15 .. 2^8
        }
    };
    Layer l(f, g, seed, 64, ScaleLayout::row_major, mutate);
    Call call(l.plan_csf, 64);
    for (std::uint32_t T : {1u, 3u, 12u, 64u})
      check_all_modes(l, random_inputs(rng, T, g), call,
                      std::string(to_string(f)) + " T=" + std::to_string(T));
  }
}

// Runs of row blocks (a decode block streaming several row blocks of its tile
// in turn, the ring running through each row block's reduction). The launch
// rule gives this layer none; ctest runs the test again with
// CSFMOE_TEST_DECODE_RUN = 2 and 3 (tests/CMakeLists.txt), which K of 8 and 4
// blocks of 128 lets apply to the 8-token passes (T = 1, 7, 20: partial last
// runs, and at T = 20 tiles of two passes; T = 64 takes passes of 16, no
// runs). Then the native call streams runs and the stage-read call does not:
// check_all_modes holds them to identical bits, and both to the CPU reference.
TEST_F(GpuMoe, DecodeRowBlockRunsMatchReferenceAndStageRead) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const MoeLayerGeometry g{8, 1024, 512, 4, GateUpOrder::w13};
  // Under compute-sanitizer: one format and layout, a single and a two-pass
  // call (racecheck of the paired ring copies: both GEMMs copy pairs here).
  const bool small = small_run();
  for (ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4})
    for (ScaleLayout lay : {ScaleLayout::row_major, ScaleLayout::swizzled_128x4}) {
      if (small && (f != ScaleFormat::nvfp4 || lay != ScaleLayout::row_major)) continue;
      Layer l(f, g, seed, 64, lay);
      Call call(l.plan_csf, 64);
      for (std::uint32_t T :
           small ? std::vector<std::uint32_t>{1, 20} : std::vector<std::uint32_t>{1, 7, 20, 64})
        check_all_modes(l, random_inputs(rng, T, g), call,
                        std::string(to_string(f)) +
                            (lay == ScaleLayout::row_major ? " row-major" : " swizzled") +
                            " T=" + std::to_string(T));
    }
}

TEST_F(GpuMoe, DecodeAndTiledKernelsChosenByTokenCount) {
  CSFMOE_SEEDED(seed);
  const MoeLayerGeometry g{8, 256, 128, 2, GateUpOrder::w13};
  Layer l(ScaleFormat::nvfp4, g, seed, 512);
  Call call(l.plan_csf, 512);
  MoeBindOptions opt;
  opt.decode_max_tokens = 100;
  opt.prefill_min_tokens = 0xFFFFFFFFu;  // PrefillKernelChosen* covers the prefill kernel
  opt.grouped_min_tokens = 0xFFFFFFFFu;  // GroupedKernelChosen* the grouped one
  const BoundMoe b = bind(*l.csf, nullptr, 512, call.workspace(), false, opt);
  EXPECT_EQ(b.kernel_for(1), MoeKernel::decode);
  EXPECT_EQ(b.kernel_for(100), MoeKernel::decode);
  EXPECT_EQ(b.kernel_for(101), MoeKernel::tiled);
  opt.decode_max_tokens = 0;
  EXPECT_EQ(bind(*l.csf, nullptr, 512, call.workspace(), false, opt).kernel_for(1), MoeKernel::tiled);
  // H = 320 is not a multiple of 128: always tiled.
  const MoeLayerGeometry odd{4, 320, 128, 2, GateUpOrder::w13};
  Layer lo(ScaleFormat::nvfp4, odd, seed, 64);
  Call co(lo.plan_csf, 64);
  EXPECT_EQ(bind(*lo.csf, nullptr, 64, co.workspace(), false).kernel_for(1), MoeKernel::tiled);
}

// A binding's call plan is plan_call over the capabilities bind read.
TEST_F(GpuMoe, BindingPlansCallsFromTheDeviceCaps) {
  CSFMOE_SEEDED(seed);
  const MoeLayerGeometry g{8, 256, 128, 2, GateUpOrder::w13};
  Layer l(ScaleFormat::nvfp4, g, seed, 512);
  Call call(l.plan_csf, 512);
  const BoundMoe b = bind(*l.csf, nullptr, 512, call.workspace(), false);
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "sm count");
  EXPECT_EQ(b.device_caps().sm_count, std::uint32_t(sms));
  EXPECT_EQ(b.device_caps().prefill_kernels, sm90());
  for (std::uint32_t T : {1u, 7u, 64u, 300u, 512u}) {
    const MoeCallPlan want = plan_call(l.plan_csf, b.device_caps(), T, false, true, MoeBindOptions{});
    const MoeCallPlan got = b.call_plan(T);
    EXPECT_EQ(got.mode, want.mode);
    EXPECT_EQ(got.kernel, want.kernel);
    EXPECT_EQ(got.token_pass, want.token_pass);
    EXPECT_EQ(got.token_tile, want.token_tile);
    EXPECT_EQ(got.tile_group, want.tile_group);
    EXPECT_EQ(got.gate_up.warps, want.gate_up.warps);
    EXPECT_EQ(got.down.smem_bytes, want.down.smem_bytes);
  }
}

TEST_F(GpuMoe, PrefillKernelChosenFromItsThresholdForDenseScales) {
  CSFMOE_SEEDED(seed);
  const MoeLayerGeometry g{8, 256, 128, 2, GateUpOrder::w13};
  Layer l(ScaleFormat::nvfp4, g, seed, 512);
  Call call(l.plan_csf, 512);
  const MoeKernel large = sm90() ? MoeKernel::prefill : MoeKernel::decode;
  MoeBindOptions opt;
  opt.grouped_min_tokens = 0xFFFFFFFFu;  // GroupedKernelChosen* covers the grouped kernel
  opt.prefill_min_tokens = 200;
  const BoundMoe expanded = bind(*l.csf, nullptr, 512, call.workspace(), true, opt);
  EXPECT_EQ(expanded.kernel_for(199), MoeKernel::decode);
  EXPECT_EQ(expanded.kernel_for(200), large);
  EXPECT_EQ(bind(*l.native, nullptr, 512, call.workspace(), false, opt).kernel_for(512), large);
  // It takes precedence over decode_max_tokens ...
  opt.decode_max_tokens = 0;
  EXPECT_EQ(bind(*l.native, nullptr, 512, call.workspace(), false, opt).kernel_for(300), large);
  EXPECT_EQ(bind(*l.native, nullptr, 512, call.workspace(), false, opt).kernel_for(100), MoeKernel::tiled);
  opt.decode_max_tokens = 8192;
  // ... but stage-read calls (compressed scales) run on the decode kernel.
  opt.force_mode = MoeScaleMode::stage_read;
  EXPECT_EQ(bind(*l.csf, nullptr, 512, call.workspace(), false, opt).kernel_for(512), MoeKernel::decode);
  opt.force_mode.reset();
  // The default: 16 rows per expert on average, T * k >= 16 * E (here T >= 64).
  MoeBindOptions no_grouped;
  no_grouped.grouped_min_tokens = 0xFFFFFFFFu;
  const BoundMoe automatic = bind(*l.native, nullptr, 512, call.workspace(), false, no_grouped);
  EXPECT_EQ(automatic.kernel_for(63), MoeKernel::decode);
  EXPECT_EQ(automatic.kernel_for(64), large);
  // A threshold above max_tokens, or a layer with H % 256 != 0: never.
  opt.prefill_min_tokens = 513;
  EXPECT_EQ(bind(*l.native, nullptr, 512, call.workspace(), false, opt).kernel_for(512), MoeKernel::decode);
  opt.prefill_min_tokens = 1;
  const MoeLayerGeometry narrow{4, 384, 128, 2, GateUpOrder::w13};
  Layer ln(ScaleFormat::nvfp4, narrow, seed, 64);
  Call cn(ln.plan_csf, 64);
  EXPECT_EQ(bind(*ln.native, nullptr, 64, cn.workspace(), false, opt).kernel_for(64), MoeKernel::decode);
}

TEST_F(GpuMoe, GroupedKernelChosenFromItsThresholdAheadOfPrefill) {
  CSFMOE_SEEDED(seed);
  const MoeLayerGeometry g{8, 256, 128, 2, GateUpOrder::w13};
  Layer l(ScaleFormat::nvfp4, g, seed, 512);
  Call call(l.plan_csf, 512);
  const MoeKernel large = sm90() ? MoeKernel::grouped : MoeKernel::decode;
  // The default: 5 rows per expert on average, T * k >= 5 * E (here T >= 20), ahead of the
  // prefill kernel (T >= 64).
  const BoundMoe automatic = bind(*l.native, nullptr, 512, call.workspace(), false);
  EXPECT_EQ(automatic.kernel_for(19), MoeKernel::decode);
  EXPECT_EQ(automatic.kernel_for(20), large);
  EXPECT_EQ(automatic.kernel_for(512), large);
  EXPECT_EQ(automatic.call_plan(512).token_tile, sm90() ? 128u : 0u);  // 128 rows per expert
  EXPECT_EQ(automatic.call_plan(256).token_tile, sm90() ? 80u : 0u);   // 64
  EXPECT_EQ(automatic.call_plan(32).token_tile, sm90() ? 16u : 0u);
  MoeBindOptions opt;
  opt.grouped_min_tokens = 100;
  opt.grouped_token_tile = 32;
  opt.grouped_tile_group = 3;
  const BoundMoe chosen = bind(*l.native, nullptr, 512, call.workspace(), false, opt);
  EXPECT_EQ(chosen.kernel_for(99), sm90() ? MoeKernel::prefill : MoeKernel::decode);
  EXPECT_EQ(chosen.kernel_for(100), large);
  if (sm90()) {
    EXPECT_EQ(chosen.call_plan(100).token_tile, 32u);
    EXPECT_EQ(chosen.call_plan(100).tile_group, 3u);
  }
  // Stage-read calls (compressed scales) run on the decode kernel; a CSF layer with a
  // scratch expands its routed experts for the grouped kernel instead.
  opt.force_mode = MoeScaleMode::stage_read;
  EXPECT_EQ(bind(*l.csf, nullptr, 512, call.workspace(), false, opt).kernel_for(512), MoeKernel::decode);
  opt.force_mode.reset();
  EXPECT_EQ(bind(*l.csf, nullptr, 512, call.workspace(), false, opt).kernel_for(512), large);
  EXPECT_EQ(bind(*l.csf, nullptr, 512, call.workspace(), false, opt).mode_for(512), MoeScaleMode::routed);
}

TEST_F(GpuMoe, InvalidIdsContributeNothingAndAreCounted) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const MoeLayerGeometry g{8, 256, 128, 2, GateUpOrder::w13};
  Layer l(ScaleFormat::mxfp4, g, seed, 64);
  Call call(l.plan_csf, 64);
  for (std::uint32_t T : {3u, 40u}) {
    Inputs in = random_inputs(rng, T, g);
    in.ids[1] = -1;
    in.ids[4] = 8;
    in.ids[5] = 1000;
    Inputs valid = in;
    for (int i : {1, 4, 5}) {
      valid.ids[i] = 0;
      valid.weights[i] = 0.0f;
    }
    const std::vector<float> ref = reference(l, valid);
    for (MoeKernel kernel : {MoeKernel::decode, MoeKernel::tiled, MoeKernel::prefill})
      for (MoeScaleMode m : kModes) {
        SCOPED_TRACE("T=" + std::to_string(T) + " " + to_string(kernel) + " " + std::string(to_string(m)));
        const auto out = to_float(run_mode(l, m, in, call, nullptr, kernel));
        EXPECT_LT(relative_error(out, ref), 1e-2);
        const BoundMoe b = bind(l.weights_for(m), nullptr, 64, call.workspace(), m == MoeScaleMode::expanded,
                                options_for(m, kernel));
        EXPECT_EQ(b.invalid_id_count(), 3u);
      }
  }
}

// scales_expanded chosen per call: one binding serves calls that stage-read
// (or expand routed experts) and calls that read a scratch expanded ahead,
// with the bits of the bindings frozen either way; and the query that says
// ahead of time which calls read expanded scales agrees with the binding.
TEST_F(GpuMoe, ScalesExpandedChosenPerCall) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const MoeLayerGeometry g{16, 256, 128, 8, GateUpOrder::w13};
  Layer l(ScaleFormat::nvfp4, g, seed, 256);
  Call call(l.plan_csf, 256);
  const BoundMoe per_call = bind(*l.csf, nullptr, 256, call.workspace(), false);
  const BoundMoe frozen = bind(*l.csf, nullptr, 256, call.workspace(), true);
  for (std::uint32_t T : {1u, 37u, 256u}) {
    SCOPED_TRACE(T);
    const Inputs in = random_inputs(rng, T, g);
    const std::size_t elems = std::size_t{T} * g.hidden;
    const auto once = [&](const BoundMoe& b, std::optional<bool> expanded) {
      check(cudaMemset(l.scratch13.p, 0xFF, l.scratch13.n), "scratch poison");
      check(cudaMemset(l.scratch2.p, 0xFF, l.scratch2.n), "scratch poison");
      if (expanded.value_or(b.scales_expanded())) expand_scales(*l.csf, nullptr);
      call.upload(in, nullptr);
      call.poison(elems, nullptr);
      call.run(b, T, expanded);
      check(cudaDeviceSynchronize(), "run sync");
      return download<std::uint16_t>(call.out.p, elems);
    };
    const auto ahead = once(per_call, true), ahead_frozen = once(frozen, std::nullopt);
    EXPECT_TRUE(ahead == ahead_frozen) << "per-call expanded differs from a binding made expanded";
    EXPECT_LT(relative_error(to_float(ahead), reference(l, in)), 1e-2);
    const auto plain = once(per_call, std::nullopt), plain_override = once(frozen, false);
    EXPECT_TRUE(plain == plain_override) << "per-call false differs from the binding's own choice";
    EXPECT_LT(relative_error(to_float(plain), reference(l, in)), 1e-2);
    const MoeScaleMode m = per_call.mode_for(T);
    EXPECT_EQ(reads_expanded_scales(l.plan_csf, per_call.device_caps(), T, true),
              m == MoeScaleMode::routed || m == MoeScaleMode::expanded);
  }
  // A layer without a scratch cannot read expanded scales.
  const BoundMoe native = bind(*l.native, nullptr, 256, call.workspace(), false);
  call.upload(random_inputs(rng, 4, g), nullptr);
  EXPECT_THROW(call.run(native, 4, true), InvalidArgument);
}

TEST_F(GpuMoe, GraphCaptureReplaysWithNewInputs) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const MoeLayerGeometry g{16, 256, 128, 8, GateUpOrder::w13};
  Layer l(ScaleFormat::nvfp4, g, seed, 128);
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (MoeScaleMode m : kModes) {
    SCOPED_TRACE(std::string(to_string(m)));
    Call call(l.plan_csf, 128);
    MoeBindOptions opt;
    opt.force_mode = m;
    const BoundMoe b = bind(l.weights_for(m), s, 128, call.workspace(), m == MoeScaleMode::expanded, opt);
    if (m == MoeScaleMode::expanded) expand_scales(l.weights_for(m), s);
    const std::uint32_t T = 37;
    call.upload(random_inputs(rng, T, g), s);
    cudaGraph_t graph;
    CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    call.run(b, T);
    CUDA_OK(cudaStreamEndCapture(s, &graph));
    cudaGraphExec_t exec;
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    for (int rep = 0; rep < 3; ++rep) {
      const Inputs in = random_inputs(rng, T, g);
      call.upload(in, s);
      call.poison(std::size_t{T} * g.hidden, s);
      CUDA_OK(cudaGraphLaunch(exec, s));
      CUDA_OK(cudaStreamSynchronize(s));
      const auto out = to_float(download<std::uint16_t>(call.out.p, std::size_t{T} * g.hidden));
      EXPECT_LT(relative_error(out, reference(l, in)), 1e-2) << "replay " << rep;
    }
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));
  }
  CUDA_OK(cudaStreamDestroy(s));
}

// Calls chained on one stream with no synchronization between them, each
// consuming the previous call's output and routing differently through the
// same workspace: the kernels launched as programmatic dependents (PDL) must
// give the bits of strict stream order, and each step the reference's values.
TEST_F(GpuMoe, ProgrammaticLaunchMatchesStrictOrderAcrossChainedCalls) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const MoeLayerGeometry g{32, 256, 128, 8, GateUpOrder::w13};
  const std::uint32_t T = small_run() ? 24 : 300;
  Layer l(ScaleFormat::nvfp4, g, seed, T);
  int major = 0;
  CUDA_OK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  constexpr int kSteps = 4;
  std::vector<Inputs> steps;
  for (int i = 0; i < kSteps; ++i) steps.push_back(random_inputs(rng, T, g));
  Buf hidden = Buf::of(steps[0].hidden), ws(moe_workspace_bytes(l.plan_csf, T));
  std::vector<Buf> ids, wts, outs;
  for (const Inputs& in : steps) {
    ids.push_back(Buf::of(in.ids));
    wts.push_back(Buf::of(in.weights));
    outs.push_back(Buf(std::size_t{T} * g.hidden * 2));
  }
  for (MoeKernel kernel : {MoeKernel::decode, MoeKernel::tiled, MoeKernel::prefill}) {
    if (kernel == MoeKernel::prefill && !prefill_fits(g)) continue;
    for (MoeScaleMode m : {MoeScaleMode::native, MoeScaleMode::routed, MoeScaleMode::stage_read}) {
      if (kernel == MoeKernel::prefill && m == MoeScaleMode::stage_read) continue;
      SCOPED_TRACE(std::string("kernel ") + std::string(to_string(kernel)) + " mode " +
                   std::string(to_string(m)));
      std::vector<std::vector<std::uint16_t>> result[2];
      for (int chained = 0; chained < 2; ++chained) {
        MoeBindOptions opt = options_for(m, kernel);
        opt.programmatic_launch = chained == 1;
        const BoundMoe b = bind(l.weights_for(m), s, T, {ws.p, ws.n}, false, opt);
        EXPECT_EQ(b.programmatic_launch(), chained == 1 && major >= 9);
        for (Buf& o : outs) CUDA_OK(cudaMemsetAsync(o.p, 0xFF, o.n, s));
        for (int i = 0; i < kSteps; ++i)
          run(b, i == 0 ? hidden.p : outs[i - 1].p, T, ids[i].p, IndexType::int64, wts[i].as<float>(),
              outs[i].p);
        CUDA_OK(cudaStreamSynchronize(s));
        CUDA_OK(cudaGetLastError());
        for (const Buf& o : outs) result[chained].push_back(download<std::uint16_t>(o.p, o.n / 2));
      }
      for (int i = 0; i < kSteps; ++i) {
        EXPECT_TRUE(result[1][i] == result[0][i]) << "step " << i << " differs from strict order";
        Inputs in = steps[i];
        if (i > 0) in.hidden = result[0][i - 1];
        const double err = relative_error(to_float(result[1][i]), reference(l, in));
        EXPECT_LT(err, 1e-2) << "step " << i << " relative error " << err;
      }
    }
  }
  CUDA_OK(cudaStreamDestroy(s));
}

TEST_F(GpuMoe, TwoLayersShareOneScratchExpandedOnASideStream) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const MoeLayerGeometry g{16, 256, 128, 4, GateUpOrder::w13};
  Layer a(ScaleFormat::nvfp4, g, seed, 256);
  Layer b(ScaleFormat::nvfp4, g, seed + 99, 256);
  // Layer b's CSF weights re-prepared onto layer a's scratch.
  MoeDeviceWeights d = b.csf->source();
  d.w13_scales = b.s13.as<std::uint8_t>();
  d.w2_scales = b.s2.as<std::uint8_t>();
  ScaleScratch shared;
  shared.w13 = a.scratch13.as<std::uint8_t>();
  shared.w13_bytes = a.scratch13.n;
  shared.w2 = a.scratch2.as<std::uint8_t>();
  shared.w2_bytes = a.scratch2.n;
  const MoeWeights wb = prepare_weights(b.plan_csf, d, &shared, nullptr);
  cudaStream_t main_s, side;
  CUDA_OK(cudaStreamCreateWithFlags(&main_s, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  cudaEvent_t a_ready, a_done, b_ready;
  for (cudaEvent_t* e : {&a_ready, &a_done, &b_ready})
    CUDA_OK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  Call ca(a.plan_csf, 256), cb(b.plan_csf, 256);
  const BoundMoe ba = bind(*a.csf, main_s, 256, ca.workspace(), true);
  const BoundMoe bb = bind(wb, main_s, 256, cb.workspace(), true);
  for (int step = 0; step < 3; ++step) {
    const Inputs ia = random_inputs(rng, 100, g), ib = random_inputs(rng, 100, g);
    ca.upload(ia, main_s);
    cb.upload(ib, main_s);
    ca.poison(ia.hidden.size(), main_s);
    cb.poison(ib.hidden.size(), main_s);
    // side: expand a -> main: run a -> side: (after a) expand b while main
    // does other work -> main: run b.
    expand_scales(*a.csf, side);
    CUDA_OK(cudaEventRecord(a_ready, side));
    CUDA_OK(cudaStreamWaitEvent(main_s, a_ready));
    ca.run(ba, 100);
    CUDA_OK(cudaEventRecord(a_done, main_s));
    CUDA_OK(cudaStreamWaitEvent(side, a_done));
    // The background launch shape (one block per SM) on odd steps.
    expand_scales(wb, side, ExpandLaunch{std::uint32_t(step % 2)});
    CUDA_OK(cudaEventRecord(b_ready, side));
    // Stand-in for the next layer's attention on the main stream.
    CUDA_OK(cudaMemsetAsync(ca.ws.p, 0, ca.ws.n, main_s));
    CUDA_OK(cudaStreamWaitEvent(main_s, b_ready));
    cb.run(bb, 100);
    CUDA_OK(cudaStreamSynchronize(main_s));
    const auto oa = to_float(download<std::uint16_t>(ca.out.p, ia.hidden.size()));
    const auto ob = to_float(download<std::uint16_t>(cb.out.p, ib.hidden.size()));
    EXPECT_LT(relative_error(oa, reference(a, ia)), 1e-2) << "layer a step " << step;
    EXPECT_LT(relative_error(ob, reference(b, ib)), 1e-2) << "layer b step " << step;
  }
  for (cudaEvent_t e : {a_ready, a_done, b_ready}) CUDA_OK(cudaEventDestroy(e));
  CUDA_OK(cudaStreamDestroy(main_s));
  CUDA_OK(cudaStreamDestroy(side));
}

TEST_F(GpuMoe, RunsAllocateNothingAndRepeatBitwise) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const MoeLayerGeometry g{32, 256, 128, 8, GateUpOrder::w13};
  Layer l(ScaleFormat::nvfp4, g, seed, 2048);
  Call call(l.plan_csf, 2048);
  const Inputs in = random_inputs(rng, 2000, g);
  call.upload(in, nullptr);
  const BoundMoe routed = bind(*l.csf, nullptr, 2048, call.workspace(), false);
  ASSERT_EQ(routed.mode_for(2000), MoeScaleMode::routed);
  ASSERT_EQ(routed.mode_for(16), MoeScaleMode::stage_read);
  const BoundMoe native = bind(*l.native, nullptr, 2048, call.workspace(), false);
  // Warm-up: every kernel used below loads its module (lazy loading allocates).
  call.run(routed, 2000);
  call.run(routed, 16);
  call.run(native, 16);
  CUDA_OK(cudaDeviceSynchronize());
  std::size_t free0 = 0, total = 0, free1 = 0;
  CUDA_OK(cudaMemGetInfo(&free0, &total));
  std::vector<std::uint16_t> first;
  for (int i = 0; i < 10; ++i) {
    call.poison(in.hidden.size(), nullptr);
    call.run(i % 2 ? routed : native, i % 3 ? 2000 : 16);
    call.run(routed, 2000);
    CUDA_OK(cudaDeviceSynchronize());
    const auto out = download<std::uint16_t>(call.out.p, in.hidden.size());
    if (first.empty())
      first = out;
    else
      EXPECT_TRUE(out == first) << "run " << i << " differs";
  }
  CUDA_OK(cudaMemGetInfo(&free1, &total));
  EXPECT_EQ(free0, free1);
}

TEST_F(GpuMoe, HostChecksRejectBadArguments) {
  CSFMOE_SEEDED(seed);
  const MoeLayerGeometry g{8, 128, 64, 2, GateUpOrder::w13};
  Layer l(ScaleFormat::nvfp4, g, seed, 64);
  Call call(l.plan_csf, 64);
  const BoundMoe b = bind(*l.csf, nullptr, 64, call.workspace(), false);
  const auto* h = call.hidden.as<unsigned char>();
  EXPECT_THROW(run(b, h + 2, 4, call.ids.p, IndexType::int64, call.weights.as<float>(), call.out.p),
               InvalidArgument);
  EXPECT_THROW(run(b, h, 65, call.ids.p, IndexType::int64, call.weights.as<float>(), call.out.p),
               InvalidArgument);
  EXPECT_THROW(run(b, h, 4, nullptr, IndexType::int64, call.weights.as<float>(), call.out.p),
               InvalidArgument);
  EXPECT_THROW(run(b, h, 4, call.ids.p, IndexType::int64, call.weights.as<float>(), call.hidden.p),
               InvalidArgument);
  std::vector<std::uint16_t> host(64 * 128);
  EXPECT_THROW(run(b, host.data(), 4, call.ids.p, IndexType::int64, call.weights.as<float>(), call.out.p),
               InvalidArgument);
  EXPECT_THROW(bind(*l.csf, nullptr, 64, {call.ws.p, call.ws.n - 1}, false), InvalidArgument);
  EXPECT_THROW(bind(*l.csf, nullptr, 65, call.workspace(), false), InvalidArgument);
  EXPECT_THROW(bind(*l.native, nullptr, 64, call.workspace(), true), InvalidArgument);
  MoeBindOptions opt;
  opt.force_mode = MoeScaleMode::native;
  EXPECT_THROW(bind(*l.csf, nullptr, 64, call.workspace(), false, opt), InvalidArgument);
  opt.force_mode = MoeScaleMode::stage_read;
  EXPECT_THROW(bind(*l.native, nullptr, 64, call.workspace(), false, opt), InvalidArgument);
  opt.force_mode.reset();
  opt.tuning.warps = 3;
  EXPECT_THROW(bind(*l.csf, nullptr, 64, call.workspace(), false, opt), InvalidArgument);
  opt.tuning = {};
  opt.tuning.copy_kblocks = 2;
  EXPECT_THROW(bind(*l.csf, nullptr, 64, call.workspace(), false, opt), InvalidArgument);
  opt.tuning = {};
  opt.grouped_token_tile = 40;  // not a token-tile class
  EXPECT_THROW(bind(*l.csf, nullptr, 64, call.workspace(), false, opt), InvalidArgument);
  EXPECT_TRUE(l.csf->source_scales_droppable());
  EXPECT_FALSE(l.native->source_scales_droppable());
  EXPECT_EQ(l.native->resident_scale_bytes(), l.plan_native.w13_scale_bytes + l.plan_native.w2_scale_bytes);
  MoeDeviceWeights d = l.native->source();
  d.w13 = d.w13 + 1;
  EXPECT_THROW(prepare_weights(l.plan_native, d, nullptr, nullptr), InvalidArgument);
  // Biases belong to gpt_oss layers, on the device, FP32 and 16-byte aligned.
  Buf bias(4 * 2 * g.experts * g.intermediate + 16);
  d = l.native->source();
  d.w13_bias = bias.as<float>();
  EXPECT_THROW(prepare_weights(l.plan_native, d, nullptr, nullptr), InvalidArgument);
  MoePlan oss = l.plan_native;
  oss.geometry.activation = MoeActivationSpec::gpt_oss();
  d.w13_bias = bias.as<float>() + 1;
  EXPECT_THROW(prepare_weights(oss, d, nullptr, nullptr), InvalidArgument);
  std::vector<float> host_bias(2 * g.experts * g.intermediate);
  d.w13_bias = host_bias.data();
  EXPECT_THROW(prepare_weights(oss, d, nullptr, nullptr), InvalidArgument);
}

}  // namespace
}  // namespace csfmoe
