// Loading one MoE layer of a safetensors checkpoint into MoeHostWeights.
#include "csfmoe/moe_checkpoint.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <climits>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <set>

#include "checkpoint/detect.hpp"
#include "csfmoe/checkpoint.hpp"
#include "csfmoe/checkpoint_reader.hpp"
#include "csfmoe/errors.hpp"
#include "csfmoe/safetensors.hpp"

namespace csfmoe {
namespace fs = std::filesystem;
using namespace detail;

namespace {

using Bytes = std::vector<std::uint8_t>;

// One safetensors file seen through its logical (original) tensors: for a CSF
// container, the tensors of the original file, read CRC-checked (scale
// tensors decoded from their parts) by the library's one reader.
struct SourceFile {
  CheckpointFile file;
  ScaleLayout meta_layout = ScaleLayout::row_major;  // from "csfmoe.scale_layout", if any
  std::string label() const { return file.path().string(); }
};

std::vector<std::string> natural_sorted(std::set<std::string> keys);

// All logical tensors of a checkpoint (a file, or the shards of a folder).
class Source final : public MoeTensorSource {
 public:
  explicit Source(const fs::path& path) : path_(path) {
    for (const auto& p : checkpoint_files(path)) add(p);
  }

  std::string label() const override { return path_.string(); }

  const st::TensorInfo* find(const std::string& name) const override {
    auto it = by_name_.find(name);
    return it == by_name_.end() ? nullptr : &files_[it->second.first].file.tensors()[it->second.second];
  }
  // Names with this prefix, in order.
  std::vector<std::string> names_with_prefix(const std::string& prefix) const override {
    std::vector<std::string> out;
    for (auto it = by_name_.lower_bound(prefix); it != by_name_.end() && it->first.starts_with(prefix); ++it)
      out.push_back(it->first);
    return out;
  }
  const SourceFile& file_of(const std::string& name) const { return files_[by_name_.at(name).first]; }
  std::string label_of(const std::string& name) const override { return file_of(name).label(); }

  // Layout of a scale tensor's bytes as read().
  ScaleLayout layout_of(const std::string& name) const override {
    const SourceFile& f = file_of(name);
    if (const CsfEntryInfo* e = f.file.csf_entry(name)) return e->grid.layout;
    return f.meta_layout;
  }

  // The tensor's original bytes (decoded and CRC-checked for a container).
  Bytes read(const std::string& name) const override { return file_of(name).file.read(name); }

  std::vector<std::string> layers() const override {
    std::set<std::string> keys;
    for (const auto& f : files_) {
      std::set<ScaleLayout> layouts = {f.meta_layout};
      for (const auto& e : f.file.csf_entries()) layouts.insert(e.grid.layout);
      for (ScaleLayout l : layouts)
        for (const auto& c : detect_scales(f.file.header(), l, f.label()).scales)
          if (!c.layer.empty()) keys.insert(c.layer);
    }
    return natural_sorted(std::move(keys));
  }

 private:
  void add(const fs::path& p) {
    SourceFile s{CheckpointFile::open(p), ScaleLayout::row_major};
    const std::string label = s.label();
    if (const auto& md = s.file.metadata(); md && md->count(std::string(kScaleLayoutKey))) {
      st::Header tags;  // the container's own __metadata__, as compress reads it
      tags.metadata = md;
      s.meta_layout = source_layout(tags, std::nullopt, label);
    }
    files_.push_back(std::move(s));
    const std::size_t fi = files_.size() - 1;
    const auto& tensors = files_[fi].file.tensors();
    for (std::size_t ti = 0; ti < tensors.size(); ++ti) {
      const auto& t = tensors[ti];
      auto [it, fresh] = by_name_.emplace(t.name, std::pair{fi, ti});
      if (!fresh)
        throw FormatError(
            fmt::format("{}: tensor '{}' is also in {}", label, t.name, files_[it->second.first].label()));
    }
  }

  fs::path path_;
  std::vector<SourceFile> files_;
  std::map<std::string, std::pair<std::size_t, std::size_t>> by_name_;  // name -> (file, tensor) indices
};

// Digit runs compare as numbers.
bool natural_less(const std::string& a, const std::string& b) {
  std::size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (std::isdigit(static_cast<unsigned char>(a[i])) && std::isdigit(static_cast<unsigned char>(b[j]))) {
      std::size_t ie = i, je = j;
      while (ie < a.size() && std::isdigit(static_cast<unsigned char>(a[ie]))) ++ie;
      while (je < b.size() && std::isdigit(static_cast<unsigned char>(b[je]))) ++je;
      std::string_view da(a.data() + i, ie - i), db(b.data() + j, je - j);
      while (da.size() > 1 && da[0] == '0') da.remove_prefix(1);
      while (db.size() > 1 && db[0] == '0') db.remove_prefix(1);
      if (da.size() != db.size()) return da.size() < db.size();
      if (da != db) return da < db;
      i = ie;
      j = je;
    } else {
      if (a[i] != b[j]) return a[i] < b[j];
      ++i;
      ++j;
    }
  }
  return a.size() - i < b.size() - j;
}

std::vector<std::string> natural_sorted(std::set<std::string> keys) {
  std::vector<std::string> out(keys.begin(), keys.end());
  std::sort(out.begin(), out.end(), natural_less);
  return out;
}

// A packed FP4 weight and its block scales, checked (not read).
struct Fp4 {
  ScaleFormat format = ScaleFormat::nvfp4;
  MoeLayerProjection p;
};

// Missing tensors a message names before "and N more".
constexpr std::size_t kShowMissing = 8;

class LayerReader {
 public:
  LayerReader(const MoeTensorSource& s, std::string layer) : s_(s), layer_(std::move(layer)) {}

  // FormatError listing every missing one of `names`.
  void require(const std::vector<std::string>& names, std::string_view naming) const {
    std::vector<std::string> missing;
    for (const auto& n : names)
      if (!s_.find(n)) missing.push_back(n);
    if (missing.empty()) return;
    std::string list;
    for (std::size_t i = 0; i < missing.size() && i < kShowMissing; ++i)
      list += fmt::format("{}'{}'", i ? ", " : "", missing[i]);
    if (missing.size() > kShowMissing) list += fmt::format(" and {} more", missing.size() - kShowMissing);
    throw FormatError(
        fmt::format("{}: layer '{}' ({} layout): missing tensors {}", s_.label(), layer_, naming, list));
  }
  const st::TensorInfo& need(const std::string& name) const {
    const st::TensorInfo* t = s_.find(name);
    if (!t)
      throw FormatError(fmt::format("{}: layer '{}': tensor '{}' is missing", s_.label(), layer_, name));
    return *t;
  }
  [[noreturn]] void fail(const std::string& name, const std::string& why) const {
    throw FormatError(fmt::format("{}: tensor '{}': {}", s_.label_of(name), name, why));
  }

  // stacked: leading expert dimension; blocks: gpt-oss [.., R, K/32, 16] weight.
  Fp4 fp4(const std::string& wname, const std::string& sname, bool stacked, bool blocks) const {
    const st::TensorInfo& w = need(wname);
    const st::TensorInfo& sc = need(sname);
    const std::size_t lead = stacked ? 1 : 0;
    if (w.dtype != st::Dtype::U8)
      fail(wname, fmt::format("packed FP4 weight must be U8, got {}", st::to_string(w.dtype)));
    const std::size_t wrank = lead + (blocks ? 3 : 2);
    if (w.shape.size() != wrank || (blocks && w.shape.back() != 16))
      fail(wname, fmt::format("shape {} is not {}", shape_str(w.shape),
                              blocks ? (stacked ? "[E, R, K/32, 16]" : "[R, K/32, 16]")
                                     : (stacked ? "[E, R, K/2]" : "[R, K/2]")));
    Fp4 out;
    out.p.weight = wname;
    out.p.scale = sname;
    out.p.experts = stacked ? w.shape[0] : 1;
    out.p.rows = w.shape[lead];
    out.p.k = blocks ? w.shape[lead + 1] * 32 : w.shape[lead + 1] * 2;
    if (out.p.experts == 0 || out.p.rows == 0 || out.p.k == 0)
      fail(wname, fmt::format("empty shape {}", shape_str(w.shape)));
    // Keeps the geometry's 32-bit fields exact (plan_weights bounds them far lower).
    if (out.p.experts > INT32_MAX || out.p.rows > INT32_MAX || out.p.k > INT32_MAX)
      fail(wname, fmt::format("shape {} exceeds 2^31 in a dimension", shape_str(w.shape)));
    if (sc.shape.size() != lead + 2 || (stacked && sc.shape[0] != out.p.experts))
      fail(sname, fmt::format("shape {} does not match weight '{}' {}", shape_str(sc.shape), wname,
                              shape_str(w.shape)));
    const ScaleLayout layout = s_.layout_of(sname);
    out.p.scale_layout = layout;
    const std::uint64_t rs = sc.shape[lead], cs = sc.shape[lead + 1];
    std::optional<ScaleFormat> f;
    for (ScaleFormat c : {ScaleFormat::nvfp4, ScaleFormat::mxfp4}) {
      const std::uint64_t g = group_size(c);
      if (out.p.k % g || (blocks && c != ScaleFormat::mxfp4)) continue;
      std::uint64_t want_r = out.p.rows, want_c = out.p.k / g;
      if (layout == ScaleLayout::swizzled_128x4) {
        want_r = round_up(want_r, 128);
        want_c = round_up(want_c, 4);
      }
      if (rs == want_r && cs == want_c) {
        f = c;
        break;
      }
    }
    if (!f)
      fail(sname,
           fmt::format("{} scale grid {} matches neither K/16 nor K/32 blocks of weight '{}' {} (K = {})",
                       to_string(layout), shape_str(sc.shape), wname, shape_str(w.shape), out.p.k));
    out.format = *f;
    const bool dtype_ok = *f == ScaleFormat::nvfp4
                              ? (sc.dtype == st::Dtype::F8_E4M3 || sc.dtype == st::Dtype::U8)
                              : (sc.dtype == st::Dtype::F8_E8M0 || sc.dtype == st::Dtype::U8);
    if (!dtype_ok)
      fail(sname, fmt::format("{} block scale must be {}, got {}", to_string(*f),
                              *f == ScaleFormat::nvfp4 ? "F8_E4M3 (or U8)" : "U8 or F8_E8M0",
                              st::to_string(sc.dtype)));
    return out;
  }

  // Global scales: [] or [1] (broadcast), or [E] when stacked.
  std::vector<float> globals(const std::string& name, std::uint64_t experts, bool stacked) const {
    const st::TensorInfo& t = need(name);
    if (t.dtype != st::Dtype::F32)
      fail(name, fmt::format("global scale must be float32 (F32), got {}", st::to_string(t.dtype)));
    const bool one = t.shape.empty() || (t.shape.size() == 1 && t.shape[0] == 1);
    const bool per_expert = stacked && t.shape.size() == 1 && t.shape[0] == experts;
    if (!one && !per_expert)
      fail(name, fmt::format("global scale shape {} is not [], [1]{}", shape_str(t.shape),
                             stacked ? fmt::format(" or [{}]", experts) : ""));
    const Bytes b = s_.read(name);
    if (b.size() != (one ? 1 : experts) * sizeof(float))
      fail(name, fmt::format("{} bytes for shape {}", b.size(), shape_str(t.shape)));
    std::vector<float> v(b.size() / 4);
    std::memcpy(v.data(), b.data(), b.size());
    for (std::size_t i = 0; i < v.size(); ++i)
      if (!std::isfinite(v[i])) fail(name, fmt::format("global scale [{}] is {}", i, v[i]));
    if (one) v.assign(experts, v[0]);
    return v;
  }

  // Activation scales: the W4A16 kernels do not apply them, but one that is
  // damaged (CRC) or not a positive finite F32 means a damaged checkpoint.
  // Empty when absent.
  std::vector<float> input_scale(const std::string& name, std::uint64_t experts, bool stacked) const {
    if (!s_.find(name)) return {};
    const std::vector<float> v = globals(name, experts, stacked);
    for (std::size_t i = 0; i < v.size(); ++i)
      if (!(v[i] > 0.0f)) fail(name, fmt::format("input scale [{}] is {}; must be positive", i, v[i]));
    return v;
  }

  // An expert bias [E, R] (BF16 or F32, as gpt-oss checkpoints store them) as
  // FP32, checked finite; empty when absent (each bias is optional).
  std::vector<float> bias(const std::string& name, std::uint64_t experts, std::uint64_t rows,
                          const std::string& rows_of) const {
    const st::TensorInfo* t = s_.find(name);
    if (!t) return {};
    if (t->dtype != st::Dtype::BF16 && t->dtype != st::Dtype::F32)
      fail(name, fmt::format("expert bias must be BF16 or F32, got {}", st::to_string(t->dtype)));
    if (t->shape != std::vector<std::uint64_t>{experts, rows})
      fail(name, fmt::format("expert bias shape {} is not [{}, {}] (experts, rows of '{}')",
                             shape_str(t->shape), experts, rows, rows_of));
    const Bytes b = s_.read(name);
    const std::size_t width = st::dtype_size(t->dtype);
    if (b.size() != experts * rows * width)
      fail(name, fmt::format("{} bytes for shape {}", b.size(), shape_str(t->shape)));
    std::vector<float> v(experts * rows);
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (width == 2) {
        std::uint16_t bits;
        std::memcpy(&bits, b.data() + 2 * i, 2);
        v[i] = bf16_to_float(bits);
      } else {
        std::memcpy(&v[i], b.data() + 4 * i, 4);
      }
      if (!std::isfinite(v[i]))
        fail(name, fmt::format("expert bias [{}, {}] is {}", i / rows, i % rows, v[i]));
    }
    return v;
  }

  // MXFP4 carries no global scale; refuse one instead of silently dropping it.
  void no_global(const std::string& name) const {
    if (s_.find(name))
      throw Unsupported(
          fmt::format("{}: tensor '{}': an MXFP4 layer with a global scale is not supported "
                      "(the MoE API applies none to MXFP4)",
                      s_.label_of(name), name));
  }

 private:
  const MoeTensorSource& s_;
  std::string layer_;
};

enum class Layout { stacked, gptoss, per_expert };

struct PerExpertNames {
  const char* gate;
  const char* up;
  const char* down;
};
constexpr PerExpertNames kPerExpert[] = {{"gate_proj", "up_proj", "down_proj"}, {"w1", "w3", "w2"}};

void check_pair(const MoeTensorSource& s, const std::string& layer, const Fp4& w13, const std::string& n13,
                const Fp4& w2, const std::string& n2) {
  const MoeLayerProjection &a = w13.p, &b = w2.p;
  if (w13.format != w2.format || a.experts != b.experts || a.rows % 2 || b.rows != a.k || b.k * 2 != a.rows)
    throw FormatError(
        fmt::format("{}: layer '{}': '{}' ({} E={} rows={} K={}) and '{}' ({} E={} rows={} K={}) are not the "
                    "[E, 2N, H] / [E, H, N] pair of one layer",
                    s.label(), layer, n13, to_string(w13.format), a.experts, a.rows, a.k, n2,
                    to_string(w2.format), b.experts, b.rows, b.k));
}

// Appends a projection's packed weight and its row-major [E, R, K/g] scales.
void append(const Source& src, ScaleFormat format, const MoeLayerProjection& p, Bytes& packed,
            Bytes& scales) {
  const Bytes w = src.read(p.weight);
  packed.insert(packed.end(), w.begin(), w.end());
  const Bytes raw = src.read(p.scale);
  if (p.scale_layout == ScaleLayout::row_major) {
    scales.insert(scales.end(), raw.begin(), raw.end());
    return;
  }
  // Back to the row-major grid the MoE API takes.
  const auto& shape = src.find(p.scale)->shape;
  const std::uint64_t rs = shape[shape.size() - 2], cs = shape.back(), per = rs * cs;
  const std::uint64_t c = p.k / group_size(format);
  for (std::uint64_t e = 0; e < p.experts; ++e)
    for (std::uint64_t r = 0; r < p.rows; ++r)
      for (std::uint64_t j = 0; j < c; ++j) scales.push_back(raw[e * per + swizzled_index(r, j, cs)]);
}

// gpt-oss's gate_up rows alternate (row 2i is gate i, row 2i + 1 up i, as
// transformers' GptOssExperts reads them); the w13 order is gate rows, then
// up rows. `row` is the elements per row (packed bytes, scales or 1 for a bias).
template <class T>
void deinterleave_gate_up(std::vector<T>& v, std::uint64_t experts, std::uint64_t n, std::uint64_t row) {
  std::vector<T> out(v.size());
  for (std::uint64_t e = 0; e < experts; ++e) {
    const T* src = v.data() + e * 2 * n * row;
    T* dst = out.data() + e * 2 * n * row;
    for (std::uint64_t i = 0; i < n; ++i) {
      std::copy_n(src + (2 * i) * row, row, dst + i * row);
      std::copy_n(src + (2 * i + 1) * row, row, dst + (n + i) * row);
    }
  }
  v.swap(out);
}

}  // namespace

std::vector<std::string> list_moe_layers(const fs::path& checkpoint) { return Source(checkpoint).layers(); }

MoeTensorTable::MoeTensorTable(std::string label, Reader reader)
    : label_(std::move(label)), reader_(std::move(reader)) {}

void MoeTensorTable::add(std::string name, st::Dtype dtype, std::vector<std::uint64_t> shape,
                         ScaleLayout layout) {
  Entry e;
  e.info.name = name;
  e.info.dtype = dtype;
  e.info.shape = std::move(shape);
  e.layout = layout;
  if (!tensors_.emplace(name, std::move(e)).second)
    throw InvalidArgument(fmt::format("{}: tensor '{}' given twice", label_, name));
}

const st::TensorInfo* MoeTensorTable::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second.info;
}

std::vector<std::string> MoeTensorTable::names_with_prefix(const std::string& prefix) const {
  std::vector<std::string> out;
  for (auto it = tensors_.lower_bound(prefix); it != tensors_.end() && it->first.starts_with(prefix); ++it)
    out.push_back(it->first);
  return out;
}

ScaleLayout MoeTensorTable::layout_of(const std::string& scale) const {
  auto it = tensors_.find(scale);
  return it == tensors_.end() ? ScaleLayout::row_major : it->second.layout;
}

std::vector<std::uint8_t> MoeTensorTable::read(const std::string& name) const {
  std::vector<std::uint8_t> b = reader_(name);
  const st::TensorInfo* t = find(name);
  if (!t || b.size() != t->elements() * st::dtype_size(t->dtype))
    throw InvalidArgument(fmt::format("{}: tensor '{}': the reader gave {} bytes for shape {} {}", label_,
                                      name, b.size(), t ? shape_str(t->shape) : "?",
                                      t ? st::to_string(t->dtype) : "?"));
  return b;
}

std::vector<std::string> MoeTensorTable::layers() const {
  std::set<std::string> keys;
  for (ScaleLayout l : {ScaleLayout::row_major, ScaleLayout::swizzled_128x4}) {
    st::Header h;
    for (const auto& [name, e] : tensors_)
      if (e.layout == l) h.tensors.push_back(e.info);
    try {
      for (const auto& c : detect_scales(h, l, label_).scales)
        if (!c.layer.empty()) keys.insert(c.layer);
    } catch (const FormatError&) {
      // Only names layers for a message; a malformed tensor is reported where it is used.
    }
  }
  return natural_sorted(std::move(keys));
}

MoeLayerSpec resolve_moe_layer(const MoeTensorSource& src, std::string_view layer_key, unsigned topk) {
  const std::string L(layer_key);
  const LayerReader rd(src, L);
  const std::string path = src.label();

  // Which layout this key names; per-expert indices and projection names.
  std::vector<Layout> found;
  if (src.find(L + ".w13.weight") || src.find(L + ".w13.weight_scale")) found.push_back(Layout::stacked);
  if (src.find(L + ".gate_up_proj_blocks") || src.find(L + ".gate_up_proj_scales"))
    found.push_back(Layout::gptoss);
  std::set<std::uint64_t> ids;
  std::set<std::size_t> naming;
  for (const auto& n : src.names_with_prefix(L + ".")) {
    const std::string_view rest = std::string_view(n).substr(L.size() + 1);
    const auto dot = rest.find('.');
    if (dot == 0 || dot == std::string_view::npos || dot > 9) continue;
    const std::string_view num = rest.substr(0, dot), proj = rest.substr(dot + 1);
    if (!std::all_of(num.begin(), num.end(), [](char c) { return c >= '0' && c <= '9'; })) continue;
    for (std::size_t i = 0; i < std::size(kPerExpert); ++i)
      for (const char* p : {kPerExpert[i].gate, kPerExpert[i].up, kPerExpert[i].down})
        if (proj.starts_with(std::string(p) + ".")) {
          naming.insert(i);
          ids.insert(std::stoull(std::string(num)));
          // Per-expert biases would need an activation the names do not give.
          if (proj == std::string(p) + ".bias")
            throw Unsupported(fmt::format(
                "{}: tensor '{}': expert biases of a per-expert layer are not loaded: the names give no "
                "activation for them (gpt-oss layers are read under L.gate_up_proj_* / L.down_proj_*)",
                src.label_of(n), n));
        }
  }
  if (!ids.empty()) found.push_back(Layout::per_expert);
  if (found.empty()) {
    const auto layers = src.layers();
    throw InvalidArgument(fmt::format("{}: no MoE layer '{}'; layers found: {}", path, L,
                                      layers.empty() ? "none" : fmt::format("{}", fmt::join(layers, ", "))));
  }
  if (found.size() > 1 || naming.size() > 1)
    throw FormatError(
        fmt::format("{}: layer '{}' mixes stacked, gpt-oss and per-expert tensor names", path, L));

  MoeLayerSpec spec;
  std::uint64_t E = 0;
  if (found[0] != Layout::per_expert) {
    const bool oss = found[0] == Layout::gptoss;
    spec.naming = oss ? "gpt-oss" : "stacked";
    // Stacked w13 / w2 biases follow no checkpoint convention that would say
    // the activation and row order they belong to (gpt-oss's layers are
    // stored under gpt-oss names); refused rather than guessed.
    if (!oss)
      for (const char* b : {".w13.bias", ".w2.bias"})
        if (src.find(L + b))
          throw Unsupported(fmt::format(
              "{}: tensor '{}{}': expert biases of a stacked (w13 / w2) layer are not loaded: no known "
              "checkpoint convention gives their activation or gate/up row order (gpt-oss layers are read "
              "under their own names, L.gate_up_proj_* / L.down_proj_*)",
              src.label_of(L + b), L, b));
    const std::string n13 = L + (oss ? ".gate_up_proj_blocks" : ".w13.weight");
    const std::string n2 = L + (oss ? ".down_proj_blocks" : ".w2.weight");
    const std::string s13 = L + (oss ? ".gate_up_proj_scales" : ".w13.weight_scale");
    const std::string s2 = L + (oss ? ".down_proj_scales" : ".w2.weight_scale");
    rd.require({n13, s13, n2, s2}, spec.naming);
    const Fp4 a = rd.fp4(n13, s13, true, oss);
    const Fp4 b = rd.fp4(n2, s2, true, oss);
    check_pair(src, L, a, n13, b, n2);
    E = a.p.experts;
    spec.format = a.format;
    if (spec.format == ScaleFormat::nvfp4) {
      rd.require({L + ".w13.weight_scale_2", L + ".w2.weight_scale_2"}, spec.naming);
      spec.w13_global = rd.globals(L + ".w13.weight_scale_2", E, true);
      spec.w2_global = rd.globals(L + ".w2.weight_scale_2", E, true);
      spec.w13_input_scale = rd.input_scale(L + ".w13.input_scale", E, true);
      spec.w2_input_scale = rd.input_scale(L + ".w2.input_scale", E, true);
    } else {
      if (!oss) {
        rd.no_global(L + ".w13.weight_scale_2");
        rd.no_global(L + ".w2.weight_scale_2");
      }
      spec.w13_global.assign(E, 1.0f);
      spec.w2_global.assign(E, 1.0f);
    }
    spec.geometry.hidden = static_cast<std::uint32_t>(a.p.k);
    spec.geometry.intermediate = static_cast<std::uint32_t>(b.p.k);
    // Expert biases mark a gpt-oss checkpoint proper: interleaved gate/up rows
    // and the clamped SwiGLU. Without them the names hold the fused [gate; up]
    // rows `csf synth` and the b12x split use, run with SiLU as before.
    const std::string b13 = L + ".gate_up_proj_bias", b2 = L + ".down_proj_bias";
    if (oss && (src.find(b13) || src.find(b2))) {
      spec.gate_up_interleaved = true;
      spec.geometry.activation = MoeActivationSpec::gpt_oss();
      spec.w13_bias = rd.bias(b13, E, a.p.rows, n13);
      spec.w2_bias = rd.bias(b2, E, b.p.rows, n2);
      if (!spec.w13_bias.empty()) deinterleave_gate_up(spec.w13_bias, E, b.p.k, 1);
    }
    spec.w13.push_back(a.p);
    spec.w2.push_back(b.p);
  } else {
    spec.naming = "per-expert";
    E = *ids.rbegin() + 1;
    if (E > MoePlan::kMaxExperts)
      throw InvalidArgument(fmt::format("{}: layer '{}': expert index {} exceeds the MoE API's {} experts",
                                        path, L, E - 1, MoePlan::kMaxExperts));
    const PerExpertNames& pn = kPerExpert[*naming.begin()];
    {
      std::vector<std::string> need;
      for (std::uint64_t e = 0; e < E; ++e)
        for (const char* proj : {pn.gate, pn.up, pn.down})
          for (const char* leaf : {".weight", ".weight_scale"})
            need.push_back(fmt::format("{}.{}.{}{}", L, e, proj, leaf));
      rd.require(need, spec.naming);
    }
    std::vector<float> i13, i2;
    for (std::uint64_t e = 0; e < E; ++e) {
      const std::string p = fmt::format("{}.{}.", L, e);
      const std::string ng = p + pn.gate + ".weight", nu = p + pn.up + ".weight",
                        nd = p + pn.down + ".weight";
      const Fp4 g = rd.fp4(ng, ng + "_scale", false, false);
      const Fp4 u = rd.fp4(nu, nu + "_scale", false, false);
      const Fp4 d = rd.fp4(nd, nd + "_scale", false, false);
      if (g.format != u.format || g.p.rows != u.p.rows || g.p.k != u.p.k)
        throw FormatError(fmt::format("{}: layer '{}': '{}' ({} {}x{}) and '{}' ({} {}x{}) differ", path, L,
                                      ng, to_string(g.format), g.p.rows, g.p.k, nu, to_string(u.format),
                                      u.p.rows, u.p.k));
      // Gate and up stacked, gate rows first: the w13 order.
      Fp4 gu = g;
      gu.p.rows = 2 * g.p.rows;
      check_pair(src, L, gu, ng + " + " + nu, d, nd);
      if (e == 0) {
        spec.format = g.format;
        spec.geometry.hidden = static_cast<std::uint32_t>(g.p.k);
        spec.geometry.intermediate = static_cast<std::uint32_t>(g.p.rows);
      } else if (g.format != spec.format || g.p.k != spec.geometry.hidden ||
                 g.p.rows != spec.geometry.intermediate) {
        throw FormatError(
            fmt::format("{}: layer '{}': expert {} ('{}': {} N={} H={}) differs from expert 0 ({} N={} "
                        "H={})",
                        path, L, e, ng, to_string(g.format), g.p.rows, g.p.k, to_string(spec.format),
                        spec.geometry.intermediate, spec.geometry.hidden));
      }
      spec.w13.push_back(g.p);
      spec.w13.push_back(u.p);
      spec.w2.push_back(d.p);
      if (spec.format == ScaleFormat::nvfp4) {
        rd.require({ng + "_scale_2", nu + "_scale_2", nd + "_scale_2"}, spec.naming);
        const float gg = rd.globals(ng + "_scale_2", 1, false)[0];
        const float ug = rd.globals(nu + "_scale_2", 1, false)[0];
        if (std::memcmp(&gg, &ug, sizeof gg) != 0)
          throw Unsupported(fmt::format(
              "{}: layer '{}': '{}_scale_2' ({}) and '{}_scale_2' ({}) differ; the MoE API has one global "
              "scale per expert for the fused gate/up projection, so this checkpoint would need "
              "requantization",
              path, L, ng, gg, nu, ug));
        spec.w13_global.push_back(gg);
        spec.w2_global.push_back(rd.globals(nd + "_scale_2", 1, false)[0]);
        const auto gi = rd.input_scale(p + pn.gate + ".input_scale", 1, false);
        (void)rd.input_scale(p + pn.up + ".input_scale", 1, false);
        const auto di = rd.input_scale(p + pn.down + ".input_scale", 1, false);
        i13.insert(i13.end(), gi.begin(), gi.end());
        i2.insert(i2.end(), di.begin(), di.end());
      } else {
        rd.no_global(ng + "_scale_2");
        rd.no_global(nu + "_scale_2");
        rd.no_global(nd + "_scale_2");
        spec.w13_global.push_back(1.0f);
        spec.w2_global.push_back(1.0f);
      }
    }
    // Per-layer activation scales only when every expert has one.
    if (i13.size() == E) spec.w13_input_scale = std::move(i13);
    if (i2.size() == E) spec.w2_input_scale = std::move(i2);
  }
  spec.geometry.experts = static_cast<std::uint32_t>(std::min<std::uint64_t>(E, UINT32_MAX));
  spec.geometry.topk = topk;
  spec.geometry.order = GateUpOrder::w13;
  try {
    (void)plan_weights(spec.format, spec.geometry, MoeConstraints{});
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(fmt::format("{}: layer '{}' (E={} H={} N={} k={}): {}", path, L,
                                      spec.geometry.experts, spec.geometry.hidden, spec.geometry.intermediate,
                                      topk, e.what()));
  }
  return spec;
}

MoeHostWeights load_moe_layer(const fs::path& checkpoint, std::string_view layer_key, unsigned topk) {
  const Source src(checkpoint);
  const MoeLayerSpec spec = resolve_moe_layer(src, layer_key, topk);
  MoeHostWeights w;
  w.format = spec.format;
  w.geometry = spec.geometry;
  w.w13_global = spec.w13_global;
  w.w2_global = spec.w2_global;
  for (const auto& p : spec.w13) append(src, spec.format, p, w.w13, w.w13_scales);
  for (const auto& p : spec.w2) append(src, spec.format, p, w.w2, w.w2_scales);
  if (spec.gate_up_interleaved) {
    const std::uint64_t E = spec.geometry.experts, N = spec.geometry.intermediate, H = spec.geometry.hidden;
    deinterleave_gate_up(w.w13, E, N, H / 2);
    deinterleave_gate_up(w.w13_scales, E, N, H / group_size(spec.format));
  }
  w.w13_bias = spec.w13_bias;
  w.w2_bias = spec.w2_bias;
  validate(w);
  return w;
}

}  // namespace csfmoe
