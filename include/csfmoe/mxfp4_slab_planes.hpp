// MXFP4 slab planes: a smaller stored form of b12x's canonical MXFP4 planes
// for short rows (docs/csf-format.md, "MXFP4 slab planes"). The rows keep
// their b12x bases, selector bits and exception records; only their storage
// changes: one base byte per 16-row slab plus a 2-bit delta per row (with an
// escape for a row whose base is not within 2 of the slab's), and the slab's
// selector bits packed without per-row byte padding. Converting to and from
// CsfPlanes moves bits, never re-runs the base rule.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "csfmoe/b12x_planes.hpp"

namespace csfmoe {

// Per-row delta code of a slab: codes 0..2 mean base = slab base + code,
// the escape code means the row's base is the next byte of the escape list.
inline constexpr unsigned mxfp4_slab_delta_bits = csf::mxfp4_slab_delta_bits;
inline constexpr std::uint8_t mxfp4_slab_escape = csf::mxfp4_slab_escape;

// Bytes of one 16-row slab: the slab base, 16 two-bit delta codes (4 bytes),
// then the 16 rows' selector bits as one stream of 16 * cols bits (2 * cols
// bytes); the byte map is detail/plane_layout.hpp's.
inline constexpr std::uint64_t mxfp4_slab_bytes(std::uint32_t cols) { return csf::mxfp4_slab_bytes(cols); }
// Bytes of the slabs of one grid: rows / 16 slabs.
inline std::uint64_t mxfp4_slab_plane_bytes(const PlaneShape& s) {
  return std::uint64_t{s.rows / plane_slab_rows} * mxfp4_slab_bytes(s.cols);
}

// One MXFP4 expert projection in slab form.
struct Mxfp4SlabPlanes {
  PlaneShape shape;  // format mxfp4
  // rows / 16 slabs of mxfp4_slab_bytes(cols) bytes.
  std::vector<std::uint8_t> slabs;
  // The full base of every escaped row, in row order.
  std::vector<std::uint8_t> escapes;
  // The b12x records as they are: (byte << 24) | (row * cols + col), strictly increasing.
  std::vector<std::uint32_t> exceptions;
};

// Slab form of b12x MXFP4 planes (validated first: FormatError naming
// `name`), in the encoder's form (canonical_planes: records that win over
// their slot become codes or sit on code 0). Each slab's base is the lowest
// b whose range [b, b + 2] holds the most row bases of the slab; rows outside
// it are escaped. InvalidArgument for NVFP4 planes or a bad shape.
Mxfp4SlabPlanes planes_to_mxfp4_slabs(const CsfPlanes& planes, std::string_view name);

// Escape codes in `slabs` (the number of escape bytes they need). FormatError
// naming `name` if `slabs` is not mxfp4_slab_plane_bytes(s) long.
std::uint64_t mxfp4_slab_escape_count(const PlaneShape& s, std::span<const std::uint8_t> slabs,
                                      std::string_view name);

// The b12x planes of untrusted slab parts, bit for bit, after a full check
// (FormatError naming `name` and the first violation): the slab part's
// size, a slab base above 254, a delta-coded row whose base would be above
// 254, an escape list shorter or longer than the escape codes, an escaped
// base above 254 or within [slab base, slab base + 2] (it had a delta code),
// then every check of validate_planes on the result (records sorted and
// inside the grid; a record may win over its slot, as in b12x's readers).
// InvalidArgument for a shape that is not MXFP4 or breaks check_plane_shape.
CsfPlanes mxfp4_slabs_to_planes(const PlaneShape& s, std::span<const std::uint8_t> slabs,
                                std::span<const std::uint8_t> escapes,
                                std::span<const std::uint32_t> exceptions, std::string_view name);
CsfPlanes mxfp4_slabs_to_planes(const Mxfp4SlabPlanes& p, std::string_view name);

// Bytes the slab storage of these experts takes in a container: slabs,
// escapes, 4 per record and a 4-byte record count per expert (the same
// count the planes storage keeps).
std::uint64_t mxfp4_slabs_stored_bytes(std::span<const Mxfp4SlabPlanes> experts);

}  // namespace csfmoe
