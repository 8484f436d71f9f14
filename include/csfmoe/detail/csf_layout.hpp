// The CSF layout: where every byte of a CSF tensor's parts lives, per format
// (docs/csf-format.md). The one definition used by the CPU codec, the GPU codec,
// the MoE kernels' scale readers and the stage-read index builder. Host and
// CUDA device code (CSFMOE_HD); needs no CUDA header.
//
// The per-format constants (window, slab rows, partition rows, column
// granule, 2^24 positions) and the 128x4 swizzle (swizzled_index) are in
// csfmoe/formats.hpp; everything derived from them is here. Integer types are
// those of the kernels' hot paths: rows, columns, positions and in-slab
// indices are 32-bit, byte offsets into the fixed part 64-bit.
#pragma once

#include <cstdint>

#include "csfmoe/formats.hpp"

namespace csfmoe::csf {

// ---------------------------------------------------------------------------
// Padded grid and slabs
// ---------------------------------------------------------------------------
// Rows / columns of one expert's padded grid.
CSFMOE_HD constexpr std::uint64_t padded_rows(ScaleFormat f, std::uint64_t rows) {
  return round_up(rows, csf_partition_rows(f));
}
CSFMOE_HD constexpr std::uint64_t padded_cols(ScaleFormat f, std::uint64_t cols) {
  return round_up(cols, csf_col_granule(f));
}
// Bytes of bases at the start of every slab: one per slab row.
CSFMOE_HD constexpr std::uint32_t slab_base_bytes(ScaleFormat f) { return csf_slab_rows(f); }
// NVFP4: bytes of one 4-column group of offsets (128 rows x 4 nibbles).
constexpr std::uint32_t nvfp4_group_bytes = 256;
// MXFP4: bytes of offset bits per row.
CSFMOE_HD constexpr std::uint32_t mxfp4_mask_bytes(std::uint32_t padded_cols) {
  return (padded_cols + 7) / 8;
}
// Bytes of one slab: the bases, then the offsets of slab_rows rows.
CSFMOE_HD constexpr std::uint64_t slab_bytes(ScaleFormat f, std::uint64_t padded_cols) {
  return f == ScaleFormat::nvfp4 ? 128 * (1 + padded_cols / 2) : 16 * (1 + (padded_cols + 7) / 8);
}
// Slabs of one expert.
CSFMOE_HD constexpr std::uint64_t slabs_per_expert(ScaleFormat f, std::uint64_t padded_rows) {
  return padded_rows / csf_slab_rows(f);
}
// Slab of one expert holding `row`.
CSFMOE_HD constexpr std::uint32_t slab_index(ScaleFormat f, std::uint32_t row) {
  return row / csf_slab_rows(f);
}
// Byte offset in the fixed part of the slab holding `row` of `expert`.
CSFMOE_HD constexpr std::uint64_t slab_offset(ScaleFormat f, std::uint64_t expert, std::uint32_t row,
                                              std::uint64_t fixed_bytes_per_expert,
                                              std::uint64_t slab_bytes) {
  return expert * fixed_bytes_per_expert + std::uint64_t(slab_index(f, row)) * slab_bytes;
}

// ---------------------------------------------------------------------------
// Inside a slab (`row` is the row inside the expert; only row % slab_rows counts)
// ---------------------------------------------------------------------------
// Byte of the row's base.
CSFMOE_HD constexpr std::uint32_t base_index(ScaleFormat f, std::uint32_t row) {
  return f == ScaleFormat::nvfp4 ? (row % 32) * 4 + (row % 128) / 32 : row % 16;
}
// NVFP4: nibble of (row, col) in the offset area after the 128 bases; the
// offsets of a 4-column group follow the 128x4 swizzle order.
CSFMOE_HD constexpr std::uint32_t nvfp4_offset_nibble(std::uint32_t row, std::uint32_t col) {
  return (col / 4) * 512 + (row % 32) * 16 + ((row % 128) / 32) * 4 + (col % 4);
}
// NVFP4: byte of the slab holding nibble n, and its shift (low nibble for
// even n); and the same for the offset of (row, col).
CSFMOE_HD constexpr std::uint32_t nvfp4_nibble_byte(std::uint32_t n) { return 128 + n / 2; }
CSFMOE_HD constexpr std::uint32_t nvfp4_nibble_shift(std::uint32_t n) { return (n & 1) * 4; }
CSFMOE_HD constexpr std::uint32_t nvfp4_offset_byte(std::uint32_t row, std::uint32_t col) {
  return nvfp4_nibble_byte(nvfp4_offset_nibble(row, col));
}
CSFMOE_HD constexpr std::uint32_t nvfp4_offset_shift(std::uint32_t row, std::uint32_t col) {
  return nvfp4_nibble_shift(nvfp4_offset_nibble(row, col));
}
// NVFP4: the row's two offset bytes (4 columns) of group 0 relative to the
// offset area; group g is g * nvfp4_group_bytes further.
CSFMOE_HD constexpr std::uint32_t nvfp4_row_in_group(std::uint32_t row) {
  return (row % 32) * 8 + ((row % 128) / 32) * 2;
}
// NVFP4: byte of the slab holding the code pair j (columns 2j, 2j + 1) of
// row `row`: in the 128x4 nibble order a pair is one byte, even column in the
// low nibble as in b12x's planes, so planes and slabs trade whole bytes.
CSFMOE_HD constexpr std::uint32_t nvfp4_code_pair_byte(std::uint32_t row, std::uint32_t j) {
  return slab_base_bytes(ScaleFormat::nvfp4) + (j / 2) * nvfp4_group_bytes + nvfp4_row_in_group(row) + j % 2;
}
static_assert(nvfp4_code_pair_byte(37, 5) == nvfp4_offset_byte(37, 10) &&
              nvfp4_code_pair_byte(100, 2) == nvfp4_offset_byte(100, 4));
// MXFP4: first mask byte of the row in its slab (mask_bytes per row), the
// byte holding the offset bit of (row, col), and the bit.
CSFMOE_HD constexpr std::uint32_t mxfp4_row_mask(std::uint32_t row, std::uint32_t mask_bytes) {
  return 16 + (row % 16) * mask_bytes;
}
CSFMOE_HD constexpr std::uint32_t mxfp4_offset_byte(std::uint32_t row, std::uint32_t col,
                                                    std::uint32_t padded_cols) {
  return mxfp4_row_mask(row, mxfp4_mask_bytes(padded_cols)) + col / 8;
}
CSFMOE_HD constexpr std::uint32_t mxfp4_offset_bit(std::uint32_t col) { return col % 8; }

// ---------------------------------------------------------------------------
// Positions and exception records
// ---------------------------------------------------------------------------
// Position of (row, col) inside one expert's padded grid, and back.
CSFMOE_HD constexpr std::uint32_t position(std::uint32_t row, std::uint32_t col, std::uint32_t padded_cols) {
  return row * padded_cols + col;
}
CSFMOE_HD constexpr std::uint32_t position_row(std::uint32_t pos, std::uint32_t padded_cols) {
  return pos / padded_cols;
}
CSFMOE_HD constexpr std::uint32_t position_col(std::uint32_t pos, std::uint32_t padded_cols) {
  return pos - position_row(pos, padded_cols) * padded_cols;
}

// A record: low 24 bits the position, high 8 bits the original byte.
constexpr unsigned record_position_bits = 24;
constexpr std::uint32_t record_position_mask = (std::uint32_t{1} << record_position_bits) - 1;
static_assert(std::uint64_t{record_position_mask} + 1 == csf_max_positions);
CSFMOE_HD constexpr std::uint32_t make_record(std::uint32_t position, std::uint8_t value) {
  return (std::uint32_t{value} << record_position_bits) | (position & record_position_mask);
}
CSFMOE_HD constexpr std::uint32_t record_position(std::uint32_t rec) { return rec & record_position_mask; }
// The byte, as a byte and as a 32-bit word (for kernels that shift it into place).
CSFMOE_HD constexpr std::uint32_t record_value_u32(std::uint32_t rec) { return rec >> record_position_bits; }
CSFMOE_HD constexpr std::uint8_t record_value(std::uint32_t rec) {
  return static_cast<std::uint8_t>(record_value_u32(rec));
}

// ---------------------------------------------------------------------------
// The layout parameters every user of resident CSF parts carries (host
// structs, kernel parameters): filled once from a CsfGeometry
// (CsfGeometry::layout()) and embedded, never copied field by field.
// ---------------------------------------------------------------------------
struct LayoutView {
  // The format is not stored: kernels are compiled per format. The fields
  // and their order are what the kernel parameter structs held before.
  std::uint64_t fixed_bytes_per_expert = 0;
  std::uint64_t slab_bytes = 0;
  std::uint32_t padded_rows = 0, padded_cols = 0;  // padded grid of one expert

  // A template argument: a run-time format would divide by a run-time slab height.
  template <ScaleFormat F>
  CSFMOE_HD std::uint64_t slab_offset(std::uint64_t expert, std::uint32_t row) const {
    return csf::slab_offset(F, expert, row, fixed_bytes_per_expert, slab_bytes);
  }
  CSFMOE_HD std::uint32_t mask_bytes() const { return mxfp4_mask_bytes(padded_cols); }
  CSFMOE_HD std::uint32_t position(std::uint32_t row, std::uint32_t col) const {
    return csf::position(row, col, padded_cols);
  }
  CSFMOE_HD std::uint32_t position_row(std::uint32_t pos) const {
    return csf::position_row(pos, padded_cols);
  }
  CSFMOE_HD std::uint32_t position_col(std::uint32_t pos) const {
    return csf::position_col(pos, padded_cols);
  }
};

}  // namespace csfmoe::csf
