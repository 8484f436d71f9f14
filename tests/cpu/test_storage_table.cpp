// The CSF storage table (src/checkpoint/storage_table.hpp): one entry per
// storage, found by value, by descriptor name and by its two axes, and what
// the descriptor and the version stamp read from it.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "checkpoint/container.hpp"
#include "checkpoint/storage_table.hpp"
#include "csfmoe/errors.hpp"

namespace csfmoe::detail {
namespace {

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

}  // namespace
}  // namespace csfmoe::detail
