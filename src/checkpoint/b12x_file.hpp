// Checkpoints written by b12x / vLLM (internal; docs/container-format.md,
// "Files written by b12x / vLLM"): plain safetensors files in which a
// block-scale tensor X is replaced by its canonical planes
// X.nvfp4_csf_fixed + X.nvfp4_csf_exceptions (or .mxfp4_csf_*). Such a file
// is read as if X were there: every reader sees X in the logical header and
// decodes it from the planes, after checking them against b12x's rules.
// There is no checksum to compare with: the planes' structure is all a
// reader can verify.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "checkpoint/container.hpp"
#include "csfmoe/safetensors.hpp"

namespace csfmoe::detail {

struct ForeignB12x {
  st::Header logical;          // the file's tensors, each plane pair replaced by its scale tensor
  std::vector<CsfEntry> csf;   // one entry per scale tensor (storage b12x, crc32 unknown), in file order
  const CsfEntry* find(const std::string& name) const;
};

// The b12x view of a plain (non-container) file, or nullopt when it holds no
// plane tensor. FormatError naming `label` and the tensor for an incomplete
// pair, a plane of the wrong dtype or shape, a scale present beside its
// planes, or an MXFP4 scale whose column count no companion weight gives
// (X.weight, X.weight_packed or the stem's .weight / _blocks).
std::optional<ForeignB12x> foreign_b12x(const st::File& file, const std::string& label);

}  // namespace csfmoe::detail
