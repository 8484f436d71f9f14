// Tensor-parallel slicing of checkpoints, tensor by tensor, bytes only (and
// CSF planes without re-encoding).
#include "checkpoint/tp_slice.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <string_view>

#include "checkpoint/b12x_file.hpp"
#include "checkpoint/container.hpp"
#include "checkpoint/detect.hpp"
#include "checkpoint/folder.hpp"
#include "csfmoe/checkpoint.hpp"
#include "csfmoe/checkpoint_reader.hpp"
#include "csfmoe/errors.hpp"
#include "csfmoe/safetensors.hpp"
#include "csfmoe/tensor_slice.hpp"

namespace csfmoe::detail {
namespace fs = std::filesystem;

namespace {

struct Sliced {
  std::vector<std::uint64_t> shape;
  std::vector<std::uint8_t> bytes;  // empty when the tensor is copied as is
  bool copy = true;
};

// Planes of a CSF tensor sliced to rows `rr` and columns `cr` of each
// expert's grid, or nullopt where the cut is not on plane boundaries (or the
// tensor is not row-major): the compressor then encodes the slice.
std::optional<std::vector<CsfPlanes>> slice_csf_planes(const CheckpointFile& f, const std::string& name,
                                                       std::span<const AxisRange> rr, AxisRange cr) {
  const CsfEntryInfo* e = f.csf_entry(name);
  if (!e || e->grid.layout != ScaleLayout::row_major) return std::nullopt;
  const std::uint64_t col_granule = e->grid.format == ScaleFormat::nvfp4 ? 2 : 1;
  for (const auto& r : rr)
    if (r.first % plane_slab_rows || r.count % plane_slab_rows) return std::nullopt;
  if (cr.first % col_granule || cr.count % col_granule) return std::nullopt;
  try {
    check_plane_shape(PlaneShape{e->grid.format, e->grid.rows, e->grid.cols}, name);
  } catch (const InvalidArgument&) {
    return std::nullopt;
  }
  const std::vector<CsfPlanes> whole = csf_to_planes(f.csf_parts(name), name);
  std::vector<CsfPlanes> out;
  for (const auto& p : whole) out.push_back(slice_planes(p, rr, cr, name));
  return out;
}

constexpr std::string_view kGateUpBias = ".gate_up_proj_bias", kDownBias = ".down_proj_bias";

// The prefixes L of gpt-oss layers proper: those with `L.gate_up_proj_bias`
// or `L.down_proj_bias` in any of the files (resolve_moe_layer's marker).
// Their gate/up rows are interleaved (row 2i gate i, row 2i + 1 up i).
void add_gpt_oss_layers(const CheckpointFile& f, std::set<std::string>& layers) {
  for (const auto& t : f.tensors())
    for (const std::string_view suffix : {kGateUpBias, kDownBias})
      if (t.name.ends_with(suffix)) layers.insert(t.name.substr(0, t.name.size() - suffix.size()));
}

// Whether `name` is `L<leaf>`, `leaf` one of `leaves`, for an L in `layers`.
bool in_gpt_oss_layer(const std::string& name, std::initializer_list<std::string_view> leaves,
                      const std::set<std::string>& layers) {
  for (const std::string_view leaf : leaves)
    if (name.ends_with(leaf) && layers.count(name.substr(0, name.size() - leaf.size()))) return true;
  return false;
}

class FileSlicer {
 public:
  // `gpt_oss_layers`: see add_gpt_oss_layers (collected over every file of a
  // folder: a layer's bias may sit in another shard than its weights).
  FileSlicer(const CheckpointFile& f, unsigned tp, unsigned rank, std::optional<ScaleLayout> layout,
             std::map<std::string, std::vector<CsfPlanes>>* planes,
             const std::set<std::string>& gpt_oss_layers)
      : f_(f),
        tp_(tp),
        rank_(rank),
        label_(f.path().string()),
        det_(detect_scales(f.header(), source_layout(f.header(), layout, label_), label_)),
        planes_(planes),
        gpt_oss_layers_(gpt_oss_layers) {
    for (const auto& c : det_.scales) by_companion_[c.companion] = &c;
  }

  // New shape (and bytes unless shape_only) of one tensor.
  Sliced slice(const st::TensorInfo& t, bool shape_only) const {
    Sliced out;
    out.shape = t.shape;
    TpSplit split = tensor_parallel_split_of(t.name);
    if (split == TpSplit::none) return out;
    // gpt-oss proper (vLLM's loader): gate/up rows interleaved, so each
    // rank keeps the contiguous rows [2 r n, 2 (r + 1) n) of the 2N (pairs
    // stay together); the down bias is whole on rank 0 and zero elsewhere,
    // so that summing the ranks adds it once.
    if (split == TpSplit::gate_up_rows &&
        in_gpt_oss_layer(t.name, {".gate_up_proj_blocks", ".gate_up_proj_scales", kGateUpBias},
                         gpt_oss_layers_))
      split = TpSplit::rows;
    if (in_gpt_oss_layer(t.name, {kDownBias}, gpt_oss_layers_)) {
      if (rank_ == 0) return out;
      out.copy = false;
      if (!shape_only) {
        std::uint64_t n = st::dtype_size(t.dtype);
        for (auto d : t.shape) n *= d;
        out.bytes.assign(n, 0);
      }
      return out;
    }
    const std::string what = fmt::format("{}: tensor '{}' ({} split)", label_, t.name, to_string(split));
    const std::vector<std::uint8_t> data = shape_only ? std::vector<std::uint8_t>{} : f_.read(t.name);
    const std::size_t nd = t.shape.size();
    if (const ScaleCandidate* c = det_.find(t.name)) {
      // A block-scale grid: slice its true rows/cols, keep its layout.
      const st::TensorInfo* w = f_.find(c->companion);
      const bool blocks = c->companion.ends_with("_blocks");
      const std::uint64_t R = w->shape[nd - 2];
      const std::uint64_t K = blocks ? w->shape[nd - 1] * 32 : w->shape[nd - 1] * 2;
      const std::uint64_t cols = K / group_size(c->shape.format);
      std::vector<AxisRange> rr{{0, R}};
      AxisRange cr{0, cols};
      if (split == TpSplit::cols)
        cr = even_ranges(cols, split, 1, what + " scale columns")[0];
      else
        rr = even_ranges(R, split, 1, what + " scale rows");
      std::uint64_t r_out = 0;
      for (const auto& r : rr) r_out += r.count;
      const bool swz = c->shape.layout == ScaleLayout::swizzled_128x4;
      out.shape[nd - 2] = swz ? round_up(r_out, 128) : r_out;
      out.shape[nd - 1] = swz ? round_up(cr.count, 4) : cr.count;
      out.copy = false;
      if (!shape_only) {
        out.bytes = slice_scale_grid(c->shape, std::uint32_t(R), std::uint32_t(cols), data, rr, cr);
        if (planes_)
          if (auto p = slice_csf_planes(f_, t.name, rr, cr)) (*planes_)[t.name] = std::move(*p);
      }
      return out;
    }
    std::size_t axis = 0;
    std::uint64_t granule = 1;
    if (auto it = by_companion_.find(t.name); it != by_companion_.end()) {
      // Packed FP4 weight: [.., R, K/2] bytes or [.., R, K/32, 16] blocks.
      const bool blocks = t.name.ends_with("_blocks");
      const std::size_t row_axis = blocks ? nd - 3 : nd - 2, col_axis = blocks ? nd - 2 : nd - 1;
      axis = split == TpSplit::cols ? col_axis : row_axis;
      // Column pieces must be whole scale groups (bytes per group: g/2).
      if (split == TpSplit::cols && !blocks) granule = group_size(it->second->shape.format) / 2;
    } else if (t.name.ends_with("bias")) {
      // Down-projection biases are not split (gpt-oss proper's, above, are
      // zero on every rank but 0): whoever sums the ranks adds them once.
      if (split == TpSplit::cols || nd == 0) return out;
      axis = nd - 1;
    } else if (nd <= 1 || t.shape.back() == 1) {
      return out;  // global / input scales: one value per expert
    } else {
      throw Unsupported(fmt::format(
          "{}: {} {} is an expert projection tensor of unknown kind (not a packed FP4 weight with detected "
          "scales, "
          "its scale, a bias or a per-expert scalar); cannot tell which axis to split for tp = {}",
          what, st::to_string(t.dtype), fmt::format("[{}]", fmt::join(t.shape, ", ")), tp_));
    }
    const auto ranges = even_ranges(t.shape[axis], split, granule, what);
    std::uint64_t kept = 0;
    for (const auto& r : ranges) kept += r.count;
    out.shape[axis] = kept;
    out.copy = false;
    if (!shape_only) out.bytes = slice_axis(data, t.shape, st::dtype_size(t.dtype), axis, ranges);
    return out;
  }

  // This rank's pieces of an axis; only even splits. vLLM's slicer pads
  // the last rank's planes to the common row count instead (rows of base
  // 0x38, no records): those rows are in no checkpoint, so such a slice would
  // no longer restore to bytes of its source, and csfmoe refuses it.
  std::vector<AxisRange> even_ranges(std::uint64_t length, TpSplit split, std::uint64_t granule,
                                     const std::string& what) const {
    try {
      return tensor_parallel_axis_ranges(length, split, tp_, rank_, granule, what);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(fmt::format(
          "{}; csfmoe writes even tensor-parallel slices only (vLLM pads the last rank's planes with rows of "
          "base 0x38 and no records at load time, bytes that no checkpoint holds): choose a tp that divides "
          "it",
          e.what()));
    }
  }

  // The slice's metadata and tensors (shapes and offsets), without reading data.
  void plan() {
    // The original's metadata (a container's logical header holds it).
    md_ = f_.header().metadata.value_or(st::Metadata{});
    if (md_.count(kTpKey))
      throw InvalidArgument(fmt::format("{} is already a tensor-parallel slice (tp = {}, rank = {})", label_,
                                        md_[kTpKey], md_.count(kTpRankKey) ? md_[kTpRankKey] : "?"));
    md_[kTpKey] = std::to_string(tp_);
    md_[kTpRankKey] = std::to_string(rank_);
    // Data order of the source, so that the slice reads like the original.
    order_.clear();
    for (const auto& t : f_.tensors()) order_.push_back(&t);
    std::stable_sort(order_.begin(), order_.end(), [](auto* a, auto* b) { return a->begin < b->begin; });
    planned_.clear();
    sliced_bytes_ = source_bytes_ = 0;
    for (const auto* t : order_) {
      st::TensorInfo p = *t;
      p.shape = slice(*t, true).shape;
      std::uint64_t n = st::dtype_size(t->dtype);
      for (auto d : p.shape) n *= d;
      p.begin = sliced_bytes_;
      sliced_bytes_ += n;
      p.end = sliced_bytes_;
      source_bytes_ += t->nbytes();
      planned_.push_back(std::move(p));
    }
  }
  std::uint64_t source_bytes() const { return source_bytes_; }  // logical bytes read
  std::uint64_t sliced_bytes() const { return sliced_bytes_; }  // data bytes written

  // After plan(); `tick` gets each source tensor's bytes once it is written.
  void write(const fs::path& dest, const std::function<void(std::uint64_t, const std::string&)>& tick) const {
    st::Writer w(dest, st::Writer::header_json_size(planned_, md_) + 64);
    for (const auto* t : order_) {
      Sliced s = slice(*t, false);
      if (s.copy)
        w.add_tensor(t->name, t->dtype, t->shape, f_.read(t->name));
      else
        w.add_tensor(t->name, t->dtype, std::move(s.shape), s.bytes);
      if (tick) tick(t->nbytes(), t->name);
    }
    w.commit(md_);
  }

 private:
  const CheckpointFile& f_;
  unsigned tp_, rank_;
  std::string label_;
  Detection det_;
  std::map<std::string, std::vector<CsfPlanes>>* planes_;  // optional: sliced planes of CSF tensors
  const std::set<std::string>& gpt_oss_layers_;
  std::map<std::string, const ScaleCandidate*> by_companion_;
  st::Metadata md_;
  std::vector<const st::TensorInfo*> order_;
  std::vector<st::TensorInfo> planned_;
  std::uint64_t source_bytes_ = 0, sliced_bytes_ = 0;
};

// The shard index of a slice: the source's (a container folder's rewritten
// index gives back the original), with metadata.total_size, where present,
// set to the slice's data bytes, and b12x plane entries renamed to their
// scale (the slice is native, as decompress writes it).
std::string sliced_index(const fs::path& index_file, std::uint64_t total_size,
                         const std::map<std::string, std::string>& plane_to_scale) {
  using ojson = nlohmann::ordered_json;
  const st::ShardIndex idx = st::read_shard_index(index_file);
  const std::string orig = original_index(idx.raw, index_file.string()).value_or(idx.raw);
  ojson j;
  try {
    j = ojson::parse(orig);
  } catch (const nlohmann::json::exception&) {
    throw FormatError(fmt::format("{}: not valid JSON", index_file.string()));
  }
  IndexEdit edit;
  if (!plane_to_scale.empty()) edit = renaming(idx.weight_map, plane_to_scale);
  edit.total_size = total_size;
  return edit_index(std::move(j), edit).value_or(orig);
}

}  // namespace

TpSliceBytes slice_checkpoint_tp(const fs::path& in, const fs::path& out, unsigned tp, unsigned rank,
                                 std::optional<ScaleLayout> layout, SlicedPlanes* planes,
                                 const ProgressFn& progress) {
  if (tp == 0) throw InvalidArgument("tp must be at least 1");
  if (rank >= tp) throw InvalidArgument(fmt::format("rank {} is not below tp {}", rank, tp));
  TpSliceBytes bytes;
  // Progress counts the source bytes read, out of all the job's bytes
  // (source + slice: the compressor continues from here).
  const auto ticker = [&](const std::string& file) {
    return [&, file](std::uint64_t n, const std::string& tensor) {
      bytes.done += n;
      if (progress)
        progress(Progress{bytes.done, bytes.source + bytes.sliced,
                          fmt::format("{}{}{} (tp slice)", file, tensor.empty() ? "" : ":", tensor)});
    };
  };
  if (!fs::is_directory(in)) {
    const CheckpointFile f = CheckpointFile::open(in);
    std::set<std::string> gpt_oss_layers;
    add_gpt_oss_layers(f, gpt_oss_layers);
    FileSlicer s(f, tp, rank, layout, planes ? &(*planes)[""] : nullptr, gpt_oss_layers);
    s.plan();
    bytes.source = s.source_bytes();
    bytes.sliced = s.sliced_bytes();
    ticker(in.filename().string())(0, "");  // the bar starts before the first tensor is read
    s.write(out, ticker(in.filename().string()));
    return bytes;
  }
  if (read_manifest_export(in))
    throw Unsupported(
        fmt::format("{}: tensor-parallel slices of b12x's manifest export are not supported; "
                    "decompress it first",
                    in.string()));
  std::error_code ec;
  if (!fs::create_directory(out, ec) || ec)
    throw IoError(
        fmt::format("{}: cannot create folder: {}", out.string(), ec ? ec.message() : "already exists"));
  // Shards an index lists in a sub-folder ("tensors/x.safetensors") are
  // sliced in place, the sub-folder's other files copied.
  std::set<std::string> nested;
  if (fs::exists(fs::symlink_status(in / st::kIndexFileName, ec)))
    for (const auto& s : st::read_shard_index(in / st::kIndexFileName).shards)
      if (s.find('/') != std::string::npos) nested.insert(s);
  std::vector<std::string> names;
  for (const auto& de : fs::directory_iterator(in)) names.push_back(de.path().filename().string());
  std::sort(names.begin(), names.end());
  const auto holds_nested = [&](const std::string& dir) {
    const auto it = nested.lower_bound(dir + "/");
    return it != nested.end() && it->starts_with(dir + "/");
  };
  // Every shard is opened and planned first: the job's size is known from the start.
  std::map<std::string, CheckpointFile> files;
  for (const auto& n : names) {
    if (fs::is_symlink(fs::symlink_status(in / n, ec)))
      throw Unsupported(
          fmt::format("{}: '{}' is a symlink; tensor-parallel slicing needs plain files", in.string(), n));
    if (n.ends_with(".safetensors") && !holds_nested(n))
      files.emplace(n, CheckpointFile::open(st::resolve_inside(in, n, in.string())));
  }
  for (const auto& r : nested) files.emplace(r, CheckpointFile::open(st::resolve_shard(in, r, in.string())));
  // The slice is native: the index entries of b12x planes become their scale's.
  std::map<std::string, std::string> plane_to_scale;
  std::set<std::string> gpt_oss_layers;  // of all the shards, before any is sliced
  for (const auto& [n, f] : files) add_gpt_oss_layers(f, gpt_oss_layers);
  std::map<std::string, FileSlicer> slicers;
  for (const auto& [n, f] : files) {
    if (f.is_b12x())
      for (const auto& e : f.csf_entries())
        for (const auto& part : e.parts) plane_to_scale[part] = e.name;
    FileSlicer& s =
        slicers.try_emplace(n, f, tp, rank, layout, planes ? &(*planes)[n] : nullptr, gpt_oss_layers)
            .first->second;
    s.plan();
    bytes.source += s.source_bytes();
    bytes.sliced += s.sliced_bytes();
  }
  if (!files.empty()) ticker(files.begin()->first)(0, "");  // the bar starts before the first tensor is read
  const auto slice_tree = [&](const auto& self, const fs::path& from, const fs::path& to,
                              const std::string& rel) -> void {
    std::error_code e2;
    if (!fs::create_directory(to, e2) || e2)
      throw IoError(
          fmt::format("{}: cannot create folder: {}", to.string(), e2 ? e2.message() : "already exists"));
    for (const auto& de : fs::directory_iterator(from)) {
      const std::string name = de.path().filename().string(), r = rel + "/" + name;
      if (nested.count(r)) {
        slicers.at(r).write(to / name, ticker(r));
      } else if (!de.is_symlink(e2) && de.is_directory(e2)) {
        self(self, de.path(), to / name, r);
      } else {
        fs::copy(de.path(), to / name, fs::copy_options::copy_symlinks, e2);
        if (e2)
          throw IoError(fmt::format("cannot copy {} to {}: {}", de.path().string(), (to / name).string(),
                                    e2.message()));
      }
    }
  };
  for (const auto& n : names) {
    const fs::path p = in / n;
    if (holds_nested(n)) {
      slice_tree(slice_tree, p, out / n, n);
    } else if (n.ends_with(".safetensors")) {
      slicers.at(n).write(out / n, ticker(n));
    } else if (n == st::kIndexFileName) {
      // The index names tensors, not shapes: it stays valid for the slice,
      // with the slice's total_size.
      write_file(out / n, sliced_index(p, bytes.sliced, plane_to_scale));
    } else {
      fs::copy(p, out / n, fs::copy_options::recursive | fs::copy_options::copy_symlinks, ec);
      if (ec)
        throw IoError(fmt::format("cannot copy {} to {}: {}", p.string(), (out / n).string(), ec.message()));
    }
  }
  return bytes;
}

}  // namespace csfmoe::detail
