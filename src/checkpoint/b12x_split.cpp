// The stacked expert tensors split per expert, for `compress --schema b12x`.
//
// b12x / vLLM load one tensor per expert projection, so stacked [E, R, C]
// inputs (csf synth, ModelOpt's w13 / w2, gpt-oss's gate_up_proj_*) are first
// rewritten per expert, byte for byte, into a hidden folder and that is what
// gets compressed (decompress then gives the per-expert file back).

#include <fmt/format.h>

#include <map>
#include <set>

#include "checkpoint/b12x_file.hpp"
#include "checkpoint/detect.hpp"
#include "checkpoint/folder.hpp"
#include "checkpoint/verbs.hpp"
#include "csfmoe/errors.hpp"
#include "csfmoe/safetensors.hpp"

namespace csfmoe::detail {
namespace fs = std::filesystem;

namespace {

// One stacked name: the layer prefix (up to and including ".experts."), the
// per-expert projections its rows hold in order, and the per-expert suffix.
struct StackedName {
  std::string prefix;
  std::vector<std::string> projs;  // 2 for fused gate/up (rows split in halves), else 1
  std::string suffix;              // ".weight_scale", ".weight", ...
  bool gpt_oss_blocks = false;     // X_blocks [E, R, K/32, 16] -> w.weight [R, K/2]
};

std::optional<StackedName> parse_stacked(const std::string& name) {
  const auto at = name.rfind(".experts.");
  if (at == std::string::npos) return std::nullopt;
  StackedName s;
  s.prefix = name.substr(0, at + 9);
  const std::string rest = name.substr(at + 9);
  // ModelOpt / HF names: [gate; up] for w13 and gate_up_proj, [up; gate] for w31.
  static const std::map<std::string, std::vector<std::string>> dotted = {
      {"w13", {"gate_proj", "up_proj"}},
      {"gate_up_proj", {"gate_proj", "up_proj"}},
      {"w31", {"up_proj", "gate_proj"}},
      {"w1", {"gate_proj"}},
      {"w3", {"up_proj"}},
      {"gate_proj", {"gate_proj"}},
      {"up_proj", {"up_proj"}},
      {"w2", {"down_proj"}},
      {"down_proj", {"down_proj"}}};
  if (const auto dot = rest.find('.'); dot != std::string::npos) {
    const auto it = dotted.find(rest.substr(0, dot));
    if (it == dotted.end()) return std::nullopt;
    s.projs = it->second;
    s.suffix = rest.substr(dot);
    return s;
  }
  // gpt-oss MXFP4 names -> per-expert w1 / w3 / w2 (.weight_scale as in b12x's Kimi names; .weight, which
  // csfmoe's detection and load_moe_layer pair it with).
  static const std::map<std::string, std::vector<std::string>> oss = {{"gate_up_proj", {"w1", "w3"}},
                                                                      {"down_proj", {"w2"}}};
  for (const auto& [base, projs] : oss)
    for (const auto& [tail, suffix] :
         {std::pair{"_blocks", ".weight"}, {"_scales", ".weight_scale"}, {"_bias", ".bias"}})
      if (rest == base + tail) {
        s.projs = projs;
        s.suffix = suffix;
        s.gpt_oss_blocks = std::string_view(tail) == "_blocks";
        return s;
      }
  return std::nullopt;
}

// A per-expert tensor of the split: source bytes [begin, begin + n) of `src`.
struct SplitPiece {
  st::TensorInfo out;
  const st::TensorInfo* src;
  std::uint64_t offset;
};

// The tensors of `f` after the split (in data order), or nullopt when no
// expert scale of the file is stacked. Throws InvalidArgument naming the
// file and tensor for stacked inputs that cannot be split.
std::optional<std::vector<SplitPiece>> plan_expert_split(const st::File& f,
                                                         std::optional<ScaleLayout> layout) {
  const std::string label = f.path().string();
  const Detection det = detect_scales(f.header(), source_layout(f.header(), layout, label), label);
  bool stacked = false;
  for (const auto& c : det.scales)
    if (!c.layer.empty() &&
        (c.shape.experts != 1 || (parse_stacked(c.name) && f.find(c.name)->shape.size() >= 3)))
      stacked = true;  // [1, R, C] too: b12x wants per-expert names
  if (!stacked) return std::nullopt;
  const auto fail = [&](const st::TensorInfo& t, const std::string& why) {
    return InvalidArgument(
        fmt::format("{}: tensor '{}' {}: cannot split it per expert for the b12x schema: {}", label, t.name,
                    shape_str(t.shape), why));
  };
  // Experts per layer, from the tensors with rows (per-expert scalars are [E] or shared []).
  std::map<std::string, std::uint64_t> experts;
  for (const auto& t : f.tensors())
    if (auto s = parse_stacked(t.name); s && t.shape.size() >= 2) {
      auto [it, fresh] = experts.emplace(s->prefix, t.shape[0]);
      if (!fresh && it->second != t.shape[0])
        throw fail(t,
                   fmt::format("{} experts where the layer's other tensors have {}", t.shape[0], it->second));
    }
  for (const auto& c : det.scales)
    if (!c.layer.empty() && c.shape.experts != 1) {
      const auto s = parse_stacked(c.name);
      if (!s || !experts.count(s->prefix) || c.shape.experts != experts.at(s->prefix))
        throw fail(*f.find(c.name),
                   "unknown stacked naming (known: experts.{w13,w31,gate_up_proj,w1,w3,w2,"
                   "gate_proj,up_proj,down_proj}.X and gpt-oss experts.{gate_up_proj,down_proj}"
                   "_{blocks,scales,bias})");
      if (s->projs.size() == 2 && c.shape.layout != ScaleLayout::row_major)
        throw fail(*f.find(c.name), fmt::format("a {} scale grid cannot be cut into gate and up rows",
                                                to_string(c.shape.layout)));
    }
  std::set<std::string> names;
  for (const auto& t : f.tensors()) names.insert(t.name);
  std::vector<SplitPiece> out;
  std::uint64_t pos = 0;
  const auto add = [&](const st::TensorInfo& src, std::string name, std::vector<std::uint64_t> shape,
                       std::uint64_t offset, std::uint64_t n, bool renamed = true) {
    if (renamed && names.count(name))
      throw fail(src, fmt::format("its per-expert name '{}' is already a tensor", name));
    SplitPiece& p = out.emplace_back();
    p.out.name = std::move(name);
    p.out.dtype = src.dtype;
    p.out.shape = std::move(shape);
    p.out.begin = pos;
    p.out.end = pos += n;
    p.src = &src;
    p.offset = offset;
  };
  for (const auto* t : data_order(f.header())) {
    const auto s = parse_stacked(t->name);
    if (!s || !experts.count(s->prefix)) {
      add(*t, t->name, t->shape, 0, t->nbytes(), false);
      continue;
    }
    const std::uint64_t E = experts.at(s->prefix), halves = s->projs.size();
    const std::string stem = s->prefix;
    if (t->shape.empty()) {  // one scalar shared by every expert: copied to each
      for (std::uint64_t e = 0; e < E; ++e)
        for (const auto& p : s->projs)
          add(*t, fmt::format("{}{}.{}{}", stem, e, p, s->suffix), {}, 0, t->nbytes());
      continue;
    }
    if (t->shape[0] != E)
      throw fail(*t, fmt::format("leading dimension {} is not the layer's {} experts", t->shape[0], E));
    std::vector<std::uint64_t> inner(t->shape.begin() + 1, t->shape.end());
    const std::uint64_t per_expert = t->nbytes() / E;
    if (!inner.empty() && halves == 2 && inner[0] % 2)
      throw fail(*t, fmt::format("{} rows do not split into gate and up halves", inner[0]));
    if (!inner.empty() && halves == 2) inner[0] /= 2;
    if (s->gpt_oss_blocks) {  // [R, K/32, 16] -> [R, K/2]: the same bytes
      if (inner.size() != 3 || inner[2] != 16) throw fail(*t, "gpt-oss blocks must be [E, R, K/32, 16]");
      inner = {inner[0], inner[1] * 16};
    }
    const std::uint64_t piece = inner.empty() ? per_expert : per_expert / halves;
    for (std::uint64_t e = 0; e < E; ++e)
      for (std::uint64_t h = 0; h < halves; ++h)
        add(*t, fmt::format("{}{}.{}{}", stem, e, s->projs[h], s->suffix), inner,
            e * per_expert + (inner.empty() ? 0 : h * piece), piece);
  }
  return out;
}

void write_split_file(const st::File& f, const std::vector<SplitPiece>& pieces, const fs::path& dest) {
  std::vector<st::TensorInfo> planned;
  for (const auto& p : pieces) planned.push_back(p.out);
  const auto& md = f.header().metadata;
  st::Writer w(dest, st::Writer::header_json_size(planned, md) + 64);
  for (const auto& p : pieces)
    w.add_tensor(p.out.name, p.out.dtype, p.out.shape, f.data(*p.src).subspan(p.offset, p.out.nbytes()));
  w.commit(md);
}

}  // namespace

bool split_stacked_experts(const fs::path& in, const fs::path& out, std::optional<ScaleLayout> layout) {
  const auto plain = [](const st::File& f) {
    return !container_info(f) && !foreign_b12x(f, f.path().string());
  };
  if (!fs::is_directory(in)) {
    const st::File f = st::File::open(in);
    if (!plain(f)) return false;
    const auto plan = plan_expert_split(f, layout);
    if (plan) write_split_file(f, *plan, out);
    return plan.has_value();
  }
  Folder f = open_folder(in);
  if (f.manifest) return false;
  check_index_tensors(f, in);
  std::map<std::string, std::vector<SplitPiece>> plans;
  for (const auto& [n, file] : f.files)
    if (plain(file))
      if (auto p = plan_expert_split(file, layout)) plans.emplace(n, std::move(*p));
  if (plans.empty()) return false;
  std::error_code ec;
  if (!fs::create_directory(out, ec) || ec)
    throw IoError(fmt::format("{}: cannot create folder: {}", out.string(), ec ? ec.message() : "exists"));
  std::uint64_t total = 0;
  for (const auto& [n, file] : f.files) {
    if (auto it = plans.find(n); it != plans.end()) {
      write_split_file(file, it->second, out_file(out, n));
    } else {
      copy_plain(file.path(), out_file(out, n));
    }
    total += st::File::open(out / n).data_size();
  }
  for (const auto& n : f.others) f.copy_other(in, n, out / n);
  if (f.index) {
    // weight_map: each stacked tensor becomes its per-expert tensors, in the same shard.
    std::map<std::string, std::vector<std::string>> renamed;
    for (const auto& [n, pieces] : plans)
      for (const auto& p : pieces) renamed[n + '\0' + p.src->name].push_back(p.out.name);
    IndexEdit edit;
    edit.weight_map = &f.index->weight_map;
    edit.rename = [&renamed](const std::string& tensor,
                             const std::string& s) -> std::optional<std::vector<std::string>> {
      const auto it = renamed.find(s + '\0' + tensor);
      if (it == renamed.end()) return std::nullopt;
      return it->second;
    };
    edit.total_size = total;
    write_file(out / st::kIndexFileName,
               *edit_index(parse_index_json(f.index->raw, (in / st::kIndexFileName).string()), edit));
  }
  return true;
}

}  // namespace csfmoe::detail
