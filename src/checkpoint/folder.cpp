// Checkpoint folders: the output rules, a folder's entries, and the one
// writer of shard indexes (folder.hpp).
#include "checkpoint/folder.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "checkpoint/container.hpp"
#include "checkpoint/json_error.hpp"
#include "csfmoe/errors.hpp"

namespace csfmoe::detail {
namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

namespace {

constexpr const char* kIndexKey = "csfmoe";  // key inside the rewritten index's "metadata"

// Copies folder `from` (the checkpoint's `rel`) to `to` as copy_plain does,
// leaving out the shards in `skip` (paths relative to the checkpoint folder):
// a sub-folder of shards that an index lists is written shard by shard.
void copy_tree_except(const fs::path& from, const fs::path& to, const std::string& rel,
                      const std::set<std::string>& skip) {
  std::error_code ec;
  fs::create_directories(to, ec);
  if (ec) throw IoError(fmt::format("cannot create {}: {}", to.string(), ec.message()));
  for (const auto& de : fs::directory_iterator(from)) {
    const std::string name = de.path().filename().string(), r = rel + "/" + name;
    if (skip.count(r)) continue;
    if (de.is_symlink(ec))
      fs::copy_symlink(de.path(), to / name, ec);  // symlinks inside sub-folders are copied, never followed
    else if (de.is_directory(ec))
      copy_tree_except(de.path(), to / name, r, skip);
    else
      fs::copy_file(de.path(), to / name, fs::copy_options::none, ec);
    if (ec)
      throw IoError(
          fmt::format("cannot copy {} to {}: {}", de.path().string(), (to / name).string(), ec.message()));
  }
}

const st::File* shard(const Folder& f, const std::string& name) {
  for (const auto& [n, file] : f.files)
    if (n == name) return &file;
  return nullptr;
}

}  // namespace

void check_paths(const fs::path& in, const fs::path& out) {
  std::error_code ec;
  if (!fs::exists(in, ec)) throw InvalidArgument(fmt::format("input {} does not exist", in.string()));
  if (fs::exists(fs::symlink_status(out, ec))) {
    if (fs::equivalent(in, out, ec))
      throw InvalidArgument(fmt::format("output {} is the input", out.string()));
    throw InvalidArgument(fmt::format("output {} already exists; refusing to overwrite", out.string()));
  }
  const fs::path ain = fs::weakly_canonical(in, ec), aout = fs::weakly_canonical(out, ec);
  if (ain == aout) throw InvalidArgument(fmt::format("output {} is the input", out.string()));
  if (fs::is_directory(in)) {
    auto [a, b] = std::mismatch(ain.begin(), ain.end(), aout.begin(), aout.end());
    if (a == ain.end())
      throw InvalidArgument(
          fmt::format("output {} lies inside the input folder {}", out.string(), in.string()));
  }
  fs::path parent = out.parent_path();
  if (parent.empty()) parent = ".";
  if (!fs::is_directory(parent, ec))
    throw InvalidArgument(fmt::format("output folder {} does not exist", parent.string()));
}

TempDir::TempDir(fs::path dest) : dest_(std::move(dest)), tmp_(st::prepare_temporary(dest_)) {
  std::error_code ec;
  if (!fs::create_directory(tmp_, ec) || ec)
    throw IoError(fmt::format("{}: cannot create temporary folder: {}", tmp_.string(),
                              ec ? ec.message() : "already exists"));
}

TempDir::~TempDir() {
  if (!done_) {
    std::error_code ec;
    fs::remove_all(tmp_, ec);
  }
}

void TempDir::commit() {
  if (::renameat2(AT_FDCWD, tmp_.c_str(), AT_FDCWD, dest_.c_str(), RENAME_NOREPLACE) != 0) {
    if (errno == EEXIST)
      throw InvalidArgument(fmt::format("output {} already exists; refusing to overwrite", dest_.string()));
    throw IoError(fmt::format("{}: cannot rename {} into place: {}", dest_.string(), tmp_.string(),
                              std::strerror(errno)));
  }
  done_ = true;
}

// A top-level entry copied unchanged must not, through a symlink, bring a
// file from elsewhere on this machine into the output, nor be a loop.
void check_plain_entry(const fs::path& folder, const std::string& name) {
  const fs::path p = folder / name;
  std::error_code ec;
  if (!fs::is_symlink(fs::symlink_status(p, ec))) return;
  (void)fs::status(p, ec);
  if (ec == std::errc::too_many_symbolic_link_levels)
    throw FormatError(fmt::format("{}: '{}' is a symlink loop ({})", folder.string(), name, ec.message()));
  if (ec)
    throw FormatError(
        fmt::format("{}: '{}' is a dangling symlink ({})", folder.string(), name, ec.message()));
  const fs::path target = fs::canonical(p, ec), base = fs::canonical(folder, ec);
  auto [b, t] = std::mismatch(base.begin(), base.end(), target.begin(), target.end());
  if (ec || b != base.end() || t == target.end())
    throw FormatError(fmt::format("{}: '{}' is a symlink that leaves the folder ({})", folder.string(), name,
                                  target.string()));
}

void copy_plain(const fs::path& from, const fs::path& to) {
  std::error_code ec;
  if (fs::is_directory(from, ec)) {
    // Symlinks inside sub-folders are copied as links, never followed.
    fs::copy(from, to, fs::copy_options::recursive | fs::copy_options::copy_symlinks, ec);
  } else {
    fs::copy_file(from, to, fs::copy_options::none, ec);
  }
  if (ec) throw IoError(fmt::format("cannot copy {} to {}: {}", from.string(), to.string(), ec.message()));
}

// Output path of the shard `n` ("x.safetensors" or "tensors/x.safetensors")
// in folder `root`, its sub-folder created.
fs::path out_file(const fs::path& root, const std::string& n) {
  const fs::path p = root / n;
  std::error_code ec;
  if (n.find('/') != std::string::npos && (fs::create_directories(p.parent_path(), ec), ec))
    throw IoError(fmt::format("cannot create {}: {}", p.parent_path().string(), ec.message()));
  return p;
}

void Folder::copy_other(const fs::path& in, const std::string& n, const fs::path& to) const {
  const auto it = nested.lower_bound(n + "/");
  if (it != nested.end() && it->starts_with(n + "/"))
    copy_tree_except(in / n, to, n, nested);
  else
    copy_plain(in / n, to);
}

Folder open_folder(const fs::path& in) {
  Folder f;
  if ((f.manifest = read_manifest_export(in))) {
    for (const auto& p : f.manifest->shards)
      f.files.emplace_back("tensors/" + p.filename().string(), st::File::open(p));
    return f;
  }
  std::vector<std::string> names;
  for (const auto& de : fs::directory_iterator(in)) names.push_back(de.path().filename().string());
  std::sort(names.begin(), names.end());
  for (const auto& n : names) {
    if (n == st::kIndexFileName) {
      st::resolve_inside(in, n, (in / n).string());
      f.index = st::read_shard_index(in / n);
    } else if (n.ends_with(".safetensors")) {
      const fs::path p = st::resolve_inside(in, n, in.string());
      f.files.emplace_back(n, st::File::open(p));
    } else {
      check_plain_entry(in, n);
      f.others.push_back(n);
    }
  }
  // Shards an index lists in a sub-folder (tensors/model-00001.safetensors),
  // checked to resolve inside the folder by read_shard_index.
  if (f.index)
    for (const auto& s : f.index->shards)
      if (s.find('/') != std::string::npos && f.nested.insert(s).second)
        f.files.emplace_back(s, st::File::open(st::resolve_shard(in, s, (in / st::kIndexFileName).string())));
  std::sort(f.files.begin(), f.files.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  if (f.files.empty())
    throw InvalidArgument(fmt::format("{}: the folder holds no .safetensors file", in.string()));
  return f;
}

void check_index_tensors(const Folder& f, const fs::path& in) {
  if (!f.index) return;
  const std::string label = (in / st::kIndexFileName).string();
  for (const auto& [tensor, s] : f.index->weight_map) {
    const st::File* file = shard(f, s);
    if (!file)
      throw FormatError(
          fmt::format("{}: weight_map['{}']: shard '{}' is not a safetensors file", label, tensor, s));
    if (!file->find(tensor))
      throw FormatError(fmt::format("{}: weight_map['{}']: shard '{}' has no such tensor", label, tensor, s));
  }
}

void write_file(const fs::path& dest, std::string_view bytes) {
  st::AtomicFile f(dest);
  f.write(bytes);
  f.commit();
}

// --- the shard index -------------------------------------------------------

ojson parse_index_json(const std::string& raw, const std::string& label) {
  try {
    return ojson::parse(raw);
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(fmt::format("{}: {}", label, json_error_text(e)));
  }
}

std::optional<std::string> edit_index(ojson index, const IndexEdit& edit) {
  bool changed = false;
  if (edit.weight_map) {
    ojson wm = ojson::object();
    for (const auto& [tensor, s] : *edit.weight_map) {
      const auto names = edit.rename ? edit.rename(tensor, s) : std::nullopt;
      if (!names) {
        wm[tensor] = s;
      } else {
        for (const std::string& n : *names) wm[n] = s;
      }
    }
    index["weight_map"] = std::move(wm);  // an existing key keeps its place
    changed = true;
  }
  const auto set_total_size = [&](ojson& meta) {
    if (auto ts = meta.find("total_size"); edit.total_size && ts != meta.end() && ts->is_number()) {
      *ts = *edit.total_size;
      changed = true;
    }
  };
  if (!edit.original) {
    if (auto m = index.find("metadata"); m != index.end() && m->is_object()) set_total_size(*m);
    if (!changed) return std::nullopt;
    return index.dump(2) + "\n";
  }
  ojson mark = ojson::object();
  mark["version"] = kContainerVersion;
  mark["original_index"] = *edit.original;
  mark["original_index_crc32"] = crc_of(*edit.original);
  ojson meta = ojson::object();
  if (auto m = index.find("metadata"); m != index.end() && m->is_object()) meta = *m;
  set_total_size(meta);
  meta[kIndexKey] = std::move(mark);
  ojson out = ojson::object();
  out["metadata"] = std::move(meta);
  for (auto it = index.begin(); it != index.end(); ++it)
    if (it.key() != "metadata") out[it.key()] = it.value();
  return out.dump(2) + "\n";
}

IndexEdit renaming(const std::vector<std::pair<std::string, std::string>>& weight_map,
                   const std::map<std::string, std::string>& names) {
  IndexEdit edit;
  edit.weight_map = &weight_map;
  edit.rename = [&names](const std::string& tensor,
                         const std::string&) -> std::optional<std::vector<std::string>> {
    const auto it = names.find(tensor);
    if (it == names.end()) return std::nullopt;
    return std::vector<std::string>{it->second};
  };
  return edit;
}

// The original index bytes, if `raw` is a rewritten index; CorruptData on a CRC mismatch.
std::optional<std::string> original_index(const std::string& raw, const std::string& label) {
  ojson j;
  try {
    j = ojson::parse(raw);
  } catch (const nlohmann::json::exception&) {
    return std::nullopt;
  }
  if (!j.is_object()) return std::nullopt;
  auto m = j.find("metadata");
  if (m == j.end() || !m->is_object()) return std::nullopt;
  auto k = m->find(kIndexKey);
  if (k == m->end()) return std::nullopt;
  if (!k->is_object() || !k->contains("original_index") || !(*k)["original_index"].is_string() ||
      !k->contains("original_index_crc32") || !(*k)["original_index_crc32"].is_number_unsigned())
    throw FormatError(label + ": metadata.csfmoe must hold original_index and original_index_crc32");
  std::string o = (*k)["original_index"].get<std::string>();
  if (crc_of(o) != (*k)["original_index_crc32"].get<std::uint64_t>())
    throw CorruptData(label + ": CRC32 of the preserved original index does not match");
  return o;
}

}  // namespace csfmoe::detail
