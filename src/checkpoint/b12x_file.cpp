// The b12x view of a plain safetensors file (checkpoint/b12x_file.hpp).
#include "checkpoint/b12x_file.hpp"

#include <fmt/format.h>

#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>

#include "checkpoint/detect.hpp"
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

// MXFP4 columns from the scale's weight: X.weight / X.weight_packed for a
// scale X.weight_scale, S.weight for a scale S.scale, S_blocks for S_scales.
std::optional<std::uint64_t> mxfp4_cols(const st::File& f, const std::string& scale, std::uint64_t rows) {
  std::vector<std::string> candidates;
  if (scale.ends_with("_scale")) {
    const std::string stem = scale.substr(0, scale.size() - 6);
    candidates = {stem, stem + "_packed"};
  } else if (scale.ends_with(".scale")) {
    candidates = {scale.substr(0, scale.size() - 6) + ".weight"};
  } else if (scale.ends_with("_scales")) {
    candidates = {scale.substr(0, scale.size() - 7) + "_blocks"};
  }
  for (const auto& c : candidates) {
    const st::TensorInfo* w = f.find(c);
    if (!w || w->shape.empty() || w->shape[0] != rows) continue;
    if (w->shape.size() == 3 && w->dtype == st::Dtype::U8 && w->shape[2] == 16) return w->shape[1];  // blocks
    if (w->shape.size() != 2) continue;
    // Packed FP4: two elements a byte (U8 / I8), eight an I32; 32 per scale.
    const std::uint64_t per = w->dtype == st::Dtype::I32 ? 8 : st::dtype_size(w->dtype) == 1 ? 2 : 0;
    if (per && (w->shape[1] * per) % 32 == 0) return w->shape[1] * per / 32;
  }
  return std::nullopt;
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
    if (fixed->dtype != st::Dtype::U8 || fixed->shape.size() != 2 || fixed->shape[0] == 0 ||
        fixed->shape[1] < 32 || fixed->shape[1] % plane_slab_rows)
      throw FormatError(
          fmt::format("{}: fixed plane '{}' must be U8 [rows / 16, 16 * (1 + code bytes)], got {} {}", what,
                      fixed->name, st::to_string(fixed->dtype), shape_str(fixed->shape)));
    if (exc->dtype != st::Dtype::U32 || exc->shape.size() != 1)
      throw FormatError(fmt::format("{}: exceptions plane '{}' must be U32 [n], got {} {}", what, exc->name,
                                    st::to_string(exc->dtype), shape_str(exc->shape)));
    const std::uint64_t rows = fixed->shape[0] * plane_slab_rows, code_bytes = fixed->shape[1] / 16 - 1;
    std::uint64_t cols = 0;
    if (fmt_ == ScaleFormat::nvfp4) {
      cols = 2 * code_bytes;
    } else {
      const auto c = mxfp4_cols(f, scale, rows);
      if (!c)
        throw FormatError(
            fmt::format("{}: the MXFP4 columns of '{}' need its weight (a companion tensor with "
                        "{} rows), which the file does not hold",
                        what, fixed->name, rows));
      cols = *c;
      if (cols == 0 || (cols + 7) / 8 != code_bytes)
        throw FormatError(fmt::format("{}: '{}' has {} selector bytes per row; its weight gives {} columns",
                                      what, fixed->name, code_bytes, cols));
    }
    if (rows > UINT32_MAX || cols > UINT32_MAX)
      throw FormatError(fmt::format("{}: a {} x {} grid is too large", what, rows, cols));
    CsfEntry e;
    e.name = scale;
    e.dtype = fmt_ == ScaleFormat::nvfp4 ? st::Dtype::F8_E4M3 : st::Dtype::U8;
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

nlohmann::json read_json(const std::filesystem::path& p) {
  std::error_code ec;
  const auto st = std::filesystem::status(p, ec);
  if (!std::filesystem::exists(st))
    throw FormatError(
        fmt::format("{}: missing (b12x's export needs manifest.json and build-contract.json)", p.string()));
  if (!std::filesystem::is_regular_file(st))
    throw FormatError(
        fmt::format("{}: not a regular file (b12x's export needs manifest.json and "
                    "build-contract.json as plain JSON files)",
                    p.string()));
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
    throw FormatError(fmt::format("{}: not valid JSON: {}", p.string(), e.what()));
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
  const nlohmann::json m = read_json(mpath), c = read_json(cpath);
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
    x.shards.push_back(
        st::resolve_inside(folder / "tensors", name, fmt::format("{}: shards[{}]", mpath.string(), i)));
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
    x.source_names[it.key()] = shard;
  }
  for (const auto& f : files)
    if (!used.count(f))
      throw FormatError(
          fmt::format("{}: shard '{}' holds none of the contract's source tensors", mpath.string(), f));
  return x;
}

}  // namespace csfmoe::detail
