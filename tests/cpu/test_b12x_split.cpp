// compress --schema b12x of stacked expert tensors ([E, R, C], as csf synth
// writes them): split per expert under b12x's names (fused gate/up rows in
// [gate; up] order), byte for byte, then stored as b12x planes; decompress
// gives the per-expert tensors back, verify passes, load_moe_layer reads the
// same layer; inputs that cannot be split are refused with nothing written.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "csfmoe/checkpoint.hpp"
#include "csfmoe/checkpoint_reader.hpp"
#include "csfmoe/errors.hpp"
#include "csfmoe/moe.hpp"
#include "csfmoe/moe_checkpoint.hpp"
#include "csfmoe/safetensors.hpp"
#include "test_files.hpp"
#include "test_seed.hpp"

namespace csfmoe {
namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<std::uint8_t>;
using csfmoe::testing::TempDir;

const std::string kLayer = "model.layers.0.mlp.experts";

struct Tensor {
  std::string name;
  st::Dtype dtype;
  std::vector<std::uint64_t> shape;
  Bytes bytes;
};

Bytes floats(const std::vector<float>& v) {
  Bytes b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

void write_file(const fs::path& p, const std::vector<Tensor>& ts) {
  st::Writer w(p, 1 << 16);
  for (const auto& t : ts) w.add_tensor(t.name, t.dtype, t.shape, t.bytes);
  w.commit(std::nullopt);
}

// The layer as csf synth writes it: ModelOpt w13 / w2 (NVFP4) or gpt-oss (MXFP4).
std::vector<Tensor> stacked(const MoeHostWeights& w) {
  const std::uint64_t E = w.geometry.experts, H = w.geometry.hidden, N = w.geometry.intermediate;
  const std::string& L = kLayer;
  if (w.format == ScaleFormat::mxfp4)
    return {{L + ".gate_up_proj_blocks", st::Dtype::U8, {E, 2 * N, H / 32, 16}, w.w13},
            {L + ".gate_up_proj_scales", st::Dtype::U8, {E, 2 * N, H / 32}, w.w13_scales},
            {L + ".down_proj_blocks", st::Dtype::U8, {E, H, N / 32, 16}, w.w2},
            {L + ".down_proj_scales", st::Dtype::U8, {E, H, N / 32}, w.w2_scales}};
  return {{L + ".w13.weight", st::Dtype::U8, {E, 2 * N, H / 2}, w.w13},
          {L + ".w13.weight_scale", st::Dtype::F8_E4M3, {E, 2 * N, H / 16}, w.w13_scales},
          {L + ".w13.weight_scale_2", st::Dtype::F32, {E}, floats(w.w13_global)},
          {L + ".w13.input_scale", st::Dtype::F32, {E}, floats(std::vector<float>(E, 1.0f))},
          {L + ".w2.weight", st::Dtype::U8, {E, H, N / 2}, w.w2},
          {L + ".w2.weight_scale", st::Dtype::F8_E4M3, {E, H, N / 16}, w.w2_scales},
          {L + ".w2.weight_scale_2", st::Dtype::F32, {E}, floats(w.w2_global)}};
}

// Per-expert name -> the bytes it must hold: slice e (and half h of a fused tensor) of the stacked input.
std::map<std::string, Bytes> expected_split(const MoeHostWeights& w) {
  std::map<std::string, Bytes> out;
  const bool mx = w.format == ScaleFormat::mxfp4;
  const std::uint64_t E = w.geometry.experts;
  const auto cut = [&](const Bytes& b, std::uint64_t e, std::uint64_t h, std::uint64_t halves) {
    const std::uint64_t per = b.size() / E, piece = per / halves;
    return Bytes(b.begin() + std::ptrdiff_t(e * per + h * piece),
                 b.begin() + std::ptrdiff_t(e * per + (h + 1) * piece));
  };
  const char* gate = mx ? "w1" : "gate_proj";
  const char* up = mx ? "w3" : "up_proj";
  const char* down = mx ? "w2" : "down_proj";
  for (std::uint64_t e = 0; e < E; ++e) {
    const std::string p = fmt::format("{}.{}.", kLayer, e);
    out[p + gate + ".weight"] = cut(w.w13, e, 0, 2);
    out[p + up + ".weight"] = cut(w.w13, e, 1, 2);
    out[p + gate + ".weight_scale"] = cut(w.w13_scales, e, 0, 2);
    out[p + up + ".weight_scale"] = cut(w.w13_scales, e, 1, 2);
    out[p + down + ".weight"] = cut(w.w2, e, 0, 1);
    out[p + down + ".weight_scale"] = cut(w.w2_scales, e, 0, 1);
    if (!mx) {
      const Bytes g13 = floats(w.w13_global), g2 = floats(w.w2_global), one = floats({1.0f});
      out[p + "gate_proj.weight_scale_2"] = out[p + "up_proj.weight_scale_2"] = cut(g13, e, 0, 1);
      out[p + "gate_proj.input_scale"] = out[p + "up_proj.input_scale"] = one;
      out[p + "down_proj.weight_scale_2"] = cut(g2, e, 0, 1);
    }
  }
  return out;
}

void expect_same_layer(const MoeHostWeights& a, const MoeHostWeights& b) {
  EXPECT_EQ(a.format, b.format);
  EXPECT_EQ(a.geometry.experts, b.geometry.experts);
  EXPECT_TRUE(a.w13 == b.w13);
  EXPECT_TRUE(a.w13_scales == b.w13_scales);
  EXPECT_TRUE(a.w13_global == b.w13_global);
  EXPECT_TRUE(a.w2 == b.w2);
  EXPECT_TRUE(a.w2_scales == b.w2_scales);
  EXPECT_TRUE(a.w2_global == b.w2_global);
}

// Checks a decompressed per-expert file (or folder) against the expected slices.
void expect_split(const fs::path& restored, const std::map<std::string, Bytes>& want, std::size_t others) {
  std::map<std::string, Bytes> got;
  const auto read = [&](const fs::path& p) {
    const st::File f = st::File::open(p);
    for (const auto& t : f.tensors()) {
      const auto d = f.data(t);
      got[t.name] = Bytes(d.begin(), d.end());
      if (want.count(t.name) && (t.name.ends_with("_2") || t.name.ends_with("input_scale")))
        EXPECT_TRUE(t.shape.empty()) << t.name << ": per-expert global scales are scalars";
    }
  };
  if (fs::is_directory(restored)) {
    for (const auto& de : fs::directory_iterator(restored))
      if (de.path().extension() == ".safetensors") read(de.path());
  } else {
    read(restored);
  }
  EXPECT_EQ(got.size(), want.size() + others);
  for (const auto& [name, bytes] : want) {
    ASSERT_TRUE(got.count(name)) << name << " missing";
    EXPECT_TRUE(got.at(name) == bytes) << name << ": not the stacked input's slice";
  }
}

class B12xSplit : public ::testing::TestWithParam<ScaleFormat> {};

TEST_P(B12xSplit, StackedFileIsSplitPerExpertByteForByte) {
  CSFMOE_SEEDED(seed);
  for (const std::uint32_t E : {1u, 2u, 5u}) {
    SCOPED_TRACE(fmt::format("E = {}", E));
    const MoeHostWeights w = synthetic_moe_weights(GetParam(), {E, 256, 128, 2}, seed + E, /*fast=*/true);
    TempDir d;
    write_file(d.path / "m.safetensors", stacked(w));
    CompressOptions o;
    o.schema = CheckpointSchema::b12x;
    compress_checkpoint(d.path / "m.safetensors", d.path / "b.safetensors", o);
    // Only the output is left: the hidden split copy is gone.
    EXPECT_EQ(d.entries(), (std::set<std::string>{"b.safetensors", "m.safetensors"}));
    // Planes under per-expert b12x names, no stacked tensor left.
    const st::File c = st::File::open(d.path / "b.safetensors");
    const std::string suffix = GetParam() == ScaleFormat::mxfp4 ? "_csf_fixed" : "nvfp4_csf_fixed";
    std::size_t planes = 0;
    for (const auto& t : c.tensors()) {
      EXPECT_EQ(t.name.find(".w13."), std::string::npos) << t.name;
      EXPECT_EQ(t.name.find("gate_up_proj"), std::string::npos) << t.name;
      if (t.name.ends_with(suffix)) ++planes;
    }
    EXPECT_EQ(planes, 3u * E);
    verify_checkpoint(d.path / "b.safetensors");
    decompress_checkpoint(d.path / "b.safetensors", d.path / "back.safetensors");
    expect_split(d.path / "back.safetensors", expected_split(w), 0);
    // The readers: the same layer as the stacked input, from the container and from the restored file.
    const MoeHostWeights src = load_moe_layer(d.path / "m.safetensors", kLayer, 1);
    expect_same_layer(load_moe_layer(d.path / "b.safetensors", kLayer, 1), src);
    expect_same_layer(load_moe_layer(d.path / "back.safetensors", kLayer, 1), src);
    const CheckpointFile cf = CheckpointFile::open(d.path / "b.safetensors");
    for (const auto& [name, bytes] : expected_split(w)) EXPECT_TRUE(cf.read(name) == bytes) << name;
  }
}

TEST_P(B12xSplit, StackedFolderIsSplitAndItsIndexRenamed) {
  CSFMOE_SEEDED(seed);
  const std::uint32_t E = 3;
  const MoeHostWeights w = synthetic_moe_weights(GetParam(), {E, 256, 128, 2}, seed, /*fast=*/true);
  TempDir d;
  const fs::path in = d.path / "in";
  fs::create_directories(in);
  write_file(in / "model-00001-of-00002.safetensors", stacked(w));
  write_file(in / "model-00002-of-00002.safetensors",
             {{"model.norm.weight", st::Dtype::BF16, {8}, Bytes(16, 0x3c)}});
  nlohmann::ordered_json idx;
  idx["metadata"]["total_size"] = 0;
  for (const auto& t : stacked(w)) idx["weight_map"][t.name] = "model-00001-of-00002.safetensors";
  idx["weight_map"]["model.norm.weight"] = "model-00002-of-00002.safetensors";
  csfmoe::testing::write_bytes(in / "model.safetensors.index.json", idx.dump(2));
  csfmoe::testing::write_bytes(in / "config.json", "{}");
  CompressOptions o;
  o.schema = CheckpointSchema::b12x;
  compress_checkpoint(in, d.path / "b", o);
  EXPECT_EQ(d.entries(), (std::set<std::string>{"b", "in"}));
  verify_checkpoint(d.path / "b");
  decompress_checkpoint(d.path / "b", d.path / "back");
  const auto want = expected_split(w);
  expect_split(d.path / "back", want, 1);
  // The restored index lists the per-expert tensors in their shard, and the split's total size.
  const auto j = nlohmann::json::parse(std::ifstream(d.path / "back" / "model.safetensors.index.json"));
  EXPECT_EQ(j["weight_map"].size(), want.size() + 1);
  for (const auto& [name, bytes] : want)
    EXPECT_EQ(j["weight_map"].value(name, ""), "model-00001-of-00002.safetensors") << name;
  EXPECT_EQ(j["metadata"]["total_size"].get<std::uint64_t>(),
            st::File::open(d.path / "back" / "model-00001-of-00002.safetensors").data_size() + 16);
  EXPECT_TRUE(fs::exists(d.path / "back" / "config.json"));
  expect_same_layer(load_moe_layer(d.path / "b", kLayer, 1), load_moe_layer(in, kLayer, 1));
}

INSTANTIATE_TEST_SUITE_P(Formats, B12xSplit, ::testing::Values(ScaleFormat::nvfp4, ScaleFormat::mxfp4),
                         [](const auto& i) { return std::string(to_string(i.param)); });

// Stacked inputs that cannot be split: refused naming the file, the tensor and why; nothing written.
TEST(B12xSplitRefusals, UnsplittableStackedInputsAreRefused) {
  const auto refused = [](const std::vector<Tensor>& ts, const std::string& tensor, const std::string& why) {
    TempDir d;
    write_file(d.path / "m.safetensors", ts);
    CompressOptions o;
    o.schema = CheckpointSchema::b12x;
    try {
      compress_checkpoint(d.path / "m.safetensors", d.path / "b.safetensors", o);
      ADD_FAILURE() << tensor << ": accepted";
    } catch (const InvalidArgument& e) {
      const std::string m = e.what();
      for (const std::string& n : {std::string("m.safetensors"), tensor, why})
        EXPECT_NE(m.find(n), std::string::npos) << "'" << n << "' not in: " << m;
    }
    EXPECT_EQ(d.entries(), std::set<std::string>{"m.safetensors"});
  };
  const std::string L = kLayer;
  // w13 with an odd row count: no gate / up halves.
  refused({{L + ".w13.weight", st::Dtype::U8, {2, 33, 128}, Bytes(2 * 33 * 128, 0x22)},
           {L + ".w13.weight_scale", st::Dtype::F8_E4M3, {2, 33, 16}, Bytes(2 * 33 * 16, 0x38)}},
          L + ".w13.weight", "33 rows do not split into gate and up halves");
  // A stacked projection name the split does not know.
  refused({{L + ".w99.weight", st::Dtype::U8, {2, 64, 128}, Bytes(2 * 64 * 128, 0x22)},
           {L + ".w99.weight_scale", st::Dtype::F8_E4M3, {2, 64, 16}, Bytes(2 * 64 * 16, 0x38)}},
          L + ".w99.weight_scale", "unknown stacked naming");
  // A per-expert name of the split that the file already has.
  refused({{L + ".w2.weight", st::Dtype::U8, {2, 64, 128}, Bytes(2 * 64 * 128, 0x22)},
           {L + ".w2.weight_scale", st::Dtype::F8_E4M3, {2, 64, 16}, Bytes(2 * 64 * 16, 0x38)},
           {L + ".0.down_proj.weight", st::Dtype::BF16, {4}, Bytes(8, 0)}},
          L + ".w2.weight", "'" + L + ".0.down_proj.weight' is already a tensor");
}

}  // namespace
}  // namespace csfmoe
