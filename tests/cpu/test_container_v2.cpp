// Container version 2 (docs/container-format.md): CSF tensors whose grid
// allows it are stored as b12x's canonical planes (per expert: 16-row slabs
// of bases and codes, the exception records, a record count), restore byte
// for byte and load into the same resident form as version 1; version 1
// files (tests/data/container-v1, written by the version 1 tool) still
// verify, restore and load.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

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

#include "checkpoint/container.hpp"
#include "csfmoe/b12x_planes.hpp"
#include "csfmoe/checkpoint.hpp"
#include "csfmoe/checkpoint_reader.hpp"
#include "csfmoe/codec.hpp"
#include "csfmoe/detail/csf_layout.hpp"
#include "csfmoe/errors.hpp"
#include "csfmoe/moe.hpp"
#include "csfmoe/moe_checkpoint.hpp"
#include "csfmoe/safetensors.hpp"
#include "csfmoe/synthetic.hpp"
#include "test_files.hpp"
#include "test_seed.hpp"

namespace csfmoe {
namespace {

namespace fs = std::filesystem;
using csfmoe::testing::read_bytes;
using csfmoe::testing::TempDir;

const fs::path kV1 = fs::path(CSFMOE_SOURCE_DIR) / "tests" / "data" / "container-v1";

int descriptor_version(const fs::path& p) {
  const auto f = st::File::open(p);
  const auto& md = *f.header().metadata;
  const auto desc = nlohmann::json::parse(md.at(detail::kContainerKey));
  return desc.at("version").get<int>();
}

TEST(ContainerV1, FilesOfTheFirstVersionStillVerifyRestoreAndLoad) {
  for (const char* fmt : {"nvfp4", "mxfp4"}) {
    SCOPED_TRACE(fmt);
    const fs::path native = kV1 / (std::string(fmt) + ".safetensors");
    const fs::path v1 = kV1 / (std::string(fmt) + ".csf-v1.safetensors");
    ASSERT_TRUE(fs::exists(v1)) << v1;
    EXPECT_EQ(descriptor_version(v1), 1);
    const CheckpointReport ver = verify_checkpoint(v1);
    std::size_t csf = 0;
    for (const auto& t : ver.tensors) csf += t.action == TensorAction::csf;
    EXPECT_GT(csf, 0u) << "the fixture holds no CSF tensor";
    // Version 1 stores the resident parts.
    const auto f = st::File::open(v1);
    const auto info = detail::get_container_metadata(f.header().metadata, v1.string());
    ASSERT_TRUE(info.has_value());
    for (const auto& e : info->csf) {
      EXPECT_EQ(e.storage, detail::CsfStorage::resident) << e.name;
      EXPECT_NE(f.find(detail::part_names(e.name).row_prefix), nullptr) << e.name;
    }
    TempDir d;
    decompress_checkpoint(v1, d.path / "back.safetensors");
    EXPECT_TRUE(read_bytes(d.path / "back.safetensors") == read_bytes(native));
    // Recompressed today: version 2 with planes (3 where MXFP4 slabs are
    // smaller), fewer bytes, the same original.
    const CheckpointReport rep = compress_checkpoint(native, d.path / "v2.safetensors");
    EXPECT_EQ(descriptor_version(d.path / "v2.safetensors"), std::string(fmt) == "mxfp4" ? 3 : 2);
    EXPECT_LT(rep.scale_stored_bytes, ver.scale_stored_bytes);
    decompress_checkpoint(d.path / "v2.safetensors", d.path / "back2.safetensors");
    EXPECT_TRUE(read_bytes(d.path / "back2.safetensors") == read_bytes(native));
  }
  // inspect reads version 1 parts: the same CSF tensors, their stored bytes the parts' bytes.
  const CheckpointReport ins = inspect_checkpoint(kV1 / "nvfp4.csf-v1.safetensors");
  const auto f = st::File::open(kV1 / "nvfp4.csf-v1.safetensors");
  std::size_t csf = 0;
  for (const auto& t : ins.tensors) {
    if (t.action != TensorAction::csf) continue;
    ++csf;
    std::uint64_t parts = 0;
    for (const auto& n : detail::stored_part_names(t.name, detail::CsfStorage::resident, ScaleFormat::nvfp4))
      parts += f.find(n)->nbytes();
    EXPECT_EQ(t.stats.encoded_bytes, parts) << t.name;
    EXPECT_EQ(t.resident_bytes, parts) << t.name;
  }
  EXPECT_EQ(csf, 4u);
}

// What a planes tensor stores: per expert R * (1 + C/2) bytes (NVFP4) or
// R * (1 + ceil(C/8)) (MXFP4), 4 bytes per exception and 4 per expert: b12x's
// accounting plus the count; never the row prefix or row padding.
TEST(ContainerV2, PlanesStoreBasesCodesAndRecordsOnly) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (int round = 0; round < 6; ++round) {
    const ScaleFormat f = round % 2 ? ScaleFormat::mxfp4 : ScaleFormat::nvfp4;
    const std::uint32_t E = 1 + rng() % 4, R = 16 * (1 + rng() % 24);
    const std::uint32_t C = f == ScaleFormat::nvfp4 ? 2 * (8 + rng() % 40) : 4 + rng() % 60;
    SCOPED_TRACE(::testing::Message() << to_string(f) << " E=" << E << " R=" << R << " C=" << C);
    const GridShape g{f, ScaleLayout::row_major, E, R, C};
    const auto scales = synthetic_scales(g, ScaleDistribution::realistic, rng());
    // A weight of K = C * group columns makes the grid a detectable block scale.
    const std::uint64_t K = std::uint64_t{C} * group_size(f);
    TempDir d;
    {
      st::Writer w(d.path / "m.safetensors", 1 << 16);
      std::vector<std::uint8_t> weight(std::uint64_t{E} * R * K / 2);
      for (auto& x : weight) x = static_cast<std::uint8_t>(rng());
      if (f == ScaleFormat::nvfp4) {
        w.add_tensor("model.layers.0.mlp.experts.w13.weight", st::Dtype::U8, {E, R, K / 2}, weight);
        w.add_tensor("model.layers.0.mlp.experts.w13.weight_scale", st::Dtype::F8_E4M3, {E, R, C}, scales);
      } else {
        w.add_tensor("model.layers.0.mlp.experts.gate_up_proj_blocks", st::Dtype::U8, {E, R, C, 16}, weight);
        w.add_tensor("model.layers.0.mlp.experts.gate_up_proj_scales", st::Dtype::U8, {E, R, C}, scales);
      }
      w.commit(std::nullopt);
    }
    CompressOptions o;
    o.keep_unprofitable = false;
    o.mxfp4_slab = false;  // the MXFP4 slab form: test_mxfp4_slab_planes
    const CheckpointReport rep = compress_checkpoint(d.path / "m.safetensors", d.path / "c.safetensors", o);
    const std::string name = f == ScaleFormat::nvfp4 ? "model.layers.0.mlp.experts.w13.weight_scale"
                                                     : "model.layers.0.mlp.experts.gate_up_proj_scales";
    const TensorReport* t = nullptr;
    for (const auto& x : rep.tensors)
      if (x.name == name) t = &x;
    ASSERT_NE(t, nullptr);
    ASSERT_EQ(t->action, TensorAction::csf);
    EXPECT_EQ(t->storage, "planes");
    const std::uint64_t codes = f == ScaleFormat::nvfp4 ? C / 2 : (C + 7) / 8;
    const std::uint64_t want = std::uint64_t{E} * R * (1 + codes) + 4 * t->stats.exceptions + 4 * E;
    EXPECT_EQ(t->stats.encoded_bytes, want);
    EXPECT_LT(t->stats.encoded_bytes, t->resident_bytes) << "planes are smaller than the resident form";
    const auto file = st::File::open(d.path / "c.safetensors");
    const auto* planes = file.find(name + ".csf.planes");
    ASSERT_NE(planes, nullptr);
    EXPECT_EQ(planes->shape, (std::vector<std::uint64_t>{std::uint64_t{E} * R / 16, 16 * (1 + codes)}));
    // The planes are b12x's: each expert's slice decodes on its own to that expert's grid.
    const auto data = file.data(*planes);
    const std::uint64_t per = std::uint64_t{R} / 16 * 16 * (1 + codes);
    const auto counts_part = file.data(*file.find(name + ".csf.expert_exceptions"));
    const auto records_part = file.data(*file.find(name + ".csf.exceptions"));
    std::uint64_t at = 0;
    for (std::uint32_t e = 0; e < E; ++e) {
      std::uint32_t n = 0;
      std::memcpy(&n, counts_part.data() + 4 * e, 4);
      std::vector<std::uint32_t> recs(n);
      if (n) std::memcpy(recs.data(), records_part.data() + 4 * at, 4 * std::uint64_t{n});
      at += n;
      std::vector<std::uint8_t> grid(std::uint64_t{R} * C);
      decode_planes(PlaneShape{f, R, C}, data.subspan(e * per, per), recs, grid, name);
      EXPECT_TRUE(
          std::equal(grid.begin(), grid.end(), scales.begin() + std::ptrdiff_t(std::uint64_t{e} * R * C)))
          << "expert " << e;
    }
    decompress_checkpoint(d.path / "c.safetensors", d.path / "back.safetensors");
    EXPECT_TRUE(read_bytes(d.path / "back.safetensors") == read_bytes(d.path / "m.safetensors"));
  }
}

// A damaged exceptions plane of csfmoe's own planes storage is refused naming
// the file, the tensor and the record, as the container's planes (no b12x
// file is involved).
TEST(ContainerV2, DamagedPlanesAreNamedAsTheContainersOwn) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const std::uint32_t E = 1 + rng() % 3, R = 16 * (1 + rng() % 4), C = 2 * (8 + rng() % 8);
  const GridShape g{ScaleFormat::nvfp4, ScaleLayout::row_major, E, R, C};
  auto scales = synthetic_scales(g, ScaleDistribution::realistic, rng());
  // Each expert's first byte far outside its row's window: at least one record per expert.
  for (std::uint32_t e = 0; e < E; ++e) {
    auto* row = scales.data() + std::uint64_t{e} * R * C;
    row[0] = static_cast<std::uint8_t>(row[1] + 128);
  }
  const std::string name = "model.layers.0.mlp.experts.w13.weight_scale";
  TempDir d;
  {
    st::Writer w(d.path / "m.safetensors", 1 << 16);
    w.add_tensor("model.layers.0.mlp.experts.w13.weight", st::Dtype::U8, {E, R, C * 8},
                 std::vector<std::uint8_t>(std::uint64_t{E} * R * C * 8, 0x35));
    w.add_tensor(name, st::Dtype::F8_E4M3, {E, R, C}, scales);
    w.commit(std::nullopt);
  }
  CompressOptions o;
  o.keep_unprofitable = false;
  const fs::path c = d.path / "c.safetensors";
  const CheckpointReport rep = compress_checkpoint(d.path / "m.safetensors", c, o);
  for (const auto& t : rep.tensors)
    if (t.name == name) ASSERT_EQ(t.storage, "planes");
  // The first record moved outside the grid.
  std::string bytes = read_bytes(c);
  std::uint64_t header = 0;
  std::memcpy(&header, bytes.data(), 8);
  const auto file = st::File::open(c);
  const auto* records = file.find(name + ".csf.exceptions");
  ASSERT_NE(records, nullptr);
  ASSERT_GE(records->nbytes(), 4u);
  const std::uint32_t bad = csf::make_record(R * C, 0xEE);
  std::memcpy(bytes.data() + 8 + header + records->begin, &bad, 4);
  csfmoe::testing::write_bytes(d.path / "bad.safetensors", bytes);
  for (const auto& run : std::vector<std::function<void()>>{
           [&] { verify_checkpoint(d.path / "bad.safetensors"); },
           [&] { (void)CheckpointFile::open(d.path / "bad.safetensors").read(name); }}) {
    try {
      run();
      ADD_FAILURE() << "a record outside the grid accepted";
    } catch (const FormatError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("bad.safetensors"), std::string::npos) << m;
      EXPECT_NE(m.find(name), std::string::npos) << m;
      EXPECT_NE(m.find("CSF exceptions plane: record 0 has position"), std::string::npos) << m;
      EXPECT_EQ(m.find("b12x"), std::string::npos) << m;
    }
  }
}

// Grids the planes cannot hold (rows not a multiple of 16, odd NVFP4 columns,
// a swizzled source) keep the resident storage and restore exactly.
TEST(ContainerV2, OtherGridsKeepTheResidentStorage) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  struct Case {
    std::uint32_t rows, cols;
    ScaleLayout layout;
  };
  for (const Case c : {Case{40, 32, ScaleLayout::row_major}, Case{64, 33, ScaleLayout::row_major},
                       Case{128, 32, ScaleLayout::swizzled_128x4}}) {
    SCOPED_TRACE(::testing::Message() << c.rows << "x" << c.cols << " " << to_string(c.layout));
    const GridShape g{ScaleFormat::nvfp4, ScaleLayout::row_major, 2, c.rows, c.cols};
    auto scales = synthetic_scales(g, ScaleDistribution::realistic, rng());
    if (c.layout == ScaleLayout::swizzled_128x4) scales = relayout_scales(g, scales, c.layout);
    const std::uint64_t K = std::uint64_t{c.cols} * 16;
    TempDir d;
    {
      st::Writer w(d.path / "m.safetensors", 1 << 16);
      std::vector<std::uint8_t> weight(2 * c.rows * K / 2, 0x11);
      w.add_tensor("x.weight", st::Dtype::U8, {2, c.rows, K / 2}, weight);
      w.add_tensor("x.weight_scale", st::Dtype::F8_E4M3, {2, c.rows, c.cols}, scales);
      w.commit(std::nullopt);
    }
    CompressOptions o;
    o.keep_unprofitable = false;
    o.layout = c.layout;
    compress_checkpoint(d.path / "m.safetensors", d.path / "c.safetensors", o);
    const auto file = st::File::open(d.path / "c.safetensors");
    EXPECT_EQ(file.find("x.weight_scale.csf.planes"), nullptr);
    EXPECT_NE(file.find("x.weight_scale.csf.row_prefix"), nullptr);
    for (const auto& t : inspect_checkpoint(d.path / "c.safetensors").tensors)
      if (t.name == "x.weight_scale") EXPECT_EQ(t.storage, "resident");
    decompress_checkpoint(d.path / "c.safetensors", d.path / "back.safetensors");
    EXPECT_TRUE(read_bytes(d.path / "back.safetensors") == read_bytes(d.path / "m.safetensors"));
  }
}

// --schema b12x: every per-expert scale under b12x's own tensor names (even
// where CSF does not pay), the scale itself absent, other tensors native;
// planes that decode to the native grids on their own; byte-exact restore.
TEST(ContainerB12x, PerExpertScalesUnderB12xNames) {
  for (const char* fmt : {"nvfp4", "mxfp4"}) {
    SCOPED_TRACE(fmt);
    const fs::path native = kV1 / (std::string(fmt) + ".safetensors");
    TempDir d;
    CompressOptions o;
    o.schema = CheckpointSchema::b12x;
    const CheckpointReport rep = compress_checkpoint(native, d.path / "b.safetensors", o);
    const auto src = st::File::open(native);
    const auto out = st::File::open(d.path / "b.safetensors");
    const ScaleFormat f = std::string(fmt) == "nvfp4" ? ScaleFormat::nvfp4 : ScaleFormat::mxfp4;
    std::size_t scales = 0;
    for (const auto& t : rep.tensors) {
      if (!t.format) {
        EXPECT_NE(out.find(t.name), nullptr) << t.name;
        continue;
      }
      ++scales;
      ASSERT_EQ(t.action, TensorAction::csf) << t.name << ": " << t.reason;
      EXPECT_EQ(out.find(t.name), nullptr) << t.name;
      const auto* fixed = out.find(b12x_fixed_name(t.name, f));
      const auto* exc = out.find(b12x_exceptions_name(t.name, f));
      ASSERT_TRUE(fixed && exc) << t.name;
      const auto* orig = src.find(t.name);
      const std::uint32_t R = static_cast<std::uint32_t>(orig->shape[0]),
                          C = static_cast<std::uint32_t>(orig->shape[1]);
      EXPECT_EQ(fixed->shape, (std::vector<std::uint64_t>{R / 16, plane_slab_bytes(f, C)}));
      std::vector<std::uint32_t> recs(exc->nbytes() / 4);
      if (!recs.empty()) std::memcpy(recs.data(), out.data(*exc).data(), exc->nbytes());
      std::vector<std::uint8_t> grid(std::uint64_t{R} * C);
      decode_planes(PlaneShape{f, R, C}, out.data(*fixed), recs, grid, t.name);
      const auto want = src.data(*orig);
      EXPECT_TRUE(std::equal(grid.begin(), grid.end(), want.begin())) << t.name;
    }
    EXPECT_EQ(scales, 6u);
    decompress_checkpoint(d.path / "b.safetensors", d.path / "back.safetensors");
    EXPECT_TRUE(read_bytes(d.path / "back.safetensors") == read_bytes(native));
    verify_checkpoint(d.path / "b.safetensors");
  }
}

// Stacked scales are split per expert (w13: gate rows, then up rows) before
// they are stored as b12x planes.
TEST(ContainerB12x, StackedScalesAreSplitPerExpert) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const GridShape g{ScaleFormat::nvfp4, ScaleLayout::row_major, 2, 64, 32};
  const auto scales = synthetic_scales(g, ScaleDistribution::realistic, rng());
  TempDir d;
  {
    st::Writer w(d.path / "m.safetensors", 1 << 16);
    w.add_tensor("model.layers.0.mlp.experts.w13.weight", st::Dtype::U8, {2, 64, 256},
                 std::vector<std::uint8_t>(2 * 64 * 256, 0x22));
    w.add_tensor("model.layers.0.mlp.experts.w13.weight_scale", st::Dtype::F8_E4M3, {2, 64, 32}, scales);
    w.commit(std::nullopt);
  }
  CompressOptions o;
  o.schema = CheckpointSchema::b12x;
  compress_checkpoint(d.path / "m.safetensors", d.path / "b.safetensors", o);
  const CheckpointFile f = CheckpointFile::open(d.path / "b.safetensors");
  for (std::uint64_t e = 0; e < 2; ++e)
    for (std::uint64_t h = 0; h < 2; ++h) {
      const std::string n =
          fmt::format("model.layers.0.mlp.experts.{}.{}.weight_scale", e, h ? "up_proj" : "gate_proj");
      const auto begin = scales.begin() + std::ptrdiff_t((2 * e + h) * 32 * 32);
      EXPECT_TRUE(f.read(n) == std::vector<std::uint8_t>(begin, begin + 32 * 32)) << n;
    }
  verify_checkpoint(d.path / "b.safetensors");
}

// compress --tp of a compressed input: the slice's planes are cut from the
// input's (bases keep their full-row values: no encoding), and the result
// restores to the same sliced native file as slicing the native input.
TEST(ContainerV2, TensorParallelSliceOfACompressedInputCutsItsPlanes) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const std::uint32_t E = 2, H = 512, N = 256;
  const std::string L = "model.layers.0.mlp.experts";
  TempDir d;
  {
    st::Writer w(d.path / "m.safetensors", 1 << 16);
    auto bytes = [&](std::uint64_t n) {
      std::vector<std::uint8_t> v(n);
      for (auto& x : v) x = static_cast<std::uint8_t>(rng());
      return v;
    };
    const GridShape g13{ScaleFormat::nvfp4, ScaleLayout::row_major, E, 2 * N, H / 16};
    const GridShape g2{ScaleFormat::nvfp4, ScaleLayout::row_major, E, H, N / 16};
    w.add_tensor(L + ".w13.weight", st::Dtype::U8, {E, 2 * N, H / 2},
                 bytes(std::uint64_t{E} * 2 * N * H / 2));
    w.add_tensor(L + ".w13.weight_scale", st::Dtype::F8_E4M3, {E, 2 * N, H / 16},
                 synthetic_scales(g13, ScaleDistribution::realistic, rng()));
    w.add_tensor(L + ".w2.weight", st::Dtype::U8, {E, H, N / 2}, bytes(std::uint64_t{E} * H * N / 2));
    w.add_tensor(L + ".w2.weight_scale", st::Dtype::F8_E4M3, {E, H, N / 16},
                 synthetic_scales(g2, ScaleDistribution::extremes, rng()));
    w.commit(std::nullopt);
  }
  CompressOptions keep;
  keep.keep_unprofitable = false;
  compress_checkpoint(d.path / "m.safetensors", d.path / "c.safetensors", keep);
  const CheckpointFile whole = CheckpointFile::open(d.path / "c.safetensors");
  for (unsigned rank = 0; rank < 2; ++rank) {
    SCOPED_TRACE(rank);
    CompressOptions o = keep;
    o.tp = 2;
    o.tp_rank = rank;
    const fs::path from_native = d.path / fmt::format("n{}.safetensors", rank);
    const fs::path from_csf = d.path / fmt::format("s{}.safetensors", rank);
    compress_checkpoint(d.path / "m.safetensors", from_native, o);
    compress_checkpoint(d.path / "c.safetensors", from_csf, o);
    decompress_checkpoint(from_native, d.path / fmt::format("n{}.back", rank));
    decompress_checkpoint(from_csf, d.path / fmt::format("s{}.back", rank));
    EXPECT_TRUE(read_bytes(d.path / fmt::format("n{}.back", rank)) ==
                read_bytes(d.path / fmt::format("s{}.back", rank)));
    // Down: columns cut, every row kept: each row's base is the unsliced row's.
    const CheckpointFile part = CheckpointFile::open(from_csf);
    const std::string w2 = L + ".w2.weight_scale";
    const auto src = csf_to_planes(whole.csf_parts(w2), w2), cut = csf_to_planes(part.csf_parts(w2), w2);
    ASSERT_EQ(src.size(), cut.size());
    for (std::size_t e = 0; e < src.size(); ++e) {
      ASSERT_EQ(cut[e].shape.rows, src[e].shape.rows);
      EXPECT_EQ(cut[e].shape.cols, src[e].shape.cols / 2);
      const std::uint64_t ss = plane_slab_bytes(ScaleFormat::nvfp4, src[e].shape.cols);
      const std::uint64_t cs = plane_slab_bytes(ScaleFormat::nvfp4, cut[e].shape.cols);
      for (std::uint32_t slab = 0; slab < src[e].shape.rows / 16; ++slab)
        EXPECT_TRUE(std::equal(cut[e].fixed.begin() + cs * slab, cut[e].fixed.begin() + cs * slab + 16,
                               src[e].fixed.begin() + ss * slab))
            << "expert " << e << " slab " << slab;
    }
  }
}

// --- files written by b12x / vLLM: plain safetensors with plane pairs -------

struct ForeignFile {
  std::map<std::string, std::vector<std::uint8_t>> native;  // scale name -> its grid
};

// A per-expert NVFP4 (ModelOpt names) or MXFP4 (X.weight U8 [R, K/2] + planes)
// layer written the way b12x writes it: the planes under their own names, no
// csfmoe metadata, the scales absent; plus a BF16 tensor.
ForeignFile write_foreign(const fs::path& p, ScaleFormat f, std::uint32_t experts, std::mt19937_64& rng,
                          const std::function<void(const std::string&, CsfPlanes&)>& tamper = {}) {
  ForeignFile out;
  const std::uint32_t N = 64, H = f == ScaleFormat::nvfp4 ? 512 : 1024;
  st::Writer w(p, 1 << 16);
  for (std::uint32_t e = 0; e < experts; ++e)
    for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
      const bool down = std::string(proj) == "down_proj";
      const std::uint32_t R = down ? H : N, K = down ? N : H, C = K / group_size(f);
      const std::string stem = fmt::format("model.layers.0.mlp.experts.{}.{}", e, proj);
      std::vector<std::uint8_t> weight(std::uint64_t{R} * K / 2);
      for (auto& x : weight) x = static_cast<std::uint8_t>(rng());
      w.add_tensor(stem + ".weight", st::Dtype::U8, {R, K / 2}, weight);
      const GridShape g{f, ScaleLayout::row_major, 1, R, C};
      auto grid = synthetic_scales(g, ScaleDistribution::realistic, rng());
      if (f == ScaleFormat::nvfp4)
        for (auto& b : grid) b &= 0x7F;  // positive E4M3 scales, as ModelOpt writes them
      const std::string scale = stem + ".weight_scale";
      CsfPlanes planes = encode_planes(PlaneShape{f, R, C}, grid, scale);
      if (tamper) tamper(scale, planes);
      w.add_tensor(b12x_fixed_name(scale, f), st::Dtype::U8, {R / 16, plane_slab_bytes(f, C)}, planes.fixed);
      std::vector<std::uint8_t> rec(planes.exceptions.size() * 4);
      if (!rec.empty()) std::memcpy(rec.data(), planes.exceptions.data(), rec.size());
      w.add_tensor(b12x_exceptions_name(scale, f), st::Dtype::U32, {planes.exceptions.size()}, rec);
      if (f == ScaleFormat::nvfp4) {
        const float g2 = 1e-3f;
        std::vector<std::uint8_t> b(4);
        std::memcpy(b.data(), &g2, 4);
        w.add_tensor(stem + ".weight_scale_2", st::Dtype::F32, {}, b);
      }
      out.native[scale] = std::move(grid);
    }
  w.add_tensor("model.norm.weight", st::Dtype::BF16, {8}, std::vector<std::uint8_t>(16, 0x3F));
  w.commit(st::Metadata{{"format", "pt"}});
  return out;
}

TEST(ForeignB12x, FilesWrittenByB12xReadVerifyAndDecompress) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4}) {
    SCOPED_TRACE(to_string(f));
    TempDir d;
    const fs::path p = d.path / "b12x.safetensors";
    const ForeignFile ff = write_foreign(p, f, 2, rng);
    EXPECT_FALSE(is_csf_container(p));
    const CheckpointReport ver = verify_checkpoint(p);
    std::size_t csf = 0;
    for (const auto& t : ver.tensors) {
      csf += t.action == TensorAction::csf;
      EXPECT_EQ(t.reason, kB12xNoChecksum) << t.name;
    }
    EXPECT_EQ(csf, 6u);
    // The reader sees each scale in its planes' place and decodes it.
    const CheckpointFile file = CheckpointFile::open(p);
    EXPECT_TRUE(file.is_b12x());
    for (const auto& [name, grid] : ff.native) {
      ASSERT_NE(file.find(name), nullptr) << name;
      EXPECT_EQ(file.find(b12x_fixed_name(name, f)), nullptr) << "planes are not logical tensors";
      EXPECT_TRUE(file.read(name) == grid) << name;
      EXPECT_FALSE(file.csf_entry(name)->has_crc32);
    }
    // decompress writes the native file: the scales in place, everything else unchanged.
    decompress_checkpoint(p, d.path / "native.safetensors");
    const auto nat = st::File::open(d.path / "native.safetensors");
    for (const auto& [name, grid] : ff.native) {
      const auto* t = nat.find(name);
      ASSERT_NE(t, nullptr) << name;
      EXPECT_EQ(t->dtype, f == ScaleFormat::nvfp4 ? st::Dtype::F8_E4M3 : st::Dtype::U8);
      const auto bytes = nat.data(*t);
      EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), grid.begin(), grid.end())) << name;
      EXPECT_EQ(nat.find(b12x_exceptions_name(name, f)), nullptr);
    }
    const auto src = st::File::open(p);
    const auto* norm = nat.find("model.norm.weight");
    ASSERT_NE(norm, nullptr);
    EXPECT_TRUE(std::ranges::equal(nat.data(*norm), src.data(*src.find("model.norm.weight"))));
    EXPECT_EQ(nat.header().metadata, src.header().metadata);
    // inspect: the scales as CSF, stored as their planes.
    const CheckpointReport ins = inspect_checkpoint(p);
    for (const auto& t : ins.tensors)
      if (ff.native.count(t.name)) {
        EXPECT_EQ(t.action, TensorAction::csf) << t.name;
        EXPECT_EQ(t.stats.encoded_bytes, src.find(b12x_fixed_name(t.name, f))->nbytes() +
                                             src.find(b12x_exceptions_name(t.name, f))->nbytes());
      }
    // Recompressing the restored file in the b12x schema gives the same planes back.
    CompressOptions o;
    o.schema = CheckpointSchema::b12x;
    compress_checkpoint(d.path / "native.safetensors", d.path / "again.safetensors", o);
    const auto again = st::File::open(d.path / "again.safetensors");
    for (const auto& [name, grid] : ff.native)
      EXPECT_TRUE(std::ranges::equal(again.data(*again.find(b12x_fixed_name(name, f))),
                                     src.data(*src.find(b12x_fixed_name(name, f)))))
          << name;
  }
}

TEST(ForeignB12x, NvfpLayerLoadsLikeItsNativeForm) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir d;
  write_foreign(d.path / "b12x.safetensors", ScaleFormat::nvfp4, 3, rng);
  decompress_checkpoint(d.path / "b12x.safetensors", d.path / "native.safetensors");
  const std::string layer = "model.layers.0.mlp.experts";
  const MoeHostWeights a = load_moe_layer(d.path / "b12x.safetensors", layer, 2);
  const MoeHostWeights b = load_moe_layer(d.path / "native.safetensors", layer, 2);
  EXPECT_EQ(a.geometry.experts, 3u);
  EXPECT_TRUE(a.w13_scales == b.w13_scales);
  EXPECT_TRUE(a.w2_scales == b.w2_scales);
  EXPECT_TRUE(a.w13 == b.w13);
}

// Planes that break b12x's rules are refused naming the file and the tensor,
// by every reader, and decompress leaves nothing behind.
TEST(ForeignB12x, PlanesThatBreakTheRulesAreRefused) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  struct Case {
    const char* what;
    ScaleFormat format;
    std::function<void(CsfPlanes&)> tamper;
    const char* needle;
  };
  const std::vector<Case> cases = {
      {"base above 240", ScaleFormat::nvfp4, [](CsfPlanes& p) { p.fixed[3] = 241; }, "240"},
      {"base above 254", ScaleFormat::mxfp4, [](CsfPlanes& p) { p.fixed[5] = 255; }, "254"},
      {"records out of order", ScaleFormat::nvfp4,
       [](CsfPlanes& p) {
         // Two bytes of row 0 far outside its window make two records; then swap them.
         auto grid = decode_planes(p, "x");
         grid[1] = static_cast<std::uint8_t>(grid[0] + 100);
         grid[2] = static_cast<std::uint8_t>(grid[0] + 101);
         p = encode_planes(p.shape, grid, "x");
         ASSERT_GE(p.exceptions.size(), 2u);
         std::swap(p.exceptions[0], p.exceptions[1]);
       },
       "increasing"},
      {"record out of range", ScaleFormat::nvfp4,
       [](CsfPlanes& p) { p.exceptions = {csf::make_record(p.shape.rows * p.shape.cols, 0xEE)}; },
       "position"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    TempDir d;
    const fs::path p = d.path / "bad.safetensors";
    bool done = false;
    write_foreign(p, c.format, 1, rng, [&](const std::string& name, CsfPlanes& planes) {
      if (!done && name.find("up_proj") != std::string::npos) {
        c.tamper(planes);
        done = true;
      }
    });
    const std::string victim = "model.layers.0.mlp.experts.0.up_proj.weight_scale";
    for (const auto& run : std::vector<std::function<void()>>{
             [&] { verify_checkpoint(p); }, [&] { decompress_checkpoint(p, d.path / "out.safetensors"); },
             [&] { (void)CheckpointFile::open(p).read(victim); }}) {
      try {
        run();
        ADD_FAILURE() << "accepted";
      } catch (const FormatError& e) {
        const std::string m = e.what();
        EXPECT_NE(m.find(p.string()), std::string::npos) << m;
        EXPECT_NE(m.find(victim), std::string::npos) << m;
        EXPECT_NE(m.find(c.needle), std::string::npos) << m;
      }
    }
    EXPECT_FALSE(fs::exists(d.path / "out.safetensors"));
  }
}

TEST(ForeignB12x, IncompletePairsAndMissingColumnsAreRefused) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  const GridShape g{ScaleFormat::mxfp4, ScaleLayout::row_major, 1, 32, 20};
  const auto grid = synthetic_scales(g, ScaleDistribution::realistic, rng());
  const CsfPlanes planes = encode_planes(PlaneShape{ScaleFormat::mxfp4, 32, 20}, grid, "x");
  std::vector<std::uint8_t> rec(planes.exceptions.size() * 4);
  if (!rec.empty()) std::memcpy(rec.data(), planes.exceptions.data(), rec.size());
  const auto write = [&](const fs::path& p, bool fixed, bool exc, bool weight, bool scale) {
    st::Writer w(p, 1 << 16);
    if (weight) w.add_tensor("x.weight", st::Dtype::U8, {32, 320}, std::vector<std::uint8_t>(32 * 320, 1));
    if (scale) w.add_tensor("x.weight_scale", st::Dtype::U8, {32, 20}, grid);
    if (fixed)
      w.add_tensor(b12x_fixed_name("x.weight_scale", ScaleFormat::mxfp4), st::Dtype::U8,
                   {2, plane_slab_bytes(ScaleFormat::mxfp4, 20)}, planes.fixed);
    if (exc)
      w.add_tensor(b12x_exceptions_name("x.weight_scale", ScaleFormat::mxfp4), st::Dtype::U32,
                   {planes.exceptions.size()}, rec);
    w.commit(std::nullopt);
  };
  TempDir d;
  struct Case {
    bool fixed, exc, weight, scale;
    const char* needle;
  };
  for (const Case c : {Case{true, false, true, false, "without"}, Case{false, true, true, false, "without"},
                       Case{true, true, false, false, "weight"}, Case{true, true, true, true, "beside"}}) {
    const fs::path p = d.path / fmt::format("c{}{}{}{}.safetensors", c.fixed, c.exc, c.weight, c.scale);
    write(p, c.fixed, c.exc, c.weight, c.scale);
    try {
      verify_checkpoint(p);
      ADD_FAILURE() << p;
    } catch (const FormatError& e) {
      EXPECT_NE(std::string(e.what()).find("x.weight_scale"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(c.needle), std::string::npos) << e.what();
    }
  }
  // Complete, with its weight: verifies and restores the grid.
  write(d.path / "ok.safetensors", true, true, true, false);
  EXPECT_TRUE(CheckpointFile::open(d.path / "ok.safetensors").read("x.weight_scale") == grid);
}

// b12x's manifest export: manifest.json + build-contract.json, shards under
// tensors/, Hugging Face files under metadata/.
void write_export(const fs::path& root, const std::vector<std::string>& shards,
                  const std::map<std::string, std::string>& source_names, const std::string& schema,
                  const std::string& codec) {
  nlohmann::json m = {
      {"schema", schema}, {"codec", codec}, {"family", "test"}, {"shards", nlohmann::json::array()}};
  for (const auto& s : shards) m["shards"].push_back({{"file", s}});
  nlohmann::json c = {
      {"schema", schema}, {"codec", codec}, {"family", "test"}, {"source_names", source_names}};
  std::ofstream(root / "manifest.json") << m.dump();
  std::ofstream(root / "build-contract.json") << c.dump();
}

TEST(ForeignB12x, ManifestExportReadsVerifiesAndDecompressesToAHuggingFaceFolder) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  TempDir d;
  const fs::path root = d.path / "export";
  fs::create_directories(root / "tensors");
  fs::create_directories(root / "metadata");
  std::ofstream(root / "metadata" / "config.json") << R"({"model_type": "test"})";
  const ForeignFile ff =
      write_foreign(root / "tensors" / "model-00001.safetensors", ScaleFormat::nvfp4, 2, rng);
  std::map<std::string, std::string> names;
  const auto shard = st::File::open(root / "tensors" / "model-00001.safetensors");
  for (const auto& t : shard.tensors()) {
    std::string n = t.name;
    for (const char* suffix : {".nvfp4_csf_fixed", ".nvfp4_csf_exceptions"})
      if (n.ends_with(suffix)) n = n.substr(0, n.size() - std::string(suffix).size());
    names[n] = "model-00001.safetensors";
  }
  const std::string schema = "lil-nvfp4-csf-checkpoint/1",
                    codec = "byte-window4-fixed-stream-u24-exceptions/1";
  write_export(root, {"model-00001.safetensors"}, names, schema, codec);

  const CheckpointReport ver = verify_checkpoint(root);
  std::size_t csf = 0;
  for (const auto& t : ver.tensors) csf += t.action == TensorAction::csf;
  EXPECT_EQ(csf, 6u);
  const MoeHostWeights w = load_moe_layer(root, "model.layers.0.mlp.experts", 2);
  EXPECT_EQ(w.geometry.experts, 2u);
  decompress_checkpoint(root, d.path / "hf");
  EXPECT_TRUE(fs::exists(d.path / "hf" / "config.json"));
  const auto index = nlohmann::json::parse(read_bytes(d.path / "hf" / "model.safetensors.index.json"));
  for (const auto& [scale, grid] : ff.native)
    EXPECT_EQ(index["weight_map"][scale], "model-00001.safetensors");
  const MoeHostWeights back = load_moe_layer(d.path / "hf", "model.layers.0.mlp.experts", 2);
  EXPECT_TRUE(back.w13_scales == w.w13_scales);
  EXPECT_TRUE(back.w2_scales == w.w2_scales);

  // Broken exports are refused naming the file and the entry; nothing is written.
  const auto refused = [&](const std::string& needle) {
    try {
      verify_checkpoint(root);
      ADD_FAILURE() << "accepted: " << needle;
    } catch (const FormatError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_THROW(decompress_checkpoint(root, d.path / "never"), FormatError);
    EXPECT_FALSE(fs::exists(d.path / "never"));
  };
  write_export(root, {"model-00001.safetensors", "model-00002.safetensors"}, names, schema, codec);
  refused("model-00002.safetensors");  // a shard the folder does not hold
  write_export(root, {"model-00001.safetensors"}, names, schema, "row-base-offset1-u24-exceptions/1");
  refused("codec");
  auto stray = names;
  stray["model.extra"] = "model-00009.safetensors";
  write_export(root, {"model-00001.safetensors"}, stray, schema, codec);
  refused("model-00009.safetensors");
  write_export(root, {"../outside.safetensors"}, names, schema, codec);
  refused("outside");
  fs::remove(root / "build-contract.json");
  refused("build-contract.json");
  // A FIFO in the contract's place is named as what it is, not "missing".
  ASSERT_EQ(::mkfifo((root / "build-contract.json").c_str(), 0600), 0);
  try {
    verify_checkpoint(root);
    ADD_FAILURE() << "a FIFO contract accepted";
  } catch (const FormatError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("'build-contract.json' is not a regular file"), std::string::npos) << m;
    EXPECT_EQ(m.find("missing"), std::string::npos) << m;
  }
}

}  // namespace
}  // namespace csfmoe
