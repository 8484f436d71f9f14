// End-to-end tests of the `csf` tool: each test runs the real binary in a
// fresh temporary folder on files written here (with a safetensors writer
// independent of the library) and checks exit codes, outputs and the files
// left behind.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "checkpoint/container.hpp"
#include "csfmoe/b12x_planes.hpp"
#include "csfmoe/codec.hpp"
#include "csfmoe/quantize.hpp"
#include "csfmoe/safetensors.hpp"
#include "csfmoe/synthetic.hpp"
#include "test_csf_tool.hpp"
#include "test_processes.hpp"
#include "test_seed.hpp"

extern char** environ;

namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<std::uint8_t>;

using Result = csfmoe::testing::CsfRun;

Bytes read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void write_bytes(const fs::path& p, const Bytes& b) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

// --- a minimal safetensors writer, independent of the library -------------
struct T {
  std::string name, dtype;
  std::vector<std::uint64_t> shape;
  Bytes bytes;
};

std::string header_of(const std::vector<T>& ts) {
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  std::uint64_t off = 0;
  for (const auto& t : ts) {
    h[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {off, off + t.bytes.size()}}};
    off += t.bytes.size();
  }
  return h.dump();
}

Bytes file_bytes(const std::vector<T>& ts, std::optional<std::string> header = std::nullopt) {
  std::string h = header ? *header : header_of(ts);
  while (h.size() % 8) h += ' ';
  std::size_t total = 8 + h.size();
  for (const auto& t : ts) total += t.bytes.size();
  Bytes out(total);
  for (int i = 0; i < 8; ++i) out[i] = static_cast<std::uint8_t>(std::uint64_t{h.size()} >> (8 * i));
  std::memcpy(out.data() + 8, h.data(), h.size());
  std::size_t pos = 8 + h.size();
  for (const auto& t : ts) {
    std::copy(t.bytes.begin(), t.bytes.end(), out.begin() + static_cast<std::ptrdiff_t>(pos));
    pos += t.bytes.size();
  }
  return out;
}

Bytes random_bytes(std::mt19937_64& rng, std::size_t n) {
  Bytes b(n);
  for (auto& x : b) x = static_cast<std::uint8_t>(rng());
  return b;
}

// Independent reference of the CSF statistics of one row-major grid: per row
// the lowest base with the most bytes in [base, base + W).
struct RefStats {
  std::uint64_t rows = 0, values = 0, exceptions = 0;
  std::set<int> bases;
};
RefStats reference_stats(const Bytes& grid, std::uint64_t rows, std::uint64_t cols, unsigned w) {
  RefStats s;
  for (std::uint64_t r = 0; r < rows; ++r) {
    std::array<int, 256> hist{};
    for (std::uint64_t c = 0; c < cols; ++c) ++hist[grid[r * cols + c]];
    int best = -1, best_b = 0;
    for (int b = 0; b + int(w) - 1 <= 255; ++b) {
      int n = 0;
      for (unsigned k = 0; k < w; ++k) n += hist[b + k];
      if (n > best) best = n, best_b = b;
    }
    s.bases.insert(best_b);
    s.exceptions += cols - std::uint64_t(best);
  }
  s.rows = rows;
  s.values = rows * cols;
  return s;
}

// A small MoE checkpoint: one stacked layer (w13, w2), a dense NVFP4 matrix
// whose scales are uniform noise (CSF cannot pay there) and a BF16 norm.
struct Sample {
  std::vector<T> tensors;
  std::map<std::string, RefStats> expected;  // per scale tensor
};

Sample make_nvfp4_sample(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  // w13 has >= 16 scale columns so CSF pays there; w2 may be narrow enough not to.
  const auto pick = [&](std::uint32_t n) { return static_cast<std::uint32_t>(rng() % n); };
  const std::uint32_t E = 2 + pick(3), H = 256 * (1 + pick(3)), N = 64 * (1 + pick(3));
  const std::uint32_t dense_rows = 40 + pick(300);  // not a multiple of 128 on purpose
  Sample s;
  auto add_scale = [&](const std::string& stem, std::uint32_t e, std::uint32_t rows, std::uint32_t k,
                       csfmoe::ScaleDistribution dist, const std::string& layerless_prefix) {
    csfmoe::GridShape g{csfmoe::ScaleFormat::nvfp4, csfmoe::ScaleLayout::row_major, e, rows, k / 16};
    auto scales = csfmoe::synthetic_scales(g, dist, rng());
    std::vector<std::uint64_t> lead;
    if (!layerless_prefix.empty()) lead.push_back(e);
    auto wshape = lead, sshape = lead;
    wshape.insert(wshape.end(), {rows, k / 2});
    sshape.insert(sshape.end(), {rows, k / 16});
    s.tensors.push_back({stem + ".weight", "U8", wshape, random_bytes(rng, std::size_t(e) * rows * k / 2)});
    s.expected[stem + ".weight_scale"] = reference_stats(scales, std::uint64_t(e) * rows, k / 16, 16);
    s.tensors.push_back({stem + ".weight_scale", "F8_E4M3", sshape, std::move(scales)});
  };
  const std::string layer = "model.layers.0.mlp.experts";
  add_scale(layer + ".w13", E, 2 * N, H, csfmoe::ScaleDistribution::realistic, "stacked");
  add_scale(layer + ".w2", E, H, N,
            rng() % 2 ? csfmoe::ScaleDistribution::realistic : csfmoe::ScaleDistribution::extremes,
            "stacked");
  add_scale("lm_head", 1, dense_rows, H, csfmoe::ScaleDistribution::uniform_random, "");
  s.tensors.push_back({"model.norm.weight", "BF16", {H}, random_bytes(rng, 2 * H)});
  return s;
}

Sample make_mxfp4_sample(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const auto pick = [&](std::uint32_t n) { return static_cast<std::uint32_t>(rng() % n); };
  const std::uint32_t E = 2 + pick(3), H = 256 * (1 + pick(2)), N = 64 * (1 + pick(3));
  Sample s;
  auto add = [&](const std::string& stem, std::uint32_t rows, std::uint32_t k) {
    csfmoe::GridShape g{csfmoe::ScaleFormat::mxfp4, csfmoe::ScaleLayout::row_major, E, rows, k / 32};
    auto scales = csfmoe::synthetic_scales(g, csfmoe::ScaleDistribution::realistic, rng());
    s.tensors.push_back(
        {stem + "_blocks", "U8", {E, rows, k / 32, 16}, random_bytes(rng, std::size_t(E) * rows * k / 2)});
    s.expected[stem + "_scales"] = reference_stats(scales, std::uint64_t(E) * rows, k / 32, 2);
    s.tensors.push_back({stem + "_scales", "U8", {E, rows, k / 32}, std::move(scales)});
  };
  add("model.layers.1.mlp.experts.gate_up_proj", 2 * N, H);
  add("model.layers.1.mlp.experts.down_proj", H, N);
  return s;
}

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "csf-cli-test-XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
    fs::create_directories(dir_ / "io");
    fs::create_directories(dir_ / "out");
  }
  void TearDown() override {
    std::error_code ec;
    if (!HasFailure()) fs::remove_all(dir_, ec);
  }

  // Runs csf with stdout/stderr captured into files (no shell involved).
  Result csf(const std::vector<std::string>& args) {
    return csfmoe::testing::run_csf_tool(args, dir_ / "io");
  }

  fs::path write(const std::string& name, const Bytes& b) {
    const fs::path p = dir_ / name;
    write_bytes(p, b);
    return p;
  }

  std::vector<std::string> out_entries() const {
    std::vector<std::string> v;
    for (const auto& e : fs::directory_iterator(dir_ / "out")) v.push_back(e.path().filename().string());
    return v;
  }

  // A failed command: non-zero exit, exactly one `csf: error:` line on
  // stderr naming every needle, and nothing left in out/.
  void expect_clean_failure(const Result& r, const std::vector<std::string>& needles) {
    EXPECT_NE(r.code, 0) << r.out << r.err;
    EXPECT_EQ(r.code, 1) << "runtime errors exit with 1: " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_EQ(r.err.rfind("csf: error: ", 0), 0u) << r.err;
    for (const auto& n : needles)
      EXPECT_NE(r.err.find(n), std::string::npos) << "'" << n << "' not in: " << r.err;
    EXPECT_TRUE(out_entries().empty()) << "left in out/: " << ::testing::PrintToString(out_entries());
  }

  fs::path dir_;
};

nlohmann::json parse_json(const std::string& s) {
  try {
    return nlohmann::json::parse(s);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not JSON: " << e.what() << "\n" << s.substr(0, 500);
    return {};
  }
}

TEST_F(CliTest, RoundTripIsByteExactAndVerifies) {
  CSFMOE_SEEDED(seed);
  const auto nv = make_nvfp4_sample(seed), mx = make_mxfp4_sample(seed + 1);
  for (const auto& [name, sample] : {std::pair{"nv.safetensors", &nv}, std::pair{"mx.safetensors", &mx}}) {
    SCOPED_TRACE(name);
    const auto src = write(name, file_bytes(sample->tensors));
    const auto c = dir_ / "out" / "c.safetensors", r = dir_ / "out" / "r.safetensors";
    auto res = csf({"compress", src.string(), c.string(), "--threads", "2"});
    ASSERT_EQ(res.code, 0) << res.err;
    EXPECT_NE(res.out.find("scales total"), std::string::npos) << res.out;
    res = csf({"verify", c.string()});
    EXPECT_EQ(res.code, 0) << res.err;
    EXPECT_NE(res.out.find("OK c.safetensors"), std::string::npos) << res.out;
    res = csf({"decompress", c.string(), r.string(), "--quiet"});
    ASSERT_EQ(res.code, 0) << res.err;
    EXPECT_TRUE(read_bytes(src) == read_bytes(r)) << "restored file differs";
    fs::remove(c);
    fs::remove(r);
  }
}

TEST_F(CliTest, ShardedFolderRoundTrips) {
  CSFMOE_SEEDED(seed);
  const auto nv = make_nvfp4_sample(seed), mx = make_mxfp4_sample(seed + 1);
  const fs::path in = dir_ / "ckpt";
  fs::create_directories(in);
  nlohmann::ordered_json index = {{"metadata", {{"total_size", 0}}},
                                  {"weight_map", nlohmann::ordered_json::object()}};
  std::uint64_t total = 0;
  for (const auto& [shard, sample] : {std::pair{"model-00001-of-00002.safetensors", &nv},
                                      std::pair{"model-00002-of-00002.safetensors", &mx}}) {
    write_bytes(in / shard, file_bytes(sample->tensors));
    for (const auto& t : sample->tensors) {
      index["weight_map"][t.name] = shard;
      total += t.bytes.size();
    }
  }
  index["metadata"]["total_size"] = total;
  const std::string idx = index.dump(2);
  write_bytes(in / "model.safetensors.index.json", Bytes(idx.begin(), idx.end()));
  write_bytes(in / "config.json", {'{', '}'});

  const auto c = dir_ / "out" / "ckpt-csf", r = dir_ / "out" / "ckpt-restored";
  auto res = csf({"compress", in.string(), c.string()});
  ASSERT_EQ(res.code, 0) << res.err;
  EXPECT_NE(res.out.find("file model-00002-of-00002.safetensors"), std::string::npos) << res.out;
  res = csf({"verify", c.string()});
  EXPECT_EQ(res.code, 0) << res.err;
  EXPECT_NE(res.out.find("OK model-00001-of-00002.safetensors"), std::string::npos) << res.out;
  EXPECT_NE(res.out.find("OK model-00002-of-00002.safetensors"), std::string::npos) << res.out;
  res = csf({"decompress", c.string(), r.string()});
  ASSERT_EQ(res.code, 0) << res.err;
  std::size_t files = 0;
  for (const auto& e : fs::directory_iterator(in)) {
    ++files;
    EXPECT_TRUE(read_bytes(e.path()) == read_bytes(r / e.path().filename())) << e.path().filename();
  }
  EXPECT_EQ(std::distance(fs::directory_iterator(r), fs::directory_iterator()),
            static_cast<std::ptrdiff_t>(files));
}

TEST_F(CliTest, SwizzledLayoutRoundTrips) {
  CSFMOE_SEEDED(seed);
  const auto src = dir_ / "swz.safetensors";
  auto res = csf({"synth", src.string(), "--model", "qwen3-30b-a3b", "--format", "nvfp4", "--experts", "1",
                  "--layout", "swizzled_128x4", "--seed", std::to_string(seed)});
  ASSERT_EQ(res.code, 0) << res.err;
  res = csf({"inspect", src.string(), "--json", "--layout", "swizzled_128x4"});
  ASSERT_EQ(res.code, 0) << res.err;
  EXPECT_EQ(parse_json(res.out)["totals"]["csf_tensors"].get<int>(), 2) << res.out;
  const auto c = dir_ / "out" / "c.safetensors", r = dir_ / "out" / "r.safetensors";
  ASSERT_EQ(csf({"compress", src.string(), c.string(), "--layout", "swizzled_128x4", "--quiet"}).code, 0);
  ASSERT_EQ(csf({"decompress", c.string(), r.string()}).code, 0);
  EXPECT_TRUE(read_bytes(src) == read_bytes(r));
}

TEST_F(CliTest, CompressReportsKeptNativeTensor) {
  CSFMOE_SEEDED(seed);
  const auto src = write("nv.safetensors", file_bytes(make_nvfp4_sample(seed).tensors));
  const auto res = csf({"compress", src.string(), (dir_ / "out" / "c.safetensors").string()});
  ASSERT_EQ(res.code, 0) << res.err;
  // Uniform-noise scales make CSF larger than the input.
  EXPECT_NE(res.out.find("kept native: nv.safetensors:lm_head.weight_scale:"), std::string::npos) << res.out;
  EXPECT_NE(res.out.find("layer model.layers.0.mlp.experts"), std::string::npos) << res.out;
}

TEST_F(CliTest, InspectJsonMatchesReferenceAndCompressedFile) {
  CSFMOE_SEEDED(seed);
  const auto sample = make_nvfp4_sample(seed);
  const auto src = write("nv.safetensors", file_bytes(sample.tensors));
  auto res = csf({"inspect", src.string(), "--json"});
  ASSERT_EQ(res.code, 0) << res.err;
  const auto j = parse_json(res.out);
  ASSERT_TRUE(j.contains("tensors") && j.contains("totals") && j.contains("layers")) << res.out;

  std::uint64_t src_sum = 0, stored_sum = 0, exc_sum = 0, val_sum = 0;
  std::size_t scale_tensors = 0;
  std::map<std::string, std::uint64_t> layer_src;
  for (const auto& t : j["tensors"]) {
    const std::string name = t["name"];
    if (t["action"] == "passthrough") {
      EXPECT_EQ(sample.expected.count(name), 0u) << name;
      continue;
    }
    ++scale_tensors;
    ASSERT_EQ(sample.expected.count(name), 1u) << name;
    const auto& ref = sample.expected.at(name);
    EXPECT_EQ(t["format"], "nvfp4");
    EXPECT_EQ(t["rows"].get<std::uint64_t>(), ref.rows) << name;
    EXPECT_EQ(t["values"].get<std::uint64_t>(), ref.values) << name;
    EXPECT_EQ(t["exceptions"].get<std::uint64_t>(), ref.exceptions) << name;
    EXPECT_EQ(t["distinct_bases"].get<std::uint64_t>(), ref.bases.size()) << name;
    EXPECT_EQ(t["source_bytes"].get<std::uint64_t>(), ref.values) << name;
    EXPECT_DOUBLE_EQ(t["exception_rate"].get<double>(), double(ref.exceptions) / double(ref.values));
    const auto stored = t["stored_bytes"].get<std::uint64_t>();
    EXPECT_DOUBLE_EQ(t["ratio"].get<double>(), double(stored) / double(ref.values));
    if (t["action"] == "csf") {
      EXPECT_EQ(stored, t["encoded_bytes"].get<std::uint64_t>());
      EXPECT_LT(stored, ref.values) << name << " stored as CSF although larger";
    } else {
      EXPECT_EQ(t["action"], "native_kept");
      EXPECT_EQ(stored, ref.values);
      EXPECT_GE(t["encoded_bytes"].get<std::uint64_t>(), ref.values)
          << name << " kept native although CSF pays";
    }
    if (t["layer"] != "") layer_src[t["layer"]] += ref.values;
    src_sum += ref.values;
    stored_sum += stored;
    exc_sum += ref.exceptions;
    val_sum += ref.values;
  }
  EXPECT_EQ(scale_tensors, sample.expected.size());
  const auto& tot = j["totals"];
  EXPECT_EQ(tot["scale_source_bytes"].get<std::uint64_t>(), src_sum);
  EXPECT_EQ(tot["scale_stored_bytes"].get<std::uint64_t>(), stored_sum);
  EXPECT_EQ(tot["exceptions"].get<std::uint64_t>(), exc_sum);
  EXPECT_DOUBLE_EQ(tot["scale_ratio"].get<double>(), double(stored_sum) / double(src_sum));
  std::uint64_t all_bytes = 0;
  for (const auto& t : sample.tensors) all_bytes += t.bytes.size();
  EXPECT_EQ(tot["file_source_bytes"].get<std::uint64_t>(), all_bytes);
  ASSERT_EQ(j["layers"].size(), layer_src.size());
  for (const auto& l : j["layers"]) EXPECT_EQ(l["source_bytes"].get<std::uint64_t>(), layer_src[l["layer"]]);

  // The compressed file reports the same encoding.
  const auto c = dir_ / "out" / "c.safetensors";
  ASSERT_EQ(csf({"compress", src.string(), c.string(), "--quiet"}).code, 0);
  res = csf({"inspect", c.string(), "--json"});
  ASSERT_EQ(res.code, 0) << res.err;
  const auto jc = parse_json(res.out);
  for (const auto& t : j["tensors"]) {
    if (t["action"] == "passthrough") continue;
    const auto it = std::find_if(jc["tensors"].begin(), jc["tensors"].end(),
                                 [&](const nlohmann::json& x) { return x["name"] == t["name"]; });
    ASSERT_NE(it, jc["tensors"].end()) << t["name"];
    for (const char* k : {"action", "source_bytes", "stored_bytes"})
      EXPECT_EQ((*it)[k], t[k]) << t["name"] << " " << k;
    if (t["action"] != "csf") continue;  // a kept-native tensor is not re-measured from a container
    for (const char* k : {"rows", "values", "exceptions", "distinct_bases", "encoded_bytes"})
      EXPECT_EQ((*it)[k], t[k]) << t["name"] << " " << k;
  }
  // The table names every scale tensor.
  res = csf({"inspect", src.string()});
  ASSERT_EQ(res.code, 0) << res.err;
  EXPECT_NE(res.out.find("lm_head.weight_scale"), std::string::npos) << res.out;
  EXPECT_NE(res.out.find("w13.weight_scale"), std::string::npos) << res.out;
}

TEST_F(CliTest, TruncatedFileFailsCleanly) {
  CSFMOE_SEEDED(seed);
  auto sample = make_nvfp4_sample(seed);
  auto bytes = file_bytes(sample.tensors);
  // Cut into the data of the last tensor.
  std::mt19937_64 rng(seed);
  bytes.resize(bytes.size() - 1 - rng() % sample.tensors.back().bytes.size());
  const auto src = write("trunc.safetensors", bytes);
  expect_clean_failure(csf({"compress", src.string(), (dir_ / "out" / "c.safetensors").string()}),
                       {"trunc.safetensors", sample.tensors.back().name});
  expect_clean_failure(csf({"inspect", src.string()}), {"trunc.safetensors"});
}

TEST_F(CliTest, TruncatedCompressedFileFailsCleanly) {
  CSFMOE_SEEDED(seed);
  const auto src = write("nv.safetensors", file_bytes(make_nvfp4_sample(seed).tensors));
  const auto c = dir_ / "c.safetensors";
  ASSERT_EQ(csf({"compress", src.string(), c.string(), "--quiet"}).code, 0);
  auto bytes = read_bytes(c);
  std::mt19937_64 rng(seed);
  bytes.resize(bytes.size() - 1 - rng() % 64);
  write_bytes(c, bytes);
  expect_clean_failure(csf({"decompress", c.string(), (dir_ / "out" / "r.safetensors").string()}),
                       {"c.safetensors"});
  const auto v = csf({"verify", c.string()});
  EXPECT_NE(v.code, 0);
}

TEST_F(CliTest, BadHeaderJsonFailsCleanly) {
  CSFMOE_SEEDED(seed);
  const auto sample = make_nvfp4_sample(seed);
  std::string h = header_of(sample.tensors);
  std::mt19937_64 rng(seed);
  h.resize(1 + rng() % (h.size() - 1));  // cut the JSON text anywhere
  const auto src = write("badjson.safetensors", file_bytes(sample.tensors, h));
  expect_clean_failure(csf({"compress", src.string(), (dir_ / "out" / "c.safetensors").string()}),
                       {"badjson.safetensors"});
}

TEST_F(CliTest, OffsetsPastEndFailCleanly) {
  CSFMOE_SEEDED(seed);
  const auto sample = make_nvfp4_sample(seed);
  std::mt19937_64 rng(seed);
  const auto victim = sample.tensors[rng() % sample.tensors.size()].name;
  auto h = nlohmann::ordered_json::parse(header_of(sample.tensors));
  std::uint64_t total = 0;
  for (const auto& t : sample.tensors) total += t.bytes.size();
  h[victim]["data_offsets"][1] = total + 1 + rng() % 1000;
  const auto src = write("offsets.safetensors", file_bytes(sample.tensors, h.dump()));
  expect_clean_failure(csf({"compress", src.string(), (dir_ / "out" / "c.safetensors").string()}),
                       {"offsets.safetensors", victim});
}

TEST_F(CliTest, WrongScaleDtypeFailsCleanly) {
  CSFMOE_SEEDED(seed);
  auto sample = make_nvfp4_sample(seed);
  std::mt19937_64 rng(seed);
  // A scale tensor of the right grid shape but 2-byte elements.
  std::vector<std::string> scales;
  for (const auto& [n, _] : sample.expected) scales.push_back(n);
  const auto victim = scales[rng() % scales.size()];
  for (auto& t : sample.tensors)
    if (t.name == victim) {
      t.dtype = rng() % 2 ? "BF16" : "F16";
      t.bytes.resize(2 * t.bytes.size());
    }
  const auto src = write("dtype.safetensors", file_bytes(sample.tensors));
  expect_clean_failure(csf({"compress", src.string(), (dir_ / "out" / "c.safetensors").string()}),
                       {"dtype.safetensors", victim});
}

TEST_F(CliTest, WrongPartDtypeInContainerFailsCleanly) {
  CSFMOE_SEEDED(seed);
  const auto sample = make_nvfp4_sample(seed);
  const auto src = write("nv.safetensors", file_bytes(sample.tensors));
  const auto c = dir_ / "c.safetensors";
  ASSERT_EQ(csf({"compress", src.string(), c.string(), "--quiet"}).code, 0);
  auto bytes = read_bytes(c);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[static_cast<std::size_t>(i)];
  auto h =
      nlohmann::ordered_json::parse(std::string(bytes.begin() + 8, bytes.begin() + 8 + static_cast<long>(n)));
  // Same element size, other type: the sizes still add up, only the dtype is wrong.
  const std::string victim = "model.layers.0.mlp.experts.w13.weight_scale";
  const auto part = csfmoe::detail::part_names(victim).exceptions;
  ASSERT_TRUE(h.contains(part)) << "w13 is not stored as CSF";
  std::mt19937_64 rng(seed);
  h[part]["dtype"] = rng() % 2 ? "I32" : "F32";
  std::string text = h.dump();
  ASSERT_LE(text.size(), n);
  text.resize(n, ' ');
  std::copy(text.begin(), text.end(), bytes.begin() + 8);
  write_bytes(c, bytes);
  expect_clean_failure(csf({"decompress", c.string(), (dir_ / "out" / "r.safetensors").string()}),
                       {"c.safetensors", part});
  EXPECT_NE(csf({"verify", c.string()}).code, 0);
}

TEST_F(CliTest, FlippedCompressedByteIsACrcMismatch) {
  CSFMOE_SEEDED(seed);
  const auto sample = make_nvfp4_sample(seed);
  const auto src = write("nv.safetensors", file_bytes(sample.tensors));
  const auto c = dir_ / "c.safetensors";
  ASSERT_EQ(csf({"compress", src.string(), c.string(), "--quiet"}).code, 0);
  auto bytes = read_bytes(c);
  std::string victim;
  std::size_t pos = 0;
  {
    const auto file = csfmoe::st::File::open(c);
    // Any tensor stored as CSF (realistic w13 scales always are), in either storage:
    // planes (16-row slabs: 16 bases, then 16 rows of C / 2 code bytes) or the
    // resident slabs (128 bases, then codes).
    std::vector<std::string> csf_tensors;
    for (const auto& t : sample.tensors)
      if (sample.expected.count(t.name) && (file.find(csfmoe::detail::part_names(t.name).planes) ||
                                            file.find(csfmoe::detail::part_names(t.name).fixed)))
        csf_tensors.push_back(t.name);
    ASSERT_FALSE(csf_tensors.empty());
    std::mt19937_64 pick(seed);
    victim = csf_tensors[pick() % csf_tensors.size()];
    const auto names = csfmoe::detail::part_names(victim);
    const auto* planes = file.find(names.planes);
    const auto* part = planes ? planes : file.find(names.fixed);
    const auto& shape = std::find_if(sample.tensors.begin(), sample.tensors.end(), [&](const T& t) {
                          return t.name == victim;
                        })->shape;
    const auto dim = [&](std::size_t from_end) {
      return static_cast<std::uint32_t>(shape[shape.size() - from_end]);
    };
    const auto geom = csfmoe::CsfGeometry::of({csfmoe::ScaleFormat::nvfp4, csfmoe::ScaleLayout::row_major,
                                               shape.size() == 3 ? dim(3) : 1u, dim(2), dim(1)});
    const std::uint64_t slab = planes ? 16 * (1 + dim(1) / 2) : geom.slab_bytes;
    const std::uint64_t bases = planes ? 16 : 128;
    if (planes) {
      EXPECT_EQ(part->nbytes(), std::uint64_t(shape.size() == 3 ? dim(3) : 1u) * dim(2) / 16 * slab);
    } else {
      EXPECT_EQ(part->nbytes(), geom.fixed_bytes());
    }
    std::vector<std::size_t> candidates;
    for (std::size_t i = 0; i < part->nbytes(); ++i) {
      const std::uint8_t b = bytes[file.data_offset() + part->begin + i];
      if (i % slab >= bases && (b & 0x0F) && (b & 0xF0)) candidates.push_back(i);
    }
    ASSERT_FALSE(candidates.empty());
    std::mt19937_64 rng(seed);
    pos = file.data_offset() + part->begin + candidates[rng() % candidates.size()];
  }
  bytes[pos] ^= 0x01;
  write_bytes(c, bytes);
  const auto d = csf({"decompress", c.string(), (dir_ / "out" / "r.safetensors").string()});
  expect_clean_failure(d, {"c.safetensors", victim});
  EXPECT_NE(d.err.find("CRC"), std::string::npos) << d.err;
  const auto v = csf({"verify", c.string()});
  EXPECT_NE(v.code, 0);
  EXPECT_NE(v.err.find(victim), std::string::npos) << v.err;
  EXPECT_EQ(v.out.find("OK"), std::string::npos) << v.out;
}

TEST_F(CliTest, RefusesOutputEqualToInputOrExisting) {
  CSFMOE_SEEDED(seed);
  const auto bytes = file_bytes(make_nvfp4_sample(seed).tensors);
  const auto src = write("nv.safetensors", bytes);
  auto r = csf({"compress", src.string(), src.string()});
  EXPECT_EQ(r.code, 1);
  EXPECT_EQ(r.err.rfind("csf: error: ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find("is the input"), std::string::npos) << r.err;
  // The same file under another spelling of its path.
  r = csf({"compress", src.string(), (dir_ / "." / "nv.safetensors").string()});
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("is the input"), std::string::npos) << r.err;
  EXPECT_TRUE(read_bytes(src) == bytes) << "input was modified";

  const auto existing = dir_ / "out" / "existing.safetensors";
  write_bytes(existing, {'x'});
  for (const char* cmd : {"compress", "decompress", "quantize", "synth"}) {
    SCOPED_TRACE(cmd);
    std::vector<std::string> args = {cmd, src.string(), existing.string()};
    if (std::string(cmd) == "quantize") args.insert(args.end(), {"--format", "nvfp4"});
    if (std::string(cmd) == "synth")
      args = {cmd, existing.string(), "--model", "qwen3-30b-a3b", "--format", "mxfp4", "--experts", "1"};
    r = csf(args);
    EXPECT_EQ(r.code, 1) << r.err;
    EXPECT_NE(r.err.find("exists"), std::string::npos) << r.err;
    EXPECT_TRUE(read_bytes(existing) == Bytes{'x'}) << "existing output was overwritten";
    EXPECT_EQ(out_entries().size(), 1u);
  }
}

TEST_F(CliTest, UsageErrorsExitWithTwo) {
  for (const auto& args :
       std::vector<std::vector<std::string>>{{},
                                             {"compress"},
                                             {"inspect", "x", "--layout", "diagonal"},
                                             {"quantize", "a", "b", "--format", "int4"},
                                             {"synth", "o", "--model", "gpt-5", "--format", "nvfp4"},
                                             {"frobnicate"}}) {
    const auto r = csf(args);
    EXPECT_EQ(r.code, 2) << ::testing::PrintToString(args) << r.err;
    EXPECT_FALSE(r.err.empty());
  }
  EXPECT_EQ(csf({"--help"}).code, 0);
}

TEST_F(CliTest, QuantizeMatchesLibraryAndRoundTrips) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 0.02f);
  const std::uint64_t rows = 32 * (1 + rng() % 8), k = 64 * (1 + rng() % 6);
  std::vector<float> x(rows * k);
  for (auto& v : x) v = nd(rng) * (rng() % 50 == 0 ? 20.0f : 1.0f);
  Bytes bf(2 * x.size());
  std::vector<float> xr(x.size());  // the values as BF16 stores them
  for (std::size_t i = 0; i < x.size(); ++i) {
    const auto b = csfmoe::float_to_bf16(x[i]);
    bf[2 * i] = static_cast<std::uint8_t>(b);
    bf[2 * i + 1] = static_cast<std::uint8_t>(b >> 8);
    xr[i] = csfmoe::bf16_to_float(b);
  }
  Bytes odd(2 * rows * 48);  // K = 48: a multiple of 16 but not of 32
  for (std::size_t i = 0; i < rows * 48; ++i) {
    const auto b = csfmoe::float_to_bf16(nd(rng));
    odd[2 * i] = static_cast<std::uint8_t>(b);
    odd[2 * i + 1] = static_cast<std::uint8_t>(b >> 8);
  }
  const std::vector<T> ts = {{"enc.0.ffn.weight", "BF16", {rows, k}, bf},
                             {"enc.0.ffn.bias", "BF16", {rows}, random_bytes(rng, 2 * rows)},
                             {"enc.0.odd.weight", "BF16", {rows, 48}, odd}};
  const auto src = write("bf16.safetensors", file_bytes(ts));

  const auto nv = dir_ / "nv.safetensors";
  auto r = csf({"quantize", src.string(), nv.string(), "--format", "nvfp4"});
  ASSERT_EQ(r.code, 0) << r.err;
  {
    const auto f = csfmoe::st::File::open(nv);
    const auto q = csfmoe::quantize_nvfp4(xr, rows, k);
    const auto* w = f.find("enc.0.ffn.weight");
    const auto* s = f.find("enc.0.ffn.weight_scale");
    const auto* g = f.find("enc.0.ffn.weight_scale_2");
    const auto* in = f.find("enc.0.ffn.input_scale");
    ASSERT_TRUE(w && s && g && in);
    EXPECT_EQ(w->dtype, csfmoe::st::Dtype::U8);
    EXPECT_EQ(w->shape, (std::vector<std::uint64_t>{rows, k / 2}));
    EXPECT_EQ(s->dtype, csfmoe::st::Dtype::F8_E4M3);
    EXPECT_EQ(s->shape, (std::vector<std::uint64_t>{rows, k / 16}));
    EXPECT_TRUE(g->shape.empty() && in->shape.empty());
    const auto wd = f.data(*w), sd = f.data(*s);
    EXPECT_TRUE(std::equal(wd.begin(), wd.end(), q.packed.begin(), q.packed.end()));
    EXPECT_TRUE(std::equal(sd.begin(), sd.end(), q.scales.begin(), q.scales.end()));
    float gs = 0, is = 0;
    std::memcpy(&gs, f.data(*g).data(), 4);
    std::memcpy(&is, f.data(*in).data(), 4);
    EXPECT_EQ(gs, q.global_scale);
    EXPECT_EQ(is, 1.0f);
    // K = 48 holds three NVFP4 blocks, so it is quantized too.
    EXPECT_NE(f.find("enc.0.odd.weight_scale"), nullptr);
    const auto* bias = f.find("enc.0.ffn.bias");
    ASSERT_NE(bias, nullptr);
    EXPECT_EQ(bias->dtype, csfmoe::st::Dtype::BF16);
  }
  const auto mx = dir_ / "mx.safetensors";
  r = csf({"quantize", src.string(), mx.string(), "--format", "mxfp4", "--min-rows", "1"});
  ASSERT_EQ(r.code, 0) << r.err;
  {
    const auto f = csfmoe::st::File::open(mx);
    const auto q = csfmoe::quantize_mxfp4(xr, rows, k);
    const auto* b = f.find("enc.0.ffn_blocks");
    const auto* s = f.find("enc.0.ffn_scales");
    ASSERT_TRUE(b && s);
    EXPECT_EQ(b->shape, (std::vector<std::uint64_t>{rows, k / 32, 16}));
    EXPECT_EQ(s->shape, (std::vector<std::uint64_t>{rows, k / 32}));
    const auto bd = f.data(*b), sd = f.data(*s);
    EXPECT_TRUE(std::equal(bd.begin(), bd.end(), q.packed.begin(), q.packed.end()));
    EXPECT_TRUE(std::equal(sd.begin(), sd.end(), q.scales.begin(), q.scales.end()));
    // K = 48 is not a multiple of 32: passed through unchanged.
    const auto* kept = f.find("enc.0.odd.weight");
    ASSERT_NE(kept, nullptr);
    EXPECT_EQ(kept->dtype, csfmoe::st::Dtype::BF16);
  }
  // Both outputs compress and restore exactly.
  for (const auto& p : {nv, mx}) {
    const auto c = dir_ / "out" / "c.safetensors", back = dir_ / "out" / "r.safetensors";
    ASSERT_EQ(csf({"compress", p.string(), c.string(), "--quiet"}).code, 0);
    ASSERT_EQ(csf({"decompress", c.string(), back.string(), "--quiet"}).code, 0);
    EXPECT_TRUE(read_bytes(p) == read_bytes(back)) << p;
    fs::remove(c);
    fs::remove(back);
  }
}

// Exact F16 bits of a normal value that F16 represents exactly.
std::uint16_t exact_f16(float v) {
  if (v == 0.0f) return 0;
  int e = 0;
  const float m = std::frexp(std::fabs(v), &e);  // |v| = m * 2^e, m in [0.5, 1)
  const auto frac = static_cast<std::uint16_t>((m * 2.0f - 1.0f) * 1024.0f);
  return static_cast<std::uint16_t>((v < 0 ? 0x8000 : 0) | ((e + 14) << 10) | frac);
}

TEST_F(CliTest, QuantizeReadsF16F32AndBf16Alike) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const std::uint64_t rows = 16 * (1 + rng() % 8), k = 32 * (1 + rng() % 4);
  // Multiples of 1/64 up to 1 are exact in all three dtypes.
  std::vector<float> x(rows * k);
  for (auto& v : x) v = float(int(rng() % 129) - 64) / 64.0f;
  Bytes f32(4 * x.size()), f16(2 * x.size()), bf16(2 * x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    std::memcpy(&f32[4 * i], &x[i], 4);
    const auto h = exact_f16(x[i]), b = csfmoe::float_to_bf16(x[i]);
    f16[2 * i] = static_cast<std::uint8_t>(h), f16[2 * i + 1] = static_cast<std::uint8_t>(h >> 8);
    bf16[2 * i] = static_cast<std::uint8_t>(b), bf16[2 * i + 1] = static_cast<std::uint8_t>(b >> 8);
  }
  for (const char* format : {"nvfp4", "mxfp4"}) {
    SCOPED_TRACE(format);
    std::vector<Bytes> outputs;
    for (const auto& [dtype, bytes] :
         {std::pair{"F32", &f32}, std::pair{"F16", &f16}, std::pair{"BF16", &bf16}}) {
      const auto in = dir_ / (std::string(dtype) + ".safetensors");
      const auto out = dir_ / (std::string(dtype) + "-" + format + ".safetensors");
      write_bytes(in, file_bytes({{"m.weight", dtype, {rows, k}, *bytes}}));
      const auto r = csf({"quantize", in.string(), out.string(), "--format", format, "--quiet"});
      ASSERT_EQ(r.code, 0) << r.err;
      EXPECT_TRUE(r.out.empty()) << r.out;
      const auto f = csfmoe::st::File::open(out);
      Bytes all;
      for (const auto& t : f.tensors()) {
        const auto d = f.data(t);
        all.insert(all.end(), d.begin(), d.end());
      }
      outputs.push_back(std::move(all));
      fs::remove(in);
    }
    EXPECT_TRUE(outputs[0] == outputs[1]) << "F16 input quantizes differently from F32";
    EXPECT_TRUE(outputs[0] == outputs[2]) << "BF16 input quantizes differently from F32";
  }
}

TEST_F(CliTest, SynthWritesRealGeometryGroupedByLayer) {
  CSFMOE_SEEDED(seed);
  const auto out = dir_ / "synth.safetensors";
  const auto r = csf({"synth", out.string(), "--model", "qwen3-30b-a3b", "--format", "mxfp4", "--experts",
                      "1", "--layers", "2", "--seed", std::to_string(seed)});
  ASSERT_EQ(r.code, 0) << r.err;
  {
    const auto f = csfmoe::st::File::open(out);
    const auto& g = csfmoe::kQwen3_30B_A3B;
    const auto* s = f.find("model.layers.1.mlp.experts.gate_up_proj_scales");
    const auto* b = f.find("model.layers.1.mlp.experts.down_proj_blocks");
    ASSERT_TRUE(s && b);
    EXPECT_EQ(s->shape, (std::vector<std::uint64_t>{1, 2 * g.intermediate, g.hidden / 32}));
    EXPECT_EQ(b->shape, (std::vector<std::uint64_t>{1, g.hidden, g.intermediate / 32, 16}));
  }
  const auto j = csf({"inspect", out.string(), "--json"});
  ASSERT_EQ(j.code, 0) << j.err;
  const auto rep = parse_json(j.out);
  ASSERT_EQ(rep["layers"].size(), 2u);
  EXPECT_EQ(rep["layers"][0]["layer"], "model.layers.0.mlp.experts");
  EXPECT_EQ(rep["layers"][1]["layer"], "model.layers.1.mlp.experts");
  EXPECT_EQ(rep["totals"]["csf_tensors"].get<int>(), 4);
  // Realistic MXFP4 scales compress well below half.
  EXPECT_LT(rep["totals"]["scale_ratio"].get<double>(), 0.5);
}

// The tensor-parallel shards b12x reports on: synth writes their short MXFP4
// down-projection rows, stored in the smaller slab form (planes with
// --no-mxfp4-slab), and they round-trip byte-identical.
TEST_F(CliTest, SynthShardPresetsHaveTheirRowLengthsAndRoundTrip) {
  CSFMOE_SEEDED(seed);
  const std::pair<const char*, std::uint64_t> presets[] = {
      {"qwen3.8-tp2", 20}, {"deepseek-4.1-tp4", 18}, {"kimi-tp12", 8}, {"kimi-tp16", 6}};
  for (const auto& [name, cols] : presets) {
    SCOPED_TRACE(name);
    const auto src = dir_ / (std::string(name) + ".safetensors");
    const auto c = dir_ / "out" / (std::string(name) + ".csf.safetensors");
    const auto r = dir_ / "out" / (std::string(name) + ".restored.safetensors");
    auto res = csf({"synth", src.string(), "--model", name, "--format", "mxfp4", "--experts", "1", "--seed",
                    std::to_string(seed)});
    ASSERT_EQ(res.code, 0) << res.err;
    {
      const auto f = csfmoe::st::File::open(src);
      const auto* s = f.find("model.layers.0.mlp.experts.down_proj_scales");
      ASSERT_TRUE(s);
      EXPECT_EQ(s->shape.back(), cols);
    }
    ASSERT_EQ(csf({"compress", src.string(), c.string(), "--quiet"}).code, 0);
    ASSERT_EQ(csf({"decompress", c.string(), r.string(), "--quiet"}).code, 0);
    EXPECT_TRUE(read_bytes(src) == read_bytes(r));
    const auto p = dir_ / "out" / (std::string(name) + ".planes.safetensors");
    ASSERT_EQ(csf({"compress", src.string(), p.string(), "--quiet", "--no-mxfp4-slab"}).code, 0);
    const std::string down = "model.layers.0.mlp.experts.down_proj_scales";
    const auto slabs = csfmoe::st::File::open(c), planes = csfmoe::st::File::open(p);
    ASSERT_TRUE(slabs.find(down + ".csf.slabs")) << "short MXFP4 rows are stored as slabs";
    ASSERT_TRUE(planes.find(down + ".csf.planes"));
    EXPECT_LT(slabs.find(down + ".csf.slabs")->nbytes(), planes.find(down + ".csf.planes")->nbytes());
    EXPECT_LT(fs::file_size(c), fs::file_size(p));
  }
}

TEST_F(CliTest, InspectDeviceReportsResidentBytesPerLayerAndModel) {
  CSFMOE_SEEDED(seed);
  const auto out = dir_ / "synth.safetensors";
  const auto r = csf({"synth", out.string(), "--model", "qwen3-30b-a3b", "--format", "nvfp4", "--experts",
                      "2", "--layers", "2", "--seed", std::to_string(seed)});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto res = csf({"inspect", out.string(), "--json", "--device"});
  ASSERT_EQ(res.code, 0) << res.err;
  const auto j = parse_json(res.out);
  ASSERT_TRUE(j.contains("device")) << res.out;
  const auto& d = j["device"];
  // Per layer: native = the layer's scale source bytes, csf = as stored.
  ASSERT_EQ(d["layers"].size(), j["layers"].size());
  std::uint64_t native = 0, csf_bytes = 0, largest = 0;
  for (std::size_t i = 0; i < d["layers"].size(); ++i) {
    const auto& dl = d["layers"][i];
    const auto& l = j["layers"][i];
    EXPECT_EQ(dl["layer"], l["layer"]);
    EXPECT_EQ(dl["native_bytes"], l["source_bytes"]);
    // Resident CSF (row prefix, partition index, padding) is above what is stored
    // (planes); b12x's resident form lies between.
    EXPECT_GE(dl["csf_bytes"].get<std::uint64_t>(), l["stored_bytes"].get<std::uint64_t>());
    EXPECT_LE(dl["b12x_bytes"].get<std::uint64_t>(), dl["csf_bytes"].get<std::uint64_t>());
    EXPECT_GE(dl["b12x_bytes"].get<std::uint64_t>(), l["stored_bytes"].get<std::uint64_t>());
    EXPECT_LT(dl["csf_bytes"].get<std::uint64_t>(), dl["native_bytes"].get<std::uint64_t>());
    EXPECT_EQ(dl["saved_bytes"].get<std::uint64_t>(),
              dl["native_bytes"].get<std::uint64_t>() - dl["csf_bytes"].get<std::uint64_t>());
    native += dl["native_bytes"].get<std::uint64_t>();
    csf_bytes += dl["csf_bytes"].get<std::uint64_t>();
    largest = std::max(largest, dl["native_bytes"].get<std::uint64_t>());
  }
  EXPECT_EQ(d["scales"]["native_bytes"].get<std::uint64_t>(), native);
  EXPECT_EQ(d["scales"]["csf_bytes"].get<std::uint64_t>(), csf_bytes);
  EXPECT_EQ(d["expand_scratch_bytes"].get<std::uint64_t>(), largest);
  // The totals count the scratch CSF scales need: saved is what is left after it.
  for (const char* total : {"scales", "model"}) {
    const auto& t = d[total];
    const auto n = t["native_bytes"].get<std::int64_t>(), c = t["csf_bytes"].get<std::int64_t>(),
               b = t["b12x_bytes"].get<std::int64_t>(), s = std::int64_t(largest);
    EXPECT_EQ(t["expand_scratch_bytes"].get<std::int64_t>(), s) << total;
    EXPECT_EQ(t["csf_with_scratch_bytes"].get<std::int64_t>(), c + s) << total;
    EXPECT_EQ(t["b12x_with_scratch_bytes"].get<std::int64_t>(), b + s) << total;
    EXPECT_EQ(t["net_saved_bytes"].get<std::int64_t>(), n - c - s) << total;
    EXPECT_EQ(t["saved_bytes"].get<std::int64_t>(), std::max<std::int64_t>(0, n - c - s)) << total;
  }
  // With two layers the scratch (one layer's native scales) outweighs what CSF saves on the scales.
  EXPECT_LT(d["scales"]["net_saved_bytes"].get<std::int64_t>(), 0) << d.dump();
  EXPECT_EQ(d["scales"]["b12x_bytes"].get<std::uint64_t>() - d["scales"]["csf_bytes"].get<std::uint64_t>(),
            d["model"]["b12x_bytes"].get<std::uint64_t>() - d["model"]["csf_bytes"].get<std::uint64_t>());
  // The model total counts every tensor; only the scales shrink.
  EXPECT_EQ(d["model"]["native_bytes"], j["totals"]["file_source_bytes"]);
  EXPECT_EQ(d["model"]["net_saved_bytes"], d["scales"]["net_saved_bytes"]);
  // The table form names the layers and the scratch, and says when CSF plus scratch exceed native.
  const auto table = csf({"inspect", out.string(), "--device"});
  ASSERT_EQ(table.code, 0) << table.err;
  EXPECT_NE(table.out.find("resident device memory"), std::string::npos) << table.out;
  EXPECT_NE(table.out.find("model.layers.1.mlp.experts"), std::string::npos) << table.out;
  EXPECT_NE(table.out.find("expand scratch"), std::string::npos) << table.out;
  EXPECT_NE(table.out.find("all block scales, with the scratch"), std::string::npos) << table.out;
  EXPECT_NE(table.out.find("CSF scales plus the expand scratch exceed the native scales by"),
            std::string::npos)
      << table.out;
}

// --- edges a new user meets (issue #24) -------------------------------------

TEST_F(CliTest, VerifyRefusesAFileThatIsNotCompressed) {
  CSFMOE_SEEDED(seed);
  const auto src = write("nv.safetensors", file_bytes(make_nvfp4_sample(seed).tensors));
  const auto r = csf({"verify", src.string()});
  expect_clean_failure(r, {"nv.safetensors", "not a CSF container"});
  EXPECT_EQ(r.out.find("OK"), std::string::npos) << r.out;
  // A folder of native files alike; a folder of containers verifies.
  fs::create_directories(dir_ / "native");
  fs::copy_file(src, dir_ / "native" / "a.safetensors");
  expect_clean_failure(csf({"verify", (dir_ / "native").string()}), {"not a CSF container"});
  ASSERT_EQ(csf({"compress", (dir_ / "native").string(), (dir_ / "packed").string(), "-q"}).code, 0);
  const auto ok = csf({"verify", (dir_ / "packed").string()});
  EXPECT_EQ(ok.code, 0) << ok.err;
  EXPECT_NE(ok.out.find("OK a.safetensors"), std::string::npos) << ok.out;
  // A native file added to a compressed folder is named as skipped, not as verified.
  fs::copy_file(src, dir_ / "packed" / "b.safetensors");
  const auto mixed = csf({"verify", (dir_ / "packed").string()});
  EXPECT_EQ(mixed.code, 0) << mixed.err;
  EXPECT_NE(mixed.out.find("SKIPPED b.safetensors"), std::string::npos) << mixed.out;
  EXPECT_EQ(mixed.out.find("OK b.safetensors"), std::string::npos) << mixed.out;
}

TEST_F(CliTest, FolderWithoutSafetensorsIsAnError) {
  fs::create_directories(dir_ / "empty");
  std::ofstream(dir_ / "empty" / "config.json") << "{}";
  for (const char* cmd : {"inspect", "verify", "compress", "decompress"}) {
    SCOPED_TRACE(cmd);
    std::vector<std::string> args = {cmd, (dir_ / "empty").string()};
    if (std::string(cmd) == "compress" || std::string(cmd) == "decompress")
      args.push_back((dir_ / "out" / "x").string());
    expect_clean_failure(csf(args), {"empty", "no .safetensors"});
  }
}

TEST_F(CliTest, CompressHonoursTheFilesLayoutTagAndPrintsFileSizes) {
  CSFMOE_SEEDED(seed);
  const auto tagged = dir_ / "synth.safetensors";
  ASSERT_EQ(csf({"synth", tagged.string(), "--model", "qwen3-30b-a3b", "--format", "nvfp4", "--experts", "1",
                 "--layout", "swizzled_128x4", "--seed", std::to_string(seed), "-q"})
                .code,
            0);
  const auto c = dir_ / "c.safetensors";
  const auto r = csf({"compress", tagged.string(), c.string()});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("on disk"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(std::to_string(fs::file_size(c)) + " bytes"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(std::to_string(fs::file_size(tagged)) + " bytes"), std::string::npos) << r.out;
  {
    const auto f = csfmoe::st::File::open(c);
    const auto info = csfmoe::detail::get_container_metadata(f.header().metadata, c.string());
    ASSERT_TRUE(info.has_value());
    ASSERT_FALSE(info->csf.empty());
    for (const auto& e : info->csf) EXPECT_EQ(e.grid.layout, csfmoe::ScaleLayout::swizzled_128x4) << e.name;
  }
  // The same bytes as naming the layout explicitly.
  const auto c2 = dir_ / "c2.safetensors";
  ASSERT_EQ(csf({"compress", tagged.string(), c2.string(), "--layout", "swizzled_128x4", "-q"}).code, 0);
  EXPECT_TRUE(read_bytes(c) == read_bytes(c2));
  // A contradicting --layout is an error, and nothing is written.
  expect_clean_failure(
      csf({"compress", tagged.string(), (dir_ / "out" / "x.safetensors").string(), "--layout", "row_major"}),
      {"synth.safetensors", "csfmoe.scale_layout", "swizzled_128x4"});
  // Round trip.
  ASSERT_EQ(csf({"decompress", c.string(), (dir_ / "r.safetensors").string(), "-q"}).code, 0);
  EXPECT_TRUE(read_bytes(dir_ / "r.safetensors") == read_bytes(tagged));
}

// The container's header is sized to what it holds: no reservation slack
// beyond the 8-byte alignment, so a small file does not grow by the bound.
TEST_F(CliTest, ContainerHeaderHasNoReservationSlack) {
  CSFMOE_SEEDED(seed);
  for (int round = 0; round < 3; ++round) {
    const auto src = write("in" + std::to_string(round) + ".safetensors",
                           file_bytes(make_nvfp4_sample(seed + std::uint64_t(round)).tensors));
    const auto c = dir_ / ("c" + std::to_string(round) + ".safetensors");
    ASSERT_EQ(csf({"compress", src.string(), c.string(), "-q"}).code, 0);
    const Bytes b = read_bytes(c);
    ASSERT_GE(b.size(), 8u);
    std::uint64_t n = 0;
    for (int i = 0; i < 8; ++i) n |= std::uint64_t(b[std::size_t(i)]) << (8 * i);
    ASSERT_LE(8 + n, b.size());
    std::size_t spaces = 0;
    while (spaces < n && b[8 + n - 1 - spaces] == ' ') ++spaces;
    EXPECT_LT(spaces, 8u) << "header of " << n << " bytes ends in " << spaces << " spaces";
    EXPECT_EQ((8 + n) % 8, 0u);
    // Still a valid container that restores exactly.
    const auto r = dir_ / ("r" + std::to_string(round) + ".safetensors");
    ASSERT_EQ(csf({"decompress", c.string(), r.string(), "-q"}).code, 0);
    EXPECT_TRUE(read_bytes(r) == read_bytes(src));
  }
}

TEST_F(CliTest, InspectDecodesAndCrcChecksCsfTensors) {
  CSFMOE_SEEDED(seed);
  const auto sample = make_nvfp4_sample(seed);
  const auto src = write("nv.safetensors", file_bytes(sample.tensors));
  const auto c = dir_ / "c.safetensors";
  ASSERT_EQ(csf({"compress", src.string(), c.string(), "-q"}).code, 0);
  const auto clean = csf({"inspect", c.string()});
  ASSERT_EQ(clean.code, 0) << clean.err;
  EXPECT_NE(clean.out.find("CRC32 matched"), std::string::npos) << clean.out;
  EXPECT_NE(clean.out.find("csf verify"), std::string::npos) << clean.out;
  // Swap two different code bytes of a CSF fixed part: the part stays well formed, the CRC does not match.
  auto bytes = read_bytes(c);
  const auto file = csfmoe::st::File::open(c);
  const std::string victim = "model.layers.0.mlp.experts.w13.weight_scale";
  const auto* part = file.find(csfmoe::detail::part_names(victim).planes);
  ASSERT_NE(part, nullptr);
  const std::size_t base = file.data_offset() + part->begin;
  // Inside the first plane slab's codes: after its 16 bases, C >= 16 columns of 16 rows at 2 codes a byte.
  std::size_t i = 16, j = 0;
  for (std::size_t k = i + 1; k < 16 + 8 * 16 && !j; ++k)
    if (bytes[base + k] != bytes[base + i]) j = k;
  ASSERT_NE(j, 0u);
  std::swap(bytes[base + i], bytes[base + j]);
  write_bytes(c, bytes);
  const auto r = csf({"inspect", c.string()});
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.err.find(victim), std::string::npos) << r.err;
  // The CRC catches it, or the plane check first when a code moved into an exception's slot.
  EXPECT_TRUE(r.err.find("CRC32") != std::string::npos || r.err.find("code") != std::string::npos) << r.err;
}

TEST_F(CliTest, MessagesForEdgeArguments) {
  // --tp without --rank: a usage error naming --rank.
  CSFMOE_SEEDED(seed);
  const auto src = write("nv.safetensors", file_bytes(make_nvfp4_sample(seed).tensors));
  auto r = csf({"compress", src.string(), (dir_ / "out" / "x").string(), "--tp", "2"});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("--rank"), std::string::npos) << r.err;
  EXPECT_TRUE(out_entries().empty());
  // Ranks: --rank outside --tp's ranks, or --rank without --tp, are usage errors in the user's words.
  r = csf({"compress", src.string(), (dir_ / "out" / "x").string(), "--tp", "2", "--rank", "2"});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("--rank 2 is outside --tp 2's ranks 0..1"), std::string::npos) << r.err;
  r = csf({"compress", src.string(), (dir_ / "out" / "x").string(), "--rank", "1"});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("--rank 1 needs --tp"), std::string::npos) << r.err;
  EXPECT_TRUE(out_entries().empty());
  // csf moe: zero tokens, top-k or iterations, and a scale mode with --cpu, are command-line errors.
  for (const auto& args : std::vector<std::vector<std::string>>{{"moe", "--tokens", "0"},
                                                                {"moe", "--topk", "0"},
                                                                {"moe", "--iters", "0"},
                                                                {"moe", "--cpu", "--mode", "stage_read"}}) {
    r = csf(args);
    EXPECT_EQ(r.code, 2) << ::testing::PrintToString(args) << r.err;
    EXPECT_NE(r.err.find("usage error"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(args[1]), std::string::npos) << r.err;  // names the option
    EXPECT_EQ(r.err.find("plan_weights"), std::string::npos) << r.err;
  }
  // synth --experts out of range: a short message, not a 300-digit bound.
  r = csf({"synth", (dir_ / "out" / "s").string(), "--model", "qwen3-30b-a3b", "--format", "nvfp4",
           "--experts", "0"});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_LT(r.err.size(), 200u) << r.err;
  EXPECT_NE(r.err.find("--experts"), std::string::npos) << r.err;
  // A shape whose byte count wraps 64 bits is named as such.
  const T wrap{"wrap", "F32", {std::uint64_t{1} << 62}, {}};
  const auto p = write("wrap.safetensors", file_bytes({wrap}));
  r = csf({"inspect", p.string()});
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("overflows"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("needs 0"), std::string::npos) << r.err;
  // --help explains the table's words and the exit codes.
  r = csf({"--help"});
  EXPECT_EQ(r.code, 0);
  for (const char* word : {"ratio", "lower is better", "bases", "exc", "native_kept", "passthrough",
                           "stage_read", "Exit codes", "--max-error"})
    EXPECT_NE(r.out.find(word), std::string::npos) << word;
}

// What a new user meets: each refusal says why and what to do instead, and
// the help says what each command takes.
TEST_F(CliTest, MessagesSayWhatToDoNext) {
  CSFMOE_SEEDED(seed);
  const auto src = write("nv.safetensors", file_bytes(make_nvfp4_sample(seed).tensors));
  const std::string out = (dir_ / "out" / "x.safetensors").string();
  // --no-mxfp4-slab is the csfmoe schema's: with --schema b12x a command-line error.
  auto r = csf({"compress", src.string(), out, "--schema", "b12x", "--no-mxfp4-slab"});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_EQ(r.err.rfind("csf: usage error: ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find("--schema b12x always writes b12x's planes"), std::string::npos) << r.err;
  EXPECT_TRUE(out_entries().empty());
  // Stacked scales that cannot be split per expert for the b12x schema (w13
  // rows that do not halve into gate and up): refused naming file, tensor, reason.
  const auto odd = write(
      "odd.safetensors",
      file_bytes({{"model.layers.0.mlp.experts.w13.weight", "U8", {2, 33, 128}, Bytes(2 * 33 * 128, 0x22)},
                  {"model.layers.0.mlp.experts.w13.weight_scale",
                   "F8_E4M3",
                   {2, 33, 16},
                   Bytes(2 * 33 * 16, 0x38)}}));
  r = csf({"compress", odd.string(), out, "--schema", "b12x"});
  expect_clean_failure(r, {"odd.safetensors", "model.layers.0.mlp.experts.w13.weight",
                           "cannot split it per expert", "33 rows do not split into gate and up halves"});
  // Stacked scales that can be split: stored per expert, under b12x's names.
  r = csf({"compress", "-q", src.string(), out, "--schema", "b12x"});
  EXPECT_EQ(r.code, 0) << r.err;
  r = csf({"inspect", "--json", out});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("model.layers.0.mlp.experts.1.up_proj.weight_scale"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("experts.w13"), std::string::npos) << r.out;
  fs::remove(out);
  // A container compressed again: what to do with it instead.
  ASSERT_EQ(csf({"compress", "-q", src.string(), (dir_ / "c.safetensors").string()}).code, 0);
  r = csf({"compress", (dir_ / "c.safetensors").string(), out});
  expect_clean_failure(r, {"c.safetensors is already a CSF container", "decompress restores the original"});
  // decompress --help names every input it restores.
  r = csf({"decompress", "--help"});
  EXPECT_EQ(r.code, 0) << r.err;
  for (const char* word : {"b12x / vLLM", "manifest export", "tensor-parallel", "--tp N --rank R"})
    EXPECT_NE(r.out.find(word), std::string::npos) << word << "\n" << r.out;
  // synth --experts: the limit per model, from the model table.
  r = csf({"synth", "--help"});
  EXPECT_EQ(r.code, 0) << r.err;
  for (const csfmoe::MoeGeometry* g : csfmoe::moe_geometries())
    EXPECT_NE(r.out.find(std::string(g->name) + " " + std::to_string(g->experts)), std::string::npos)
        << g->name << "\n"
        << r.out;
  // One layer of one expert is singular; two of each plural.
  r = csf({"synth", (dir_ / "s1.safetensors").string(), "--model", "qwen3-30b-a3b", "--format", "nvfp4",
           "--experts", "1", "--layers", "1"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find(" 1 layer x 1 expert ("), std::string::npos) << r.out;
  r = csf({"synth", (dir_ / "s2.safetensors").string(), "--model", "qwen3-30b-a3b", "--format", "mxfp4",
           "--experts", "2", "--layers", "2"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find(" 2 layers x 2 experts ("), std::string::npos) << r.out;
}

TEST_F(CliTest, QuantizeSaysWhyAMatrixStaysAsItIs) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const std::uint64_t k_bad = 16 * (2 + rng() % 4) + 8;  // not a multiple of 16
  std::vector<T> ts = {{"good.weight", "F32", {4, 64}, Bytes(4 * 64 * 4, 0)},
                       {"odd.weight", "F32", {4, k_bad}, Bytes(4 * k_bad * 4, 0)},
                       {"vec.weight", "F32", {64}, Bytes(64 * 4, 0)},
                       {"other.bias", "F32", {4}, Bytes(16, 0)}};
  for (auto& t : ts)
    for (std::size_t i = 0; i + 3 < t.bytes.size(); i += 4) {
      const float v = std::normal_distribution<float>(0.0f, 1.0f)(rng);
      std::memcpy(t.bytes.data() + i, &v, 4);
    }
  const auto src = write("f.safetensors", file_bytes(ts));
  const auto r = csf({"quantize", src.string(), (dir_ / "q.safetensors").string(), "--format", "nvfp4"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("kept as is: odd.weight"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("K = " + std::to_string(k_bad)), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("kept as is: vec.weight"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("other.bias"), std::string::npos) << "not asked for, not listed: " << r.out;
  EXPECT_EQ(r.out.find("kept as is: good.weight"), std::string::npos) << r.out;
}

TEST_F(CliTest, SweepsDeadTemporariesOfOtherOutputs) {
  CSFMOE_SEEDED(seed);
  const auto src = write("nv.safetensors", file_bytes(make_nvfp4_sample(seed).tensors));
  const pid_t gone = csfmoe::testing::dead_pid();
  const std::string stale = ".another-output.safetensors.tmp-" + std::to_string(gone);
  const std::string live = ".busy.safetensors.tmp-" + std::to_string(::getpid());
  write_bytes(dir_ / "out" / stale, Bytes(4096, 7));
  write_bytes(dir_ / "out" / live, Bytes(16, 7));
  ASSERT_EQ(csf({"compress", src.string(), (dir_ / "out" / "c.safetensors").string(), "-q"}).code, 0);
  EXPECT_FALSE(fs::exists(dir_ / "out" / stale)) << "a dead run's temporary was left";
  EXPECT_TRUE(fs::exists(dir_ / "out" / live)) << "a live run's temporary was removed";
}

// A file as b12x / vLLM write it (planes under their names, no csfmoe
// metadata): verify says what it checked, decompress restores the scales,
// compress refuses it with what to do instead.
TEST_F(CliTest, FilesWrittenByB12xVerifyDecompressAndAreNotCompressedAgain) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const std::uint32_t R = 64, C = 32;
  const csfmoe::GridShape g{csfmoe::ScaleFormat::nvfp4, csfmoe::ScaleLayout::row_major, 1, R, C};
  const auto grid = csfmoe::synthetic_scales(g, csfmoe::ScaleDistribution::realistic, rng());
  const std::string scale = "model.layers.0.mlp.experts.0.gate_proj.weight_scale";
  const auto planes = csfmoe::encode_planes({csfmoe::ScaleFormat::nvfp4, R, C}, grid, scale);
  Bytes rec(planes.exceptions.size() * 4);
  if (!rec.empty()) std::memcpy(rec.data(), planes.exceptions.data(), rec.size());
  const std::vector<T> ts = {{"model.layers.0.mlp.experts.0.gate_proj.weight",
                              "U8",
                              {R, C * 8},
                              random_bytes(rng, std::size_t(R) * C * 8)},
                             {csfmoe::b12x_fixed_name(scale, csfmoe::ScaleFormat::nvfp4),
                              "U8",
                              {R / 16, 16 * (1 + C / 2)},
                              planes.fixed},
                             {csfmoe::b12x_exceptions_name(scale, csfmoe::ScaleFormat::nvfp4),
                              "U32",
                              {planes.exceptions.size()},
                              rec}};
  const auto p = write("b12x.safetensors", file_bytes(ts));
  const auto v = csf({"verify", p.string()});
  EXPECT_EQ(v.code, 0) << v.err;
  EXPECT_NE(v.out.find("1 b12x plane pairs checked and decoded"), std::string::npos) << v.out;
  const auto c = csf({"compress", p.string(), (dir_ / "out" / "c.safetensors").string()});
  expect_clean_failure(c, {"b12x.safetensors", "decompress it first"});
  const auto d = csf({"decompress", p.string(), (dir_ / "native.safetensors").string(), "-q"});
  ASSERT_EQ(d.code, 0) << d.err;
  const auto native = csfmoe::st::File::open(dir_ / "native.safetensors");
  const auto* t = native.find(scale);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->dtype, csfmoe::st::Dtype::F8_E4M3);
  const auto bytes = native.data(*t);
  EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), grid.begin(), grid.end()));
}

TEST_F(CliTest, DemoPasses) {
  const auto r = csf({"demo", "--data", std::string(CSFMOE_SOURCE_DIR) + "/data"});
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("OK: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("scales total"), std::string::npos) << r.out;
}

}  // namespace
