// Container version 2 (docs/container-format.md): CSF tensors whose grid
// allows it are stored as b12x's canonical planes (per expert: 16-row slabs
// of bases and codes, the exception records, a record count), restore byte
// for byte and load into the same resident form as version 1; version 1
// files (tests/data/container-v1, written by the version 1 tool) still
// verify, restore and load.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "checkpoint/container.hpp"
#include "csfmoe/b12x_planes.hpp"
#include "csfmoe/checkpoint.hpp"
#include "csfmoe/codec.hpp"
#include "csfmoe/errors.hpp"
#include "csfmoe/moe.hpp"
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

TEST(ContainerB12x, StackedScalesAreRefused) {
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
  try {
    compress_checkpoint(d.path / "m.safetensors", d.path / "b.safetensors", o);
    ADD_FAILURE() << "stacked scales accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("w13.weight_scale"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("per expert"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(d.path / "b.safetensors"));
}

}  // namespace
}  // namespace csfmoe
