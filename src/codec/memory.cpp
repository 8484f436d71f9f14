// Host-only resident-memory accounting (see include/csfmoe/memory.hpp).
#include "csfmoe/memory.hpp"

#include <fmt/format.h>

#include "csfmoe/errors.hpp"

namespace csfmoe {

std::uint64_t csf_resident_bytes(const CsfTensor& t) {
  const CsfGeometry& g = t.geometry;
  // Sizes only: a mismatch would make the count meaningless, so say which part.
  if (t.fixed.size() != g.fixed_bytes())
    throw FormatError(fmt::format("CSF resident bytes: fixed part holds {} bytes, the geometry needs {}",
                                  t.fixed.size(), g.fixed_bytes()));
  if (t.row_prefix.size() != g.total_rows() + 1)
    throw FormatError(fmt::format("CSF resident bytes: row_prefix holds {} entries, the geometry needs {}",
                                  t.row_prefix.size(), g.total_rows() + 1));
  const std::uint64_t parts = std::uint64_t{g.partitions_per_expert} * g.shape.experts + 1;
  if (t.partition_index.size() != parts)
    throw FormatError(
        fmt::format("CSF resident bytes: partition_index holds {} entries, the geometry needs {}",
                    t.partition_index.size(), parts));
  return t.encoded_bytes();
}

ResidentBytes resident_bytes(const GridShape& shape) {
  const std::uint64_t n = CsfGeometry::of(shape).native_bytes(shape.layout);
  return {n, n};
}

ResidentBytes resident_bytes(const CsfTensor& tensor) {
  return {tensor.source_bytes(), csf_resident_bytes(tensor)};
}

std::uint64_t expand_scratch_bytes(const GridShape& w13, const GridShape& w2, ScaleLayout layout) {
  return CsfGeometry::of(w13).native_bytes(layout) + CsfGeometry::of(w2).native_bytes(layout);
}

}  // namespace csfmoe
