// Reading what b12x and vLLM read, refusing what they refuse (issue 31):
// flat fixed planes, records that win over their slot, plane grids checked
// against their weight, files named by a checkpoint only inside its folder,
// no tensor named like the header's metadata, manifest schemas that agree
// with their planes. Fixtures are built here on fresh random grids, both
// formats, several column counts, per-expert files and folders, and go
// through verify, inspect, decompress, CheckpointFile, load_moe_layer, --tp
// and the csf tool.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "csfmoe/b12x_planes.hpp"
#include "csfmoe/checkpoint.hpp"
#include "csfmoe/checkpoint_reader.hpp"
#include "csfmoe/codec.hpp"
#include "csfmoe/errors.hpp"
#include "csfmoe/moe.hpp"
#include "csfmoe/moe_checkpoint.hpp"
#include "csfmoe/safetensors.hpp"
#include "csfmoe/synthetic.hpp"
#include "test_csf_tool.hpp"
#include "test_files.hpp"
#include "test_seed.hpp"

extern char** environ;

namespace csfmoe {
namespace {

namespace fs = std::filesystem;
using csfmoe::testing::read_bytes;
using csfmoe::testing::TempDir;
using csfmoe::testing::write_bytes;
using ToolRun = csfmoe::testing::CsfRun;
using Bytes = std::vector<std::uint8_t>;
constexpr ScaleFormat kNv = ScaleFormat::nvfp4, kMx = ScaleFormat::mxfp4;

// --- an independent b12x reader: base + code per slot, then every record's byte.
Bytes b12x_read(const PlaneShape& s, const Bytes& fixed, const std::vector<std::uint32_t>& records) {
  const std::size_t row_bytes = s.format == kNv ? s.cols / 2 : (s.cols + 7) / 8;
  const std::size_t slab = 16 * (1 + row_bytes);
  Bytes out(std::size_t{s.rows} * s.cols);
  for (std::uint32_t r = 0; r < s.rows; ++r) {
    const std::uint8_t base = fixed[(r / 16) * slab + r % 16];
    const std::uint8_t* codes = fixed.data() + (r / 16) * slab + 16 + (r % 16) * row_bytes;
    for (std::uint32_t c = 0; c < s.cols; ++c) {
      const unsigned code =
          s.format == kNv ? (codes[c / 2] >> (4 * (c % 2))) & 0xF : (codes[c / 8] >> (c % 8)) & 1;
      out[std::size_t{r} * s.cols + c] = static_cast<std::uint8_t>(base + code);
    }
  }
  for (const std::uint32_t rec : records) out[rec & 0xFFFFFF] = static_cast<std::uint8_t>(rec >> 24);
  return out;
}

unsigned code_at(const CsfPlanes& p, std::uint32_t r, std::uint32_t c) {
  const PlaneShape& s = p.shape;
  const std::size_t row_bytes = s.format == kNv ? s.cols / 2 : (s.cols + 7) / 8;
  const std::uint8_t* codes = p.fixed.data() + (r / 16) * 16 * (1 + row_bytes) + 16 + (r % 16) * row_bytes;
  return s.format == kNv ? (codes[c / 2] >> (4 * (c % 2))) & 0xF : (codes[c / 8] >> (c % 8)) & 1;
}
std::uint8_t base_at(const CsfPlanes& p, std::uint32_t r) {
  return p.fixed[(r / 16) * plane_slab_bytes(p.shape.format, p.shape.cols) + r % 16];
}

// The encoder's form: every record on a code-0 slot, holding a byte outside its row's window.
bool encoder_form(const CsfPlanes& p) {
  const unsigned w = p.shape.format == kNv ? 16 : 2;
  for (const std::uint32_t rec : p.exceptions) {
    const std::uint32_t pos = rec & 0xFFFFFF, r = pos / p.shape.cols, c = pos % p.shape.cols;
    if (code_at(p, r, c) != 0 || static_cast<std::uint8_t>((rec >> 24) - base_at(p, r)) < w) return false;
  }
  return true;
}

// Adds records that win over their slot: on random slots holding a non-zero
// code (a byte far from the window) and on random slots with a byte inside
// the window; returns how many.
int add_winning_records(CsfPlanes& p, std::mt19937_64& rng, int n) {
  const PlaneShape& s = p.shape;
  const unsigned w = s.format == kNv ? 16 : 2;
  std::map<std::uint32_t, std::uint32_t> by_pos;
  for (const std::uint32_t rec : p.exceptions) by_pos[rec & 0xFFFFFF] = rec;
  int added = 0;
  for (int i = 0; i < 50 * n && added < n; ++i) {
    const std::uint32_t pos = std::uniform_int_distribution<std::uint32_t>(0, s.rows * s.cols - 1)(rng);
    if (by_pos.count(pos)) continue;
    const std::uint32_t r = pos / s.cols, c = pos % s.cols;
    const std::uint8_t base = base_at(p, r);
    std::uint8_t v = 0;
    if (added % 2 == 0) {
      if (code_at(p, r, c) == 0) continue;
      v = static_cast<std::uint8_t>(base + w + rng() % (256 - w));  // outside the window
    } else {
      v = static_cast<std::uint8_t>(base + rng() % w);  // inside the window
    }
    by_pos[pos] = (std::uint32_t{v} << 24) | pos;
    ++added;
  }
  p.exceptions.clear();
  for (const auto& [pos, rec] : by_pos) p.exceptions.push_back(rec);
  return added;
}

// A per-expert layer written the way b12x writes it (the scales replaced by
// their planes, no csfmoe metadata), in ModelOpt naming (X.weight +
// X.weight_scale, gate/up/down_proj) or DeepSeek-V4.1 naming (S.weight +
// S.scale, w1/w3/w2). `flat` stores the fixed planes as U8 [n]; `edit`
// changes a scale's planes before they are written.
struct Layer {
  ScaleFormat format = kNv;
  std::uint32_t experts = 2, H = 512, N = 64;
  bool flat = false, deepseek = false;
  std::function<void(const std::string& scale, CsfPlanes&)> edit;
};
struct Written {
  std::map<std::string, Bytes> grids;       // scale -> what b12x's readers read
  std::map<std::string, CsfPlanes> planes;  // scale -> its planes as written
};
const std::string kLayer = "model.layers.0.mlp.experts";

Written write_layer(const fs::path& p, const Layer& l, std::mt19937_64& rng) {
  Written out;
  st::Writer w(p, 1 << 17);
  const auto projections = l.deepseek ? std::vector<std::string>{"w1", "w3", "w2"}
                                      : std::vector<std::string>{"gate_proj", "up_proj", "down_proj"};
  for (std::uint32_t e = 0; e < l.experts; ++e)
    for (const std::string& proj : projections) {
      const bool down = proj == "down_proj" || proj == "w2";
      const std::uint32_t R = down ? l.H : l.N, K = down ? l.N : l.H, C = K / group_size(l.format);
      const std::string stem = fmt::format("{}.{}.{}", kLayer, e, proj);
      Bytes weight(std::uint64_t{R} * K / 2);
      for (auto& x : weight) x = static_cast<std::uint8_t>(rng());
      w.add_tensor(stem + ".weight", st::Dtype::U8, {R, K / 2}, weight);
      auto grid = synthetic_scales(GridShape{l.format, ScaleLayout::row_major, 1, R, C},
                                   ScaleDistribution::realistic, rng());
      if (l.format == kNv)
        for (auto& b : grid) b &= 0x7F;  // positive E4M3 scales, as ModelOpt writes them
      const std::string scale = stem + (l.deepseek ? ".scale" : ".weight_scale");
      CsfPlanes planes = encode_planes(PlaneShape{l.format, R, C}, grid, scale);
      if (l.edit) l.edit(scale, planes);
      const PlaneShape& s = planes.shape;
      const std::uint64_t slab = plane_slab_bytes(s.format, s.cols);
      std::vector<std::uint64_t> fshape = {s.rows / 16, slab};
      if (l.flat) fshape = {planes.fixed.size()};
      if (!l.flat && planes.fixed.size() != fshape[0] * fshape[1])
        fshape = {planes.fixed.size() / slab, slab};
      w.add_tensor(b12x_fixed_name(scale, l.format), st::Dtype::U8, fshape, planes.fixed);
      Bytes rec(planes.exceptions.size() * 4);
      if (!rec.empty()) std::memcpy(rec.data(), planes.exceptions.data(), rec.size());
      w.add_tensor(b12x_exceptions_name(scale, l.format), st::Dtype::U32, {planes.exceptions.size()}, rec);
      if (l.format == kNv) {
        const float g2 = 1e-3f;
        Bytes b(4);
        std::memcpy(b.data(), &g2, 4);
        w.add_tensor(stem + ".weight_scale_2", st::Dtype::F32, {}, b);
      }
      out.grids[scale] = b12x_read(planes.shape, planes.fixed, planes.exceptions);
      out.planes[scale] = std::move(planes);
    }
  w.add_tensor("model.norm.weight", st::Dtype::BF16, {8}, Bytes(16, 0x3F));
  w.commit(st::Metadata{{"format", "pt"}});
  return out;
}

// Every logical tensor of a checkpoint file, as CheckpointFile reads it.
std::map<std::string, Bytes> read_all(const fs::path& p) {
  std::map<std::string, Bytes> out;
  const CheckpointFile f = CheckpointFile::open(p);
  for (const auto& t : f.header().tensors) out[t.name] = f.read(t.name);
  return out;
}

// The csf tool, stdout and stderr captured (no shell).
ToolRun csf_tool(const std::vector<std::string>& args, const fs::path& io) {
  return csfmoe::testing::run_csf_tool(args, io);
}

// Every reader refuses `in` with FormatError naming each needle, and
// decompress (library and tool) leaves no output.
void expect_refused_everywhere(const fs::path& in, const std::vector<std::string>& needles,
                               const std::string& tensor = "") {
  TempDir out;
  std::vector<std::pair<std::string, std::function<void()>>> runs = {
      {"verify", [&] { verify_checkpoint(in); }},
      {"inspect", [&] { inspect_checkpoint(in); }},
      {"decompress", [&] { decompress_checkpoint(in, out.path / "native"); }},
      {"load_moe_layer", [&] { (void)load_moe_layer(in, kLayer, 2); }},
      {"tp", [&] {
         CompressOptions o;
         o.tp = 2;
         o.tp_rank = 1;
         compress_checkpoint(in, out.path / "tp", o);
       }}};
  if (!fs::is_directory(in))
    runs.push_back({"CheckpointFile", [&] {
                      const CheckpointFile f = CheckpointFile::open(in);
                      if (!tensor.empty()) (void)f.read(tensor);
                    }});
  for (const auto& [what, run] : runs) {
    SCOPED_TRACE(what);
    try {
      run();
      ADD_FAILURE() << "accepted";
    } catch (const FormatError& e) {
      for (const auto& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not a FormatError: " << e.what();
    }
  }
  const ToolRun r = csf_tool({"decompress", in.string(), (out.path / "cli").string()}, out.path);
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_EQ(r.err.rfind("csf: error: ", 0), 0u) << r.err;
  for (const auto& n : needles) EXPECT_NE(r.err.find(n), std::string::npos) << r.err;
  EXPECT_EQ(out.entries(), (std::set<std::string>{"stderr", "stdout"})) << "no partial output";
}

struct Shape {
  ScaleFormat f;
  std::uint32_t H;
  bool deepseek;
};
// Both formats, several column counts (w13 C = H / 16 or H / 32; w2 C = N / g).
const Shape kShapes[] = {{kNv, 512, false}, {kNv, 384, false}, {kMx, 1024, false},
                         {kMx, 640, true},  {kMx, 832, false}, {kNv, 256, true}};

// --- 1. flat fixed planes ----------------------------------------------------
TEST(B12xReading, FlatFixedPlanesReadLikeTwoDimensionalOnes) {
  CSFMOE_SEEDED(seed);
  for (const Shape& sh : kShapes) {
    SCOPED_TRACE(fmt::format("{} H {}{}", to_string(sh.f), sh.H, sh.deepseek ? " deepseek" : ""));
    TempDir d;
    Layer l{sh.f, 2, sh.H, 64, false, sh.deepseek, {}};
    std::mt19937_64 a(seed), b(seed);
    const Written two = write_layer(d.path / "planes.safetensors", l, a);
    l.flat = true;
    const Written flat = write_layer(d.path / "flat.safetensors", l, b);
    const auto f = st::File::open(d.path / "flat.safetensors");
    EXPECT_EQ(f.find(b12x_fixed_name(two.grids.begin()->first, sh.f))->shape.size(), 1u);

    const CheckpointReport ver = verify_checkpoint(d.path / "flat.safetensors");
    std::size_t csf = 0;
    for (const auto& t : ver.tensors) csf += t.action == TensorAction::csf;
    EXPECT_EQ(csf, 6u);
    const auto reads = read_all(d.path / "flat.safetensors");
    EXPECT_TRUE(reads == read_all(d.path / "planes.safetensors"));
    for (const auto& [scale, grid] : flat.grids) EXPECT_TRUE(reads.at(scale) == grid) << scale;
    const CheckpointReport ins = inspect_checkpoint(d.path / "flat.safetensors");
    for (const auto& t : ins.tensors)
      if (flat.grids.count(t.name)) EXPECT_EQ(t.action, TensorAction::csf) << t.name;
    // decompress: the same native file as from 2-D planes, byte for byte.
    decompress_checkpoint(d.path / "flat.safetensors", d.path / "flat-native.safetensors");
    decompress_checkpoint(d.path / "planes.safetensors", d.path / "planes-native.safetensors");
    EXPECT_EQ(read_bytes(d.path / "flat-native.safetensors"),
              read_bytes(d.path / "planes-native.safetensors"));
    // The layer loads the same (the layer rules know ModelOpt and gpt-oss names, not S.scale).
    if (!sh.deepseek) {
      const MoeHostWeights x = load_moe_layer(d.path / "flat.safetensors", kLayer, 2);
      const MoeHostWeights y = load_moe_layer(d.path / "planes-native.safetensors", kLayer, 2);
      EXPECT_TRUE(x.w13_scales == y.w13_scales);
      EXPECT_TRUE(x.w2_scales == y.w2_scales);
    }
    // --tp: the same slice as from 2-D planes.
    CompressOptions o;
    o.tp = 2;
    o.tp_rank = 1;
    compress_checkpoint(d.path / "flat.safetensors", d.path / "flat-tp.safetensors", o);
    compress_checkpoint(d.path / "planes.safetensors", d.path / "planes-tp.safetensors", o);
    EXPECT_TRUE(read_all(d.path / "flat-tp.safetensors") == read_all(d.path / "planes-tp.safetensors"));
    // And the tool.
    const ToolRun r = csf_tool({"verify", (d.path / "flat.safetensors").string()}, d.path);
    EXPECT_EQ(r.code, 0) << r.err;
  }
}

TEST(B12xReading, FlatFixedPlanesInAFolderAndAManifestExport) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (ScaleFormat f : {kNv, kMx}) {
    SCOPED_TRACE(to_string(f));
    TempDir d;
    const fs::path root = d.path / "export";
    fs::create_directories(root / "tensors");
    const Written w = write_layer(root / "tensors" / "model-00001.safetensors",
                                  Layer{f, 3, f == kNv ? 512u : 1024u, 64, true, false, {}}, rng);
    nlohmann::json names = nlohmann::json::object();
    const auto shard_file = st::File::open(root / "tensors" / "model-00001.safetensors");
    for (const auto& t : shard_file.tensors()) {
      std::string n = t.name;
      for (const std::string sfx : {b12x_fixed_name("", f), b12x_exceptions_name("", f)})
        if (n.ends_with(sfx)) n.resize(n.size() - sfx.size());
      names[n] = "model-00001.safetensors";
    }
    const std::string schema = f == kNv ? "lil-nvfp4-csf-checkpoint/1" : "lil-mxfp4-csf-checkpoint/1";
    const std::string codec =
        f == kNv ? "byte-window4-fixed-stream-u24-exceptions/1" : "row-base-offset1-u24-exceptions/1";
    std::ofstream(root / "manifest.json")
        << nlohmann::json{{"schema", schema},
                          {"codec", codec},
                          {"shards", {{{"file", "model-00001.safetensors"}}}}}
               .dump();
    std::ofstream(root / "build-contract.json")
        << nlohmann::json{{"schema", schema}, {"codec", codec}, {"source_names", names}}.dump();
    EXPECT_NO_THROW(verify_checkpoint(root));
    const MoeHostWeights x = load_moe_layer(root, kLayer, 2);
    EXPECT_EQ(x.geometry.experts, 3u);
    decompress_checkpoint(root, d.path / "hf");
    const auto back = read_all(d.path / "hf" / "model-00001.safetensors");
    for (const auto& [scale, grid] : w.grids) EXPECT_TRUE(back.at(scale) == grid) << scale;
    // A plain folder of such files too.
    fs::create_directories(d.path / "plain");
    fs::copy_file(root / "tensors" / "model-00001.safetensors", d.path / "plain" / "a.safetensors");
    EXPECT_NO_THROW(verify_checkpoint(d.path / "plain"));
    EXPECT_NO_THROW(inspect_checkpoint(d.path / "plain"));
  }
}

TEST(B12xReading, FlatFixedPlanesOfTheWrongSizeAreRefused) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (const Shape& sh : kShapes) {
    const std::uint32_t C = sh.H / group_size(sh.f);
    const std::uint64_t slab = plane_slab_bytes(sh.f, C);
    for (const std::int64_t delta :
         {std::int64_t{-1}, std::int64_t{1}, -std::int64_t(slab), std::int64_t(slab)}) {
      SCOPED_TRACE(fmt::format("{} H {} delta {}", to_string(sh.f), sh.H, delta));
      TempDir d;
      const std::string victim =
          fmt::format("{}.1.{}", kLayer, sh.deepseek ? "w3.scale" : "up_proj.weight_scale");
      Layer l{sh.f, 2, sh.H, 64, true, sh.deepseek, [&](const std::string& scale, CsfPlanes& p) {
                if (scale != victim) return;
                if (delta < 0)
                  p.fixed.resize(p.fixed.size() - std::size_t(-delta));
                else
                  p.fixed.resize(p.fixed.size() + std::size_t(delta), 0x10);
              }};
      write_layer(d.path / "bad.safetensors", l, rng);
      expect_refused_everywhere(d.path / "bad.safetensors",
                                {(d.path / "bad.safetensors").string(), victim, "does not fit", "weight"},
                                victim);
    }
  }
  // A flat plane without its weight cannot be shaped.
  TempDir d;
  const auto grid =
      synthetic_scales(GridShape{kNv, ScaleLayout::row_major, 1, 32, 8}, ScaleDistribution::realistic, rng());
  const CsfPlanes p = encode_planes(PlaneShape{kNv, 32, 8}, grid, "x");
  {
    Bytes rec(p.exceptions.size() * 4);
    if (!rec.empty()) std::memcpy(rec.data(), p.exceptions.data(), rec.size());
    st::Writer w(d.path / "noweight.safetensors", 1 << 12);
    w.add_tensor(b12x_fixed_name("x.weight_scale", kNv), st::Dtype::U8, {p.fixed.size()}, p.fixed);
    w.add_tensor(b12x_exceptions_name("x.weight_scale", kNv), st::Dtype::U32, {p.exceptions.size()}, rec);
    w.commit(std::nullopt);
  }
  try {
    verify_checkpoint(d.path / "noweight.safetensors");
    ADD_FAILURE() << "accepted";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("x.weight_scale"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("weight"), std::string::npos) << e.what();
  }
}

// --- 2. records win ----------------------------------------------------------
TEST(B12xReading, RecordsWinOverTheirSlot) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (const Shape& sh : kShapes) {
    SCOPED_TRACE(fmt::format("{} H {}{}", to_string(sh.f), sh.H, sh.deepseek ? " deepseek" : ""));
    TempDir d;
    int added = 0;
    Layer l{sh.f, 2, sh.H, 64, false, sh.deepseek, [&](const std::string&, CsfPlanes& p) {
              added += add_winning_records(p, rng, 6);
            }};
    l.flat = sh.H == 384;  // flat planes with winning records too
    const fs::path in = d.path / "wins.safetensors";
    const Written w = write_layer(in, l, rng);
    ASSERT_GT(added, 12);
    std::size_t winners = 0;
    for (const auto& [scale, planes] : w.planes) winners += !encoder_form(planes);
    ASSERT_GT(winners, 0u) << "the fixture must hold records that win";

    EXPECT_NO_THROW(verify_checkpoint(in));
    EXPECT_NO_THROW(inspect_checkpoint(in));
    const auto reads = read_all(in);
    for (const auto& [scale, grid] : w.grids) EXPECT_TRUE(reads.at(scale) == grid) << scale;
    decompress_checkpoint(in, d.path / "native.safetensors");
    const auto native = st::File::open(d.path / "native.safetensors");
    for (const auto& [scale, grid] : w.grids) {
      const auto bytes = native.data(*native.find(scale));
      EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), grid.begin(), grid.end())) << scale;
    }
    if (!sh.deepseek) {  // the layer rules know ModelOpt and gpt-oss names, not S.scale
      const MoeHostWeights x = load_moe_layer(in, kLayer, 2);
      const MoeHostWeights y = load_moe_layer(d.path / "native.safetensors", kLayer, 2);
      EXPECT_TRUE(x.w13_scales == y.w13_scales);
      EXPECT_TRUE(x.w2_scales == y.w2_scales);
    }
    // What csfmoe writes is in the encoder's form: --schema b12x of the read grids ...
    CompressOptions b12x;
    b12x.schema = CheckpointSchema::b12x;
    compress_checkpoint(d.path / "native.safetensors", d.path / "again.safetensors", b12x);
    const auto again = st::File::open(d.path / "again.safetensors");
    for (const auto& [scale, grid] : w.grids) {
      const auto* fx = again.find(b12x_fixed_name(scale, sh.f));
      const auto* ex = again.find(b12x_exceptions_name(scale, sh.f));
      ASSERT_TRUE(fx && ex) << scale;
      CsfPlanes p;
      p.shape = w.planes.at(scale).shape;
      const auto fb = again.data(*fx), eb = again.data(*ex);
      p.fixed.assign(fb.begin(), fb.end());
      p.exceptions.resize(eb.size() / 4);
      if (!eb.empty()) std::memcpy(p.exceptions.data(), eb.data(), eb.size());
      EXPECT_TRUE(encoder_form(p)) << scale;
      EXPECT_TRUE(b12x_read(p.shape, p.fixed, p.exceptions) == grid) << scale;
    }
    // ... and a TP slice cut from the planes (vLLM's rule) decodes like the slice of the read grids.
    CompressOptions o;
    o.tp = 2;
    o.tp_rank = 0;
    compress_checkpoint(in, d.path / "tp.safetensors", o);
    compress_checkpoint(d.path / "native.safetensors", d.path / "tp-native.safetensors", o);
    EXPECT_TRUE(read_all(d.path / "tp.safetensors") == read_all(d.path / "tp-native.safetensors"));
    EXPECT_NO_THROW(verify_checkpoint(d.path / "tp.safetensors"));
    const ToolRun r = csf_tool({"verify", in.string()}, d.path);
    EXPECT_EQ(r.code, 0) << r.err;
  }
}

// Stacked experts: planes of several experts with winning records convert to
// a resident form that csfmoe's own validate accepts and that decodes to
// what b12x reads, for several C.
TEST(B12xReading, RecordsWinInStackedPlanes) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (ScaleFormat f : {kNv, kMx})
    for (const std::uint32_t C : {2u, 8u, 18u, 36u}) {
      if (f == kNv && C % 2) continue;
      SCOPED_TRACE(fmt::format("{} C {}", to_string(f), C));
      const PlaneShape s{f, 48, C};
      std::vector<CsfPlanes> experts;
      Bytes want;
      for (int e = 0; e < 4; ++e) {
        const auto grid =
            synthetic_scales(GridShape{f, ScaleLayout::row_major, 1, s.rows, C},
                             e % 2 ? ScaleDistribution::extremes : ScaleDistribution::realistic, rng());
        CsfPlanes p = encode_planes(s, grid, "t");
        add_winning_records(p, rng, 5);
        const Bytes g = b12x_read(s, p.fixed, p.exceptions);
        want.insert(want.end(), g.begin(), g.end());
        experts.push_back(std::move(p));
      }
      const CsfTensor t = planes_to_csf(experts, "t");
      EXPECT_NO_THROW(validate(t));
      Bytes got(want.size());
      decode(t, ScaleLayout::row_major, got);
      EXPECT_TRUE(got == want);
      for (const CsfPlanes& back : csf_to_planes(t, "t")) EXPECT_TRUE(encoder_form(back));
    }
}

// --- 3. plane grid against the weight ---------------------------------------
TEST(B12xReading, PlaneGridThatContradictsItsWeightIsRefused) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  struct Case {
    const char* what;
    std::int32_t extra_rows, extra_cols;
  };
  for (const Shape& sh : kShapes)
    for (const Case c : {Case{"one slab too many", 16, 0}, Case{"one slab too few", -16, 0},
                         Case{"columns too many", 0, sh.f == kNv ? 2 : 8},
                         Case{"columns too few", 0, sh.f == kNv ? -2 : -8}}) {
      SCOPED_TRACE(fmt::format("{} H {}: {}", to_string(sh.f), sh.H, c.what));
      TempDir d;
      // Rows: down (weight [H, N / 2]); columns: gate (weight [N, H / 2]).
      const bool cols = c.extra_cols != 0;
      const std::string proj = cols ? (sh.deepseek ? "w1" : "gate_proj") : (sh.deepseek ? "w2" : "down_proj");
      const std::string victim =
          fmt::format("{}.0.{}.{}", kLayer, proj, sh.deepseek ? "scale" : "weight_scale");
      Layer l{sh.f, 2, sh.H, 64, false, sh.deepseek, [&](const std::string& scale, CsfPlanes& p) {
                if (scale != victim) return;
                // Consistent planes of another grid: only the weight can tell.
                const PlaneShape s{p.shape.format, p.shape.rows + c.extra_rows, p.shape.cols + c.extra_cols};
                p = encode_planes(
                    s,
                    synthetic_scales(GridShape{s.format, ScaleLayout::row_major, 1, s.rows, s.cols},
                                     ScaleDistribution::realistic, rng()),
                    scale);
              }};
      const fs::path p = d.path / "bad.safetensors";
      write_layer(p, l, rng);
      const std::string weight = victim.substr(0, victim.rfind('.')) + ".weight";
      const std::string shape = cols ? fmt::format("[64, {}]", sh.H / 2) : fmt::format("[{}, 32]", sh.H);
      expect_refused_everywhere(p, {p.string(), victim, weight, shape}, victim);
    }
}

// --- 8. nothing outside the folder ------------------------------------------
std::pair<std::string, std::string> export_names(ScaleFormat f) {
  return f == kNv ? std::pair<std::string, std::string>{"lil-nvfp4-csf-checkpoint/1",
                                                        "byte-window4-fixed-stream-u24-exceptions/1"}
                  : std::pair<std::string, std::string>{"lil-mxfp4-csf-checkpoint/1",
                                                        "row-base-offset1-u24-exceptions/1"};
}

// A manifest export of one layer: root/{manifest.json, build-contract.json, tensors/, metadata/}.
// `plane_names`: source_names lists the stored plane names (as b12x's test
// helpers write them), not the scale names.
void make_export(const fs::path& root, ScaleFormat f, std::mt19937_64& rng,
                 const std::string& schema_format = "", int shards = 1, bool plane_names = false) {
  fs::create_directories(root / "tensors");
  fs::create_directories(root / "metadata");
  std::ofstream(root / "metadata" / "config.json") << R"({"model_type": "test"})";
  nlohmann::json names = nlohmann::json::object(), list = nlohmann::json::array();
  for (int i = 0; i < shards; ++i) {
    const std::string shard = fmt::format("model-{:05}.safetensors", i + 1);
    write_layer(root / "tensors" / shard, Layer{f, 2, f == kNv ? 512u : 1024u, 64, false, false, {}}, rng);
    const auto shard_file = st::File::open(root / "tensors" / shard);
    for (const auto& t : shard_file.tensors()) {
      std::string n = t.name;
      for (const std::string sfx : {b12x_fixed_name("", f), b12x_exceptions_name("", f)})
        if (n.ends_with(sfx) && !plane_names) n.resize(n.size() - sfx.size());
      // Every shard named by some source tensor: a second copy of the layer keeps the norm.
      if (!names.contains(n) || n == "model.norm.weight") names[n] = shard;
    }
    list.push_back({{"file", shard}});
  }
  const auto [schema, codec] = export_names(schema_format == "mxfp4"   ? kMx
                                            : schema_format == "nvfp4" ? kNv
                                                                       : f);
  std::ofstream(root / "manifest.json")
      << nlohmann::json{{"schema", schema}, {"codec", codec}, {"shards", list}}.dump();
  std::ofstream(root / "build-contract.json")
      << nlohmann::json{{"schema", schema}, {"codec", codec}, {"source_names", names}}.dump();
}

// The reader entry points that open a folder's named files.
void expect_folder_refused(const fs::path& root, const std::vector<std::string>& needles,
                           const std::vector<std::string>& never) {
  TempDir out;
  const std::vector<std::pair<std::string, std::function<void()>>> runs = {
      {"verify", [&] { verify_checkpoint(root); }},
      {"inspect", [&] { inspect_checkpoint(root); }},
      {"decompress", [&] { decompress_checkpoint(root, out.path / "hf"); }},
      {"checkpoint_files", [&] { (void)checkpoint_files(root); }},
      {"load_moe_layer", [&] { (void)load_moe_layer(root, kLayer, 2); }}};
  for (const auto& [what, run] : runs) {
    SCOPED_TRACE(what);
    try {
      run();
      ADD_FAILURE() << "accepted";
    } catch (const FormatError& e) {
      const std::string m = e.what();
      for (const auto& n : needles) EXPECT_NE(m.find(n), std::string::npos) << m;
      for (const auto& n : never) EXPECT_EQ(m.find(n), std::string::npos) << "echoes a refused file: " << m;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not a FormatError: " << e.what();
    }
  }
  const ToolRun r = csf_tool({"verify", root.string()}, out.path);
  EXPECT_EQ(r.code, 1) << r.err;
  for (const auto& n : never) EXPECT_EQ(r.err.find(n), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(out.path / "hf"));
}

TEST(B12xReading, ExportFilesThatLeaveTheFolderAreRefused) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (ScaleFormat f : {kNv, kMx}) {
    SCOPED_TRACE(to_string(f));
    TempDir d;
    const fs::path root = d.path / "export", outside = d.path / "outside";
    make_export(root, f, rng);
    EXPECT_NO_THROW(verify_checkpoint(root));
    fs::create_directories(outside);
    // A secret outside the folder, that happens to be JSON-like and not valid.
    const std::string secret = R"({"SECRET-TOKEN-4f1c": oops})";
    for (const char* name : {"manifest.json", "build-contract.json"}) {
      SCOPED_TRACE(name);
      fs::rename(root / name, outside / name);
      write_bytes(outside / "secret.json", secret);
      fs::create_symlink(outside / "secret.json", root / name);
      expect_folder_refused(root, {name, "leaves the folder"}, {"SECRET"});
      // A link to a valid copy outside is refused too.
      fs::remove(root / name);
      fs::create_symlink(outside / name, root / name);
      expect_folder_refused(root, {name, "leaves the folder"}, {"SECRET"});
      fs::remove(root / name);
      fs::rename(outside / name, root / name);
    }
    // tensors/ as a link to a folder outside holding the same shards.
    fs::rename(root / "tensors", outside / "tensors");
    fs::create_directory_symlink(outside / "tensors", root / "tensors");
    expect_folder_refused(root, {"model-00001.safetensors", "leaves the folder"}, {});
    fs::remove(root / "tensors");
    fs::rename(outside / "tensors", root / "tensors");
    // metadata/ as a link out: decompress would copy files from elsewhere.
    fs::rename(root / "metadata", outside / "metadata");
    fs::create_directory_symlink(outside / "metadata", root / "metadata");
    try {
      decompress_checkpoint(root, d.path / "hf");
      ADD_FAILURE() << "metadata/ outside the folder accepted";
    } catch (const FormatError& e) {
      EXPECT_NE(std::string(e.what()).find("metadata"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(fs::exists(d.path / "hf"));
    fs::remove(root / "metadata");
    fs::rename(outside / "metadata", root / "metadata");
    EXPECT_NO_THROW(verify_checkpoint(root));
  }
}

TEST(B12xReading, JsonErrorsGiveAnOffsetNeverTheBytes) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir d;
  const fs::path root = d.path / "export";
  make_export(root, kNv, rng);
  write_bytes(root / "manifest.json", R"({"schema": SECRET-TOKEN-77})");
  expect_folder_refused(root, {"manifest.json", "not valid JSON", "byte"}, {"SECRET"});
  // The same for a shard index and a safetensors header.
  const fs::path hf = d.path / "hf";
  fs::create_directories(hf);
  write_layer(hf / "a.safetensors", Layer{}, rng);
  write_bytes(hf / "model.safetensors.index.json", R"({"weight_map": {"x": SECRET-TOKEN-78}})");
  for (const auto& run : std::vector<std::function<void()>>{[&] { verify_checkpoint(hf); },
                                                            [&] { (void)checkpoint_files(hf); }}) {
    try {
      run();
      ADD_FAILURE() << "accepted";
    } catch (const FormatError& e) {
      EXPECT_EQ(std::string(e.what()).find("SECRET"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("byte"), std::string::npos) << e.what();
    }
  }
  std::string header = R"({"t": SECRET-TOKEN-79})";
  std::string file(8, '\0');
  const std::uint64_t n = header.size();
  std::memcpy(file.data(), &n, 8);
  write_bytes(d.path / "bad.safetensors", file + header);
  try {
    verify_checkpoint(d.path / "bad.safetensors");
    ADD_FAILURE() << "accepted";
  } catch (const FormatError& e) {
    EXPECT_EQ(std::string(e.what()).find("SECRET"), std::string::npos) << e.what();
  }
}

// --- 9. names that collide with the format ----------------------------------
TEST(B12xReading, PlanesOfATensorNamedMetadataAreRefused) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (ScaleFormat f : {kNv, kMx}) {
    SCOPED_TRACE(to_string(f));
    TempDir d;
    const std::uint32_t R = 32, C = 16;
    const auto grid =
        synthetic_scales(GridShape{f, ScaleLayout::row_major, 1, R, C}, ScaleDistribution::realistic, rng());
    const CsfPlanes p = encode_planes(PlaneShape{f, R, C}, grid, "x");
    Bytes rec(p.exceptions.size() * 4);
    if (!rec.empty()) std::memcpy(rec.data(), p.exceptions.data(), rec.size());
    const fs::path in = d.path / "meta.safetensors";
    {
      st::Writer w(in, 1 << 12);
      w.add_tensor("__metadata__.weight", st::Dtype::U8, {R, C * group_size(f) / 2},
                   Bytes(std::size_t{R} * C * group_size(f) / 2, 0x11));
      w.add_tensor(b12x_fixed_name("__metadata__", f), st::Dtype::U8, {R / 16, plane_slab_bytes(f, C)},
                   p.fixed);
      w.add_tensor(b12x_exceptions_name("__metadata__", f), st::Dtype::U32, {p.exceptions.size()}, rec);
      w.commit(std::nullopt);
    }
    expect_refused_everywhere(in, {in.string(), "'__metadata__", "metadata"});
    EXPECT_THROW((void)CheckpointFile::open(in), FormatError);
  }
  // The writer never makes such a file, and leaves nothing.
  TempDir d;
  try {
    st::Writer w(d.path / "out.safetensors", 1 << 12);
    w.add_tensor("__metadata__", st::Dtype::U8, {4}, Bytes(4, 1));
    w.commit(std::nullopt);
    ADD_FAILURE() << "written";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("'__metadata__'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("out.safetensors"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(d.entries().empty());
}

// --- 5. index shards in a sub-folder -----------------------------------------
// Every tensor of the folder's shards -> its shard path, as an HF index.
void write_index(const fs::path& root, const std::vector<std::string>& shards) {
  nlohmann::json wm = nlohmann::json::object();
  for (const auto& s : shards) {
    const auto f = st::File::open(root / s);
    for (const auto& t : f.tensors()) wm[t.name] = s;
  }
  std::ofstream(root / "model.safetensors.index.json") << nlohmann::json{{"weight_map", wm}}.dump(2);
}

TEST(B12xReading, IndexShardsInASubFolder) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (ScaleFormat f : {kNv, kMx}) {
    SCOPED_TRACE(to_string(f));
    TempDir d;
    const fs::path b12x = d.path / "b12x";
    fs::create_directories(b12x / "tensors");
    const std::vector<std::string> shards = {"tensors/model-00001-of-00002.safetensors",
                                             "tensors/model-00002-of-00002.safetensors"};
    const Written w =
        write_layer(b12x / shards[0], Layer{f, 2, f == kNv ? 384u : 640u, 64, false, false, {}}, rng);
    {
      st::Writer x(b12x / shards[1], 1 << 12);
      x.add_tensor("lm_head.weight", st::Dtype::BF16, {16}, Bytes(32, 0x3C));
      x.commit(std::nullopt);
    }
    write_index(b12x, shards);
    std::ofstream(b12x / "tensors" / "NOTES.txt") << "kept";
    std::ofstream(b12x / "config.json") << "{}";

    // Files written by b12x / vLLM with the index listing tensors/...: read, verified, decompressed.
    EXPECT_EQ(checkpoint_files(b12x).size(), 2u);
    EXPECT_NO_THROW(verify_checkpoint(b12x));
    EXPECT_NO_THROW(inspect_checkpoint(b12x));
    const MoeHostWeights a = load_moe_layer(b12x, kLayer, 2);
    decompress_checkpoint(b12x, d.path / "native");
    const fs::path native = d.path / "native";
    EXPECT_EQ(read_bytes(native / "tensors" / "NOTES.txt"), "kept");
    const auto idx = nlohmann::json::parse(read_bytes(native / "model.safetensors.index.json"));
    for (const auto& [scale, grid] : w.grids) {
      EXPECT_EQ(idx["weight_map"][scale], shards[0]) << scale;
      EXPECT_TRUE(read_all(native / shards[0]).at(scale) == grid) << scale;
    }
    // The native folder: compressed shard by shard into tensors/, restored byte for byte.
    decompress_checkpoint(b12x, d.path / "native2");
    compress_checkpoint(native, d.path / "csf");
    EXPECT_TRUE(fs::exists(d.path / "csf" / shards[0]));
    EXPECT_TRUE(is_csf_container(d.path / "csf" / shards[0]));
    EXPECT_EQ(read_bytes(d.path / "csf" / "tensors" / "NOTES.txt"), "kept");
    EXPECT_NO_THROW(verify_checkpoint(d.path / "csf"));
    const MoeHostWeights b = load_moe_layer(d.path / "csf", kLayer, 2);
    EXPECT_TRUE(a.w13_scales == b.w13_scales);
    EXPECT_TRUE(a.w2_scales == b.w2_scales);
    decompress_checkpoint(d.path / "csf", d.path / "back");
    for (const std::string n : {shards[0], shards[1], std::string("model.safetensors.index.json"),
                                std::string("tensors/NOTES.txt"), std::string("config.json")})
      EXPECT_EQ(read_bytes(d.path / "back" / n), read_bytes(native / n)) << n;
    // --tp of the b12x folder and of the native one: the same slices.
    CompressOptions o;
    o.tp = 2;
    o.tp_rank = 1;
    compress_checkpoint(b12x, d.path / "tp-b12x", o);
    compress_checkpoint(native, d.path / "tp-native", o);
    for (const auto& s : shards)
      EXPECT_TRUE(read_all(d.path / "tp-b12x" / s) == read_all(d.path / "tp-native" / s)) << s;
    EXPECT_NO_THROW(verify_checkpoint(d.path / "tp-b12x"));
    const ToolRun r = csf_tool({"verify", b12x.string()}, d.path);
    EXPECT_EQ(r.code, 0) << r.err;

    // Still nothing outside the folder: a path out, or a sub-folder that links out.
    const auto refused = [&](const std::string& needle) {
      for (const auto& run : std::vector<std::function<void()>>{
               [&] { verify_checkpoint(native); }, [&] { (void)checkpoint_files(native); },
               [&] { compress_checkpoint(native, d.path / "never"); }}) {
        try {
          run();
          ADD_FAILURE() << "accepted: " << needle;
        } catch (const FormatError& e) {
          EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
        }
      }
      EXPECT_FALSE(fs::exists(d.path / "never"));
    };
    const std::string index = read_bytes(native / "model.safetensors.index.json");
    std::string evil = index;
    evil.replace(evil.find(shards[1]), shards[1].size(), "tensors/../../outside.safetensors");
    fs::copy_file(native / shards[1], d.path / "outside.safetensors");
    write_bytes(native / "model.safetensors.index.json", evil);
    refused("not a plain file name");
    write_bytes(native / "model.safetensors.index.json", index);
    fs::rename(native / "tensors", d.path / "elsewhere");
    fs::create_directory_symlink(d.path / "elsewhere", native / "tensors");
    refused("leaves the folder");
    fs::remove(d.path / "outside.safetensors");
  }
}

// --- 6. source names that list the planes -----------------------------------
TEST(B12xReading, ManifestSourceNamesOfPlanesGiveScaleNamesInTheIndex) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (ScaleFormat f : {kNv, kMx}) {
    SCOPED_TRACE(to_string(f));
    TempDir d;
    const fs::path root = d.path / "export";
    make_export(root, f, rng, "", 1, /*plane_names=*/true);
    const auto contract = nlohmann::json::parse(read_bytes(root / "build-contract.json"));
    ASSERT_TRUE(contract["source_names"].contains(b12x_fixed_name(kLayer + ".0.up_proj.weight_scale", f)));
    EXPECT_NO_THROW(verify_checkpoint(root));
    decompress_checkpoint(root, d.path / "hf");
    const auto index = nlohmann::json::parse(read_bytes(d.path / "hf" / "model.safetensors.index.json"));
    const auto shard = st::File::open(d.path / "hf" / "model-00001.safetensors");
    std::size_t scales = 0;
    for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
      EXPECT_EQ(it.key().find("_csf_"), std::string::npos) << "a plane name in the index: " << it.key();
      EXPECT_NE(shard.find(it.key()), nullptr) << it.key() << " is not in its shard";
      scales += it.key().ends_with(".weight_scale");
    }
    EXPECT_EQ(scales, 6u);
    EXPECT_EQ(index["weight_map"].size(), shard.tensors().size());
    const MoeHostWeights a = load_moe_layer(root, kLayer, 2), b = load_moe_layer(d.path / "hf", kLayer, 2);
    EXPECT_TRUE(a.w13_scales == b.w13_scales);
    EXPECT_TRUE(a.w2_scales == b.w2_scales);
  }
}

// --- 4. DeepSeek-V4.1 names ---------------------------------------------------
// A native DeepSeek-V4.1 layer: S.weight U8 [R, K / 2] + S.scale F8_E8M0 [R, K / 32], w1 / w3 / w2.
std::map<std::string, Bytes> write_deepseek(const fs::path& p, std::mt19937_64& rng, std::uint32_t H) {
  std::map<std::string, Bytes> scales;
  const std::uint32_t N = 64;
  st::Writer w(p, 1 << 16);
  for (std::uint32_t e = 0; e < 2; ++e)
    for (const char* proj : {"w1", "w3", "w2"}) {
      const bool down = std::string(proj) == "w2";
      const std::uint32_t R = down ? H : N, K = down ? N : H, C = K / 32;
      const std::string stem = fmt::format("{}.{}.{}", kLayer, e, proj);
      Bytes weight(std::uint64_t{R} * K / 2);
      for (auto& x : weight) x = static_cast<std::uint8_t>(rng());
      w.add_tensor(stem + ".weight", st::Dtype::U8, {R, K / 2}, weight);
      const Bytes grid = synthetic_scales(GridShape{kMx, ScaleLayout::row_major, 1, R, C},
                                          ScaleDistribution::realistic, rng());
      w.add_tensor(stem + ".scale", st::Dtype::F8_E8M0, {R, C}, grid);
      scales[stem + ".scale"] = grid;
    }
  w.add_tensor("embed.weight", st::Dtype::BF16, {8}, Bytes(16, 0x3F));
  w.commit(st::Metadata{{"format", "pt"}});
  return scales;
}

TEST(B12xReading, DeepSeekNamesCompressSliceAndRestoreTheirScaleDtype) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (const std::uint32_t H : {1024u, 640u}) {
    SCOPED_TRACE(fmt::format("H {}", H));
    TempDir d;
    const fs::path src = d.path / "ds.safetensors";
    const auto scales = write_deepseek(src, rng, H);
    // --schema b12x finds S.scale as an MXFP4 block scale and stores its planes.
    CompressOptions b12x;
    b12x.schema = CheckpointSchema::b12x;
    compress_checkpoint(src, d.path / "b12x.safetensors", b12x);
    const auto out = st::File::open(d.path / "b12x.safetensors");
    for (const auto& [name, grid] : scales) {
      EXPECT_NE(out.find(b12x_fixed_name(name, kMx)), nullptr) << name;
      EXPECT_EQ(out.find(name), nullptr) << name;
    }
    decompress_checkpoint(d.path / "b12x.safetensors", d.path / "back.safetensors");
    EXPECT_EQ(read_bytes(d.path / "back.safetensors"), read_bytes(src));
    // The same planes without csfmoe's metadata (as b12x writes them): the
    // restored scales keep DeepSeek's F8_E8M0.
    {
      st::Writer w(d.path / "foreign.safetensors", 1 << 16);
      for (const auto& t : out.tensors()) w.add_tensor(t.name, t.dtype, t.shape, out.data(t));
      w.commit(std::nullopt);
    }
    EXPECT_NO_THROW(verify_checkpoint(d.path / "foreign.safetensors"));
    decompress_checkpoint(d.path / "foreign.safetensors", d.path / "native.safetensors");
    const auto native = st::File::open(d.path / "native.safetensors");
    for (const auto& [name, grid] : scales) {
      const auto* t = native.find(name);
      ASSERT_NE(t, nullptr) << name;
      EXPECT_EQ(t->dtype, st::Dtype::F8_E8M0) << name;
      const auto bytes = native.data(*t);
      EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), grid.begin(), grid.end())) << name;
    }
    // --tp knows w1 / w3 (rows) and w2 (columns), of the native file and of its planes.
    for (const fs::path& in : {src, d.path / "foreign.safetensors"}) {
      SCOPED_TRACE(in.filename().string());
      CompressOptions o;
      o.tp = 2;
      o.tp_rank = 1;
      const fs::path tp = d.path / ("tp-" + in.filename().string());
      compress_checkpoint(in, tp, o);
      const CheckpointFile f = CheckpointFile::open(tp);
      for (const auto& [name, grid] : scales) {
        const bool down = name.find(".w2.") != std::string::npos;
        const std::uint32_t R = down ? H : 64, C = (down ? 64 : H) / 32;
        Bytes want;
        for (std::uint32_t r = 0; r < R; ++r)
          for (std::uint32_t c = 0; c < C; ++c)
            if (down ? c >= C / 2 : r >= R / 2) want.push_back(grid[std::size_t{r} * C + c]);
        EXPECT_TRUE(f.read(name) == want) << name;
      }
    }
  }
}

TEST(B12xReading, CompressSaysSoWhenItFindsNoBlockScale) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir d;
  {
    st::Writer w(d.path / "plain.safetensors", 1 << 12);
    Bytes b(64);
    for (auto& x : b) x = static_cast<std::uint8_t>(rng());
    w.add_tensor("model.layers.0.mlp.down.weight", st::Dtype::BF16, {32}, b);
    w.commit(std::nullopt);
  }
  fs::create_directories(d.path / "io");
  const ToolRun r =
      csf_tool({"compress", (d.path / "plain.safetensors").string(), (d.path / "out.safetensors").string()},
               d.path / "io");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("no block-scale tensor found"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("plain.safetensors"), std::string::npos) << r.err;
  write_deepseek(d.path / "ds.safetensors", rng, 1024);
  const ToolRun ok = csf_tool({"compress", "--schema", "b12x", (d.path / "ds.safetensors").string(),
                               (d.path / "ds-b12x.safetensors").string()},
                              d.path / "io");
  EXPECT_EQ(ok.code, 0) << ok.err;
  EXPECT_EQ(ok.err.find("no block-scale"), std::string::npos) << ok.err;
}

// --- 7. vLLM's padded TP shards: refused, naming vLLM's rule ------------------
TEST(B12xReading, UnevenTensorParallelSplitsAreRefusedNamingVllmsRule) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (ScaleFormat f : {kNv, kMx}) {
    SCOPED_TRACE(to_string(f));
    TempDir d;
    const fs::path b12x = d.path / "b12x.safetensors", native = d.path / "native.safetensors";
    write_layer(b12x, Layer{f, 2, f == kNv ? 512u : 1024u, 64, false, false, {}}, rng);
    decompress_checkpoint(b12x, native);
    for (const fs::path& in : {b12x, native})
      for (const unsigned tp : {3u, 6u}) {
        SCOPED_TRACE(fmt::format("{} tp {}", in.filename().string(), tp));
        CompressOptions o;
        o.tp = tp;
        o.tp_rank = tp - 1;
        try {
          compress_checkpoint(in, d.path / "out.safetensors", o);
          ADD_FAILURE() << "an uneven split was written";
        } catch (const InvalidArgument& e) {
          const std::string m = e.what();
          EXPECT_NE(m.find(in.string()), std::string::npos) << m;
          EXPECT_NE(m.find("vLLM"), std::string::npos) << m;
          EXPECT_NE(m.find("0x38"), std::string::npos) << m;
        }
        EXPECT_FALSE(fs::exists(d.path / "out.safetensors"));
        const ToolRun r = csf_tool({"compress", "--tp", std::to_string(tp), "--rank", "0", in.string(),
                                    (d.path / "cli.safetensors").string()},
                                   d.path);
        EXPECT_EQ(r.code, 1) << r.err;
        EXPECT_NE(r.err.find("vLLM"), std::string::npos) << r.err;
        EXPECT_FALSE(fs::exists(d.path / "cli.safetensors"));
      }
  }
}

// --- 10. schema against planes, tensors in two shards ------------------------
TEST(B12xReading, ManifestSchemaMustMatchItsPlanes) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (ScaleFormat f : {kNv, kMx}) {
    SCOPED_TRACE(to_string(f));
    TempDir d;
    const fs::path root = d.path / "export";
    make_export(root, f, rng, f == kNv ? "mxfp4" : "nvfp4");
    const std::string planes = f == kNv ? "nvfp4" : "mxfp4", schema = f == kNv ? "lil-mxfp4" : "lil-nvfp4";
    expect_folder_refused(root, {"model-00001.safetensors", planes, schema}, {});
  }
}

TEST(B12xReading, ATensorInTwoExportShardsIsRefused) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (ScaleFormat f : {kNv, kMx}) {
    SCOPED_TRACE(to_string(f));
    TempDir d;
    const fs::path root = d.path / "export";
    make_export(root, f, rng, "", 2);  // both shards hold the same layer's tensors
    expect_folder_refused(root, {"model-00002.safetensors", "also in", "model-00001.safetensors"}, {});
    const ToolRun r = csf_tool({"inspect", root.string()}, d.path);
    EXPECT_EQ(r.code, 1) << r.out << r.err;
    EXPECT_NE(r.err.find("also in"), std::string::npos) << r.err;
  }
}

}  // namespace
}  // namespace csfmoe
