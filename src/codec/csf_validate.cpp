// Validation of untrusted CSF parts (docs/csf-format.md, "Validation"): a
// fast branch-free structural check, and a cell-by-cell one that names the
// first violation when the fast one fails.
#include <algorithm>

#include "codec/csf_internal.hpp"

namespace csfmoe {
namespace csf_internal {
void check_part_sizes(const CsfTensor& t) {
  const CsfGeometry& g = t.geometry;
  if (t.fixed.size() != g.fixed_bytes())
    throw FormatError(fmt::format("CSF fixed part: {} bytes, expected {} for grid {}", t.fixed.size(),
                                  g.fixed_bytes(), to_string(g.shape)));
  if (t.row_prefix.size() != g.total_rows() + 1)
    throw FormatError(
        fmt::format("CSF row_prefix: {} entries, expected {} (experts x padded rows + 1) for grid {}",
                    t.row_prefix.size(), g.total_rows() + 1, to_string(g.shape)));
  const u64 parts = u64{g.partitions_per_expert} * g.shape.experts + 1;
  if (t.partition_index.size() != parts)
    throw FormatError(
        fmt::format("CSF partition_index: {} entries, expected {} (experts x partitions + 1) for grid {}",
                    t.partition_index.size(), parts, to_string(g.shape)));
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
          fmt::format("CSF header: {} is {}, but grid {} needs {}", name, have, to_string(g.shape), expect));
  };
  field("padded_rows", g.padded_rows, want.padded_rows);
  field("padded_cols", g.padded_cols, want.padded_cols);
  field("slab_rows", g.slab_rows, want.slab_rows);
  field("slab_bytes", g.slab_bytes, want.slab_bytes);
  field("fixed_bytes_per_expert", g.fixed_bytes_per_expert, want.fixed_bytes_per_expert);
  field("partition_rows", g.partition_rows, want.partition_rows);
  field("partitions_per_expert", g.partitions_per_expert, want.partitions_per_expert);
}

}  // namespace csf_internal

using namespace csf_internal;

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
          for (u32 c = Cp; c < csf::mxfp4_mask_bytes(Cp) * 8; ++c)
            if (fx.offset(e, r, c) != 0)
              throw FormatError(fmt::format(
                  "CSF fixed part: padding row {} of expert {} has mask bit {} set (padding must be 0)", r, e,
                  c));
        }
        continue;
      }
      const u32 pad_end = nv ? Cp : csf::mxfp4_mask_bytes(Cp) * 8;
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
        const u32 prow = csf::position_row(pos, Cp), pcol = csf::position_col(pos, Cp);
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
  const u32 mb = csf::mxfp4_mask_bytes(Cp);
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
          const u8 base = slab[csf::base_index(NV ? kNv : kMx, j)];
          if (r < R) {
            bad |= base > max_base;
            continue;
          }
          // Padding row: base 0, no records, every offset 0.
          const u8* row_nib = NV ? slab + csf::slab_base_bytes(kNv) + csf::nvfp4_row_in_group(j)
                                 : slab + csf::mxfp4_row_mask(j, mb);
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
          const u8* row_nib = NV ? slab + csf::slab_base_bytes(kNv) + csf::nvfp4_row_in_group(j)
                                 : slab + csf::mxfp4_row_mask(j, mb);
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
        const u8* row_nib = NV ? slab + csf::slab_base_bytes(kNv) + csf::nvfp4_row_in_group(j)
                               : slab + csf::mxfp4_row_mask(j, mb);
        const u8 base = slab[csf::base_index(NV ? kNv : kMx, j)];
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
  throw FormatError(fmt::format("CSF parts of grid {}: the structural check failed", to_string(g.shape)));
}

}  // namespace csfmoe
