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

// --- the parts: name, dtype, shape rule and header-bound count each ---------

using Shape = std::vector<std::uint64_t>;

std::uint64_t positions(const CsfGeometry& g) {
  return std::uint64_t{g.shape.experts} * g.shape.rows * g.shape.cols;
}
std::uint64_t fixed_bytes(const CsfGeometry& g) { return g.fixed_bytes(); }
std::uint64_t experts(const CsfGeometry& g) { return g.shape.experts; }
std::uint64_t row_prefix_entries(const CsfGeometry& g) { return g.total_rows() + 1; }
std::uint64_t partition_index_entries(const CsfGeometry& g) {
  return std::uint64_t{g.partitions_per_expert} * g.shape.experts + 1;
}
// Each expert's 16-row slabs of `slab` bytes, one row each.
Shape slab_rows(const CsfGeometry& g, std::uint64_t slab) {
  return {std::uint64_t{g.shape.experts} * (g.shape.rows / plane_slab_rows), slab};
}
Shape plane_shape(const CsfGeometry& g, const PartCounts&) {
  return slab_rows(g, plane_slab_bytes(g.shape.format, g.shape.cols));
}
Shape records_shape(const CsfGeometry&, const PartCounts& c) { return {c.records}; }
Shape experts_shape(const CsfGeometry& g, const PartCounts&) { return {experts(g)}; }

// The resident form's fixed slabs (padded), row prefix and partition index.
constexpr CsfPart kFixed{[](const std::string& t, ScaleFormat) { return part_names(t).fixed; }, st::Dtype::U8,
                         [](const CsfGeometry& g, const PartCounts&) { return Shape{g.fixed_bytes()}; },
                         false, fixed_bytes};
constexpr CsfPart kRowPrefix{
    [](const std::string& t, ScaleFormat) { return part_names(t).row_prefix; }, st::Dtype::U32,
    [](const CsfGeometry& g, const PartCounts&) { return Shape{row_prefix_entries(g)}; }, false,
    row_prefix_entries};
constexpr CsfPart kPartitionIndex{
    [](const std::string& t, ScaleFormat) { return part_names(t).partition_index; }, st::Dtype::U32,
    [](const CsfGeometry& g, const PartCounts&) { return Shape{partition_index_entries(g)}; }, false,
    partition_index_entries};
// The exception records (every storage but b12x's, which names them its own
// way): at most one per position.
constexpr CsfPart kExceptions{[](const std::string& t, ScaleFormat) { return part_names(t).exceptions; },
                              st::Dtype::U32, records_shape, false, positions};
// The records of each expert (planes and MXFP4 slabs).
constexpr CsfPart kExpertExceptions{
    [](const std::string& t, ScaleFormat) { return part_names(t).expert_exceptions; }, st::Dtype::U32,
    experts_shape, false, experts};
// b12x's canonical planes: per expert its 16-row slabs of bases and codes,
// never more bytes than the resident fixed slabs.
constexpr CsfPart kPlanes{[](const std::string& t, ScaleFormat) { return part_names(t).planes; },
                          st::Dtype::U8, plane_shape, false, fixed_bytes};
// The same planes and records under b12x / vLLM's names; the planes may be flat.
constexpr CsfPart kB12xFixed{[](const std::string& t, ScaleFormat f) { return b12x_fixed_name(t, f); },
                             st::Dtype::U8, plane_shape, true, fixed_bytes};
constexpr CsfPart kB12xExceptions{
    [](const std::string& t, ScaleFormat f) { return b12x_exceptions_name(t, f); }, st::Dtype::U32,
    records_shape, false, positions};
// MXFP4 planes in slab form and the bases of their escaped rows, neither
// more bytes than the resident fixed slabs.
constexpr CsfPart kSlabs{
    [](const std::string& t, ScaleFormat) { return part_names(t).slabs; }, st::Dtype::U8,
    [](const CsfGeometry& g, const PartCounts&) { return slab_rows(g, mxfp4_slab_bytes(g.shape.cols)); },
    false, fixed_bytes};
constexpr CsfPart kSlabEscapes{
    [](const std::string& t, ScaleFormat) { return part_names(t).slab_escapes; }, st::Dtype::U8,
    [](const CsfGeometry&, const PartCounts& c) { return Shape{c.escapes}; }, false, fixed_bytes};

// Each storage's parts, in file order.
constexpr const CsfPart* kResidentParts[] = {&kFixed, &kExceptions, &kRowPrefix, &kPartitionIndex};
constexpr const CsfPart* kPlanesParts[] = {&kPlanes, &kExceptions, &kExpertExceptions};
constexpr const CsfPart* kB12xParts[] = {&kB12xFixed, &kB12xExceptions};
constexpr const CsfPart* kMxfp4SlabParts[] = {&kSlabs, &kSlabEscapes, &kExceptions, &kExpertExceptions};

// --- resident: the resident form as is -------------------------------------

void write_resident(st::Writer& w, const std::string& tensor, const CsfForms& forms) {
  write_csf_parts(w, tensor, *forms.resident);
}
std::uint64_t resident_bytes(const CsfForms& forms) { return forms.resident->encoded_bytes(); }

// The resident parts as they are, validated.
CsfTensor load_resident(const CsfEntry& e, const CsfGeometry& g, const PartReader& get) {
  const std::string& what = get.what();
  const PartCounts counts{e.exceptions};
  CsfTensor t;
  t.geometry = g;
  auto fixed = get(kFixed, counts);
  auto exc = get(kExceptions, counts);
  auto rp = get(kRowPrefix, counts);
  auto pi = get(kPartitionIndex, counts);
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
  const bool b12x = storage.naming == CsfNaming::b12x;
  if (b12x && g.experts != 1)
    throw FormatError(
        fmt::format("{}: b12x planes hold one expert projection, the grid says {}", what, g.experts));
  const PartCounts part_counts{e.exceptions};
  const auto planes = get(b12x ? kB12xFixed : slab_form ? kSlabs : kPlanes, part_counts);
  const auto records = get(b12x ? kB12xExceptions : kExceptions, part_counts);
  std::vector<std::uint32_t> counts(g.experts, static_cast<std::uint32_t>(e.exceptions));
  if (!b12x) {
    const auto counts_raw = get(kExpertExceptions, part_counts);
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
    const auto escape_bytes = get(kSlabEscapes, {e.exceptions, escape_total});
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

void write_b12x(st::Writer& w, const std::string& tensor, const CsfForms& forms) {
  write_b12x_planes(w, tensor, forms.planes.front());
}
std::uint64_t b12x_bytes(const CsfForms& forms) {
  return planes_stored_bytes(forms.planes) - 4;  // no record count
}

// --- mxfp4_slab: MXFP4 planes in slab form ---------------------------------

void write_mxfp4_slab(st::Writer& w, const std::string& tensor, const CsfForms& forms) {
  write_csf_mxfp4_slabs(w, tensor, forms.mxfp4_slabs);
}
std::uint64_t mxfp4_slab_stored_bytes(const CsfForms& forms) {
  return mxfp4_slabs_stored_bytes(forms.mxfp4_slabs);
}

// --- the table -------------------------------------------------------------

constexpr std::array<CsfStorageSpec, 4> kStorages{{
    {CsfStorage::resident, "resident", 0, CsfPayload::resident, CsfNaming::container, kResidentParts,
     CsfStorage::resident, write_resident, resident_bytes, load_resident},
    {CsfStorage::planes, "planes", 2, CsfPayload::planes, CsfNaming::container, kPlanesParts,
     CsfStorage::planes, write_planes, planes_bytes, load_planes},
    {CsfStorage::b12x, "b12x", 2, CsfPayload::planes, CsfNaming::b12x, kB12xParts, CsfStorage::planes,
     write_b12x, b12x_bytes, load_planes},
    {CsfStorage::mxfp4_slab, "mxfp4_slab", 3, CsfPayload::mxfp4_slab, CsfNaming::container, kMxfp4SlabParts,
     CsfStorage::mxfp4_slab, write_mxfp4_slab, mxfp4_slab_stored_bytes, load_planes},
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
  std::vector<std::string> names;
  for (const CsfPart* part : storage_spec(storage).parts) names.push_back(part->name(tensor, format));
  return names;
}

std::span<const std::uint8_t> PartReader::operator()(const CsfPart& part, const PartCounts& counts) const {
  const std::string& what = what_;
  const st::File& c = file_;
  const std::string n = part.name(entry_.name, entry_.grid.format);
  const st::Dtype d = part.dtype;
  const std::vector<std::uint64_t> shape = part.shape(geometry_, counts);
  const bool flat_ok = part.flat_ok;
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

namespace {

// A part tensor as the writers store it: its name and dtype from its
// descriptor, its shape that of the data written (the loaders' shape rules
// check it on the way back).
void add_part(st::Writer& w, const CsfPart& part, const std::string& tensor, ScaleFormat format,
              std::vector<std::uint64_t> shape, std::span<const std::uint8_t> bytes) {
  w.add_tensor(part.name(tensor, format), part.dtype, std::move(shape), bytes);
}
void begin_part(st::Writer& w, const CsfPart& part, const std::string& tensor, ScaleFormat format,
                std::vector<std::uint64_t> shape) {
  w.begin_tensor(part.name(tensor, format), part.dtype, std::move(shape));
}

}  // namespace

void write_csf_parts(st::Writer& w, const std::string& name, const CsfTensor& t) {
  const ScaleFormat f = t.geometry.shape.format;
  add_part(w, kFixed, name, f, {t.fixed.size()}, t.fixed);
  add_part(w, kExceptions, name, f, {t.exceptions.size()}, as_bytes(t.exceptions));
  add_part(w, kRowPrefix, name, f, {t.row_prefix.size()}, as_bytes(t.row_prefix));
  add_part(w, kPartitionIndex, name, f, {t.partition_index.size()}, as_bytes(t.partition_index));
}

void write_csf_planes(st::Writer& w, const std::string& name, std::span<const CsfPlanes> experts) {
  const PlaneShape s = experts.empty() ? PlaneShape{} : experts.front().shape;
  const std::uint64_t slab = plane_slab_bytes(s.format, s.cols);
  begin_part(w, kPlanes, name, s.format, {experts.size() * (s.rows / plane_slab_rows), slab});
  for (const auto& e : experts) w.write(e.fixed);
  w.end_tensor();
  std::vector<std::uint32_t> counts;
  std::uint64_t records = 0;
  for (const auto& e : experts) {
    counts.push_back(static_cast<std::uint32_t>(e.exceptions.size()));
    records += e.exceptions.size();
  }
  begin_part(w, kExceptions, name, s.format, {records});
  for (const auto& e : experts) w.write(as_bytes(e.exceptions));
  w.end_tensor();
  add_part(w, kExpertExceptions, name, s.format, {counts.size()}, as_bytes(counts));
}

std::uint64_t planes_stored_bytes(std::span<const CsfPlanes> experts) {
  std::uint64_t n = 0;
  for (const auto& e : experts) n += e.fixed.size() + 4 * e.exceptions.size() + 4;
  return n;
}

void write_csf_mxfp4_slabs(st::Writer& w, const std::string& name, std::span<const Mxfp4SlabPlanes> experts) {
  const PlaneShape s = experts.empty() ? PlaneShape{ScaleFormat::mxfp4, 0, 0} : experts.front().shape;
  begin_part(w, kSlabs, name, s.format,
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
  begin_part(w, kSlabEscapes, name, s.format, {escapes});
  for (const auto& e : experts) w.write(e.escapes);
  w.end_tensor();
  begin_part(w, kExceptions, name, s.format, {records});
  for (const auto& e : experts) w.write(as_bytes(e.exceptions));
  w.end_tensor();
  add_part(w, kExpertExceptions, name, s.format, {counts.size()}, as_bytes(counts));
}

void write_b12x_planes(st::Writer& w, const std::string& name, const CsfPlanes& planes) {
  const PlaneShape& s = planes.shape;
  add_part(w, kB12xFixed, name, s.format, {s.rows / plane_slab_rows, plane_slab_bytes(s.format, s.cols)},
           planes.fixed);
  add_part(w, kB12xExceptions, name, s.format, {planes.exceptions.size()}, as_bytes(planes.exceptions));
}

}  // namespace csfmoe::detail
