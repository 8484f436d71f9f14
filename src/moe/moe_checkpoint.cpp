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

// All logical tensors of a checkpoint (a file, or the shards of a folder).
class Source {
 public:
  explicit Source(const fs::path& path) : path_(path) {
    for (const auto& p : checkpoint_files(path)) add(p);
  }

  const fs::path& path() const { return path_; }
  const std::vector<SourceFile>& files() const { return files_; }

  const st::TensorInfo* find(const std::string& name) const {
    auto it = by_name_.find(name);
    return it == by_name_.end() ? nullptr : &files_[it->second.first].file.tensors()[it->second.second];
  }
  // Names with this prefix, in order.
  std::vector<std::string> names_with_prefix(const std::string& prefix) const {
    std::vector<std::string> out;
    for (auto it = by_name_.lower_bound(prefix); it != by_name_.end() && it->first.starts_with(prefix); ++it)
      out.push_back(it->first);
    return out;
  }
  const SourceFile& file_of(const std::string& name) const { return files_[by_name_.at(name).first]; }
  std::string label_of(const std::string& name) const { return file_of(name).label(); }

  // Layout of a scale tensor's bytes as read().
  ScaleLayout layout_of(const std::string& name) const {
    const SourceFile& f = file_of(name);
    if (const CsfEntryInfo* e = f.file.csf_entry(name)) return e->grid.layout;
    return f.meta_layout;
  }

  // The tensor's original bytes (decoded and CRC-checked for a container).
  Bytes read(const std::string& name) const { return file_of(name).file.read(name); }

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

std::vector<std::string> layers_of(const Source& src) {
  std::set<std::string> keys;
  for (const auto& f : src.files()) {
    std::set<ScaleLayout> layouts = {f.meta_layout};
    for (const auto& e : f.file.csf_entries()) layouts.insert(e.grid.layout);
    for (ScaleLayout l : layouts)
      for (const auto& c : detect_scales(f.file.header(), l, f.label()).scales)
        if (!c.layer.empty()) keys.insert(c.layer);
  }
  std::vector<std::string> out(keys.begin(), keys.end());
  std::sort(out.begin(), out.end(), natural_less);
  return out;
}

// A packed FP4 weight and its block scales, scales row-major.
struct Fp4 {
  ScaleFormat format = ScaleFormat::nvfp4;
  std::uint64_t experts = 1, rows = 0, k = 0;
  Bytes packed, scales;
};

class LayerReader {
 public:
  LayerReader(const Source& s, std::string layer) : s_(s), layer_(std::move(layer)) {}

  const st::TensorInfo& need(const std::string& name) const {
    const st::TensorInfo* t = s_.find(name);
    if (!t)
      throw FormatError(
          fmt::format("{}: layer '{}': tensor '{}' is missing", s_.path().string(), layer_, name));
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
    out.experts = stacked ? w.shape[0] : 1;
    out.rows = w.shape[lead];
    out.k = blocks ? w.shape[lead + 1] * 32 : w.shape[lead + 1] * 2;
    if (out.experts == 0 || out.rows == 0 || out.k == 0)
      fail(wname, fmt::format("empty shape {}", shape_str(w.shape)));
    // Keeps the geometry's 32-bit fields exact (plan_weights bounds them far lower).
    if (out.experts > INT32_MAX || out.rows > INT32_MAX || out.k > INT32_MAX)
      fail(wname, fmt::format("shape {} exceeds 2^31 in a dimension", shape_str(w.shape)));
    if (sc.shape.size() != lead + 2 || (stacked && sc.shape[0] != out.experts))
      fail(sname, fmt::format("shape {} does not match weight '{}' {}", shape_str(sc.shape), wname,
                              shape_str(w.shape)));
    const ScaleLayout layout = s_.layout_of(sname);
    const std::uint64_t rs = sc.shape[lead], cs = sc.shape[lead + 1];
    std::optional<ScaleFormat> f;
    for (ScaleFormat c : {ScaleFormat::nvfp4, ScaleFormat::mxfp4}) {
      const std::uint64_t g = group_size(c);
      if (out.k % g || (blocks && c != ScaleFormat::mxfp4)) continue;
      std::uint64_t want_r = out.rows, want_c = out.k / g;
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
                       to_string(layout), shape_str(sc.shape), wname, shape_str(w.shape), out.k));
    out.format = *f;
    const bool dtype_ok = *f == ScaleFormat::nvfp4
                              ? (sc.dtype == st::Dtype::F8_E4M3 || sc.dtype == st::Dtype::U8)
                              : (sc.dtype == st::Dtype::F8_E8M0 || sc.dtype == st::Dtype::U8);
    if (!dtype_ok)
      fail(sname, fmt::format("{} block scale must be {}, got {}", to_string(*f),
                              *f == ScaleFormat::nvfp4 ? "F8_E4M3 (or U8)" : "U8 or F8_E8M0",
                              st::to_string(sc.dtype)));
    out.packed = s_.read(wname);
    Bytes raw = s_.read(sname);
    if (layout == ScaleLayout::row_major) {
      out.scales = std::move(raw);
    } else {
      // Back to the row-major [E, R, K/g] grid the MoE API takes.
      const std::uint64_t c = out.k / group_size(*f), per = rs * cs;
      out.scales.resize(out.experts * out.rows * c);
      std::uint8_t* dst = out.scales.data();
      for (std::uint64_t e = 0; e < out.experts; ++e)
        for (std::uint64_t r = 0; r < out.rows; ++r)
          for (std::uint64_t j = 0; j < c; ++j) *dst++ = raw[e * per + swizzled_index(r, j, cs)];
    }
    return out;
  }

  // Global scales: [] or [1] (broadcast), or [E] when stacked.
  std::vector<float> globals(const std::string& name, std::uint64_t experts, bool stacked) const {
    const st::TensorInfo& t = need(name);
    if (t.dtype != st::Dtype::F32)
      fail(name, fmt::format("global scale must be F32, got {}", st::to_string(t.dtype)));
    const bool one = t.shape.empty() || (t.shape.size() == 1 && t.shape[0] == 1);
    const bool per_expert = stacked && t.shape.size() == 1 && t.shape[0] == experts;
    if (!one && !per_expert)
      fail(name, fmt::format("global scale shape {} is not [], [1]{}", shape_str(t.shape),
                             stacked ? fmt::format(" or [{}]", experts) : ""));
    const Bytes b = s_.read(name);
    std::vector<float> v(b.size() / 4);
    std::memcpy(v.data(), b.data(), b.size());
    for (std::size_t i = 0; i < v.size(); ++i)
      if (!std::isfinite(v[i])) fail(name, fmt::format("global scale [{}] is {}", i, v[i]));
    if (one) v.assign(experts, v[0]);
    return v;
  }

  // Activation scales: the W4A16 kernels do not apply them, but one that is
  // damaged (CRC) or not a positive finite F32 means a damaged checkpoint.
  void check_input_scale(const std::string& name, std::uint64_t experts, bool stacked) const {
    if (!s_.find(name)) return;
    const std::vector<float> v = globals(name, experts, stacked);
    for (std::size_t i = 0; i < v.size(); ++i)
      if (!(v[i] > 0.0f)) fail(name, fmt::format("input scale [{}] is {}; must be positive", i, v[i]));
  }

  // MXFP4 carries no global scale; refuse one instead of silently dropping it.
  void no_global(const std::string& name) const {
    if (s_.find(name))
      throw Unsupported(
          fmt::format("{}: tensor '{}': an MXFP4 layer with a global scale is not supported "
                      "(the MoE API applies none to MXFP4)",
                      s_.label_of(name), name));
  }

  const std::string& layer() const { return layer_; }

 private:
  const Source& s_;
  std::string layer_;
};

enum class Layout { stacked, gptoss, per_expert };

struct PerExpertNames {
  const char* gate;
  const char* up;
  const char* down;
};
constexpr PerExpertNames kPerExpert[] = {{"gate_proj", "up_proj", "down_proj"}, {"w1", "w3", "w2"}};

void check_pair(const Source& s, const std::string& layer, const Fp4& w13, const std::string& n13,
                const Fp4& w2, const std::string& n2) {
  if (w13.format != w2.format || w13.experts != w2.experts || w13.rows % 2 || w2.rows != w13.k ||
      w2.k * 2 != w13.rows)
    throw FormatError(
        fmt::format("{}: layer '{}': '{}' ({} E={} rows={} K={}) and '{}' ({} E={} rows={} K={}) are not the "
                    "[E, 2N, H] / [E, H, N] pair of one layer",
                    s.path().string(), layer, n13, to_string(w13.format), w13.experts, w13.rows, w13.k, n2,
                    to_string(w2.format), w2.experts, w2.rows, w2.k));
}

}  // namespace

std::vector<std::string> list_moe_layers(const fs::path& checkpoint) { return layers_of(Source(checkpoint)); }

MoeHostWeights load_moe_layer(const fs::path& checkpoint, std::string_view layer_key, unsigned topk) {
  const Source src(checkpoint);
  const std::string L(layer_key);
  const LayerReader rd(src, L);
  const std::string path = checkpoint.string();

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
        }
  }
  if (!ids.empty()) found.push_back(Layout::per_expert);
  if (found.empty()) {
    const auto layers = layers_of(src);
    throw InvalidArgument(fmt::format("{}: no MoE layer '{}'; layers found: {}", path, L,
                                      layers.empty() ? "none" : fmt::format("{}", fmt::join(layers, ", "))));
  }
  if (found.size() > 1 || naming.size() > 1)
    throw FormatError(
        fmt::format("{}: layer '{}' mixes stacked, gpt-oss and per-expert tensor names", path, L));

  MoeHostWeights w;
  std::uint64_t E = 0;
  if (found[0] != Layout::per_expert) {
    const bool oss = found[0] == Layout::gptoss;
    // The MoE API has no expert biases: running without them would be silently wrong.
    for (const char* b : {".gate_up_proj_bias", ".down_proj_bias", ".w13.bias", ".w2.bias"})
      if (src.find(L + b))
        throw Unsupported(fmt::format("{}: tensor '{}{}': expert biases are not supported by the MoE API",
                                      src.label_of(L + b), L, b));
    const std::string n13 = L + (oss ? ".gate_up_proj_blocks" : ".w13.weight");
    const std::string n2 = L + (oss ? ".down_proj_blocks" : ".w2.weight");
    Fp4 a = rd.fp4(n13, L + (oss ? ".gate_up_proj_scales" : ".w13.weight_scale"), true, oss);
    Fp4 b = rd.fp4(n2, L + (oss ? ".down_proj_scales" : ".w2.weight_scale"), true, oss);
    check_pair(src, L, a, n13, b, n2);
    E = a.experts;
    w.format = a.format;
    if (w.format == ScaleFormat::nvfp4) {
      w.w13_global = rd.globals(L + ".w13.weight_scale_2", E, true);
      w.w2_global = rd.globals(L + ".w2.weight_scale_2", E, true);
      rd.check_input_scale(L + ".w13.input_scale", E, true);
      rd.check_input_scale(L + ".w2.input_scale", E, true);
    } else {
      if (!oss) {
        rd.no_global(L + ".w13.weight_scale_2");
        rd.no_global(L + ".w2.weight_scale_2");
      }
      w.w13_global.assign(E, 1.0f);
      w.w2_global.assign(E, 1.0f);
    }
    w.geometry.hidden = static_cast<std::uint32_t>(a.k);
    w.geometry.intermediate = static_cast<std::uint32_t>(b.k);
    w.w13 = std::move(a.packed);
    w.w13_scales = std::move(a.scales);
    w.w2 = std::move(b.packed);
    w.w2_scales = std::move(b.scales);
  } else {
    E = *ids.rbegin() + 1;
    if (E > MoePlan::kMaxExperts)
      throw InvalidArgument(fmt::format("{}: layer '{}': expert index {} exceeds the MoE API's {} experts",
                                        path, L, E - 1, MoePlan::kMaxExperts));
    const PerExpertNames& pn = kPerExpert[*naming.begin()];
    for (std::uint64_t e = 0; e < E; ++e) {
      const std::string p = fmt::format("{}.{}.", L, e);
      const std::string ng = p + pn.gate + ".weight", nu = p + pn.up + ".weight",
                        nd = p + pn.down + ".weight";
      Fp4 g = rd.fp4(ng, ng + "_scale", false, false);
      Fp4 u = rd.fp4(nu, nu + "_scale", false, false);
      Fp4 d = rd.fp4(nd, nd + "_scale", false, false);
      if (g.format != u.format || g.rows != u.rows || g.k != u.k)
        throw FormatError(fmt::format("{}: layer '{}': '{}' ({} {}x{}) and '{}' ({} {}x{}) differ", path, L,
                                      ng, to_string(g.format), g.rows, g.k, nu, to_string(u.format), u.rows,
                                      u.k));
      // Gate and up stacked, gate rows first: the w13 order.
      Fp4 gu;
      gu.format = g.format;
      gu.rows = 2 * g.rows;
      gu.k = g.k;
      check_pair(src, L, gu, ng + " + " + nu, d, nd);
      if (e == 0) {
        w.format = g.format;
        w.geometry.hidden = static_cast<std::uint32_t>(g.k);
        w.geometry.intermediate = static_cast<std::uint32_t>(g.rows);
      } else if (g.format != w.format || g.k != w.geometry.hidden || g.rows != w.geometry.intermediate) {
        throw FormatError(
            fmt::format("{}: layer '{}': expert {} ('{}': {} N={} H={}) differs from expert 0 ({} N={} "
                        "H={})",
                        path, L, e, ng, to_string(g.format), g.rows, g.k, to_string(w.format),
                        w.geometry.intermediate, w.geometry.hidden));
      }
      w.w13.insert(w.w13.end(), g.packed.begin(), g.packed.end());
      w.w13.insert(w.w13.end(), u.packed.begin(), u.packed.end());
      w.w13_scales.insert(w.w13_scales.end(), g.scales.begin(), g.scales.end());
      w.w13_scales.insert(w.w13_scales.end(), u.scales.begin(), u.scales.end());
      w.w2.insert(w.w2.end(), d.packed.begin(), d.packed.end());
      w.w2_scales.insert(w.w2_scales.end(), d.scales.begin(), d.scales.end());
      if (w.format == ScaleFormat::nvfp4) {
        const float gg = rd.globals(ng + "_scale_2", 1, false)[0];
        const float ug = rd.globals(nu + "_scale_2", 1, false)[0];
        if (std::memcmp(&gg, &ug, sizeof gg) != 0)
          throw Unsupported(fmt::format(
              "{}: layer '{}': '{}_scale_2' ({}) and '{}_scale_2' ({}) differ; the MoE API has one global "
              "scale "
              "per expert for the fused gate/up projection, so this checkpoint would need requantization",
              path, L, ng, gg, nu, ug));
        w.w13_global.push_back(gg);
        w.w2_global.push_back(rd.globals(nd + "_scale_2", 1, false)[0]);
        for (const char* proj : {pn.gate, pn.up, pn.down})
          rd.check_input_scale(p + proj + ".input_scale", 1, false);
      } else {
        rd.no_global(ng + "_scale_2");
        rd.no_global(nu + "_scale_2");
        rd.no_global(nd + "_scale_2");
        w.w13_global.push_back(1.0f);
        w.w2_global.push_back(1.0f);
      }
    }
  }
  w.geometry.experts = static_cast<std::uint32_t>(std::min<std::uint64_t>(E, UINT32_MAX));
  w.geometry.topk = topk;
  w.geometry.order = GateUpOrder::w13;
  try {
    (void)plan_weights(w.format, w.geometry, MoeConstraints{});
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(fmt::format("{}: layer '{}' (E={} H={} N={} k={}): {}", path, L, w.geometry.experts,
                                      w.geometry.hidden, w.geometry.intermediate, topk, e.what()));
  }
  validate(w);
  return w;
}

}  // namespace csfmoe
