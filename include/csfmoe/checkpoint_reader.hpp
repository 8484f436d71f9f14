// Reading the tensors of a safetensors file, plain or CSF container, one
// tensor at a time, with the per-tensor checks of `csf verify`: the library's
// one reader, used by the MoE layer loader and the Python package.
//
// A plain file is only validated structurally (safetensors has no checksums).
// For a container, open() checks the descriptor and the restore record
// against the original header; then every tensor handed out is CRC-checked
// against the restore record first: a native tensor over its stored bytes,
// a CSF tensor by validating its four parts and decoding them once on the
// host. A mismatch throws CorruptData naming the file and the tensor.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "csfmoe/codec.hpp"
#include "csfmoe/formats.hpp"
#include "csfmoe/safetensors.hpp"

namespace csfmoe {

// A tensor stored as CSF in a container.
struct CsfEntryInfo {
  std::string name;  // the original tensor's name
  st::Dtype dtype = st::Dtype::U8;
  std::vector<std::uint64_t> shape;  // the original tensor's shape
  GridShape grid;
  std::uint32_t crc32 = 0;  // of the original tensor bytes
  std::uint64_t exceptions = 0;
  std::string layer;  // MoE layer key, or ""
  // How the parts are stored ("resident", "planes" or "b12x";
  // docs/container-format.md) and the names of the part tensors.
  std::string storage;
  std::vector<std::string> parts;
  // False for a file written by b12x / vLLM, which holds no checksum: its
  // planes are checked against b12x's rules only.
  bool has_crc32 = true;
};

// A block-scale tensor that a container keeps native, and why.
struct KeptNativeInfo {
  ScaleFormat format = ScaleFormat::nvfp4;
  std::string layer;
  std::string reason;
};

class CheckpointFile {
 public:
  // IoError / FormatError (malformed file, descriptor or restore record).
  static CheckpointFile open(const std::filesystem::path& path);
  CheckpointFile(CheckpointFile&&) noexcept;
  CheckpointFile& operator=(CheckpointFile&&) noexcept;
  ~CheckpointFile();

  const std::filesystem::path& path() const;
  bool is_container() const;
  // A plain file written by b12x / vLLM: block-scale tensors replaced by
  // their canonical planes (X.nvfp4_csf_fixed + X.nvfp4_csf_exceptions, or
  // .mxfp4_csf_*). Its logical tensors hold X in their place; reading X
  // checks the planes against b12x's rules and decodes them (no CRC exists).
  bool is_b12x() const;
  // The file's own __metadata__ (a container's includes its csfmoe.* keys).
  const std::optional<st::Metadata>& metadata() const;
  // The logical tensors: those of the original file for a container (the
  // CSF parts are not among them), the file's own otherwise. Offsets refer
  // to the original data section; use read() / native_bytes() for data.
  const st::Header& header() const;
  const std::vector<st::TensorInfo>& tensors() const { return header().tensors; }
  const st::TensorInfo* find(std::string_view name) const { return header().find(name); }

  // Tensors stored as CSF (empty for a plain file), in original data order.
  const std::vector<CsfEntryInfo>& csf_entries() const;
  const CsfEntryInfo* csf_entry(std::string_view name) const;
  const std::map<std::string, KeptNativeInfo>& native_kept() const;

  // The stored bytes of a logical tensor that is not CSF (a view of the
  // mapping, valid while this object lives), CRC-checked for a container.
  std::span<const std::uint8_t> native_bytes(std::string_view name) const;
  // The validated parts of a CSF tensor, CRC-checked by decoding them once.
  CsfTensor csf_parts(std::string_view name, const CodecOptions& options = {}) const;
  // The original bytes of any logical tensor (decoded if CSF), CRC-checked.
  std::vector<std::uint8_t> read(std::string_view name, const CodecOptions& options = {}) const;

 private:
  struct Impl;
  explicit CheckpointFile(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The safetensors files of a checkpoint: a file itself; for a folder, the
// shards its model.safetensors.index.json names (validated as
// st::read_shard_index does) or else every *.safetensors in it, by name.
// Each must resolve inside the folder. InvalidArgument if there are none.
std::vector<std::filesystem::path> checkpoint_files(const std::filesystem::path& checkpoint);

}  // namespace csfmoe
