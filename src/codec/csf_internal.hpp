// Internal to the CPU CSF codec (src/codec/csf_*.cpp): integer and vector
// types, fixed-part access by (expert, row, col), shared checks and the
// entry points each file provides to the others.
#pragma once

#include <fmt/format.h>

#include <array>
#include <bit>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "csfmoe/codec.hpp"
#include "csfmoe/errors.hpp"

namespace csfmoe::csf_internal {

using u64 = std::uint64_t;
using u32 = std::uint32_t;
using u8 = std::uint8_t;

constexpr ScaleFormat kNv = ScaleFormat::nvfp4;
constexpr ScaleFormat kMx = ScaleFormat::mxfp4;

// GCC/Clang vector extensions: lowered to SSE2/AVX on x86 and NEON on ARM,
// so one source serves every target.
using u8x16 = u8 __attribute__((vector_size(16)));
using u8x8 = u8 __attribute__((vector_size(8)));
using u16x8 = std::uint16_t __attribute__((vector_size(16)));
using u32x4 = u32 __attribute__((vector_size(16)));

// Byte j of kSpreadBits.v[x] is bit j of x: eight 1-bit selectors (MXFP4
// offsets) to eight bytes in one add of the row's bases.
struct SpreadBits {
  std::array<u64, 256> v{};
  constexpr SpreadBits() {
    for (unsigned x = 0; x < 256; ++x)
      for (unsigned j = 0; j < 8; ++j)
        if (x >> j & 1) v[x] |= u64{1} << (8 * j);
  }
};
inline constexpr SpreadBits kSpreadBits{};
static_assert(std::endian::native == std::endian::little, "kSpreadBits words are stored as bytes");

// ---------------------------------------------------------------------------
// Fixed-part access by (expert, row, col); the layout is csf_layout.hpp's.
// ---------------------------------------------------------------------------
struct Fixed {
  const CsfGeometry& g;
  u8* data;

  u8* slab(u32 e, u32 r) const {
    return data + csf::slab_offset(g.shape.format, e, r, g.fixed_bytes_per_expert, g.slab_bytes);
  }
  u8 base(u32 e, u32 r) const { return slab(e, r)[csf::base_index(g.shape.format, r)]; }
  void set_base(u32 e, u32 r, u8 b) const { slab(e, r)[csf::base_index(g.shape.format, r)] = b; }
  u8 offset(u32 e, u32 r, u32 c) const {
    const u8* s = slab(e, r);
    if (g.shape.format == ScaleFormat::nvfp4)
      return static_cast<u8>((s[csf::nvfp4_offset_byte(r, c)] >> csf::nvfp4_offset_shift(r, c)) & 0xF);
    return static_cast<u8>((s[csf::mxfp4_offset_byte(r, c, g.padded_cols)] >> csf::mxfp4_offset_bit(c)) & 1);
  }
  // The slot must still be 0 (the fixed part starts zeroed).
  void set_offset(u32 e, u32 r, u32 c, u8 off) const {
    u8* s = slab(e, r);
    u8& slot = g.shape.format == ScaleFormat::nvfp4 ? s[csf::nvfp4_offset_byte(r, c)]
                                                    : s[csf::mxfp4_offset_byte(r, c, g.padded_cols)];
    const u32 shift =
        g.shape.format == ScaleFormat::nvfp4 ? csf::nvfp4_offset_shift(r, c) : csf::mxfp4_offset_bit(c);
    slot = static_cast<u8>(slot | (off << shift));
  }
};

// Rows of the swizzled layout of a grid with `rows` x `cols` true cells.
constexpr u64 swz_rows(u32 rows) { return round_up(rows, 128); }
constexpr u64 swz_cols(u32 cols) { return round_up(cols, 4); }

inline std::size_t native_per_expert(const CsfGeometry& g, ScaleLayout l) {
  return static_cast<std::size_t>(g.native_bytes(l) / g.shape.experts);
}

inline void finish_partition_index(CsfTensor& t) {
  const CsfGeometry& g = t.geometry;
  const u64 parts = u64{g.partitions_per_expert} * g.shape.experts;
  t.partition_index.resize(parts + 1);
  for (u64 i = 0; i <= parts; ++i) t.partition_index[i] = t.row_prefix[i * g.partition_rows];
}

[[noreturn]] inline void too_many_exceptions(const CsfGeometry& g, u64 n) {
  throw Unsupported(fmt::format(
      "CSF encode: grid {} has {} exceptions, more than the 32-bit record index allows (4294967295)",
      to_string(g.shape), n));
}

// ---------------------------------------------------------------------------
// Vector helpers of the fast paths.
// ---------------------------------------------------------------------------
inline u8x16 load16(const u8* p) {
  u8x16 v;
  std::memcpy(&v, p, 16);
  return v;
}
inline u8x16 splat16(u8 b) { return u8x16{} + b; }
inline bool any_set(u8x16 m) {
  u64 q[2];
  std::memcpy(q, &m, 16);
  return (q[0] | q[1]) != 0;
}
inline u32x4 load_u32x4(const u8* p) {
  u32x4 v;
  std::memcpy(&v, p, 16);
  return v;
}
// 4x4 transpose of 32-bit lanes: a 16-byte chunk of a 128x4 tile holds one
// 4-byte group of 4 rows, so 4 chunks of 4 neighbouring tiles are 16 bytes of
// each of those rows.
inline void transpose4(u32x4& a, u32x4& b, u32x4& c, u32x4& d) {
  const u32x4 t0 = __builtin_shufflevector(a, b, 0, 4, 1, 5);
  const u32x4 t1 = __builtin_shufflevector(a, b, 2, 6, 3, 7);
  const u32x4 t2 = __builtin_shufflevector(c, d, 0, 4, 1, 5);
  const u32x4 t3 = __builtin_shufflevector(c, d, 2, 6, 3, 7);
  a = __builtin_shufflevector(t0, t2, 0, 1, 4, 5);
  b = __builtin_shufflevector(t0, t2, 2, 3, 6, 7);
  c = __builtin_shufflevector(t1, t3, 0, 1, 4, 5);
  d = __builtin_shufflevector(t1, t3, 2, 3, 6, 7);
}

// Bit j set where lane j of a 0x00/0xFF mask is set.
inline unsigned lane_bits(u8x16 m) {
  u64 q[2];
  std::memcpy(q, &m, 16);
  constexpr u64 ones = 0x0101010101010101ull, gather = 0x0102040810204080ull;
  return unsigned(((q[0] & ones) * gather) >> 56) | (unsigned(((q[1] & ones) * gather) >> 56) << 8);
}
inline void store_u16(u8* p, u64 v) {
  const auto x = static_cast<std::uint16_t>(v);
  std::memcpy(p, &x, 2);
}

// Rows of work per task: one NVFP4 slab, one MXFP4 partition (4 slabs).
inline u32 task_rows(const CsfGeometry& g) { return g.shape.format == ScaleFormat::nvfp4 ? 128u : 64u; }

// csf_reference.cpp: one cell at a time, the oracle of the tests.
CsfTensor reference_encode(const CsfGeometry& g, std::span<const u8> src);
void reference_decode_expert(const CsfTensor& t, u32 e, ScaleLayout layout, std::span<u8> dst);

// csf_encode.cpp: the base of one row of n bytes by the encoder's rule (the
// lowest base whose window holds the most bytes) and how many bytes its
// window holds. The one row-base search shared by every encoder.
struct RowBase {
  u8 base;
  u32 in_window;
};
RowBase window_base(ScaleFormat format, const u8* row, u32 n);

// csf_encode.cpp / csf_decode.cpp: the fast multithreaded paths.
CsfTensor fast_encode(const CsfGeometry& g, std::span<const u8> src, unsigned threads);
void fast_decode(const CsfTensor& t, std::span<const u32> experts, ScaleLayout layout, std::span<u8> dst,
                 unsigned threads);

// csf_validate.cpp: FormatError when the part sizes or the stored geometry
// do not match the shape.
void check_part_sizes(const CsfTensor& t);
void check_geometry(const CsfGeometry& g);

}  // namespace csfmoe::csf_internal
