// CPU CSF codec: geometry, a reference implementation that follows the format
// notes literally, a fast multithreaded implementation that must stay
// bit-identical to it, validation of untrusted parts, stats.
// See docs/csf-format.md for the layout and every choice made here.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <bit>
#include <bitset>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "common/cpu_threads.hpp"
#include "csfmoe/codec.hpp"
#include "csfmoe/errors.hpp"

namespace csfmoe {
namespace {

using u64 = std::uint64_t;
using u32 = std::uint32_t;
using u8 = std::uint8_t;

// GCC/Clang vector extensions: lowered to SSE2/AVX on x86 and NEON on ARM,
// so one source serves every target.
using u8x16 = u8 __attribute__((vector_size(16)));
using u8x8 = u8 __attribute__((vector_size(8)));
using u16x8 = std::uint16_t __attribute__((vector_size(16)));
using u32x4 = u32 __attribute__((vector_size(16)));

bool known_format(ScaleFormat f) { return f == ScaleFormat::nvfp4 || f == ScaleFormat::mxfp4; }
bool known_layout(ScaleLayout l) { return l == ScaleLayout::row_major || l == ScaleLayout::swizzled_128x4; }

std::string describe(const GridShape& s) {
  return fmt::format("[{}, {}, {}] {} {}", s.experts, s.rows, s.cols, to_string(s.format),
                     to_string(s.layout));
}

// ---------------------------------------------------------------------------
// Fixed-part addressing (rows are rows inside one expert).
// ---------------------------------------------------------------------------
constexpr std::size_t nv_base_offset(u32 r) { return std::size_t{r % 32} * 4 + (r % 128) / 32; }
// Nibble index of (r, c) inside a slab's offset area (after the 128 bases).
constexpr std::size_t nv_nibble_index(u32 r, u32 c) {
  return std::size_t{c / 4} * 512 + std::size_t{r % 32} * 16 + ((r % 128) / 32) * 4 + (c % 4);
}
constexpr u32 mx_mask_bytes(u32 padded_cols) { return (padded_cols + 7) / 8; }

struct Fixed {
  const CsfGeometry& g;
  u8* data;

  u8* slab(u32 e, u32 r) const {
    return data + std::size_t{e} * g.fixed_bytes_per_expert + std::size_t{r / g.slab_rows} * g.slab_bytes;
  }
  u8 base(u32 e, u32 r) const {
    const u8* s = slab(e, r);
    return g.shape.format == ScaleFormat::nvfp4 ? s[nv_base_offset(r)] : s[r % 16];
  }
  void set_base(u32 e, u32 r, u8 b) const {
    u8* s = slab(e, r);
    (g.shape.format == ScaleFormat::nvfp4 ? s[nv_base_offset(r)] : s[r % 16]) = b;
  }
  u8 offset(u32 e, u32 r, u32 c) const {
    const u8* s = slab(e, r);
    if (g.shape.format == ScaleFormat::nvfp4) {
      const std::size_t n = nv_nibble_index(r, c);
      return static_cast<u8>((s[128 + n / 2] >> ((n & 1) * 4)) & 0xF);
    }
    return static_cast<u8>((s[16 + std::size_t{r % 16} * mx_mask_bytes(g.padded_cols) + c / 8] >> (c % 8)) &
                           1);
  }
  // The slot must still be 0 (the fixed part starts zeroed).
  void set_offset(u32 e, u32 r, u32 c, u8 off) const {
    u8* s = slab(e, r);
    if (g.shape.format == ScaleFormat::nvfp4) {
      const std::size_t n = nv_nibble_index(r, c);
      s[128 + n / 2] = static_cast<u8>(s[128 + n / 2] | (off << ((n & 1) * 4)));
    } else {
      u8& m = s[16 + std::size_t{r % 16} * mx_mask_bytes(g.padded_cols) + c / 8];
      m = static_cast<u8>(m | (off << (c % 8)));
    }
  }
};

// Rows of the swizzled layout of a grid with `rows` x `cols` true cells.
constexpr u64 swz_rows(u32 rows) { return round_up(rows, 128); }
constexpr u64 swz_cols(u32 cols) { return round_up(cols, 4); }

std::size_t native_per_expert(const CsfGeometry& g, ScaleLayout l) {
  return static_cast<std::size_t>(g.native_bytes(l) / g.shape.experts);
}

void finish_partition_index(CsfTensor& t) {
  const CsfGeometry& g = t.geometry;
  const u64 parts = u64{g.partitions_per_expert} * g.shape.experts;
  t.partition_index.resize(parts + 1);
  for (u64 i = 0; i <= parts; ++i) t.partition_index[i] = t.row_prefix[i * g.partition_rows];
}

// A zeroed byte vector. Large outputs ask for transparent huge pages before
// the first touch: page faults on fresh 4 KiB pages otherwise cost as much as
// encoding the bytes.
void assign_zeroed(std::vector<u8>& v, std::size_t n) {
  v.clear();
  v.reserve(n);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr std::uintptr_t huge = std::uintptr_t{2} << 20;
  if (n >= 4 * huge) {
    const auto begin = reinterpret_cast<std::uintptr_t>(v.data());
    const std::uintptr_t first = (begin + huge - 1) & ~(huge - 1), last = (begin + n) & ~(huge - 1);
    if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);  // a hint only
  }
#endif
  v.resize(n);
}

[[noreturn]] void too_many_exceptions(const CsfGeometry& g, u64 n) {
  throw Unsupported(fmt::format(
      "CSF encode: grid {} has {} exceptions, more than the 32-bit record index allows (4294967295)",
      describe(g.shape), n));
}

// ---------------------------------------------------------------------------
// Reference implementation: one cell at a time, straight from the notes.
// ---------------------------------------------------------------------------
u8 reference_base(const std::array<u32, 256>& hist, unsigned w) {
  u32 best_count = 0;
  unsigned best = 0;
  bool any = false;
  for (unsigned b = 0; b + w - 1 <= 255; ++b) {
    u32 count = 0;
    for (unsigned v = b; v < b + w; ++v) count += hist[v];
    if (!any || count > best_count) {  // strictly greater: the lowest base wins ties
      best_count = count;
      best = b;
      any = true;
    }
  }
  return static_cast<u8>(best);
}

std::size_t source_index(const CsfGeometry& g, u32 e, u32 r, u32 c) {
  const std::size_t per = native_per_expert(g, g.shape.layout);
  if (g.shape.layout == ScaleLayout::row_major) return e * per + std::size_t{r} * g.shape.cols + c;
  return e * per + swizzled_index(r, c, g.padded_cols);
}

CsfTensor reference_encode(const CsfGeometry& g, std::span<const u8> src) {
  CsfTensor t;
  t.geometry = g;
  t.fixed.assign(g.fixed_bytes(), 0);
  t.row_prefix.assign(g.total_rows() + 1, 0);
  const Fixed fx{g, t.fixed.data()};
  const unsigned w = csf_window(g.shape.format);
  const u32 R = g.shape.rows, C = g.shape.cols;
  u64 count = 0;
  for (u32 e = 0; e < g.shape.experts; ++e) {
    for (u32 r = 0; r < g.padded_rows; ++r) {
      if (count > std::numeric_limits<u32>::max()) too_many_exceptions(g, count);
      t.row_prefix[std::size_t{e} * g.padded_rows + r] = static_cast<u32>(count);
      if (r >= R) continue;  // padding row: base 0, offsets 0, no records
      std::array<u32, 256> hist{};
      for (u32 c = 0; c < C; ++c) ++hist[src[source_index(g, e, r, c)]];
      const u8 base = reference_base(hist, w);
      fx.set_base(e, r, base);
      for (u32 c = 0; c < C; ++c) {
        const u8 v = src[source_index(g, e, r, c)];
        if (v >= base && v < base + w) {
          fx.set_offset(e, r, c, static_cast<u8>(v - base));
        } else {
          t.exceptions.push_back(make_exception(r * g.padded_cols + c, v));
          ++count;
        }
      }
    }
  }
  if (count > std::numeric_limits<u32>::max()) too_many_exceptions(g, count);
  t.row_prefix.back() = static_cast<u32>(count);
  finish_partition_index(t);
  return t;
}

// Logical padded grid (padded_rows x padded_cols) of one expert.
std::vector<u8> reference_expert_grid(const CsfTensor& t, u32 e) {
  const CsfGeometry& g = t.geometry;
  const Fixed fx{g, const_cast<u8*>(t.fixed.data())};
  std::vector<u8> grid(std::size_t{g.padded_rows} * g.padded_cols);
  for (u32 r = 0; r < g.padded_rows; ++r)
    for (u32 c = 0; c < g.padded_cols; ++c)
      grid[std::size_t{r} * g.padded_cols + c] = static_cast<u8>(fx.base(e, r) + fx.offset(e, r, c));
  const u64 first = t.row_prefix[std::size_t{e} * g.padded_rows];
  const u64 last = t.row_prefix[std::size_t{e + 1} * g.padded_rows];
  for (u64 i = first; i < last; ++i)
    grid[exception_position(t.exceptions[i])] = exception_value(t.exceptions[i]);
  return grid;
}

void reference_decode_expert(const CsfTensor& t, u32 e, ScaleLayout layout, std::span<u8> dst) {
  const CsfGeometry& g = t.geometry;
  const Fixed fx{g, const_cast<u8*>(t.fixed.data())};
  const std::vector<u8> grid = reference_expert_grid(t, e);
  const std::size_t per = native_per_expert(g, layout);
  u8* out = dst.data() + std::size_t{e} * per;
  const u32 R = g.shape.rows, C = g.shape.cols;
  if (layout == ScaleLayout::row_major) {
    for (u32 r = 0; r < R; ++r)
      for (u32 c = 0; c < C; ++c) out[std::size_t{r} * C + c] = grid[std::size_t{r} * g.padded_cols + c];
    return;
  }
  const u64 rows = swz_rows(R), cols = swz_cols(C);
  for (u32 r = 0; r < rows; ++r)
    for (u32 c = 0; c < cols; ++c) {
      u8 v = 0;  // rows beyond the CSF grid (MXFP4 rounded to 128) decode to 0x00
      if (r < g.padded_rows) v = c < g.padded_cols ? grid[std::size_t{r} * g.padded_cols + c] : fx.base(e, r);
      out[swizzled_index(r, c, cols)] = v;
    }
}

// ---------------------------------------------------------------------------
// Fast implementation.
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
u32 task_rows(const CsfGeometry& g) { return g.shape.format == ScaleFormat::nvfp4 ? 128u : 64u; }

struct RowResult {
  u8 base;
  u32 in_window;
};

// Base of one row with the same rule as reference_base. Bins outside
// [min - W + 1, max + W - 1] are zero, so the sliding window only visits
// candidate bases in that range. `hist` (4 x 256 counters) is left zeroed.
// Smallest and largest byte of a row, 16 bytes at a time.
inline void row_min_max(const u8* row, u32 n, u8& mn_out, u8& mx_out) {
  u8 mn = 255, mx = 0;
  std::size_t i = 0;
  if (n >= 16) {
    u8x16 vmn = load16(row), vmx = vmn;
    for (i = 16; i + 16 <= n; i += 16) {
      const u8x16 v = load16(row + i);
      vmn = v < vmn ? v : vmn;
      vmx = v > vmx ? v : vmx;
    }
    // Fold the lanes with 32- and 16-bit shuffles (single SSE2 instructions).
    auto fold = [](u8x16& lo, u8x16& hi, auto shuffle) {
      const u8x16 a = shuffle(lo), b = shuffle(hi);
      lo = a < lo ? a : lo;
      hi = b > hi ? b : hi;
    };
    fold(vmn, vmx, [](u8x16 v) {
      const u32x4 x = reinterpret_cast<u32x4>(v);
      return reinterpret_cast<u8x16>(__builtin_shufflevector(x, x, 2, 3, 0, 1));
    });
    fold(vmn, vmx, [](u8x16 v) {
      const u32x4 x = reinterpret_cast<u32x4>(v);
      return reinterpret_cast<u8x16>(__builtin_shufflevector(x, x, 1, 0, 3, 2));
    });
    fold(vmn, vmx, [](u8x16 v) {
      const u16x8 x = reinterpret_cast<u16x8>(v);
      return reinterpret_cast<u8x16>(__builtin_shufflevector(x, x, 1, 0, 3, 2, 4, 5, 6, 7));
    });
    mn = std::min(vmn[0], vmn[1]);
    mx = std::max(vmx[0], vmx[1]);
  }
  for (; i < n; ++i) {
    mn = std::min(mn, row[i]);
    mx = std::max(mx, row[i]);
  }
  mn_out = mn;
  mx_out = mx;
}

// Sum of the 16 byte lanes (each at most 255).
inline u32 lane_sum(u8x16 v) {
  u64 q[2];
  std::memcpy(q, &v, 16);
  constexpr u64 even = 0x00FF00FF00FF00FFull, ones16 = 0x0001000100010001ull;
  const u64 s = (q[0] & even) + ((q[0] >> 8) & even) + (q[1] & even) + ((q[1] >> 8) & even);  // 4 x u16
  return static_cast<u32>((s * ones16) >> 48);
}

// MXFP4 rows span only a few distinct bytes: with at most 8 distinct values
// in [mn, mx] the bin counts come from vector compares (no histogram), then
// the same lowest-best rule as reference_base over the few candidates.
// Returns false (nothing done) when the row does not fit that case.
// Counts of bins mn .. mn + S - 1 of a row whose bytes all lie in [mn, mn + S].
template <unsigned S>
inline void narrow_counts(const u8* row, u32 n, u8 mn, u32* cnt) {
  const u8x16 mv = splat16(mn);
  u8x16 acc[S] = {};
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const u8x16 d = load16(row + i) - mv;
    for (unsigned k = 0; k < S; ++k) acc[k] -= reinterpret_cast<u8x16>(d == static_cast<u8>(k));
  }
  for (unsigned k = 0; k < S; ++k) cnt[k] = lane_sum(acc[k]);
  for (; i < n; ++i) {
    const unsigned d = unsigned(row[i] - mn);
    if (d < S) ++cnt[d];
  }
}

// MXFP4 rows span only a few distinct bytes: with at most 8 distinct values
// in [mn, mx] the bin counts come from vector compares (no histogram), then
// the same lowest-best rule as reference_base over the few candidates.
// Returns false (nothing done) when the row does not fit that case.
inline bool mx_base_narrow(const u8* row, u32 n, u8 mn, u8 mx, RowResult& res) {
  const unsigned span = unsigned(mx - mn);     // 2..7 here; bins 0..span-1 counted, the last by difference
  if (span > 7 || n > 16 * 255) return false;  // byte lanes count at most 255 vectors
  u32 cnt[8] = {};
  switch (span) {
    case 2:
      narrow_counts<2>(row, n, mn, cnt);
      break;
    case 3:
      narrow_counts<3>(row, n, mn, cnt);
      break;
    case 4:
      narrow_counts<4>(row, n, mn, cnt);
      break;
    case 5:
      narrow_counts<5>(row, n, mn, cnt);
      break;
    case 6:
      narrow_counts<6>(row, n, mn, cnt);
      break;
    default:
      narrow_counts<7>(row, n, mn, cnt);
      break;
  }
  u32 seen = 0;
  for (unsigned k = 0; k < span; ++k) seen += cnt[k];
  cnt[span] = n - seen;
  // Candidates b in [mn - 1, min(mx, 254)]: count(b) = h[b] + h[b + 1], with
  // ext[t] = h[mn - 1 + t] (zero outside [mn, mx]).
  u32 ext[10] = {};
  for (unsigned k = 0; k <= span; ++k) ext[k + 1] = cnt[k];
  const unsigned t0 = mn >= 1 ? 0u : 1u;
  const unsigned t1 = std::min(254u, unsigned(mx)) + 1 - mn;
  u32 best_count = ext[t0] + ext[t0 + 1];
  unsigned best = t0;
  for (unsigned t = t0 + 1; t <= t1; ++t) {
    const u32 c = ext[t] + ext[t + 1];
    best = c > best_count ? t : best;  // strictly: the lowest base wins ties
    best_count = c > best_count ? c : best_count;
  }
  best = best + mn - 1;
  res = {static_cast<u8>(best), best_count};
  return true;
}

// Lowest best base from a full histogram h0 of a row (zero outside
// [mn, mx]), as reference_base; clears h0 again.
template <unsigned W>
RowResult search_window(u32* h0, u8 mn, u8 mx) {
  const std::size_t m0 = mn & ~3u, m1 = std::size_t{mx} + 1;
  const unsigned lo = mn >= W - 1 ? mn - (W - 1) : 0;
  const unsigned hi = std::min(256u - W, unsigned(mx));
  const u32* hp = h0 + lo;
  u32 count = 0;
  for (unsigned v = 0; v < W; ++v) count += hp[v];
  u32 best_count = count;
  std::size_t best = 0;
  for (std::size_t k = 1, last = hi - lo; k <= last; ++k) {
    count += hp[k + W - 1] - hp[k - 1];
    const bool better = count > best_count;  // strictly: the lowest base wins ties
    best_count = better ? count : best_count;
    best = better ? k : best;
  }
  for (std::size_t v = m0; v < m1; v += 4) {
    const u32x4 zero{};
    std::memcpy(h0 + v, &zero, 16);
  }
  best += lo;
  return {static_cast<u8>(best), best_count};
}

template <unsigned W>
RowResult fast_base(const u8* row, u32 n, u32* hist) {
  u8 mn, mx;
  row_min_max(row, n, mn, mx);
  if (unsigned(mx - mn) < W)
    return {static_cast<u8>(mx >= W - 1 ? mx - (W - 1) : 0), n};  // all in one window
  if constexpr (W == 2) {
    RowResult res;
    if (mx_base_narrow(row, n, mn, mx, res)) return res;
  }
  // Four interleaved histograms: runs of equal bytes (the common case) would
  // otherwise serialize on store-to-load forwarding of one counter.
  u32* h0 = hist;
  u32* h1 = hist + 256;
  u32* h2 = hist + 512;
  u32* h3 = hist + 768;
  // Pointer walk: a 32-bit index would cost an address computation per byte.
  const u8* p = row;
  for (const u8* end = row + (n & ~15u); p != end; p += 16) {
    ++h0[p[0]];
    ++h1[p[1]];
    ++h2[p[2]];
    ++h3[p[3]];
    ++h0[p[4]];
    ++h1[p[5]];
    ++h2[p[6]];
    ++h3[p[7]];
    ++h0[p[8]];
    ++h1[p[9]];
    ++h2[p[10]];
    ++h3[p[11]];
    ++h0[p[12]];
    ++h1[p[13]];
    ++h2[p[14]];
    ++h3[p[15]];
  }
  for (const u8* end = row + n; p != end; ++p) ++h0[*p];
  // Merge (and clear) 4 bins at a time; bins outside [mn, mx] are zero everywhere.
  const std::size_t m0 = mn & ~3u, m1 = std::size_t{mx} + 1;
  for (std::size_t v = m0; v < m1; v += 4) {
    u32x4 a, b, c, d;
    std::memcpy(&a, h0 + v, 16);
    std::memcpy(&b, h1 + v, 16);
    std::memcpy(&c, h2 + v, 16);
    std::memcpy(&d, h3 + v, 16);
    a += b + c + d;
    const u32x4 zero{};
    std::memcpy(h0 + v, &a, 16);
    std::memcpy(h1 + v, &zero, 16);
    std::memcpy(h2 + v, &zero, 16);
    std::memcpy(h3 + v, &zero, 16);
  }
  return search_window<W>(h0, mn, mx);
}

// Offsets of one NVFP4 row into its slab; exceptions written at `out` in
// column order (the caller sized the room from the row's window count).
u32* nv_fill_row(const u8* row, u32 C, u8 base, u8* slab, u32 r, u32 padded_cols, u32* out) {
  u8* nib = slab + 128 + std::size_t{r % 32} * 8 + ((r % 128) / 32) * 2;  // group g at nib + g * 256
  const u8x16 bv = splat16(base);
  const u32 pos0 = r * padded_cols;
  std::size_t c = 0;
  for (; c + 16 <= C; c += 16) {
    u8x16 d = load16(row + c) - bv;
    const auto bad = reinterpret_cast<u8x16>(d > 15);
    if (any_set(bad)) [[unlikely]] {
      for (unsigned m = lane_bits(bad); m != 0; m &= m - 1) {
        const unsigned j = unsigned(__builtin_ctz(m));
        *out++ = make_exception(static_cast<u32>(pos0 + c + j), row[c + j]);
      }
      d &= ~bad;
    }
    u16x8 w;
    std::memcpy(&w, &d, 16);
    const u16x8 packed = (w & 0xF) | ((w >> 4) & 0xF0);
    const u8x8 bytes = __builtin_convertvector(packed, u8x8);
    u64 m;
    std::memcpy(&m, &bytes, 8);
    u8* q = nib + std::size_t{c / 4} * 256;
    store_u16(q, m);
    store_u16(q + 256, m >> 16);
    store_u16(q + 512, m >> 32);
    store_u16(q + 768, m >> 48);
  }
  for (; c < C; ++c) {
    const u8 v = row[c];
    const unsigned d = u8(v - base);
    if (d < 16) {
      u8& q = nib[std::size_t{c / 4} * 256 + (c % 4) / 2];
      q = static_cast<u8>(q | (d << ((c & 1) * 4)));
    } else {
      *out++ = make_exception(static_cast<u32>(pos0 + c), v);
    }
  }
  return out;
}

[[noreturn]] void internal_count_mismatch(u32 e, u32 r0) {
  throw std::logic_error(
      fmt::format("CSF encode: internal error, exception count mismatch in expert {} rows {}+", e, r0));
}

// The low byte of every 16-bit lane of a, then of b.
inline u8x16 pack_low_bytes(u16x8 a, u16x8 b) {
#if defined(__SSE2__)
  const __m128i m = _mm_set1_epi16(0xFF);
  return reinterpret_cast<u8x16>(_mm_packus_epi16(_mm_and_si128(reinterpret_cast<__m128i>(a), m),
                                                  _mm_and_si128(reinterpret_cast<__m128i>(b), m)));
#else
  static_assert(std::endian::native == std::endian::little);
  return __builtin_shufflevector(reinterpret_cast<u8x16>(a), reinterpret_cast<u8x16>(b), 0, 2, 4, 6, 8, 10,
                                 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
#endif
}

// Offsets of the 4 rows k, k + 32, k + 64, k + 96 of a full NVFP4 slab (row
// q of the quad at rows[q]): their nibbles of one 4-column group are 8
// adjacent bytes, so 16 columns of the 4 rows are packed, transposed as
// 16-bit pairs and written with four 8-byte stores. Records go to
// recs[cursor[q]++] (cursor[q] < row_end[q] is checked).
void nv_fill_quad(const u8* const rows[4], u32 C, const u8 bases[4], u8* slab, u32 k, u32 r0, u32 padded_cols,
                  u32* recs, u32* cursor, const u32* row_end) {
  u8* nib = slab + 128 + std::size_t{k} * 8;  // group g at nib + g * 256, row q at + 2q
  u8x16 bv[4];
  for (u32 q = 0; q < 4; ++q) bv[q] = splat16(bases[q]);
  std::size_t c = 0;
  for (; c + 16 <= C; c += 16) {
    u8x16 d[4];
    for (u32 q = 0; q < 4; ++q) d[q] = load16(rows[q] + c) - bv[q];
    const u8x16 any = d[0] | d[1] | d[2] | d[3];
    u64 h[2];
    std::memcpy(h, &any, 16);
    if (((h[0] | h[1]) & 0xF0F0F0F0F0F0F0F0ull) != 0) [[unlikely]] {
      for (u32 q = 0; q < 4; ++q) {
        const auto bad = reinterpret_cast<u8x16>(d[q] > 15);
        const u32 rr = q * 32 + k;
        for (unsigned m = lane_bits(bad); m != 0; m &= m - 1) {
          const unsigned j = unsigned(__builtin_ctz(m));
          if (cursor[rr] >= row_end[rr]) internal_count_mismatch(0, r0);
          recs[cursor[rr]++] =
              make_exception(static_cast<u32>((r0 + rr) * padded_cols + c + j), rows[q][c + j]);
        }
        d[q] &= ~bad;
      }
    }
    u16x8 w[4];
    for (u32 q = 0; q < 4; ++q) {
      const u16x8 x = reinterpret_cast<u16x8>(d[q]);
      w[q] = x | (x >> 4);  // low byte: even column | odd column << 4
    }
    // Row a's 8 packed bytes, then row b's.
    const u8x16 x8 = pack_low_bytes(w[0], w[1]), y8 = pack_low_bytes(w[2], w[3]);
    const u16x8 x = reinterpret_cast<u16x8>(x8), y = reinterpret_cast<u16x8>(y8);
    // x = (a0 a1 a2 a3 b0 b1 b2 b3), y = (c0 .. d3) in 16-bit pairs (one per group).
    const u16x8 lo = __builtin_shufflevector(x, y, 0, 8, 1, 9, 2, 10, 3, 11);
    const u16x8 hi = __builtin_shufflevector(x, y, 4, 12, 5, 13, 6, 14, 7, 15);
    const u16x8 g01 = __builtin_shufflevector(lo, hi, 0, 8, 1, 9, 2, 10, 3, 11);
    const u16x8 g23 = __builtin_shufflevector(lo, hi, 4, 12, 5, 13, 6, 14, 7, 15);
    u8* dst = nib + (c / 4) * 256;
    std::memcpy(dst, &g01, 8);
    std::memcpy(dst + 256, reinterpret_cast<const u8*>(&g01) + 8, 8);
    std::memcpy(dst + 512, &g23, 8);
    std::memcpy(dst + 768, reinterpret_cast<const u8*>(&g23) + 8, 8);
  }
  for (u32 q = 0; q < 4; ++q) {
    const u32 rr = q * 32 + k;
    for (std::size_t cc = c; cc < C; ++cc) {
      const u8 v = rows[q][cc];
      const unsigned d = u8(v - bases[q]);
      if (d < 16) {
        u8& b = nib[(cc / 4) * 256 + q * 2 + (cc % 4) / 2];
        b = static_cast<u8>(b | (d << ((cc & 1) * 4)));
      } else {
        if (cursor[rr] >= row_end[rr]) internal_count_mismatch(0, r0);
        recs[cursor[rr]++] = make_exception(static_cast<u32>((r0 + rr) * padded_cols + cc), v);
      }
    }
  }
}

// Offset bits of one MXFP4 row into its slab.
u32* mx_fill_row(const u8* row, u32 C, u8 base, u8* slab, u32 r, u32 padded_cols, u32* out) {
  u8* mask = slab + 16 + std::size_t{r % 16} * mx_mask_bytes(padded_cols);
  const u8x16 bv = splat16(base);
  const u32 pos0 = r * padded_cols;
  std::size_t c = 0;
  for (; c + 16 <= C; c += 16) {
    u8x16 d = load16(row + c) - bv;
    const auto bad = reinterpret_cast<u8x16>(d > 1);
    if (any_set(bad)) [[unlikely]] {
      for (unsigned m = lane_bits(bad); m != 0; m &= m - 1) {
        const unsigned j = unsigned(__builtin_ctz(m));
        *out++ = make_exception(static_cast<u32>(pos0 + c + j), row[c + j]);
      }
      d &= ~bad;
    }
    u64 q[2];
    std::memcpy(q, &d, 16);
    // Bytes of 0/1 -> 8 bits: every partial product lands on its own bit.
    mask[c / 8] = static_cast<u8>((q[0] * 0x0102040810204080ull) >> 56);
    mask[c / 8 + 1] = static_cast<u8>((q[1] * 0x0102040810204080ull) >> 56);
  }
  for (; c < C; ++c) {
    const u8 v = row[c];
    const unsigned d = u8(v - base);
    if (d < 2) {
      mask[c / 8] = static_cast<u8>(mask[c / 8] | (d << (c % 8)));
    } else {
      *out++ = make_exception(static_cast<u32>(pos0 + c), v);
    }
  }
  return out;
}

// The 128-row band at r0 (a multiple of 128) of one swizzled expert into
// row-major scratch (rows `stride` apart). A 16-byte chunk of a tile holds 4
// bytes of each of 4 rows 32 apart.
void unswizzle_band(const u8* expert, u32 r0, u32 cols, std::size_t stride, u8* out) {
  const std::size_t groups = cols / 4;
  const u8* tiles = expert + std::size_t{r0 / 128} * groups * 512;
  std::size_t gi = 0;
  for (; gi + 4 <= groups; gi += 4) {
    const u8* tile = tiles + gi * 512;
    u8* o = out + gi * 4;
    for (std::size_t k = 0; k < 32; ++k) {
      u32x4 a = load_u32x4(tile + k * 16), b = load_u32x4(tile + 512 + k * 16),
            c = load_u32x4(tile + 1024 + k * 16), d = load_u32x4(tile + 1536 + k * 16);
      transpose4(a, b, c, d);  // a: row k, b: row k + 32, ...; columns 4gi .. 4gi + 15
      std::memcpy(o + k * stride, &a, 16);
      std::memcpy(o + (k + 32) * stride, &b, 16);
      std::memcpy(o + (k + 64) * stride, &c, 16);
      std::memcpy(o + (k + 96) * stride, &d, 16);
    }
  }
  for (; gi < groups; ++gi) {
    const u8* tile = tiles + gi * 512;
    for (u32 k = 0; k < 32; ++k)
      for (u32 q = 0; q < 4; ++q)
        std::memcpy(out + std::size_t{q * 32 + k} * stride + gi * 4, tile + k * 16 + q * 4, 4);
  }
}

// NVFP4 offsets of one slab straight from a swizzled source: the nibble order
// of the fixed part is the byte order of the 128x4 tiles. cursor[row] is where
// the row's next exception goes.
void nv_fill_tiles(const u8* tiles, u32 groups, const u8* slab_bases, u8* slab, u32 r0, u32 padded_cols,
                   u32* recs, u32* cursor, const u32* row_end) {
  u8x16 bv[32];
  for (u32 k = 0; k < 32; ++k) {
    const u32x4 b =
        u32x4{slab_bases[k * 4], slab_bases[k * 4 + 1], slab_bases[k * 4 + 2], slab_bases[k * 4 + 3]} *
        0x01010101u;
    std::memcpy(&bv[k], &b, 16);
  }
  u8* nib = slab + 128;
  for (u32 gi = 0; gi < groups; ++gi) {
    const u8* tile = tiles + std::size_t{gi} * 512;
    u8* out = nib + std::size_t{gi} * 256;
    // Chunks k and k + 1 give 16 adjacent bytes of offsets.
    for (u32 k = 0; k < 32; k += 2) {
      u8x16 d[2];
      for (u32 h = 0; h < 2; ++h) d[h] = load16(tile + (k + h) * 16) - bv[k + h];
      const u8x16 any = d[0] | d[1];
      u64 q[2];
      std::memcpy(q, &any, 16);
      if (((q[0] | q[1]) & 0xF0F0F0F0F0F0F0F0ull) != 0) [[unlikely]] {
        for (u32 h = 0; h < 2; ++h) {
          const auto bad = reinterpret_cast<u8x16>(d[h] > 15);
          const u8* v = tile + (k + h) * 16;
          for (unsigned m = lane_bits(bad); m != 0; m &= m - 1) {
            const unsigned j = unsigned(__builtin_ctz(m));
            const u32 rr = k + h + 32 * (j / 4);
            if (cursor[rr] >= row_end[rr]) internal_count_mismatch(0, r0);
            recs[cursor[rr]++] = make_exception((r0 + rr) * padded_cols + gi * 4 + j % 4, v[j]);
          }
          d[h] &= ~bad;
        }
      }
      const u16x8 x0 = reinterpret_cast<u16x8>(d[0]), x1 = reinterpret_cast<u16x8>(d[1]);
      const u8x16 packed = pack_low_bytes(x0 | (x0 >> 4), x1 | (x1 >> 4));
      std::memcpy(out + k * 8, &packed, 16);
    }
  }
}

CsfTensor fast_encode(const CsfGeometry& g, std::span<const u8> src, unsigned threads) {
  CsfTensor t;
  t.geometry = g;
  assign_zeroed(t.fixed, g.fixed_bytes());
  t.row_prefix.assign(g.total_rows() + 1, 0);
  const bool nv = g.shape.format == ScaleFormat::nvfp4;
  const bool swz = g.shape.layout == ScaleLayout::swizzled_128x4;
  const u32 R = g.shape.rows, C = g.shape.cols;
  // A swizzled source is read in whole 128-row tile bands (its rows are a
  // multiple of 128), so every tile byte is loaded once.
  const u32 unit = swz ? 128u : task_rows(g);
  const u32 units = g.padded_rows / unit;
  const std::size_t per = native_per_expert(g, g.shape.layout);
  const std::size_t tasks = std::size_t{units} * g.shape.experts;
  std::vector<std::vector<u32>> task_recs(tasks);
  u32* counts = t.row_prefix.data() + 1;  // per-row counts first, scanned below

  cpu_threads::for_each_index(tasks, threads, [&](std::size_t task) {
    thread_local std::vector<u32> hist;
    thread_local std::vector<u8> scratch;
    // Scratch rows padded off a power of two: with strides of 2^k the tile
    // loads and scratch stores alias in the low 12 address bits and stall.
    const std::size_t stride = round_up(C, 16) + 16;
    if (hist.size() != 1024) hist.assign(1024, 0);
    const u32 e = static_cast<u32>(task / units);
    const u32 r0 = static_cast<u32>(task % units) * unit;
    if (r0 >= R) return;  // only padding rows: base 0, offsets 0, no records
    const u32 n = std::min(unit, R - r0);
    const u8* expert = src.data() + e * per;
    if (swz) {
      scratch.resize(std::size_t{unit} * stride);
      unswizzle_band(expert, r0, C, stride, scratch.data());  // unit == 128 here
    }
    auto row_of = [&](u32 i) {
      return swz ? scratch.data() + std::size_t{i} * stride : expert + std::size_t{r0 + i} * C;
    };
    u8* fixed_e = t.fixed.data() + std::size_t{e} * g.fixed_bytes_per_expert;
    // Pass 1: bases and exception counts of the task's rows.
    u8 bases[128];
    u32 cursor[128], row_end[128];
    u32 total = 0;
    u32* row_counts = counts + std::size_t{e} * g.padded_rows + r0;
    for (u32 i = 0; i < n; ++i) {
      const u32 r = r0 + i;
      u8* slab = fixed_e + std::size_t{nv ? r / 128 : r / 16} * g.slab_bytes;
      const RowResult res =
          nv ? fast_base<16>(row_of(i), C, hist.data()) : fast_base<2>(row_of(i), C, hist.data());
      bases[i] = res.base;
      (nv ? slab[nv_base_offset(r)] : slab[r % 16]) = res.base;
      cursor[i] = total;
      row_counts[i] = C - res.in_window;
      total += C - res.in_window;
      row_end[i] = total;
    }
    // Pass 2: offsets and records.
    std::vector<u32>& recs = task_recs[task];
    recs.resize(total);
    if (nv && swz) {
      const u8* tiles = expert + std::size_t{r0 / 128} * (C / 4) * 512;
      nv_fill_tiles(tiles, C / 4, fixed_e + std::size_t{r0 / 128} * g.slab_bytes,
                    fixed_e + std::size_t{r0 / 128} * g.slab_bytes, r0, g.padded_cols, recs.data(), cursor,
                    row_end);
      for (u32 i = 0; i < n; ++i)
        if (cursor[i] != row_end[i]) internal_count_mismatch(e, r0);
    } else if (nv && n == 128) {
      u8* slab = fixed_e + std::size_t{r0 / 128} * g.slab_bytes;
      for (u32 k = 0; k < 32; ++k) {
        const u8* rows[4] = {row_of(k), row_of(k + 32), row_of(k + 64), row_of(k + 96)};
        const u8 quad_bases[4] = {bases[k], bases[k + 32], bases[k + 64], bases[k + 96]};
        nv_fill_quad(rows, C, quad_bases, slab, k, r0, g.padded_cols, recs.data(), cursor, row_end);
      }
      for (u32 i = 0; i < n; ++i)
        if (cursor[i] != row_end[i]) internal_count_mismatch(e, r0);
    } else {
      u32* out = recs.data();
      for (u32 i = 0; i < n; ++i) {
        const u32 r = r0 + i;
        u8* slab = fixed_e + std::size_t{nv ? r / 128 : r / 16} * g.slab_bytes;
        u32* end = nv ? nv_fill_row(row_of(i), C, bases[i], slab, r, g.padded_cols, out)
                      : mx_fill_row(row_of(i), C, bases[i], slab, r, g.padded_cols, out);
        if (end != out + row_counts[i]) internal_count_mismatch(e, r0);
        out = end;
      }
    }
  });

  u64 total = 0;
  for (std::size_t i = 1; i < t.row_prefix.size(); ++i) {
    total += t.row_prefix[i];
    if (total > std::numeric_limits<u32>::max()) too_many_exceptions(g, total);
    t.row_prefix[i] = static_cast<u32>(total);
  }
  t.exceptions.resize(total);
  cpu_threads::for_each_index(tasks, threads, [&](std::size_t task) {
    const u32 e = static_cast<u32>(task / units);
    const u32 r0 = static_cast<u32>(task % units) * unit;
    const auto& recs = task_recs[task];
    if (!recs.empty())
      std::memcpy(t.exceptions.data() + t.row_prefix[std::size_t{e} * g.padded_rows + r0], recs.data(),
                  recs.size() * 4);
  });
  finish_partition_index(t);
  return t;
}

// Bytes k of the result are (nibble k of 8 packed bytes) + base lanes.
inline u8x16 expand_nibbles(const u8* p, u8x16 bv) {
  u8x8 b8;
  std::memcpy(&b8, p, 8);
  const u16x8 w = __builtin_convertvector(b8, u16x8);
  const u16x8 e = (w & 0xF) | ((w << 4) & 0xF00);
  u8x16 r;
  std::memcpy(&r, &e, 16);
  return r + bv;
}

// Base lanes of chunk k of a 128x4 tile: rows k, k+32, k+64, k+96, 4 lanes each.
inline u8x16 nv_chunk_bases(const u8* slab, u32 k) {
  const u32x4 b = u32x4{slab[k * 4], slab[k * 4 + 1], slab[k * 4 + 2], slab[k * 4 + 3]} * 0x01010101u;
  u8x16 r;
  std::memcpy(&r, &b, 16);
  return r;
}

struct SpreadTable {
  std::array<u64, 256> v{};
  constexpr SpreadTable() {
    for (unsigned x = 0; x < 256; ++x)
      for (unsigned j = 0; j < 8; ++j)
        if (x >> j & 1) v[x] |= u64{1} << (8 * j);
  }
};
constexpr SpreadTable kSpread{};

// Records of row r (inside expert e) patched into a row-major or swizzled expert.
template <bool Swizzled>
inline void patch_row(const CsfTensor& t, u32 e, u32 r, u8* out, std::size_t out_cols) {
  const CsfGeometry& g = t.geometry;
  const std::size_t gr = std::size_t{e} * g.padded_rows + r;
  const u32 first = t.row_prefix[gr], last = t.row_prefix[gr + 1];
  const u32 pos0 = r * g.padded_cols;
  for (u32 i = first; i < last; ++i) {
    const u32 rec = t.exceptions[i];
    const u32 c = exception_position(rec) - pos0;
    if constexpr (Swizzled)
      out[swizzled_index(r, c, out_cols)] = exception_value(rec);
    else
      out[std::size_t{r} * out_cols + c] = exception_value(rec);
  }
}

void nv_decode_slab(const CsfTensor& t, u32 e, u32 s, ScaleLayout layout, u8* out) {
  const CsfGeometry& g = t.geometry;
  const u8* slab = t.fixed.data() + std::size_t{e} * g.fixed_bytes_per_expert + std::size_t{s} * g.slab_bytes;
  const u8* nib = slab + 128;
  const u32 groups = g.padded_cols / 4;
  const u32 R = g.shape.rows, C = g.shape.cols;
  const u32 r0 = s * 128;
  if (layout == ScaleLayout::swizzled_128x4) {
    u8x16 bv[32];
    for (u32 k = 0; k < 32; ++k) bv[k] = nv_chunk_bases(slab, k);
    u8* tiles = out + std::size_t{s} * groups * 512;
    for (u32 gi = 0; gi < groups; ++gi) {
      for (u32 k = 0; k < 32; ++k) {
        const u8x16 v = expand_nibbles(nib + std::size_t{gi} * 256 + k * 8, bv[k]);
        std::memcpy(tiles + std::size_t{gi} * 512 + k * 16, &v, 16);
      }
    }
    for (u32 r = r0; r < r0 + 128; ++r) patch_row<true>(t, e, r, out, g.padded_cols);
    return;
  }
  const u32 full = C / 4, tail = C % 4;
  for (u32 k = 0; k < 32; ++k) {
    const u8x16 bv = nv_chunk_bases(slab, k);
    u8* rows[4];
    u32 live = 0;
    for (u32 q = 0; q < 4; ++q) {
      const u32 r = r0 + q * 32 + k;
      rows[q] = r < R ? out + std::size_t{r} * C : nullptr;
      live += r < R;
    }
    if (live == 0) continue;
    if (live == 4) {
      for (u32 gi = 0; gi < full; ++gi) {
        const u8x16 v = expand_nibbles(nib + std::size_t{gi} * 256 + k * 8, bv);
        const u8* b = reinterpret_cast<const u8*>(&v);
        std::memcpy(rows[0] + gi * 4, b, 4);
        std::memcpy(rows[1] + gi * 4, b + 4, 4);
        std::memcpy(rows[2] + gi * 4, b + 8, 4);
        std::memcpy(rows[3] + gi * 4, b + 12, 4);
      }
    } else {
      for (u32 gi = 0; gi < full; ++gi) {
        const u8x16 v = expand_nibbles(nib + std::size_t{gi} * 256 + k * 8, bv);
        const u8* b = reinterpret_cast<const u8*>(&v);
        for (u32 q = 0; q < 4; ++q)
          if (rows[q]) std::memcpy(rows[q] + gi * 4, b + q * 4, 4);
      }
    }
    if (tail) {
      const u8x16 v = expand_nibbles(nib + std::size_t{full} * 256 + k * 8, bv);
      const u8* b = reinterpret_cast<const u8*>(&v);
      for (u32 q = 0; q < 4; ++q)
        if (rows[q]) std::memcpy(rows[q] + full * 4, b + q * 4, tail);
    }
  }
  const u32 r_end = std::min(r0 + 128, R);
  for (u32 r = r0; r < r_end; ++r) patch_row<false>(t, e, r, out, C);
}

// One MXFP4 row expanded into `dst` (cols bytes; caller provides cols + 8 slack for writes past cols if
// slack).
inline void mx_expand_row(const u8* mask, u8 base, u32 cols, u8* dst) {
  const u64 b = u64{base} * 0x0101010101010101ull;
  const u32 full = cols / 8;
  for (u32 k = 0; k < full; ++k) {
    const u64 v = kSpread.v[mask[k]] + b;
    std::memcpy(dst + std::size_t{k} * 8, &v, 8);
  }
  if (cols % 8) {
    const u64 v = kSpread.v[mask[full]] + b;
    std::memcpy(dst + std::size_t{full} * 8, &v, cols % 8);
  }
}

// Rows [r0, r0 + 64) of an MXFP4 expert into the row-major layout.
void mx_decode_rows(const CsfTensor& t, u32 e, u32 r0, u8* out) {
  const CsfGeometry& g = t.geometry;
  const u32 R = g.shape.rows, C = g.shape.cols;
  const u32 mb = mx_mask_bytes(g.padded_cols);
  const u8* fixed_e = t.fixed.data() + std::size_t{e} * g.fixed_bytes_per_expert;
  const u32 r_end = std::min(r0 + 64, R);
  for (u32 r = r0; r < r_end; ++r) {
    const u8* slab = fixed_e + std::size_t{r / 16} * g.slab_bytes;
    mx_expand_row(slab + 16 + std::size_t{r % 16} * mb, slab[r % 16], C, out + std::size_t{r} * C);
    patch_row<false>(t, e, r, out, C);
  }
}

// One 128-row band of an MXFP4 expert into the swizzled layout: 4 rows 32
// apart are expanded side by side, then 4x4 transposes give whole 16-byte
// tile chunks. Rows past the CSF grid are 0x00, padding columns the base.
// Fast case of the band below (C % 8 == 0, all 128 rows inside the CSF
// grid): every mask byte of a row gives 8 bytes, the halves of two tile
// chunks; the 4 rows of a chunk are merged in 64-bit registers and stored
// straight into the tiles, then the records are patched in place.
void mx_decode_swizzled_band_fast(const CsfTensor& t, u32 e, u32 r0, u8* out) {
  const CsfGeometry& g = t.geometry;
  const u32 C = g.shape.cols;
  const u32 mb = C / 8;
  const u8* fixed_e = t.fixed.data() + std::size_t{e} * g.fixed_bytes_per_expert;
  u8* tiles = out + std::size_t{r0 / 128} * (C / 4) * 512;
  constexpr u64 low = 0xFFFFFFFFull, ones = 0x0101010101010101ull;
  const u8* m[128];  // mask row and base lanes of band row j
  u64 b[128];
  for (u32 j = 0; j < 128; ++j) {
    const u32 r = r0 + j;
    const u8* slab = fixed_e + std::size_t{r / 16} * g.slab_bytes;
    m[j] = slab + 16 + std::size_t{r % 16} * mb;
    b[j] = u64{slab[r % 16]} * ones;
  }
  // Tile by tile, so the output is written as two sequential streams.
  for (u32 x = 0; x < mb; ++x) {
    u8* even_tile = tiles + std::size_t{2 * x} * 512;
    u8* odd_tile = even_tile + 512;
    for (u32 k = 0; k < 32; ++k) {
      const u64 v0 = kSpread.v[m[k][x]] + b[k], v1 = kSpread.v[m[k + 32][x]] + b[k + 32];
      const u64 v2 = kSpread.v[m[k + 64][x]] + b[k + 64], v3 = kSpread.v[m[k + 96][x]] + b[k + 96];
      // Little-endian: the low half of each row's 8 bytes is columns 8x..8x+3.
      const u64 even[2] = {(v0 & low) | (v1 << 32), (v2 & low) | (v3 << 32)};
      const u64 odd[2] = {(v0 >> 32) | (v1 & ~low), (v2 >> 32) | (v3 & ~low)};
      std::memcpy(even_tile + k * 16, even, 16);
      std::memcpy(odd_tile + k * 16, odd, 16);
    }
  }
  for (u32 r = r0; r < r0 + 128; ++r) patch_row<true>(t, e, r, out, C);
}

void mx_decode_swizzled_band(const CsfTensor& t, u32 e, u32 r0, u8* out) {
  const CsfGeometry& g = t.geometry;
  const u32 C = g.shape.cols;
  if (C % 8 == 0 && r0 + 128 <= g.padded_rows) {
    mx_decode_swizzled_band_fast(t, e, r0, out);
    return;
  }
  const u32 mb = mx_mask_bytes(g.padded_cols);
  const u8* fixed_e = t.fixed.data() + std::size_t{e} * g.fixed_bytes_per_expert;
  const u32 cols = static_cast<u32>(swz_cols(C));
  const std::size_t groups = cols / 4;
  thread_local std::vector<u8> buf;
  buf.resize(std::size_t{4} * cols);
  u8* tiles = out + std::size_t{r0 / 128} * groups * 512;
  for (u32 k = 0; k < 32; ++k) {
    for (u32 q = 0; q < 4; ++q) {
      const u32 r = r0 + 32 * q + k;
      u8* row = buf.data() + std::size_t{q} * cols;
      if (r >= g.padded_rows) {
        std::memset(row, 0, cols);
        continue;
      }
      const u8* slab = fixed_e + std::size_t{r / 16} * g.slab_bytes;
      const u8 base = slab[r % 16];
      mx_expand_row(slab + 16 + std::size_t{r % 16} * mb, base, C, row);
      std::memset(row + C, base, cols - C);  // padding columns hold the base
      const std::size_t gr = std::size_t{e} * g.padded_rows + r;
      const u32 pos0 = r * g.padded_cols;
      for (u32 i = t.row_prefix[gr]; i < t.row_prefix[gr + 1]; ++i)
        row[exception_position(t.exceptions[i]) - pos0] = exception_value(t.exceptions[i]);
    }
    std::size_t gi = 0;
    for (; gi + 4 <= groups; gi += 4) {
      u32x4 v[4];
      for (u32 q = 0; q < 4; ++q) v[q] = load_u32x4(buf.data() + std::size_t{q} * cols + gi * 4);
      transpose4(v[0], v[1], v[2], v[3]);  // v[j]: chunk k of tile gi + j
      for (u32 j = 0; j < 4; ++j) std::memcpy(tiles + (gi + j) * 512 + k * 16, &v[j], 16);
    }
    for (; gi < groups; ++gi)
      for (u32 q = 0; q < 4; ++q)
        std::memcpy(tiles + gi * 512 + k * 16 + q * 4, buf.data() + std::size_t{q} * cols + gi * 4, 4);
  }
}

void fast_decode(const CsfTensor& t, std::span<const u32> experts, ScaleLayout layout, std::span<u8> dst,
                 unsigned threads) {
  const CsfGeometry& g = t.geometry;
  const bool nv = g.shape.format == ScaleFormat::nvfp4;
  const bool mx_swz = !nv && layout == ScaleLayout::swizzled_128x4;
  // MXFP4 to swizzled works in whole 128-row tiles (which may reach past the
  // CSF grid's 64-row padding); everything else in slabs / partitions.
  const u32 unit = mx_swz ? 128 : task_rows(g);
  const u32 units = static_cast<u32>((mx_swz ? swz_rows(g.shape.rows) : g.padded_rows) / unit);
  const std::size_t per = native_per_expert(g, layout);
  cpu_threads::for_each_index(experts.size() * units, threads, [&](std::size_t task) {
    const u32 e = experts[task / units];
    const u32 u = static_cast<u32>(task % units);
    u8* out = dst.data() + std::size_t{e} * per;
    if (nv)
      nv_decode_slab(t, e, u, layout, out);
    else if (mx_swz)
      mx_decode_swizzled_band(t, e, u * unit, out);
    else
      mx_decode_rows(t, e, u * unit, out);
  });
}

// ---------------------------------------------------------------------------
// Checks.
// ---------------------------------------------------------------------------
void check_part_sizes(const CsfTensor& t) {
  const CsfGeometry& g = t.geometry;
  if (t.fixed.size() != g.fixed_bytes())
    throw FormatError(fmt::format("CSF fixed part: {} bytes, expected {} for grid {}", t.fixed.size(),
                                  g.fixed_bytes(), describe(g.shape)));
  if (t.row_prefix.size() != g.total_rows() + 1)
    throw FormatError(
        fmt::format("CSF row_prefix: {} entries, expected {} (experts x padded rows + 1) for grid {}",
                    t.row_prefix.size(), g.total_rows() + 1, describe(g.shape)));
  const u64 parts = u64{g.partitions_per_expert} * g.shape.experts + 1;
  if (t.partition_index.size() != parts)
    throw FormatError(
        fmt::format("CSF partition_index: {} entries, expected {} (experts x partitions + 1) for grid {}",
                    t.partition_index.size(), parts, describe(g.shape)));
  if (t.row_prefix.back() != t.exceptions.size())
    throw FormatError(
        fmt::format("CSF row_prefix: the last entry is {} but the tensor holds {} exception records",
                    t.row_prefix.back(), t.exceptions.size()));
}

void check_geometry(const CsfGeometry& g) {
  CsfGeometry want;
  try {
    want = CsfGeometry::of(g.shape);
  } catch (const InvalidArgument& e) {
    throw FormatError(std::string("CSF header: ") + e.what());
  }
  auto field = [&](const char* name, u64 have, u64 expect) {
    if (have != expect)
      throw FormatError(
          fmt::format("CSF header: {} is {}, but grid {} needs {}", name, have, describe(g.shape), expect));
  };
  field("padded_rows", g.padded_rows, want.padded_rows);
  field("padded_cols", g.padded_cols, want.padded_cols);
  field("slab_rows", g.slab_rows, want.slab_rows);
  field("slab_bytes", g.slab_bytes, want.slab_bytes);
  field("fixed_bytes_per_expert", g.fixed_bytes_per_expert, want.fixed_bytes_per_expert);
  field("partition_rows", g.partition_rows, want.partition_rows);
  field("partitions_per_expert", g.partitions_per_expert, want.partitions_per_expert);
}

void check_layout_arg(ScaleLayout layout, const char* who) {
  if (!known_layout(layout))
    throw InvalidArgument(fmt::format("{}: unknown destination layout {}", who, unsigned(layout)));
}

void check_dst(const CsfGeometry& g, ScaleLayout layout, std::size_t size, const char* who) {
  const u64 want = g.native_bytes(layout);
  if (size != want)
    throw InvalidArgument(fmt::format("{}: destination holds {} bytes, expected {} for grid {} decoded to {}",
                                      who, size, want, describe(g.shape), to_string(layout)));
}

}  // namespace

// ---------------------------------------------------------------------------
// Public API
// ---------------------------------------------------------------------------
CsfGeometry CsfGeometry::of(const GridShape& s) {
  if (!known_format(s.format))
    throw InvalidArgument(fmt::format("CSF grid shape: unknown scale format {}", unsigned(s.format)));
  if (!known_layout(s.layout))
    throw InvalidArgument(fmt::format("CSF grid shape: unknown scale layout {}", unsigned(s.layout)));
  if (s.experts == 0 || s.rows == 0 || s.cols == 0)
    throw InvalidArgument(
        fmt::format("CSF grid shape {}: experts, rows and cols must all be at least 1", describe(s)));
  if (s.layout == ScaleLayout::swizzled_128x4 && (s.rows % 128 != 0 || s.cols % 4 != 0))
    throw InvalidArgument(fmt::format(
        "CSF grid shape {}: a swizzled_128x4 source is stored padded, so rows must be a multiple of 128 and "
        "cols a multiple of 4",
        describe(s)));
  CsfGeometry g;
  g.shape = s;
  g.partition_rows = csf_partition_rows(s.format);
  g.slab_rows = csf_slab_rows(s.format);
  const u64 prow = round_up(s.rows, g.partition_rows);
  const u64 pcol = round_up(s.cols, csf_col_granule(s.format));
  if (prow * pcol >= csf_max_positions)
    throw InvalidArgument(
        fmt::format("CSF grid shape {}: one expert's padded grid is {}x{} = {} positions, but exception "
                    "positions are 24-bit "
                    "(at most {} positions per expert)",
                    describe(s), prow, pcol, prow * pcol, csf_max_positions - 1));
  g.padded_rows = static_cast<u32>(prow);
  g.padded_cols = static_cast<u32>(pcol);
  g.slab_bytes = s.format == ScaleFormat::nvfp4 ? 128 * (1 + pcol / 2) : 16 * (1 + (pcol + 7) / 8);
  g.fixed_bytes_per_expert = prow / g.slab_rows * g.slab_bytes;
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

CsfTensor encode(const GridShape& shape, std::span<const std::uint8_t> src, const CodecOptions& options) {
  const CsfGeometry g = CsfGeometry::of(shape);
  const u64 want = g.native_bytes(shape.layout);
  if (src.size() != want)
    throw InvalidArgument(fmt::format("CSF encode: source holds {} bytes, expected {} for grid {}",
                                      src.size(), want, describe(shape)));
  return options.reference ? reference_encode(g, src) : fast_encode(g, src, options.threads);
}

void decode_experts(const CsfTensor& tensor, std::span<const std::uint32_t> experts, ScaleLayout layout,
                    std::span<std::uint8_t> dst, const CodecOptions& options, bool trusted) {
  check_layout_arg(layout, "CSF decode");
  if (trusted)
    check_part_sizes(tensor);  // cheap, and keeps a lying caller inside the buffers
  else
    validate(tensor);
  const CsfGeometry& g = tensor.geometry;
  check_dst(g, layout, dst.size(), "CSF decode");
  std::vector<u32> list(experts.begin(), experts.end());
  for (std::size_t i = 0; i < list.size(); ++i)
    if (list[i] >= g.shape.experts)
      throw InvalidArgument(
          fmt::format("CSF decode_experts: expert id {} (entry {}) is out of range for {} experts", list[i],
                      i, g.shape.experts));
  std::sort(list.begin(), list.end());
  list.erase(std::unique(list.begin(), list.end()), list.end());
  if (options.reference) {
    for (u32 e : list) reference_decode_expert(tensor, e, layout, dst);
    return;
  }
  fast_decode(tensor, list, layout, dst, options.threads);
}

void decode(const CsfTensor& tensor, ScaleLayout layout, std::span<std::uint8_t> dst,
            const CodecOptions& options, bool trusted) {
  check_layout_arg(layout, "CSF decode");
  if (trusted)
    check_part_sizes(tensor);
  else
    validate(tensor);
  const CsfGeometry& g = tensor.geometry;
  check_dst(g, layout, dst.size(), "CSF decode");
  std::vector<u32> all(g.shape.experts);
  for (u32 e = 0; e < g.shape.experts; ++e) all[e] = e;
  if (options.reference) {
    for (u32 e : all) reference_decode_expert(tensor, e, layout, dst);
    return;
  }
  fast_decode(tensor, all, layout, dst, options.threads);
}

// The slow, cell-by-cell check that names the first violation; run only
// when the fast check below has found one.
static void validate_detailed(const CsfTensor& t) {
  const CsfGeometry& g = t.geometry;
  const u32 E = g.shape.experts, R = g.shape.rows, C = g.shape.cols, Rp = g.padded_rows, Cp = g.padded_cols;
  const unsigned w = csf_window(g.shape.format);
  const auto& rp = t.row_prefix;
  if (rp[0] != 0) throw FormatError(fmt::format("CSF row_prefix: the first entry is {}, expected 0", rp[0]));
  for (std::size_t i = 1; i < rp.size(); ++i)
    if (rp[i] < rp[i - 1])
      throw FormatError(
          fmt::format("CSF row_prefix: entry {} (expert {}, row {}) is {}, below the previous entry {} (the "
                      "prefix must not "
                      "decrease)",
                      i, i / Rp, i % Rp, rp[i], rp[i - 1]));
  for (std::size_t i = 0; i < t.partition_index.size(); ++i) {
    const u32 want = rp[i * g.partition_rows];
    if (t.partition_index[i] != want)
      throw FormatError(fmt::format("CSF partition_index: entry {} is {}, but row_prefix at row {} is {}", i,
                                    t.partition_index[i], i * g.partition_rows, want));
  }
  const Fixed fx{g, const_cast<u8*>(t.fixed.data())};
  const bool nv = g.shape.format == ScaleFormat::nvfp4;
  for (u32 e = 0; e < E; ++e) {
    const u32 expert_first = rp[std::size_t{e} * Rp];
    for (u32 r = 0; r < Rp; ++r) {
      const u8 base = fx.base(e, r);
      if (base > 256 - w)
        throw FormatError(
            fmt::format("CSF fixed part: row {} of expert {} has base {}, above {} (the window [base, base + "
                        "{}] must fit in a "
                        "byte)",
                        r, e, base, 256 - w, w - 1));
      const std::size_t gr = std::size_t{e} * Rp + r;
      if (r >= R) {
        if (base != 0)
          throw FormatError(
              fmt::format("CSF fixed part: padding row {} of expert {} has base {} (padding rows must be 0)",
                          r, e, base));
        if (rp[gr + 1] != rp[gr])
          throw FormatError(
              fmt::format("CSF row_prefix: padding row {} of expert {} lists {} exception records", r, e,
                          rp[gr + 1] - rp[gr]));
        for (u32 c = 0; c < Cp; ++c)
          if (fx.offset(e, r, c) != 0)
            throw FormatError(fmt::format(
                "CSF fixed part: padding row {} of expert {} has offset {} at column {} (padding must be 0)",
                r, e, fx.offset(e, r, c), c));
        if (!nv) {
          // MXFP4 mask bits past the last column are padding too.
          for (u32 c = Cp; c < mx_mask_bytes(Cp) * 8; ++c)
            if (fx.offset(e, r, c) != 0)
              throw FormatError(fmt::format(
                  "CSF fixed part: padding row {} of expert {} has mask bit {} set (padding must be 0)", r, e,
                  c));
        }
        continue;
      }
      const u32 pad_end = nv ? Cp : mx_mask_bytes(Cp) * 8;
      for (u32 c = C; c < pad_end; ++c)
        if (fx.offset(e, r, c) != 0)
          throw FormatError(
              fmt::format("CSF fixed part: row {} of expert {} has offset {} in padding column {} (the grid "
                          "has {} columns; "
                          "padding must be 0)",
                          r, e, fx.offset(e, r, c), c, C));
      u32 prev = 0;
      for (u32 i = rp[gr]; i < rp[gr + 1]; ++i) {
        const u32 rec = t.exceptions[i];
        const u32 pos = exception_position(rec);
        const u32 prow = pos / Cp, pcol = pos % Cp;
        const u32 index = i - expert_first;
        if (prow >= R || pcol >= C)
          throw FormatError(
              fmt::format("CSF exceptions: record {} of expert {} has position {} outside the {}x{} grid",
                          index, e, pos, R, C));
        if (prow != r)
          throw FormatError(
              fmt::format("CSF exceptions: record {} of expert {} has position {} (row {}, column {}) but "
                          "row_prefix places it "
                          "in row {} (records must be sorted by row)",
                          index, e, pos, prow, pcol, r));
        if (i > rp[gr] && pos <= prev)
          throw FormatError(
              fmt::format("CSF exceptions: record {} of expert {} has position {} after position {} (records "
                          "must be sorted by "
                          "column inside a row, without duplicates)",
                          index, e, pos, prev));
        prev = pos;
        if (const u8 off = fx.offset(e, r, pcol); off != 0)
          throw FormatError(
              fmt::format("CSF fixed part: row {} column {} of expert {} holds offset {} under exception "
                          "record {} (must be 0)",
                          r, pcol, e, off, index));
        const u8 v = exception_value(rec);
        if (v >= base && v < base + w)
          throw FormatError(
              fmt::format("CSF exceptions: record {} of expert {} stores byte 0x{:02x} at row {} column {}, "
                          "inside the row's "
                          "window [{}, {}] (it must be an offset)",
                          index, e, v, r, pcol, base, base + w - 1));
      }
    }
  }
}

// Fast structural check: true when the parts are valid. It tests exactly the
// rules of validate_detailed, but walks the records of a slab in one flat,
// branch-free loop (each record finds its row from its position and must lie
// inside that row's prefix range) and touches the fixed part only at bases,
// exception slots and padding cells.
template <bool NV>
static bool validate_fast(const CsfTensor& t) {
  const CsfGeometry& g = t.geometry;
  const u32 E = g.shape.experts, R = g.shape.rows, C = g.shape.cols, Rp = g.padded_rows, Cp = g.padded_cols;
  constexpr unsigned w = NV ? 16 : 2;
  constexpr u32 SR = NV ? 128 : 16;  // slab rows
  const u32* rp = t.row_prefix.data();
  const std::size_t nrp = t.row_prefix.size();
  u32 bad = rp[0] != 0;
  for (std::size_t i = 1; i < nrp; ++i) bad |= rp[i] < rp[i - 1];
  for (std::size_t i = 0; i < t.partition_index.size(); ++i)
    bad |= t.partition_index[i] != rp[i * g.partition_rows];
  if (bad) return false;
  const u32* recs = t.exceptions.data();
  const u32 mb = mx_mask_bytes(Cp);
  constexpr u8 max_base = static_cast<u8>(256 - w);
  // pos / Cp exactly for 24-bit pos and Cp < 2^24: floor(pos * m / 2^48).
  const u64 magic = (u64{1} << 48) / Cp + 1;
  // Padding columns of a true row: NVFP4 columns C..Cp-1 (inside the last
  // 4-column group), MXFP4 mask bits C..8*mb-1 (inside the last mask byte).
  const bool pad_cols = NV ? C != Cp : C != mb * 8;
  // Exception slots are scattered over their slab, so reading them from
  // memory is latency-bound; stream the fixed part into L2 ahead instead (at
  // least one slab and 8 KiB ahead).
  const u8* fixed = t.fixed.data();
  const std::size_t fixed_size = t.fixed.size();
  const std::size_t SB = g.slab_bytes;
  const std::size_t ahead = SB * ((8192 + SB - 1) / SB);
  std::size_t prefetched = std::min<std::size_t>(ahead, fixed_size);
  const u32 slabs = Rp / SR;
  for (u32 e = 0; e < E; ++e) {
    const u8* fixed_e = fixed + std::size_t{e} * g.fixed_bytes_per_expert;
    const u32* rpe = rp + std::size_t{e} * Rp;
    u32 lowest = 0;  // the next record's position must be at least this
    for (u32 s = 0; s < slabs; ++s) {
      const u8* slab = fixed_e + std::size_t{s} * SB;
      // Prefetch up to one slab (plus `ahead`) past this one: two lines per
      // record inside the record loop, the rest after it.
      const std::size_t until = std::min(static_cast<std::size_t>(slab - fixed) + SB + ahead, fixed_size);
      const u32 r0 = s * SR;
      if (r0 + SR <= R) {
        u8 mx = 0;
        for (u32 j = 0; j < SR; ++j) mx = std::max(mx, slab[j]);  // NVFP4: the 128 bases, any order
        bad |= mx > max_base;
      } else {
        for (u32 j = 0; j < SR; ++j) {
          const u32 r = r0 + j;
          const u8 base = NV ? slab[nv_base_offset(j)] : slab[j];
          if (r < R) {
            bad |= base > max_base;
            continue;
          }
          // Padding row: base 0, no records, every offset 0.
          const u8* row_nib =
              NV ? slab + 128 + std::size_t{j % 32} * 8 + (j / 32) * 2 : slab + 16 + std::size_t{j} * mb;
          u32 any = base | (rpe[r + 1] - rpe[r]);
          if constexpr (NV) {
            for (u32 gi = 0; gi < Cp / 4; ++gi)
              any |= row_nib[std::size_t{gi} * 256] | row_nib[std::size_t{gi} * 256 + 1];
          } else {
            for (u32 k = 0; k < mb; ++k) any |= row_nib[k];
          }
          bad |= any;
        }
      }
      if (pad_cols) {
        for (u32 j = 0; j < SR && r0 + j < R; ++j) {
          const u8* row_nib =
              NV ? slab + 128 + std::size_t{j % 32} * 8 + (j / 32) * 2 : slab + 16 + std::size_t{j} * mb;
          if constexpr (NV) {
            const u8* q = row_nib + std::size_t{C / 4} * 256;  // C % 4 in 1..3
            const u32 word = u32{q[0]} | u32{q[1]} << 8;       // nibble j = column 4 * (C / 4) + j
            bad |= word >> (4 * (C % 4));
          } else {
            bad |= row_nib[C / 8] >> (C % 8);
            for (u32 k = C / 8 + 1; k < mb; ++k) bad |= row_nib[k];
          }
        }
      }
      const u32 first = rpe[r0], last = rpe[r0 + SR];
      for (u32 i = first; i < last; ++i) {
        const u32 rec = recs[i];
        const u32 pos = exception_position(rec);
        const u32 r = static_cast<u32>((pos * magic) >> 48);
        const u32 c = pos - r * Cp;
        bool out = r >= R || c >= C || pos < lowest;
        lowest = pos + 1;
        const u32 r1 = out ? r0 : r;  // keep every read inside the slab
        out |= i < rpe[r1] || i >= rpe[r1 + 1];
        const u32 j = out ? 0 : r1 - r0;
        const u32 cc = out ? 0 : c;
        const u8* row_nib =
            NV ? slab + 128 + std::size_t{j % 32} * 8 + (j / 32) * 2 : slab + 16 + std::size_t{j} * mb;
        const u8 base = NV ? slab[nv_base_offset(j)] : slab[j];
        const u32 off = NV ? (row_nib[std::size_t{cc / 4} * 256 + (cc % 4) / 2] >> ((cc & 1) * 4)) & 0xF
                           : (row_nib[cc / 8] >> (cc % 8)) & 1;
        bad |= out | off | (u8(exception_value(rec) - base) < w);
        for (int k = 0; k < 2; ++k) {
          const bool more = prefetched < until;
          __builtin_prefetch(fixed + (more ? prefetched : until - 1), 0, 2);
          prefetched += more ? 64 : 0;
        }
      }
      for (; prefetched < until; prefetched += 64) __builtin_prefetch(fixed + prefetched, 0, 2);
    }
    if (bad) return false;
  }
  return bad == 0;
}

void validate(const CsfTensor& t) {
  const CsfGeometry& g = t.geometry;
  check_geometry(g);
  check_part_sizes(t);
  if (g.shape.format == ScaleFormat::nvfp4 ? validate_fast<true>(t) : validate_fast<false>(t)) return;
  validate_detailed(t);
  throw FormatError(fmt::format("CSF parts of grid {}: the structural check failed", describe(g.shape)));
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
                                      expert, row, describe(g.shape), g.padded_rows));
  if (t.fixed.size() != g.fixed_bytes())
    throw FormatError(fmt::format("CSF fixed part: {} bytes, expected {} for grid {}", t.fixed.size(),
                                  g.fixed_bytes(), describe(g.shape)));
  return Fixed{g, const_cast<u8*>(t.fixed.data())}.base(expert, row);
}

}  // namespace csfmoe
