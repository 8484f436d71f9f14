// CSF: lossless compression of FP4 block-scale grids (see docs/csf-format.md).
//
// A scale tensor is a stack of E expert grids of R rows by C columns (bytes).
// Each row stores one base byte and, for every byte, a 4-bit (NVFP4) or 1-bit
// (MXFP4) offset from the base; bytes outside [base, base + W) are exceptions
// kept whole in 32-bit records. Decoding gives back every byte exactly.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "csfmoe/detail/csf_layout.hpp"
#include "csfmoe/formats.hpp"

namespace csfmoe {

// Logical shape of a scale tensor as the source stores it.
//   row_major:       rows x cols are the true grid; any R, C >= 1.
//   swizzled_128x4:  the buffer is already padded; rows % 128 == 0 and
//                    cols % 4 == 0 are required and every byte (padding
//                    included) is part of the grid and is restored.
struct GridShape {
  ScaleFormat format = ScaleFormat::nvfp4;
  ScaleLayout layout = ScaleLayout::row_major;
  std::uint32_t experts = 1;
  std::uint32_t rows = 0;
  std::uint32_t cols = 0;

  friend bool operator==(const GridShape&, const GridShape&) = default;
};
// "[experts, rows, cols] format layout", as error messages name a grid.
std::string to_string(const GridShape& s);

// Everything derived from a GridShape. Positions inside an expert are
// row * padded_cols + col in logical (un-swizzled) padded coordinates.
struct CsfGeometry {
  GridShape shape;
  std::uint32_t padded_rows = 0;  // rows rounded up to csf_partition_rows
  std::uint32_t padded_cols = 0;  // cols rounded up to csf_col_granule
  std::uint32_t slab_rows = 0;    // 128 (NVFP4) or 16 (MXFP4)
  std::uint64_t slab_bytes = 0;   // NVFP4 128*(1+Cp/2); MXFP4 16*(1+ceil(Cp/8))
  std::uint64_t fixed_bytes_per_expert = 0;
  std::uint32_t partition_rows = 0;  // 128 (NVFP4) or 64 (MXFP4)
  std::uint32_t partitions_per_expert = 0;

  // Validates the shape (non-zero dims, swizzle alignment, 2^24 positions
  // per expert) and throws InvalidArgument with the reason.
  static CsfGeometry of(const GridShape& shape);

  std::uint64_t native_bytes(ScaleLayout layout) const;  // bytes of the native tensor in that layout
  std::uint64_t fixed_bytes() const { return fixed_bytes_per_expert * shape.experts; }
  std::uint64_t total_rows() const { return std::uint64_t{padded_rows} * shape.experts; }
  // The layout parameters kernels and views carry (csfmoe/detail/csf_layout.hpp).
  csf::LayoutView layout() const { return {fixed_bytes_per_expert, slab_bytes, padded_rows, padded_cols}; }
};

// An exception record: low 24 bits position, high 8 bits the original byte
// (csf::make_record and its inverses).
constexpr std::uint32_t make_exception(std::uint32_t position, std::uint8_t value) {
  return csf::make_record(position, value);
}
constexpr std::uint32_t exception_position(std::uint32_t rec) { return csf::record_position(rec); }
constexpr std::uint8_t exception_value(std::uint32_t rec) { return csf::record_value(rec); }

// The encoded parts of one scale tensor.
struct CsfTensor {
  CsfGeometry geometry;
  // E * fixed_bytes_per_expert: per expert, slabs of bases + offsets.
  std::vector<std::uint8_t> fixed;
  // All exception records, expert by expert, each expert's ordered by row then column.
  std::vector<std::uint32_t> exceptions;
  // E * padded_rows + 1 entries: global exclusive prefix of exception counts
  // per row (row_prefix[e * padded_rows + r] = first record of that row).
  std::vector<std::uint32_t> row_prefix;
  // E * partitions_per_expert + 1 entries: row_prefix sampled at every
  // partition start (and the total at the end).
  std::vector<std::uint32_t> partition_index;

  std::uint64_t encoded_bytes() const;  // fixed + 4 * (exceptions + row_prefix + partition_index)
  std::uint64_t source_bytes() const { return geometry.native_bytes(geometry.shape.layout); }
};

struct CodecOptions {
  unsigned threads = 0;    // 0: all hardware threads; 1: the calling thread only
  bool reference = false;  // use the simple reference implementation (tests)
};

// Encode a native scale tensor (source_bytes() bytes in shape.layout).
// Throws InvalidArgument if src has the wrong size or the shape is invalid.
CsfTensor encode(const GridShape& shape, std::span<const std::uint8_t> src, const CodecOptions& options = {});

// Decode into dst in the given layout (dst.size() == geometry.native_bytes(layout)).
// For a row_major source decoded to swizzled_128x4, padding positions hold
// the row's base byte (offset 0); padded rows decode to 0x00. Decoding to the
// source layout restores the source bytes exactly.
// The parts must be valid (see validate); decode validates first unless
// `trusted` is set (parts this process just encoded).
void decode(const CsfTensor& tensor, ScaleLayout layout, std::span<std::uint8_t> dst,
            const CodecOptions& options = {}, bool trusted = false);

// Decode the experts listed (each < E; duplicates allowed) into dst, which
// holds a native tensor of all E experts; other experts are left untouched.
void decode_experts(const CsfTensor& tensor, std::span<const std::uint32_t> experts, ScaleLayout layout,
                    std::span<std::uint8_t> dst, const CodecOptions& options = {}, bool trusted = false);

// Full structural check of untrusted parts; throws FormatError naming the
// part and the first violation: part sizes, prefix monotone and consistent
// with the record count and partition index, records sorted and unique per
// expert, positions inside the true grid and inside their row, offset slot of
// an exception is 0, exception value actually outside the row's window,
// padding offsets 0, base <= 256 - W.
void validate(const CsfTensor& tensor);

// Summary used by `csf inspect`.
struct CsfStats {
  std::uint64_t rows = 0;    // true rows over all experts
  std::uint64_t values = 0;  // true bytes over all experts
  std::uint64_t exceptions = 0;
  std::uint32_t distinct_bases = 0;
  std::uint64_t source_bytes = 0;
  std::uint64_t encoded_bytes = 0;
  double exception_rate() const { return values ? double(exceptions) / double(values) : 0.0; }
  double ratio() const { return source_bytes ? double(encoded_bytes) / double(source_bytes) : 0.0; }
};
CsfStats stats(const CsfTensor& tensor);

// Base byte of (expert, row) read from the fixed part.
std::uint8_t row_base(const CsfTensor& tensor, std::uint32_t expert, std::uint32_t row);

}  // namespace csfmoe
