// Fast CPU CSF decoder: nibbles and mask bits expanded with vector ops or a
// 256-entry table, then each row's records patched (docs/csf-format.md).
#include <algorithm>
#include <array>

#include "codec/csf_internal.hpp"
#include "common/cpu_threads.hpp"

namespace csfmoe {
namespace csf_internal {
namespace {

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

// Records of row r (inside expert e) patched into a row-major or swizzled expert.
template <bool Swizzled>
inline void patch_row(const CsfTensor& t, u32 e, u32 r, u8* out, std::size_t out_cols) {
  const CsfGeometry& g = t.geometry;
  const std::size_t gr = std::size_t{e} * g.padded_rows + r;
  const u32 first = t.row_prefix[gr], last = t.row_prefix[gr + 1];
  const u32 pos0 = csf::position(r, 0, g.padded_cols);
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
  const u8* nib = slab + csf::slab_base_bytes(kNv);
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
    const u64 v = kSpreadBits.v[mask[k]] + b;
    std::memcpy(dst + std::size_t{k} * 8, &v, 8);
  }
  if (cols % 8) {
    const u64 v = kSpreadBits.v[mask[full]] + b;
    std::memcpy(dst + std::size_t{full} * 8, &v, cols % 8);
  }
}

// Rows [r0, r0 + 64) of an MXFP4 expert into the row-major layout.
void mx_decode_rows(const CsfTensor& t, u32 e, u32 r0, u8* out) {
  const CsfGeometry& g = t.geometry;
  const u32 R = g.shape.rows, C = g.shape.cols;
  const u32 mb = csf::mxfp4_mask_bytes(g.padded_cols);
  const u8* fixed_e = t.fixed.data() + std::size_t{e} * g.fixed_bytes_per_expert;
  const u32 r_end = std::min(r0 + 64, R);
  for (u32 r = r0; r < r_end; ++r) {
    const u8* slab = fixed_e + std::size_t{csf::slab_index(kMx, r)} * g.slab_bytes;
    mx_expand_row(slab + csf::mxfp4_row_mask(r, mb), slab[csf::base_index(kMx, r)], C,
                  out + std::size_t{r} * C);
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
    const u8* slab = fixed_e + std::size_t{csf::slab_index(kMx, r)} * g.slab_bytes;
    m[j] = slab + csf::mxfp4_row_mask(r, mb);
    b[j] = u64{slab[csf::base_index(kMx, r)]} * ones;
  }
  // Tile by tile, so the output is written as two sequential streams.
  for (u32 x = 0; x < mb; ++x) {
    u8* even_tile = tiles + std::size_t{2 * x} * 512;
    u8* odd_tile = even_tile + 512;
    for (u32 k = 0; k < 32; ++k) {
      const u64 v0 = kSpreadBits.v[m[k][x]] + b[k], v1 = kSpreadBits.v[m[k + 32][x]] + b[k + 32];
      const u64 v2 = kSpreadBits.v[m[k + 64][x]] + b[k + 64], v3 = kSpreadBits.v[m[k + 96][x]] + b[k + 96];
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
  const u32 mb = csf::mxfp4_mask_bytes(g.padded_cols);
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
      const u8* slab = fixed_e + std::size_t{csf::slab_index(kMx, r)} * g.slab_bytes;
      const u8 base = slab[csf::base_index(kMx, r)];
      mx_expand_row(slab + csf::mxfp4_row_mask(r, mb), base, C, row);
      std::memset(row + C, base, cols - C);  // padding columns hold the base
      const std::size_t gr = std::size_t{e} * g.padded_rows + r;
      const u32 pos0 = csf::position(r, 0, g.padded_cols);
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

void check_layout_arg(ScaleLayout layout, const char* who) {
  if (!is_known(layout))
    throw InvalidArgument(fmt::format("{}: unknown destination layout {}", who, unsigned(layout)));
}

void check_dst(const CsfGeometry& g, ScaleLayout layout, std::size_t size, const char* who) {
  const u64 want = g.native_bytes(layout);
  if (size != want)
    throw InvalidArgument(fmt::format("{}: destination holds {} bytes, expected {} for grid {} decoded to {}",
                                      who, size, want, to_string(g.shape), to_string(layout)));
}

}  // namespace

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

}  // namespace csf_internal

using namespace csf_internal;

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

}  // namespace csfmoe
