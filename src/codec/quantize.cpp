// NVFP4 (ModelOpt recipe) and MXFP4 (OCP MX v1.0 recipe) quantizers.
//
// Choices where the recipes leave something open, written down here:
//  - NVFP4 all-zero tensor: global scale 1 (header contract). All-zero block:
//    ModelOpt sets the block's float scale to 1.0 before the FP8 cast, so its
//    scale byte is 0x38 (not 0x00); we keep that for bit-exact checkpoints.
//    A block whose scale rounds to FP8 zero divides by zero exactly as
//    ModelOpt does; those elements become +-6 codes and still dequantize to 0.
//  - MXFP4 all-zero block: floor(log2(0)) is taken as below E8M0's range, so
//    the exponent clamps to -127 and the scale byte is 0x00 (2^-127), the
//    smallest scale; the OCP reference (microxcaling) gives the same byte.
//  - NaN or infinite inputs are rejected: neither recipe defines them.
#include "csfmoe/quantize.hpp"

#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "csfmoe/errors.hpp"
#include "csfmoe/formats.hpp"

namespace csfmoe {
namespace {

void check_input(const char* who, std::span<const float> x, std::size_t rows, std::size_t cols,
                 ScaleFormat f) {
  const unsigned g = group_size(f);
  if (rows == 0 || cols == 0)
    throw InvalidArgument(std::string(who) + ": matrix shape " + std::to_string(rows) + " x " +
                          std::to_string(cols) + " has a zero dimension");
  if (cols % g != 0)
    throw InvalidArgument(std::string(who) + ": cols " + std::to_string(cols) +
                          " is not a multiple of the group size " + std::to_string(g));
  if (rows > std::numeric_limits<std::size_t>::max() / cols || x.size() != rows * cols)
    throw InvalidArgument(std::string(who) + ": input has " + std::to_string(x.size()) +
                          " values but the shape " + std::to_string(rows) + " x " + std::to_string(cols) +
                          " needs " + std::to_string(rows * cols));
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i]))
      throw InvalidArgument(std::string(who) + ": input value at row " + std::to_string(i / cols) + ", col " +
                            std::to_string(i % cols) + " is " + (std::isnan(x[i]) ? "NaN" : "infinite") +
                            "; only finite values can be quantized");
  }
}

QuantizedMatrix make_output(ScaleFormat f, std::size_t rows, std::size_t cols) {
  QuantizedMatrix q;
  q.format = f;
  q.rows = rows;
  q.cols = cols;
  q.packed.assign(rows * cols / 2, 0);
  q.scales.assign(rows * (cols / group_size(f)), 0);
  q.global_scale = 1.0f;
  return q;
}

void put_nibble(std::vector<std::uint8_t>& packed, std::size_t index, std::uint8_t code) {
  std::uint8_t& byte = packed[index / 2];
  // Low nibble holds the even element.
  byte = (index % 2 == 0) ? static_cast<std::uint8_t>((byte & 0xF0u) | code)
                          : static_cast<std::uint8_t>((byte & 0x0Fu) | (code << 4));
}

std::uint8_t get_nibble(const std::vector<std::uint8_t>& packed, std::size_t index) {
  const std::uint8_t byte = packed[index / 2];
  return (index % 2 == 0) ? static_cast<std::uint8_t>(byte & 0x0Fu) : static_cast<std::uint8_t>(byte >> 4);
}

// ModelOpt's packer sets the sign bit only for quotients < 0, so -0.0 (and
// a NaN from 0 / 0) packs with a clear sign bit.
std::uint8_t element_code(float q) {
  const std::uint8_t code = float_to_e2m1(q);
  return q < 0.0f ? code : static_cast<std::uint8_t>(code & 0x7u);
}

void check_quantized(const char* who, const QuantizedMatrix& q) {
  if (q.format != ScaleFormat::nvfp4 && q.format != ScaleFormat::mxfp4)
    throw InvalidArgument(std::string(who) + ": quantized matrix has an unknown scale format " +
                          std::to_string(static_cast<unsigned>(q.format)));
  const unsigned g = group_size(q.format);
  if (q.rows == 0 || q.cols == 0 || q.cols % g != 0)
    throw InvalidArgument(std::string(who) + ": quantized matrix shape " + std::to_string(q.rows) + " x " +
                          std::to_string(q.cols) + " is invalid for " + std::string(to_string(q.format)) +
                          " (non-zero, cols a multiple of " + std::to_string(g) + ")");
  if (q.rows > std::numeric_limits<std::size_t>::max() / q.cols)
    throw InvalidArgument(std::string(who) + ": quantized matrix shape overflows");
  if (q.packed.size() != q.rows * q.cols / 2)
    throw InvalidArgument(std::string(who) + ": packed holds " + std::to_string(q.packed.size()) +
                          " bytes, expected rows * cols / 2 = " + std::to_string(q.rows * q.cols / 2));
  if (q.scales.size() != q.rows * (q.cols / g))
    throw InvalidArgument(std::string(who) + ": scales holds " + std::to_string(q.scales.size()) +
                          " bytes, expected rows * cols / " + std::to_string(g) + " = " +
                          std::to_string(q.rows * (q.cols / g)));
  if (q.format == ScaleFormat::mxfp4 && q.global_scale != 1.0f)
    throw InvalidArgument(std::string(who) + ": MXFP4 has no global scale, but global_scale is " +
                          std::to_string(q.global_scale));
}

// Block scale times global, as a float. NVFP4 multiplies in binary32 like
// ModelOpt; MXFP4 scales are exact powers of two.
float block_scale_value(const QuantizedMatrix& q, std::uint8_t s) {
  return q.format == ScaleFormat::nvfp4 ? e4m3fn_to_float(s) : e8m0_to_float(s);
}

}  // namespace

QuantizedMatrix quantize_nvfp4(std::span<const float> x, std::size_t rows, std::size_t cols,
                               float global_scale_override) {
  check_input("quantize_nvfp4", x, rows, cols, ScaleFormat::nvfp4);
  if (!(global_scale_override >= 0.0f) || std::isinf(global_scale_override))
    throw InvalidArgument("quantize_nvfp4: global_scale_override " + std::to_string(global_scale_override) +
                          " must be a finite value > 0 (or 0 for the tensor's own)");
  constexpr std::size_t g = 16;
  QuantizedMatrix q = make_output(ScaleFormat::nvfp4, rows, cols);

  float global = global_scale_override;
  if (global == 0.0f) {
    float amax = 0.0f;
    for (float v : x) amax = std::fmax(amax, std::fabs(v));
    global = amax == 0.0f ? 1.0f : amax / (6.0f * 448.0f);
  }
  q.global_scale = global;

  const std::size_t blocks_per_row = cols / g;
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t b = 0; b < blocks_per_row; ++b) {
      const float* blk = x.data() + r * cols + b * g;
      float amax = 0.0f;
      for (std::size_t i = 0; i < g; ++i) amax = std::fmax(amax, std::fabs(blk[i]));
      // ModelOpt: (amax / 6) / global, zero scales replaced by 1, clamp to the
      // FP8 range, then cast (RNE).
      const float per_block = amax / 6.0f;
      float s = per_block == 0.0f ? 1.0f : per_block / global;
      s = std::fmin(s, 448.0f);
      const std::uint8_t code = float_to_e4m3fn(s);
      q.scales[r * blocks_per_row + b] = code;
      const float eff = e4m3fn_to_float(code) * global;
      for (std::size_t i = 0; i < g; ++i)
        put_nibble(q.packed, r * cols + b * g + i, element_code(blk[i] / eff));
    }
  }
  return q;
}

QuantizedMatrix quantize_mxfp4(std::span<const float> x, std::size_t rows, std::size_t cols) {
  check_input("quantize_mxfp4", x, rows, cols, ScaleFormat::mxfp4);
  constexpr std::size_t g = 32;
  constexpr int kEmaxElem = 2;  // E2M1's largest exponent: 6 = 1.5 * 2^2
  QuantizedMatrix q = make_output(ScaleFormat::mxfp4, rows, cols);
  const std::size_t blocks_per_row = cols / g;
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t b = 0; b < blocks_per_row; ++b) {
      const float* blk = x.data() + r * cols + b * g;
      float amax = 0.0f;
      for (std::size_t i = 0; i < g; ++i) amax = std::fmax(amax, std::fabs(blk[i]));
      // ilogb is floor(log2) exactly, subnormals included; zero counts as
      // below the range and clamps with them.
      int e = amax == 0.0f ? -127 : std::ilogb(amax) - kEmaxElem;
      if (e < -127) e = -127;
      if (e > 127) e = 127;
      q.scales[r * blocks_per_row + b] = static_cast<std::uint8_t>(e + 127);
      // x / 2^e by ldexp: exact except where the quotient falls far below the
      // smallest E2M1 step, which rounds to zero either way.
      for (std::size_t i = 0; i < g; ++i)
        put_nibble(q.packed, r * cols + b * g + i, element_code(std::ldexp(blk[i], -e)));
    }
  }
  return q;
}

std::vector<float> dequantize(const QuantizedMatrix& q) {
  check_quantized("dequantize", q);
  const std::size_t g = group_size(q.format);
  const bool nv = q.format == ScaleFormat::nvfp4;
  std::vector<float> out(q.rows * q.cols);
  for (std::size_t i = 0; i < out.size(); ++i) {
    const std::size_t r = i / q.cols, c = i % q.cols;
    const float s = block_scale_value(q, q.scales[r * (q.cols / g) + c / g]);
    // e2m1 * scale is exact (2- and 4-bit significands), so the product with
    // the global rounds once.
    const float v = e2m1_to_float(get_nibble(q.packed, i)) * s;
    out[i] = nv ? v * q.global_scale : v;
  }
  return out;
}

float dequantize_element(const QuantizedMatrix& q, std::size_t row, std::size_t col) {
  check_quantized("dequantize_element", q);
  if (row >= q.rows || col >= q.cols)
    throw InvalidArgument("dequantize_element: element (" + std::to_string(row) + ", " + std::to_string(col) +
                          ") is outside the " + std::to_string(q.rows) + " x " + std::to_string(q.cols) +
                          " matrix");
  const std::size_t g = group_size(q.format);
  const float s = block_scale_value(q, q.scales[row * (q.cols / g) + col / g]);
  const float v = e2m1_to_float(get_nibble(q.packed, row * q.cols + col)) * s;
  return q.format == ScaleFormat::nvfp4 ? v * q.global_scale : v;
}

}  // namespace csfmoe
