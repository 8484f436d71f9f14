// Checkpoint-level operations: compress the block-scale tensors of a
// safetensors file (or a sharded checkpoint folder) into CSF, restore the
// original byte for byte, verify, inspect. See docs/container-format.md.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "csfmoe/codec.hpp"
#include "csfmoe/formats.hpp"

namespace csfmoe {

// Called as tensors are processed; bytes_done/bytes_total count source bytes
// of the whole job (all shards). Called from the calling thread only.
struct Progress {
  std::uint64_t bytes_done = 0;
  std::uint64_t bytes_total = 0;
  std::string current;  // "file:tensor"
};
using ProgressFn = std::function<void(const Progress&)>;

// The __metadata__ key that names the layout of a file's scale tensors
// ("row_major" or "swizzled_128x4"); `csf synth` writes it.
inline constexpr std::string_view kScaleLayoutKey = "csfmoe.scale_layout";

// How compress stores CSF tensors.
enum class CheckpointSchema {
  // csfmoe's container: every block-scale tensor that pays as CSF, stored as
  // planes where the grid allows, else in the resident form.
  csfmoe,
  // b12x / vLLM's canonical planes under their own names (X.nvfp4_csf_fixed,
  // X.nvfp4_csf_exceptions, or .mxfp4_csf_*) for every expert projection's
  // block scales (per-expert names; a stacked [E, R, C] scale is refused),
  // whether or not CSF pays; other tensors stay native. The file stays a
  // csfmoe container too (restore record), so decompress is byte-exact.
  b12x,
};

struct CompressOptions {
  unsigned threads = 0;  // 0: all hardware threads
  // How the source's scale tensors are laid out. Unset: each file's
  // kScaleLayoutKey tag, else row_major. Set: a file whose tag says
  // otherwise is refused (InvalidArgument naming the file).
  std::optional<ScaleLayout> layout;
  bool keep_unprofitable = true;  // keep a tensor native when CSF would be larger
  ProgressFn progress;            // optional
  // compress only: tensor-parallel slice to store (tp > 1): MoE expert
  // projections are cut along N for rank tp_rank before encoding; the output
  // records tp/rank and decompresses to the sliced native file (see
  // docs/container-format.md, "Tensor-parallel slices").
  unsigned tp = 1, tp_rank = 0;
  CheckpointSchema schema = CheckpointSchema::csfmoe;
  // csfmoe schema: store an MXFP4 tensor's planes in slab form (container
  // version 3, docs/container-format.md) when that is smaller than the
  // planes; false keeps b12x's planes (a version 2 file when nothing else needs 3).
  bool mxfp4_slab = true;
};

// What happened to one tensor.
enum class TensorAction {
  csf,          // stored as CSF parts
  native_kept,  // a scale tensor kept native because CSF would not pay
  passthrough,  // not a block-scale tensor; copied as is
};

struct TensorReport {
  std::string file;   // file name inside the checkpoint
  std::string name;   // tensor name in the source
  std::string dtype;  // safetensors dtype of the source tensor
  std::vector<std::uint64_t> shape;
  TensorAction action = TensorAction::passthrough;
  std::optional<ScaleFormat> format;  // set for block-scale tensors
  std::string layer;                  // MoE layer key (e.g. "model.layers.3.mlp.experts") or ""
  std::string reason;                 // why native_kept, or ""
  // For block-scale tensors (measured even when kept native); encoded_bytes
  // is what the container stores (planes or resident form).
  CsfStats stats;
  std::uint64_t resident_bytes = 0;  // the CSF tensor's resident (device) form, when measured
  // How a CSF tensor is (or would be) stored: "resident", "planes", "b12x" or
  // "mxfp4_slab" (docs/container-format.md); "" for other tensors.
  std::string storage;
  // What b12x keeps resident for the same tensor: the same fixed slabs and
  // records plus an 8-byte offset per partition (no per-row prefix).
  std::uint64_t b12x_resident_bytes = 0;
};

// A file that holds one rank's tensor-parallel slice (compress with tp > 1;
// its csfmoe.tp / csfmoe.tp_rank metadata).
struct TpSliceInfo {
  std::string file;  // file name inside the checkpoint
  unsigned tp = 1, rank = 0;
};

struct CheckpointReport {
  std::filesystem::path path;
  std::vector<TensorReport> tensors;
  std::vector<TpSliceInfo> tp_slices;  // inspect, verify: the files that hold a TP slice
  // Totals over block-scale tensors only.
  std::uint64_t scale_source_bytes = 0;
  std::uint64_t scale_stored_bytes = 0;  // as stored (CSF or native kept)
  std::uint64_t file_source_bytes = 0;   // all tensors, source
  std::uint64_t file_stored_bytes = 0;   // all tensors, as stored
};

// in: a .safetensors file or a folder (sharded with model.safetensors.index.json,
// or any folder of .safetensors files). out: a file or folder path that must
// not exist yet (and must not be the input). Writes through temporary files
// and renames at the end: on any error no output is left behind.
CheckpointReport compress_checkpoint(const std::filesystem::path& in, const std::filesystem::path& out,
                                     const CompressOptions& options = {});

// Restores the original checkpoint byte for byte (CRC-checked per tensor and
// per file). Same output rules as compress.
void decompress_checkpoint(const std::filesystem::path& in, const std::filesystem::path& out,
                           const CompressOptions& options = {});

// Decodes every CSF tensor and checks its CRC32 against the stored one (and
// for a file written by b12x / vLLM, checks its planes against b12x's rules
// and decodes them: such files carry no checksum; and
// every tensor kept native against its CRC); throws CorruptData naming file
// and tensor on the first mismatch, and FormatError when `in` holds no CSF
// container at all. In a folder, the tensors of files that are not
// containers are listed as passthrough with reason kNotAContainer, unchecked.
inline constexpr std::string_view kNotAContainer = "not a CSF container: not checked";
// The reason on every tensor of a file written by b12x / vLLM (its planes
// checked against b12x's rules and decoded; nothing else can be checked).
inline constexpr std::string_view kB12xNoChecksum = "written by b12x / vLLM: planes checked, no checksum";
CheckpointReport verify_checkpoint(const std::filesystem::path& in, const CompressOptions& options = {});

// Statistics for a native or compressed checkpoint. For a native one the
// stats say what CSF would give; nothing is written. For a container, every
// CSF tensor is decoded and CRC-checked (CorruptData on a mismatch); the
// other tensors are not read (verify_checkpoint reads them).
CheckpointReport inspect_checkpoint(const std::filesystem::path& in, const CompressOptions& options = {});

// True if the file at path is a csfmoe-compressed safetensors file.
bool is_csf_container(const std::filesystem::path& file);

}  // namespace csfmoe
