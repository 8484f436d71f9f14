// load_moe_layer / list_moe_layers: checkpoints written here with the
// library's safetensors writer (stacked csf-synth names, gpt-oss MXFP4 names,
// per-expert ModelOpt tensors from quantize_nvfp4) are read back byte for
// byte, also through CSF containers; adversarial checkpoints are refused with
// typed errors naming the file and tensor; `csf moe --checkpoint` runs.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "csfmoe/checkpoint.hpp"
#include "csfmoe/errors.hpp"
#include "csfmoe/moe_checkpoint.hpp"
#include "csfmoe/quantize.hpp"
#include "csfmoe/safetensors.hpp"
#include "test_seed.hpp"

namespace {

namespace fs = std::filesystem;
using namespace csfmoe;
using Bytes = std::vector<std::uint8_t>;

struct Tensor {
  std::string name;
  st::Dtype dtype;
  std::vector<std::uint64_t> shape;
  Bytes data;
};

template <class T>
Bytes bytes_of(const std::vector<T>& v) {
  Bytes b(v.size() * sizeof(T));
  if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}
Bytes slice(const Bytes& b, std::uint64_t begin, std::uint64_t n) {
  return Bytes(b.begin() + begin, b.begin() + begin + n);
}

void write_st(const fs::path& p, const std::vector<Tensor>& ts, const std::optional<st::Metadata>& md = {}) {
  st::Writer w(p, 1 << 16);
  for (const auto& t : ts) w.add_tensor(t.name, t.dtype, t.shape, t.data);
  w.commit(md);
}

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "csfmoe-moeck-XXXXXX").string();
    if (!mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }
  fs::path operator/(const std::string& n) const { return path_ / n; }

 private:
  fs::path path_;
};

MoeLayerGeometry random_geometry(std::mt19937_64& rng) {
  MoeLayerGeometry g;
  g.experts = std::uniform_int_distribution<std::uint32_t>(2, 5)(rng);
  g.hidden = 64 * std::uniform_int_distribution<std::uint32_t>(1, 3)(rng);
  g.intermediate = 64 * std::uniform_int_distribution<std::uint32_t>(1, 2)(rng);
  g.topk = std::uniform_int_distribution<std::uint32_t>(1, g.experts)(rng);
  return g;
}

// The stacked tensors `csf synth` writes for one layer (NVFP4 ModelOpt or gpt-oss MXFP4 names).
std::vector<Tensor> stacked_tensors(const std::string& L, const MoeHostWeights& w,
                                    bool scalar_globals = false) {
  const std::uint64_t E = w.geometry.experts, H = w.geometry.hidden, N = w.geometry.intermediate;
  const std::uint64_t g = group_size(w.format);
  if (w.format == ScaleFormat::mxfp4)
    return {{L + ".gate_up_proj_blocks", st::Dtype::U8, {E, 2 * N, H / 32, 16}, w.w13},
            {L + ".gate_up_proj_scales", st::Dtype::U8, {E, 2 * N, H / 32}, w.w13_scales},
            {L + ".down_proj_blocks", st::Dtype::U8, {E, H, N / 32, 16}, w.w2},
            {L + ".down_proj_scales", st::Dtype::U8, {E, H, N / 32}, w.w2_scales}};
  auto glob = [&](const std::vector<float>& v) {
    return scalar_globals ? Tensor{"", st::Dtype::F32, {}, bytes_of(std::vector<float>{v[0]})}
                          : Tensor{"", st::Dtype::F32, {E}, bytes_of(v)};
  };
  Tensor g13 = glob(w.w13_global), g2 = glob(w.w2_global);
  g13.name = L + ".w13.weight_scale_2";
  g2.name = L + ".w2.weight_scale_2";
  return {{L + ".w13.weight", st::Dtype::U8, {E, 2 * N, H / 2}, w.w13},
          {L + ".w13.weight_scale", st::Dtype::F8_E4M3, {E, 2 * N, H / g}, w.w13_scales},
          g13,
          {L + ".w13.input_scale", st::Dtype::F32, {E}, bytes_of(std::vector<float>(E, 1.0f))},
          {L + ".w2.weight", st::Dtype::U8, {E, H, N / 2}, w.w2},
          {L + ".w2.weight_scale", st::Dtype::F8_E4M3, {E, H, N / g}, w.w2_scales},
          g2};
}

// stacked_tensors with both scale tensors in the 128x4 swizzled layout. With
// 2N a multiple of 128 (random_geometry), w13's swizzled grid has the
// row-major shape: only a file's metadata tells the layouts apart.
std::vector<Tensor> swizzled_stacked_tensors(const std::string& layer, const MoeHostWeights& w) {
  const MoeLayerGeometry& g = w.geometry;
  auto ts = stacked_tensors(layer, w);
  const GridShape s13{ScaleFormat::nvfp4, ScaleLayout::row_major, g.experts, 2 * g.intermediate,
                      g.hidden / 16};
  const GridShape s2{ScaleFormat::nvfp4, ScaleLayout::row_major, g.experts, g.hidden, g.intermediate / 16};
  ts[1].data = relayout_scales(s13, w.w13_scales, ScaleLayout::swizzled_128x4);
  ts[1].shape = {g.experts, round_up(s13.rows, 128), round_up(s13.cols, 4)};
  ts[5].data = relayout_scales(s2, w.w2_scales, ScaleLayout::swizzled_128x4);
  ts[5].shape = {g.experts, round_up(s2.rows, 128), round_up(s2.cols, 4)};
  return ts;
}

void expect_same(const MoeHostWeights& a, const MoeHostWeights& b) {
  EXPECT_EQ(a.format, b.format);
  EXPECT_EQ(a.geometry.experts, b.geometry.experts);
  EXPECT_EQ(a.geometry.hidden, b.geometry.hidden);
  EXPECT_EQ(a.geometry.intermediate, b.geometry.intermediate);
  EXPECT_EQ(a.geometry.topk, b.geometry.topk);
  EXPECT_EQ(a.geometry.order, b.geometry.order);
  EXPECT_TRUE(a.w13 == b.w13);
  EXPECT_TRUE(a.w13_scales == b.w13_scales);
  EXPECT_TRUE(a.w2 == b.w2);
  EXPECT_TRUE(a.w2_scales == b.w2_scales);
  EXPECT_EQ(bytes_of(a.w13_global), bytes_of(b.w13_global));
  EXPECT_EQ(bytes_of(a.w2_global), bytes_of(b.w2_global));
}

// Reference outputs of both weight sets on the same random tokens must be identical.
void expect_same_reference(const MoeHostWeights& a, const MoeHostWeights& b, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const std::uint32_t T = 3, k = a.geometry.topk, H = a.geometry.hidden;
  std::normal_distribution<float> x;
  std::vector<std::uint16_t> hidden(std::size_t{T} * H);
  for (auto& v : hidden) v = float_to_bf16(x(rng));
  std::vector<std::int32_t> ids(std::size_t{T} * k);
  std::vector<float> wts(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    ids[i] = std::uniform_int_distribution<std::int32_t>(0, a.geometry.experts - 1)(rng);
    wts[i] = std::uniform_real_distribution<float>(0.1f, 1.0f)(rng);
  }
  std::vector<float> oa(hidden.size()), ob(hidden.size());
  moe_reference(a, hidden, T, ids, wts, oa, 1);
  moe_reference(b, hidden, T, ids, wts, ob, 1);
  EXPECT_EQ(bytes_of(oa), bytes_of(ob));
  double norm = 0;
  for (float v : oa) norm += double(v) * v;
  EXPECT_GT(norm, 0.0);  // a layer of zeros would make the comparison vacuous
}

// Per-expert ModelOpt layer from quantize_nvfp4 of random matrices, and the weights it must load as.
struct PerExpert {
  std::vector<Tensor> tensors;
  MoeHostWeights expected;
};
PerExpert per_expert_layer(const std::string& L, const MoeLayerGeometry& g, std::uint64_t seed,
                           const char* gate = "gate_proj", const char* up = "up_proj",
                           const char* down = "down_proj") {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 0.02f);
  auto mat = [&](std::size_t n) {
    std::vector<float> m(n);
    for (auto& v : m) v = d(rng);
    return m;
  };
  PerExpert out;
  MoeHostWeights& w = out.expected;
  w.format = ScaleFormat::nvfp4;
  w.geometry = g;
  const std::uint64_t H = g.hidden, N = g.intermediate;
  for (std::uint32_t e = 0; e < g.experts; ++e) {
    const QuantizedMatrix qg = quantize_nvfp4(mat(N * H), N, H);
    // ModelOpt shares the w1/w3 global scale; the loader requires it.
    const QuantizedMatrix qu = quantize_nvfp4(mat(N * H), N, H, qg.global_scale);
    const QuantizedMatrix qd = quantize_nvfp4(mat(H * N), H, N);
    const std::string p = L + "." + std::to_string(e) + ".";
    // Alternate [] and [1] global shapes.
    const std::vector<std::uint64_t> gs =
        e % 2 ? std::vector<std::uint64_t>{1} : std::vector<std::uint64_t>{};
    for (const auto& [name, q, rows, k] :
         {std::tuple{gate, &qg, N, H}, std::tuple{up, &qu, N, H}, std::tuple{down, &qd, H, N}}) {
      out.tensors.push_back({p + name + ".weight", st::Dtype::U8, {rows, k / 2}, q->packed});
      out.tensors.push_back({p + name + ".weight_scale", st::Dtype::F8_E4M3, {rows, k / 16}, q->scales});
      out.tensors.push_back(
          {p + name + ".weight_scale_2", st::Dtype::F32, gs, bytes_of(std::vector<float>{q->global_scale})});
    }
    w.w13.insert(w.w13.end(), qg.packed.begin(), qg.packed.end());
    w.w13.insert(w.w13.end(), qu.packed.begin(), qu.packed.end());
    w.w13_scales.insert(w.w13_scales.end(), qg.scales.begin(), qg.scales.end());
    w.w13_scales.insert(w.w13_scales.end(), qu.scales.begin(), qu.scales.end());
    w.w2.insert(w.w2.end(), qd.packed.begin(), qd.packed.end());
    w.w2_scales.insert(w.w2_scales.end(), qd.scales.begin(), qd.scales.end());
    w.w13_global.push_back(qg.global_scale);
    w.w2_global.push_back(qd.global_scale);
  }
  // Unrelated tensors around the experts, as in a real model.
  out.tensors.push_back({L.substr(0, L.rfind('.')) + ".gate.weight",
                         st::Dtype::F32,
                         {g.experts, H},
                         bytes_of(mat(std::size_t{g.experts} * H))});
  return out;
}

CompressOptions force_csf() {
  CompressOptions o;
  o.keep_unprofitable = false;  // every scale tensor as CSF parts, so decoding is exercised
  o.threads = 1;
  return o;
}

std::size_t csf_tensors(const CheckpointReport& r) {
  std::size_t n = 0;
  for (const auto& t : r.tensors) n += t.action == TensorAction::csf;
  return n;
}

template <class E, class F>
std::string expect_throw(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
    return {};
  }
  ADD_FAILURE() << "no exception";
  return {};
}

const std::string kL0 = "model.layers.0.mlp.experts";

TEST(MoeCheckpoint, StackedNvfp4RoundTripsAndCompressed) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const MoeLayerGeometry g = random_geometry(rng);
  const MoeHostWeights w = synthetic_moe_weights(ScaleFormat::nvfp4, g, seed);
  TempDir dir;
  const fs::path f = dir / "model.safetensors";
  write_st(f, stacked_tensors(kL0, w));
  EXPECT_EQ(list_moe_layers(f), std::vector<std::string>{kL0});
  const MoeHostWeights got = load_moe_layer(f, kL0, g.topk);
  expect_same(got, w);
  expect_same_reference(got, w, seed + 1);

  const CheckpointReport rep = compress_checkpoint(f, dir / "c.safetensors", force_csf());
  EXPECT_EQ(csf_tensors(rep), 2u);
  ASSERT_TRUE(is_csf_container(dir / "c.safetensors"));
  EXPECT_EQ(list_moe_layers(dir / "c.safetensors"), std::vector<std::string>{kL0});
  expect_same(load_moe_layer(dir / "c.safetensors", kL0, g.topk), w);
}

TEST(MoeCheckpoint, ScalarGlobalsBroadcast) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const MoeLayerGeometry g = random_geometry(rng);
  MoeHostWeights w = synthetic_moe_weights(ScaleFormat::nvfp4, g, seed);
  w.w13_global.assign(g.experts, w.w13_global[0]);
  w.w2_global.assign(g.experts, w.w2_global[0]);
  TempDir dir;
  write_st(dir / "m.safetensors", stacked_tensors(kL0, w, /*scalar_globals=*/true));
  expect_same(load_moe_layer(dir / "m.safetensors", kL0, g.topk), w);
}

TEST(MoeCheckpoint, GptOssMxfp4) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const MoeLayerGeometry g = random_geometry(rng);
  const MoeHostWeights w = synthetic_moe_weights(ScaleFormat::mxfp4, g, seed);
  TempDir dir;
  write_st(dir / "m.safetensors", stacked_tensors(kL0, w));
  const MoeHostWeights got = load_moe_layer(dir / "m.safetensors", kL0, g.topk);
  expect_same(got, w);
  expect_same_reference(got, w, seed + 1);
  compress_checkpoint(dir / "m.safetensors", dir / "c.safetensors", force_csf());
  expect_same(load_moe_layer(dir / "c.safetensors", kL0, g.topk), w);
  // Without biases: the fused [gate; up] rows csf synth writes, with SiLU.
  EXPECT_EQ(got.geometry.activation.kind, MoeActivation::silu);
  EXPECT_TRUE(got.w13_bias.empty() && got.w2_bias.empty());
}

// A gpt-oss checkpoint proper, as its files hold it: gate and up rows
// interleaved in gate_up_proj_blocks / _scales / _bias, biases BF16 or F32.
struct GptOssFile {
  std::uint64_t E = 0, H = 0, N = 0;
  Bytes b13, s13, b2, s2;            // blocks and scales, file order
  std::vector<float> bias13, bias2;  // the biases' values (exact in the file's dtype)
  st::Dtype bias_dtype = st::Dtype::F32;
  std::vector<Tensor> tensors(const std::string& L, bool with13 = true, bool with2 = true) const {
    auto enc = [&](const std::vector<float>& v) {
      if (bias_dtype == st::Dtype::F32) return bytes_of(v);
      std::vector<std::uint16_t> h(v.size());
      for (std::size_t i = 0; i < v.size(); ++i) {
        std::uint32_t bits;
        std::memcpy(&bits, &v[i], 4);
        h[i] = static_cast<std::uint16_t>(bits >> 16);  // the values are bf16-exact
      }
      return bytes_of(h);
    };
    std::vector<Tensor> ts = {{L + ".gate_up_proj_blocks", st::Dtype::U8, {E, 2 * N, H / 32, 16}, b13},
                              {L + ".gate_up_proj_scales", st::Dtype::U8, {E, 2 * N, H / 32}, s13},
                              {L + ".down_proj_blocks", st::Dtype::U8, {E, H, N / 32, 16}, b2},
                              {L + ".down_proj_scales", st::Dtype::U8, {E, H, N / 32}, s2}};
    if (with13) ts.push_back({L + ".gate_up_proj_bias", bias_dtype, {E, 2 * N}, enc(bias13)});
    if (with2) ts.push_back({L + ".down_proj_bias", bias_dtype, {E, H}, enc(bias2)});
    return ts;
  }
};

GptOssFile gpt_oss_file(const MoeLayerGeometry& g, st::Dtype bias_dtype, std::mt19937_64& rng) {
  GptOssFile f;
  f.E = g.experts;
  f.H = g.hidden;
  f.N = g.intermediate;
  f.bias_dtype = bias_dtype;
  std::uniform_int_distribution<int> byte(0, 255), scale(120, 128);  // E8M0 2^-7 .. 2^1
  auto fill = [&](std::uint64_t n, auto& d) {
    Bytes b(n);
    for (auto& v : b) v = static_cast<std::uint8_t>(d(rng));
    return b;
  };
  f.b13 = fill(f.E * 2 * f.N * f.H / 2, byte);
  f.s13 = fill(f.E * 2 * f.N * f.H / 32, scale);
  f.b2 = fill(f.E * f.H * f.N / 2, byte);
  f.s2 = fill(f.E * f.H * f.N / 32, scale);
  // bf16-exact values; every fourth one beyond the limit, so the clamp is reached.
  std::normal_distribution<float> d(0.0f, 2.0f);
  auto biases = [&](std::uint64_t n) {
    std::vector<float> v(n);
    for (std::size_t i = 0; i < n; ++i)
      v[i] = bf16_to_float(float_to_bf16(i % 4 == 3 ? (i % 8 == 3 ? 9.0f : -9.0f) + d(rng) : d(rng)));
    return v;
  };
  f.bias13 = biases(f.E * 2 * f.N);
  f.bias2 = biases(f.E * f.H);
  return f;
}

// The layer's output computed in float64 straight from the interleaved file
// tensors: gate i = row 2i, up i = row 2i + 1, gpt-oss's clamped SwiGLU
// written out (activation.hpp's formula), then the down projection and bias.
std::vector<double> gpt_oss_oracle(const GptOssFile& f, bool with13, bool with2,
                                   const std::vector<std::uint16_t>& hidden, std::uint32_t T, std::uint32_t k,
                                   const std::vector<std::int32_t>& ids, const std::vector<float>& wts) {
  const std::uint64_t H = f.H, N = f.N;
  auto elem = [](const Bytes& blocks, const Bytes& scales, std::uint64_t row, std::uint64_t col,
                 std::uint64_t K) {
    const std::uint8_t b = blocks[row * (K / 2) + col / 2];
    return double(e2m1_to_float(static_cast<std::uint8_t>(col % 2 ? b >> 4 : b & 0xF))) *
           double(e8m0_to_float(scales[row * (K / 32) + col / 32]));
  };
  std::vector<double> out(std::size_t{T} * H, 0.0);
  for (std::uint32_t t = 0; t < T; ++t)
    for (std::uint32_t j = 0; j < k; ++j) {
      const std::uint64_t e = std::uint64_t(ids[t * k + j]);
      std::vector<double> act(N);
      for (std::uint64_t i = 0; i < N; ++i) {
        const std::uint64_t gr = e * 2 * N + 2 * i, ur = gr + 1;  // interleaved rows
        double gate = with13 ? f.bias13[gr] : 0.0, up = with13 ? f.bias13[ur] : 0.0;
        for (std::uint64_t h = 0; h < H; ++h) {
          const double x = bf16_to_float(hidden[t * H + h]);
          gate += elem(f.b13, f.s13, gr, h, H) * x;
          up += elem(f.b13, f.s13, ur, h, H) * x;
        }
        gate = std::min(gate, 7.0);
        up = std::clamp(up, -7.0, 7.0);
        act[i] = (up + 1.0) * gate / (1.0 + std::exp(-1.702 * gate));
      }
      for (std::uint64_t h = 0; h < H; ++h) {
        double y = with2 ? f.bias2[e * H + h] : 0.0;
        for (std::uint64_t i = 0; i < N; ++i) y += elem(f.b2, f.s2, e * H + h, i, N) * act[i];
        out[t * H + h] += double(wts[t * k + j]) * y;
      }
    }
  return out;
}

double rel_error(const std::vector<float>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / den);
}

// The loaded layer: rows, scales and biases de-interleaved (checked index by
// index against the file), activation gpt_oss with gpt-oss's constants, and
// its CPU reference equal to the float64 layer computed from the file.
void expect_gpt_oss_layer(const MoeHostWeights& got, const GptOssFile& f, bool with13, bool with2,
                          std::uint32_t topk, std::uint64_t seed) {
  const std::uint64_t E = f.E, H = f.H, N = f.N;
  ASSERT_EQ(got.format, ScaleFormat::mxfp4);
  ASSERT_EQ(got.geometry.experts, E);
  ASSERT_EQ(got.geometry.hidden, H);
  ASSERT_EQ(got.geometry.intermediate, N);
  EXPECT_EQ(got.geometry.order, GateUpOrder::w13);
  EXPECT_EQ(got.geometry.activation.kind, MoeActivation::gpt_oss);
  EXPECT_EQ(got.geometry.activation.alpha, kGptOssAlpha);
  EXPECT_EQ(got.geometry.activation.limit, kGptOssLimit);
  ASSERT_EQ(got.w13.size(), f.b13.size());
  ASSERT_EQ(got.w13_scales.size(), f.s13.size());
  std::uint64_t mismatches = 0;
  for (std::uint64_t e = 0; e < E; ++e)
    for (std::uint64_t r = 0; r < 2 * N; ++r) {
      // Loaded row r: gate r (file row 2r) for r < N, else up r - N (file row 2(r - N) + 1).
      const std::uint64_t fr = e * 2 * N + (r < N ? 2 * r : 2 * (r - N) + 1), lr = e * 2 * N + r;
      for (std::uint64_t c = 0; c < H / 2; ++c)
        mismatches += got.w13[lr * (H / 2) + c] != f.b13[fr * (H / 2) + c];
      for (std::uint64_t c = 0; c < H / 32; ++c)
        mismatches += got.w13_scales[lr * (H / 32) + c] != f.s13[fr * (H / 32) + c];
      if (with13) mismatches += got.w13_bias.at(lr) != f.bias13[fr];
    }
  EXPECT_EQ(mismatches, 0u);
  EXPECT_EQ(got.w2, f.b2);
  EXPECT_EQ(got.w2_scales, f.s2);
  EXPECT_EQ(got.w13_global, std::vector<float>(E, 1.0f));
  if (with13)
    EXPECT_EQ(got.w13_bias.size(), E * 2 * N);
  else
    EXPECT_TRUE(got.w13_bias.empty());
  EXPECT_EQ(got.w2_bias, with2 ? f.bias2 : std::vector<float>{});

  std::mt19937_64 rng(seed);
  const std::uint32_t T = 5;
  std::normal_distribution<float> x;
  std::vector<std::uint16_t> hidden(std::size_t{T} * H);
  for (auto& v : hidden) v = float_to_bf16(x(rng));
  std::vector<std::int32_t> ids(std::size_t{T} * topk);
  std::vector<float> wts(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    ids[i] = std::uniform_int_distribution<std::int32_t>(0, std::int32_t(E) - 1)(rng);
    wts[i] = std::uniform_real_distribution<float>(0.1f, 1.0f)(rng);
  }
  std::vector<float> out(hidden.size());
  moe_reference(got, hidden, T, ids, wts, out, 1);
  const auto want = gpt_oss_oracle(f, with13, with2, hidden, T, topk, ids, wts);
  EXPECT_LT(rel_error(out, want), 1e-6);
  // The oracle is not blind to the row order: reading the rows fused is far off.
  MoeHostWeights fused = got;
  fused.w13 = f.b13;
  fused.w13_scales = f.s13;
  std::vector<float> wrong(hidden.size());
  moe_reference(fused, hidden, T, ids, wts, wrong, 1);
  EXPECT_GT(rel_error(wrong, want), 1e-2);
}

TEST(MoeCheckpoint, GptOssWithBiasesIsDeinterleaved) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir dir;
  for (st::Dtype dt : {st::Dtype::BF16, st::Dtype::F32}) {
    SCOPED_TRACE(std::string(st::to_string(dt)));
    const MoeLayerGeometry g = random_geometry(rng);
    const GptOssFile f = gpt_oss_file(g, dt, rng);
    const fs::path p = dir / fmt::format("oss-{}.safetensors", st::to_string(dt));
    write_st(p, f.tensors(kL0));
    EXPECT_EQ(list_moe_layers(p), std::vector<std::string>{kL0});
    const MoeHostWeights got = load_moe_layer(p, kL0, g.topk);
    expect_gpt_oss_layer(got, f, true, true, g.topk, seed + 1);
    // Through a CSF container: the same layer.
    const fs::path c = dir / fmt::format("oss-{}-csf.safetensors", st::to_string(dt));
    EXPECT_EQ(csf_tensors(compress_checkpoint(p, c, force_csf())), 2u);
    const MoeHostWeights back = load_moe_layer(c, kL0, g.topk);
    expect_same(back, got);
    EXPECT_EQ(back.w13_bias, got.w13_bias);
    EXPECT_EQ(back.w2_bias, got.w2_bias);
    EXPECT_EQ(back.geometry.activation.kind, MoeActivation::gpt_oss);
  }
  // Each bias is optional (MoeHostWeights' are): either one alone still marks
  // the layer gpt-oss's, interleaved and clamped.
  const MoeLayerGeometry g = random_geometry(rng);
  const GptOssFile f = gpt_oss_file(g, st::Dtype::BF16, rng);
  for (const auto& [with13, with2] : {std::pair{true, false}, std::pair{false, true}}) {
    SCOPED_TRACE(fmt::format("gate_up bias {}, down bias {}", with13, with2));
    const fs::path p = dir / fmt::format("oss-{}{}.safetensors", with13, with2);
    write_st(p, f.tensors(kL0, with13, with2));
    expect_gpt_oss_layer(load_moe_layer(p, kL0, g.topk), f, with13, with2, g.topk, seed + 2);
  }
}

// `compress --tp` of a gpt-oss checkpoint proper, vLLM's way: each rank
// keeps the contiguous interleaved rows [2 r n, 2 (r + 1) n) of gate_up
// (blocks, scales and bias: gate/up pairs stay together), down's columns,
// and the down bias on rank 0 only (zeros elsewhere), so that the ranks'
// reference outputs sum to the whole layer's. Both a file and a folder whose
// biases sit in another shard than the weights they mark.
TEST(MoeCheckpoint, GptOssTensorParallelSlicesKeepGateUpPairs) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir dir;
  MoeLayerGeometry g = random_geometry(rng);
  g.intermediate = 256;  // n = 128 (tp 2) and 64 (tp 4): a slice the MoE API plans (N % 64 == 0)
  const std::uint64_t E = g.experts, H = g.hidden, N = g.intermediate;
  const std::uint32_t T = 5;
  std::normal_distribution<float> x;
  std::vector<std::uint16_t> hidden(std::size_t{T} * H);
  for (auto& v : hidden) v = float_to_bf16(x(rng));
  std::vector<std::int32_t> ids(std::size_t{T} * g.topk);
  std::vector<float> wts(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    ids[i] = std::uniform_int_distribution<std::int32_t>(0, std::int32_t(E) - 1)(rng);
    wts[i] = std::uniform_real_distribution<float>(0.1f, 1.0f)(rng);
  }
  // Rows [a, b) of each of `outer` blocks of `rows` rows of `row_bytes` bytes.
  auto rows_of = [](const Bytes& src, std::uint64_t outer, std::uint64_t rows, std::uint64_t row_bytes,
                    std::uint64_t a, std::uint64_t b) {
    Bytes out;
    for (std::uint64_t o = 0; o < outer; ++o)
      out.insert(out.end(), src.begin() + (o * rows + a) * row_bytes,
                 src.begin() + (o * rows + b) * row_bytes);
    return out;
  };
  for (st::Dtype dt : {st::Dtype::BF16, st::Dtype::F32})
    for (bool folder : {false, true}) {
      SCOPED_TRACE(fmt::format("{} {}", st::to_string(dt), folder ? "folder" : "file"));
      const GptOssFile f = gpt_oss_file(g, dt, rng);
      const std::vector<Tensor> ts = f.tensors(kL0);
      std::map<std::string, Tensor> src;
      for (const auto& t : ts) src[t.name] = t;
      const std::string tag = fmt::format("{}-{}", st::to_string(dt), folder);
      const fs::path in = dir / ("in-" + tag + (folder ? "" : ".safetensors"));
      if (folder) {
        fs::create_directory(in);
        write_st(in / "model-00001-of-00002.safetensors", {ts.begin(), ts.begin() + 4});
        write_st(in / "model-00002-of-00002.safetensors", {ts.begin() + 4, ts.end()});
      } else {
        write_st(in, ts);
      }
      const MoeHostWeights whole = load_moe_layer(in, kL0, g.topk);
      ASSERT_EQ(whole.geometry.activation.kind, MoeActivation::gpt_oss);
      std::vector<float> whole_ref(hidden.size());
      moe_reference(whole, hidden, T, ids, wts, whole_ref, 1);
      const std::uint64_t bias_size = st::dtype_size(dt);
      for (unsigned tp : {2u, 4u}) {
        SCOPED_TRACE(fmt::format("tp {}", tp));
        const std::uint64_t n = N / tp;
        std::vector<double> sum(hidden.size(), 0.0);
        for (unsigned r = 0; r < tp; ++r) {
          SCOPED_TRACE(fmt::format("rank {}", r));
          const std::string rt = fmt::format("{}-{}-{}", tag, tp, r);
          const fs::path c = dir / ("c-" + rt + (folder ? "" : ".safetensors"));
          const fs::path back = dir / ("b-" + rt + (folder ? "" : ".safetensors"));
          CompressOptions o = force_csf();
          o.tp = tp;
          o.tp_rank = r;
          compress_checkpoint(in, c, o);
          decompress_checkpoint(c, back);
          std::map<std::string, Tensor> got;
          std::vector<fs::path> files{back};
          if (folder) {
            files.clear();
            for (const auto& de : fs::directory_iterator(back))
              if (de.path().extension() == ".safetensors") files.push_back(de.path());
          }
          for (const auto& p : files) {
            const st::File sf = st::File::open(p);
            for (const auto& t : sf.tensors()) {
              const auto d = sf.data(t);
              got[t.name] = Tensor{t.name, t.dtype, t.shape, Bytes(d.begin(), d.end())};
            }
          }
          ASSERT_EQ(got.size(), src.size());
          const std::uint64_t a = 2 * r * n, b = 2 * (r + 1) * n;  // rows of the 2N, pairs together
          const Tensor &b13 = got.at(kL0 + ".gate_up_proj_blocks"),
                       &s13 = got.at(kL0 + ".gate_up_proj_scales"),
                       &bias13 = got.at(kL0 + ".gate_up_proj_bias"), &bias2 = got.at(kL0 + ".down_proj_bias");
          EXPECT_EQ(b13.shape, (std::vector<std::uint64_t>{E, 2 * n, H / 32, 16}));
          EXPECT_EQ(b13.data, rows_of(f.b13, E, 2 * N, H / 2, a, b));
          EXPECT_EQ(s13.shape, (std::vector<std::uint64_t>{E, 2 * n, H / 32}));
          EXPECT_EQ(s13.data, rows_of(f.s13, E, 2 * N, H / 32, a, b));
          EXPECT_EQ(bias13.dtype, dt);
          EXPECT_EQ(bias13.shape, (std::vector<std::uint64_t>{E, 2 * n}));
          EXPECT_EQ(bias13.data, rows_of(src.at(bias13.name).data, E, 2 * N, bias_size, a, b));
          // The down bias: whole on rank 0, zeros of its shape and dtype elsewhere.
          EXPECT_EQ(bias2.dtype, dt);
          EXPECT_EQ(bias2.shape, (std::vector<std::uint64_t>{E, H}));
          EXPECT_EQ(bias2.data, r == 0 ? src.at(bias2.name).data : Bytes(E * H * bias_size, 0));
          // Down's blocks and scales: columns of N, as before.
          EXPECT_EQ(got.at(kL0 + ".down_proj_blocks").data, rows_of(f.b2, E * H, N / 32, 16, a / 64, b / 64));
          EXPECT_EQ(got.at(kL0 + ".down_proj_scales").data, rows_of(f.s2, E * H, N / 32, 1, a / 64, b / 64));

          const MoeHostWeights s = load_moe_layer(c, kL0, g.topk);
          ASSERT_EQ(s.geometry.intermediate, n);
          EXPECT_EQ(s.geometry.activation.kind, MoeActivation::gpt_oss);
          std::vector<float> part(hidden.size());
          moe_reference(s, hidden, T, ids, wts, part, 1);
          for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += part[i];
        }
        // moe_reference rounds each rank's partial sum to float: tp roundings.
        double num = 0, den = 0;
        for (std::size_t i = 0; i < sum.size(); ++i) {
          num += (sum[i] - whole_ref[i]) * (sum[i] - whole_ref[i]);
          den += double(whole_ref[i]) * whole_ref[i];
        }
        EXPECT_LT(std::sqrt(num / den), 1e-6 * tp);
      }
    }
}

TEST(MoeCheckpoint, RefusesBrokenExpertBiases) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const MoeLayerGeometry g = random_geometry(rng);
  const GptOssFile f = gpt_oss_file(g, st::Dtype::BF16, rng);
  const std::uint64_t E = g.experts, N = g.intermediate, H = g.hidden;
  const std::string b13 = kL0 + ".gate_up_proj_bias", b2 = kL0 + ".down_proj_bias";
  TempDir dir;
  int n = 0;
  auto variant = [&](auto edit) {
    auto ts = f.tensors(kL0);
    edit(ts);
    const fs::path p = dir / ("v" + std::to_string(n++) + ".safetensors");
    write_st(p, ts);
    return p;
  };
  auto find = [](std::vector<Tensor>& ts, const std::string& name) -> Tensor& {
    for (auto& t : ts)
      if (t.name == name) return t;
    throw std::runtime_error("no tensor " + name);
  };
  // The message names the file, the tensor and the reason.
  auto refused = [&](const fs::path& p, const std::string& tensor, const std::string& why) {
    const auto m = expect_throw<FormatError>([&] { (void)load_moe_layer(p, kL0, g.topk); });
    for (const auto& part : {p.string(), tensor, why}) EXPECT_NE(m.find(part), std::string::npos) << m;
  };
  // Wrong shapes: the N rows of one half, a transposed bias, an extra axis.
  for (const std::vector<std::uint64_t>& shape :
       {std::vector<std::uint64_t>{E, N}, {2 * N, E}, {E, 2 * N, 1}, {E * 2 * N}}) {
    const fs::path p = variant([&](auto& ts) {
      Tensor& t = find(ts, b13);
      t.shape = shape;
      std::uint64_t elems = 1;
      for (auto d : shape) elems *= d;
      t.data.resize(elems * 2);
    });
    refused(p, b13, "shape");
  }
  refused(variant([&](auto& ts) {
            Tensor& t = find(ts, b2);
            t.shape = {E + 1, H};
            t.data.resize((E + 1) * H * 2);
          }),
          b2, "shape");
  // Wrong dtypes: F16 (not what gpt-oss stores), U8 bytes of the same size.
  refused(variant([&](auto& ts) { find(ts, b2).dtype = st::Dtype::F16; }), b2, "BF16 or F32");
  refused(variant([&](auto& ts) {
            Tensor& t = find(ts, b13);
            t.dtype = st::Dtype::U8;
            t.shape = {E, 4 * N};
          }),
          b13, "BF16 or F32");
  // A non-finite bias, at a random place.
  {
    const std::uint64_t at = std::uniform_int_distribution<std::uint64_t>(0, E * H - 1)(rng);
    const fs::path p = variant([&](auto& ts) {
      const std::uint16_t inf = 0x7F80;
      std::memcpy(find(ts, b2).data.data() + 2 * at, &inf, 2);
    });
    refused(p, b2, fmt::format("[{}, {}] is inf", at / H, at % H));
  }
  // Biases on stacked (ModelOpt) or per-expert names: no convention says
  // their activation; refused, not dropped.
  {
    const MoeHostWeights w = synthetic_moe_weights(ScaleFormat::nvfp4, g, seed);
    auto ts = stacked_tensors(kL0, w);
    ts.push_back({kL0 + ".w2.bias", st::Dtype::F32, {E, H}, Bytes(E * H * 4)});
    write_st(dir / "stacked.safetensors", ts);
    const auto m =
        expect_throw<Unsupported>([&] { (void)load_moe_layer(dir / "stacked.safetensors", kL0, g.topk); });
    EXPECT_NE(m.find(kL0 + ".w2.bias"), std::string::npos) << m;
    PerExpert pe = per_expert_layer(kL0, g, seed);
    pe.tensors.push_back({kL0 + ".1.up_proj.bias", st::Dtype::F32, {N}, Bytes(N * 4)});
    write_st(dir / "per-expert.safetensors", pe.tensors);
    const auto m2 =
        expect_throw<Unsupported>([&] { (void)load_moe_layer(dir / "per-expert.safetensors", kL0, g.topk); });
    EXPECT_NE(m2.find(kL0 + ".1.up_proj.bias"), std::string::npos) << m2;
  }
  // A truncated file (cut at a random byte of its data): a typed error, no crash.
  {
    const fs::path p = variant([](auto&) {});
    const std::uintmax_t size = fs::file_size(p);
    fs::resize_file(p, std::uniform_int_distribution<std::uintmax_t>(size / 2, size - 1)(rng));
    try {
      (void)load_moe_layer(p, kL0, g.topk);
      ADD_FAILURE() << "a truncated file loaded";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(p.string()), std::string::npos) << e.what();
    }
  }
}

TEST(MoeCheckpoint, SwizzledScalesFromMetadata) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const MoeLayerGeometry g = random_geometry(rng);
  const MoeHostWeights w = synthetic_moe_weights(ScaleFormat::nvfp4, g, seed);
  const auto ts = swizzled_stacked_tensors(kL0, w);
  // The w13 grid needs no padding (2N is a multiple of 128), so only the metadata tells
  // the layouts apart; the bytes must differ for the test to mean anything.
  ASSERT_NE(ts[1].data, w.w13_scales);
  TempDir dir;
  write_st(dir / "m.safetensors", ts, st::Metadata{{"csfmoe.scale_layout", "swizzled_128x4"}});
  expect_same(load_moe_layer(dir / "m.safetensors", kL0, g.topk), w);
  CompressOptions o = force_csf();
  o.layout = ScaleLayout::swizzled_128x4;
  compress_checkpoint(dir / "m.safetensors", dir / "c.safetensors", o);
  expect_same(load_moe_layer(dir / "c.safetensors", kL0, g.topk), w);
}

// A file tagged csfmoe.scale_layout = swizzled_128x4 compresses as swizzled
// without being told, and the MoE layer loaded from the container equals the
// one loaded from the source (weights and reference outputs).
TEST(MoeCheckpoint, CompressHonoursTheScaleLayoutTag) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const MoeLayerGeometry g = random_geometry(rng);
  const MoeHostWeights w = synthetic_moe_weights(ScaleFormat::nvfp4, g, seed);
  const auto ts = swizzled_stacked_tensors(kL0, w);
  TempDir dir;
  write_st(dir / "m.safetensors", ts, st::Metadata{{std::string(kScaleLayoutKey), "swizzled_128x4"}});
  const MoeHostWeights native = load_moe_layer(dir / "m.safetensors", kL0, g.topk);
  expect_same(native, w);
  compress_checkpoint(dir / "m.safetensors", dir / "c.safetensors", force_csf());  // no layout given
  const MoeHostWeights packed = load_moe_layer(dir / "c.safetensors", kL0, g.topk);
  expect_same(packed, native);
  expect_same_reference(packed, native, seed + 1);
  CompressOptions contradicting = force_csf();
  contradicting.layout = ScaleLayout::row_major;
  try {
    compress_checkpoint(dir / "m.safetensors", dir / "d.safetensors", contradicting);
    ADD_FAILURE() << "a layout that contradicts the tag was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("m.safetensors"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(kScaleLayoutKey), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(dir / "d.safetensors"));
}

// The activation scales are not used by the W4A16 kernels, but the loader
// still checks them: CRC in a container, positive finite F32 everywhere.
TEST(MoeCheckpoint, InputScalesAreChecked) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const MoeLayerGeometry g = random_geometry(rng);
  const MoeHostWeights w = synthetic_moe_weights(ScaleFormat::nvfp4, g, seed);
  TempDir dir;
  write_st(dir / "m.safetensors", stacked_tensors(kL0, w));
  compress_checkpoint(dir / "m.safetensors", dir / "c.safetensors", force_csf());
  const std::string name = kL0 + ".w13.input_scale";
  {
    // One flipped byte of the input scale inside the container.
    const auto f = st::File::open(dir / "c.safetensors");
    const st::TensorInfo* t = f.find(name);
    ASSERT_NE(t, nullptr);
    const std::uint64_t at = f.data_offset() + t->begin + rng() % t->nbytes();
    std::fstream io(dir / "c.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    io.seekg(static_cast<std::streamoff>(at));
    char b = 0;
    io.read(&b, 1);
    b = static_cast<char>(b ^ (1 << (rng() % 8)));
    io.seekp(static_cast<std::streamoff>(at));
    io.write(&b, 1);
  }
  try {
    (void)load_moe_layer(dir / "c.safetensors", kL0, g.topk);
    ADD_FAILURE() << "a damaged input_scale was accepted";
  } catch (const CorruptData& e) {
    EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
  }
  // Non-positive values in a native file.
  auto ts = stacked_tensors(kL0, w);
  std::vector<float> bad(g.experts, 1.0f);
  bad[rng() % g.experts] = rng() % 2 ? 0.0f : -1.0f;
  ts[3].data = bytes_of(bad);
  write_st(dir / "bad.safetensors", ts);
  try {
    (void)load_moe_layer(dir / "bad.safetensors", kL0, g.topk);
    ADD_FAILURE() << "a non-positive input_scale was accepted";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("positive"), std::string::npos) << e.what();
  }
}

TEST(MoeCheckpoint, TopkAboveTheExpertsIsRefused) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const MoeLayerGeometry g = random_geometry(rng);
  TempDir dir;
  write_st(dir / "m.safetensors", stacked_tensors(kL0, synthetic_moe_weights(ScaleFormat::nvfp4, g, seed)));
  EXPECT_NO_THROW((void)load_moe_layer(dir / "m.safetensors", kL0, g.experts));
  try {
    (void)load_moe_layer(dir / "m.safetensors", kL0, g.experts + 1);
    ADD_FAILURE() << "top-k above the experts was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("exceeds"), std::string::npos) << e.what();
  }
}

TEST(MoeCheckpoint, PerExpertModelOpt) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const MoeLayerGeometry g = random_geometry(rng);
  const PerExpert pe = per_expert_layer(kL0, g, seed);
  TempDir dir;
  write_st(dir / "m.safetensors", pe.tensors);
  EXPECT_EQ(list_moe_layers(dir / "m.safetensors"), std::vector<std::string>{kL0});
  const MoeHostWeights got = load_moe_layer(dir / "m.safetensors", kL0, g.topk);
  expect_same(got, pe.expected);
  expect_same_reference(got, pe.expected, seed + 1);
  compress_checkpoint(dir / "m.safetensors", dir / "c.safetensors", force_csf());
  expect_same(load_moe_layer(dir / "c.safetensors", kL0, g.topk), pe.expected);

  // Mixtral-style w1 / w3 / w2 names load the same way.
  const PerExpert mx = per_expert_layer(kL0, g, seed + 7, "w1", "w3", "w2");
  write_st(dir / "mixtral.safetensors", mx.tensors);
  expect_same(load_moe_layer(dir / "mixtral.safetensors", kL0, g.topk), mx.expected);
}

TEST(MoeCheckpoint, ShardedFolderAndNaturalOrder) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const MoeLayerGeometry g = random_geometry(rng);
  const MoeHostWeights a = synthetic_moe_weights(ScaleFormat::nvfp4, g, seed);
  const MoeHostWeights b = synthetic_moe_weights(ScaleFormat::nvfp4, g, seed + 1);
  const PerExpert c = per_expert_layer("model.layers.2.mlp.experts", g, seed + 2);
  TempDir dir;
  fs::create_directory(dir / "ck");
  write_st(dir / "ck" / "model-00001-of-00002.safetensors",
           stacked_tensors("model.layers.10.mlp.experts", a));
  auto second = stacked_tensors("model.layers.9.mlp.experts", b);
  second.insert(second.end(), c.tensors.begin(), c.tensors.end());
  write_st(dir / "ck" / "model-00002-of-00002.safetensors", second);
  const std::vector<std::string> want = {"model.layers.2.mlp.experts", "model.layers.9.mlp.experts",
                                         "model.layers.10.mlp.experts"};
  EXPECT_EQ(list_moe_layers(dir / "ck"), want);
  expect_same(load_moe_layer(dir / "ck", want[2], g.topk), a);
  expect_same(load_moe_layer(dir / "ck", want[1], g.topk), b);
  expect_same(load_moe_layer(dir / "ck", want[0], g.topk), c.expected);
  compress_checkpoint(dir / "ck", dir / "cc", force_csf());
  EXPECT_EQ(list_moe_layers(dir / "cc"), want);
  expect_same(load_moe_layer(dir / "cc", want[2], g.topk), a);
  expect_same(load_moe_layer(dir / "cc", want[0], g.topk), c.expected);
}

TEST(MoeCheckpoint, RefusesBrokenCheckpoints) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const MoeLayerGeometry g = random_geometry(rng);
  const MoeHostWeights w = synthetic_moe_weights(ScaleFormat::nvfp4, g, seed);
  TempDir dir;
  int n = 0;
  // Writes the layer with `edit` applied; returns the file.
  auto variant = [&](auto edit) {
    auto ts = stacked_tensors(kL0, w);
    edit(ts);
    const fs::path p = dir / ("v" + std::to_string(n++) + ".safetensors");
    write_st(p, ts);
    return p;
  };
  auto has = [](const std::string& msg, const std::string& part) {
    EXPECT_NE(msg.find(part), std::string::npos) << msg << " does not name " << part;
  };

  {  // a missing tensor
    const fs::path p = variant([](auto& ts) { ts.erase(ts.begin() + 5); });
    const auto m = expect_throw<FormatError>([&] { load_moe_layer(p, kL0, g.topk); });
    has(m, p.string());
    has(m, kL0 + ".w2.weight_scale");
  }
  {  // an unknown layer lists the real ones
    const fs::path p = variant([](auto&) {});
    const auto m =
        expect_throw<InvalidArgument>([&] { load_moe_layer(p, "model.layers.7.mlp.experts", g.topk); });
    has(m, "model.layers.7.mlp.experts");
    has(m, kL0);
  }
  {  // w2 from a different expert count
    auto p = variant([&](auto& ts) {
      ts[4].shape[0] += 1;
      ts[4].data.resize(ts[4].data.size() / g.experts * (g.experts + 1));
    });
    const auto m = expect_throw<FormatError>([&] { load_moe_layer(p, kL0, g.topk); });
    has(m, kL0 + ".w2.weight");
  }
  {  // a BF16 block scale whose shape proves NVFP4
    auto p = variant([](auto& ts) {
      ts[1].dtype = st::Dtype::BF16;
      ts[1].shape.back() /= 2;
    });
    EXPECT_THROW(load_moe_layer(p, kL0, g.topk), FormatError);
  }
  {  // global scales of the wrong length, and a NaN global
    auto p = variant([](auto& ts) {
      ts[2].shape = {2, ts[2].shape[0]};
      ts[2].data.insert(ts[2].data.end(), ts[2].data.begin(), ts[2].data.end());
    });
    has(expect_throw<FormatError>([&] { load_moe_layer(p, kL0, g.topk); }), kL0 + ".w13.weight_scale_2");
    p = variant([](auto& ts) {
      const float nan = std::numeric_limits<float>::quiet_NaN();
      std::memcpy(ts[6].data.data(), &nan, 4);
    });
    has(expect_throw<FormatError>([&] { load_moe_layer(p, kL0, g.topk); }), kL0 + ".w2.weight_scale_2");
  }
  {  // k out of range is refused by plan_weights, named with the layer
    const fs::path p = variant([](auto&) {});
    has(expect_throw<InvalidArgument>([&] { load_moe_layer(p, kL0, 0); }), kL0);
    has(expect_throw<InvalidArgument>([&] { load_moe_layer(p, kL0, MoePlan::kMaxTopk + 1); }), kL0);
  }
  {  // H = 32: a valid FP4 layer that the MoE kernels' 64-wide tiles cannot take
    MoeLayerGeometry s = g;
    s.hidden = 32;
    MoeHostWeights small = w;
    small.geometry = s;
    const std::uint64_t E = s.experts, N = s.intermediate;
    small.w13.assign(E * 2 * N * 16, 0x21);
    small.w13_scales.assign(E * 2 * N * 2, 0x38);
    small.w2.assign(E * 32 * N / 2, 0x12);
    small.w2_scales.assign(E * 32 * N / 16, 0x38);
    write_st(dir / "h32.safetensors", stacked_tensors(kL0, small));
    has(expect_throw<InvalidArgument>([&] { load_moe_layer(dir / "h32.safetensors", kL0, g.topk); }), "H=32");
  }
  {  // a corrupted container tensor is caught by its CRC
    const fs::path p = variant([](auto&) {});
    const fs::path c = dir / "corrupt.safetensors";
    compress_checkpoint(p, c, force_csf());
    std::uint64_t off = 0;
    {
      const st::File f = st::File::open(c);
      const st::TensorInfo* t = f.find(kL0 + ".w13.weight");
      ASSERT_NE(t, nullptr);
      off =
          f.data_offset() + t->begin + std::uniform_int_distribution<std::uint64_t>(0, t->nbytes() - 1)(rng);
    }
    std::fstream io(c, std::ios::in | std::ios::out | std::ios::binary);
    io.seekg(static_cast<std::streamoff>(off));
    char ch = 0;
    io.read(&ch, 1);
    ch = static_cast<char>(ch ^ 0x10);
    io.seekp(static_cast<std::streamoff>(off));
    io.write(&ch, 1);
    io.close();
    has(expect_throw<CorruptData>([&] { load_moe_layer(c, kL0, g.topk); }), kL0 + ".w13.weight");
  }
  EXPECT_THROW(load_moe_layer(dir / "absent.safetensors", kL0, 1), IoError);
  EXPECT_THROW(list_moe_layers(dir / "absent"), IoError);
  fs::create_directory(dir / "empty");
  EXPECT_THROW(list_moe_layers(dir / "empty"), InvalidArgument);
}

TEST(MoeCheckpoint, RefusesBrokenPerExpertLayers) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  MoeLayerGeometry g = random_geometry(rng);
  g.experts = std::max(g.experts, 3u);
  TempDir dir;
  int n = 0;
  auto variant = [&](auto edit) {
    PerExpert pe = per_expert_layer(kL0, g, seed);
    edit(pe.tensors);
    const fs::path p = dir / ("v" + std::to_string(n++) + ".safetensors");
    write_st(p, pe.tensors);
    return p;
  };
  auto erase_prefix = [](std::vector<Tensor>& ts, const std::string& prefix) {
    std::erase_if(ts, [&](const Tensor& t) { return t.name.starts_with(prefix); });
  };
  auto find = [](std::vector<Tensor>& ts, const std::string& name) -> Tensor& {
    for (auto& t : ts)
      if (t.name == name) return t;
    throw std::runtime_error("no tensor " + name);
  };
  {  // gate and up with different global scales need requantization
    const std::uint32_t e = std::uniform_int_distribution<std::uint32_t>(0, g.experts - 1)(rng);
    const std::string up = kL0 + "." + std::to_string(e) + ".up_proj.weight_scale_2";
    const fs::path p = variant([&](auto& ts) {
      float v;
      std::memcpy(&v, find(ts, up).data.data(), 4);
      v *= 1.5f;
      std::memcpy(find(ts, up).data.data(), &v, 4);
    });
    const auto m = expect_throw<Unsupported>([&] { load_moe_layer(p, kL0, g.topk); });
    EXPECT_NE(m.find(up), std::string::npos) << m;
    EXPECT_NE(m.find(kL0 + "." + std::to_string(e) + ".gate_proj.weight_scale_2"), std::string::npos) << m;
  }
  {  // a hole in the expert numbering
    const fs::path p = variant([&](auto& ts) { erase_prefix(ts, kL0 + ".1."); });
    const auto m = expect_throw<FormatError>([&] { load_moe_layer(p, kL0, g.topk); });
    EXPECT_NE(m.find(kL0 + ".1."), std::string::npos) << m;
  }
  {  // one expert with a different intermediate size
    const std::string p2 = kL0 + "." + std::to_string(g.experts - 1) + ".";
    const fs::path p = variant([&](auto& ts) {
      erase_prefix(ts, p2);
      MoeLayerGeometry other = g;
      other.intermediate += 64;
      other.experts = 1;
      for (auto t : per_expert_layer(kL0, other, seed + 3).tensors)
        if (t.name.starts_with(kL0 + ".0.")) {
          t.name = p2 + t.name.substr(kL0.size() + 3);
          ts.push_back(std::move(t));
        }
    });
    const auto m = expect_throw<FormatError>([&] { load_moe_layer(p, kL0, g.topk); });
    EXPECT_NE(m.find(p2), std::string::npos) << m;
  }
  {  // a missing global scale
    const std::string name = kL0 + ".0.down_proj.weight_scale_2";
    const fs::path p =
        variant([&](auto& ts) { std::erase_if(ts, [&](const Tensor& t) { return t.name == name; }); });
    const auto m = expect_throw<FormatError>([&] { load_moe_layer(p, kL0, g.topk); });
    EXPECT_NE(m.find(name), std::string::npos) << m;
  }
  {  // per-expert [E] globals are not a per-expert tensor's shape
    const std::string name = kL0 + ".0.down_proj.weight_scale_2";
    const fs::path p = variant([&](auto& ts) {
      Tensor& t = find(ts, name);
      t.shape = {2};
      t.data.insert(t.data.end(), t.data.begin(), t.data.end());
    });
    EXPECT_THROW(load_moe_layer(p, kL0, g.topk), FormatError);
  }
}

// --- the CLI ----------------------------------------------------------------
struct CliRun {
  int code = -1;
  std::string out, err;
};

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

CliRun csf(const TempDir& dir, const std::string& args) {
  const fs::path o = dir / "stdout.txt", e = dir / "stderr.txt";
  const std::string cmd =
      std::string("'") + CSFMOE_CSF_BINARY + "' " + args + " >'" + o.string() + "' 2>'" + e.string() + "'";
  const int st = std::system(cmd.c_str());
  CliRun r;
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  r.out = read_text(o);
  r.err = read_text(e);
  return r;
}

TEST(MoeCheckpointCli, RunsALayerOfACheckpoint) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  MoeLayerGeometry g = random_geometry(rng);
  const MoeHostWeights w = synthetic_moe_weights(ScaleFormat::nvfp4, g, seed);
  TempDir dir;
  const fs::path one = dir / "one.safetensors";
  write_st(one, stacked_tensors(kL0, w));
  CliRun r = csf(dir, "moe --checkpoint '" + one.string() + "' --cpu --tokens 2 --iters 1");
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  const std::string want = fmt::format("{} : {} E={} H={} N={} k={} nvfp4", one.string(), kL0, g.experts,
                                       g.hidden, g.intermediate, std::min(8u, g.experts));
  EXPECT_NE(r.out.find(want), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("cpu-reference"), std::string::npos) << r.out;

  // Compressed, two layers: --layer is needed, and the error lists them.
  const std::string l1 = "model.layers.1.mlp.experts";
  auto ts = stacked_tensors(kL0, w);
  const auto more = stacked_tensors(l1, synthetic_moe_weights(ScaleFormat::mxfp4, g, seed + 1));
  ts.insert(ts.end(), more.begin(), more.end());
  write_st(dir / "two.safetensors", ts);
  compress_checkpoint(dir / "two.safetensors", dir / "two.csf.safetensors", force_csf());
  const std::string two = "'" + (dir / "two.csf.safetensors").string() + "'";
  r = csf(dir, "moe --checkpoint " + two + " --cpu --tokens 2 --iters 1");
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  EXPECT_NE(r.err.find(kL0), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(l1), std::string::npos) << r.err;
  r = csf(dir, "moe --checkpoint " + two + " --layer " + l1 + " --topk 2 --cpu --tokens 2 --iters 1");
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find(fmt::format("{} E={} H={} N={} k=2 mxfp4", l1, g.experts, g.hidden, g.intermediate)),
            std::string::npos)
      << r.out;
  // An explicit k above the layer's experts is refused, naming both.
  r = csf(dir, "moe --checkpoint " + two + " --layer " + l1 + " --topk " + std::to_string(g.experts + 1) +
                   " --cpu --tokens 2 --iters 1");
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  EXPECT_NE(r.err.find(fmt::format("topk = {} exceeds geometry.experts = {}", g.experts + 1, g.experts)),
            std::string::npos)
      << r.err;
  r = csf(dir, "moe --checkpoint " + two + " --layer model.layers.5.mlp.experts --cpu --tokens 2");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("model.layers.5.mlp.experts"), std::string::npos) << r.err;
  // A checkpoint fixes the geometry; --layer needs a checkpoint.
  EXPECT_NE(csf(dir, "moe --checkpoint " + two + " --hidden 128 --cpu").code, 0);
  EXPECT_NE(csf(dir, "moe --layer " + kL0 + " --cpu").code, 0);
}

TEST(MoeCheckpointCli, RunsAGptOssLayerWithItsBiases) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const MoeLayerGeometry g = random_geometry(rng);
  const GptOssFile f = gpt_oss_file(g, st::Dtype::BF16, rng);
  TempDir dir;
  const fs::path p = dir / "oss.safetensors";
  write_st(p, f.tensors(kL0));
  const CliRun r = csf(dir, "moe --checkpoint '" + p.string() + "' --cpu --tokens 2 --iters 1");
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find(fmt::format("{} E={} H={} N={} k={} mxfp4 gpt_oss (alpha 1.702, limit 7, gate/up and "
                                   "down biases)",
                                   kL0, g.experts, g.hidden, g.intermediate, std::min(8u, g.experts))),
            std::string::npos)
      << r.out;
}

}  // namespace
