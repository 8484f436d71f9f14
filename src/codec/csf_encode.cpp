// Fast CPU CSF encoder: tasks of one NVFP4 slab / one MXFP4 partition on
// cpu_threads::for_each_index, SIMD base search and offset packing (docs/csf-format.md,
// "Implementations").
#include <algorithm>
#include <bit>
#include <limits>
#include <stdexcept>

#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "codec/csf_internal.hpp"
#include "common/cpu_threads.hpp"

namespace csfmoe {
namespace csf_internal {
namespace {

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
  u8* nib = slab + csf::slab_base_bytes(kNv) + csf::nvfp4_row_in_group(r);  // group g at nib + g * 256
  const u8x16 bv = splat16(base);
  const u32 pos0 = csf::position(r, 0, padded_cols);
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
  u8* nib = slab + csf::slab_base_bytes(kNv) +
            csf::nvfp4_row_in_group(k);  // group g at nib + g * 256, row q at + 2q
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
  u8* mask = slab + csf::mxfp4_row_mask(r, csf::mxfp4_mask_bytes(padded_cols));
  const u8x16 bv = splat16(base);
  const u32 pos0 = csf::position(r, 0, padded_cols);
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
  u8* nib = slab + csf::slab_base_bytes(kNv);
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

}  // namespace

RowBase window_base(ScaleFormat format, const u8* row, u32 n) {
  thread_local std::vector<u32> hist;
  if (hist.size() != 1024) hist.assign(1024, 0);  // fast_base leaves it zeroed
  const RowResult res =
      format == ScaleFormat::nvfp4 ? fast_base<16>(row, n, hist.data()) : fast_base<2>(row, n, hist.data());
  return {res.base, res.in_window};
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
      u8* slab = fixed_e + std::size_t{nv ? csf::slab_index(kNv, r) : csf::slab_index(kMx, r)} * g.slab_bytes;
      const RowResult res =
          nv ? fast_base<16>(row_of(i), C, hist.data()) : fast_base<2>(row_of(i), C, hist.data());
      bases[i] = res.base;
      slab[nv ? csf::base_index(kNv, r) : csf::base_index(kMx, r)] = res.base;
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
        u8* slab =
            fixed_e + std::size_t{nv ? csf::slab_index(kNv, r) : csf::slab_index(kMx, r)} * g.slab_bytes;
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

}  // namespace csf_internal

using namespace csf_internal;

CsfTensor encode(const GridShape& shape, std::span<const std::uint8_t> src, const CodecOptions& options) {
  const CsfGeometry g = CsfGeometry::of(shape);
  const u64 want = g.native_bytes(shape.layout);
  if (src.size() != want)
    throw InvalidArgument(fmt::format("CSF encode: source holds {} bytes, expected {} for grid {}",
                                      src.size(), want, to_string(shape)));
  return options.reference ? reference_encode(g, src) : fast_encode(g, src, options.threads);
}

}  // namespace csfmoe
