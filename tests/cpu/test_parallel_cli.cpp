// `csf compress --tp N --rank R`: the stored container decompresses to the
// rank's slice of every expert projection (checked against index arithmetic
// written here, not the library's slicer), the ranks' slices put back
// together are the original bytes, and bad requests leave nothing behind.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "csfmoe/checkpoint.hpp"
#include "csfmoe/formats.hpp"
#include "csfmoe/safetensors.hpp"
#include "test_seed.hpp"

namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<std::uint8_t>;
using namespace csfmoe;

struct CliResult {
  int code = -1;
  std::string err;
};

CliResult csf(const std::string& args, const fs::path& dir) {
  const fs::path err = dir / "stderr.txt";
  const std::string cmd = std::string(CSFMOE_CSF_BINARY) + " " + args + " >/dev/null 2>" + err.string();
  const int s = std::system(cmd.c_str());
  std::ifstream in(err);
  CliResult r;
  r.err.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  r.code = WIFEXITED(s) ? WEXITSTATUS(s) : -1;
  return r;
}

// csf with stdout kept too.
CliResult csf_out(const std::string& args, const fs::path& dir, std::string& out) {
  const fs::path o = dir / "stdout.txt", err = dir / "stderr.txt";
  const std::string cmd =
      std::string(CSFMOE_CSF_BINARY) + " " + args + " >" + o.string() + " 2>" + err.string();
  const int s = std::system(cmd.c_str());
  CliResult r;
  r.code = WIFEXITED(s) ? WEXITSTATUS(s) : -1;
  std::ifstream ie(err), io(o);
  r.err.assign(std::istreambuf_iterator<char>(ie), std::istreambuf_iterator<char>());
  out.assign(std::istreambuf_iterator<char>(io), std::istreambuf_iterator<char>());
  return r;
}

struct Tensor {
  std::string name;
  st::Dtype dtype;
  std::vector<std::uint64_t> shape;
  Bytes bytes;
};

class TpCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("csf_tp_cli_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  Tensor random_tensor(std::string name, st::Dtype d, std::vector<std::uint64_t> shape) {
    std::uint64_t n = st::dtype_size(d);
    for (auto x : shape) n *= x;
    Tensor t{std::move(name), d, std::move(shape), Bytes(n)};
    for (auto& b : t.bytes) b = static_cast<std::uint8_t>(rng_());
    return t;
  }
  void write(const fs::path& p, const std::vector<Tensor>& ts) {
    st::Writer w(p, 1 << 16);
    for (const auto& t : ts) w.add_tensor(t.name, t.dtype, t.shape, t.bytes);
    w.commit(st::Metadata{{"format", "pt"}});
  }
  std::map<std::string, Tensor> read(const fs::path& p) {
    const st::File f = st::File::open(p);
    std::map<std::string, Tensor> m;
    for (const auto& t : f.tensors()) {
      const auto d = f.data(t);
      m[t.name] = Tensor{t.name, t.dtype, t.shape, Bytes(d.begin(), d.end())};
    }
    meta_ = f.header().metadata.value_or(st::Metadata{});
    return m;
  }

  fs::path dir_;
  std::mt19937_64 rng_;
  st::Metadata meta_;
};

// Rows [a, b) of a [outer, rows, inner-bytes] tensor, per outer block.
Bytes rows_of(const Bytes& src, std::uint64_t outer, std::uint64_t rows, std::uint64_t inner, std::uint64_t a,
              std::uint64_t b) {
  Bytes out;
  for (std::uint64_t o = 0; o < outer; ++o)
    out.insert(out.end(), src.begin() + (o * rows + a) * inner, src.begin() + (o * rows + b) * inner);
  return out;
}
// Both halves' rows [a, b) of a fused gate/up tensor, per outer block.
Bytes halves_of(const Bytes& src, std::uint64_t outer, std::uint64_t rows2, std::uint64_t inner,
                std::uint64_t a, std::uint64_t b) {
  Bytes out;
  for (std::uint64_t o = 0; o < outer; ++o)
    for (std::uint64_t h = 0; h < 2; ++h) {
      const std::uint64_t base = o * rows2 + h * rows2 / 2;
      out.insert(out.end(), src.begin() + (base + a) * inner, src.begin() + (base + b) * inner);
    }
  return out;
}

TEST_F(TpCli, SlicesOfBothFormatsDecompressToTheRanksSliceAndReassemble) {
  CSFMOE_SEEDED(seed);
  rng_.seed(seed);
  const std::uint64_t E = 2, H = 128, N = 256;
  std::vector<Tensor> ts;
  ts.push_back(random_tensor("model.embed_tokens.weight", st::Dtype::BF16, {16, 8}));
  // NVFP4, ModelOpt per-expert 2-D tensors.
  for (std::uint64_t e = 0; e < E; ++e) {
    const std::string p = "model.layers.0.mlp.experts." + std::to_string(e) + ".";
    for (const char* w : {"w1", "w3"}) {
      ts.push_back(random_tensor(p + w + ".weight", st::Dtype::U8, {N, H / 2}));
      ts.push_back(random_tensor(p + w + ".weight_scale", st::Dtype::F8_E4M3, {N, H / 16}));
      ts.push_back(random_tensor(p + w + ".weight_scale_2", st::Dtype::F32, {}));
    }
    ts.push_back(random_tensor(p + "w2.weight", st::Dtype::U8, {H, N / 2}));
    ts.push_back(random_tensor(p + "w2.weight_scale", st::Dtype::F8_E4M3, {H, N / 16}));
    ts.push_back(random_tensor(p + "w2.input_scale", st::Dtype::F32, {}));
  }
  // MXFP4, gpt-oss stacked [E, ...] tensors with biases.
  const std::string q = "model.layers.1.mlp.experts.";
  ts.push_back(random_tensor(q + "gate_up_proj_blocks", st::Dtype::U8, {E, 2 * N, H / 32, 16}));
  ts.push_back(random_tensor(q + "gate_up_proj_scales", st::Dtype::U8, {E, 2 * N, H / 32}));
  ts.push_back(random_tensor(q + "gate_up_proj_bias", st::Dtype::BF16, {E, 2 * N}));
  ts.push_back(random_tensor(q + "down_proj_blocks", st::Dtype::U8, {E, H, N / 32, 16}));
  ts.push_back(random_tensor(q + "down_proj_scales", st::Dtype::U8, {E, H, N / 32}));
  ts.push_back(random_tensor(q + "down_proj_bias", st::Dtype::BF16, {E, H}));
  // The same names without biases: the fused [gate; up] rows csf synth writes.
  const std::string u = "model.layers.2.mlp.experts.";
  ts.push_back(random_tensor(u + "gate_up_proj_blocks", st::Dtype::U8, {E, 2 * N, H / 32, 16}));
  ts.push_back(random_tensor(u + "gate_up_proj_scales", st::Dtype::U8, {E, 2 * N, H / 32}));
  ts.push_back(random_tensor(u + "down_proj_blocks", st::Dtype::U8, {E, H, N / 32, 16}));
  ts.push_back(random_tensor(u + "down_proj_scales", st::Dtype::U8, {E, H, N / 32}));
  std::map<std::string, Tensor> orig;
  for (const auto& t : ts) orig[t.name] = t;
  const fs::path in = dir_ / "model.safetensors";
  write(in, ts);

  for (unsigned tp : {2u, 4u}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    std::map<std::string, Bytes> cat;  // rank slices concatenated along the split axis
    for (unsigned r = 0; r < tp; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      const fs::path c = dir_ / ("c" + std::to_string(tp) + "_" + std::to_string(r) + ".safetensors");
      const fs::path back = dir_ / ("b" + std::to_string(tp) + "_" + std::to_string(r) + ".safetensors");
      CliResult x = csf("compress -q --tp " + std::to_string(tp) + " --rank " + std::to_string(r) + " " +
                            in.string() + " " + c.string(),
                        dir_);
      ASSERT_EQ(x.code, 0) << x.err;
      x = csf("verify " + c.string(), dir_);
      ASSERT_EQ(x.code, 0) << x.err;
      // The container itself records the slice.
      {
        const st::File cf = st::File::open(c);
        ASSERT_TRUE(cf.header().metadata);
        EXPECT_EQ(cf.header().metadata->at("csfmoe.tp"), std::to_string(tp));
        EXPECT_EQ(cf.header().metadata->at("csfmoe.tp_rank"), std::to_string(r));
      }
      x = csf("decompress -q " + c.string() + " " + back.string(), dir_);
      ASSERT_EQ(x.code, 0) << x.err;
      const auto got = read(back);
      EXPECT_EQ(meta_.at("csfmoe.tp"), std::to_string(tp));
      EXPECT_EQ(meta_.at("csfmoe.tp_rank"), std::to_string(r));
      EXPECT_EQ(meta_.at("format"), "pt");
      ASSERT_EQ(got.size(), orig.size());
      const std::uint64_t n = N / tp, a = r * n, b = a + n;
      for (const auto& [name, o] : orig) {
        SCOPED_TRACE(name);
        ASSERT_TRUE(got.count(name));
        const Tensor& g = got.at(name);
        EXPECT_EQ(g.dtype, o.dtype);
        Bytes want;
        std::vector<std::uint64_t> shape = o.shape;
        const bool nv = name.find("layers.0") != std::string::npos;
        // gpt-oss proper (biases): interleaved gate/up rows, kept in
        // contiguous pairs [2a, 2b) as vLLM slices them; without biases: halves.
        const bool oss = name.find("layers.1") != std::string::npos;
        const auto ends = [&](const char* s) {
          const std::string x(s);
          return name.size() >= x.size() && name.compare(name.size() - x.size(), x.size(), x) == 0;
        };
        if (nv && (ends(".w1.weight") || ends(".w3.weight"))) {
          want = rows_of(o.bytes, 1, N, H / 2, a, b);
          shape = {n, H / 2};
        } else if (nv && (ends(".w1.weight_scale") || ends(".w3.weight_scale"))) {
          want = rows_of(o.bytes, 1, N, H / 16, a, b);
          shape = {n, H / 16};
        } else if (nv && ends(".w2.weight")) {
          want = rows_of(o.bytes, H, N / 2, 1, a / 2, b / 2);  // column bytes of each row
          shape = {H, n / 2};
        } else if (nv && ends(".w2.weight_scale")) {
          want = rows_of(o.bytes, H, N / 16, 1, a / 16, b / 16);
          shape = {H, n / 16};
        } else if (ends("gate_up_proj_blocks")) {
          want = oss ? rows_of(o.bytes, E, 2 * N, H / 32 * 16, 2 * a, 2 * b)
                     : halves_of(o.bytes, E, 2 * N, H / 32 * 16, a, b);
          shape = {E, 2 * n, H / 32, 16};
        } else if (ends("gate_up_proj_scales")) {
          want = oss ? rows_of(o.bytes, E, 2 * N, H / 32, 2 * a, 2 * b)
                     : halves_of(o.bytes, E, 2 * N, H / 32, a, b);
          shape = {E, 2 * n, H / 32};
        } else if (ends("gate_up_proj_bias")) {
          want = rows_of(o.bytes, E, 2 * N, 2, 2 * a, 2 * b);
          shape = {E, 2 * n};
        } else if (ends("down_proj_bias")) {
          want = r == 0 ? o.bytes : Bytes(o.bytes.size(), 0);  // added once over the ranks
        } else if (ends("down_proj_blocks")) {
          want = rows_of(o.bytes, E * H, N / 32, 16, a / 32, b / 32);
          shape = {E, H, n / 32, 16};
        } else if (ends("down_proj_scales")) {
          want = rows_of(o.bytes, E * H, N / 32, 1, a / 32, b / 32);
          shape = {E, H, n / 32};
        } else {
          want = o.bytes;  // embeddings, global/input scales: unchanged
        }
        EXPECT_EQ(g.shape, shape);
        ASSERT_EQ(g.bytes, want);
        Bytes& cc = cat[name];
        cc.insert(cc.end(), g.bytes.begin(), g.bytes.end());
      }
    }
    // Row-split tensors (separate w1/w3) concatenate back to the original directly.
    for (const auto& [name, o] : orig) {
      const bool w13 =
          name.find(".w1.weight") != std::string::npos || name.find(".w3.weight") != std::string::npos;
      if (w13 && name.find("_2") == std::string::npos) EXPECT_EQ(cat[name], o.bytes) << name;
    }
  }
}

TEST_F(TpCli, SwizzledScalesAreSlicedAlongTheirTrueAxes) {
  CSFMOE_SEEDED(seed);
  rng_.seed(seed);
  // Stacked NVFP4 [E, 2N, H/2] with 128x4-swizzled scales; N = 256, tp 2: 128 rows per half.
  const std::uint64_t E = 2, H = 192, N = 256, C = H / 16;  // C = 12 (multiple of 4)
  std::vector<Tensor> ts;
  ts.push_back(random_tensor("experts.w13.weight", st::Dtype::U8, {E, 2 * N, H / 2}));
  ts.push_back(random_tensor("experts.w13.weight_scale", st::Dtype::F8_E4M3, {E, 2 * N, C}));
  ts.push_back(random_tensor("experts.w2.weight", st::Dtype::U8, {E, H, N / 2}));
  ts.push_back(
      random_tensor("experts.w2.weight_scale", st::Dtype::F8_E4M3, {E, 256, N / 16}));  // H padded to 256
  const fs::path in = dir_ / "s.safetensors";
  write(in, ts);
  const unsigned tp = 2;
  for (unsigned r = 0; r < tp; ++r) {
    const fs::path c = dir_ / ("c" + std::to_string(r)), back = dir_ / ("b" + std::to_string(r));
    CliResult x = csf("compress -q --layout swizzled_128x4 --tp 2 --rank " + std::to_string(r) + " " +
                          in.string() + " " + c.string(),
                      dir_);
    ASSERT_EQ(x.code, 0) << x.err;
    ASSERT_EQ(csf("decompress -q " + c.string() + " " + back.string(), dir_).code, 0);
    const auto got = read(back);
    // w13 scales: each half's 128-row tile block, byte ranges of the swizzled grid.
    const auto& s13 = got.at("experts.w13.weight_scale");
    ASSERT_EQ(s13.shape, (std::vector<std::uint64_t>{E, N, C}));
    EXPECT_EQ(s13.bytes, halves_of(ts[1].bytes, E, 2 * N, C, r * 128, r * 128 + 128));
    // w2 scales: true 192 rows x 16 columns -> 8 columns per rank, re-padded swizzle.
    const auto& s2 = got.at("experts.w2.weight_scale");
    ASSERT_EQ(s2.shape, (std::vector<std::uint64_t>{E, 256, 8}));
    for (std::uint64_t e = 0; e < E; ++e)
      for (std::uint64_t row = 0; row < 256; ++row)
        for (std::uint64_t col = 0; col < 8; ++col) {
          const std::uint8_t v = s2.bytes[e * 256 * 8 + swizzled_index(row, col, 8)];
          const std::uint8_t o = ts[3].bytes[e * 256 * 16 + swizzled_index(row, r * 8 + col, 16)];
          ASSERT_EQ(v, row < H ? o : 0) << "e " << e << " row " << row << " col " << col;
        }
  }
}

TEST_F(TpCli, BadRequestsFailCleanly) {
  CSFMOE_SEEDED(seed);
  rng_.seed(seed);
  const fs::path in = dir_ / "m.safetensors";
  write(in, {random_tensor("experts.0.w1.weight", st::Dtype::U8, {96, 32}),
             random_tensor("experts.0.w1.weight_scale", st::Dtype::F8_E4M3, {96, 4}),
             random_tensor("experts.0.gate_proj.weight", st::Dtype::BF16, {8, 8})});
  const fs::path out = dir_ / "o.safetensors";
  auto count_entries = [&] { return std::distance(fs::directory_iterator(dir_), fs::directory_iterator{}); };
  const auto before = count_entries();
  CliResult x = csf("compress --tp 0 " + in.string() + " " + out.string(), dir_);
  EXPECT_EQ(x.code, 2) << x.err;
  // A rank outside the ranks, or a rank without a degree above 1: command-line errors (exit 2).
  x = csf("compress --tp 4 --rank 4 " + in.string() + " " + out.string(), dir_);
  EXPECT_EQ(x.code, 2) << x.err;
  EXPECT_NE(x.err.find("rank 4"), std::string::npos) << x.err;
  x = csf("compress --tp 1 --rank 1 " + in.string() + " " + out.string(), dir_);
  EXPECT_EQ(x.code, 2) << x.err;
  EXPECT_NE(x.err.find("--rank 1 needs --tp"), std::string::npos) << x.err;
  // 96 rows over tp 8 is 12 each, but the BF16 gate_proj has no known split axis.
  x = csf("compress --tp 8 --rank 0 " + in.string() + " " + out.string(), dir_);
  EXPECT_EQ(x.code, 1) << x.err;
  EXPECT_NE(x.err.find("experts.0.gate_proj.weight"), std::string::npos) << x.err;
  // 96 rows do not split in 64 pieces: said in words a user reads.
  x = csf("compress --tp 64 --rank 3 " + in.string() + " " + out.string(), dir_);
  EXPECT_EQ(x.code, 1) << x.err;
  EXPECT_NE(x.err.find("experts.0.w1.weight"), std::string::npos) << x.err;
  EXPECT_NE(
      x.err.find("cannot cut an axis of 96 elements into tp = 64 equal slices: for tp = 64 it must be a "
                 "multiple of 64"),
      std::string::npos)
      << x.err;
  EXPECT_FALSE(fs::exists(out));
  EXPECT_EQ(count_entries(), before + 1);  // only stderr.txt was added: no temporary left behind
  // A slice cannot be sliced again.
  const fs::path one = dir_ / "one.safetensors";
  write(one, {random_tensor("experts.0.w1.weight", st::Dtype::U8, {96, 32}),
              random_tensor("experts.0.w1.weight_scale", st::Dtype::F8_E4M3, {96, 4})});
  const fs::path c = dir_ / "c", b = dir_ / "b.safetensors";
  ASSERT_EQ(csf("compress -q --tp 2 --rank 1 " + one.string() + " " + c.string(), dir_).code, 0);
  ASSERT_EQ(csf("decompress -q " + c.string() + " " + b.string(), dir_).code, 0);
  x = csf("compress --tp 2 --rank 0 " + b.string() + " " + (dir_ / "again").string(), dir_);
  EXPECT_EQ(x.code, 1) << x.err;
  EXPECT_NE(x.err.find("already a tensor-parallel slice"), std::string::npos) << x.err;
}

TEST_F(TpCli, FolderCheckpointsAreSlicedShardByShard) {
  CSFMOE_SEEDED(seed);
  rng_.seed(seed);
  const fs::path in = dir_ / "ckpt";
  fs::create_directories(in);
  const Tensor w = random_tensor("model.layers.0.mlp.experts.0.w2.weight", st::Dtype::U8, {64, 64});
  const Tensor s = random_tensor("model.layers.0.mlp.experts.0.w2.weight_scale", st::Dtype::F8_E4M3, {64, 8});
  write(in / "model-00001-of-00001.safetensors", {w, s});
  { std::ofstream(in / "config.json") << "{\"x\": 1}\n"; }
  const fs::path c = dir_ / "c", back = dir_ / "back";
  ASSERT_EQ(csf("compress -q --tp 4 --rank 2 " + in.string() + " " + c.string(), dir_).code, 0);
  CliResult x = csf("decompress -q " + c.string() + " " + back.string(), dir_);
  ASSERT_EQ(x.code, 0) << x.err;
  EXPECT_TRUE(fs::exists(back / "config.json"));
  const auto got = read(back / "model-00001-of-00001.safetensors");
  EXPECT_EQ(got.at(w.name).bytes, rows_of(w.bytes, 64, 64, 1, 32, 48));
  EXPECT_EQ(got.at(s.name).bytes, rows_of(s.bytes, 64, 8, 1, 4, 6));
  // No hidden slice folder left beside the output.
  for (const auto& de : fs::directory_iterator(dir_))
    EXPECT_EQ(de.path().filename().string().find(".c.tp-slice"), std::string::npos) << de.path();
}

// A sliced folder: its index's total_size is the slice's; inspect, verify
// and --json name each file's slice; progress runs over the whole job (slice
// then compress) from its first byte.
TEST_F(TpCli, SlicedFoldersSayWhatTheyHoldAndCountTheirBytes) {
  CSFMOE_SEEDED(seed);
  rng_.seed(seed);
  const fs::path in = dir_ / "ckpt";
  fs::create_directories(in);
  const std::uint64_t n = 32 * (1 + rng_() % 3);  // w1 rows: halves split evenly for tp 2
  const std::vector<Tensor> a = {
      random_tensor("model.layers.0.mlp.experts.0.w2.weight", st::Dtype::U8, {64, 64}),
      random_tensor("model.layers.0.mlp.experts.0.w2.weight_scale", st::Dtype::F8_E4M3, {64, 8})};
  const std::vector<Tensor> b = {
      random_tensor("model.layers.0.mlp.experts.0.w1.weight", st::Dtype::U8, {n, 32}),
      random_tensor("model.layers.0.mlp.experts.0.w1.weight_scale", st::Dtype::F8_E4M3, {n, 4}),
      random_tensor("model.norm.weight", st::Dtype::BF16, {16})};
  const std::string sa = "model-00001-of-00002.safetensors", sb = "model-00002-of-00002.safetensors";
  write(in / sa, a);
  write(in / sb, b);
  nlohmann::json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", nlohmann::json::object()}};
  std::uint64_t source = 0;
  for (const auto& [shard, ts] : {std::pair{sa, a}, std::pair{sb, b}})
    for (const auto& t : ts) {
      index["weight_map"][t.name] = shard;
      source += t.bytes.size();
    }
  index["metadata"]["total_size"] = source;
  { std::ofstream(in / "model.safetensors.index.json") << index.dump(2); }

  // Progress through the library: one job, slice first, total fixed from the start.
  std::vector<Progress> seen;
  CompressOptions o;
  o.tp = 2;
  o.tp_rank = 1;
  o.progress = [&](const Progress& p) { seen.push_back(p); };
  const fs::path c = dir_ / "c", back = dir_ / "back";
  compress_checkpoint(in, c, o);
  ASSERT_FALSE(seen.empty());
  EXPECT_NE(seen.front().current.find("(tp slice)"), std::string::npos) << seen.front().current;
  EXPECT_EQ(seen.front().bytes_done, 0u) << "the bar starts before the first tensor is read";
  for (std::size_t i = 0; i < seen.size(); ++i) {
    EXPECT_EQ(seen[i].bytes_total, seen.front().bytes_total) << i << " " << seen[i].current;
    if (i) EXPECT_GE(seen[i].bytes_done, seen[i - 1].bytes_done) << i << " " << seen[i].current;
  }
  EXPECT_EQ(seen.back().bytes_done, seen.back().bytes_total);

  CliResult x = csf("decompress -q " + c.string() + " " + back.string(), dir_);
  ASSERT_EQ(x.code, 0) << x.err;
  std::uint64_t sliced = 0;
  for (const auto& shard : {sa, sb})
    for (const auto& [name, t] : read(back / shard)) sliced += t.bytes.size();
  EXPECT_LT(sliced, source);
  EXPECT_EQ(seen.back().bytes_total, source + sliced);
  std::ifstream idx(back / "model.safetensors.index.json");
  const auto got = nlohmann::json::parse(idx);
  EXPECT_EQ(got["metadata"]["total_size"].get<std::uint64_t>(), sliced) << got.dump();
  EXPECT_EQ(got["weight_map"], index["weight_map"]);

  // inspect (container and native slice), inspect --json, verify: each file's slice.
  for (const auto& folder : {c, back}) {
    std::string out;
    x = csf_out("inspect " + folder.string(), dir_, out);
    ASSERT_EQ(x.code, 0) << x.err;
    for (const auto& shard : {sa, sb})
      EXPECT_NE(out.find(shard + ": tensor-parallel slice: rank 1 of tp 2"), std::string::npos) << out;
    x = csf_out("inspect --json " + folder.string(), dir_, out);
    ASSERT_EQ(x.code, 0) << x.err;
    const auto j = nlohmann::json::parse(out);
    ASSERT_EQ(j["tp_slices"].size(), 2u) << j["tp_slices"].dump();
    for (const auto& s : j["tp_slices"]) {
      EXPECT_EQ(s["tp"], 2);
      EXPECT_EQ(s["rank"], 1);
    }
  }
  std::string out;
  x = csf_out("verify " + c.string(), dir_, out);
  ASSERT_EQ(x.code, 0) << x.err;
  for (const auto& shard : {sa, sb}) {
    const auto at = out.find("OK " + shard);
    ASSERT_NE(at, std::string::npos) << out;
    EXPECT_NE(out.substr(at, out.find('\n', at) - at).find("rank 1 of tp 2"), std::string::npos) << out;
  }
  // A whole (unsliced) checkpoint says nothing of slices.
  ASSERT_EQ(csf("compress -q " + in.string() + " " + (dir_ / "whole").string(), dir_).code, 0);
  x = csf_out("inspect --json " + (dir_ / "whole").string(), dir_, out);
  ASSERT_EQ(x.code, 0) << x.err;
  EXPECT_TRUE(nlohmann::json::parse(out)["tp_slices"].empty());
  x = csf_out("verify " + (dir_ / "whole").string(), dir_, out);
  EXPECT_EQ(out.find("tensor-parallel"), std::string::npos) << out;
}

}  // namespace
