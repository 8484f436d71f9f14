// Writing new safetensors files (quantize, synth) through csfmoe::st::Writer,
// which goes through a temporary file and renames at the end.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "csfmoe/safetensors.hpp"

namespace csfmoe::cli {

// One tensor to write; `write` must hand the writer exactly
// product(shape) * dtype_size bytes (Writer::end_tensor checks).
struct OutTensor {
  std::string name;
  st::Dtype dtype = st::Dtype::U8;
  std::vector<std::uint64_t> shape;
  std::function<void(st::Writer&)> write;
};

// Writes all tensors in order; on any error no file is left at `out`.
void write_safetensors(const std::filesystem::path& out, const std::vector<OutTensor>& tensors,
                       const st::Metadata& metadata);

}  // namespace csfmoe::cli
