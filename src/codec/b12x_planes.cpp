// b12x / vLLM canonical CSF checkpoint planes: encode, validate, decode,
// tensor-parallel slices and conversion to and from a CsfTensor
// (docs/csf-format.md, "Canonical checkpoint planes").
#include "csfmoe/b12x_planes.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <limits>

#include "codec/csf_internal.hpp"

namespace csfmoe {

using namespace csf_internal;

namespace {

// The layout of a grid's fixed plane.
csf::PlaneLayout plane_layout(const PlaneShape& s) { return {s.format, s.rows, s.cols}; }

// Rewrites validated planes in the encoder's form, decoding to the same
// bytes: b12x's and vLLM's readers let a record win over its slot, so a
// record may sit on a non-zero code or hold a byte of its row's window. The
// slot under a record becomes code 0; a record inside the window becomes
// that code instead. csfmoe's resident form and every plane it writes keep
// this form.
void canonicalize(const csf::PlaneLayout& L, std::vector<u8>& fixed, std::vector<u32>& exceptions) {
  std::size_t kept = 0;
  for (const u32 rec : exceptions) {
    const u32 pos = csf::record_position(rec), r = pos / L.cols, c = pos % L.cols;
    u8* codes = fixed.data() + L.codes_at(r);
    const u8 d = static_cast<u8>(csf::record_value(rec) - fixed[L.base_at(r)]);
    L.clear_code(codes, c);
    if (d < L.window)
      L.set_code(codes, c, d);
    else
      exceptions[kept++] = rec;
  }
  exceptions.resize(kept);
}

void check_ranges(const PlaneShape& s, std::span<const AxisRange> rows, AxisRange cols,
                  std::string_view name) {
  const std::string what = fmt::format("{}: CSF planes slice of grid {}", name, to_string(s));
  if (rows.empty()) throw InvalidArgument(what + ": no row ranges given");
  for (const AxisRange& r : rows) {
    if (r.count == 0 || r.first > s.rows || r.count > s.rows - r.first)  // no wrap-around
      throw InvalidArgument(fmt::format("{}: row range [{}, {}) is empty or outside the {} rows", what,
                                        r.first, r.first + r.count, s.rows));
    if (r.first % plane_slab_rows != 0 || r.count % plane_slab_rows != 0)
      throw InvalidArgument(fmt::format(
          "{}: row range [{}, {}) does not start and end on a 16-row slab boundary (planes are cut per slab)",
          what, r.first, r.first + r.count));
  }
  if (cols.count == 0 || cols.first > s.cols || cols.count > s.cols - cols.first)
    throw InvalidArgument(fmt::format("{}: column range [{}, {}) is empty or outside the {} columns", what,
                                      cols.first, cols.first + cols.count, s.cols));
  if (s.format == kNv && (cols.first % 2 != 0 || cols.count % 2 != 0))
    throw InvalidArgument(fmt::format(
        "{}: column range [{}, {}) splits an NVFP4 code byte (first column and count must be even)", what,
        cols.first, cols.first + cols.count));
}

}  // namespace

std::string to_string(const PlaneShape& s) {
  return fmt::format("[{}, {}] {}", s.rows, s.cols, to_string(s.format));
}

std::uint64_t plane_slab_bytes(ScaleFormat format, std::uint32_t cols) {
  return csf::plane_slab_bytes(format, cols);
}

void check_plane_shape(const PlaneShape& s, std::string_view name) {
  if (!is_known(s.format))
    throw InvalidArgument(fmt::format("{}: CSF planes: unknown scale format {}", name, unsigned(s.format)));
  if (s.rows == 0 || s.cols == 0)
    throw InvalidArgument(
        fmt::format("{}: CSF planes grid {}: rows and cols must both be at least 1", name, to_string(s)));
  if (s.rows % plane_slab_rows != 0)
    throw InvalidArgument(
        fmt::format("{}: CSF planes grid {}: rows must be a multiple of 16 (the planes hold 16-row slabs)",
                    name, to_string(s)));
  if (s.format == kNv && s.cols % 2 != 0)
    throw InvalidArgument(fmt::format(
        "{}: CSF planes grid {}: NVFP4 cols must be even (two 4-bit codes per byte)", name, to_string(s)));
  if (u64{s.rows} * s.cols > csf_max_positions)
    throw InvalidArgument(
        fmt::format("{}: CSF planes grid {}: {} positions, but exception positions are 24-bit (at most {})",
                    name, to_string(s), u64{s.rows} * s.cols, csf_max_positions));
}

CsfPlanes encode_planes(const PlaneShape& s, std::span<const std::uint8_t> native, std::string_view name) {
  check_plane_shape(s, name);
  const u64 want = u64{s.rows} * s.cols;
  if (native.size() != want)
    throw InvalidArgument(fmt::format("{}: CSF planes encode: source holds {} bytes, expected {} for grid {}",
                                      name, native.size(), want, to_string(s)));
  const csf::PlaneLayout L = plane_layout(s);
  CsfPlanes out;
  out.shape = s;
  out.fixed.assign(plane_fixed_bytes(s), 0);
  for (u32 r = 0; r < s.rows; ++r) {
    const u8* row = native.data() + std::size_t{r} * s.cols;
    const u8 base = window_base(s.format, row, s.cols).base;
    out.fixed[L.base_at(r)] = base;
    u8* codes = out.fixed.data() + L.codes_at(r);
    for (u32 c = 0; c < s.cols; ++c) {
      const u8 d = static_cast<u8>(row[c] - base);
      if (d < L.window)
        L.set_code(codes, c, d);
      else
        out.exceptions.push_back(csf::make_record(r * s.cols + c, row[c]));
    }
  }
  return out;
}

void validate_planes(const PlaneShape& s, std::span<const std::uint8_t> fixed,
                     std::span<const std::uint32_t> exceptions, std::string_view name) {
  check_plane_shape(s, name);
  const csf::PlaneLayout L = plane_layout(s);
  const u64 want = plane_fixed_bytes(s);
  if (fixed.size() != want)
    throw FormatError(
        fmt::format("{}: CSF fixed plane holds {} bytes, expected {} ({} slabs of {} bytes) for grid {}",
                    name, fixed.size(), want, s.rows / plane_slab_rows, L.slab_bytes, to_string(s)));
  const u8 max_base = L.max_base();
  for (u32 r = 0; r < s.rows; ++r) {
    const u8 base = fixed[L.base_at(r)];
    if (base > max_base)
      throw FormatError(
          fmt::format("{}: CSF fixed plane: row {} has base {}, above {} (the window [base, base + {}] "
                      "must fit in a "
                      "byte)",
                      name, r, base, max_base, L.window - 1));
    if (!L.nv() && s.cols % 8 != 0) {
      const u8 last = fixed[L.codes_at(r) + s.cols / 8];
      if (last >> (s.cols % 8))
        throw FormatError(
            fmt::format("{}: CSF fixed plane: row {} has selector bits set past its last column {} "
                        "(unused bits must "
                        "be 0)",
                        name, r, s.cols - 1));
    }
  }
  const u64 positions = u64{s.rows} * s.cols;
  for (std::size_t i = 0; i < exceptions.size(); ++i) {
    const u32 rec = exceptions[i];
    const u32 pos = csf::record_position(rec);
    if (i > 0 && pos <= csf::record_position(exceptions[i - 1]))
      throw FormatError(fmt::format(
          "{}: CSF exceptions plane: record {} has position {}, not above the previous record's {} (records "
          "must be strictly increasing)",
          name, i, pos, csf::record_position(exceptions[i - 1])));
    if (pos >= positions)
      throw FormatError(
          fmt::format("{}: CSF exceptions plane: record {} has position {}, outside the {}x{} grid", name, i,
                      pos, s.rows, s.cols));
  }
}

bool in_encoder_form(const CsfPlanes& planes) {
  const csf::PlaneLayout L = plane_layout(planes.shape);
  for (const u32 rec : planes.exceptions) {
    const u32 pos = csf::record_position(rec), r = pos / L.cols, c = pos % L.cols;
    const u8 d = static_cast<u8>(csf::record_value(rec) - planes.fixed[L.base_at(r)]);
    if (L.code(planes.fixed.data() + L.codes_at(r), c) != 0 || d < L.window) return false;
  }
  return true;
}

CsfPlanes canonical_planes(const CsfPlanes& planes, std::string_view name) {
  validate_planes(planes.shape, planes.fixed, planes.exceptions, name);
  CsfPlanes out = planes;
  canonicalize(plane_layout(planes.shape), out.fixed, out.exceptions);
  return out;
}

void decode_planes(const PlaneShape& s, std::span<const std::uint8_t> fixed,
                   std::span<const std::uint32_t> exceptions, std::span<std::uint8_t> native,
                   std::string_view name) {
  validate_planes(s, fixed, exceptions, name);
  const u64 want = u64{s.rows} * s.cols;
  if (native.size() != want)
    throw InvalidArgument(
        fmt::format("{}: CSF planes decode: destination holds {} bytes, expected {} for grid {}", name,
                    native.size(), want, to_string(s)));
  const csf::PlaneLayout L = plane_layout(s);
  for (u32 r = 0; r < s.rows; ++r) {
    const u8 base = fixed[L.base_at(r)];
    const u8* codes = fixed.data() + L.codes_at(r);
    u8* out = native.data() + std::size_t{r} * s.cols;
    if (L.nv()) {
      for (u32 j = 0; j < s.cols / 2; ++j) {
        out[2 * j] = static_cast<u8>(base + (codes[j] & 0xF));
        out[2 * j + 1] = static_cast<u8>(base + (codes[j] >> 4));
      }
    } else {
      // Eight selector bits at once: each spread to a byte (0 or 1) plus the base; no lane carries.
      const u64 bases = u64{base} * 0x0101010101010101ull;
      u32 c = 0;
      for (; c + 8 <= s.cols; c += 8) {
        const u64 v = kSpreadBits.v[codes[c / 8]] + bases;
        std::memcpy(out + c, &v, 8);
      }
      for (; c < s.cols; ++c) out[c] = static_cast<u8>(base + ((codes[c / 8] >> (c % 8)) & 1));
    }
  }
  for (const u32 rec : exceptions) native[csf::record_position(rec)] = csf::record_value(rec);
}

std::vector<std::uint8_t> decode_planes(const CsfPlanes& planes, std::string_view name) {
  check_plane_shape(planes.shape, name);
  std::vector<u8> out(std::size_t{planes.shape.rows} * planes.shape.cols);
  decode_planes(planes.shape, planes.fixed, planes.exceptions, out, name);
  return out;
}

CsfPlanes slice_planes(const CsfPlanes& source, std::span<const AxisRange> rows, AxisRange cols,
                       std::string_view name) {
  const CsfPlanes planes = canonical_planes(source, name);  // slices are written: the encoder's form
  const PlaneShape& s = planes.shape;
  check_ranges(s, rows, cols, name);
  u64 out_rows = 0;
  for (const AxisRange& r : rows) out_rows += r.count;
  if (out_rows > std::numeric_limits<u32>::max())
    throw InvalidArgument(fmt::format("{}: CSF planes slice: {} rows in all, too many", name, out_rows));
  const PlaneShape os{s.format, static_cast<u32>(out_rows), static_cast<u32>(cols.count)};
  check_plane_shape(os, name);
  const csf::PlaneLayout in = plane_layout(s), out_layout = plane_layout(os);
  CsfPlanes out;
  out.shape = os;
  out.fixed.assign(plane_fixed_bytes(os), 0);
  const u32 c0 = static_cast<u32>(cols.first), nc = os.cols;
  const auto by_position = [](u32 rec, u64 pos) { return csf::record_position(rec) < pos; };
  u32 o = 0;  // first output row of the range
  for (const AxisRange& range : rows) {
    const u32 r0 = static_cast<u32>(range.first), n = static_cast<u32>(range.count);
    for (u32 i = 0; i < n; ++i) {
      out.fixed[out_layout.base_at(o + i)] = planes.fixed[in.base_at(r0 + i)];
      const u8* src = planes.fixed.data() + in.codes_at(r0 + i);
      u8* dst = out.fixed.data() + out_layout.codes_at(o + i);
      if (in.nv()) {
        std::memcpy(dst, src + c0 / 2, nc / 2);
      } else {
        for (u32 c = 0; c < nc; ++c) out_layout.set_code(dst, c, in.code(src, c0 + c));
      }
    }
    const u64 first_pos = u64{r0} * s.cols, end_pos = u64{r0 + n} * s.cols;
    auto it = std::lower_bound(planes.exceptions.begin(), planes.exceptions.end(), first_pos, by_position);
    const auto end = std::lower_bound(it, planes.exceptions.end(), end_pos, by_position);
    for (; it != end; ++it) {
      const u32 pos = csf::record_position(*it), r = pos / s.cols, c = pos % s.cols;
      if (c < c0 || c >= c0 + nc) continue;
      out.exceptions.push_back(csf::make_record((o + r - r0) * nc + (c - c0), csf::record_value(*it)));
    }
    o += n;
  }
  return out;
}

CsfPlanes concat_planes(std::span<const CsfPlanes> parts, std::string_view name) {
  if (parts.empty()) throw InvalidArgument(fmt::format("{}: CSF planes concatenation: no parts given", name));
  const PlaneShape first = parts[0].shape;
  u64 rows = 0;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    const PlaneShape& s = parts[i].shape;
    if (s.format != first.format || s.cols != first.cols)
      throw InvalidArgument(fmt::format(
          "{}: CSF planes concatenation: part {} has grid {}, part 0 has {} (format and columns must "
          "agree)",
          name, i, to_string(s), to_string(first)));
    validate_planes(s, parts[i].fixed, parts[i].exceptions, fmt::format("{} part {}", name, i));
    rows += s.rows;
  }
  if (rows > std::numeric_limits<u32>::max())
    throw InvalidArgument(fmt::format("{}: CSF planes concatenation: {} rows in all, too many", name, rows));
  CsfPlanes out;
  out.shape = {first.format, static_cast<u32>(rows), first.cols};
  check_plane_shape(out.shape, name);
  out.fixed.reserve(plane_fixed_bytes(out.shape));
  u32 row0 = 0;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    const CsfPlanes part = canonical_planes(parts[i], fmt::format("{} part {}", name, i));
    out.fixed.insert(out.fixed.end(), part.fixed.begin(), part.fixed.end());
    const u32 shift = row0 * first.cols;  // row0 * cols < 2^24: the result passed check_plane_shape
    for (const u32 rec : part.exceptions)
      out.exceptions.push_back(csf::make_record(csf::record_position(rec) + shift, csf::record_value(rec)));
    row0 += part.shape.rows;
  }
  return out;
}

CsfTensor planes_to_csf(std::span<const CsfPlanes> experts, std::string_view name) {
  if (experts.empty())
    throw InvalidArgument(fmt::format("{}: CSF planes to CSF tensor: no experts given", name));
  const PlaneShape s = experts[0].shape;
  check_plane_shape(s, name);
  for (std::size_t e = 0; e < experts.size(); ++e) {
    if (experts[e].shape != s)
      throw InvalidArgument(
          fmt::format("{}: CSF planes to CSF tensor: expert {} has grid {}, expert 0 has {}", name, e,
                      to_string(experts[e].shape), to_string(s)));
  }
  // The resident form holds the encoder's form (csfmoe's validate requires it).
  std::vector<CsfPlanes> canonical;
  canonical.reserve(experts.size());
  for (std::size_t e = 0; e < experts.size(); ++e)
    canonical.push_back(canonical_planes(experts[e], fmt::format("{} expert {}", name, e)));
  if (experts.size() > std::numeric_limits<u32>::max())
    throw InvalidArgument(
        fmt::format("{}: CSF planes to CSF tensor: {} experts, too many", name, experts.size()));
  const u32 E = static_cast<u32>(experts.size()), R = s.rows, C = s.cols;
  CsfGeometry g;
  try {
    g = CsfGeometry::of(GridShape{s.format, ScaleLayout::row_major, E, R, C});
  } catch (const InvalidArgument& err) {
    throw InvalidArgument(fmt::format("{}: CSF planes to CSF tensor: {}", name, err.what()));
  }
  const csf::PlaneLayout L = plane_layout(s);
  CsfTensor t;
  t.geometry = g;
  t.fixed.assign(g.fixed_bytes(), 0);
  t.row_prefix.assign(g.total_rows() + 1, 0);
  const Fixed fx{g, t.fixed.data()};
  u64 total = 0;
  for (std::size_t e = 0; e < E; ++e) total += canonical[e].exceptions.size();
  if (total > std::numeric_limits<u32>::max()) too_many_exceptions(g, total);
  t.exceptions.reserve(total);
  for (u32 e = 0; e < E; ++e) {
    const CsfPlanes& p = canonical[e];
    if (L.nv()) {
      for (u32 r = 0; r < R; ++r) {
        fx.set_base(e, r, p.fixed[L.base_at(r)]);
        const u8* codes = p.fixed.data() + L.codes_at(r);
        u8* slab = fx.slab(e, r);
        for (u32 j = 0; j < C / 2; ++j) slab[csf::nvfp4_code_pair_byte(r, j)] = codes[j];
      }
    } else {
      // Same 16-row slabs, same columns (MXFP4 pads no column): byte for byte.
      std::memcpy(fx.slab(e, 0), p.fixed.data(), p.fixed.size());
    }
    u32* counts = t.row_prefix.data() + std::size_t{e} * g.padded_rows + 1;
    for (const u32 rec : p.exceptions) {
      const u32 pos = csf::record_position(rec), r = pos / C, c = pos % C;
      t.exceptions.push_back(csf::make_record(csf::position(r, c, g.padded_cols), csf::record_value(rec)));
      ++counts[r];
    }
  }
  for (std::size_t i = 1; i < t.row_prefix.size(); ++i) t.row_prefix[i] += t.row_prefix[i - 1];
  finish_partition_index(t);
  return t;
}

std::vector<CsfPlanes> csf_to_planes(const CsfTensor& tensor, std::string_view name) {
  try {
    validate(tensor);
  } catch (const FormatError& err) {
    throw FormatError(fmt::format("{}: {}", name, err.what()));
  }
  const CsfGeometry& g = tensor.geometry;
  const PlaneShape s{g.shape.format, g.shape.rows, g.shape.cols};
  check_plane_shape(s, name);
  const csf::PlaneLayout L = plane_layout(s);
  const Fixed fx{g, const_cast<u8*>(tensor.fixed.data())};
  const u32 R = s.rows, C = s.cols;
  std::vector<CsfPlanes> out(g.shape.experts);
  for (u32 e = 0; e < g.shape.experts; ++e) {
    CsfPlanes& p = out[e];
    p.shape = s;
    p.fixed.assign(plane_fixed_bytes(s), 0);
    if (L.nv()) {
      for (u32 r = 0; r < R; ++r) {
        p.fixed[L.base_at(r)] = fx.base(e, r);
        const u8* slab = fx.slab(e, r);
        u8* codes = p.fixed.data() + L.codes_at(r);
        for (u32 j = 0; j < C / 2; ++j) codes[j] = slab[csf::nvfp4_code_pair_byte(r, j)];
      }
    } else {
      std::memcpy(p.fixed.data(), fx.slab(e, 0), p.fixed.size());
    }
    const u32 first = tensor.row_prefix[std::size_t{e} * g.padded_rows];
    const u32 last = tensor.row_prefix[std::size_t{e + 1} * g.padded_rows];
    p.exceptions.reserve(last - first);
    for (u32 i = first; i < last; ++i) {
      const u32 rec = tensor.exceptions[i];
      const u32 pos = csf::record_position(rec);
      const u32 r = csf::position_row(pos, g.padded_cols), c = csf::position_col(pos, g.padded_cols);
      p.exceptions.push_back(csf::make_record(r * C + c, csf::record_value(rec)));
    }
  }
  return out;
}

std::string b12x_fixed_name(std::string_view scale, ScaleFormat format) {
  return std::string(scale) + (format == ScaleFormat::nvfp4 ? ".nvfp4_csf_fixed" : ".mxfp4_csf_fixed");
}
std::string b12x_exceptions_name(std::string_view scale, ScaleFormat format) {
  return std::string(scale) +
         (format == ScaleFormat::nvfp4 ? ".nvfp4_csf_exceptions" : ".mxfp4_csf_exceptions");
}

}  // namespace csfmoe
