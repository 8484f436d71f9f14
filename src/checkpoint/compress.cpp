// compress: a safetensors checkpoint (file or folder) into CSF containers,
// whole or as one tensor-parallel rank's slice, in csfmoe's own container or
// the b12x schema.
#include <fmt/format.h>

#include <algorithm>
#include <set>

#include "checkpoint/b12x_file.hpp"
#include "checkpoint/container.hpp"
#include "checkpoint/detect.hpp"
#include "checkpoint/folder.hpp"
#include "checkpoint/storage_table.hpp"
#include "checkpoint/tp_slice.hpp"
#include "checkpoint/verbs.hpp"
#include "csfmoe/checkpoint.hpp"
#include "csfmoe/errors.hpp"
#include "csfmoe/safetensors.hpp"

namespace csfmoe::detail {
namespace fs = std::filesystem;

namespace {

// The container entry of scale tensor t stored as CSF.
CsfEntry csf_entry(const st::TensorInfo& t, const ScaleCandidate& c, std::uint32_t crc32,
                   std::uint64_t exceptions) {
  CsfEntry e;
  e.name = t.name;
  e.dtype = t.dtype;
  e.shape = t.shape;
  e.grid = c.shape;
  e.crc32 = crc32;
  e.exceptions = exceptions;
  e.layer = c.layer;
  return e;
}

// Data-section bytes outside every tensor.
std::vector<Gap> find_gaps(const st::File& f) {
  std::vector<Gap> gaps;
  std::uint64_t pos = 0;
  const auto data = f.data_section();
  auto add = [&](std::uint64_t b, std::uint64_t e) {
    if (e > b) gaps.push_back({b, std::string(reinterpret_cast<const char*>(data.data()) + b, e - b)});
  };
  for (const auto* t : data_order(f.header())) {
    if (!t->nbytes()) continue;
    add(pos, t->begin);
    pos = t->end;
  }
  add(pos, f.data_size());
  return gaps;
}

std::string ratio_reason(std::uint64_t enc, std::uint64_t src) {
  return fmt::format("CSF would be {:.1f}% of the source ({} vs {} bytes)",
                     src ? 100.0 * double(enc) / double(src) : 0.0, enc, src);
}

// Builds the original-file restore record fields shared by compress and its header bound.
ContainerInfo base_info(const st::File& f) {
  ContainerInfo info;
  info.original_header = std::string(f.header_bytes());
  info.original_file_size = f.file_size();
  info.gaps = find_gaps(f);
  return info;
}

}  // namespace

// Tensors in data order (stable for empty tensors that share an offset).
std::vector<const st::TensorInfo*> data_order(const st::Header& h) {
  std::vector<const st::TensorInfo*> v;
  for (const auto& t : h.tensors) v.push_back(&t);
  std::stable_sort(v.begin(), v.end(),
                   [](const st::TensorInfo* a, const st::TensorInfo* b) { return a->begin < b->begin; });
  return v;
}

TensorReport base_report(const std::string& file, const st::TensorInfo& t) {
  TensorReport r;
  r.file = file;
  r.name = t.name;
  r.dtype = std::string(st::to_string(t.dtype));
  r.shape = t.shape;
  return r;
}

void add_totals(CheckpointReport& rep, const TensorReport& t, std::uint64_t source, std::uint64_t stored) {
  rep.file_source_bytes += source;
  rep.file_stored_bytes += stored;
  if (t.format) {
    rep.scale_source_bytes += source;
    rep.scale_stored_bytes += stored;
  }
}

void set_resident(TensorReport& tr, const CsfTensor& enc) {
  tr.resident_bytes = enc.encoded_bytes();
  tr.b12x_resident_bytes = enc.fixed.size() + 4 * std::uint64_t(enc.exceptions.size()) +
                           8 * std::uint64_t{enc.geometry.partitions_per_expert} * enc.geometry.shape.experts;
}

std::uint64_t original_data_bytes(const ContainerInfo& info) {
  return info.original_file_size - std::min(info.original_file_size, 8 + info.original_header.size());
}

FileResult compress_file(const st::File& src, const fs::path& dest, const std::string& file, Job& job,
                         CheckpointReport& rep, bool write,
                         const std::map<std::string, std::vector<CsfPlanes>>* sliced) {
  const std::string label = src.path().string();
  const CompressOptions& opt = job.opt;
  const Detection det = detect_scales(src.header(), source_layout(src.header(), opt.layout, label), label);
  const auto order = data_order(src.header());

  // Candidates whose part names would collide with a tensor of the file stay native.
  std::set<std::string> names;
  for (const auto& t : src.tensors()) names.insert(t.name);
  std::map<std::string, std::string> unusable;
  std::map<std::string, CsfGeometry> geoms;
  for (const auto& c : det.scales) {
    const auto p = part_names(c.name);
    for (const std::string* n : p.all())
      if (names.count(*n))
        unusable[c.name] = fmt::format("part name '{}' is already a tensor of the file", *n);
    if (unusable.count(c.name)) continue;
    try {
      geoms.emplace(c.name, CsfGeometry::of(c.shape));
    } catch (const InvalidArgument& e) {
      unusable[c.name] = fmt::format("not encodable as CSF: {}", e.what());
    }
  }

  // Upper bound of the container header, reserved before the data is written.
  ContainerInfo info = base_info(src);
  std::optional<st::Metadata> md = src.header().metadata;
  std::vector<BoundTensor> bound_tensors;
  for (const auto* t : order) {
    BoundTensor& b = bound_tensors.emplace_back();
    b.tensor = t;
    if (const ScaleCandidate* c = det.find(t->name)) {
      b.scale = true;
      b.layer = c->layer;
      if (auto g = geoms.find(t->name); g != geoms.end()) b.csf = &g->second;
    }
  }
  const std::uint64_t reserve = container_header_bound(info, bound_tensors, md);
  if (write && reserve > st::kMaxHeaderBytes)
    throw Unsupported(
        fmt::format("{}: the container header would need up to {} bytes, over the safetensors limit of {}",
                    label, reserve, st::kMaxHeaderBytes));

  std::optional<st::Writer> w;
  if (write) w.emplace(dest, reserve);
  FileResult result;
  std::map<std::string, std::uint32_t> crcs;
  const CodecOptions copts = codec_options(opt);

  for (const auto* t : order) {
    const auto data = src.data(*t);
    const std::uint32_t c32 = crc_of(data);
    crcs[t->name] = c32;
    TensorReport tr = base_report(file, *t);
    const ScaleCandidate* cand = det.find(t->name);
    if (auto r = det.rejected.find(t->name); r != det.rejected.end()) tr.reason = r->second;
    bool stored_csf = false;
    std::uint64_t stored_bytes = data.size();
    if (cand) {
      tr.format = cand->shape.format;
      tr.layer = cand->layer;
      const bool b12x = opt.schema == CheckpointSchema::b12x;
      if (auto u = unusable.find(t->name); u != unusable.end()) {
        if (b12x && !cand->layer.empty())
          throw InvalidArgument(fmt::format("{}: tensor '{}': cannot be stored in the b12x schema: {}", label,
                                            t->name, u->second));
        tr.action = TensorAction::native_kept;
        tr.reason = u->second;
      } else if (b12x && cand->layer.empty()) {
        tr.action = TensorAction::native_kept;
        tr.reason = "b12x schema: only expert projections are stored as CSF";
      } else {
        if (b12x && cand->shape.experts != 1)
          throw InvalidArgument(fmt::format(
              "{}: tensor '{}': stacked expert scales {} reached the b12x writer unsplit (the split per "
              "expert runs before it; please report this)",
              label, t->name, shape_str(t->shape)));
        if (b12x && !planes_storable(cand->shape))
          throw InvalidArgument(fmt::format(
              "{}: tensor '{}': a {} grid of {} x {} cannot be stored in the b12x schema (rows a multiple of "
              "16, NVFP4 columns even, row-major)",
              label, t->name, to_string(cand->shape.layout), cand->shape.rows, cand->shape.cols));
        // Planes cut from a compressed input keep its bases: no encoding.
        const std::vector<CsfPlanes>* presliced = nullptr;
        if (sliced)
          if (auto it = sliced->find(t->name); it != sliced->end() && planes_storable(cand->shape))
            presliced = &it->second;
        CsfTensor enc = presliced ? planes_to_csf(*presliced, t->name) : encode(cand->shape, data, copts);
        tr.stats = stats(enc);
        set_resident(tr, enc);
        // Exactness is the point: prove it before storing anything.
        std::vector<std::uint8_t> back(data.size());
        decode(enc, cand->shape.layout, back, copts, /*trusted=*/true);
        if (!std::equal(back.begin(), back.end(), data.begin()))
          throw CorruptData(fmt::format(
              "{}: tensor '{}': CSF round trip does not reproduce the source (codec bug)", label, t->name));
        // Stored as planes (what b12x stores) where the grid allows, proven exact too.
        std::vector<CsfPlanes> planes;
        if (presliced) {
          planes = *presliced;
        } else if (planes_storable(cand->shape)) {
          planes = csf_to_planes(enc, t->name);
        }
        if (!planes.empty()) {
          const std::uint64_t per_expert = std::uint64_t{cand->shape.rows} * cand->shape.cols;
          for (std::size_t x = 0; x < planes.size(); ++x) {
            const std::vector<std::uint8_t> grid = decode_planes(planes[x], t->name);
            if (!std::equal(grid.begin(), grid.end(), data.begin() + std::ptrdiff_t(x * per_expert)))
              throw CorruptData(
                  fmt::format("{}: tensor '{}': expert {}: planes do not reproduce the source (codec bug)",
                              label, t->name, x));
          }
        }
        // The naming is the schema's; the payload planes where the grid allows, else the resident form.
        const CsfNaming naming = b12x ? CsfNaming::b12x : CsfNaming::container;
        CsfPayload payload = planes.empty() ? CsfPayload::resident : CsfPayload::planes;
        // MXFP4 planes in slab form when that is smaller (never when larger), proven to give the planes back.
        std::vector<Mxfp4SlabPlanes> slab_form;
        if (naming == CsfNaming::container && payload == CsfPayload::planes &&
            cand->shape.format == ScaleFormat::mxfp4 && opt.mxfp4_slab) {
          for (const CsfPlanes& pl : planes) {
            slab_form.push_back(planes_to_mxfp4_slabs(pl, t->name));
            const CsfPlanes back_planes = mxfp4_slabs_to_planes(slab_form.back(), t->name);
            if (back_planes.fixed != pl.fixed || back_planes.exceptions != pl.exceptions)
              throw CorruptData(fmt::format(
                  "{}: tensor '{}': MXFP4 slabs do not reproduce the planes (codec bug)", label, t->name));
          }
          const CsfForms both{&enc, planes, slab_form};
          if (storage_of(CsfPayload::mxfp4_slab, naming).stored_bytes(both) <
              storage_of(CsfPayload::planes, naming).stored_bytes(both))
            payload = CsfPayload::mxfp4_slab;
        }
        const CsfStorageSpec& storage = storage_of(payload, naming);
        const CsfForms forms{&enc, planes, slab_form};  // spans taken once slab_form is complete
        const std::uint64_t csf_bytes = storage.stored_bytes(forms);
        tr.stats.encoded_bytes = csf_bytes;
        // The b12x schema stores every expert projection as planes: its loaders expect them.
        if (!b12x && opt.keep_unprofitable && csf_bytes >= data.size()) {
          tr.action = TensorAction::native_kept;
          tr.reason = ratio_reason(csf_bytes, data.size());
        } else {
          stored_csf = true;
          tr.action = TensorAction::csf;
          stored_bytes = csf_bytes;
          CsfEntry entry = csf_entry(*t, *cand, c32, enc.exceptions.size());
          entry.storage = storage.storage;
          tr.storage = std::string(storage.name);
          if (w) storage.write(*w, t->name, forms);
          info.csf.push_back(std::move(entry));
          result.csf_parts[t->name] = stored_part_names(t->name, storage.storage, cand->shape.format);
        }
      }
      if (!stored_csf) info.native_kept[t->name] = {cand->shape.format, cand->layer, tr.reason};
    }
    if (!stored_csf) {
      if (w) w->add_tensor(t->name, t->dtype, t->shape, data);
      info.native_crc32[t->name] = c32;
    }
    add_totals(rep, tr, data.size(), stored_bytes);
    rep.tensors.push_back(std::move(tr));
    job.tick(data.size(), file, t->name);
  }

  // Whole-file CRC from the pieces, in file order.
  std::uint32_t fc = crc_of(src.bytes().subspan(0, src.data_offset()));
  {
    std::size_t gi = 0;
    const auto& gaps = info.gaps;
    for (const auto* t : order) {
      if (!t->nbytes()) continue;
      while (gi < gaps.size() && gaps[gi].offset < t->begin) {
        fc = crc_join(fc, crc_of(gaps[gi].bytes), gaps[gi].bytes.size());
        ++gi;
      }
      fc = crc_join(fc, crcs[t->name], t->nbytes());
    }
    for (; gi < gaps.size(); ++gi) fc = crc_join(fc, crc_of(gaps[gi].bytes), gaps[gi].bytes.size());
  }
  info.original_file_crc32 = fc;
  if (w) {
    st::Metadata out_md = md.value_or(st::Metadata{});
    put_container_metadata(info, out_md);
    w->commit(out_md);
    result.stored = w->tensors();
  }
  return result;
}

}  // namespace csfmoe::detail

namespace csfmoe {
namespace fs = std::filesystem;
using namespace detail;

namespace {

std::string already_compressed(const fs::path& p) {
  return fmt::format(
      "{} is already a CSF container: nothing to compress again (inspect and verify read it as it is; "
      "decompress restores the original; a tensor-parallel slice of it can be stored with tp and rank)",
      p.string());
}

// compress_checkpoint of a whole (unsliced) input; `sliced` as in compress_file, per file name.
CheckpointReport compress_whole(const fs::path& in, const fs::path& out, const CompressOptions& options,
                                const SlicedPlanes* sliced) {
  const auto planes_of =
      [&](const std::string& file) -> const std::map<std::string, std::vector<CsfPlanes>>* {
    if (!sliced) return nullptr;
    auto it = sliced->find(file);
    return it == sliced->end() ? nullptr : &it->second;
  };
  CheckpointReport rep;
  rep.path = in;
  Job job{options};
  const auto refuse_b12x = [](const st::File& file) {
    if (foreign_b12x(file, file.path().string()))
      throw InvalidArgument(
          fmt::format("{} is written by b12x / vLLM (its scales are CSF planes already): "
                      "decompress it first, or store one tensor-parallel slice of it (tp and rank)",
                      file.path().string()));
  };
  if (!fs::is_directory(in)) {
    st::File src = st::File::open(in);
    if (container_info(src)) throw InvalidArgument(already_compressed(in));
    refuse_b12x(src);
    job.total = src.data_size();
    compress_file(src, out, in.filename().string(), job, rep, true, planes_of(""));
    return rep;
  }
  Folder f = open_folder(in);
  check_index_tensors(f, in);
  for (const auto& [n, file] : f.files) {
    if (container_info(file)) throw InvalidArgument(already_compressed(file.path()));
    refuse_b12x(file);
    job.total += file.data_size();
  }
  TempDir tmp(out);
  std::map<std::string, std::map<std::string, std::vector<std::string>>> csf;
  std::uint64_t total_stored = 0;
  for (const auto& [n, file] : f.files) {
    FileResult r = compress_file(file, out_file(tmp.path(), n), n, job, rep, true, planes_of(n));
    for (const auto& t : r.stored) total_stored += t.nbytes();
    csf[n] = std::move(r.csf_parts);
  }
  if (f.index) {
    // Each tensor stored as CSF is listed under its part tensors, in its shard.
    IndexEdit edit;
    edit.weight_map = &f.index->weight_map;
    edit.rename = [&csf](const std::string& tensor,
                         const std::string& s) -> std::optional<std::vector<std::string>> {
      const auto file = csf.find(s);
      if (file == csf.end()) return std::nullopt;
      const auto parts = file->second.find(tensor);
      if (parts == file->second.end()) return std::nullopt;
      return parts->second;
    };
    edit.total_size = total_stored;
    edit.original = &f.index->raw;
    const std::string label = (in / st::kIndexFileName).string();
    write_file(tmp.path() / st::kIndexFileName, *edit_index(parse_index_json(f.index->raw, label), edit));
  }
  for (const auto& n : f.others) f.copy_other(in, n, tmp.path() / n);
  tmp.commit();
  return rep;
}

// compress_checkpoint after the checks and the b12x expert split.
CheckpointReport compress_source(const fs::path& in, const fs::path& out, const CompressOptions& options) {
  if (options.tp != 1 || options.tp_rank != 0) {
    // Slice into a hidden folder beside the output, then compress the slice;
    // a compressed input's planes are cut, not encoded again.
    TempDir sliced(out.parent_path() / (out.filename().string() + ".tp-slice"));
    const fs::path src = sliced.path() / (fs::is_directory(in) ? fs::path("checkpoint") : in.filename());
    SlicedPlanes planes;
    const TpSliceBytes bytes =
        slice_checkpoint_tp(in, src, options.tp, options.tp_rank, options.layout, &planes, options.progress);
    CompressOptions whole = options;
    whole.tp = 1;
    whole.tp_rank = 0;
    // One bar for the whole job: slicing counted the source bytes first.
    if (options.progress)
      whole.progress = [&options, read = bytes.source](const Progress& p) {
        options.progress(Progress{read + p.bytes_done, read + p.bytes_total, p.current});
      };
    CheckpointReport rep = compress_whole(src, out, whole, &planes);
    rep.path = in;
    return rep;
  }
  return compress_whole(in, out, options, nullptr);
}

}  // namespace

CheckpointReport compress_checkpoint(const fs::path& in, const fs::path& out,
                                     const CompressOptions& options) {
  check_paths(in, out);
  if (options.schema == CheckpointSchema::b12x) {
    // Stacked expert tensors are split per expert into a hidden folder
    // beside the output first; that split copy is what gets compressed.
    TempDir split(out.parent_path() / (out.filename().string() + ".expert-split"));
    const fs::path src = split.path() / (fs::is_directory(in) ? fs::path("checkpoint") : in.filename());
    if (split_stacked_experts(in, src, options.layout)) {
      CheckpointReport rep = compress_source(src, out, options);
      rep.path = in;
      return rep;
    }
  }
  return compress_source(in, out, options);
}

}  // namespace csfmoe
