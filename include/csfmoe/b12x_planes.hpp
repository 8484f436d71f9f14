// b12x / vLLM canonical CSF checkpoint planes (docs/csf-format.md, "Canonical
// checkpoint planes"): per expert projection, one fixed plane of 16-row slabs
// (bases, then codes) and one list of exception records. The encoding rule is
// csfmoe's (same bases, codes and records on the same grid); only the storage
// differs, so planes convert to and from a CsfTensor without re-encoding.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "csfmoe/codec.hpp"
#include "csfmoe/detail/plane_layout.hpp"
#include "csfmoe/formats.hpp"
#include "csfmoe/tensor_slice.hpp"

namespace csfmoe {

// The tensor names b12x / vLLM checkpoints give the two planes of the
// block-scale tensor `scale` (which is then absent): scale +
// ".nvfp4_csf_fixed" / ".nvfp4_csf_exceptions", or ".mxfp4_csf_*".
std::string b12x_fixed_name(std::string_view scale, ScaleFormat format);
std::string b12x_exceptions_name(std::string_view scale, ScaleFormat format);

// The native scale grid of one expert projection: rows x cols bytes, row-major.
struct PlaneShape {
  ScaleFormat format = ScaleFormat::nvfp4;
  std::uint32_t rows = 0;
  std::uint32_t cols = 0;

  friend bool operator==(const PlaneShape&, const PlaneShape&) = default;
};
// "[rows, cols] format", as error messages name a grid.
std::string to_string(const PlaneShape& s);

// Rows of one slab of the fixed plane (both formats); the plane's layout is
// detail/plane_layout.hpp's.
inline constexpr std::uint32_t plane_slab_rows = csf::plane_slab_rows;

// Bytes of one 16-row slab: NVFP4 16 * (1 + cols / 2), MXFP4 16 * (1 + ceil(cols / 8)).
std::uint64_t plane_slab_bytes(ScaleFormat format, std::uint32_t cols);
// Bytes of the whole fixed plane, a U8 [rows / 16, plane_slab_bytes] tensor.
inline std::uint64_t plane_fixed_bytes(const PlaneShape& s) {
  return std::uint64_t{s.rows / plane_slab_rows} * plane_slab_bytes(s.format, s.cols);
}

// Throws InvalidArgument naming `name` unless rows and cols are at least 1,
// rows % 16 == 0, NVFP4 cols are even and rows * cols <= 2^24 (24-bit positions).
void check_plane_shape(const PlaneShape& s, std::string_view name);

// The two planes of one expert projection.
struct CsfPlanes {
  PlaneShape shape;
  // Per 16-row slab: 16 bases (row order), then per row its codes: NVFP4 cols / 2
  // bytes, two 4-bit codes per byte, the even column in the low nibble; MXFP4
  // ceil(cols / 8) selector bytes, bit c % 8 of byte c / 8 set = base + 1,
  // bits past the last column 0.
  std::vector<std::uint8_t> fixed;
  // (byte << 24) | (row * cols + col) for every byte outside its row's window,
  // strictly increasing; the code slot of such a byte is 0 (as the encoder
  // writes them; readers also take records that win over their slot).
  std::vector<std::uint32_t> exceptions;
};

// Encodes a native row-major grid of shape `s` (rows * cols bytes) with the
// codec's base rule. InvalidArgument for a bad shape or a source of the wrong size.
CsfPlanes encode_planes(const PlaneShape& s, std::span<const std::uint8_t> native,
                        std::string_view name = "scale");

// Full check of untrusted planes; throws FormatError naming `name` and the
// first violation: fixed plane size, bases above 240 (NVFP4) / 254 (MXFP4),
// MXFP4 selector bits set past the last column, records not strictly
// increasing, a position outside the grid. A record wins over its slot (as
// in b12x's and vLLM's readers): it may sit on a non-zero code or hold a
// byte inside its row's window, and its byte is the value. InvalidArgument
// for a bad shape.
void validate_planes(const PlaneShape& s, std::span<const std::uint8_t> fixed,
                     std::span<const std::uint32_t> exceptions, std::string_view name);

// Validated planes in the encoder's form, decoding to the same bytes: the
// slot under each record holds code 0, and a record whose byte lies inside
// its row's window is replaced by that code. Everything csfmoe writes or
// keeps resident is in this form (slice_planes, concat_planes and
// planes_to_csf return it).
CsfPlanes canonical_planes(const CsfPlanes& planes, std::string_view name);
// Whether validated planes are already in that form (canonical_planes would
// return them unchanged): no record on a non-zero code, none whose byte lies
// in its row's window.
bool in_encoder_form(const CsfPlanes& planes);

// Validates, then writes the native grid (rows * cols bytes, byte-exact) to `native`.
void decode_planes(const PlaneShape& s, std::span<const std::uint8_t> fixed,
                   std::span<const std::uint32_t> exceptions, std::span<std::uint8_t> native,
                   std::string_view name);
std::vector<std::uint8_t> decode_planes(const CsfPlanes& planes, std::string_view name);

// Tensor-parallel slice of planes without re-encoding (vLLM's rule): the
// rows in `rows` (concatenated in the given order; each range starts and
// ends on a 16-row slab boundary) and the columns in `cols` (NVFP4: even
// first and count). Bases keep their full-row values, codes are copied
// (MXFP4 selector bits repacked), records are filtered to the slice and
// re-addressed. The result decodes to exactly the slice of the native grid;
// it can differ from encoding that slice (another base may win there).
// Validates the input first (FormatError); InvalidArgument for misaligned or
// out-of-range ranges. A TP rank's ranges come from tensor_parallel_axis_ranges
// with granule plane_slab_rows for rows and 2 (NVFP4) / 1 (MXFP4) for columns.
CsfPlanes slice_planes(const CsfPlanes& planes, std::span<const AxisRange> rows, AxisRange cols,
                       std::string_view name);

// Planes of the row-wise concatenation of grids with the same format and
// columns (e.g. a fused [up; gate] projection from per-projection planes, as
// b12x's loader builds w13): fixed planes appended slab by slab, records
// re-addressed to their rows in the result. Every row is encoded on its own,
// so parts straight from encode_planes give the encoding of the stacked
// grid (slices keep their full-row bases). Validates every
// part (FormatError naming `name` and the part); InvalidArgument for no parts,
// differing formats or columns, or a result beyond 2^24 positions.
CsfPlanes concat_planes(std::span<const CsfPlanes> parts, std::string_view name);

// The resident form from planes: a row_major CsfTensor of experts.size()
// experts (every plane of the same shape, each validated). Bases, codes and
// records are moved, not recomputed; the CsfTensor pads (NVFP4 rows to 128
// and columns to 4, MXFP4 rows to 64) and re-addresses records to its padded
// columns. InvalidArgument for differing shapes, or a grid that the padded
// form cannot address (padded rows * padded cols >= 2^24).
CsfTensor planes_to_csf(std::span<const CsfPlanes> experts, std::string_view name);

// The planes of every expert of a CsfTensor (validated first; FormatError if
// it is malformed). The tensor's logical grid must meet check_plane_shape
// (InvalidArgument otherwise); a swizzled_128x4 tensor gives the planes of its
// un-swizzled grid.
std::vector<CsfPlanes> csf_to_planes(const CsfTensor& tensor, std::string_view name);

}  // namespace csfmoe
