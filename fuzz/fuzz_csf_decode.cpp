// Structure-aware fuzzer for the CSF codec's handling of untrusted parts.
//
// The input is read as a small GridShape plus either (a) a source grid that is
// encoded and then damaged by a list of edits (flipped bases and offsets,
// records moved out of range, swapped, duplicated or dropped, prefix entries
// that stop adding up, parts of the wrong size, lying geometry), or (b) raw
// parts. Properties:
//   - validate() either accepts or throws FormatError; nothing else, and
//     never an out-of-bounds access (ASan) or UB (UBSan);
//   - decode() of rejected parts throws FormatError too;
//   - whenever validate() accepts, decode() succeeds in both layouts, the
//     reference and fast decoders agree, decode_experts() matches, and
//     re-encoding the decoded grid decodes to the same bytes;
//   - undamaged encoder output decodes to the source exactly, and the fast and
//     reference encoders produce identical parts.
// Shapes stay small (<= 3 experts, <= 256 rows, <= 40 cols) so an input can
// never make the fuzzer allocate much.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <vector>

#include "csf_fuzz_input.hpp"
#include "csfmoe/codec.hpp"
#include "csfmoe/errors.hpp"

using namespace csfmoe;

namespace {

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fuzz_csf_decode: property violated: %s\n", what);
  std::abort();
}

std::vector<std::uint8_t> decode_to(const CsfTensor& t, ScaleLayout l, bool reference) {
  std::vector<std::uint8_t> out(t.geometry.native_bytes(l));
  CodecOptions o;
  o.threads = 1;
  o.reference = reference;
  decode(t, l, out, o);
  return out;
}

void apply_edit(FuzzedDataProvider& in, CsfTensor& t) {
  const auto op = in.ConsumeIntegralInRange<int>(0, 11);
  auto pick = [&](std::size_t n) { return n ? in.ConsumeIntegralInRange<std::size_t>(0, n - 1) : 0; };
  switch (op) {
    case 0:
      if (!t.fixed.empty()) t.fixed[pick(t.fixed.size())] = in.ConsumeIntegral<std::uint8_t>();
      break;
    case 1:
      if (!t.exceptions.empty())
        t.exceptions[pick(t.exceptions.size())] = in.ConsumeIntegral<std::uint32_t>();
      break;
    case 2:  // move a record's position only (keeps its value)
      if (!t.exceptions.empty()) {
        auto& r = t.exceptions[pick(t.exceptions.size())];
        r = make_exception(in.ConsumeIntegral<std::uint32_t>(), exception_value(r));
      }
      break;
    case 3:
      if (t.exceptions.size() > 1)
        std::swap(t.exceptions[pick(t.exceptions.size())], t.exceptions[pick(t.exceptions.size())]);
      break;
    case 4:  // duplicate a record
      if (!t.exceptions.empty()) {
        const auto i = pick(t.exceptions.size());
        t.exceptions.insert(t.exceptions.begin() + static_cast<std::ptrdiff_t>(i), t.exceptions[i]);
      }
      break;
    case 5:
      if (!t.exceptions.empty())
        t.exceptions.erase(t.exceptions.begin() + static_cast<std::ptrdiff_t>(pick(t.exceptions.size())));
      break;
    case 6:
      if (!t.row_prefix.empty())
        t.row_prefix[pick(t.row_prefix.size())] += in.ConsumeIntegralInRange<std::uint32_t>(0, 3) - 1u;
      break;
    case 7:
      if (!t.row_prefix.empty())
        t.row_prefix[pick(t.row_prefix.size())] = in.ConsumeIntegral<std::uint32_t>();
      break;
    case 8:
      if (!t.partition_index.empty())
        t.partition_index[pick(t.partition_index.size())] = in.ConsumeIntegral<std::uint32_t>();
      break;
    case 9: {  // a part of the wrong size
      const auto which = in.ConsumeIntegralInRange<int>(0, 3);
      const auto n = in.ConsumeIntegralInRange<std::size_t>(0, 64);
      const bool grow = in.ConsumeBool();
      auto resize = [&](auto& v) { v.resize(grow ? v.size() + n : v.size() - std::min(n, v.size())); };
      if (which == 0) resize(t.fixed);
      if (which == 1) resize(t.exceptions);
      if (which == 2) resize(t.row_prefix);
      if (which == 3) resize(t.partition_index);
      break;
    }
    case 10: {  // geometry that lies about the parts
      auto& g = t.geometry;
      switch (in.ConsumeIntegralInRange<int>(0, 4)) {
        case 0:
          g.padded_rows += in.ConsumeIntegralInRange<std::uint32_t>(0, 256);
          break;
        case 1:
          g.padded_cols = in.ConsumeIntegral<std::uint32_t>();
          break;
        case 2:
          g.slab_bytes = in.ConsumeIntegral<std::uint64_t>();
          break;
        case 3:
          g.partitions_per_expert = in.ConsumeIntegral<std::uint32_t>();
          break;
        case 4:
          g.fixed_bytes_per_expert = in.ConsumeIntegral<std::uint64_t>();
          break;
      }
      break;
    }
    case 11: {  // a different shape over the same parts
      auto& s = t.geometry.shape;
      switch (in.ConsumeIntegralInRange<int>(0, 3)) {
        case 0:
          s.experts = in.ConsumeIntegralInRange<std::uint32_t>(0, 4);
          break;
        case 1:
          s.rows = in.ConsumeIntegralInRange<std::uint32_t>(0, 600);
          break;
        case 2:
          s.cols = in.ConsumeIntegralInRange<std::uint32_t>(0, 80);
          break;
        case 3:
          s.format = static_cast<ScaleFormat>(in.ConsumeIntegralInRange<int>(0, 2));
          break;
      }
      // Keep the derived fields consistent with the new shape when it is valid,
      // so that the deeper checks get exercised rather than the geometry check.
      try {
        t.geometry = CsfGeometry::of(s);
      } catch (const InvalidArgument&) {
      }
      break;
    }
  }
}

// Raw parts straight from the input: the counts per row come from the input,
// and the prefix is either their honest sum or raw words.
CsfTensor raw_parts(FuzzedDataProvider& in, const CsfGeometry& g) {
  CsfTensor t;
  t.geometry = g;
  t.fixed = in.ConsumeBytes<std::uint8_t>(static_cast<std::size_t>(g.fixed_bytes()));
  if (in.ConsumeBool()) t.fixed.resize(static_cast<std::size_t>(g.fixed_bytes()));
  const bool honest_prefix = in.ConsumeBool();
  const std::size_t rows = static_cast<std::size_t>(g.total_rows());
  t.row_prefix.assign(rows + 1, 0);
  std::uint32_t sum = 0;
  for (std::size_t i = 0; i < rows && in.remaining_bytes(); ++i) {
    if (honest_prefix) {
      sum += in.ConsumeIntegralInRange<std::uint32_t>(0, 2) == 2 ? 1u : 0u;
      t.row_prefix[i + 1] = sum;
    } else {
      t.row_prefix[i + 1] = in.ConsumeIntegralInRange<std::uint32_t>(0, 8);
    }
  }
  if (honest_prefix)
    for (std::size_t i = 1; i <= rows; ++i) t.row_prefix[i] = std::max(t.row_prefix[i], t.row_prefix[i - 1]);
  const std::size_t n = std::min<std::size_t>(t.row_prefix.back(), 4096);
  for (std::size_t i = 0; i < n; ++i) t.exceptions.push_back(in.ConsumeIntegral<std::uint32_t>());
  t.partition_index.resize(std::size_t{g.partitions_per_expert} * g.shape.experts + 1);
  for (std::size_t i = 0; i < t.partition_index.size(); ++i)
    t.partition_index[i] = t.row_prefix[std::min(rows, i * g.partition_rows)];
  return t;
}

void check_accepted(const CsfTensor& t, bool thorough) {
  const GridShape& s = t.geometry.shape;
  const auto src_ref = decode_to(t, s.layout, true);
  const auto src_fast = decode_to(t, s.layout, false);
  if (src_ref != src_fast) fail("reference and fast decode disagree (source layout)");
  const auto rm_ref = decode_to(t, ScaleLayout::row_major, thorough);
  if (rm_ref != decode_to(t, ScaleLayout::row_major, false))
    fail("reference and fast decode disagree (row_major)");
  const auto sw_fast = decode_to(t, ScaleLayout::swizzled_128x4, false);
  if (thorough && sw_fast != decode_to(t, ScaleLayout::swizzled_128x4, true))
    fail("reference and fast decode disagree (swizzled_128x4)");

  // One expert alone must match its slice of the full decode, others untouched.
  const std::uint32_t e = s.experts - 1;
  std::vector<std::uint8_t> part(src_ref.size(), 0xA5);
  const std::uint32_t list[] = {e, e};
  CodecOptions o;
  o.threads = 1;
  decode_experts(t, list, s.layout, part, o);
  const std::size_t per = src_ref.size() / s.experts;
  for (std::size_t i = 0; i < part.size(); ++i)
    if (part[i] != (i / per == e ? src_ref[i] : 0xA5)) fail("decode_experts differs from decode");

  // Re-encoding the decoded grid gives parts that decode to the same bytes.
  const CsfTensor again = encode(s, src_ref, o);
  validate(again);
  if (decode_to(again, s.layout, false) != src_ref) fail("re-encoded grid decodes differently");
  if (decode_to(again, ScaleLayout::row_major, false) != rm_ref)
    fail("re-encoded grid decodes differently (row_major)");
  (void)stats(t);
  for (std::uint32_t r = 0; r < t.geometry.padded_rows; r += 37) (void)row_base(t, 0, r);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  const csfmoe_fuzz::ShapeChoice choice = csfmoe_fuzz::read_shape(in);
  CsfGeometry g;
  try {
    g = CsfGeometry::of(choice.shape);
  } catch (const InvalidArgument&) {
    return 0;  // read_shape only makes valid shapes; keep going regardless
  }

  CsfTensor t;
  std::vector<std::uint8_t> source;
  CodecOptions o;
  o.threads = 1;
  if (!choice.raw) {
    source = csfmoe_fuzz::read_grid(in, g);
    t = encode(g.shape, source, o);
  }
  if (!choice.raw && choice.compare_encoders) {  // the reference encoder is slow: only when asked
    CodecOptions ref = o;
    ref.reference = true;
    const CsfTensor r = encode(g.shape, source, ref);
    if (r.fixed != t.fixed || r.exceptions != t.exceptions || r.row_prefix != t.row_prefix ||
        r.partition_index != t.partition_index)
      fail("fast and reference encoders disagree");
  }
  if (choice.raw) {
    t = raw_parts(in, g);
  }
  const int wanted = in.ConsumeIntegralInRange<int>(0, 6);
  int edits = 0;
  for (; edits < wanted && in.remaining_bytes(); ++edits) apply_edit(in, t);

  bool accepted = false;
  try {
    validate(t);
    accepted = true;
  } catch (const FormatError&) {
  }
  if (!accepted) {
    // decode must refuse the same parts (its destination must be sized from
    // the claimed geometry, which can itself be nonsense: guard the size).
    const std::uint64_t n = t.geometry.native_bytes(ScaleLayout::row_major);
    if (n <= (std::uint64_t{1} << 24)) {
      std::vector<std::uint8_t> out(static_cast<std::size_t>(n));
      try {
        decode(t, ScaleLayout::row_major, out, o);
        fail("decode accepted parts that validate rejected");
      } catch (const FormatError&) {
      } catch (const InvalidArgument&) {
        // a lying geometry can make the destination size itself wrong
      }
    }
    return 0;
  }
  check_accepted(t, choice.compare_encoders);
  if (!choice.raw && edits == 0 && decode_to(t, g.shape.layout, false) != source)
    fail("undamaged encoding does not decode to its source");
  return 0;
}
