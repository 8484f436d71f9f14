// Structure-aware fuzzer for the MXFP4 slab planes (mxfp4_slab_planes.hpp).
//
// Input: a 3-byte header (flags: bit 1 raw parts; rows selector; cols
// selector), then either a grid recipe (csf_fuzz_input.hpp's form) that is
// encoded to planes, put in slab form and damaged by a list of edits, or raw
// slab parts.
// Properties:
//   - mxfp4_slabs_to_planes() accepts or throws FormatError, nothing else,
//     and never reads out of bounds (ASan) or hits UB (UBSan);
//   - accepted parts give planes that validate_planes() accepts; those
//     planes in slab form (planes_to_mxfp4_slabs) give back their
//     canonical_planes() (records may win over their slot, as in b12x's
//     readers; the slab form is written in the encoder's form), which decode
//     to the same bytes and are the planes themselves where they already had
//     that form;
//   - undamaged parts are the slab form of the encoder's planes and decode to
//     their source.
// Shapes stay small (<= 256 rows, <= 40 columns).
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "csf_fuzz_input.hpp"
#include "csfmoe/b12x_planes.hpp"
#include "csfmoe/codec.hpp"
#include "csfmoe/errors.hpp"
#include "csfmoe/mxfp4_slab_planes.hpp"

using namespace csfmoe;

namespace {

constexpr const char* kName = "fuzz.scales";

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fuzz_mxfp4_slabs: property violated: %s\n", what);
  std::abort();
}

void apply_edit(FuzzedDataProvider& in, Mxfp4SlabPlanes& p) {
  auto pick = [&](std::size_t n) { return n ? in.ConsumeIntegralInRange<std::size_t>(0, n - 1) : 0; };
  auto& recs = p.exceptions;
  switch (in.ConsumeIntegralInRange<int>(0, 8)) {
    case 0:
      if (!p.slabs.empty()) p.slabs[pick(p.slabs.size())] = in.ConsumeIntegral<std::uint8_t>();
      break;
    case 1:  // flip one bit (a slab base, a delta code, a selector bit)
      if (!p.slabs.empty())
        p.slabs[pick(p.slabs.size())] ^= static_cast<std::uint8_t>(1u << in.ConsumeIntegralInRange(0, 7));
      break;
    case 2:
      if (!p.escapes.empty()) p.escapes[pick(p.escapes.size())] = in.ConsumeIntegral<std::uint8_t>();
      break;
    case 3:
      p.escapes.insert(p.escapes.begin() + static_cast<std::ptrdiff_t>(pick(p.escapes.size() + 1)),
                       in.ConsumeIntegral<std::uint8_t>());
      break;
    case 4:
      if (!p.escapes.empty())
        p.escapes.erase(p.escapes.begin() + static_cast<std::ptrdiff_t>(pick(p.escapes.size())));
      break;
    case 5:
      if (!recs.empty()) recs[pick(recs.size())] = in.ConsumeIntegral<std::uint32_t>();
      break;
    case 6:
      if (recs.size() > 1) std::swap(recs[pick(recs.size())], recs[pick(recs.size())]);
      break;
    case 7:
      if (!recs.empty()) recs.erase(recs.begin() + static_cast<std::ptrdiff_t>(pick(recs.size())));
      break;
    case 8: {  // slab data of the wrong size
      const auto n = in.ConsumeIntegralInRange<std::size_t>(1, 64);
      p.slabs.resize(in.ConsumeBool() ? p.slabs.size() + n : p.slabs.size() - std::min(n, p.slabs.size()));
      break;
    }
  }
}

Mxfp4SlabPlanes raw_parts(FuzzedDataProvider& in, const PlaneShape& s) {
  Mxfp4SlabPlanes p;
  p.shape = s;
  p.slabs = in.ConsumeBytes<std::uint8_t>(static_cast<std::size_t>(mxfp4_slab_plane_bytes(s)));
  p.slabs.resize(static_cast<std::size_t>(mxfp4_slab_plane_bytes(s)));
  p.escapes = in.ConsumeBytes<std::uint8_t>(in.ConsumeIntegralInRange<std::size_t>(0, 64));
  const std::size_t n = in.ConsumeIntegralInRange<std::size_t>(0, 256);
  for (std::size_t i = 0; i < n && in.remaining_bytes(); ++i)
    p.exceptions.push_back(in.ConsumeIntegral<std::uint32_t>());
  if (in.ConsumeBool()) {  // sorted, unique, inside the grid: the deeper checks get their turn
    const std::uint32_t positions = s.rows * s.cols;
    for (auto& r : p.exceptions) r = make_exception(exception_position(r) % positions, exception_value(r));
    const auto by_pos = [](std::uint32_t a, std::uint32_t b) {
      return exception_position(a) < exception_position(b);
    };
    std::sort(p.exceptions.begin(), p.exceptions.end(), by_pos);
    p.exceptions.erase(std::unique(p.exceptions.begin(), p.exceptions.end(),
                                   [](std::uint32_t a, std::uint32_t b) {
                                     return exception_position(a) == exception_position(b);
                                   }),
                       p.exceptions.end());
  }
  return p;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  std::uint8_t h[3] = {};
  const auto head = in.ConsumeBytes<std::uint8_t>(3);
  std::copy(head.begin(), head.end(), h);
  const bool raw = (h[0] >> 1) & 1;
  const std::uint32_t rows = plane_slab_rows * (1 + h[1] % 16);
  const std::uint32_t cols = 1 + h[2] % 40;
  const PlaneShape s{ScaleFormat::mxfp4, rows, cols};

  Mxfp4SlabPlanes p;
  std::vector<std::uint8_t> source;
  CsfPlanes encoded;
  if (raw) {
    p = raw_parts(in, s);
  } else {
    const CsfGeometry g = CsfGeometry::of(GridShape{s.format, ScaleLayout::row_major, 1, rows, cols});
    source = csfmoe_fuzz::read_grid(in, g);
    encoded = encode_planes(s, source, kName);
    p = planes_to_mxfp4_slabs(encoded, kName);
  }
  const int wanted = in.ConsumeIntegralInRange<int>(0, 6);
  int edits = 0;
  for (; edits < wanted && in.remaining_bytes(); ++edits) apply_edit(in, p);

  CsfPlanes planes;
  try {
    planes = mxfp4_slabs_to_planes(p, kName);
  } catch (const FormatError&) {
    if (!raw && edits == 0) fail("undamaged slab parts were refused");
    return 0;
  }
  validate_planes(s, planes.fixed, planes.exceptions, kName);  // a FormatError escaping here fails the run
  const Mxfp4SlabPlanes again = planes_to_mxfp4_slabs(planes, kName);
  const CsfPlanes back = mxfp4_slabs_to_planes(again, kName);
  const CsfPlanes canon = canonical_planes(planes, kName);
  if (back.fixed != canon.fixed || back.exceptions != canon.exceptions)
    fail("planes -> slabs -> planes is not canonical_planes()");
  if (decode_planes(back, kName) != decode_planes(planes, kName))
    fail("planes -> slabs -> planes decode differently");
  const CsfPlanes twice = canonical_planes(canon, kName);
  if (twice.fixed != canon.fixed || twice.exceptions != canon.exceptions)
    fail("canonical_planes() is not idempotent");
  if (!raw && edits == 0) {
    if (planes.fixed != encoded.fixed || planes.exceptions != encoded.exceptions)
      fail("undamaged slab parts do not give the encoder's planes");
    if (decode_planes(planes, kName) != source) fail("undamaged slab parts do not decode to their source");
  }
  return 0;
}
