// Human-readable table and JSON of a CheckpointReport.
#include <fmt/core.h>

#include <algorithm>
#include <map>
#include <optional>
#include <set>

#include "cli.hpp"
#include "csfmoe/memory.hpp"

namespace csfmoe::cli {

namespace {

std::uint64_t dtype_size(const std::string& dtype) {
  static const std::map<std::string, std::uint64_t> sizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"F8_E8M0", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},     {"U32", 4},
      {"F32", 4},  {"I64", 8}, {"U64", 8}, {"F64", 8}};
  const auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

bool is_scale(const TensorReport& t) { return t.action != TensorAction::passthrough; }

// Sums of the block-scale tensors of one group (an MoE layer, or everything).
struct Totals {
  std::size_t tensors = 0;
  std::uint64_t rows = 0, values = 0, exceptions = 0, source = 0, stored = 0, encoded = 0;
  void add(const TensorReport& t) {
    ++tensors;
    rows += t.stats.rows;
    values += t.stats.values;
    exceptions += t.stats.exceptions;
    source += source_bytes(t);
    encoded += t.stats.encoded_bytes;
    stored += stored_bytes(t);
  }
  double exception_rate() const { return values ? double(exceptions) / double(values) : 0.0; }
  double ratio() const { return source ? double(stored) / double(source) : 0.0; }
};

nlohmann::json totals_json(const Totals& t) {
  return {{"tensors", t.tensors},
          {"rows", t.rows},
          {"values", t.values},
          {"exceptions", t.exceptions},
          {"exception_rate", t.exception_rate()},
          {"source_bytes", t.source},
          {"stored_bytes", t.stored},
          {"ratio", t.ratio()}};
}

// Layer keys in order of first appearance; "" (tensors outside any MoE layer) last.
std::vector<std::string> layer_order(const CheckpointReport& r) {
  std::vector<std::string> order;
  std::set<std::string> seen;
  bool has_empty = false;
  for (const auto& t : r.tensors) {
    if (!is_scale(t)) continue;
    if (t.layer.empty()) {
      has_empty = true;
    } else if (seen.insert(t.layer).second) {
      order.push_back(t.layer);
    }
  }
  if (has_empty) order.emplace_back();
  return order;
}

std::string elide(const std::string& s, std::size_t width) {
  if (s.size() <= width) return s;
  const std::size_t keep = width - 3;
  return s.substr(0, keep / 2) + "..." + s.substr(s.size() - (keep - keep / 2));
}

std::string percent(double x) { return fmt::format("{:.2f}%", 100.0 * x); }

}  // namespace

std::uint64_t tensor_bytes(const std::string& dtype, const std::vector<std::uint64_t>& shape) {
  std::uint64_t n = dtype_size(dtype);
  for (const auto d : shape) n *= d;
  return n;
}

std::uint64_t stored_bytes(const TensorReport& t) {
  switch (t.action) {
    case TensorAction::csf:
      return t.stats.encoded_bytes;
    case TensorAction::native_kept:
    case TensorAction::passthrough:
      break;
  }
  return source_bytes(t);
}

std::uint64_t source_bytes(const TensorReport& t) {
  // A kept-native tensor read back from a container carries no measured stats.
  const auto n = tensor_bytes(t.dtype, t.shape);
  return n ? n : t.stats.source_bytes;
}

std::string human_bytes(std::uint64_t b) {
  if (b < 1000) return fmt::format("{} B", b);
  if (b < 1'000'000) return fmt::format("{:.1f} kB", double(b) / 1e3);
  if (b < 1'000'000'000) return fmt::format("{:.1f} MB", double(b) / 1e6);
  return fmt::format("{:.2f} GB", double(b) / 1e9);
}

std::string_view to_string(TensorAction a) {
  switch (a) {
    case TensorAction::csf:
      return "csf";
    case TensorAction::native_kept:
      return "native_kept";
    case TensorAction::passthrough:
      return "passthrough";
  }
  return "?";
}

CheckpointReport merge_reports(const std::vector<CheckpointReport>& reports,
                               const std::filesystem::path& path) {
  CheckpointReport m;
  m.path = path;
  for (const auto& r : reports) {
    m.tensors.insert(m.tensors.end(), r.tensors.begin(), r.tensors.end());
    m.scale_source_bytes += r.scale_source_bytes;
    m.scale_stored_bytes += r.scale_stored_bytes;
    m.file_source_bytes += r.file_source_bytes;
    m.file_stored_bytes += r.file_stored_bytes;
    m.tp_slices.insert(m.tp_slices.end(), r.tp_slices.begin(), r.tp_slices.end());
  }
  return m;
}

void print_report_table(std::FILE* out, const CheckpointReport& r) {
  // Groups: file (when there are several), then MoE layer, in order of appearance.
  std::vector<std::string> files;
  for (const auto& t : r.tensors)
    if (is_scale(t) && std::find(files.begin(), files.end(), t.file) == files.end()) files.push_back(t.file);
  const bool show_file = files.size() > 1;
  std::vector<std::pair<std::string, std::vector<std::string>>> groups;
  for (const auto& f : files) {
    CheckpointReport sub;
    for (const auto& t : r.tensors)
      if (t.file == f) sub.tensors.push_back(t);
    groups.emplace_back(f, layer_order(sub));
  }
  std::size_t n_groups = 0;
  for (const auto& g : groups) n_groups += g.second.size();

  // Names inside a layer are printed relative to the layer key.
  auto shown_name = [&](const TensorReport& t) {
    std::string n = t.name;
    if (!t.layer.empty() && n.size() > t.layer.size() + 1 && n.compare(0, t.layer.size(), t.layer) == 0)
      n = n.substr(t.layer.size() + 1);
    const int indent = (show_file ? 2 : 0) + (t.layer.empty() ? 0 : 2);
    return std::string(static_cast<std::size_t>(indent), ' ') + n;
  };
  std::size_t width = 14;
  for (const auto& t : r.tensors)
    if (is_scale(t)) width = std::max(width, shown_name(t).size());
  width = std::min<std::size_t>(width, 64);

  const auto row = [&](const std::string& name, const std::string& fmt_s, const std::string& rows,
                       const std::string& bases, const std::string& exc, std::uint64_t before,
                       std::uint64_t after, const std::string& ratio, const std::string& action) {
    fmt::print(out, "{:<{}}  {:<5}  {:>9}  {:>5}  {:>7}  {:>10}  {:>10}  {:>7}  {}\n", elide(name, width),
               width, fmt_s, rows, bases, exc, human_bytes(before), human_bytes(after), ratio, action);
  };
  fmt::print(out, "{:<{}}  {:<5}  {:>9}  {:>5}  {:>7}  {:>10}  {:>10}  {:>7}  {}\n", "tensor", width, "fmt",
             "rows", "bases", "exc", "before", "after", "ratio", "action");

  Totals all;
  for (const auto& [file, layers] : groups) {
    if (show_file) fmt::print(out, "file {}\n", file);
    const std::string pad = show_file ? "  " : "";
    for (const auto& layer : layers) {
      Totals lt;
      if (!layer.empty()) fmt::print(out, "{}layer {}\n", pad, layer);
      for (const auto& t : r.tensors) {
        if (!is_scale(t) || t.file != file || t.layer != layer) continue;
        lt.add(t);
        all.add(t);
        std::string action{to_string(t.action)};
        if (t.action == TensorAction::native_kept && t.stats.encoded_bytes)
          action += fmt::format(" (CSF {:.1f}%)", 100.0 * t.stats.ratio());
        const auto src = source_bytes(t), stored = stored_bytes(t);
        row(shown_name(t), t.format ? std::string(to_string(*t.format)) : "-", std::to_string(t.stats.rows),
            std::to_string(t.stats.distinct_bases), percent(t.stats.exception_rate()), src, stored,
            percent(src ? double(stored) / double(src) : 0), action);
      }
      if (!layer.empty() && n_groups > 1)
        row(pad + "  layer total", "", std::to_string(lt.rows), "", percent(lt.exception_rate()), lt.source,
            lt.stored, percent(lt.ratio()), fmt::format("{} tensors", lt.tensors));
    }
  }
  std::size_t passthrough = 0;
  std::uint64_t passthrough_bytes = 0;
  for (const auto& t : r.tensors) {
    if (is_scale(t)) continue;
    ++passthrough;
    passthrough_bytes += tensor_bytes(t.dtype, t.shape);
  }
  row("scales total", "", std::to_string(all.rows), "", percent(all.exception_rate()), r.scale_source_bytes,
      r.scale_stored_bytes,
      percent(r.scale_source_bytes ? double(r.scale_stored_bytes) / double(r.scale_source_bytes) : 0),
      fmt::format("{} scale tensors", all.tensors));
  row("all tensors", "", "", "", "", r.file_source_bytes, r.file_stored_bytes,
      percent(r.file_source_bytes ? double(r.file_stored_bytes) / double(r.file_source_bytes) : 0),
      fmt::format("{} other tensors passed through ({})", passthrough, human_bytes(passthrough_bytes)));
  fmt::print(out,
             "ratio = after / before, lower is better; exc = share of scale bytes stored whole as "
             "exceptions; csf --help explains every column\n");
}

std::string tp_slice_text(const TpSliceInfo& t) {
  return fmt::format("tensor-parallel slice: rank {} of tp {} (MoE expert projections cut along N)", t.rank,
                     t.tp);
}

void print_tp_slices(std::FILE* out, const CheckpointReport& r) {
  for (const auto& t : r.tp_slices) fmt::print(out, "{}: {}\n", t.file, tp_slice_text(t));
}

void print_kept_native(std::FILE* out, const CheckpointReport& r) {
  for (const auto& t : r.tensors)
    if (t.action == TensorAction::native_kept)
      fmt::print(out, "kept native: {}:{}: {}\n", t.file, t.name,
                 t.reason.empty() ? "CSF would not pay" : t.reason);
}

nlohmann::json report_to_json(const CheckpointReport& r) {
  nlohmann::json tensors = nlohmann::json::array();
  Totals all;
  std::map<std::string, Totals> per_layer;
  std::size_t counts[3] = {0, 0, 0};
  for (const auto& t : r.tensors) {
    ++counts[static_cast<int>(t.action)];
    nlohmann::json j = {{"file", t.file},
                        {"name", t.name},
                        {"dtype", t.dtype},
                        {"shape", t.shape},
                        {"action", to_string(t.action)},
                        {"layer", t.layer},
                        {"reason", t.reason},
                        {"stored_bytes", stored_bytes(t)}};
    j["format"] = t.format ? nlohmann::json(std::string(to_string(*t.format))) : nlohmann::json(nullptr);
    if (is_scale(t)) {
      all.add(t);
      if (!t.layer.empty()) per_layer[t.layer].add(t);
      j["rows"] = t.stats.rows;
      j["values"] = t.stats.values;
      j["exceptions"] = t.stats.exceptions;
      j["exception_rate"] = t.stats.exception_rate();
      j["distinct_bases"] = t.stats.distinct_bases;
      j["encoded_bytes"] = t.stats.encoded_bytes;
      if (!t.storage.empty()) j["storage"] = t.storage;
      j["csf_ratio"] = t.stats.ratio();
      j["ratio"] = source_bytes(t) ? double(stored_bytes(t)) / double(source_bytes(t)) : 0.0;
    }
    j["source_bytes"] = source_bytes(t);
    tensors.push_back(std::move(j));
  }
  nlohmann::json layers = nlohmann::json::array();
  for (const auto& key : layer_order(r)) {
    if (key.empty()) continue;
    auto j = totals_json(per_layer[key]);
    j["layer"] = key;
    layers.push_back(std::move(j));
  }
  auto totals = totals_json(all);
  totals["scale_source_bytes"] = r.scale_source_bytes;
  totals["scale_stored_bytes"] = r.scale_stored_bytes;
  totals["scale_ratio"] =
      r.scale_source_bytes ? double(r.scale_stored_bytes) / double(r.scale_source_bytes) : 0.0;
  totals["file_source_bytes"] = r.file_source_bytes;
  totals["file_stored_bytes"] = r.file_stored_bytes;
  totals["file_ratio"] =
      r.file_source_bytes ? double(r.file_stored_bytes) / double(r.file_source_bytes) : 0.0;
  totals["csf_tensors"] = counts[static_cast<int>(TensorAction::csf)];
  totals["native_kept_tensors"] = counts[static_cast<int>(TensorAction::native_kept)];
  totals["passthrough_tensors"] = counts[static_cast<int>(TensorAction::passthrough)];
  nlohmann::json slices = nlohmann::json::array();
  for (const auto& t : r.tp_slices) slices.push_back({{"file", t.file}, {"tp", t.tp}, {"rank", t.rank}});
  return {{"path", r.path.string()},
          {"tensors", tensors},
          {"layers", layers},
          {"totals", totals},
          {"tp_slices", slices}};
}

namespace {

struct DeviceTotals {
  std::vector<std::pair<std::string, ResidentBytes>> layers;  // block scales per MoE layer
  std::vector<std::uint64_t> layers_b12x;                     // b12x's resident form of the same
  ResidentBytes scales, model;                                // all scales; all tensors
  std::uint64_t scales_b12x = 0, model_b12x = 0;
  std::uint64_t scratch = 0;  // largest layer's native scales
};

// A total (all scales, or the model) with the expand scratch that CSF scales
// need beside them: what is saved is what is left after it, and may be negative.
struct WithScratch {
  std::uint64_t native = 0, csf = 0, b12x = 0;  // csf and b12x include the scratch
  std::int64_t net_saved() const { return std::int64_t(native) - std::int64_t(csf); }
  double ratio() const { return native ? double(csf) / double(native) : 0.0; }
};
WithScratch with_scratch(const ResidentBytes& b, std::uint64_t b12x, std::uint64_t scratch) {
  return {b.native, b.csf + scratch, b12x + scratch};
}

std::string signed_bytes(std::int64_t v) {
  return v < 0 ? "-" + human_bytes(std::uint64_t(-v)) : human_bytes(std::uint64_t(v));
}

// Device bytes of a tensor: the resident CSF form (not the stored one) for CSF tensors.
std::uint64_t resident_of(const TensorReport& t) {
  return t.action == TensorAction::csf && t.resident_bytes ? t.resident_bytes : stored_bytes(t);
}
std::uint64_t b12x_resident_of(const TensorReport& t) {
  return t.action == TensorAction::csf && t.b12x_resident_bytes ? t.b12x_resident_bytes : stored_bytes(t);
}

DeviceTotals device_totals(const CheckpointReport& r) {
  DeviceTotals d;
  for (const auto& key : layer_order(r)) {
    ResidentBytes layer;
    std::uint64_t b12x = 0;
    for (const auto& t : r.tensors)
      if (is_scale(t) && t.layer == key) {
        layer += ResidentBytes{source_bytes(t), resident_of(t)};
        b12x += b12x_resident_of(t);
      }
    d.layers.emplace_back(key.empty() ? std::string("(outside MoE layers)") : key, layer);
    d.layers_b12x.push_back(b12x);
    d.scales += layer;
    d.scales_b12x += b12x;
    if (!key.empty()) d.scratch = std::max(d.scratch, layer.native);
  }
  for (const auto& t : r.tensors) {
    d.model += ResidentBytes{source_bytes(t), resident_of(t)};
    d.model_b12x += is_scale(t) ? b12x_resident_of(t) : stored_bytes(t);
  }
  return d;
}

nlohmann::json resident_json(const ResidentBytes& b) {
  return {{"native_bytes", b.native}, {"csf_bytes", b.csf}, {"saved_bytes", b.saved()}, {"ratio", b.ratio()}};
}

// A total with the scratch: csf_bytes / b12x_bytes without it, *_with_scratch
// with it; saved_bytes and ratio count the scratch (net_saved_bytes < 0 when
// CSF plus the scratch exceed native).
nlohmann::json total_json(const ResidentBytes& b, std::uint64_t b12x, std::uint64_t scratch) {
  const WithScratch w = with_scratch(b, b12x, scratch);
  return {{"native_bytes", b.native},
          {"csf_bytes", b.csf},
          {"b12x_bytes", b12x},
          {"expand_scratch_bytes", scratch},
          {"csf_with_scratch_bytes", w.csf},
          {"b12x_with_scratch_bytes", w.b12x},
          {"net_saved_bytes", w.net_saved()},
          {"saved_bytes", w.net_saved() > 0 ? std::uint64_t(w.net_saved()) : std::uint64_t{0}},
          {"ratio", w.ratio()}};
}

}  // namespace

void print_device_report(std::FILE* out, const CheckpointReport& r) {
  const DeviceTotals d = device_totals(r);
  fmt::print(out,
             "\nresident device memory (block scales native -> CSF as csfmoe keeps it; b12x: what b12x keeps "
             "resident)\n");
  fmt::print(out, "{:<48} {:>12} {:>12} {:>12} {:>12} {:>8}\n", "layer", "native", "csf", "b12x", "saved",
             "ratio");
  auto row = [&](const std::string& name, std::uint64_t native, std::uint64_t csf, std::uint64_t b12x,
                 std::int64_t saved, double ratio) {
    fmt::print(out, "{:<48} {:>12} {:>12} {:>12} {:>12} {:>8}\n", elide(name, 48), human_bytes(native),
               human_bytes(csf), human_bytes(b12x), signed_bytes(saved), percent(ratio));
  };
  for (std::size_t i = 0; i < d.layers.size(); ++i) {
    const ResidentBytes& b = d.layers[i].second;
    row(d.layers[i].first, b.native, b.csf, d.layers_b12x[i], std::int64_t(b.native) - std::int64_t(b.csf),
        b.ratio());
  }
  fmt::print(out, "{:<48} {:>12} {:>12} {:>12}\n", "expand scratch (largest layer's native scales)", "",
             "+" + human_bytes(d.scratch), "+" + human_bytes(d.scratch));
  const WithScratch scales = with_scratch(d.scales, d.scales_b12x, d.scratch),
                    model = with_scratch(d.model, d.model_b12x, d.scratch);
  row("all block scales, with the scratch", scales.native, scales.csf, scales.b12x, scales.net_saved(),
      scales.ratio());
  row("model (all tensors), with the scratch", model.native, model.csf, model.b12x, model.net_saved(),
      model.ratio());
  fmt::print(out,
             "expand scratch: one buffer shared by all layers, for the expanded and routed modes (stage_read "
             "needs none, but keeps an exception index)\n");
  if (scales.net_saved() < 0)
    fmt::print(
        out,
        "CSF scales plus the expand scratch exceed the native scales by {} (the scratch is one layer's "
        "native scales: it pays off over more layers; stage_read needs none)\n",
        human_bytes(std::uint64_t(-scales.net_saved())));
}

nlohmann::json device_report_json(const CheckpointReport& r) {
  const DeviceTotals d = device_totals(r);
  nlohmann::json layers = nlohmann::json::array();
  for (std::size_t i = 0; i < d.layers.size(); ++i) {
    auto j = resident_json(d.layers[i].second);
    j["layer"] = d.layers[i].first;
    j["b12x_bytes"] = d.layers_b12x[i];
    layers.push_back(std::move(j));
  }
  return {{"layers", layers},
          {"scales", total_json(d.scales, d.scales_b12x, d.scratch)},
          {"model", total_json(d.model, d.model_b12x, d.scratch)},
          {"expand_scratch_bytes", d.scratch}};
}

}  // namespace csfmoe::cli
