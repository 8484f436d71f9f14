// CheckpointFile: per-tensor, CRC-checked reading of plain files and CSF
// containers (csfmoe/checkpoint_reader.hpp).
#include <fmt/format.h>

#include <algorithm>

#include "checkpoint/b12x_file.hpp"
#include "checkpoint/container.hpp"
#include "csfmoe/checkpoint_reader.hpp"
#include "csfmoe/errors.hpp"

namespace csfmoe {
namespace fs = std::filesystem;
using namespace detail;

struct CheckpointFile::Impl {
  st::File file;
  std::optional<ContainerInfo> info;
  std::optional<ForeignB12x> foreign;  // a plain file holding b12x planes
  st::Header logical;
  std::vector<CsfEntryInfo> entries;
  std::map<std::string, KeptNativeInfo> kept;

  std::string label() const { return file.path().string(); }

  const CsfEntry* entry(std::string_view name) const {
    if (info) return info->find(std::string(name));
    return foreign ? foreign->find(std::string(name)) : nullptr;
  }

  const st::TensorInfo& logical_tensor(std::string_view name) const {
    const st::TensorInfo* t = logical.find(name);
    if (!t) throw InvalidArgument(fmt::format("{}: no tensor named '{}'", label(), name));
    return *t;
  }

  void check_crc(std::string_view name, std::span<const std::uint8_t> bytes, std::uint32_t want,
                 const char* what) const {
    const std::uint32_t got = crc_of(bytes);
    if (got != want)
      throw CorruptData(fmt::format("{}: tensor '{}': CRC32 of the {} is {:08x}, expected {:08x}", label(),
                                    name, what, got, want));
  }

  // Decodes validated parts to their source layout, checking the original's
  // CRC where the file has one (a b12x / vLLM file has none).
  std::vector<std::uint8_t> decode_checked(const CsfEntry& e, const CsfTensor& enc, const st::TensorInfo& t,
                                           const CodecOptions& options) const {
    return detail::decode_checked(enc, e, t.nbytes(), label(), options, info.has_value());
  }
};

CheckpointFile::CheckpointFile(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CheckpointFile::CheckpointFile(CheckpointFile&&) noexcept = default;
CheckpointFile& CheckpointFile::operator=(CheckpointFile&&) noexcept = default;
CheckpointFile::~CheckpointFile() = default;

CheckpointFile CheckpointFile::open(const fs::path& path) {
  auto impl = std::make_unique<Impl>(Impl{st::File::open(path), std::nullopt, std::nullopt, {}, {}, {}});
  const std::string label = impl->label();
  impl->info = get_container_metadata(impl->file.header().metadata, label);
  if (!impl->info) {
    impl->foreign = foreign_b12x(impl->file, label);
    if (!impl->foreign) {
      impl->logical = impl->file.header();
      return CheckpointFile(std::move(impl));
    }
    impl->logical = impl->foreign->logical;
    for (const auto& e : impl->foreign->csf)
      impl->entries.push_back(CsfEntryInfo{e.name, e.dtype, e.shape, e.grid, e.crc32, e.exceptions, e.layer,
                                           std::string(to_string(e.storage)),
                                           stored_part_names(e.name, e.storage, e.grid.format), false});
    return CheckpointFile(std::move(impl));
  }
  const ContainerInfo& info = *impl->info;
  const std::string& h = info.original_header;
  if (8 + h.size() > info.original_file_size)
    throw FormatError(fmt::format("{}: original header ({} bytes) does not fit the original file size {}",
                                  label, h.size(), info.original_file_size));
  impl->logical = st::parse_header(h, info.original_file_size - 8 - h.size(), label + " (original header)");
  for (const auto& t : impl->logical.tensors) {
    if (const CsfEntry* e = info.find(t.name)) {
      if (t.dtype != e->dtype || t.shape != e->shape)
        throw FormatError(fmt::format(
            "{}: tensor '{}': the CSF descriptor disagrees with the original header", label, t.name));
      continue;
    }
    const st::TensorInfo* ct = impl->file.find(t.name);
    if (!ct || ct->dtype != t.dtype || ct->shape != t.shape)
      throw FormatError(fmt::format("{}: tensor '{}' of the original header is {} in the container", label,
                                    t.name, ct ? "different" : "missing"));
    if (!info.native_crc32.count(t.name))
      throw FormatError(fmt::format("{}: tensor '{}': no CRC32 in the restore record", label, t.name));
  }
  for (const auto& e : info.csf) {
    if (!impl->logical.find(e.name))
      throw FormatError(
          fmt::format("{}: tensor '{}': in the descriptor but not in the original header", label, e.name));
    impl->entries.push_back(CsfEntryInfo{e.name, e.dtype, e.shape, e.grid, e.crc32, e.exceptions, e.layer,
                                         std::string(to_string(e.storage)),
                                         stored_part_names(e.name, e.storage, e.grid.format), true});
  }
  for (const auto& [name, k] : info.native_kept)
    impl->kept[name] = KeptNativeInfo{k.format, k.layer, k.reason};
  return CheckpointFile(std::move(impl));
}

const fs::path& CheckpointFile::path() const { return impl_->file.path(); }
bool CheckpointFile::is_container() const { return impl_->info.has_value(); }
bool CheckpointFile::is_b12x() const { return impl_->foreign.has_value(); }
const std::optional<st::Metadata>& CheckpointFile::metadata() const { return impl_->file.header().metadata; }
const st::Header& CheckpointFile::header() const { return impl_->logical; }
const std::vector<CsfEntryInfo>& CheckpointFile::csf_entries() const { return impl_->entries; }
const std::map<std::string, KeptNativeInfo>& CheckpointFile::native_kept() const { return impl_->kept; }

const CsfEntryInfo* CheckpointFile::csf_entry(std::string_view name) const {
  for (const auto& e : impl_->entries)
    if (e.name == name) return &e;
  return nullptr;
}

std::span<const std::uint8_t> CheckpointFile::native_bytes(std::string_view name) const {
  const Impl& m = *impl_;
  const st::TensorInfo& t = m.logical_tensor(name);
  if (m.entry(name))
    throw InvalidArgument(fmt::format("{}: tensor '{}' is stored as CSF; read its parts", m.label(), name));
  if (!m.info) return m.file.data(t);
  const st::TensorInfo* ct = m.file.find(name);  // present and matching: checked by open()
  const auto data = m.file.data(*ct);
  m.check_crc(name, data, m.info->native_crc32.at(t.name), "stored tensor");
  return data;
}

CsfTensor CheckpointFile::csf_parts(std::string_view name, const CodecOptions& options) const {
  const Impl& m = *impl_;
  const st::TensorInfo& t = m.logical_tensor(name);
  const CsfEntry* e = m.entry(name);
  if (!e) throw InvalidArgument(fmt::format("{}: tensor '{}' is not stored as CSF", m.label(), name));
  CsfTensor enc = load_csf_parts(m.file, *e, m.label());
  (void)m.decode_checked(*e, enc, t, options);
  return enc;
}

std::vector<std::uint8_t> CheckpointFile::read(std::string_view name, const CodecOptions& options) const {
  const Impl& m = *impl_;
  const st::TensorInfo& t = m.logical_tensor(name);
  if (const CsfEntry* e = m.entry(name))
    return m.decode_checked(*e, load_csf_parts(m.file, *e, m.label()), t, options);
  const auto d = native_bytes(name);
  return std::vector<std::uint8_t>(d.begin(), d.end());
}

std::vector<fs::path> checkpoint_files(const fs::path& checkpoint) {
  std::error_code ec;
  if (!fs::exists(checkpoint, ec))
    throw IoError(fmt::format("checkpoint {} does not exist", checkpoint.string()));
  if (!fs::is_directory(checkpoint, ec)) return {checkpoint};
  if (auto x = read_manifest_export(checkpoint)) return x->shards;  // b12x's export: its tensors/ shards
  std::vector<fs::path> out;
  const fs::path index = checkpoint / st::kIndexFileName;
  if (fs::exists(fs::symlink_status(index, ec))) {
    st::resolve_inside(checkpoint, std::string(st::kIndexFileName), index.string());
    for (const auto& s : st::read_shard_index(index).shards)
      out.push_back(st::resolve_shard(checkpoint, s, index.string()));
  } else {
    std::vector<std::string> names;
    for (const auto& de : fs::directory_iterator(checkpoint))
      if (de.path().filename().string().ends_with(".safetensors"))
        names.push_back(de.path().filename().string());
    std::sort(names.begin(), names.end());
    for (const auto& n : names) out.push_back(st::resolve_inside(checkpoint, n, checkpoint.string()));
  }
  if (out.empty())
    throw InvalidArgument(
        fmt::format("checkpoint folder {} holds no .safetensors file", checkpoint.string()));
  return out;
}

}  // namespace csfmoe
