// Structure-aware fuzzer for the b12x canonical CSF planes (b12x_planes.hpp).
//
// Input: a 3-byte header (flags: bit 0 format, bit 1 raw planes; rows
// selector; cols selector), then either a grid recipe (csf_fuzz_input.hpp's
// form) that is encoded and damaged by a list of edits, or raw planes.
// Properties:
//   - validate_planes() accepts or throws FormatError, nothing else, and never
//     reads out of bounds (ASan) or hits UB (UBSan);
//   - decode_planes(), slice_planes() and planes_to_csf() refuse rejected
//     planes with FormatError too;
//   - accepted planes decode (records win over their slot, as in b12x's and
//     vLLM's readers: the byte of every record, on any code, in or out of
//     the window); their CsfTensor (planes_to_csf) passes validate(),
//     decodes to the same bytes and converts back to canonical_planes(), the
//     encoder's form (code 0 under every record, every record outside its
//     window), which is the input itself where the input had that form; a
//     slice decodes to the slice of the decoded grid; stacked
//     planes decode to the stacked grids; re-encoding the grid gives the
//     planes of csfmoe's own encoder;
//   - undamaged planes decode to their source.
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

using namespace csfmoe;

namespace {

constexpr const char* kName = "fuzz.weight_scale";

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fuzz_b12x_planes: property violated: %s\n", what);
  std::abort();
}

void apply_edit(FuzzedDataProvider& in, CsfPlanes& p) {
  auto pick = [&](std::size_t n) { return n ? in.ConsumeIntegralInRange<std::size_t>(0, n - 1) : 0; };
  auto& recs = p.exceptions;
  switch (in.ConsumeIntegralInRange<int>(0, 8)) {
    case 0:
      if (!p.fixed.empty()) p.fixed[pick(p.fixed.size())] = in.ConsumeIntegral<std::uint8_t>();
      break;
    case 1:  // flip one bit of the fixed plane (a code, a selector bit, a base)
      if (!p.fixed.empty())
        p.fixed[pick(p.fixed.size())] ^= static_cast<std::uint8_t>(1u << in.ConsumeIntegralInRange(0, 7));
      break;
    case 2:
      if (!recs.empty()) recs[pick(recs.size())] = in.ConsumeIntegral<std::uint32_t>();
      break;
    case 3:  // move a record, keeping its byte
      if (!recs.empty()) {
        auto& r = recs[pick(recs.size())];
        r = make_exception(in.ConsumeIntegral<std::uint32_t>(), exception_value(r));
      }
      break;
    case 4:
      if (recs.size() > 1) std::swap(recs[pick(recs.size())], recs[pick(recs.size())]);
      break;
    case 5:
      if (!recs.empty()) {
        const auto i = pick(recs.size());
        recs.insert(recs.begin() + static_cast<std::ptrdiff_t>(i), recs[i]);
      }
      break;
    case 6:
      if (!recs.empty()) recs.erase(recs.begin() + static_cast<std::ptrdiff_t>(pick(recs.size())));
      break;
    case 7: {  // insert a record where it keeps the order
      const std::uint32_t rec = in.ConsumeIntegral<std::uint32_t>();
      recs.insert(std::upper_bound(recs.begin(), recs.end(), rec,
                                   [](std::uint32_t a, std::uint32_t b) {
                                     return exception_position(a) < exception_position(b);
                                   }),
                  rec);
      break;
    }
    case 8: {  // a fixed plane of the wrong size
      const auto n = in.ConsumeIntegralInRange<std::size_t>(1, 64);
      p.fixed.resize(in.ConsumeBool() ? p.fixed.size() + n : p.fixed.size() - std::min(n, p.fixed.size()));
      break;
    }
  }
}

CsfPlanes raw_planes(FuzzedDataProvider& in, const PlaneShape& s) {
  CsfPlanes p;
  p.shape = s;
  p.fixed = in.ConsumeBytes<std::uint8_t>(static_cast<std::size_t>(plane_fixed_bytes(s)));
  p.fixed.resize(static_cast<std::size_t>(plane_fixed_bytes(s)));
  const bool tidy = in.ConsumeBool();
  const std::size_t n = in.ConsumeIntegralInRange<std::size_t>(0, 512);
  for (std::size_t i = 0; i < n && in.remaining_bytes(); ++i)
    p.exceptions.push_back(in.ConsumeIntegral<std::uint32_t>());
  if (tidy) {  // sorted, unique, inside the grid: the deeper checks get their turn
    const std::uint32_t positions = s.rows * s.cols;
    for (auto& r : p.exceptions) r = make_exception(exception_position(r) % positions, exception_value(r));
    std::sort(p.exceptions.begin(), p.exceptions.end(),
              [](std::uint32_t a, std::uint32_t b) { return exception_position(a) < exception_position(b); });
    p.exceptions.erase(std::unique(p.exceptions.begin(), p.exceptions.end(),
                                   [](std::uint32_t a, std::uint32_t b) {
                                     return exception_position(a) == exception_position(b);
                                   }),
                       p.exceptions.end());
  }
  return p;
}

void check_accepted(FuzzedDataProvider& in, const CsfPlanes& p) {
  const PlaneShape& s = p.shape;
  const std::vector<std::uint8_t> native = decode_planes(p, kName);
  const CsfPlanes one[] = {p};
  const CsfTensor t = planes_to_csf(one, kName);
  validate(t);  // a FormatError escaping here fails the run
  std::vector<std::uint8_t> via_csf(native.size());
  decode(t, ScaleLayout::row_major, via_csf, CodecOptions{1, false});
  if (via_csf != native) fail("the CsfTensor of the planes decodes differently");
  // A reader that lets records win: base + code, then every record's byte.
  {
    std::vector<std::uint8_t> wins(native.size());
    const std::size_t row_bytes = s.format == ScaleFormat::nvfp4 ? s.cols / 2 : (s.cols + 7) / 8;
    const std::size_t slab = 16 * (1 + row_bytes);
    bool encoder_form = true;
    for (std::uint32_t r = 0; r < s.rows; ++r)
      for (std::uint32_t c = 0; c < s.cols; ++c) {
        const std::uint8_t base = p.fixed[(r / 16) * slab + r % 16];
        const std::uint8_t* codes = p.fixed.data() + (r / 16) * slab + 16 + (r % 16) * row_bytes;
        const unsigned code = s.format == ScaleFormat::nvfp4 ? (codes[c / 2] >> (4 * (c % 2))) & 0xF
                                                             : (codes[c / 8] >> (c % 8)) & 1;
        wins[std::size_t{r} * s.cols + c] = static_cast<std::uint8_t>(base + code);
      }
    for (const std::uint32_t rec : p.exceptions) {
      const std::uint32_t pos = exception_position(rec), r = pos / s.cols, c = pos % s.cols;
      const std::uint8_t base = p.fixed[(r / 16) * slab + r % 16];
      const std::uint8_t* codes = p.fixed.data() + (r / 16) * slab + 16 + (r % 16) * row_bytes;
      const unsigned code = s.format == ScaleFormat::nvfp4 ? (codes[c / 2] >> (4 * (c % 2))) & 0xF
                                                           : (codes[c / 8] >> (c % 8)) & 1;
      const unsigned w = s.format == ScaleFormat::nvfp4 ? 16 : 2;
      encoder_form = encoder_form && code == 0 && static_cast<std::uint8_t>(exception_value(rec) - base) >= w;
      wins[pos] = exception_value(rec);
    }
    if (wins != native) fail("decode_planes differs from a reader where records win");
    const CsfPlanes canon = canonical_planes(p, kName);
    if (decode_planes(canon, kName) != native) fail("canonical planes decode differently");
    const std::vector<CsfPlanes> back = csf_to_planes(t, kName);
    if (back.size() != 1 || back[0].fixed != canon.fixed || back[0].exceptions != canon.exceptions)
      fail("planes -> CsfTensor -> planes is not canonical_planes()");
    if (encoder_form && (canon.fixed != p.fixed || canon.exceptions != p.exceptions))
      fail("canonical_planes() changed planes already in the encoder's form");
  }

  const CsfPlanes fresh = encode_planes(s, native, kName);
  if (decode_planes(fresh, kName) != native) fail("re-encoded grid decodes differently");
  const CsfTensor own =
      encode(GridShape{s.format, ScaleLayout::row_major, 1, s.rows, s.cols}, native, CodecOptions{1, false});
  const std::vector<CsfPlanes> own_planes = csf_to_planes(own, kName);
  if (own_planes[0].fixed != fresh.fixed || own_planes[0].exceptions != fresh.exceptions)
    fail("encode_planes differs from csfmoe's encoder");

  // A slice: one slab-aligned row range, one column range (even for NVFP4).
  const std::uint32_t slabs = s.rows / plane_slab_rows;
  const std::uint32_t a = in.ConsumeIntegralInRange<std::uint32_t>(0, slabs - 1);
  const std::uint32_t b = in.ConsumeIntegralInRange<std::uint32_t>(a + 1, slabs);
  const std::uint32_t step = s.format == ScaleFormat::nvfp4 ? 2 : 1, units = s.cols / step;
  const std::uint32_t c0 = in.ConsumeIntegralInRange<std::uint32_t>(0, units - 1);
  const std::uint32_t c1 = in.ConsumeIntegralInRange<std::uint32_t>(c0 + 1, units);
  const AxisRange rows[] = {{a * plane_slab_rows, (b - a) * plane_slab_rows}};
  const AxisRange cols{c0 * step, (c1 - c0) * step};
  const CsfPlanes sl = slice_planes(p, rows, cols, kName);
  std::vector<std::uint8_t> want;
  for (std::uint64_t r = rows[0].first; r < rows[0].first + rows[0].count; ++r)
    for (std::uint64_t c = cols.first; c < cols.first + cols.count; ++c)
      want.push_back(native[r * s.cols + c]);
  if (decode_planes(sl, kName) != want) fail("slice does not decode to the native slice");

  // Stacking the planes and the slice: the stacked grids, and their encoding.
  const CsfPlanes parts[] = {p, sl.shape.cols == s.cols ? sl : p};
  const CsfPlanes joined = concat_planes(parts, kName);
  std::vector<std::uint8_t> stacked = native;
  const std::vector<std::uint8_t> second = decode_planes(parts[1], kName);
  stacked.insert(stacked.end(), second.begin(), second.end());
  if (decode_planes(joined, kName) != stacked) fail("concatenated planes do not decode to the stacked grids");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  std::uint8_t h[3] = {};
  const auto head = in.ConsumeBytes<std::uint8_t>(3);
  std::copy(head.begin(), head.end(), h);
  const ScaleFormat f = (h[0] & 1) ? ScaleFormat::mxfp4 : ScaleFormat::nvfp4;
  const bool raw = (h[0] >> 1) & 1;
  const std::uint32_t rows = plane_slab_rows * (1 + h[1] % 16);
  const std::uint32_t cols = f == ScaleFormat::nvfp4 ? 2 * (1 + h[2] % 20) : 1 + h[2] % 40;
  const PlaneShape s{f, rows, cols};

  CsfPlanes p;
  std::vector<std::uint8_t> source;
  if (raw) {
    p = raw_planes(in, s);
  } else {
    const CsfGeometry g = CsfGeometry::of(GridShape{f, ScaleLayout::row_major, 1, rows, cols});
    source = csfmoe_fuzz::read_grid(in, g);
    p = encode_planes(s, source, kName);
  }
  const int wanted = in.ConsumeIntegralInRange<int>(0, 6);
  int edits = 0;
  for (; edits < wanted && in.remaining_bytes(); ++edits) apply_edit(in, p);

  bool accepted = false;
  try {
    validate_planes(s, p.fixed, p.exceptions, kName);
    accepted = true;
  } catch (const FormatError&) {
  }
  if (!accepted) {
    std::vector<std::uint8_t> out(std::size_t{rows} * cols);
    const CsfPlanes one[] = {p};
    const AxisRange all_rows[] = {{0, rows}};
    try {
      decode_planes(s, p.fixed, p.exceptions, out, kName);
      fail("decode_planes accepted planes that validate_planes rejected");
    } catch (const FormatError&) {
    }
    try {
      (void)slice_planes(p, all_rows, {0, cols}, kName);
      fail("slice_planes accepted planes that validate_planes rejected");
    } catch (const FormatError&) {
    }
    try {
      (void)planes_to_csf(one, kName);
      fail("planes_to_csf accepted planes that validate_planes rejected");
    } catch (const FormatError&) {
    }
    return 0;
  }
  check_accepted(in, p);
  if (!raw && edits == 0 && decode_planes(p, kName) != source)
    fail("undamaged planes do not decode to their source");
  return 0;
}
