// decompress, verify and inspect of CSF checkpoints: csfmoe containers
// (restored byte for byte, every CRC checked) and files written by b12x / vLLM
// (read as if their scales were there), single files or folders.
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cstring>

#include "checkpoint/b12x_file.hpp"
#include "checkpoint/container.hpp"
#include "checkpoint/folder.hpp"
#include "checkpoint/tp_slice.hpp"
#include "checkpoint/verbs.hpp"
#include "csfmoe/checkpoint.hpp"
#include "csfmoe/errors.hpp"
#include "csfmoe/safetensors.hpp"

namespace csfmoe {
namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;
using namespace detail;

namespace {

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
    const std::vector<std::pair<std::string, std::string>> source_names(f.manifest->source_names.begin(),
                                                                        f.manifest->source_names.end());
    IndexEdit edit;
    edit.weight_map = &source_names;
    edit.total_size = total;
    ojson fresh = ojson::object();
    fresh["metadata"] = {{"total_size", 0}};
    fresh["weight_map"] = ojson::object();
    write_file(tmp.path() / st::kIndexFileName, *edit_index(std::move(fresh), edit));
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
      write_file(tmp.path() / st::kIndexFileName, *edit_index(parse_index_json(f.index->raw, label),
                                                              renaming(f.index->weight_map, plane_to_scale)));
    else
      write_file(tmp.path() / st::kIndexFileName, f.index->raw);
  }
  for (const auto& n : f.others) f.copy_other(in, n, tmp.path() / n);
  tmp.commit();
}

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
