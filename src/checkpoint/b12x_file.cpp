// The b12x view of a plain safetensors file (checkpoint/b12x_file.hpp).
#include "checkpoint/b12x_file.hpp"

#include <fmt/format.h>

#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>
#include <tuple>

#include "checkpoint/detect.hpp"
#include "checkpoint/json_error.hpp"
#include "csfmoe/b12x_planes.hpp"
#include "csfmoe/errors.hpp"

namespace csfmoe::detail {

namespace {

struct PlaneName {
  std::string scale;  // the scale tensor the plane stands for
  ScaleFormat format = ScaleFormat::nvfp4;
  bool fixed = true;  // else the exceptions plane
};

std::optional<PlaneName> plane_name(std::string_view n) {
  for (ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4})
    for (bool fixed : {true, false}) {
      const std::string suffix = fixed ? b12x_fixed_name("", f) : b12x_exceptions_name("", f);
      if (n.size() > suffix.size() && n.ends_with(suffix))
        return PlaneName{std::string(n.substr(0, n.size() - suffix.size())), f, fixed};
    }
  return std::nullopt;
}

// The weight a scale belongs to: X.weight / X.weight_packed for a scale
// X.weight_scale, S.weight for a scale S.scale, S_blocks for S_scales; the
// first of them the file holds.
const st::TensorInfo* scale_weight(const st::File& f, const std::string& scale) {
  std::vector<std::string> candidates;
  if (scale.ends_with("_scale")) {
    const std::string stem = scale.substr(0, scale.size() - 6);
    candidates = {stem, stem + "_packed"};
  } else if (scale.ends_with(".scale")) {
    candidates = {scale.substr(0, scale.size() - 6) + ".weight"};
  } else if (scale.ends_with("_scales")) {
    candidates = {scale.substr(0, scale.size() - 7) + "_blocks"};
  }
  for (const auto& c : candidates)
    if (const st::TensorInfo* w = f.find(c)) return w;
  return nullptr;
}

// Rows and scale columns (K / 16 or K / 32) of one expert projection's
// packed FP4 weight: U8 / I8 [R, K / 2], I32 [R, K / 8] or blocks U8
// [R, K / 32, 16]; nullopt for any other shape.
std::optional<std::pair<std::uint64_t, std::uint64_t>> weight_grid(const st::TensorInfo& w,
                                                                   ScaleFormat fmt_) {
  const std::uint64_t g = group_size(fmt_);
  std::uint64_t k = 0;
  if (w.shape.size() == 3 && w.dtype == st::Dtype::U8 && w.shape[2] == 16)
    k = w.shape[1] * 32;  // blocks
  else if (w.shape.size() == 2 && w.dtype == st::Dtype::I32)
    k = w.shape[1] * 8;
  else if (w.shape.size() == 2 && st::dtype_size(w.dtype) == 1)
    k = w.shape[1] * 2;
  if (k == 0 || k % g || w.shape[0] == 0) return std::nullopt;
  return std::pair{w.shape[0], k / g};
}

}  // namespace

const CsfEntry* ForeignB12x::find(const std::string& name) const {
  for (const auto& e : csf)
    if (e.name == name) return &e;
  return nullptr;
}

std::optional<ForeignB12x> foreign_b12x(const st::File& f, const std::string& label) {
  std::map<std::string, std::pair<const st::TensorInfo*, const st::TensorInfo*>>
      pairs;  // scale -> (fixed, exc)
  std::map<std::string, ScaleFormat> formats;
  for (const auto& t : f.tensors()) {
    const auto p = plane_name(t.name);
    if (!p) continue;
    // Read as if the scale were there, it would be a tensor named like the
    // header's metadata entry: no valid file can hold it.
    if (p->scale == "__metadata__")
      throw FormatError(fmt::format(
          "{}: tensor '{}': planes of a scale named '__metadata__', the name safetensors keeps for its "
          "metadata",
          label, t.name));
    auto [it, fresh] = formats.emplace(p->scale, p->format);
    if (!fresh && it->second != p->format)
      throw FormatError(fmt::format("{}: tensor '{}': planes of both NVFP4 and MXFP4", label, p->scale));
    (p->fixed ? pairs[p->scale].first : pairs[p->scale].second) = &t;
  }
  if (pairs.empty()) return std::nullopt;

  ForeignB12x v;
  v.logical.metadata = f.header().metadata;
  std::map<std::string, CsfEntry> entries;
  for (const auto& [scale, planes] : pairs) {
    const auto [fixed, exc] = planes;
    const ScaleFormat fmt_ = formats.at(scale);
    const std::string what = fmt::format("{}: tensor '{}'", label, scale);
    if (!fixed || !exc)
      throw FormatError(
          fmt::format("{}: '{}' without '{}'", what, fixed ? fixed->name : exc->name,
                      fixed ? b12x_exceptions_name(scale, fmt_) : b12x_fixed_name(scale, fmt_)));
    if (f.find(scale))
      throw FormatError(fmt::format("{}: present beside its b12x planes; which one holds the scales?", what));
    // The fixed plane is U8 [rows / 16, slab bytes], or flat U8 [n]: b12x's
    // manifest readers reshape it by the weight's geometry (the published
    // DeepSeek-V4.1 CSF export is reported to store it so).
    const bool flat = fixed->shape.size() == 1;
    if (fixed->dtype != st::Dtype::U8 ||
        (!flat && (fixed->shape.size() != 2 || fixed->shape[0] == 0 || fixed->shape[1] < 32 ||
                   fixed->shape[1] % plane_slab_rows)) ||
        (flat && fixed->shape[0] == 0))
      throw FormatError(fmt::format(
          "{}: fixed plane '{}' must be U8 [rows / 16, 16 * (1 + code bytes)] (or flat U8 [n]), got {} {}",
          what, fixed->name, st::to_string(fixed->dtype), shape_str(fixed->shape)));
    if (exc->dtype != st::Dtype::U32 || exc->shape.size() != 1)
      throw FormatError(fmt::format("{}: exceptions plane '{}' must be U32 [n], got {} {}", what, exc->name,
                                    st::to_string(exc->dtype), shape_str(exc->shape)));
    // The weight gives the grid: rows and K / 16 (NVFP4) or K / 32 (MXFP4)
    // columns. A plane whose slabs or columns contradict it is refused, as
    // b12x's layer readers refuse it.
    const st::TensorInfo* weight = scale_weight(f, scale);
    const auto wgrid = weight ? weight_grid(*weight, fmt_) : std::nullopt;
    const auto weight_str = [&] {
      return fmt::format("its weight '{}' is {} {}", weight->name, st::to_string(weight->dtype),
                         shape_str(weight->shape));
    };
    if (weight && !wgrid)
      throw FormatError(fmt::format("{}: {}, not a packed FP4 weight of whole {}-element blocks", what,
                                    weight_str(), group_size(fmt_)));
    std::uint64_t rows = 0, cols = 0;
    if (wgrid) {
      std::tie(rows, cols) = *wgrid;
      if (rows % plane_slab_rows || (fmt_ == ScaleFormat::nvfp4 && cols % 2) || rows > UINT32_MAX ||
          cols > UINT32_MAX)
        throw FormatError(fmt::format(
            "{}: {}: a grid of {} x {} scales, which b12x's planes cannot hold (rows a multiple of 16, "
            "NVFP4 columns even)",
            what, weight_str(), rows, cols));
      const std::uint64_t slab = plane_slab_bytes(fmt_, static_cast<std::uint32_t>(cols));
      const std::uint64_t slabs = rows / plane_slab_rows;
      const bool match =
          flat ? fixed->shape[0] == slabs * slab : fixed->shape[0] == slabs && fixed->shape[1] == slab;
      if (!match)
        throw FormatError(fmt::format(
            "{}: fixed plane '{}' {} does not fit {} (a {} x {} scale grid: {} slabs of {} bytes)", what,
            fixed->name, shape_str(fixed->shape), weight_str(), rows, cols, slabs, slab));
    } else if (flat) {
      throw FormatError(
          fmt::format("{}: flat fixed plane '{}' {} needs its weight's shape to be read, which the file does "
                      "not hold",
                      what, fixed->name, shape_str(fixed->shape)));
    } else if (fmt_ == ScaleFormat::nvfp4) {
      rows = fixed->shape[0] * plane_slab_rows;
      cols = csf::nvfp4_plane_cols(fixed->shape[1]);
    } else {
      throw FormatError(
          fmt::format("{}: the MXFP4 columns of '{}' need its weight (X.weight, X.weight_packed, S.weight "
                      "or S_blocks), which the file does not hold",
                      what, fixed->name));
    }
    if (rows > UINT32_MAX || cols > UINT32_MAX)
      throw FormatError(fmt::format("{}: a {} x {} grid is too large", what, rows, cols));
    CsfEntry e;
    e.name = scale;
    // The scale's dtype in the source: E4M3 for NVFP4; DeepSeek-V4.1 (S.scale)
    // ships its MXFP4 scales as F8_E8M0, the other namings as U8.
    e.dtype = fmt_ == ScaleFormat::nvfp4  ? st::Dtype::F8_E4M3
              : scale.ends_with(".scale") ? st::Dtype::F8_E8M0
                                          : st::Dtype::U8;
    e.shape = {rows, cols};
    e.grid = GridShape{fmt_, ScaleLayout::row_major, 1, static_cast<std::uint32_t>(rows),
                       static_cast<std::uint32_t>(cols)};
    e.exceptions = exc->shape[0];
    e.layer = moe_layer_key(scale);
    e.storage = CsfStorage::b12x;
    entries.emplace(fixed->name, std::move(e));
  }
  // The file's tensors in header order, each fixed plane standing for its
  // scale (same place, the scale's byte count), exceptions planes left out.
  for (const auto& t : f.header().tensors) {
    if (auto it = entries.find(t.name); it != entries.end()) {
      st::TensorInfo s;
      s.name = it->second.name;
      s.dtype = it->second.dtype;
      s.shape = it->second.shape;
      s.begin = t.begin;
      s.end = t.begin + it->second.shape[0] * it->second.shape[1];
      v.logical.tensors.push_back(std::move(s));
      v.csf.push_back(it->second);
    } else if (const auto p = plane_name(t.name); !p) {
      v.logical.tensors.push_back(t);
    }
  }
  return v;
}

namespace {

// `name` in `folder`, opened only where it resolves inside the folder.
nlohmann::json read_json(const std::filesystem::path& folder, const char* name) {
  const std::filesystem::path p = folder / name;
  std::error_code ec;
  if (!std::filesystem::exists(std::filesystem::symlink_status(p, ec)))
    throw FormatError(
        fmt::format("{}: missing (b12x's export needs manifest.json and build-contract.json)", p.string()));
  st::resolve_under(folder, name, p.string());
  std::string text;
  {
    std::FILE* f = std::fopen(p.c_str(), "rb");
    if (!f) throw IoError(fmt::format("{}: cannot open", p.string()));
    char buf[65536];
    std::size_t n = 0;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) {
      text.append(buf, n);
      if (text.size() > (std::size_t{64} << 20)) {
        std::fclose(f);
        throw FormatError(fmt::format("{}: larger than 64 MiB", p.string()));
      }
    }
    std::fclose(f);
  }
  try {
    auto j = nlohmann::json::parse(text);
    if (!j.is_object()) throw FormatError(fmt::format("{}: not a JSON object", p.string()));
    return j;
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(fmt::format("{}: {}", p.string(), json_error_text(e)));
  }
}

std::string string_field(const nlohmann::json& j, const char* key, const std::filesystem::path& p) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_string())
    throw FormatError(fmt::format("{}: '{}' must be a string", p.string(), key));
  return it->get<std::string>();
}

}  // namespace

std::optional<ManifestExport> read_manifest_export(const std::filesystem::path& folder) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path mpath = folder / kManifestFile, cpath = folder / kBuildContractFile;
  const bool has_m = fs::exists(fs::symlink_status(mpath, ec)),
             has_c = fs::exists(fs::symlink_status(cpath, ec));
  if (!has_m && !has_c) return std::nullopt;
  const nlohmann::json m = read_json(folder, kManifestFile), c = read_json(folder, kBuildContractFile);
  ManifestExport x;
  x.schema = string_field(m, "schema", mpath);
  x.codec = string_field(m, "codec", mpath);
  const std::map<std::string, std::pair<ScaleFormat, std::string>> schemas = {
      {"lil-nvfp4-csf-checkpoint/1", {ScaleFormat::nvfp4, "byte-window4-fixed-stream-u24-exceptions/1"}},
      {"lil-mxfp4-csf-checkpoint/1", {ScaleFormat::mxfp4, "row-base-offset1-u24-exceptions/1"}}};
  const auto known = schemas.find(x.schema);
  if (known == schemas.end())
    throw FormatError(
        fmt::format("{}: schema '{}' is not lil-nvfp4-csf-checkpoint/1 or lil-mxfp4-csf-checkpoint/1",
                    mpath.string(), x.schema));
  x.format = known->second.first;
  if (x.codec != known->second.second)
    throw FormatError(fmt::format("{}: codec '{}' is not the codec of {} ('{}')", mpath.string(), x.codec,
                                  x.schema, known->second.second));
  if (string_field(c, "schema", cpath) != x.schema || string_field(c, "codec", cpath) != x.codec)
    throw FormatError(fmt::format("{}: schema / codec differ from {}", cpath.string(), mpath.string()));
  if (m.contains("family") != c.contains("family") ||
      (m.contains("family") && string_field(m, "family", mpath) != string_field(c, "family", cpath)))
    throw FormatError(fmt::format("{}: family differs from {}", cpath.string(), mpath.string()));
  const auto shards = m.find("shards");
  if (shards == m.end() || !shards->is_array() || shards->empty())
    throw FormatError(
        fmt::format("{}: 'shards' must be a non-empty array of {{\"file\": name}}", mpath.string()));
  std::set<std::string> files;
  for (std::size_t i = 0; i < shards->size(); ++i) {
    const auto& s = (*shards)[i];
    const auto f = s.is_object() ? s.find("file") : s.end();
    if (!s.is_object() || f == s.end() || !f->is_string())
      throw FormatError(fmt::format("{}: shards[{}] must be {{\"file\": name}}", mpath.string(), i));
    const std::string name = f->get<std::string>();
    if (!name.ends_with(".safetensors") || !files.insert(name).second)
      throw FormatError(
          fmt::format("{}: shards[{}] '{}' is not a new .safetensors name", mpath.string(), i, name));
    const std::string what = fmt::format("{}: shards[{}]", mpath.string(), i);
    st::resolve_inside(folder / "tensors", name, what);                      // a plain name
    x.shards.push_back(st::resolve_under(folder, "tensors/" + name, what));  // tensors/ itself inside too
  }
  const auto names = c.find("source_names");
  if (names == c.end() || !names->is_object())
    throw FormatError(fmt::format("{}: 'source_names' must map tensor names to shard files", cpath.string()));
  std::set<std::string> used;
  for (auto it = names->begin(); it != names->end(); ++it) {
    if (!it->is_string())
      throw FormatError(
          fmt::format("{}: source_names['{}'] must be a shard file name", cpath.string(), it.key()));
    const std::string shard = it->get<std::string>();
    if (!files.count(shard))
      throw FormatError(fmt::format("{}: source_names['{}'] names shard '{}', which {} does not list",
                                    cpath.string(), it.key(), shard, mpath.string()));
    used.insert(shard);
    // Some exports (b12x's test helpers) list the stored plane names: the
    // source tensor is the scale they stand for, in the shard they name.
    const auto p = plane_name(it.key());
    const std::string source = p ? p->scale : it.key();
    if (auto [at, fresh] = x.source_names.emplace(source, shard); !fresh && at->second != shard)
      throw FormatError(fmt::format("{}: source_names['{}'] names shard '{}', but '{}' is in '{}'",
                                    cpath.string(), it.key(), shard, source, at->second));
  }
  for (const auto& f : files)
    if (!used.count(f))
      throw FormatError(
          fmt::format("{}: shard '{}' holds none of the contract's source tensors", mpath.string(), f));
  // The shards must hold the planes the schema names, and each tensor once
  // (as Python's reader requires): a reader would otherwise take planes of
  // the other format, or pick one of two copies.
  std::map<std::string, std::string> where;
  for (const auto& path : x.shards) {
    const st::File shard = st::File::open(path);
    for (const auto& t : shard.tensors()) {
      const auto p = plane_name(t.name);
      if (p && p->format != x.format)
        throw FormatError(fmt::format("{}: tensor '{}': {} planes, but {} says {} ({})", path.string(),
                                      t.name, to_string(p->format), mpath.string(), x.schema,
                                      to_string(x.format)));
      if (p && !p->fixed) continue;
      const std::string logical = p ? p->scale : t.name;
      if (auto [it, fresh] = where.emplace(logical, path.filename().string()); !fresh)
        throw FormatError(fmt::format("{}: tensor '{}' is also in {}", path.string(), logical, it->second));
    }
  }
  return x;
}

}  // namespace csfmoe::detail
