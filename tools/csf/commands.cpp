// inspect, compress, decompress, verify: thin wrappers over checkpoint.hpp.
#include <fmt/core.h>

#include <map>

#include "cli.hpp"
#include "csfmoe/errors.hpp"

namespace csfmoe::cli {

namespace fs = std::filesystem;

ScaleLayout layout_arg(const std::string& s) { return parse_scale_layout(s); }

void check_output_path(const fs::path& in, const fs::path& out) {
  std::error_code ec;
  if (fs::weakly_canonical(in, ec) == fs::weakly_canonical(out, ec) || fs::equivalent(in, out, ec))
    throw InvalidArgument(fmt::format("output {} is the input", out.string()));
  if (fs::exists(fs::symlink_status(out, ec)))
    throw InvalidArgument(fmt::format("output {} already exists; refusing to overwrite it", out.string()));
}

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
    if (a.device) print_device_report(stdout, report);
  }
  return 0;
}

int run_compress(const CompressArgs& a) {
  check_output_path(a.in, a.out);
  CompressOptions o;
  o.tp = a.tp;
  o.tp_rank = a.tp_rank;
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
  if (!a.quiet) {
    print_kept_native(stdout, report);
    print_report_table(stdout, report);
    if (a.tp > 1) fmt::print("tensor-parallel slice: tp {} rank {}\n", a.tp, a.tp_rank);
    fmt::print("wrote {}\n", a.out.string());
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
  for (const auto& t : report.tensors) {
    if (!checked.count(t.file)) files.push_back(t.file);
    checked[t.file] += t.action == TensorAction::csf ? 1 : 0;
  }
  if (files.empty()) fmt::print("OK {} (no tensors)\n", a.path.string());
  for (const auto& f : files) fmt::print("OK {} ({} CSF tensors verified)\n", f, checked[f]);
  return 0;
}

}  // namespace csfmoe::cli
