// CsfGeometry (everything a grid shape implies), part sizes, stats.
#include <bitset>

#include "codec/csf_internal.hpp"

namespace csfmoe {

std::string to_string(const GridShape& s) {
  return fmt::format("[{}, {}, {}] {} {}", s.experts, s.rows, s.cols, to_string(s.format),
                     to_string(s.layout));
}

using namespace csf_internal;

// ---------------------------------------------------------------------------
// Public API
// ---------------------------------------------------------------------------
CsfGeometry CsfGeometry::of(const GridShape& s) {
  if (!is_known(s.format))
    throw InvalidArgument(fmt::format("CSF grid shape: unknown scale format {}", unsigned(s.format)));
  if (!is_known(s.layout))
    throw InvalidArgument(fmt::format("CSF grid shape: unknown scale layout {}", unsigned(s.layout)));
  if (s.experts == 0 || s.rows == 0 || s.cols == 0)
    throw InvalidArgument(
        fmt::format("CSF grid shape {}: experts, rows and cols must all be at least 1", to_string(s)));
  if (s.layout == ScaleLayout::swizzled_128x4 && (s.rows % 128 != 0 || s.cols % 4 != 0))
    throw InvalidArgument(fmt::format(
        "CSF grid shape {}: a swizzled_128x4 source is stored padded, so rows must be a multiple of 128 and "
        "cols a multiple of 4",
        to_string(s)));
  CsfGeometry g;
  g.shape = s;
  g.partition_rows = csf_partition_rows(s.format);
  g.slab_rows = csf_slab_rows(s.format);
  const u64 prow = csf::padded_rows(s.format, s.rows);
  const u64 pcol = csf::padded_cols(s.format, s.cols);
  if (prow * pcol >= csf_max_positions)
    throw InvalidArgument(
        fmt::format("CSF grid shape {}: one expert's padded grid is {}x{} = {} positions, but exception "
                    "positions are 24-bit "
                    "(at most {} positions per expert)",
                    to_string(s), prow, pcol, prow * pcol, csf_max_positions - 1));
  g.padded_rows = static_cast<u32>(prow);
  g.padded_cols = static_cast<u32>(pcol);
  g.slab_bytes = csf::slab_bytes(s.format, pcol);
  g.fixed_bytes_per_expert = csf::slabs_per_expert(s.format, prow) * g.slab_bytes;
  g.partitions_per_expert = static_cast<u32>(prow / g.partition_rows);
  return g;
}

std::uint64_t CsfGeometry::native_bytes(ScaleLayout layout) const {
  switch (layout) {
    case ScaleLayout::row_major:
      return u64{shape.experts} * shape.rows * shape.cols;
    case ScaleLayout::swizzled_128x4:
      return u64{shape.experts} * swz_rows(shape.rows) * swz_cols(shape.cols);
  }
  throw InvalidArgument(fmt::format("CSF native_bytes: unknown layout {}", unsigned(layout)));
}

std::uint64_t CsfTensor::encoded_bytes() const {
  return fixed.size() + 4 * (u64{exceptions.size()} + row_prefix.size() + partition_index.size());
}

CsfStats stats(const CsfTensor& t) {
  check_geometry(t.geometry);
  check_part_sizes(t);
  const CsfGeometry& g = t.geometry;
  CsfStats s;
  s.rows = u64{g.shape.experts} * g.shape.rows;
  s.values = s.rows * g.shape.cols;
  s.exceptions = t.exceptions.size();
  const Fixed fx{g, const_cast<u8*>(t.fixed.data())};
  std::bitset<256> seen;
  for (u32 e = 0; e < g.shape.experts; ++e)
    for (u32 r = 0; r < g.shape.rows; ++r) seen.set(fx.base(e, r));
  s.distinct_bases = static_cast<u32>(seen.count());
  s.source_bytes = t.source_bytes();
  s.encoded_bytes = t.encoded_bytes();
  return s;
}

std::uint8_t row_base(const CsfTensor& t, std::uint32_t expert, std::uint32_t row) {
  check_geometry(t.geometry);
  const CsfGeometry& g = t.geometry;
  if (expert >= g.shape.experts || row >= g.padded_rows)
    throw InvalidArgument(fmt::format("CSF row_base: (expert {}, row {}) is outside grid {} ({} padded rows)",
                                      expert, row, to_string(g.shape), g.padded_rows));
  if (t.fixed.size() != g.fixed_bytes())
    throw FormatError(fmt::format("CSF fixed part: {} bytes, expected {} for grid {}", t.fixed.size(),
                                  g.fixed_bytes(), to_string(g.shape)));
  return Fixed{g, const_cast<u8*>(t.fixed.data())}.base(expert, row);
}

}  // namespace csfmoe
