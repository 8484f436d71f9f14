// Resident-memory accounting for scale tensors, host only (no CUDA needed):
// what a layer keeps on the device when its block scales stay native, and
// what it keeps once they are CSF (the parts DeviceCsfTensor::upload or
// encode_on_device allocate). Used by `csf inspect --device`.
#pragma once

#include <cstdint>

#include "csfmoe/codec.hpp"
#include "csfmoe/formats.hpp"

namespace csfmoe {

struct ResidentBytes {
  std::uint64_t native = 0;  // device bytes of the native tensor(s) in their source layout
  std::uint64_t csf = 0;     // device bytes actually held: CSF parts, or the native bytes when kept native

  // csf / native (1.0 when nothing is compressed, 0 when empty).
  double ratio() const { return native ? double(csf) / double(native) : 0.0; }
  std::uint64_t saved() const { return native > csf ? native - csf : 0; }
  ResidentBytes& operator+=(const ResidentBytes& o) {
    native += o.native;
    csf += o.csf;
    return *this;
  }
  friend ResidentBytes operator+(ResidentBytes a, const ResidentBytes& b) { return a += b; }
  friend bool operator==(const ResidentBytes&, const ResidentBytes&) = default;
};

// Device bytes a DeviceCsfTensor of `tensor` holds: the fixed part plus
// 4 bytes per exception record, row_prefix and partition_index entry (equal
// to tensor.encoded_bytes(); DeviceCsfTensor::resident_bytes() reports the
// same number). Throws FormatError if the parts do not match the geometry.
std::uint64_t csf_resident_bytes(const CsfTensor& tensor);

// A tensor kept native: {native_bytes(shape.layout), same}. Validates the shape.
ResidentBytes resident_bytes(const GridShape& shape);
// A tensor stored as CSF: {source bytes, csf_resident_bytes}.
ResidentBytes resident_bytes(const CsfTensor& tensor);

// Scratch an expand-all of one layer needs (w13 then w2 grids in `layout`);
// one scratch serves every layer of a model, so a model needs the maximum
// over its layers, not the sum.
std::uint64_t expand_scratch_bytes(const GridShape& w13, const GridShape& w2, ScaleLayout layout);

}  // namespace csfmoe
