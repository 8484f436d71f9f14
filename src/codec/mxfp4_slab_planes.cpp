// MXFP4 slab planes: b12x's MXFP4 planes with one base per 16-row slab plus a
// 2-bit delta per row and unpadded selector bits (docs/csf-format.md, "MXFP4
// slab planes").
#include "csfmoe/mxfp4_slab_planes.hpp"

#include <algorithm>
#include <array>

#include "codec/csf_internal.hpp"

namespace csfmoe {

using namespace csf_internal;

namespace {

constexpr u32 kSlabRows = plane_slab_rows;
constexpr unsigned kDeltaRange = mxfp4_slab_escape;  // codes 0..2: slab base + code
constexpr u8 kMaxBase = 254;                         // the window [base, base + 1] fits in a byte

// Little-endian bit stream over bytes that start zeroed.
struct BitWriter {
  u8* out;
  u64 acc = 0;
  unsigned held = 0;
  void put(u64 bits, unsigned n) {  // n <= 56
    acc |= bits << held;
    held += n;
    while (held >= 8) {
      *out++ = static_cast<u8>(acc);
      acc >>= 8;
      held -= 8;
    }
  }
  void flush() {
    if (held) *out++ = static_cast<u8>(acc);
    acc = 0;
    held = 0;
  }
};

struct BitReader {
  const u8* in;
  u64 acc = 0;
  unsigned held = 0;
  u64 get(unsigned n) {  // n <= 56
    while (held < n) {
      acc |= u64{*in++} << held;
      held += 8;
    }
    const u64 v = acc & ((u64{1} << n) - 1);
    acc >>= n;
    held -= n;
    return v;
  }
};

// Up to 56 bits of a row's selector bytes starting at column c0 (a multiple of 56).
u64 load_bits(const u8* row, u32 c0, unsigned n) {
  u64 v = 0;
  const u32 first = c0 / 8, bytes = (n + 7) / 8;
  for (u32 k = 0; k < bytes; ++k) v |= u64{row[first + k]} << (8 * k);
  return n == 64 ? v : v & ((u64{1} << n) - 1);
}
void store_bits(u8* row, u32 c0, unsigned n, u64 v) {
  const u32 first = c0 / 8, bytes = (n + 7) / 8;
  for (u32 k = 0; k < bytes; ++k) row[first + k] = static_cast<u8>(v >> (8 * k));
}
constexpr unsigned kChunk = 56;

void check_mxfp4_shape(const PlaneShape& s, std::string_view name) {
  if (s.format != kMx)
    throw InvalidArgument(
        fmt::format("{}: MXFP4 slab planes: grid {} is not MXFP4 (the slab form holds 1-bit selectors)", name,
                    to_string(s)));
  check_plane_shape(s, name);
}

}  // namespace

Mxfp4SlabPlanes planes_to_mxfp4_slabs(const CsfPlanes& source, std::string_view name) {
  check_mxfp4_shape(source.shape, name);
  const CsfPlanes planes = canonical_planes(source, name);  // the slab form is written: encoder's form
  const PlaneShape& s = planes.shape;
  const csf::PlaneLayout in(kMx, s.rows, s.cols);
  const u64 slab_bytes = mxfp4_slab_bytes(s.cols);
  Mxfp4SlabPlanes out;
  out.shape = s;
  out.slabs.assign(mxfp4_slab_plane_bytes(s), 0);
  out.exceptions = planes.exceptions;
  for (u32 slab = 0; slab < s.rows / kSlabRows; ++slab) {
    const u32 r0 = slab * kSlabRows;
    u8* dst = out.slabs.data() + std::size_t{slab} * slab_bytes;
    // The slab base: the lowest b whose [b, b + 2] holds the most row bases.
    std::array<u32, 256> count{};
    for (u32 i = 0; i < kSlabRows; ++i) ++count[planes.fixed[in.base_at(r0 + i)]];
    u32 best = 0;
    u8 slab_base = 0;
    for (unsigned b = 0; b <= kMaxBase; ++b) {
      u32 n = 0;
      for (unsigned k = 0; k < kDeltaRange && b + k < 256; ++k) n += count[b + k];
      if (n > best) {
        best = n;
        slab_base = static_cast<u8>(b);
      }
    }
    dst[0] = slab_base;
    for (u32 i = 0; i < kSlabRows; ++i) {
      const u8 base = planes.fixed[in.base_at(r0 + i)];
      const u8 delta = static_cast<u8>(base - slab_base);
      if (delta < kDeltaRange) {
        csf::set_mxfp4_slab_delta_code(dst, i, delta);
      } else {
        csf::set_mxfp4_slab_delta_code(dst, i, mxfp4_slab_escape);
        out.escapes.push_back(base);
      }
    }
    BitWriter bits{dst + csf::mxfp4_slab_selector_byte};
    for (u32 i = 0; i < kSlabRows; ++i) {
      const u8* row = planes.fixed.data() + in.codes_at(r0 + i);
      for (u32 c = 0; c < s.cols; c += kChunk) {
        const unsigned n = std::min<u32>(kChunk, s.cols - c);
        bits.put(load_bits(row, c, n), n);
      }
    }
    bits.flush();  // 16 * cols bits: always whole bytes
  }
  return out;
}

std::uint64_t mxfp4_slab_escape_count(const PlaneShape& s, std::span<const std::uint8_t> slabs,
                                      std::string_view name) {
  check_mxfp4_shape(s, name);
  const u64 want = mxfp4_slab_plane_bytes(s), slab_bytes = mxfp4_slab_bytes(s.cols);
  if (slabs.size() != want)
    throw FormatError(
        fmt::format("{}: MXFP4 slab planes hold {} bytes, expected {} ({} slabs of {} bytes) for grid {}",
                    name, slabs.size(), want, s.rows / kSlabRows, slab_bytes, to_string(s)));
  u64 n = 0;
  for (u64 at = 0; at < want; at += slab_bytes)
    for (u32 i = 0; i < kSlabRows; ++i)
      n += csf::mxfp4_slab_delta_code(slabs.data() + at, i) == mxfp4_slab_escape;
  return n;
}

CsfPlanes mxfp4_slabs_to_planes(const PlaneShape& s, std::span<const std::uint8_t> slabs,
                                std::span<const std::uint8_t> escapes,
                                std::span<const std::uint32_t> exceptions, std::string_view name) {
  const u64 escape_codes = mxfp4_slab_escape_count(s, slabs, name);  // checks the shape and size
  if (escape_codes != escapes.size())
    throw FormatError(fmt::format(
        "{}: MXFP4 slab planes: {} rows are escaped but the escape list holds {} bases (one per escaped row)",
        name, escape_codes, escapes.size()));
  const csf::PlaneLayout out_rows(kMx, s.rows, s.cols);
  const u64 slab_bytes = mxfp4_slab_bytes(s.cols);
  CsfPlanes out;
  out.shape = s;
  out.fixed.assign(plane_fixed_bytes(s), 0);
  std::size_t next_escape = 0;
  for (u32 slab = 0; slab < s.rows / kSlabRows; ++slab) {
    const u32 r0 = slab * kSlabRows;
    const u8* src = slabs.data() + std::size_t{slab} * slab_bytes;
    const u8 slab_base = src[0];
    if (slab_base > kMaxBase)
      throw FormatError(fmt::format("{}: MXFP4 slab planes: slab {} (rows {}..{}) has base {}, above {}",
                                    name, slab, r0, r0 + kSlabRows - 1, slab_base, kMaxBase));
    for (u32 i = 0; i < kSlabRows; ++i) {
      const u8 code = csf::mxfp4_slab_delta_code(src, i);
      unsigned base;
      if (code == mxfp4_slab_escape) {
        base = escapes[next_escape];
        if (base > kMaxBase)
          throw FormatError(fmt::format("{}: MXFP4 slab planes: escape {} (row {}) holds base {}, above {}",
                                        name, next_escape, r0 + i, base, kMaxBase));
        if (static_cast<u8>(base - slab_base) < kDeltaRange)
          throw FormatError(
              fmt::format("{}: MXFP4 slab planes: escape {} (row {}) holds base {}, within [{}, {}] of its "
                          "slab base (it must "
                          "be a delta code)",
                          name, next_escape, r0 + i, base, slab_base, slab_base + kDeltaRange - 1));
        ++next_escape;
      } else {
        base = unsigned{slab_base} + code;
        if (base > kMaxBase)
          throw FormatError(fmt::format("{}: MXFP4 slab planes: row {} has base {} + {} = {}, above {}", name,
                                        r0 + i, slab_base, code, base, kMaxBase));
      }
      out.fixed[out_rows.base_at(r0 + i)] = static_cast<u8>(base);
    }
    BitReader bits{src + csf::mxfp4_slab_selector_byte};
    for (u32 i = 0; i < kSlabRows; ++i) {
      u8* row = out.fixed.data() + out_rows.codes_at(r0 + i);
      for (u32 c = 0; c < s.cols; c += kChunk) {
        const unsigned n = std::min<u32>(kChunk, s.cols - c);
        store_bits(row, c, n, bits.get(n));
      }
    }
  }
  out.exceptions.assign(exceptions.begin(), exceptions.end());
  // The rows are now b12x's; the records get b12x's checks against them.
  validate_planes(s, out.fixed, out.exceptions, name);
  return out;
}

CsfPlanes mxfp4_slabs_to_planes(const Mxfp4SlabPlanes& p, std::string_view name) {
  return mxfp4_slabs_to_planes(p.shape, p.slabs, p.escapes, p.exceptions, name);
}

std::uint64_t mxfp4_slabs_stored_bytes(std::span<const Mxfp4SlabPlanes> experts) {
  u64 n = 0;
  for (const auto& e : experts) n += e.slabs.size() + e.escapes.size() + 4 * e.exceptions.size() + 4;
  return n;
}

}  // namespace csfmoe
