// Checkpoint compression: byte-exact round trips of files built here, scale
// detection, keep-native decisions, sharded folders, and every failure path
// (typed error naming file and tensor, nothing left behind).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "checkpoint/detect.hpp"
#include "csfmoe/checkpoint.hpp"
#include "csfmoe/errors.hpp"
#include "csfmoe/safetensors.hpp"
#include "csfmoe/synthetic.hpp"
#include "test_files.hpp"
#include "test_seed.hpp"

namespace fs = std::filesystem;
using namespace csfmoe;
using ojson = nlohmann::ordered_json;

namespace {

using csfmoe::testing::read_bytes;
using csfmoe::testing::TempDir;
using csfmoe::testing::write_bytes;

struct Src {
  std::string name, dtype;
  std::vector<std::uint64_t> shape;
  std::string bytes;
};

struct Build {
  std::optional<ojson> metadata;    // __metadata__ object, or none
  std::size_t trailing_spaces = 0;  // after the JSON
  bool gaps = false;                // random bytes between tensors and at the end
  bool shuffle_keys = false;        // header key order differs from data order
};

// A safetensors file written by hand (not by the library's writer).
std::string build_file(const std::vector<Src>& ts, const Build& b, std::mt19937_64& rng) {
  std::string data;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> offs;
  for (const auto& t : ts) {
    if (b.gaps) data += std::string(rng() % 9, static_cast<char>(rng()));
    offs.emplace_back(data.size(), data.size() + t.bytes.size());
    data += t.bytes;
  }
  if (b.gaps) data += std::string(1 + rng() % 7, static_cast<char>(rng()));
  std::vector<std::size_t> order(ts.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  if (b.shuffle_keys) std::shuffle(order.begin(), order.end(), rng);
  ojson h = ojson::object();
  if (b.metadata) h["__metadata__"] = *b.metadata;
  for (auto i : order) {
    const auto& t = ts[i];
    h[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offs[i].first, offs[i].second}}};
  }
  const std::string json = h.dump() + std::string(b.trailing_spaces, ' ');
  std::string out(8, '\0');
  const std::uint64_t n = json.size();
  std::memcpy(out.data(), &n, 8);
  return out + json + data;
}

std::string random_bytes(std::size_t n, std::mt19937_64& rng) {
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(rng());
  return s;
}
std::string to_str(const std::vector<std::uint8_t>& v) { return {v.begin(), v.end()}; }

// ModelOpt NVFP4 tensors of one projection: weight, weight_scale, weight_scale_2, input_scale.
void add_nvfp4(std::vector<Src>& ts, const std::string& prefix, std::uint32_t experts, std::uint32_t rows,
               std::uint32_t k, ScaleDistribution dist, std::mt19937_64& rng, bool stacked) {
  std::vector<std::uint64_t> lead =
      stacked ? std::vector<std::uint64_t>{experts} : std::vector<std::uint64_t>{};
  auto with = [&](std::vector<std::uint64_t> tail) {
    auto s = lead;
    s.insert(s.end(), tail.begin(), tail.end());
    return s;
  };
  const std::uint32_t e = stacked ? experts : 1;
  ts.push_back(
      {prefix + ".weight", "U8", with({rows, k / 2}), random_bytes(std::size_t{e} * rows * k / 2, rng)});
  const GridShape g{ScaleFormat::nvfp4, ScaleLayout::row_major, e, rows, k / 16};
  ts.push_back(
      {prefix + ".weight_scale", "F8_E4M3", with({rows, k / 16}), to_str(synthetic_scales(g, dist, rng()))});
  ts.push_back({prefix + ".weight_scale_2", "F32", lead, random_bytes(4 * e, rng)});
  ts.push_back({prefix + ".input_scale", "F32", {}, random_bytes(4, rng)});
}

// gpt-oss MXFP4 tensors: X_blocks U8 [E, R, K/32, 16], X_scales U8 [E, R, K/32], X_bias BF16 [E, R].
void add_gptoss(std::vector<Src>& ts, const std::string& prefix, std::uint32_t experts, std::uint32_t rows,
                std::uint32_t k, ScaleDistribution dist, std::mt19937_64& rng) {
  const std::uint32_t c = k / 32;
  ts.push_back({prefix + "_blocks",
                "U8",
                {experts, rows, c, 16},
                random_bytes(std::size_t{experts} * rows * c * 16, rng)});
  const GridShape g{ScaleFormat::mxfp4, ScaleLayout::row_major, experts, rows, c};
  ts.push_back({prefix + "_scales", "U8", {experts, rows, c}, to_str(synthetic_scales(g, dist, rng()))});
  ts.push_back({prefix + "_bias", "BF16", {experts, rows}, random_bytes(2 * experts * rows, rng)});
}

void add_plain(std::vector<Src>& ts, std::mt19937_64& rng) {
  ts.push_back({"model.embed_tokens.weight", "BF16", {64, 48}, random_bytes(64 * 48 * 2, rng)});
  ts.push_back({"model.norm.weight", "F32", {48}, random_bytes(48 * 4, rng)});
  ts.push_back({"model.empty", "I64", {0, 3}, ""});
}

const TensorReport* find_report(const CheckpointReport& r, const std::string& name) {
  for (const auto& t : r.tensors)
    if (t.name == name) return &t;
  return nullptr;
}

// The container must itself be a strict safetensors file: contiguous data,
// 8-byte aligned data section, every part present with its original gone.
void check_container(const fs::path& p, const CheckpointReport& rep) {
  ASSERT_TRUE(is_csf_container(p));
  const st::File f = st::File::open(p);
  EXPECT_EQ(f.data_offset() % 8, 0u);
  std::vector<const st::TensorInfo*> v;
  for (const auto& t : f.tensors()) v.push_back(&t);
  std::stable_sort(v.begin(), v.end(), [](auto* a, auto* b) { return a->begin < b->begin; });
  std::uint64_t pos = 0;
  for (const auto* t : v) {
    EXPECT_EQ(t->begin, pos) << t->name;
    pos = t->end;
  }
  EXPECT_EQ(pos, f.data_size());
  for (const auto& t : rep.tensors) {
    if (t.action == TensorAction::csf) {
      EXPECT_EQ(f.find(t.name), nullptr) << t.name;
      // The parts of one storage only: resident (version 1), planes, or MXFP4 slabs.
      const bool planes = f.find(t.name + ".csf.planes") != nullptr;
      const bool slabs = f.find(t.name + ".csf.slabs") != nullptr;
      const std::vector<const char*> parts =
          slabs    ? std::vector<const char*>{".csf.slabs", ".csf.slab_escapes", ".csf.exceptions",
                                              ".csf.expert_exceptions"}
          : planes ? std::vector<const char*>{".csf.planes", ".csf.exceptions", ".csf.expert_exceptions"}
                   : std::vector<const char*>{".csf.fixed", ".csf.exceptions", ".csf.row_prefix",
                                              ".csf.partition_index"};
      const std::vector<const char*> absent =
          slabs    ? std::vector<const char*>{".csf.planes", ".csf.fixed", ".csf.row_prefix",
                                              ".csf.partition_index"}
          : planes ? std::vector<const char*>{".csf.slabs", ".csf.fixed", ".csf.row_prefix",
                                              ".csf.partition_index"}
                   : std::vector<const char*>{".csf.expert_exceptions", ".csf.slabs", ".csf.planes"};
      std::uint64_t stored = 0;
      for (const char* s : parts) {
        const st::TensorInfo* part = f.find(t.name + s);
        ASSERT_NE(part, nullptr) << t.name << s;
        stored += part->nbytes();
      }
      for (const char* s : absent) EXPECT_EQ(f.find(t.name + s), nullptr) << t.name << s;
      EXPECT_EQ(f.find(t.name + parts.front())->dtype, st::Dtype::U8);
      EXPECT_EQ(f.find(t.name + ".csf.exceptions")->dtype, st::Dtype::U32);
      EXPECT_EQ(t.stats.encoded_bytes, stored)
          << t.name << ": the report's stored bytes are the parts' bytes";
    } else {
      EXPECT_NE(f.find(t.name), nullptr) << t.name;
    }
  }
}

// compress -> verify -> decompress and a full byte compare with the source.
CheckpointReport round_trip(const fs::path& src, const fs::path& dir, const CompressOptions& opt = {}) {
  const fs::path csf = dir / (src.filename().string() + ".csf");
  const fs::path back = dir / (src.filename().string() + ".back");
  CheckpointReport rep = compress_checkpoint(src, csf, opt);
  if (fs::is_regular_file(csf)) check_container(csf, rep);
  const CheckpointReport ver = verify_checkpoint(csf, opt);
  EXPECT_EQ(ver.tensors.size(), rep.tensors.size());
  decompress_checkpoint(csf, back, opt);
  if (fs::is_regular_file(src)) {
    EXPECT_TRUE(read_bytes(src) == read_bytes(back)) << "restored file differs from " << src;
  } else {
    std::set<std::string> a, b;
    for (const auto& e : fs::directory_iterator(src)) a.insert(e.path().filename().string());
    for (const auto& e : fs::directory_iterator(back)) b.insert(e.path().filename().string());
    EXPECT_EQ(a, b);
    for (const auto& n : a)
      if (fs::is_regular_file(src / n))
        EXPECT_TRUE(read_bytes(src / n) == read_bytes(back / n)) << n << " differs";
  }
  return rep;
}

// Expects `fn` to throw E with every needle in the message and to leave `dir` unchanged.
template <class E>
void expect_error_no_output(const TempDir& dir, const std::function<void()>& fn,
                            std::vector<std::string> needles) {
  const auto before = dir.entries();
  try {
    fn();
    ADD_FAILURE() << "no error thrown";
  } catch (const E& e) {
    const std::string m = e.what();
    for (const auto& n : needles) EXPECT_NE(m.find(n), std::string::npos) << "'" << n << "' not in: " << m;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
  }
  EXPECT_EQ(dir.entries(), before) << "output or temporary left behind";
}

void patch_file(const fs::path& p, std::uint64_t offset, const std::function<void(char&)>& f) {
  std::string b = read_bytes(p);
  ASSERT_LT(offset, b.size());
  f(b[offset]);
  fs::permissions(p, fs::perms::owner_write, fs::perm_options::add);
  write_bytes(p, b);
}

std::uint64_t file_offset(const fs::path& p, const std::string& tensor) {
  const st::File f = st::File::open(p);
  const auto* t = f.find(tensor);
  EXPECT_NE(t, nullptr) << tensor;
  return t ? f.data_offset() + t->begin : 0;
}

}  // namespace

TEST(Checkpoint, NvfpStackedWithPassthroughAndMetadata) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir dir;
  std::vector<Src> ts;
  add_plain(ts, rng);
  add_nvfp4(ts, "model.layers.1.mlp.experts.w13", 4, 256, 1024, ScaleDistribution::realistic, rng, true);
  add_nvfp4(ts, "model.layers.1.mlp.experts.w2", 4, 128, 1024, ScaleDistribution::realistic, rng, true);
  Build b;
  b.metadata = ojson{{"format", "pt"}, {"quant", "nvfp4"}};
  b.shuffle_keys = true;
  write_bytes(dir.path / "m.safetensors", build_file(ts, b, rng));

  const auto rep = round_trip(dir.path / "m.safetensors", dir.path);
  ASSERT_EQ(rep.tensors.size(), ts.size());
  for (const auto& t : rep.tensors) {
    const bool scale = t.name.ends_with(".weight_scale");
    EXPECT_EQ(t.action, scale ? TensorAction::csf : TensorAction::passthrough) << t.name << " " << t.reason;
    if (scale) {
      EXPECT_EQ(t.format, ScaleFormat::nvfp4);
      EXPECT_EQ(t.layer, "model.layers.1.mlp.experts");
      EXPECT_LT(t.stats.ratio(), 0.75) << t.name;
      EXPECT_GT(t.stats.ratio(), 0.3) << t.name;
    }
  }
  EXPECT_LT(rep.scale_stored_bytes, rep.scale_source_bytes);
  EXPECT_LT(fs::file_size(dir.path / "m.safetensors.csf"), fs::file_size(dir.path / "m.safetensors"));
  // The container keeps the source's own metadata entries.
  const st::File c = st::File::open(dir.path / "m.safetensors.csf");
  EXPECT_EQ(c.header().metadata->at("format"), "pt");
  EXPECT_EQ(c.header().metadata->at("quant"), "nvfp4");
}

TEST(Checkpoint, NvfpPerExpert2DNoMetadataTrailingSpacesAndGaps) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir dir;
  std::vector<Src> ts;
  for (int e = 0; e < 3; ++e)
    for (const char* p : {"gate_proj", "up_proj", "down_proj"})
      add_nvfp4(ts, "model.layers.3.mlp.experts." + std::to_string(e) + "." + p, 1, 64 + 64 * (e % 2), 256,
                ScaleDistribution::realistic, rng, false);
  add_plain(ts, rng);
  Build b;
  b.trailing_spaces = 1 + rng() % 40;
  b.gaps = true;
  write_bytes(dir.path / "e.safetensors", build_file(ts, b, rng));
  const auto rep = round_trip(dir.path / "e.safetensors", dir.path);
  int csf = 0;
  for (const auto& t : rep.tensors)
    if (t.name.ends_with(".weight_scale")) {
      EXPECT_EQ(t.layer, "model.layers.3.mlp.experts") << t.name;
      EXPECT_TRUE(t.action == TensorAction::csf || t.action == TensorAction::native_kept);
      csf += t.action == TensorAction::csf;
    }
  EXPECT_GT(csf, 0);
}

TEST(Checkpoint, MxfpGptOssStyle) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir dir;
  std::vector<Src> ts;
  add_gptoss(ts, "model.layers.0.mlp.experts.gate_up_proj", 4, 128, 2048, ScaleDistribution::realistic, rng);
  add_gptoss(ts, "model.layers.0.mlp.experts.down_proj", 4, 64, 256, ScaleDistribution::extremes, rng);
  add_plain(ts, rng);
  write_bytes(dir.path / "g.safetensors", build_file(ts, {}, rng));
  const auto rep = round_trip(dir.path / "g.safetensors", dir.path);
  const auto* s = find_report(rep, "model.layers.0.mlp.experts.gate_up_proj_scales");
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->action, TensorAction::csf);
  EXPECT_EQ(s->format, ScaleFormat::mxfp4);
  EXPECT_EQ(s->layer, "model.layers.0.mlp.experts");
  EXPECT_LT(s->stats.ratio(), 0.4);
  const auto* blocks = find_report(rep, "model.layers.0.mlp.experts.gate_up_proj_blocks");
  ASSERT_NE(blocks, nullptr);
  EXPECT_EQ(blocks->action, TensorAction::passthrough);
}

TEST(Checkpoint, SwizzledNvfpLayout) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir dir;
  const std::uint32_t e = 2, r = 200, k = 384;  // 200 rows -> 256 padded, 24 cols
  std::vector<Src> ts;
  ts.push_back({"model.layers.5.mlp.experts.w13.weight",
                "U8",
                {e, r, k / 2},
                random_bytes(std::size_t{e} * r * k / 2, rng)});
  const GridShape g{ScaleFormat::nvfp4, ScaleLayout::swizzled_128x4, e, 256, 24};
  ts.push_back({"model.layers.5.mlp.experts.w13.weight_scale",
                "F8_E4M3",
                {e, 256, 24},
                to_str(synthetic_scales(g, ScaleDistribution::realistic, rng()))});
  write_bytes(dir.path / "s.safetensors", build_file(ts, {}, rng));
  CompressOptions opt;
  opt.layout = ScaleLayout::swizzled_128x4;
  const auto rep = round_trip(dir.path / "s.safetensors", dir.path, opt);
  EXPECT_EQ(find_report(rep, "model.layers.5.mlp.experts.w13.weight_scale")->action, TensorAction::csf);
  // Read as row-major, the padded grid does not match the 200-row weight.
  const auto ins = inspect_checkpoint(dir.path / "s.safetensors");
  const auto* t = find_report(ins, "model.layers.5.mlp.experts.w13.weight_scale");
  EXPECT_EQ(t->action, TensorAction::passthrough);
  EXPECT_NE(t->reason.find("matches neither"), std::string::npos) << t->reason;
}

TEST(Checkpoint, UniformRandomScalesAreKeptNative) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir dir;
  std::vector<Src> ts;
  add_nvfp4(ts, "model.layers.2.mlp.experts.w2", 2, 128, 256, ScaleDistribution::uniform_random, rng, true);
  add_nvfp4(ts, "model.layers.2.mlp.experts.w13", 2, 128, 256, ScaleDistribution::realistic, rng, true);
  write_bytes(dir.path / "u.safetensors", build_file(ts, {}, rng));
  const auto rep = round_trip(dir.path / "u.safetensors", dir.path);
  const auto* bad = find_report(rep, "model.layers.2.mlp.experts.w2.weight_scale");
  ASSERT_NE(bad, nullptr);
  EXPECT_EQ(bad->action, TensorAction::native_kept);
  EXPECT_GE(bad->stats.ratio(), 1.0);
  EXPECT_NE(bad->reason.find('%'), std::string::npos) << bad->reason;
  EXPECT_EQ(find_report(rep, "model.layers.2.mlp.experts.w13.weight_scale")->action, TensorAction::csf);
  // The container's inspect reports the same decision and reason.
  const auto ins = inspect_checkpoint(dir.path / "u.safetensors.csf");
  EXPECT_EQ(find_report(ins, bad->name)->action, TensorAction::native_kept);
  EXPECT_EQ(find_report(ins, bad->name)->reason, bad->reason);

  // Forced CSF is still exact.
  TempDir d2;
  CompressOptions force;
  force.keep_unprofitable = false;
  const auto rep2 = round_trip(dir.path / "u.safetensors", d2.path, force);
  EXPECT_EQ(find_report(rep2, bad->name)->action, TensorAction::csf);
}

TEST(Checkpoint, DetectionRulesAndReasons) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir dir;
  std::vector<Src> ts;
  // FP8 per-tensor checkpoint naming: must pass through, not be mistaken for NVFP4.
  ts.push_back({"model.layers.0.self_attn.q_proj.weight", "F8_E4M3", {64, 64}, random_bytes(64 * 64, rng)});
  ts.push_back({"model.layers.0.self_attn.q_proj.weight_scale", "F32", {}, random_bytes(4, rng)});
  // Orphan scale and an inconsistent one.
  ts.push_back({"orphan.weight_scale", "F8_E4M3", {64, 4}, random_bytes(256, rng)});
  ts.push_back({"bad.weight", "U8", {64, 32}, random_bytes(64 * 32, rng)});
  ts.push_back({"bad.weight_scale", "F8_E4M3", {64, 5}, random_bytes(320, rng)});
  write_bytes(dir.path / "d.safetensors", build_file(ts, {}, rng));
  const auto rep = round_trip(dir.path / "d.safetensors", dir.path);
  for (const auto& t : rep.tensors) EXPECT_EQ(t.action, TensorAction::passthrough) << t.name;
  EXPECT_NE(find_report(rep, "orphan.weight_scale")->reason.find("no companion"), std::string::npos);
  EXPECT_NE(find_report(rep, "model.layers.0.self_attn.q_proj.weight_scale")->reason.find("not packed FP4"),
            std::string::npos);
  EXPECT_NE(find_report(rep, "bad.weight_scale")->reason.find("matches neither"), std::string::npos);
  EXPECT_EQ(detail::moe_layer_key("model.layers.3.mlp.experts.17.gate_proj.weight_scale"),
            "model.layers.3.mlp.experts");
  EXPECT_EQ(detail::moe_layer_key("model.layers.3.self_attn.o_proj.weight_scale"), "");
}

TEST(Checkpoint, ProgressIsMonotoneAndComplete) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir dir;
  std::vector<Src> ts;
  add_nvfp4(ts, "model.layers.1.mlp.experts.w13", 2, 128, 256, ScaleDistribution::realistic, rng, true);
  add_plain(ts, rng);
  write_bytes(dir.path / "p.safetensors", build_file(ts, {}, rng));
  std::uint64_t total_src = 0;
  for (const auto& t : ts) total_src += t.bytes.size();
  std::vector<Progress> seen;
  CompressOptions opt;
  opt.progress = [&](const Progress& p) { seen.push_back(p); };
  compress_checkpoint(dir.path / "p.safetensors", dir.path / "p.csf", opt);
  ASSERT_EQ(seen.size(), ts.size());
  for (std::size_t i = 1; i < seen.size(); ++i) EXPECT_GE(seen[i].bytes_done, seen[i - 1].bytes_done);
  EXPECT_EQ(seen.back().bytes_done, total_src);
  EXPECT_EQ(seen.back().bytes_total, total_src);
  EXPECT_EQ(seen.front().current.rfind("p.safetensors:", 0), 0u) << seen.front().current;
}

TEST(Checkpoint, ShardedFolderWithIndexAndConfig) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir dir;
  const fs::path in = dir.path / "model";
  fs::create_directories(in / "extra");
  std::vector<Src> s1, s2;
  add_nvfp4(s1, "model.layers.0.mlp.experts.w13", 2, 128, 256, ScaleDistribution::realistic, rng, true);
  add_plain(s1, rng);
  add_gptoss(s2, "model.layers.1.mlp.experts.down_proj", 2, 64, 256, ScaleDistribution::realistic, rng);
  add_nvfp4(s2, "model.layers.1.mlp.experts.w2", 2, 128, 256, ScaleDistribution::uniform_random, rng, true);
  write_bytes(in / "model-00001-of-00002.safetensors", build_file(s1, {}, rng));
  write_bytes(in / "model-00002-of-00002.safetensors", build_file(s2, {}, rng));
  ojson idx;
  idx["metadata"] = {{"total_size", 12345}};
  idx["weight_map"] = ojson::object();
  for (const auto& t : s1) idx["weight_map"][t.name] = "model-00001-of-00002.safetensors";
  for (const auto& t : s2) idx["weight_map"][t.name] = "model-00002-of-00002.safetensors";
  const std::string idx_text = idx.dump(2) + "\n";
  write_bytes(in / "model.safetensors.index.json", idx_text);
  write_bytes(in / "config.json",
              R"({"architectures":["X"],"quantization_config":{"quant_method":"modelopt"}})");
  write_bytes(in / "extra" / "notes.txt", random_bytes(100, rng));

  const auto rep = round_trip(in, dir.path);
  const fs::path out = dir.path / "model.csf";
  EXPECT_EQ(read_bytes(out / "config.json"), read_bytes(in / "config.json"));
  EXPECT_EQ(read_bytes(out / "extra" / "notes.txt"), read_bytes(in / "extra" / "notes.txt"));
  EXPECT_TRUE(is_csf_container(out / "model-00001-of-00002.safetensors"));
  const ojson nidx = ojson::parse(read_bytes(out / "model.safetensors.index.json"));
  const auto& wm = nidx["weight_map"];
  EXPECT_FALSE(wm.contains("model.layers.0.mlp.experts.w13.weight_scale"));
  // Every part of a CSF tensor is listed under its shard, whichever storage it has.
  for (const auto& [tensor, shard] :
       {std::pair<std::string, std::string>{"model.layers.0.mlp.experts.w13.weight_scale",
                                            "model-00001-of-00002.safetensors"},
        {"model.layers.1.mlp.experts.down_proj_scales", "model-00002-of-00002.safetensors"}}) {
    const bool planes = wm.contains(tensor + ".csf.planes"), slabs = wm.contains(tensor + ".csf.slabs");
    const std::vector<std::string> parts =
        slabs    ? std::vector<std::string>{".csf.slabs", ".csf.slab_escapes", ".csf.exceptions",
                                            ".csf.expert_exceptions"}
        : planes ? std::vector<std::string>{".csf.planes", ".csf.exceptions", ".csf.expert_exceptions"}
                 : std::vector<std::string>{".csf.fixed", ".csf.exceptions", ".csf.row_prefix",
                                            ".csf.partition_index"};
    for (const auto& s : parts) EXPECT_EQ(wm[tensor + s], shard) << tensor << s;
  }
  EXPECT_TRUE(wm.contains("model.layers.1.mlp.experts.w2.weight_scale"))
      << "kept-native tensor keeps its name";
  EXPECT_EQ(nidx["metadata"]["csfmoe"]["original_index"], idx_text);
  // Every weight_map entry names a tensor that really is in that shard.
  for (auto it = wm.begin(); it != wm.end(); ++it)
    EXPECT_NE(st::File::open(out / it.value().get<std::string>()).find(it.key()), nullptr) << it.key();
  EXPECT_EQ(find_report(rep, "model.layers.1.mlp.experts.w2.weight_scale")->action,
            TensorAction::native_kept);
  EXPECT_EQ(find_report(rep, "model.layers.0.mlp.experts.w13.weight_scale")->file,
            "model-00001-of-00002.safetensors");
  const auto ins = inspect_checkpoint(out);
  EXPECT_EQ(ins.tensors.size(), rep.tensors.size());
  EXPECT_EQ(ins.scale_stored_bytes, rep.scale_stored_bytes);
}

TEST(Checkpoint, RefusesBadOutputs) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir dir;
  std::vector<Src> ts;
  add_nvfp4(ts, "x", 1, 128, 256, ScaleDistribution::realistic, rng, true);
  const fs::path in = dir.path / "in.safetensors";
  write_bytes(in, build_file(ts, {}, rng));
  expect_error_no_output<InvalidArgument>(dir, [&] { compress_checkpoint(in, in); }, {"is the input"});
  write_bytes(dir.path / "exists", "x");
  expect_error_no_output<InvalidArgument>(dir, [&] { compress_checkpoint(in, dir.path / "exists"); },
                                          {"already exists"});
  expect_error_no_output<InvalidArgument>(dir, [&] { decompress_checkpoint(in, dir.path / "o"); },
                                          {"not a CSF container"});
  compress_checkpoint(in, dir.path / "c");
  expect_error_no_output<InvalidArgument>(dir, [&] { compress_checkpoint(dir.path / "c", dir.path / "cc"); },
                                          {"already a CSF container"});
  EXPECT_FALSE(is_csf_container(in));
  expect_error_no_output<InvalidArgument>(
      dir, [&] { compress_checkpoint(dir.path / "nope", dir.path / "o"); }, {"does not exist"});
}

TEST(Checkpoint, MalformedSourcesAreRejectedWithoutOutput) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir dir;
  std::vector<Src> ts;
  add_nvfp4(ts, "model.layers.0.mlp.experts.w13", 2, 128, 256, ScaleDistribution::realistic, rng, true);
  const std::string good = build_file(ts, {}, rng);
  std::uint64_t hlen = 0;
  std::memcpy(&hlen, good.data(), 8);
  const std::string header = good.substr(8, hlen);
  const std::string data = good.substr(8 + hlen);
  auto with_header = [&](std::string h) {
    std::string out(8, '\0');
    const std::uint64_t n = h.size();
    std::memcpy(out.data(), &n, 8);
    return out + h + data;
  };
  auto replace = [&](std::string s, const std::string& from, const std::string& to) {
    const auto p = s.find(from);
    EXPECT_NE(p, std::string::npos) << from;
    return s.replace(p, from.size(), to);
  };
  const std::string scale = "model.layers.0.mlp.experts.w13.weight_scale";
  const ojson hj = ojson::parse(header);
  const auto so = hj[scale]["data_offsets"];
  const std::uint64_t sb = so[0], se = so[1];
  const std::string so_text = "[" + std::to_string(sb) + "," + std::to_string(se) + "]";
  struct Case {
    std::string what, bytes;
    std::vector<std::string> needles;
  };
  std::vector<Case> cases = {
      {"truncated", good.substr(0, 5), {"shorter than"}},
      {"header past end", good.substr(0, 8 + hlen / 2), {"past the end"}},
      {"bad json", with_header(header.substr(0, header.size() - 1)), {"not valid JSON"}},
      {"duplicate",
       with_header(replace(header, "}}", "}," + header.substr(1, header.find("},") - 0) + "}")),
       {"duplicate"}},
      {"offsets past end",
       with_header(
           replace(header, so_text, "[" + std::to_string(sb) + "," + std::to_string(data.size() + 8) + "]")),
       {scale, "past the end"}},
      {"overlap",
       with_header(
           replace(header, so_text, "[" + std::to_string(sb - 8) + "," + std::to_string(se - 8) + "]")),
       {scale, "overlaps"}},
      {"wrong scale dtype",
       with_header(replace(header, "\"F8_E4M3\"", "\"I8\"")),
       {scale, "must be F8_E4M3", "I8"}},
      {"byte count",
       with_header(replace(header, so_text, "[" + std::to_string(sb) + "," + std::to_string(se - 1) + "]")),
       {scale, "bytes"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    const fs::path p = dir.path / "bad.safetensors";
    write_bytes(p, c.bytes);
    auto needles = c.needles;
    needles.push_back(p.string());
    expect_error_no_output<FormatError>(
        dir, [&] { compress_checkpoint(p, dir.path / "out.csf"); }, needles);
    fs::remove(p);
  }
}

TEST(Checkpoint, CorruptContainersAreCaught) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir dir;
  std::vector<Src> ts;
  add_nvfp4(ts, "model.layers.0.mlp.experts.w13", 2, 128, 256, ScaleDistribution::realistic, rng, true);
  add_plain(ts, rng);
  write_bytes(dir.path / "a.safetensors", build_file(ts, {}, rng));
  const fs::path good = dir.path / "good.csf";
  compress_checkpoint(dir.path / "a.safetensors", good);
  const std::string scale = "model.layers.0.mlp.experts.w13.weight_scale";
  int n = 0;
  auto corrupt_copy = [&](const std::string& tensor, std::uint64_t at, const std::function<void(char&)>& f) {
    const fs::path p = dir.path / ("bad" + std::to_string(n++) + ".csf");
    fs::copy_file(good, p);
    patch_file(p, file_offset(p, tensor) + at, f);
    return p;
  };
  auto out = dir.path / "restored";

  // A native tensor: the per-tensor CRC names it.
  {
    const auto p = corrupt_copy("model.embed_tokens.weight", rng() % 100, [](char& c) { c ^= 1; });
    expect_error_no_output<CorruptData>(dir, [&] { decompress_checkpoint(p, out); },
                                        {p.string(), "model.embed_tokens.weight", "CRC32"});
    expect_error_no_output<CorruptData>(dir, [&] { verify_checkpoint(p); }, {"model.embed_tokens.weight"});
  }
  // Plane storage (the default for this row-major grid).
  ASSERT_NE(st::File::open(good).find(scale + ".csf.planes"), nullptr);
  // A per-expert record count: the counts no longer add up.
  {
    const auto p = corrupt_copy(scale + ".csf.expert_exceptions", 0, [](char& c) { c ^= 0x01; });
    expect_error_no_output<FormatError>(dir, [&] { decompress_checkpoint(p, out); }, {p.string(), scale});
    expect_error_no_output<FormatError>(dir, [&] { verify_checkpoint(p); }, {scale, "record counts"});
  }
  // A base byte above 240: the plane check names the tensor.
  {
    const auto p = corrupt_copy(scale + ".csf.planes", rng() % 16, [](char& c) { c = char(0xF5); });
    expect_error_no_output<FormatError>(dir, [&] { verify_checkpoint(p); }, {p.string(), scale, "240"});
  }
  // A code byte: decodes to other bytes, CRC names the tensor (or validation
  // does when the slot belonged to an exception).
  {
    const st::File f = st::File::open(good);
    const st::TensorInfo* planes = f.find(scale + ".csf.planes");
    const std::uint64_t slab = planes->shape[1];
    const std::uint64_t at = (rng() % planes->shape[0]) * slab + 16 + rng() % (slab - 16);
    const auto p = corrupt_copy(scale + ".csf.planes", at, [](char& c) { c ^= 0x11; });
    const auto before = dir.entries();
    try {
      decompress_checkpoint(p, out);
      ADD_FAILURE() << "corrupted plane accepted";
    } catch (const Error& e) {
      EXPECT_TRUE(e.kind() == ErrorKind::corrupt || e.kind() == ErrorKind::format) << e.what();
      EXPECT_NE(std::string(e.what()).find(scale), std::string::npos) << e.what();
    }
    EXPECT_EQ(dir.entries(), before);
  }
  // Resident storage (what a swizzled grid, and every version 1 file, keeps).
  const fs::path resident = dir.path / "resident.csf";
  {
    CompressOptions o;
    o.layout = ScaleLayout::swizzled_128x4;  // 128 x 16 per expert: the same shape either way
    compress_checkpoint(dir.path / "a.safetensors", resident, o);
    ASSERT_NE(st::File::open(resident).find(scale + ".csf.row_prefix"), nullptr);
  }
  auto corrupt_resident = [&](const std::string& tensor, std::uint64_t at,
                              const std::function<void(char&)>& f) {
    const fs::path p = dir.path / ("bad" + std::to_string(n++) + ".csf");
    fs::copy_file(resident, p);
    patch_file(p, file_offset(p, tensor) + at, f);
    return p;
  };
  // A row_prefix entry: structural validation names the tensor.
  {
    const auto p =
        corrupt_resident(scale + ".csf.row_prefix", 4 * (1 + rng() % 100), [](char& c) { c ^= 0x40; });
    expect_error_no_output<FormatError>(dir, [&] { decompress_checkpoint(p, out); }, {p.string(), scale});
    expect_error_no_output<FormatError>(dir, [&] { verify_checkpoint(p); }, {scale, "invalid CSF parts"});
  }
  // An offset byte of the fixed part.
  {
    const st::File f = st::File::open(resident);
    const std::uint64_t fixed = f.find(scale + ".csf.fixed")->nbytes();
    const auto p =
        corrupt_resident(scale + ".csf.fixed", 128 + rng() % (fixed - 128), [](char& c) { c ^= 0x11; });
    const auto before = dir.entries();
    try {
      decompress_checkpoint(p, out);
      ADD_FAILURE() << "corrupted fixed part accepted";
    } catch (const Error& e) {
      EXPECT_TRUE(e.kind() == ErrorKind::corrupt || e.kind() == ErrorKind::format) << e.what();
      EXPECT_NE(std::string(e.what()).find(scale), std::string::npos) << e.what();
    }
    EXPECT_EQ(dir.entries(), before);
  }
  // Truncated container.
  {
    const fs::path p = dir.path / "trunc.csf";
    const std::string b = read_bytes(good);
    write_bytes(p, b.substr(0, b.size() - 3));
    expect_error_no_output<FormatError>(dir, [&] { decompress_checkpoint(p, out); }, {p.string()});
  }
  // The intact container still restores.
  decompress_checkpoint(good, out);
  EXPECT_EQ(read_bytes(out), read_bytes(dir.path / "a.safetensors"));
}

TEST(Checkpoint, BadShardIndexesLeaveNoOutput) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir dir;
  const fs::path in = dir.path / "model";
  fs::create_directories(in);
  std::vector<Src> s1;
  add_nvfp4(s1, "model.layers.0.mlp.experts.w13", 2, 128, 256, ScaleDistribution::realistic, rng, true);
  write_bytes(in / "model-00001.safetensors", build_file(s1, {}, rng));
  write_bytes(dir.path / "outside.safetensors", build_file(s1, {}, rng));
  auto set_index = [&](const std::string& shard, const std::string& tensor) {
    ojson idx;
    idx["weight_map"] = {{"model.layers.0.mlp.experts.w13.weight", "model-00001.safetensors"},
                         {tensor, shard}};
    write_bytes(in / "model.safetensors.index.json", idx.dump());
  };
  const std::string idx_path = (in / "model.safetensors.index.json").string();
  set_index("../outside.safetensors", "model.layers.0.mlp.experts.w13.weight_scale");
  expect_error_no_output<FormatError>(dir, [&] { compress_checkpoint(in, dir.path / "o"); },
                                      {idx_path, "../outside.safetensors", "not a plain file name"});
  set_index("model-00002.safetensors", "model.layers.0.mlp.experts.w13.weight_scale");
  expect_error_no_output<FormatError>(dir, [&] { compress_checkpoint(in, dir.path / "o"); },
                                      {idx_path, "model-00002.safetensors", "does not exist"});
  set_index("model-00001.safetensors", "not.a.tensor");
  expect_error_no_output<FormatError>(dir, [&] { compress_checkpoint(in, dir.path / "o"); },
                                      {idx_path, "not.a.tensor", "no such tensor"});
  fs::create_symlink("../outside.safetensors", in / "model-00002.safetensors");
  set_index("model-00002.safetensors", "model.layers.0.mlp.experts.w13.weight_scale");
  expect_error_no_output<FormatError>(dir, [&] { compress_checkpoint(in, dir.path / "o"); },
                                      {"leaves the folder"});
  // A malformed shard aborts the folder job midway, also without output.
  fs::remove(in / "model-00002.safetensors");
  set_index("model-00001.safetensors", "model.layers.0.mlp.experts.w13.weight_scale");
  auto broken = s1;
  broken[1].dtype = "I8";  // a block scale must be F8_E4M3: found while compressing, after shard 1
  write_bytes(in / "zz-broken.safetensors", build_file(broken, {}, rng));
  expect_error_no_output<FormatError>(dir, [&] { compress_checkpoint(in, dir.path / "o"); },
                                      {"zz-broken", "must be F8_E4M3"});
}
