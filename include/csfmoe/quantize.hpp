// Quantizers and dequantizers for NVFP4 (ModelOpt recipe) and MXFP4 (OCP MX
// recipe). They make test data and let users quantize BF16 weights; the CSF
// codec never changes a byte of what they produce.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "csfmoe/formats.hpp"

namespace csfmoe {

// One quantized matrix of rows x cols (cols = K, a multiple of the group size).
struct QuantizedMatrix {
  ScaleFormat format = ScaleFormat::nvfp4;
  std::size_t rows = 0;
  std::size_t cols = 0;
  std::vector<std::uint8_t> packed;  // [rows, cols / 2]; low nibble = even element
  std::vector<std::uint8_t> scales;  // [rows, cols / group_size], row-major
  float global_scale = 1.0f;         // NVFP4 weight_scale_2; 1 for MXFP4
};

// NVFP4, ModelOpt recipe: global = amax / (6 * 448) (1 if amax == 0);
// block scale = e4m3(block_amax / 6 / global); element = e2m1(x / (scale * global)).
// global_scale_override > 0 uses that global scale instead (e.g. shared w1/w3).
QuantizedMatrix quantize_nvfp4(std::span<const float> x, std::size_t rows, std::size_t cols,
                               float global_scale_override = 0.0f);

// MXFP4, OCP MX v1.0 recipe: shared exponent = floor(log2(block_amax)) - 2
// (E2M1 emax), clamped to E8M0's range; elements = e2m1(x / 2^exp) saturated.
QuantizedMatrix quantize_mxfp4(std::span<const float> x, std::size_t rows, std::size_t cols);

// Exact dequantization to float: e2m1(v) * scale(s) [* global].
std::vector<float> dequantize(const QuantizedMatrix& q);

// Value of element (row, col) without materializing the whole matrix.
float dequantize_element(const QuantizedMatrix& q, std::size_t row, std::size_t col);

}  // namespace csfmoe
