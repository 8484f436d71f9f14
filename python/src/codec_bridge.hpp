// Building codec objects from binding arguments (shared by the codec, CUDA
// and MoE bindings).
#pragma once

#include <cstdint>
#include <string>

#include "common.hpp"
#include "csfmoe/codec.hpp"

namespace csfmoe::py {

// Grid shape from Python arguments; InvalidArgument on a bad dimension, format or layout.
GridShape grid_arg(const std::string& format, const std::string& layout, std::int64_t experts,
                   std::int64_t rows, std::int64_t cols);
// Host CsfTensor (copies of the parts; not validated).
CsfTensor tensor_from_parts(const GridShape& shape, const Array& fixed, const Array& exceptions,
                            const Array& row_prefix, const Array& partition_index);

}  // namespace csfmoe::py
