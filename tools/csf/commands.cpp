// inspect, compress, decompress, verify: thin wrappers over checkpoint.hpp.
#include <fmt/core.h>

#include <algorithm>
#include <map>
#include <set>

#include "cli.hpp"
#include "csfmoe/errors.hpp"

namespace csfmoe::cli {

namespace fs = std::filesystem;

std::optional<ScaleLayout> layout_arg(const std::string& s) {
  if (s.empty()) return std::nullopt;
  return parse_scale_layout(s);
}

void check_output_path(const fs::path& in, const fs::path& out) {
  std::error_code ec;
  if (fs::weakly_canonical(in, ec) == fs::weakly_canonical(out, ec) || fs::equivalent(in, out, ec))
    throw InvalidArgument(fmt::format("output {} is the input", out.string()));
  if (fs::exists(fs::symlink_status(out, ec)))
    throw InvalidArgument(fmt::format("output {} already exists; refusing to overwrite it", out.string()));
}

namespace {

// Bytes on disk of a file, or of the regular files directly inside a folder.
std::uint64_t disk_bytes(const fs::path& p) {
  if (!fs::is_directory(p)) return fs::file_size(p);
  std::uint64_t total = 0;
  for (const auto& de : fs::directory_iterator(p))
    if (de.is_regular_file()) total += de.file_size();
  return total;
}

bool holds_container(const fs::path& p) {
  if (!fs::is_directory(p)) return is_csf_container(p);
  for (const auto& de : fs::directory_iterator(p))
    if (de.path().extension() == ".safetensors" && is_csf_container(de.path())) return true;
  return false;
}

}  // namespace

int run_inspect(const InspectArgs& a) {
  CompressOptions o;
  o.threads = a.threads;
  o.layout = layout_arg(a.layout);
  const auto report = inspect_checkpoint(a.path, o);
  if (a.json) {
    auto j = report_to_json(report);
    if (a.device) j["device"] = device_report_json(report);
    fmt::print("{}\n", j.dump(2));
  } else {
    print_report_table(stdout, report);
    print_tp_slices(stdout, report);
    if (a.device) print_device_report(stdout, report);
    if (holds_container(a.path))
      fmt::print(
          "checked: every CSF tensor decoded and its CRC32 matched; other tensors not read (csf verify "
          "checks every byte)\n");
  }
  return 0;
}

int run_compress(const CompressArgs& a) {
  check_output_path(a.in, a.out);
  CompressOptions o;
  o.tp = a.tp;
  o.tp_rank = a.tp_rank;
  o.schema = a.schema == "b12x" ? CheckpointSchema::b12x : CheckpointSchema::csfmoe;
  o.mxfp4_slab = !a.no_mxfp4_slab;
  o.threads = a.threads;
  o.layout = layout_arg(a.layout);
  ProgressPrinter progress("compress", a.quiet);
  o.progress = progress.callback();
  CheckpointReport report;
  try {
    report = compress_checkpoint(a.in, a.out, o);
  } catch (...) {
    progress.finish();
    throw;
  }
  progress.finish();
  // A checkpoint without any block scale is copied as is: say so, even with
  // --quiet, rather than let an unrecognised naming pass for a compression.
  if (std::none_of(report.tensors.begin(), report.tensors.end(),
                   [](const TensorReport& t) { return t.format; }))
    fmt::print(stderr,
               "csf: warning: {}: no block-scale tensor found (NVFP4 / MXFP4 scales named X.weight_scale, "
               "S.scale or X_scales beside their FP4 weight); every tensor was stored unchanged\n",
               a.in.string());
  if (!a.quiet) {
    print_kept_native(stdout, report);
    print_report_table(stdout, report);
    if (a.tp > 1) fmt::print("{}\n", tp_slice_text(TpSliceInfo{a.out.filename().string(), a.tp, a.tp_rank}));
    const std::uint64_t before = disk_bytes(a.in), after = disk_bytes(a.out);
    fmt::print("wrote {}: {} bytes ({}) from {} bytes ({}) on disk, {:.2f}%\n", a.out.string(), after,
               human_bytes(after), before, human_bytes(before),
               before ? 100.0 * double(after) / double(before) : 0.0);
  }
  return 0;
}

int run_decompress(const CompressArgs& a) {
  check_output_path(a.in, a.out);
  CompressOptions o;
  o.threads = a.threads;
  ProgressPrinter progress("decompress", a.quiet);
  o.progress = progress.callback();
  try {
    decompress_checkpoint(a.in, a.out, o);
  } catch (...) {
    progress.finish();
    throw;
  }
  progress.finish();
  if (!a.quiet) fmt::print("restored {}\n", a.out.string());
  return 0;
}

int run_verify(const InspectArgs& a) {
  CompressOptions o;
  o.threads = a.threads;
  const auto report = verify_checkpoint(a.path, o);
  // Files in order of appearance with their count of checked CSF tensors.
  std::vector<std::string> files;
  std::map<std::string, std::size_t> checked;
  std::set<std::string> skipped, b12x;
  for (const auto& t : report.tensors) {
    if (!checked.count(t.file)) files.push_back(t.file);
    checked[t.file] += t.action == TensorAction::csf ? 1 : 0;
    if (t.reason == kNotAContainer) skipped.insert(t.file);
    if (t.reason == kB12xNoChecksum) b12x.insert(t.file);
  }
  std::map<std::string, std::string> slices;
  for (const auto& t : report.tp_slices) slices[t.file] = "; " + tp_slice_text(t);
  if (files.empty()) fmt::print("OK {} (no tensors)\n", a.path.string());
  for (const auto& f : files) {
    if (skipped.count(f))
      fmt::print("SKIPPED {} ({})\n", f, kNotAContainer);
    else if (b12x.count(f))
      fmt::print("OK {} ({} b12x plane pairs checked and decoded; the file holds no checksum{})\n", f,
                 checked[f], slices[f]);
    else
      fmt::print("OK {} ({} CSF tensors decoded, every tensor's CRC32 matched{})\n", f, checked[f],
                 slices[f]);
  }
  return 0;
}

}  // namespace csfmoe::cli
