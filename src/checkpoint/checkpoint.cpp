// compress / decompress / verify / inspect of safetensors checkpoints.
#include "csfmoe/checkpoint.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "checkpoint/b12x_file.hpp"
#include "checkpoint/container.hpp"
#include "checkpoint/detect.hpp"
#include "checkpoint/json_error.hpp"
#include "checkpoint/tp_slice.hpp"
#include "csfmoe/errors.hpp"
#include "csfmoe/safetensors.hpp"

namespace csfmoe {
namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;
using namespace detail;

namespace {

constexpr const char* kIndexKey = "csfmoe";  // key inside the rewritten index's "metadata"

std::uint32_t crc_join(std::uint32_t a, std::uint32_t b, std::uint64_t len_b) {
  return static_cast<std::uint32_t>(crc32_combine64(a, b, static_cast<z_off64_t>(len_b)));
}

struct Job {
  const CompressOptions& opt;
  std::uint64_t done = 0, total = 0;
  void tick(std::uint64_t bytes, const std::string& file, const std::string& tensor) {
    done += bytes;
    if (opt.progress) opt.progress(Progress{done, total, file + ":" + tensor});
  }
};

CodecOptions codec_options(const CompressOptions& o) {
  CodecOptions c;
  c.threads = o.threads;
  return c;
}

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

// Tensors in data order (stable for empty tensors that share an offset).
std::vector<const st::TensorInfo*> data_order(const st::Header& h) {
  std::vector<const st::TensorInfo*> v;
  for (const auto& t : h.tensors) v.push_back(&t);
  std::stable_sort(v.begin(), v.end(),
                   [](const st::TensorInfo* a, const st::TensorInfo* b) { return a->begin < b->begin; });
  return v;
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

// The resident sizes of a CSF tensor: csfmoe's (all parts) and b12x's (the
// fixed slabs and records, plus an 8-byte offset per partition).
void set_resident(TensorReport& tr, const CsfTensor& enc) {
  tr.resident_bytes = enc.encoded_bytes();
  tr.b12x_resident_bytes = enc.fixed.size() + 4 * std::uint64_t(enc.exceptions.size()) +
                           8 * std::uint64_t{enc.geometry.partitions_per_expert} * enc.geometry.shape.experts;
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

struct FileResult {
  std::map<std::string, std::vector<std::string>> csf_parts;  // tensors stored as CSF -> their part tensors
  std::vector<st::TensorInfo> stored;                         // container tensors
};

// Compresses one validated safetensors file into `dest` (which must not exist).
// `sliced`: planes of some tensors already cut for a tensor-parallel rank
// (slice_checkpoint_tp), stored as they are instead of encoding those tensors.
FileResult compress_file(const st::File& src, const fs::path& dest, const std::string& file, Job& job,
                         CheckpointReport& rep, bool write,
                         const std::map<std::string, std::vector<CsfPlanes>>* sliced = nullptr) {
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
        CsfStorage storage = b12x             ? CsfStorage::b12x
                             : planes.empty() ? CsfStorage::resident
                                              : CsfStorage::planes;
        // MXFP4 planes in slab form when that is smaller (never when larger), proven to give the planes back.
        std::vector<Mxfp4SlabPlanes> slab_form;
        if (storage == CsfStorage::planes && cand->shape.format == ScaleFormat::mxfp4 && opt.mxfp4_slab) {
          for (const CsfPlanes& pl : planes) {
            slab_form.push_back(planes_to_mxfp4_slabs(pl, t->name));
            const CsfPlanes back_planes = mxfp4_slabs_to_planes(slab_form.back(), t->name);
            if (back_planes.fixed != pl.fixed || back_planes.exceptions != pl.exceptions)
              throw CorruptData(fmt::format(
                  "{}: tensor '{}': MXFP4 slabs do not reproduce the planes (codec bug)", label, t->name));
          }
          if (mxfp4_slabs_stored_bytes(slab_form) < planes_stored_bytes(planes))
            storage = CsfStorage::mxfp4_slab;
        }
        const std::uint64_t csf_bytes =
            storage == CsfStorage::resident     ? enc.encoded_bytes()
            : storage == CsfStorage::b12x       ? planes_stored_bytes(planes) - 4  // no record count
            : storage == CsfStorage::mxfp4_slab ? mxfp4_slabs_stored_bytes(slab_form)
                                                : planes_stored_bytes(planes);
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
          entry.storage = storage;
          tr.storage = std::string(to_string(storage));
          if (w) {
            if (storage == CsfStorage::resident)
              write_csf_parts(*w, t->name, enc);
            else if (storage == CsfStorage::planes)
              write_csf_planes(*w, t->name, planes);
            else if (storage == CsfStorage::mxfp4_slab)
              write_csf_mxfp4_slabs(*w, t->name, slab_form);
            else
              write_b12x_planes(*w, t->name, planes.front());
          }
          info.csf.push_back(std::move(entry));
          result.csf_parts[t->name] = stored_part_names(t->name, storage, cand->shape.format);
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

// Fills the report of a tensor stored as CSF from its loaded parts: stats,
// resident sizes, storage; returns the bytes its parts take in `file`.
std::uint64_t report_stored_csf(TensorReport& tr, const st::File& file, const CsfEntry& e,
                                const CsfTensor& enc) {
  tr.action = TensorAction::csf;
  tr.format = e.grid.format;
  tr.layer = e.layer;
  tr.stats = stats(enc);
  set_resident(tr, enc);
  tr.storage = std::string(to_string(e.storage));
  return tr.stats.encoded_bytes = stored_part_bytes(file, e);
}

// A file written by b12x / vLLM: every plane pair checked against b12x's
// rules and decoded; the scale tensors are reported as CSF (stored = their
// planes' bytes), the others as passthrough. With `out`, writes the file
// with each pair replaced by its native scale tensor (the file's metadata
// kept). No checksum exists to compare with.
void read_b12x_file(const st::File& file, const ForeignB12x& v, st::Writer* out, const std::string& n,
                    Job& job, CheckpointReport& rep) {
  const std::string label = file.path().string();
  for (const auto* t : data_order(v.logical)) {
    TensorReport tr = base_report(n, *t);
    std::uint64_t stored = t->nbytes();
    if (const CsfEntry* e = v.find(t->name)) {
      const CsfTensor enc = load_csf_parts(file, *e, label);
      const auto buf =
          decode_checked(enc, *e, t->nbytes(), label, codec_options(job.opt), /*check_crc=*/false);
      if (out) out->add_tensor(t->name, t->dtype, t->shape, buf);
      stored = report_stored_csf(tr, file, *e, enc);
    } else {
      const st::TensorInfo* ft = file.find(t->name);
      if (out) out->add_tensor(t->name, t->dtype, t->shape, file.data(*ft));
    }
    tr.reason = std::string(kB12xNoChecksum);
    add_totals(rep, tr, t->nbytes(), stored);
    rep.tensors.push_back(std::move(tr));
    job.tick(t->nbytes(), n, t->name);
  }
}

std::uint64_t logical_bytes(const st::Header& h) {
  std::uint64_t n = 0;
  for (const auto& t : h.tensors) n += t.nbytes();
  return n;
}

struct OpenContainer {
  st::File file;
  ContainerInfo info;
};

// Rebuilds the original file from a container, streaming into `out` (or
// nowhere, for verify). Every CRC is checked before `out` is committed.
void restore_file(const st::File& c, const ContainerInfo& info, st::AtomicFile* out, const std::string& file,
                  Job& job, CheckpointReport* rep) {
  const std::string label = c.path().string();
  const std::string& H = info.original_header;
  if (8 + H.size() > info.original_file_size)
    throw FormatError(fmt::format("{}: original header ({} bytes) does not fit the original file size {}",
                                  label, H.size(), info.original_file_size));
  const std::uint64_t data_size = info.original_file_size - 8 - H.size();
  const st::Header oh = st::parse_header(H, data_size, label + " (original header)");
  for (const auto& e : info.csf) {
    const st::TensorInfo* t = oh.find(e.name);
    if (!t)
      throw FormatError(
          fmt::format("{}: tensor '{}': in the descriptor but not in the original header", label, e.name));
    if (t->dtype != e.dtype || t->shape != e.shape)
      throw FormatError(fmt::format(
          "{}: tensor '{}': descriptor dtype/shape disagree with the original header", label, e.name));
  }
  // Tensors and gaps must tile the original data section exactly.
  const auto order = data_order(oh);
  {
    std::vector<std::pair<std::uint64_t, std::uint64_t>> segs;
    for (const auto* t : order)
      if (t->nbytes()) segs.emplace_back(t->begin, t->end);
    for (const auto& g : info.gaps) {
      if (g.bytes.empty()) throw FormatError(label + ": empty gap record in the restore record");
      segs.emplace_back(g.offset, g.offset + g.bytes.size());
    }
    std::sort(segs.begin(), segs.end());
    std::uint64_t pos = 0;
    for (const auto& [b, e] : segs) {
      if (b != pos)
        throw FormatError(
            fmt::format("{}: restore record leaves original bytes [{}, {}) undefined or doubly defined",
                        label, std::min(b, pos), std::max(b, pos)));
      pos = e;
    }
    if (pos != data_size)
      throw FormatError(
          fmt::format("{}: restore record covers {} of {} original data bytes", label, pos, data_size));
  }

  const CodecOptions copts = codec_options(job.opt);
  std::uint8_t len8[8];
  const std::uint64_t n = H.size();
  std::memcpy(len8, &n, 8);
  std::uint32_t fc = crc_of(std::span<const std::uint8_t>(len8, 8));
  fc = crc_join(fc, crc_of(H), H.size());
  if (out) {
    out->write(std::span<const std::uint8_t>(len8, 8));
    out->write(H);
  }
  std::size_t gi = 0;
  auto emit_gaps_before = [&](std::uint64_t limit) {
    while (gi < info.gaps.size() && info.gaps[gi].offset < limit) {
      const auto& g = info.gaps[gi++];
      fc = crc_join(fc, crc_of(g.bytes), g.bytes.size());
      if (out) out->write(g.bytes);
    }
  };
  for (const auto* t : order) {
    emit_gaps_before(t->begin);
    TensorReport tr = base_report(file, *t);
    std::uint64_t stored = t->nbytes();
    std::uint32_t c32 = 0;
    if (const CsfEntry* e = info.find(t->name)) {
      CsfTensor enc = load_csf_parts(c, *e, label);
      const std::vector<std::uint8_t> buf = decode_checked(enc, *e, t->nbytes(), label, copts, true);
      c32 = e->crc32;
      if (out) out->write(buf);
      stored = report_stored_csf(tr, c, *e, enc);
    } else {
      const st::TensorInfo* ct = c.find(t->name);
      if (!ct) throw FormatError(fmt::format("{}: tensor '{}' of the original is missing", label, t->name));
      if (ct->dtype != t->dtype || ct->shape != t->shape)
        throw FormatError(
            fmt::format("{}: tensor '{}': dtype/shape differ from the original header", label, t->name));
      auto want = info.native_crc32.find(t->name);
      if (want == info.native_crc32.end())
        throw FormatError(fmt::format("{}: tensor '{}': no CRC32 in the restore record", label, t->name));
      const auto data = c.data(*ct);
      c32 = crc_of(data);
      if (c32 != want->second)
        throw CorruptData(fmt::format("{}: tensor '{}': CRC32 is {:08x}, expected {:08x}", label, t->name,
                                      c32, want->second));
      if (out) out->write(data);
      if (auto k = info.native_kept.find(t->name); k != info.native_kept.end()) {
        tr.action = TensorAction::native_kept;
        tr.format = k->second.format;
        tr.reason = k->second.reason;
        tr.layer = k->second.layer;
      }
    }
    fc = crc_join(fc, c32, t->nbytes());
    if (rep) {
      add_totals(*rep, tr, t->nbytes(), stored);
      rep->tensors.push_back(std::move(tr));
    }
    job.tick(t->nbytes(), file, t->name);
  }
  emit_gaps_before(UINT64_MAX);
  if (fc != info.original_file_crc32)
    throw CorruptData(fmt::format("{}: CRC32 of the restored file is {:08x}, expected {:08x}", label, fc,
                                  info.original_file_crc32));
  if (out && out->position() != info.original_file_size)
    throw FormatError(
        fmt::format("{}: restored {} bytes, expected {}", label, out->position(), info.original_file_size));
}

std::optional<ContainerInfo> container_info(const st::File& f) {
  return get_container_metadata(f.header().metadata, f.path().string());
}

// --- output rules ----------------------------------------------------------
void check_paths(const fs::path& in, const fs::path& out) {
  std::error_code ec;
  if (!fs::exists(in, ec)) throw InvalidArgument(fmt::format("input {} does not exist", in.string()));
  if (fs::exists(fs::symlink_status(out, ec))) {
    if (fs::equivalent(in, out, ec))
      throw InvalidArgument(fmt::format("output {} is the input", out.string()));
    throw InvalidArgument(fmt::format("output {} already exists; refusing to overwrite", out.string()));
  }
  const fs::path ain = fs::weakly_canonical(in, ec), aout = fs::weakly_canonical(out, ec);
  if (ain == aout) throw InvalidArgument(fmt::format("output {} is the input", out.string()));
  if (fs::is_directory(in)) {
    auto [a, b] = std::mismatch(ain.begin(), ain.end(), aout.begin(), aout.end());
    if (a == ain.end())
      throw InvalidArgument(
          fmt::format("output {} lies inside the input folder {}", out.string(), in.string()));
  }
  fs::path parent = out.parent_path();
  if (parent.empty()) parent = ".";
  if (!fs::is_directory(parent, ec))
    throw InvalidArgument(fmt::format("output folder {} does not exist", parent.string()));
}

// A folder built beside its destination and renamed onto it at the end
// (named, and stale ones from killed runs swept, by st::prepare_temporary).
class TempDir {
 public:
  explicit TempDir(fs::path dest) : dest_(std::move(dest)), tmp_(st::prepare_temporary(dest_)) {
    std::error_code ec;
    if (!fs::create_directory(tmp_, ec) || ec)
      throw IoError(fmt::format("{}: cannot create temporary folder: {}", tmp_.string(),
                                ec ? ec.message() : "already exists"));
  }
  ~TempDir() {
    if (!done_) {
      std::error_code ec;
      fs::remove_all(tmp_, ec);
    }
  }
  const fs::path& path() const { return tmp_; }
  void commit() {
    if (::renameat2(AT_FDCWD, tmp_.c_str(), AT_FDCWD, dest_.c_str(), RENAME_NOREPLACE) != 0) {
      if (errno == EEXIST)
        throw InvalidArgument(fmt::format("output {} already exists; refusing to overwrite", dest_.string()));
      throw IoError(fmt::format("{}: cannot rename {} into place: {}", dest_.string(), tmp_.string(),
                                std::strerror(errno)));
    }
    done_ = true;
  }

 private:
  fs::path dest_, tmp_;
  bool done_ = false;
};

// A top-level entry copied unchanged must not, through a symlink, bring a
// file from elsewhere on this machine into the output, nor be a loop.
void check_plain_entry(const fs::path& folder, const std::string& name) {
  const fs::path p = folder / name;
  std::error_code ec;
  if (!fs::is_symlink(fs::symlink_status(p, ec))) return;
  (void)fs::status(p, ec);
  if (ec == std::errc::too_many_symbolic_link_levels)
    throw FormatError(fmt::format("{}: '{}' is a symlink loop ({})", folder.string(), name, ec.message()));
  if (ec)
    throw FormatError(
        fmt::format("{}: '{}' is a dangling symlink ({})", folder.string(), name, ec.message()));
  const fs::path target = fs::canonical(p, ec), base = fs::canonical(folder, ec);
  auto [b, t] = std::mismatch(base.begin(), base.end(), target.begin(), target.end());
  if (ec || b != base.end() || t == target.end())
    throw FormatError(fmt::format("{}: '{}' is a symlink that leaves the folder ({})", folder.string(), name,
                                  target.string()));
}

void copy_plain(const fs::path& from, const fs::path& to) {
  std::error_code ec;
  if (fs::is_directory(from, ec)) {
    // Symlinks inside sub-folders are copied as links, never followed.
    fs::copy(from, to, fs::copy_options::recursive | fs::copy_options::copy_symlinks, ec);
  } else {
    fs::copy_file(from, to, fs::copy_options::none, ec);
  }
  if (ec) throw IoError(fmt::format("cannot copy {} to {}: {}", from.string(), to.string(), ec.message()));
}

// Output path of the shard `n` ("x.safetensors" or "tensors/x.safetensors")
// in folder `root`, its sub-folder created.
fs::path out_file(const fs::path& root, const std::string& n) {
  const fs::path p = root / n;
  std::error_code ec;
  if (n.find('/') != std::string::npos && (fs::create_directories(p.parent_path(), ec), ec))
    throw IoError(fmt::format("cannot create {}: {}", p.parent_path().string(), ec.message()));
  return p;
}

// Copies folder `from` (the checkpoint's `rel`) to `to` as copy_plain does,
// leaving out the shards in `skip` (paths relative to the checkpoint folder):
// a sub-folder of shards that an index lists is written shard by shard.
void copy_tree_except(const fs::path& from, const fs::path& to, const std::string& rel,
                      const std::set<std::string>& skip) {
  std::error_code ec;
  fs::create_directories(to, ec);
  if (ec) throw IoError(fmt::format("cannot create {}: {}", to.string(), ec.message()));
  for (const auto& de : fs::directory_iterator(from)) {
    const std::string name = de.path().filename().string(), r = rel + "/" + name;
    if (skip.count(r)) continue;
    if (de.is_symlink(ec))
      fs::copy_symlink(de.path(), to / name, ec);  // symlinks inside sub-folders are copied, never followed
    else if (de.is_directory(ec))
      copy_tree_except(de.path(), to / name, r, skip);
    else
      fs::copy_file(de.path(), to / name, fs::copy_options::none, ec);
    if (ec)
      throw IoError(
          fmt::format("cannot copy {} to {}: {}", de.path().string(), (to / name).string(), ec.message()));
  }
}

// The folder's entries, split into safetensors files (validated, opened) and others.
struct Folder {
  std::vector<std::pair<std::string, st::File>> files;  // sorted by name; index shards in sub-folders by path
  std::vector<std::string> others;                      // index excluded
  std::set<std::string> nested;  // index shards in sub-folders ("tensors/x.safetensors")
  // Copies the top-level entry `n` to `to`, leaving out the nested shards (written separately).
  void copy_other(const fs::path& in, const std::string& n, const fs::path& to) const {
    const auto it = nested.lower_bound(n + "/");
    if (it != nested.end() && it->starts_with(n + "/"))
      copy_tree_except(in / n, to, n, nested);
    else
      copy_plain(in / n, to);
  }
  std::optional<st::ShardIndex> index;
  std::optional<ManifestExport> manifest;  // b12x's manifest export: files are its tensors/ shards
};

Folder open_folder(const fs::path& in) {
  Folder f;
  if ((f.manifest = read_manifest_export(in))) {
    for (const auto& p : f.manifest->shards)
      f.files.emplace_back("tensors/" + p.filename().string(), st::File::open(p));
    return f;
  }
  std::vector<std::string> names;
  for (const auto& de : fs::directory_iterator(in)) names.push_back(de.path().filename().string());
  std::sort(names.begin(), names.end());
  for (const auto& n : names) {
    if (n == st::kIndexFileName) {
      st::resolve_inside(in, n, (in / n).string());
      f.index = st::read_shard_index(in / n);
    } else if (n.ends_with(".safetensors")) {
      const fs::path p = st::resolve_inside(in, n, in.string());
      f.files.emplace_back(n, st::File::open(p));
    } else {
      check_plain_entry(in, n);
      f.others.push_back(n);
    }
  }
  // Shards an index lists in a sub-folder (tensors/model-00001.safetensors),
  // checked to resolve inside the folder by read_shard_index.
  if (f.index)
    for (const auto& s : f.index->shards)
      if (s.find('/') != std::string::npos && f.nested.insert(s).second)
        f.files.emplace_back(s, st::File::open(st::resolve_shard(in, s, (in / st::kIndexFileName).string())));
  std::sort(f.files.begin(), f.files.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  if (f.files.empty())
    throw InvalidArgument(fmt::format("{}: the folder holds no .safetensors file", in.string()));
  return f;
}

const st::File* shard(const Folder& f, const std::string& name) {
  for (const auto& [n, file] : f.files)
    if (n == name) return &file;
  return nullptr;
}

void check_index_tensors(const Folder& f, const fs::path& in) {
  if (!f.index) return;
  const std::string label = (in / st::kIndexFileName).string();
  for (const auto& [tensor, s] : f.index->weight_map) {
    const st::File* file = shard(f, s);
    if (!file)
      throw FormatError(
          fmt::format("{}: weight_map['{}']: shard '{}' is not a safetensors file", label, tensor, s));
    if (!file->find(tensor))
      throw FormatError(fmt::format("{}: weight_map['{}']: shard '{}' has no such tensor", label, tensor, s));
  }
}

// The index with the weight_map entries of b12x planes renamed to their
// scale tensor (one entry per scale), everything else as it was.
std::string rename_index_entries(const st::ShardIndex& idx, const std::map<std::string, std::string>& renames,
                                 const std::string& label) {
  ojson orig;
  try {
    orig = ojson::parse(idx.raw);
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(fmt::format("{}: {}", label, json_error_text(e)));
  }
  ojson wm = ojson::object();
  for (const auto& [tensor, s] : idx.weight_map) {
    auto it = renames.find(tensor);
    wm[it == renames.end() ? tensor : it->second] = s;
  }
  ojson out = ojson::object();
  for (auto it = orig.begin(); it != orig.end(); ++it)
    out[it.key()] = it.key() == "weight_map" ? wm : it.value();
  return out.dump(2) + "\n";
}

std::string rewrite_index(const st::ShardIndex& idx,
                          const std::map<std::string, std::map<std::string, std::vector<std::string>>>& csf,
                          std::uint64_t total_stored, const std::string& label) {
  ojson orig;
  try {
    orig = ojson::parse(idx.raw);
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(fmt::format("{}: {}", label, json_error_text(e)));
  }
  ojson wm = ojson::object();
  for (const auto& [tensor, s] : idx.weight_map) {
    auto it = csf.find(s);
    if (it != csf.end() && it->second.count(tensor)) {
      for (const std::string& n : it->second.at(tensor)) wm[n] = s;
    } else {
      wm[tensor] = s;
    }
  }
  ojson mark = ojson::object();
  mark["version"] = kContainerVersion;
  mark["original_index"] = idx.raw;
  mark["original_index_crc32"] = crc_of(idx.raw);
  ojson out = ojson::object();
  ojson meta = ojson::object();
  if (auto m = orig.find("metadata"); m != orig.end() && m->is_object()) meta = *m;
  if (auto ts = meta.find("total_size"); ts != meta.end() && ts->is_number()) *ts = total_stored;
  meta[kIndexKey] = std::move(mark);
  out["metadata"] = std::move(meta);
  for (auto it = orig.begin(); it != orig.end(); ++it) {
    if (it.key() == "metadata") continue;
    out[it.key()] = it.key() == "weight_map" ? wm : it.value();
  }
  return out.dump(2) + "\n";
}

void write_file(const fs::path& dest, std::string_view bytes) {
  st::AtomicFile f(dest);
  f.write(bytes);
  f.commit();
}

std::uint64_t original_data_bytes(const ContainerInfo& info) {
  return info.original_file_size - std::min(info.original_file_size, 8 + info.original_header.size());
}

}  // namespace

// The original index bytes, if `raw` is a rewritten index; CorruptData on a CRC mismatch.
std::optional<std::string> detail::original_index(const std::string& raw, const std::string& label) {
  ojson j;
  try {
    j = ojson::parse(raw);
  } catch (const nlohmann::json::exception&) {
    return std::nullopt;
  }
  if (!j.is_object()) return std::nullopt;
  auto m = j.find("metadata");
  if (m == j.end() || !m->is_object()) return std::nullopt;
  auto k = m->find(kIndexKey);
  if (k == m->end()) return std::nullopt;
  if (!k->is_object() || !k->contains("original_index") || !(*k)["original_index"].is_string() ||
      !k->contains("original_index_crc32") || !(*k)["original_index_crc32"].is_number_unsigned())
    throw FormatError(label + ": metadata.csfmoe must hold original_index and original_index_crc32");
  std::string o = (*k)["original_index"].get<std::string>();
  if (crc_of(o) != (*k)["original_index_crc32"].get<std::uint64_t>())
    throw CorruptData(label + ": CRC32 of the preserved original index does not match");
  return o;
}

// ---------------------------------------------------------------------------
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
  if (f.index)
    write_file(tmp.path() / st::kIndexFileName,
               rewrite_index(*f.index, csf, total_stored, (in / st::kIndexFileName).string()));
  for (const auto& n : f.others) f.copy_other(in, n, tmp.path() / n);
  tmp.commit();
  return rep;
}

// ---- Stacked expert tensors split per expert (--schema b12x) ----
//
// b12x / vLLM load one tensor per expert projection, so stacked [E, R, C]
// inputs (csf synth, ModelOpt's w13 / w2, gpt-oss's gate_up_proj_*) are first
// rewritten per expert, byte for byte, into a hidden folder and that is what
// gets compressed (decompress then gives the per-expert file back).

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

// Writes `in` with its stacked expert tensors split per expert to `out`, or
// returns false (writing nothing) when no file of `in` holds stacked expert
// scales. Containers and b12x files are left to compress_whole to refuse.
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
    ojson j = ojson::parse(f.index->raw);
    ojson wm = ojson::object();
    for (const auto& [tensor, s] : f.index->weight_map) {
      const auto it = renamed.find(s + '\0' + tensor);
      if (it == renamed.end())
        wm[tensor] = s;
      else
        for (const auto& n : it->second) wm[n] = s;
    }
    j["weight_map"] = std::move(wm);
    if (auto m = j.find("metadata"); m != j.end() && m->is_object())
      if (auto ts = m->find("total_size"); ts != m->end() && ts->is_number()) *ts = total;
    write_file(out / st::kIndexFileName, j.dump(2) + "\n");
  }
  return true;
}

}  // namespace

namespace {

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

void decompress_checkpoint(const fs::path& in, const fs::path& out, const CompressOptions& options) {
  check_paths(in, out);
  Job job{options};
  if (!fs::is_directory(in)) {
    st::File c = st::File::open(in);
    auto info = container_info(c);
    if (!info) {
      const auto b12x = foreign_b12x(c, in.string());
      if (!b12x) throw InvalidArgument(fmt::format("{} is not a CSF container", in.string()));
      job.total = logical_bytes(b12x->logical);
      st::Writer w(out, st::Writer::header_json_size(b12x->logical.tensors, b12x->logical.metadata) + 1024);
      CheckpointReport ignored;
      read_b12x_file(c, *b12x, &w, in.filename().string(), job, ignored);
      w.commit(b12x->logical.metadata);
      return;
    }
    job.total = original_data_bytes(*info);
    st::AtomicFile dest(out);
    restore_file(c, *info, &dest, in.filename().string(), job, nullptr);
    dest.commit();
    return;
  }
  Folder f = open_folder(in);
  if (f.manifest) {
    // A plain Hugging Face folder: native shards and an index from the
    // contract's source names, beside the export's metadata/ files.
    TempDir tmp(out);
    std::uint64_t total = 0;
    for (const auto& [n, file] : f.files) {
      const fs::path dest = tmp.path() / file.path().filename();
      if (const auto b12x = foreign_b12x(file, file.path().string())) {
        st::Writer w(dest,
                     st::Writer::header_json_size(b12x->logical.tensors, b12x->logical.metadata) + 1024);
        CheckpointReport ignored;
        read_b12x_file(file, *b12x, &w, n, job, ignored);
        w.commit(b12x->logical.metadata);
        total += logical_bytes(b12x->logical);
      } else {
        copy_plain(file.path(), dest);
        total += file.data_size();
      }
    }
    ojson index = ojson::object();
    index["metadata"] = {{"total_size", total}};
    index["weight_map"] = f.manifest->source_names;
    write_file(tmp.path() / st::kIndexFileName, index.dump(2) + "\n");
    const fs::path meta = in / "metadata";
    std::error_code ec;
    if (fs::exists(fs::symlink_status(meta, ec)))  // never a link out of the folder
      st::resolve_under(in, "metadata", in.string(), /*directory=*/true);
    if (fs::is_directory(meta, ec))
      for (const auto& de : fs::directory_iterator(meta)) {
        const std::string n = de.path().filename().string();
        check_plain_entry(meta, n);
        if (!de.is_regular_file()) continue;
        if (fs::exists(tmp.path() / n))
          throw FormatError(
              fmt::format("{}: metadata/{} has the name of a shard or the index", in.string(), n));
        copy_plain(de.path(), tmp.path() / n);
      }
    tmp.commit();
    return;
  }
  std::vector<std::optional<ContainerInfo>> infos;
  for (const auto& [n, file] : f.files) {
    infos.push_back(container_info(file));
    job.total += infos.back() ? original_data_bytes(*infos.back()) : file.data_size();
  }
  TempDir tmp(out);
  // Scale tensors of b12x files: weight_map entries of their planes become the scale's.
  std::map<std::string, std::string> plane_to_scale;
  for (std::size_t i = 0; i < f.files.size(); ++i) {
    const auto& [n, file] = f.files[i];
    if (!infos[i]) {
      if (const auto b12x = foreign_b12x(file, file.path().string())) {
        st::Writer w(out_file(tmp.path(), n),
                     st::Writer::header_json_size(b12x->logical.tensors, b12x->logical.metadata) + 1024);
        CheckpointReport ignored;
        read_b12x_file(file, *b12x, &w, n, job, ignored);
        w.commit(b12x->logical.metadata);
        for (const auto& e : b12x->csf)
          for (const auto& part : stored_part_names(e.name, e.storage, e.grid.format))
            plane_to_scale[part] = e.name;
        continue;
      }
      copy_plain(file.path(), out_file(tmp.path(), n));
      job.tick(file.data_size(), n, "");
      continue;
    }
    st::AtomicFile dest(out_file(tmp.path(), n));
    restore_file(file, *infos[i], &dest, n, job, nullptr);
    dest.commit();
  }
  if (f.index) {
    const std::string label = (in / st::kIndexFileName).string();
    if (auto o = original_index(f.index->raw, label))
      write_file(tmp.path() / st::kIndexFileName, *o);
    else if (!plane_to_scale.empty())
      write_file(tmp.path() / st::kIndexFileName, rename_index_entries(*f.index, plane_to_scale, label));
    else
      write_file(tmp.path() / st::kIndexFileName, f.index->raw);
  }
  for (const auto& n : f.others) f.copy_other(in, n, tmp.path() / n);
  tmp.commit();
}

namespace {

// Records `file`'s tensor-parallel slice, if it holds one (its metadata, which
// a container keeps from the slice it was made of).
void note_tp_slice(CheckpointReport& rep, const st::File& file, const std::string& name) {
  const auto& md = file.header().metadata;
  if (!md) return;
  const auto t = md->find(kTpKey), r = md->find(kTpRankKey);
  if (t == md->end() && r == md->end()) return;
  const auto number = [&](auto it, const char* key) {
    unsigned v = 0;
    const std::string s = it == md->end() ? "" : it->second;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (s.empty() || ec != std::errc() || end != s.data() + s.size())
      throw FormatError(
          fmt::format("{}: __metadata__ '{}' is '{}', not a number", file.path().string(), key, s));
    return v;
  };
  TpSliceInfo info{name, number(t, kTpKey), number(r, kTpRankKey)};
  if (info.tp < 2 || info.rank >= info.tp)
    throw FormatError(fmt::format("{}: __metadata__ says tensor-parallel rank {} of tp {}",
                                  file.path().string(), info.rank, info.tp));
  rep.tp_slices.push_back(std::move(info));
}

}  // namespace

CheckpointReport verify_checkpoint(const fs::path& in, const CompressOptions& options) {
  CheckpointReport rep;
  rep.path = in;
  Job job{options};
  auto one = [&](const st::File& file, const std::string& n) {
    if (auto info = container_info(file)) {
      note_tp_slice(rep, file, n);
      restore_file(file, *info, nullptr, n, job, &rep);
    } else if (const auto b12x = foreign_b12x(file, file.path().string())) {
      read_b12x_file(file, *b12x, nullptr, n, job, rep);
    } else {
      for (const auto& t : file.tensors()) {
        TensorReport tr = base_report(n, t);
        tr.reason = kNotAContainer;
        add_totals(rep, tr, t.nbytes(), t.nbytes());
        rep.tensors.push_back(std::move(tr));
      }
    }
  };
  const auto not_csf = [&] {
    return FormatError(
        fmt::format("{} is not a CSF container: nothing to verify (csf inspect describes a "
                    "native checkpoint)",
                    in.string()));
  };
  if (!fs::is_directory(in)) {
    st::File c = st::File::open(in);
    auto info = container_info(c);
    if (!info && !foreign_b12x(c, in.string())) throw not_csf();
    job.total = info ? original_data_bytes(*info) : c.data_size();
    one(c, in.filename().string());
    return rep;
  }
  Folder f = open_folder(in);
  bool any_container = false;
  for (const auto& [n, file] : f.files) {
    auto info = container_info(file);
    job.total += info ? original_data_bytes(*info) : 0;
    any_container = any_container || info.has_value() || foreign_b12x(file, file.path().string());
  }
  if (!any_container) throw not_csf();
  for (const auto& [n, file] : f.files) one(file, n);
  if (f.index) {
    const std::string label = (in / st::kIndexFileName).string();
    if (original_index(f.index->raw, label)) check_index_tensors(f, in);
  }
  return rep;
}

CheckpointReport inspect_checkpoint(const fs::path& in, const CompressOptions& options) {
  CheckpointReport rep;
  rep.path = in;
  Job job{options};
  auto one = [&](const st::File& file, const std::string& n) {
    note_tp_slice(rep, file, n);
    if (auto info = container_info(file)) {
      // Stats from the stored parts (validated, not decoded).
      const std::string label = file.path().string();
      const st::Header oh =
          st::parse_header(info->original_header, original_data_bytes(*info), label + " (original header)");
      for (const auto* t : data_order(oh)) {
        TensorReport tr = base_report(n, *t);
        std::uint64_t stored = t->nbytes();
        if (const CsfEntry* e = info->find(t->name)) {
          CsfTensor enc = load_csf_parts(file, *e, label);
          (void)decode_checked(enc, *e, t->nbytes(), label, codec_options(options), true);
          stored = report_stored_csf(tr, file, *e, enc);
        } else if (auto k = info->native_kept.find(t->name); k != info->native_kept.end()) {
          tr.action = TensorAction::native_kept;
          tr.format = k->second.format;
          tr.reason = k->second.reason;
          tr.layer = k->second.layer;
        }
        add_totals(rep, tr, t->nbytes(), stored);
        rep.tensors.push_back(std::move(tr));
        job.tick(t->nbytes(), n, t->name);
      }
    } else if (const auto b12x = foreign_b12x(file, file.path().string())) {
      job.total += logical_bytes(b12x->logical);
      read_b12x_file(file, *b12x, nullptr, n, job, rep);
    } else {
      job.total += file.data_size();
      compress_file(file, {}, n, job, rep, false);
    }
  };
  if (!fs::is_directory(in)) {
    st::File c = st::File::open(in);
    one(c, in.filename().string());
    return rep;
  }
  Folder f = open_folder(in);
  check_index_tensors(f, in);
  for (const auto& [n, file] : f.files) one(file, n);
  return rep;
}

bool is_csf_container(const fs::path& file) {
  try {
    st::File f = st::File::open(file);
    return f.header().metadata && f.header().metadata->count(kContainerKey) > 0;
  } catch (const FormatError&) {
    return false;
  }
}

}  // namespace csfmoe
