// The CSF storages: the table (storage_table.hpp) and each storage's
// parts, writer, byte count and loader.
#include "checkpoint/storage_table.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <array>
#include <cstring>

#include "csfmoe/errors.hpp"

namespace csfmoe::detail {

namespace {

template <class T>
std::span<const std::uint8_t> as_bytes(const std::vector<T>& v) {
  return {reinterpret_cast<const std::uint8_t*>(v.data()), v.size() * sizeof(T)};
}

// --- resident: the resident form as is -------------------------------------

std::vector<std::string> resident_parts(const std::string& tensor, ScaleFormat) {
  const auto p = part_names(tensor);
  return {p.fixed, p.exceptions, p.row_prefix, p.partition_index};
}
void write_resident(st::Writer& w, const std::string& tensor, const CsfForms& forms) {
  write_csf_parts(w, tensor, *forms.resident);
}
std::uint64_t resident_bytes(const CsfForms& forms) { return forms.resident->encoded_bytes(); }

// The resident parts as they are, validated.
CsfTensor load_resident(const CsfEntry& e, const CsfGeometry& g, const PartReader& get) {
  const std::string& what = get.what();
  const auto p = part_names(e.name);
  CsfTensor t;
  t.geometry = g;
  auto fixed = get(p.fixed, st::Dtype::U8, {g.fixed_bytes()});
  auto exc = get(p.exceptions, st::Dtype::U32, {e.exceptions});
  auto rp = get(p.row_prefix, st::Dtype::U32, {g.total_rows() + 1});
  auto pi =
      get(p.partition_index, st::Dtype::U32, {std::uint64_t{g.partitions_per_expert} * g.shape.experts + 1});
  t.fixed.assign(fixed.begin(), fixed.end());
  auto load32 = [](std::span<const std::uint8_t> b, std::vector<std::uint32_t>& v) {
    v.resize(b.size() / 4);
    if (!b.empty()) std::memcpy(v.data(), b.data(), b.size());
  };
  load32(exc, t.exceptions);
  load32(rp, t.row_prefix);
  load32(pi, t.partition_index);
  try {
    validate(t);
  } catch (const FormatError& x) {
    throw FormatError(fmt::format("{}: invalid CSF parts: {}", what, x.what()));
  }
  return t;
}

// --- planes: b12x's planes per expert, with a record count each ------------

std::vector<std::string> planes_parts(const std::string& tensor, ScaleFormat) {
  const auto p = part_names(tensor);
  return {p.planes, p.exceptions, p.expert_exceptions};
}
void write_planes(st::Writer& w, const std::string& tensor, const CsfForms& forms) {
  write_csf_planes(w, tensor, forms.planes);
}
std::uint64_t planes_bytes(const CsfForms& forms) { return planes_stored_bytes(forms.planes); }

// The resident form from the plane parts of `e` (planes, b12x and mxfp4_slab:
// the same planes in slab form or under b12x's names), converted without
// re-encoding.
CsfTensor load_planes(const CsfEntry& e, const CsfGeometry&, const PartReader& get) {
  const std::string& what = get.what();
  const CsfStorageSpec& storage = storage_spec(e.storage);
  const GridShape& g = e.grid;
  if (!planes_storable(g))
    throw FormatError(fmt::format("{}: a {} grid of {} x {} cannot be stored as planes", what,
                                  to_string(g.layout), g.rows, g.cols));
  const PlaneShape shape{g.format, g.rows, g.cols};
  const bool slab_form = storage.payload == CsfPayload::mxfp4_slab;
  if (slab_form && g.format != ScaleFormat::mxfp4)
    throw FormatError(fmt::format("{}: the mxfp4_slab storage holds MXFP4 grids, the descriptor says {}",
                                  what, to_string(g.format)));
  const std::uint64_t slab = slab_form ? mxfp4_slab_bytes(g.cols) : plane_slab_bytes(g.format, g.cols);
  const std::uint64_t slabs = g.rows / plane_slab_rows;
  const auto p = part_names(e.name);
  const bool b12x = storage.naming == CsfNaming::b12x;
  if (b12x && g.experts != 1)
    throw FormatError(
        fmt::format("{}: b12x planes hold one expert projection, the grid says {}", what, g.experts));
  const auto planes = get(b12x        ? b12x_fixed_name(e.name, g.format)
                          : slab_form ? p.slabs
                                      : p.planes,
                          st::Dtype::U8, {std::uint64_t{g.experts} * slabs, slab}, /*flat_ok=*/b12x);
  const auto records =
      get(b12x ? b12x_exceptions_name(e.name, g.format) : p.exceptions, st::Dtype::U32, {e.exceptions});
  std::vector<std::uint32_t> counts(g.experts, static_cast<std::uint32_t>(e.exceptions));
  if (!b12x) {
    const auto counts_raw = get(p.expert_exceptions, st::Dtype::U32, {g.experts});
    if (!counts.empty()) std::memcpy(counts.data(), counts_raw.data(), counts_raw.size());
  }
  const auto records_raw = [&](std::uint64_t i) { return records.data() + 4 * i; };
  std::uint64_t total = 0;
  for (std::uint32_t c : counts) total += c;
  if (total != e.exceptions)
    throw FormatError(fmt::format("{}: the per-expert record counts add up to {}, the descriptor says {}",
                                  what, total, e.exceptions));
  std::vector<CsfPlanes> experts(g.experts);
  std::uint64_t at = 0;
  if (slab_form) {
    // Each expert's escaped rows take the next bases of the escape list.
    std::vector<std::uint64_t> escapes(g.experts);
    std::uint64_t escape_total = 0;
    for (std::uint32_t x = 0; x < g.experts; ++x) {
      escapes[x] = mxfp4_slab_escape_count(shape, planes.subspan(x * slabs * slab, slabs * slab),
                                           fmt::format("{} expert {}", what, x));
      escape_total += escapes[x];
    }
    const auto escape_bytes = get(p.slab_escapes, st::Dtype::U8, {escape_total});
    std::vector<std::uint32_t> expert_records;
    std::uint64_t escape_at = 0;
    for (std::uint32_t x = 0; x < g.experts; ++x) {
      expert_records.resize(counts[x]);
      if (counts[x]) std::memcpy(expert_records.data(), records_raw(at), 4 * std::uint64_t{counts[x]});
      at += counts[x];
      experts[x] = mxfp4_slabs_to_planes(shape, planes.subspan(x * slabs * slab, slabs * slab),
                                         escape_bytes.subspan(escape_at, escapes[x]), expert_records,
                                         fmt::format("{} expert {}", what, x));
      escape_at += escapes[x];
    }
  }
  for (std::uint32_t x = 0; x < g.experts && !slab_form; ++x) {
    CsfPlanes& pl = experts[x];
    pl.shape = shape;
    const auto fixed = planes.subspan(x * slabs * slab, slabs * slab);
    pl.fixed.assign(fixed.begin(), fixed.end());
    pl.exceptions.resize(counts[x]);
    if (counts[x]) std::memcpy(pl.exceptions.data(), records_raw(at), 4 * std::uint64_t{counts[x]});
    at += counts[x];
  }
  try {
    return planes_to_csf(experts, what);
  } catch (const InvalidArgument& x) {
    throw FormatError(fmt::format("{}: {}", what, x.what()));
  }
}

// --- b12x: one expert projection's planes under b12x / vLLM's names --------

std::vector<std::string> b12x_parts(const std::string& tensor, ScaleFormat format) {
  return {b12x_fixed_name(tensor, format), b12x_exceptions_name(tensor, format)};
}
void write_b12x(st::Writer& w, const std::string& tensor, const CsfForms& forms) {
  write_b12x_planes(w, tensor, forms.planes.front());
}
std::uint64_t b12x_bytes(const CsfForms& forms) {
  return planes_stored_bytes(forms.planes) - 4;  // no record count
}

// --- mxfp4_slab: MXFP4 planes in slab form ---------------------------------

std::vector<std::string> mxfp4_slab_parts(const std::string& tensor, ScaleFormat) {
  const auto p = part_names(tensor);
  return {p.slabs, p.slab_escapes, p.exceptions, p.expert_exceptions};
}
void write_mxfp4_slab(st::Writer& w, const std::string& tensor, const CsfForms& forms) {
  write_csf_mxfp4_slabs(w, tensor, forms.mxfp4_slabs);
}
std::uint64_t mxfp4_slab_stored_bytes(const CsfForms& forms) {
  return mxfp4_slabs_stored_bytes(forms.mxfp4_slabs);
}

// --- the table -------------------------------------------------------------

constexpr std::array<CsfStorageSpec, 4> kStorages{{
    {CsfStorage::resident, "resident", 0, CsfPayload::resident, CsfNaming::container, resident_parts,
     write_resident, resident_bytes, load_resident},
    {CsfStorage::planes, "planes", 2, CsfPayload::planes, CsfNaming::container, planes_parts, write_planes,
     planes_bytes, load_planes},
    {CsfStorage::b12x, "b12x", 2, CsfPayload::planes, CsfNaming::b12x, b12x_parts, write_b12x, b12x_bytes,
     load_planes},
    {CsfStorage::mxfp4_slab, "mxfp4_slab", 3, CsfPayload::mxfp4_slab, CsfNaming::container, mxfp4_slab_parts,
     write_mxfp4_slab, mxfp4_slab_stored_bytes, load_planes},
}};

constexpr bool in_enum_order() {
  for (std::size_t i = 0; i < kStorages.size(); ++i)
    if (static_cast<std::size_t>(kStorages[i].storage) != i) return false;
  return true;
}
static_assert(in_enum_order(), "kStorages is indexed by CsfStorage");

}  // namespace

std::span<const CsfStorageSpec> csf_storages() { return kStorages; }

const CsfStorageSpec& storage_spec(CsfStorage s) { return kStorages.at(static_cast<std::size_t>(s)); }

const CsfStorageSpec& storage_of(CsfPayload payload, CsfNaming naming) {
  for (const auto& s : kStorages)
    if (s.payload == payload && s.naming == naming) return s;
  throw InvalidArgument(
      fmt::format("no CSF storage holds payload {} under naming {}", int(payload), int(naming)));
}

const CsfStorageSpec* find_storage(std::string_view name) {
  for (const auto& s : kStorages)
    if (s.name == name) return &s;
  return nullptr;
}

std::string_view to_string(CsfStorage s) { return storage_spec(s).name; }

std::vector<std::string> stored_part_names(const std::string& tensor, CsfStorage storage,
                                           ScaleFormat format) {
  return storage_spec(storage).parts(tensor, format);
}

std::span<const std::uint8_t> PartReader::operator()(const std::string& n, st::Dtype d,
                                                     const std::vector<std::uint64_t>& shape,
                                                     bool flat_ok) const {
  const std::string& what = what_;
  const st::File& c = file_;
  const st::TensorInfo* ti = c.find(n);
  if (!ti) throw FormatError(fmt::format("{}: CSF part '{}' is missing", what, n));
  if (ti->dtype != d)
    throw FormatError(fmt::format("{}: CSF part '{}' must be {}, got {}", what, n, st::to_string(d),
                                  st::to_string(ti->dtype)));
  const bool flat_match =
      flat_ok && shape.size() == 2 && ti->shape.size() == 1 && ti->shape[0] == shape[0] * shape[1];
  if (ti->shape != shape && !flat_match)
    throw FormatError(fmt::format("{}: CSF part '{}' has shape [{}], expected [{}]", what, n,
                                  fmt::join(ti->shape, ", "), fmt::join(shape, ", ")));
  return c.data(*ti);
}

void write_csf_parts(st::Writer& w, const std::string& name, const CsfTensor& t) {
  const auto p = part_names(name);
  w.add_tensor(p.fixed, st::Dtype::U8, {t.fixed.size()}, t.fixed);
  w.add_tensor(p.exceptions, st::Dtype::U32, {t.exceptions.size()}, as_bytes(t.exceptions));
  w.add_tensor(p.row_prefix, st::Dtype::U32, {t.row_prefix.size()}, as_bytes(t.row_prefix));
  w.add_tensor(p.partition_index, st::Dtype::U32, {t.partition_index.size()}, as_bytes(t.partition_index));
}

void write_csf_planes(st::Writer& w, const std::string& name, std::span<const CsfPlanes> experts) {
  const auto p = part_names(name);
  const PlaneShape s = experts.empty() ? PlaneShape{} : experts.front().shape;
  const std::uint64_t slab = plane_slab_bytes(s.format, s.cols);
  w.begin_tensor(p.planes, st::Dtype::U8, {experts.size() * (s.rows / plane_slab_rows), slab});
  for (const auto& e : experts) w.write(e.fixed);
  w.end_tensor();
  std::vector<std::uint32_t> counts;
  std::uint64_t records = 0;
  for (const auto& e : experts) {
    counts.push_back(static_cast<std::uint32_t>(e.exceptions.size()));
    records += e.exceptions.size();
  }
  w.begin_tensor(p.exceptions, st::Dtype::U32, {records});
  for (const auto& e : experts) w.write(as_bytes(e.exceptions));
  w.end_tensor();
  w.add_tensor(p.expert_exceptions, st::Dtype::U32, {counts.size()}, as_bytes(counts));
}

std::uint64_t planes_stored_bytes(std::span<const CsfPlanes> experts) {
  std::uint64_t n = 0;
  for (const auto& e : experts) n += e.fixed.size() + 4 * e.exceptions.size() + 4;
  return n;
}

void write_csf_mxfp4_slabs(st::Writer& w, const std::string& name, std::span<const Mxfp4SlabPlanes> experts) {
  const auto p = part_names(name);
  const PlaneShape s = experts.empty() ? PlaneShape{ScaleFormat::mxfp4, 0, 0} : experts.front().shape;
  w.begin_tensor(p.slabs, st::Dtype::U8,
                 {experts.size() * (s.rows / plane_slab_rows), mxfp4_slab_bytes(s.cols)});
  for (const auto& e : experts) w.write(e.slabs);
  w.end_tensor();
  std::uint64_t escapes = 0, records = 0;
  std::vector<std::uint32_t> counts;
  for (const auto& e : experts) {
    escapes += e.escapes.size();
    records += e.exceptions.size();
    counts.push_back(static_cast<std::uint32_t>(e.exceptions.size()));
  }
  w.begin_tensor(p.slab_escapes, st::Dtype::U8, {escapes});
  for (const auto& e : experts) w.write(e.escapes);
  w.end_tensor();
  w.begin_tensor(p.exceptions, st::Dtype::U32, {records});
  for (const auto& e : experts) w.write(as_bytes(e.exceptions));
  w.end_tensor();
  w.add_tensor(p.expert_exceptions, st::Dtype::U32, {counts.size()}, as_bytes(counts));
}

void write_b12x_planes(st::Writer& w, const std::string& name, const CsfPlanes& planes) {
  const PlaneShape& s = planes.shape;
  w.add_tensor(b12x_fixed_name(name, s.format), st::Dtype::U8,
               {s.rows / plane_slab_rows, plane_slab_bytes(s.format, s.cols)}, planes.fixed);
  w.add_tensor(b12x_exceptions_name(name, s.format), st::Dtype::U32, {planes.exceptions.size()},
               as_bytes(planes.exceptions));
}

}  // namespace csfmoe::detail
