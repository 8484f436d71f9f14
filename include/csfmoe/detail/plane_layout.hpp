// The layouts of CSF's stored planes (docs/csf-format.md, "Canonical
// checkpoint planes" and "MXFP4 slab planes"): where every byte of b12x /
// vLLM's fixed plane lives, and of csfmoe's MXFP4 slab form of it. The one
// definition used by the plane codec (src/codec/b12x_planes.cpp), the slab
// codec (src/codec/mxfp4_slab_planes.cpp) and the reader of files written by
// b12x / vLLM (src/checkpoint/b12x_file.cpp); the resident CSF layout is
// csf_layout.hpp's. constexpr, so also usable in device code (the GPU upload of
// planes, src/cuda/codec/planes_kernels.cuh).
#pragma once

#include <cstddef>
#include <cstdint>

#include "csfmoe/formats.hpp"

namespace csfmoe::csf {

// ---------------------------------------------------------------------------
// b12x / vLLM's fixed plane: rows / 16 slabs, each 16 bases (row order), then
// 16 rows of codes (NVFP4 two 4-bit codes a byte, the even column in the low
// nibble; MXFP4 one selector bit a column, bit c % 8 of byte c / 8).
// ---------------------------------------------------------------------------
inline constexpr std::uint32_t plane_slab_rows = 16;

// Code bytes of one row.
constexpr std::uint32_t plane_row_bytes(ScaleFormat f, std::uint32_t cols) {
  return static_cast<std::uint32_t>(f == ScaleFormat::nvfp4 ? cols / 2 : (std::uint64_t{cols} + 7) / 8);
}
// Bytes of one slab: the bases, then the rows' codes.
constexpr std::uint64_t plane_slab_bytes(ScaleFormat f, std::uint32_t cols) {
  return plane_slab_rows * (1 + std::uint64_t{plane_row_bytes(f, cols)});
}
// The columns of an NVFP4 plane whose slabs are `slab_bytes` long (the
// inverse of plane_slab_bytes; MXFP4's padded selector bytes hide theirs).
constexpr std::uint64_t nvfp4_plane_cols(std::uint64_t slab_bytes) {
  return 2 * (slab_bytes / plane_slab_rows - 1);
}

// Where row r's base and codes live in the fixed plane of a rows x cols grid,
// and the code of column c in a row's codes.
struct PlaneLayout {
  ScaleFormat format;
  std::uint32_t rows, cols;
  std::uint32_t row_bytes;  // code bytes per row
  std::uint64_t slab_bytes;
  unsigned window;  // 16 (NVFP4) or 2 (MXFP4)

  constexpr PlaneLayout(ScaleFormat f, std::uint32_t rows_, std::uint32_t cols_)
      : format(f),
        rows(rows_),
        cols(cols_),
        row_bytes(plane_row_bytes(f, cols_)),
        slab_bytes(plane_slab_bytes(f, cols_)),
        window(csf_window(f)) {}

  constexpr bool nv() const { return format == ScaleFormat::nvfp4; }
  constexpr std::uint8_t max_base() const { return static_cast<std::uint8_t>(256 - window); }
  constexpr std::size_t base_at(std::uint32_t r) const {
    return std::size_t{r / plane_slab_rows} * slab_bytes + r % plane_slab_rows;
  }
  constexpr std::size_t codes_at(std::uint32_t r) const {
    return std::size_t{r / plane_slab_rows} * slab_bytes + plane_slab_rows +
           std::size_t{r % plane_slab_rows} * row_bytes;
  }
  // Code of column c of a row whose codes start at `codes`.
  constexpr std::uint8_t code(const std::uint8_t* codes, std::uint32_t c) const {
    return nv() ? static_cast<std::uint8_t>((codes[c / 2] >> ((c & 1) * 4)) & 0xF)
                : static_cast<std::uint8_t>((codes[c / 8] >> (c % 8)) & 1);
  }
  constexpr void clear_code(std::uint8_t* codes, std::uint32_t c) const {
    if (nv())
      codes[c / 2] = static_cast<std::uint8_t>(codes[c / 2] & ~(0xF << ((c & 1) * 4)));
    else
      codes[c / 8] = static_cast<std::uint8_t>(codes[c / 8] & ~(1 << (c % 8)));
  }
  // The slot must still be 0.
  constexpr void set_code(std::uint8_t* codes, std::uint32_t c, std::uint8_t code) const {
    if (nv())
      codes[c / 2] = static_cast<std::uint8_t>(codes[c / 2] | (code << ((c & 1) * 4)));
    else
      codes[c / 8] = static_cast<std::uint8_t>(codes[c / 8] | (code << (c % 8)));
  }
};

// ---------------------------------------------------------------------------
// MXFP4 slab form: per 16-row slab the slab base (byte 0), 16 two-bit row
// delta codes (bytes 1..4, row i at bits 2 * (i % 4) of byte 1 + i / 4), then
// the 16 rows' selector bits as one stream of 16 * cols bits (row i column c
// is stream bit i * cols + c, bit k at bit k % 8 of byte k / 8).
// ---------------------------------------------------------------------------
inline constexpr unsigned mxfp4_slab_delta_bits = 2;
// Delta codes 0..2: the row's base is the slab base + code; the escape code:
// the next byte of the escape list.
inline constexpr std::uint8_t mxfp4_slab_escape = 3;
inline constexpr std::size_t mxfp4_slab_delta_byte = 1;  // first byte of the delta codes
inline constexpr std::size_t mxfp4_slab_selector_byte =
    mxfp4_slab_delta_byte + plane_slab_rows * mxfp4_slab_delta_bits / 8;  // first byte of the selectors

constexpr std::uint8_t mxfp4_slab_delta_code(const std::uint8_t* slab, std::uint32_t i) {
  return static_cast<std::uint8_t>((slab[mxfp4_slab_delta_byte + i / 4] >> (2 * (i % 4))) & 3);
}
// The code's bits must still be 0.
constexpr void set_mxfp4_slab_delta_code(std::uint8_t* slab, std::uint32_t i, std::uint8_t code) {
  slab[mxfp4_slab_delta_byte + i / 4] =
      static_cast<std::uint8_t>(slab[mxfp4_slab_delta_byte + i / 4] | (code << (2 * (i % 4))));
}
// Bytes of one slab.
constexpr std::uint64_t mxfp4_slab_bytes(std::uint32_t cols) {
  return mxfp4_slab_selector_byte + 2 * std::uint64_t{cols};
}
static_assert(mxfp4_slab_bytes(0) == 5);

}  // namespace csfmoe::csf
