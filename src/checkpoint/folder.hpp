// Checkpoint folders (internal): the output rules every verb follows, the
// folder's entries, and the shard index (model.safetensors.index.json) with
// its one writer, which compress, decompress, the b12x split and the TP slicer
// all go through.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "checkpoint/b12x_file.hpp"
#include "csfmoe/safetensors.hpp"

namespace csfmoe::detail {

// --- output rules ----------------------------------------------------------

// The input exists; the output does not, is not the input, does not lie
// inside an input folder, and its parent folder exists.
void check_paths(const std::filesystem::path& in, const std::filesystem::path& out);

// A folder built beside its destination and renamed onto it at the end
// (named, and stale ones from killed runs swept, by st::prepare_temporary).
class TempDir {
 public:
  explicit TempDir(std::filesystem::path dest);
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return tmp_; }
  void commit();

 private:
  std::filesystem::path dest_, tmp_;
  bool done_ = false;
};

// A top-level entry copied unchanged must not, through a symlink, bring a
// file from elsewhere on this machine into the output, nor be a loop.
void check_plain_entry(const std::filesystem::path& folder, const std::string& name);

void copy_plain(const std::filesystem::path& from, const std::filesystem::path& to);

// Output path of the shard `n` ("x.safetensors" or "tensors/x.safetensors")
// in folder `root`, its sub-folder created.
std::filesystem::path out_file(const std::filesystem::path& root, const std::string& n);

void write_file(const std::filesystem::path& dest, std::string_view bytes);

// --- a checkpoint folder ---------------------------------------------------

// The folder's entries, split into safetensors files (validated, opened) and others.
struct Folder {
  std::vector<std::pair<std::string, st::File>> files;  // sorted by name; index shards in sub-folders by path
  std::vector<std::string> others;                      // index excluded
  std::set<std::string> nested;  // index shards in sub-folders ("tensors/x.safetensors")
  std::optional<st::ShardIndex> index;
  std::optional<ManifestExport> manifest;  // b12x's manifest export: files are its tensors/ shards
  // Copies the top-level entry `n` to `to`, leaving out the nested shards (written separately).
  void copy_other(const std::filesystem::path& in, const std::string& n,
                  const std::filesystem::path& to) const;
};

Folder open_folder(const std::filesystem::path& in);

// Every weight_map entry names a shard of the folder that holds the tensor.
void check_index_tensors(const Folder& f, const std::filesystem::path& in);

// --- the shard index -------------------------------------------------------

// The index text `raw` parsed; FormatError naming `label`.
nlohmann::ordered_json parse_index_json(const std::string& raw, const std::string& label);

// How edit_index changes an index; each field left empty changes nothing.
struct IndexEdit {
  // The weight_map is rebuilt from these entries (tensor, shard), in order...
  const std::vector<std::pair<std::string, std::string>>* weight_map = nullptr;
  // ... each listed under the names `rename` gives it (nullopt: under its own name).
  std::function<std::optional<std::vector<std::string>>(const std::string& tensor, const std::string& shard)>
      rename;
  // metadata.total_size, where the index has one.
  std::optional<std::uint64_t> total_size;
  // A compressed folder's index keeps the source index's bytes under
  // metadata.csfmoe (metadata first, made if absent), for decompress to give back.
  const std::string* original = nullptr;
};

// The edit that lists each tensor of `names` under its mapped name (b12x
// planes under their scale tensor), every other entry as it was.
IndexEdit renaming(const std::vector<std::pair<std::string, std::string>>& weight_map,
                   const std::map<std::string, std::string>& names);

// The one writer of shard indexes: `index` with `edit` applied, as the text
// to write; nullopt when the edit changes nothing (the caller keeps the
// source's bytes). Keys keep their order.
std::optional<std::string> edit_index(nlohmann::ordered_json index, const IndexEdit& edit);

// The original index bytes of a container folder's model.safetensors.index.json
// (`raw`), if it is one csfmoe rewrote; CorruptData on a CRC mismatch.
std::optional<std::string> original_index(const std::string& raw, const std::string& label);

}  // namespace csfmoe::detail
