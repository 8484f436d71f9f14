// The CSF storage table (src/checkpoint/storage_table.hpp): one entry per
// storage, found by value, by descriptor name and by its two axes, and what
// the descriptor, the version stamp, the loaders and the header bound read
// from it.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "checkpoint/container.hpp"
#include "checkpoint/storage_table.hpp"
#include "csfmoe/b12x_planes.hpp"
#include "csfmoe/checkpoint.hpp"
#include "csfmoe/codec.hpp"
#include "csfmoe/errors.hpp"
#include "csfmoe/mxfp4_slab_planes.hpp"
#include "csfmoe/safetensors.hpp"
#include "csfmoe/synthetic.hpp"
#include "test_files.hpp"
#include "test_seed.hpp"

namespace csfmoe::detail {
namespace {

namespace fs = std::filesystem;
using csfmoe::testing::TempDir;

TEST(StorageTable, OneEntryPerStorageFoundByValueNameAndAxes) {
  const auto all = csf_storages();
  ASSERT_EQ(all.size(), 4u);
  std::set<std::string_view> names;
  std::set<std::pair<CsfPayload, CsfNaming>> axes;
  for (const CsfStorageSpec& s : all) {
    EXPECT_EQ(&storage_spec(s.storage), &s);
    EXPECT_EQ(find_storage(s.name), &s);
    EXPECT_EQ(&storage_of(s.payload, s.naming), &s);
    EXPECT_EQ(to_string(s.storage), s.name);
    EXPECT_TRUE(names.insert(s.name).second) << s.name;
    EXPECT_TRUE(axes.insert({s.payload, s.naming}).second) << s.name;
  }
  EXPECT_EQ(find_storage("slabs"), nullptr);
  EXPECT_THROW(storage_of(CsfPayload::resident, CsfNaming::b12x), InvalidArgument);
}

TEST(StorageTable, PartNamesAreEachStoragesOwn) {
  // What each storage writes, in file order: the names that index rewrites
  // and readers list.
  using V = std::vector<std::string>;
  const std::string t = "m.experts.0.w1.weight_scale";
  EXPECT_EQ(stored_part_names(t, CsfStorage::resident, ScaleFormat::nvfp4),
            (V{t + ".csf.fixed", t + ".csf.exceptions", t + ".csf.row_prefix", t + ".csf.partition_index"}));
  EXPECT_EQ(stored_part_names(t, CsfStorage::planes, ScaleFormat::nvfp4),
            (V{t + ".csf.planes", t + ".csf.exceptions", t + ".csf.expert_exceptions"}));
  EXPECT_EQ(stored_part_names(t, CsfStorage::b12x, ScaleFormat::nvfp4),
            (V{t + ".nvfp4_csf_fixed", t + ".nvfp4_csf_exceptions"}));
  EXPECT_EQ(stored_part_names(t, CsfStorage::b12x, ScaleFormat::mxfp4),
            (V{t + ".mxfp4_csf_fixed", t + ".mxfp4_csf_exceptions"}));
  EXPECT_EQ(
      stored_part_names(t, CsfStorage::mxfp4_slab, ScaleFormat::mxfp4),
      (V{t + ".csf.slabs", t + ".csf.slab_escapes", t + ".csf.exceptions", t + ".csf.expert_exceptions"}));
}

TEST(StorageTable, VersionStampIsTheNewestStoragesFirstVersionAndAtLeastTwo) {
  const auto stamp = [](std::vector<CsfStorage> storages) {
    std::vector<CsfEntry> entries;
    for (const CsfStorage s : storages) entries.emplace_back().storage = s;
    return container_version_for(entries);
  };
  EXPECT_EQ(stamp({}), 2);
  EXPECT_EQ(stamp({CsfStorage::resident}), 2);
  EXPECT_EQ(stamp({CsfStorage::resident, CsfStorage::planes, CsfStorage::b12x}), 2);
  EXPECT_EQ(stamp({CsfStorage::planes, CsfStorage::mxfp4_slab}), 3);
}

TEST(StorageTable, DescriptorRefusesAStorageNewerThanItsVersion) {
  const auto parse = [](int version, const std::string& storage) {
    const std::string desc = R"({"format":"csfmoe-csf","version":)" + std::to_string(version) +
                             R"(,"tensors":{"s":{"dtype":"U8","shape":[16,2],"format":"mxfp4","layout":)"
                             R"("row_major","grid":[1,16,2],"crc32":0,"exceptions":0,"storage":")" +
                             storage + R"("}}})";
    const std::string orig = R"({"file_size":0,"file_crc32":0,"header":"","gaps":[],"native_crc32":{}})";
    return get_container_metadata(st::Metadata{{kContainerKey, desc}, {kOriginalKey, orig}}, "f");
  };
  for (const CsfStorageSpec& s : csf_storages())
    for (int version = 1; version <= kContainerVersion; ++version) {
      if (version >= s.min_version) {
        EXPECT_EQ(parse(version, std::string(s.name))->csf.at(0).storage, s.storage) << s.name << version;
      } else {
        EXPECT_THROW(parse(version, std::string(s.name)), FormatError) << s.name << version;
      }
    }
  EXPECT_THROW(parse(kContainerVersion, "slabs"), FormatError);
}

// --- the parts: what the writers write is what the table says, and the
// loaders refuse anything else -----------------------------------------------

const std::string kScale = "model.layers.0.mlp.experts.w13.weight_scale";

bool holds(const CsfStorageSpec& s, ScaleFormat f) {
  return s.payload != CsfPayload::mxfp4_slab || f == ScaleFormat::mxfp4;
}

// A random grid that every storage of format `f` can hold (b12x: one expert).
GridShape random_grid(std::mt19937_64& rng, ScaleFormat f, bool one_expert) {
  const std::uint32_t E = one_expert ? 1 : 1 + rng() % 3, R = 16 * (1 + rng() % 12);
  const std::uint32_t C = f == ScaleFormat::nvfp4 ? 2 * (1 + rng() % 40) : 1 + rng() % 70;
  return {f, ScaleLayout::row_major, E, R, C};
}

// Entry `kScale` of grid `g` written with storage `s` to `path` (parts only).
CsfEntry write_storage(const fs::path& path, const CsfStorageSpec& s, const GridShape& g,
                       std::span<const std::uint8_t> scales) {
  const CsfTensor enc = encode(g, scales);
  const std::vector<CsfPlanes> planes = csf_to_planes(enc, kScale);
  std::vector<Mxfp4SlabPlanes> slabs;
  if (g.format == ScaleFormat::mxfp4)
    for (const CsfPlanes& p : planes) slabs.push_back(planes_to_mxfp4_slabs(p, kScale));
  st::Writer w(path, 1 << 16);
  s.write(w, kScale, CsfForms{&enc, planes, slabs});
  w.commit(std::nullopt);
  CsfEntry e;
  e.name = kScale;
  e.dtype = g.format == ScaleFormat::nvfp4 ? st::Dtype::F8_E4M3 : st::Dtype::U8;
  e.shape = {g.experts, g.rows, g.cols};
  e.grid = g;
  e.exceptions = enc.exceptions.size();
  e.storage = s.storage;
  return e;
}

// `in` copied to `out` with tensor `name` changed by `edit` (its dtype, shape and bytes).
void rewrite(const fs::path& in, const fs::path& out, const std::string& name,
             const std::function<void(st::TensorInfo&, std::vector<std::uint8_t>&)>& edit) {
  const auto f = st::File::open(in);
  st::Writer w(out, 1 << 16);
  for (const st::TensorInfo& t : f.tensors()) {
    st::TensorInfo info = t;
    const auto data = f.data(t);
    std::vector<std::uint8_t> bytes(data.begin(), data.end());
    if (t.name == name) edit(info, bytes);
    w.add_tensor(info.name, info.dtype, info.shape, bytes);
  }
  w.commit(std::nullopt);
}

std::vector<std::uint8_t> decoded(const CsfTensor& t, std::uint64_t n) {
  std::vector<std::uint8_t> out(n);
  decode(t, ScaleLayout::row_major, out, {}, /*trusted=*/true);
  return out;
}

TEST(StorageTableParts, WrittenAsTheTableSaysAndWithinTheHeaderBound) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  for (int round = 0; round < 12; ++round)
    for (const ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4})
      for (const CsfStorageSpec& s : csf_storages()) {
        if (!holds(s, f)) continue;
        const GridShape g = random_grid(rng, f, s.naming == CsfNaming::b12x);
        const auto dist = round % 3 ? ScaleDistribution::realistic : ScaleDistribution::uniform_random;
        const auto scales = synthetic_scales(g, dist, rng());
        SCOPED_TRACE(::testing::Message() << s.name << " " << to_string(f) << " E=" << g.experts
                                          << " R=" << g.rows << " C=" << g.cols);
        TempDir d;
        const CsfEntry e = write_storage(d.path / "c.safetensors", s, g, scales);
        const auto file = st::File::open(d.path / "c.safetensors");
        const CsfGeometry geometry = CsfGeometry::of(g);
        ASSERT_EQ(file.tensors().size(), s.parts.size());
        for (std::size_t i = 0; i < s.parts.size(); ++i) {
          const CsfPart& part = *s.parts[i];
          const st::TensorInfo& t = file.tensors()[i];
          EXPECT_EQ(t.name, part.name(kScale, f));
          EXPECT_EQ(t.dtype, part.dtype) << t.name;
          // The header bound's view: the rule's rank, no dimension and no count above max_elements.
          const std::uint64_t max = part.max_elements(geometry);
          EXPECT_EQ(t.shape.size(), part.shape(geometry, {}).size()) << t.name;
          std::uint64_t count = 1;
          for (const std::uint64_t n : t.shape) {
            EXPECT_LE(n, max) << t.name;
            count *= n;
          }
          EXPECT_LE(count, max) << t.name;
        }
        EXPECT_EQ(decoded(load_csf_parts(file, e, "c"), scales.size()), scales) << "round trip";
        // A storage the bound counts as another takes no more header than that one.
        if (s.bound_as != s.storage) {
          write_storage(d.path / "as.safetensors", storage_spec(s.bound_as), g, scales);
          const auto as = st::File::open(d.path / "as.safetensors");
          EXPECT_LE(st::Writer::header_json_size(file.tensors(), std::nullopt),
                    st::Writer::header_json_size(as.tensors(), std::nullopt));
        }
      }
}

// Each part of every storage in turn: another dtype of the same size, an
// extra dimension, one element more, and stored flat (accepted only where
// the table says so). The loader refuses each one, naming the file, the
// tensor and the part.
TEST(StorageTableParts, LoadersRefuseADtypeOrShapeTheTableDoesNotGive) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  using Edit = std::function<void(st::TensorInfo&, std::vector<std::uint8_t>&)>;
  const std::vector<std::pair<std::string, Edit>> edits = {
      {"must be",
       [](st::TensorInfo& t, std::vector<std::uint8_t>&) {
         t.dtype = st::dtype_size(t.dtype) == 1 ? st::Dtype::I8 : st::Dtype::I32;
       }},
      {"has shape", [](st::TensorInfo& t, std::vector<std::uint8_t>&) { t.shape.push_back(1); }},
      {"has shape",
       [](st::TensorInfo& t, std::vector<std::uint8_t>& b) {
         const std::uint64_t row = t.shape.size() == 2 ? t.shape[1] : 1;
         t.shape[0] += 1;
         b.resize(b.size() + row * st::dtype_size(t.dtype));
       }},
  };
  for (const ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4})
    for (const CsfStorageSpec& s : csf_storages()) {
      if (!holds(s, f)) continue;
      const GridShape g = random_grid(rng, f, s.naming == CsfNaming::b12x);
      const auto scales = synthetic_scales(g, ScaleDistribution::realistic, rng());
      SCOPED_TRACE(::testing::Message() << s.name << " " << to_string(f) << " E=" << g.experts
                                        << " R=" << g.rows << " C=" << g.cols);
      TempDir d;
      const fs::path good = d.path / "c.safetensors", bad = d.path / "bad.safetensors";
      const CsfEntry e = write_storage(good, s, g, scales);
      ASSERT_EQ(decoded(load_csf_parts(st::File::open(good), e, good.string()), scales.size()), scales);
      for (const CsfPart* part : s.parts) {
        const std::string name = part->name(kScale, f);
        for (const auto& [want, edit] : edits) {
          SCOPED_TRACE(name + ": " + want);
          fs::remove(bad);
          rewrite(good, bad, name, edit);
          try {
            load_csf_parts(st::File::open(bad), e, bad.string());
            ADD_FAILURE() << "loaded";
          } catch (const FormatError& x) {
            const std::string m = x.what();
            EXPECT_NE(m.find(bad.string()), std::string::npos) << m;
            EXPECT_NE(m.find("tensor '" + kScale + "'"), std::string::npos) << m;
            EXPECT_NE(m.find("CSF part '" + name + "' " + want), std::string::npos) << m;
          }
        }
        // Flat: [product of the shape].
        const auto good_file = st::File::open(good);
        if (good_file.find(name)->shape.size() != 2) continue;
        fs::remove(bad);
        rewrite(good, bad, name,
                [](st::TensorInfo& t, std::vector<std::uint8_t>&) { t.shape = {t.shape[0] * t.shape[1]}; });
        if (part->flat_ok) {
          EXPECT_EQ(decoded(load_csf_parts(st::File::open(bad), e, "bad"), scales.size()), scales) << name;
        } else {
          EXPECT_THROW(load_csf_parts(st::File::open(bad), e, "bad"), FormatError) << name;
        }
      }
    }
}

// --- the header bound: compress reserves it, and every storage's header fits

void write_source(const fs::path& path, const GridShape& g, std::mt19937_64& rng) {
  const auto scales = synthetic_scales(g, ScaleDistribution::realistic, rng());
  const std::uint64_t K = std::uint64_t{g.cols} * group_size(g.format);
  std::vector<std::uint8_t> weight(std::uint64_t{g.experts} * g.rows * K / 2);
  for (auto& x : weight) x = static_cast<std::uint8_t>(rng());
  st::Writer w(path, 1 << 16);
  if (g.format == ScaleFormat::nvfp4) {
    w.add_tensor("model.layers.0.mlp.experts.w13.weight", st::Dtype::U8, {g.experts, g.rows, K / 2}, weight);
    w.add_tensor("model.layers.0.mlp.experts.w13.weight_scale", st::Dtype::F8_E4M3,
                 {g.experts, g.rows, g.cols}, scales);
  } else {
    w.add_tensor("model.layers.0.mlp.experts.gate_up_proj_blocks", st::Dtype::U8,
                 {g.experts, g.rows, g.cols, 16}, weight);
    w.add_tensor("model.layers.0.mlp.experts.gate_up_proj_scales", st::Dtype::U8, {g.experts, g.rows, g.cols},
                 scales);
  }
  w.commit(st::Metadata{{"note", "header bound"}});
}

// container_header_bound of what container `c` holds: its CSF entries as
// candidates, its other tensors, its restore record and its own metadata.
std::uint64_t bound_of(const st::File& c) {
  const auto info = get_container_metadata(c.header().metadata, "c");
  ContainerInfo base;
  base.original_header = info->original_header;
  base.original_file_size = info->original_file_size;
  base.gaps = info->gaps;
  std::map<std::string, const CsfEntry*> part_of;
  for (const CsfEntry& e : info->csf)
    for (const std::string& n : stored_part_names(e.name, e.storage, e.grid.format)) part_of[n] = &e;
  std::vector<st::TensorInfo> sources;
  std::vector<CsfGeometry> geometries;
  sources.reserve(info->csf.size());
  geometries.reserve(info->csf.size());
  std::vector<BoundTensor> tensors;
  std::set<const CsfEntry*> counted;
  for (const st::TensorInfo& t : c.tensors()) {
    const auto p = part_of.find(t.name);
    if (p == part_of.end()) {
      tensors.push_back({&t, nullptr, "", info->native_kept.count(t.name) > 0});
    } else if (counted.insert(p->second).second) {
      const CsfEntry& e = *p->second;
      st::TensorInfo& s = sources.emplace_back();
      s.name = e.name;
      s.dtype = e.dtype;
      s.shape = e.shape;
      geometries.push_back(CsfGeometry::of(e.grid));
      tensors.push_back({&s, &geometries.back(), e.layer, true});
    }
  }
  st::Metadata md = *c.header().metadata;
  md.erase(kContainerKey);
  md.erase(kOriginalKey);
  return container_header_bound(base, tensors, md);
}

TEST(StorageTableBound, CompressReservesEnoughHeaderForEveryStorage) {
  CSFMOE_SEEDED(seed);
  std::mt19937_64 rng(seed);
  std::set<std::pair<std::string, ScaleFormat>> seen;
  for (int round = 0; round < 8; ++round)
    for (const ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4}) {
      // Resident where the rows are no multiple of 16, else planes, slabs, and b12x's per expert.
      GridShape g = random_grid(rng, f, false);
      g.experts = 1 + rng() % 4;
      const bool resident = round % 2;
      // b12x's split cuts w13 into gate and up rows: each half whole slabs.
      g.rows = resident ? 16 * (1 + rng() % 6) + 1 + rng() % 15 : 32 * (1 + rng() % 6);
      SCOPED_TRACE(::testing::Message()
                   << to_string(f) << " E=" << g.experts << " R=" << g.rows << " C=" << g.cols);
      TempDir d;
      write_source(d.path / "m.safetensors", g, rng);
      std::vector<CompressOptions> options(3);
      for (auto& o : options) o.keep_unprofitable = false;
      options[1].mxfp4_slab = false;
      options[2].schema = CheckpointSchema::b12x;
      for (std::size_t i = 0; i < options.size(); ++i) {
        if (resident && options[i].schema == CheckpointSchema::b12x) continue;
        const fs::path out = d.path / ("c" + std::to_string(i));
        const CheckpointReport rep = compress_checkpoint(d.path / "m.safetensors", out, options[i]);
        for (const TensorReport& t : rep.tensors)
          if (t.action == TensorAction::csf) seen.insert({t.storage, f});
        std::vector<fs::path> files{out};
        if (fs::is_directory(out)) {
          files.clear();
          for (const auto& x : fs::directory_iterator(out))
            if (x.path().extension() == ".safetensors") files.push_back(x.path());
        }
        ASSERT_FALSE(files.empty());
        for (const fs::path& p : files) {
          const auto c = st::File::open(p);
          // The bound is the reservation: 8 length bytes and the header.
          EXPECT_GE(bound_of(c), 8 + st::Writer::header_json_size(c.tensors(), c.header().metadata)) << p;
        }
      }
    }
  for (const CsfStorageSpec& s : csf_storages())
    for (const ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4})
      if (holds(s, f)) EXPECT_TRUE(seen.count({std::string(s.name), f})) << s.name << " " << to_string(f);
}

}  // namespace
}  // namespace csfmoe::detail
