// Checkpoints written by b12x / vLLM (internal; docs/container-format.md,
// "Files written by b12x / vLLM"): plain safetensors files in which a
// block-scale tensor X is replaced by its canonical planes
// X.nvfp4_csf_fixed + X.nvfp4_csf_exceptions (or .mxfp4_csf_*). Such a file
// is read as if X were there: every reader sees X in the logical header and
// decodes it from the planes, after checking them against b12x's rules.
// There is no checksum to compare with: the planes' structure is all a
// reader can verify.
#pragma once

#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/container.hpp"
#include "csfmoe/safetensors.hpp"

namespace csfmoe::detail {

struct ForeignB12x {
  st::Header logical;         // the file's tensors, each plane pair replaced by its scale tensor
  std::vector<CsfEntry> csf;  // one entry per scale tensor (storage b12x, crc32 unknown), in file order
  const CsfEntry* find(const std::string& name) const;
};

// The b12x view of a plain (non-container) file, or nullopt when it holds no
// plane tensor. FormatError naming `label` and the tensor for an incomplete
// pair, a plane of the wrong dtype or shape, a scale present beside its
// planes, or an MXFP4 scale whose column count no companion weight gives
// (X.weight, X.weight_packed or the stem's .weight / _blocks).
std::optional<ForeignB12x> foreign_b12x(const st::File& file, const std::string& label);

// b12x's manifest-based export: a folder with manifest.json and
// build-contract.json (same schema "lil-nvfp4-csf-checkpoint/1" or
// "lil-mxfp4-csf-checkpoint/1", the schema's codec id, the same family if
// named), the shards under tensors/ (manifest "shards": [{"file": ...}]), the
// contract's "source_names" mapping every source tensor to its shard, and the
// Hugging Face files under metadata/.
struct ManifestExport {
  std::string schema, codec;
  ScaleFormat format = ScaleFormat::nvfp4;
  std::vector<std::filesystem::path> shards;  // resolved, under tensors/, in manifest order
  // Source tensor -> shard file name; plane names listed in the contract
  // stand for their scale tensor.
  std::map<std::string, std::string> source_names;
};
inline constexpr const char* kManifestFile = "manifest.json";
inline constexpr const char* kBuildContractFile = "build-contract.json";
// nullopt when `folder` has neither file; FormatError naming the file and the
// field for anything else that breaks the rules above (one file without the
// other, an unknown schema, a codec or family that disagrees, a shard name
// that is not a plain .safetensors name or is missing, source names whose
// shards are not exactly the manifest's).
std::optional<ManifestExport> read_manifest_export(const std::filesystem::path& folder);

}  // namespace csfmoe::detail
