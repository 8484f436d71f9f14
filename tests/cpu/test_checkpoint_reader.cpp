// CheckpointFile, the one per-tensor reader of the MoE layer loader and the
// Python package: clean containers read back byte-exact, and one flipped byte
// in any stored tensor (each CSF part, each native tensor) is refused with
// the error class that verify_checkpoint gives, naming file and tensor.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "csfmoe/checkpoint.hpp"
#include "csfmoe/checkpoint_reader.hpp"
#include "csfmoe/errors.hpp"
#include "csfmoe/moe_checkpoint.hpp"
#include "csfmoe/safetensors.hpp"
#include "csfmoe/synthetic.hpp"
#include "test_files.hpp"
#include "test_seed.hpp"

namespace fs = std::filesystem;
using namespace csfmoe;
using csfmoe::testing::read_bytes;
using csfmoe::testing::TempDir;
using csfmoe::testing::write_bytes;

namespace {

const std::string kLayer = "model.layers.0.mlp.experts";

struct Tensor {
  std::string name, dtype;
  std::vector<std::uint64_t> shape;
  std::string bytes;
};

std::string random_bytes(std::size_t n, std::mt19937_64& rng) {
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(rng());
  return s;
}

std::string scales(std::uint32_t e, std::uint32_t rows, std::uint32_t cols, std::mt19937_64& rng) {
  const auto v = synthetic_scales({ScaleFormat::nvfp4, ScaleLayout::row_major, e, rows, cols},
                                  ScaleDistribution::realistic, rng());
  return {v.begin(), v.end()};
}

std::string finite_floats(std::size_t n, std::mt19937_64& rng) {
  std::string s(4 * n, '\0');
  for (std::size_t i = 0; i < n; ++i) {
    const float f = 0.5f + static_cast<float>(rng() % 1000) / 1000.0f;
    std::memcpy(s.data() + 4 * i, &f, 4);
  }
  return s;
}

// A stacked NVFP4 layer (E = 2, H = 512, N = 256) and a passthrough weight.
std::vector<Tensor> layer_tensors(std::mt19937_64& rng) {
  const std::uint32_t e = 2, h = 512, n = 256;
  return {
      {kLayer + ".w13.weight", "U8", {e, 2 * n, h / 2}, random_bytes(std::size_t{e} * 2 * n * h / 2, rng)},
      {kLayer + ".w13.weight_scale", "F8_E4M3", {e, 2 * n, h / 16}, scales(e, 2 * n, h / 16, rng)},
      {kLayer + ".w13.weight_scale_2", "F32", {e}, finite_floats(e, rng)},
      {kLayer + ".w2.weight", "U8", {e, h, n / 2}, random_bytes(std::size_t{e} * h * n / 2, rng)},
      {kLayer + ".w2.weight_scale", "F8_E4M3", {e, h, n / 16}, scales(e, h, n / 16, rng)},
      {kLayer + ".w2.weight_scale_2", "F32", {e}, finite_floats(e, rng)},
      {"model.embed_tokens.weight", "BF16", {32, 64}, random_bytes(32 * 64 * 2, rng)},
  };
}

std::string build_file(const std::vector<Tensor>& ts) {
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  std::string data;
  for (const auto& t : ts) {
    h[t.name] = {{"dtype", t.dtype},
                 {"shape", t.shape},
                 {"data_offsets", {data.size(), data.size() + t.bytes.size()}}};
    data += t.bytes;
  }
  std::string json = h.dump();
  json.resize((json.size() + 7) / 8 * 8, ' ');
  std::string out(8, '\0');
  const std::uint64_t n = json.size();
  std::memcpy(out.data(), &n, 8);
  return out + json + data;
}

// The error kind of `f`, or nullopt when it succeeds; the message goes to `what`.
template <class F>
std::optional<ErrorKind> verdict(F&& f, std::string* what = nullptr) {
  try {
    f();
  } catch (const Error& e) {
    if (what) *what = e.what();
    return e.kind();
  }
  return std::nullopt;
}

// Reads every logical tensor, as the Python loader does.
void read_all(const fs::path& p) {
  const CheckpointFile f = CheckpointFile::open(p);
  for (const auto& t : f.tensors()) (void)f.read(t.name);
}

}  // namespace

TEST(CheckpointReader, CleanContainerReadsByteExact) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir dir;
  const auto ts = layer_tensors(rng);
  write_bytes(dir.path / "a.safetensors", build_file(ts));
  compress_checkpoint(dir.path / "a.safetensors", dir.path / "c.safetensors");
  for (const char* name : {"a.safetensors", "c.safetensors"}) {
    const CheckpointFile f = CheckpointFile::open(dir.path / name);
    EXPECT_EQ(f.is_container(), std::string(name) == "c.safetensors");
    ASSERT_EQ(f.tensors().size(), ts.size());
    for (const auto& t : ts) {
      const auto got = f.read(t.name);
      EXPECT_EQ(std::string(got.begin(), got.end()), t.bytes) << name << " " << t.name;
      if (f.csf_entry(t.name)) {
        const CsfTensor parts = f.csf_parts(t.name);
        EXPECT_EQ(parts.source_bytes(), t.bytes.size());
        EXPECT_THROW((void)f.native_bytes(t.name), InvalidArgument);
      } else {
        const auto view = f.native_bytes(t.name);
        EXPECT_EQ(std::string(view.begin(), view.end()), t.bytes);
      }
    }
  }
  const CheckpointFile c = CheckpointFile::open(dir.path / "c.safetensors");
  EXPECT_NE(c.csf_entry(kLayer + ".w13.weight_scale"), nullptr);
  EXPECT_NE(c.csf_entry(kLayer + ".w2.weight_scale"), nullptr);
  EXPECT_THROW((void)c.read("no.such.tensor"), InvalidArgument);
}

TEST(CheckpointReader, EveryFlippedStoredByteIsRefusedAsVerifyDoes) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir dir;
  write_bytes(dir.path / "a.safetensors", build_file(layer_tensors(rng)));
  const fs::path good = dir.path / "c.safetensors";
  compress_checkpoint(dir.path / "a.safetensors", good);
  ASSERT_FALSE(verdict([&] { read_all(good); }));
  ASSERT_FALSE(verdict([&] { (void)load_moe_layer(good, kLayer, 2); }));

  const st::File stored = st::File::open(good);
  int checked = 0, corrupt = 0;
  for (const auto& t : stored.tensors()) {
    if (!t.nbytes()) continue;
    // The logical tensor the stored one belongs to (a CSF part names its tensor).
    const auto csf = t.name.find(".csf.");
    const std::string logical = csf == std::string::npos ? t.name : t.name.substr(0, csf);
    std::string bytes = read_bytes(good);
    bytes[stored.data_offset() + t.begin + rng() % t.nbytes()] ^= static_cast<char>(0xFF);
    const fs::path bad = dir.path / ("bad" + std::to_string(checked++) + ".safetensors");
    write_bytes(bad, bytes);

    std::string verify_msg, read_msg, layer_msg;
    const auto want = verdict([&] { (void)verify_checkpoint(bad); }, &verify_msg);
    ASSERT_TRUE(want) << t.name << ": verify accepted a flipped byte";
    EXPECT_TRUE(*want == ErrorKind::corrupt || *want == ErrorKind::format) << verify_msg;
    corrupt += *want == ErrorKind::corrupt;
    EXPECT_EQ(verdict([&] { read_all(bad); }, &read_msg), want) << t.name << ": " << read_msg;
    EXPECT_NE(read_msg.find(bad.string()), std::string::npos) << read_msg;
    EXPECT_NE(read_msg.find("'" + logical + "'"), std::string::npos) << read_msg;
    if (logical.starts_with(kLayer))
      EXPECT_EQ(verdict([&] { (void)load_moe_layer(bad, kLayer, 2); }, &layer_msg), want)
          << t.name << ": " << layer_msg;
  }
  EXPECT_GE(checked, 10);  // 2 x 4 parts (minus empty ones) and the native tensors
  EXPECT_GE(corrupt, 5);   // at least the native tensors fail their CRC
}

TEST(CheckpointReader, FolderFilesFollowTheIndex) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir dir;
  const auto ts = layer_tensors(rng);
  write_bytes(dir.path / "b.safetensors", build_file({ts.begin(), ts.begin() + 3}));
  write_bytes(dir.path / "a.safetensors", build_file({ts.begin() + 3, ts.end()}));
  auto names = [](const std::vector<fs::path>& v) {
    std::vector<std::string> out;
    for (const auto& p : v) out.push_back(p.filename().string());
    return out;
  };
  EXPECT_EQ(names(checkpoint_files(dir.path)), (std::vector<std::string>{"a.safetensors", "b.safetensors"}));
  nlohmann::ordered_json idx = {{"metadata", nlohmann::ordered_json::object()},
                                {"weight_map", nlohmann::ordered_json::object()}};
  for (std::size_t i = 0; i < ts.size(); ++i)
    idx["weight_map"][ts[i].name] = i < 3 ? "b.safetensors" : "a.safetensors";
  write_bytes(dir.path / "model.safetensors.index.json", idx.dump());
  EXPECT_EQ(names(checkpoint_files(dir.path)), (std::vector<std::string>{"b.safetensors", "a.safetensors"}));
  idx["weight_map"][ts[0].name] = "../a.safetensors";
  write_bytes(dir.path / "model.safetensors.index.json", idx.dump());
  EXPECT_THROW((void)checkpoint_files(dir.path), FormatError);
  const TempDir empty;
  EXPECT_THROW((void)checkpoint_files(empty.path), InvalidArgument);
  EXPECT_THROW((void)checkpoint_files(empty.path / "missing"), IoError);
}

TEST(CheckpointReader, LayerRulesOnATableMatchTheFileLoader) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir dir;
  const auto ts = layer_tensors(rng);
  write_bytes(dir.path / "a.safetensors", build_file(ts));
  const MoeHostWeights w = load_moe_layer(dir.path / "a.safetensors", kLayer, 2);

  auto table_of = [&](const std::vector<Tensor>& tensors) {
    auto t = std::make_unique<MoeTensorTable>("table", [tensors](const std::string& name) {
      for (const auto& x : tensors)
        if (x.name == name) return std::vector<std::uint8_t>(x.bytes.begin(), x.bytes.end());
      return std::vector<std::uint8_t>{};
    });
    for (const auto& x : tensors) t->add(x.name, *st::parse_dtype(x.dtype), x.shape);
    return t;
  };
  const MoeLayerSpec spec = resolve_moe_layer(*table_of(ts), kLayer, 2);
  EXPECT_EQ(spec.naming, "stacked");
  EXPECT_EQ(spec.format, w.format);
  EXPECT_EQ(spec.geometry.experts, w.geometry.experts);
  EXPECT_EQ(spec.geometry.hidden, w.geometry.hidden);
  EXPECT_EQ(spec.geometry.intermediate, w.geometry.intermediate);
  EXPECT_EQ(spec.w13_global, w.w13_global);
  EXPECT_EQ(spec.w2_global, w.w2_global);
  ASSERT_EQ(spec.w13.size(), 1u);
  EXPECT_EQ(spec.w13[0].weight, kLayer + ".w13.weight");
  EXPECT_EQ(spec.w13[0].scale, kLayer + ".w13.weight_scale");

  // Both missing tensors are named at once, with the layer.
  std::vector<Tensor> part;
  for (const auto& x : ts)
    if (!x.name.starts_with(kLayer + ".w2.weight")) part.push_back(x);
  std::string msg;
  EXPECT_EQ(verdict([&] { (void)resolve_moe_layer(*table_of(part), kLayer, 2); }, &msg), ErrorKind::format);
  EXPECT_NE(msg.find("table: layer '" + kLayer + "' (stacked layout): missing tensors '" + kLayer +
                     ".w2.weight', '" + kLayer + ".w2.weight_scale'"),
            std::string::npos)
      << msg;
  write_bytes(dir.path / "part.safetensors", build_file(part));
  std::string file_msg;
  EXPECT_EQ(verdict([&] { (void)load_moe_layer(dir.path / "part.safetensors", kLayer, 2); }, &file_msg),
            ErrorKind::format);
  EXPECT_NE(file_msg.find("missing tensors '" + kLayer + ".w2.weight', '" + kLayer + ".w2.weight_scale'"),
            std::string::npos)
      << file_msg;
  // An unknown layer lists the layers the table holds.
  EXPECT_EQ(verdict([&] { (void)resolve_moe_layer(*table_of(ts), "model.layers.9.mlp.experts", 2); }, &msg),
            ErrorKind::invalid_argument);
  EXPECT_NE(msg.find("layers found: " + kLayer), std::string::npos) << msg;
}
