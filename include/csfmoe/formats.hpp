// FP4 block-scaled formats: element and scale number formats (E2M1, FP8 E4M3
// "fn", E8M0, BF16), the scale-grid geometry of NVFP4 and MXFP4, and the
// 128x4 swizzled scale layout. Everything here is header-only and usable from
// CUDA device code (CSFMOE_HD).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#if defined(__CUDACC__)
#define CSFMOE_HD __host__ __device__ __forceinline__
#else
#define CSFMOE_HD inline
#endif

namespace csfmoe {

// ---------------------------------------------------------------------------
// Source formats
// ---------------------------------------------------------------------------
enum class ScaleFormat : std::uint8_t {
  nvfp4 = 0,  // E2M1 values, FP8 E4M3 scale per 16, FP32 global scale
  mxfp4 = 1,  // E2M1 values, E8M0 scale per 32, no global scale
};

enum class ScaleLayout : std::uint8_t {
  row_major = 0,       // [rows, cols] bytes, row-major
  swizzled_128x4 = 1,  // 512-byte tiles of 128 rows x 4 cols (see swizzled_index)
};

std::string_view to_string(ScaleFormat f) noexcept;
std::string_view to_string(ScaleLayout l) noexcept;
// Whether a value read from outside (a file, a caller's cast) names a known format / layout.
constexpr bool is_known(ScaleFormat f) noexcept { return f == ScaleFormat::nvfp4 || f == ScaleFormat::mxfp4; }
constexpr bool is_known(ScaleLayout l) noexcept {
  return l == ScaleLayout::row_major || l == ScaleLayout::swizzled_128x4;
}
// Parse "nvfp4"/"mxfp4" and "row_major"/"swizzled_128x4"; throw InvalidArgument otherwise.
ScaleFormat parse_scale_format(std::string_view s);
ScaleLayout parse_scale_layout(std::string_view s);

// Elements of K covered by one block scale.
constexpr unsigned group_size(ScaleFormat f) { return f == ScaleFormat::nvfp4 ? 16u : 32u; }
// CSF window width W: a row's bytes in [base, base + W) are stored as offsets.
CSFMOE_HD constexpr unsigned csf_window(ScaleFormat f) { return f == ScaleFormat::nvfp4 ? 16u : 2u; }
// Rows per slab of the CSF fixed part.
CSFMOE_HD constexpr unsigned csf_slab_rows(ScaleFormat f) { return f == ScaleFormat::nvfp4 ? 128u : 16u; }
// Rows per partition-index entry; also the row padding granule.
CSFMOE_HD constexpr unsigned csf_partition_rows(ScaleFormat f) {
  return f == ScaleFormat::nvfp4 ? 128u : 64u;
}
// Column padding granule (NVFP4 offsets follow the 128x4 swizzle).
CSFMOE_HD constexpr unsigned csf_col_granule(ScaleFormat f) { return f == ScaleFormat::nvfp4 ? 4u : 1u; }
// Positions inside one expert's grid are 24-bit.
constexpr std::uint64_t csf_max_positions = std::uint64_t{1} << 24;

CSFMOE_HD constexpr std::uint64_t round_up(std::uint64_t x, std::uint64_t m) { return (x + m - 1) / m * m; }

// Byte index of (row, col) inside a 128x4-swizzled grid whose padded column
// count is padded_cols (a multiple of 4). Tiles of 512 bytes are ordered by
// row tile, then column group.
CSFMOE_HD std::size_t swizzled_index(std::size_t row, std::size_t col, std::size_t padded_cols) {
  const std::size_t tile = (row / 128) * (padded_cols / 4) + col / 4;
  return tile * 512 + (row % 32) * 16 + ((row % 128) / 32) * 4 + (col % 4);
}

// ---------------------------------------------------------------------------
// Number formats. Decoders are exact; encoders round to nearest, ties to even.
// ---------------------------------------------------------------------------

// E2M1 (4-bit): sign, 2 exponent bits (bias 1), 1 mantissa bit.
// Magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6. Code 0x8 is -0.
CSFMOE_HD float e2m1_to_float(std::uint8_t code) {
  constexpr float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float m = mag[code & 7u];
  return (code & 8u) ? -m : m;
}
// Nearest E2M1 code, ties to even mantissa; saturates to +-6; NaN maps to +6
// (E2M1 has no NaN; quantizers never feed it one). Defined in formats.cpp.
std::uint8_t float_to_e2m1(float x) noexcept;

// FP8 E4M3 "fn" (OCP): bias 7, no infinities, S.1111.111 (0x7F/0xFF) is NaN,
// max finite 448, min subnormal 2^-9.
CSFMOE_HD float e4m3fn_to_float(std::uint8_t code);
// Round to nearest even; finite values beyond 448 saturate to +-448 (the
// ModelOpt recipe clamps before the cast); NaN maps to 0x7F.
std::uint8_t float_to_e4m3fn(float x) noexcept;

// E8M0 (OCP MX scale): value 2^(code - 127); 0xFF is NaN.
CSFMOE_HD float e8m0_to_float(std::uint8_t code);

// BF16 (upper half of an IEEE binary32): RNE, NaN stays a (quiet) NaN.
CSFMOE_HD float bf16_to_float(std::uint16_t bits);
std::uint16_t float_to_bf16(float x) noexcept;

}  // namespace csfmoe

#include "csfmoe/detail/formats_inl.hpp"
