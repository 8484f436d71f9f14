// csf demo: compress -> inspect -> decompress -> verify on the bundled
// sample in a temporary folder, and check the restored files are
// byte-identical to the sample.
#include <fmt/core.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <iterator>

#include "cli.hpp"
#include "csfmoe/errors.hpp"

namespace csfmoe::cli {

namespace fs = std::filesystem;

namespace {

bool has_sample(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return false;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.path().extension() == ".safetensors") return true;
  return false;
}

// The sample ships in <source>/data. Look next to the source tree this
// binary was built from, then upwards from the executable (a build folder
// inside the source tree, or an unpacked copy of both).
fs::path find_data_dir() {
#ifdef CSFMOE_SOURCE_DIR
  if (has_sample(fs::path(CSFMOE_SOURCE_DIR) / "data")) return fs::path(CSFMOE_SOURCE_DIR) / "data";
#endif
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    for (fs::path p = exe.parent_path(); !p.empty(); p = p.parent_path()) {
      if (has_sample(p / "data") && fs::exists(p / "data" / "README.md")) return p / "data";
      if (p == p.root_path()) break;
    }
  }
  throw InvalidArgument("cannot find the bundled sample folder data/; pass --data DIR");
}

std::vector<std::uint8_t> read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw IoError(fmt::format("{}: cannot open for reading", p.string()));
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Removes the temporary folder on every exit path unless asked to keep it.
struct TempDir {
  fs::path path;
  bool keep = false;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "csf-demo-XXXXXX").string();
    if (!::mkdtemp(tmpl.data())) throw IoError(fmt::format("cannot create a temporary folder from {}", tmpl));
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    if (!keep) fs::remove_all(path, ec);
  }
};

}  // namespace

int run_demo(const DemoArgs& a) {
  const fs::path data = a.data ? *a.data : find_data_dir();
  if (!has_sample(data))
    throw InvalidArgument(fmt::format("{}: no .safetensors files in this folder", data.string()));
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(data))
    if (e.path().extension() == ".safetensors" && e.is_regular_file()) files.push_back(e.path());
  std::sort(files.begin(), files.end());

  TempDir tmp;
  tmp.keep = a.keep;
  const fs::path compressed = tmp.path / "compressed", restored = tmp.path / "restored";
  fs::create_directories(compressed);
  fs::create_directories(restored);
  fmt::print("csf demo: {} sample files from {}, working in {}\n", files.size(), data.string(),
             tmp.path.string());

  CompressOptions o;
  o.threads = a.threads;
  std::vector<CheckpointReport> reports;
  for (const auto& f : files) {
    const auto name = f.filename();
    const auto c = compressed / name, r = restored / name;
    auto report = compress_checkpoint(f, c, o);
    fmt::print("  compress    {}: file {} -> {}, scales {} -> {}\n", name.string(),
               human_bytes(fs::file_size(f)), human_bytes(fs::file_size(c)),
               human_bytes(report.scale_source_bytes), human_bytes(report.scale_stored_bytes));
    print_kept_native(stdout, report);

    // The compressed file must report the same per-tensor encoding as the
    // compression run did.
    const auto inspected = inspect_checkpoint(c, o);
    std::size_t csf_tensors = 0;
    for (const auto& t : report.tensors) {
      if (t.action != TensorAction::csf) continue;
      ++csf_tensors;
      const auto it = std::find_if(inspected.tensors.begin(), inspected.tensors.end(),
                                   [&](const TensorReport& x) { return x.name == t.name; });
      if (it == inspected.tensors.end() || it->stats.encoded_bytes != t.stats.encoded_bytes ||
          it->stats.exceptions != t.stats.exceptions)
        throw CorruptData(fmt::format("{}: tensor {}: inspect of the compressed file disagrees with compress",
                                      c.string(), t.name));
    }
    fmt::print("  inspect     {}: {} CSF tensors\n", name.string(), csf_tensors);

    decompress_checkpoint(c, r, o);
    fmt::print("  decompress  {}: {}\n", name.string(), human_bytes(fs::file_size(r)));
    verify_checkpoint(c, o);
    fmt::print("  verify      {}: OK\n", name.string());
    if (read_all(f) != read_all(r))
      throw CorruptData(fmt::format("{}: restored file differs from the sample {}", r.string(), f.string()));
    fmt::print("  identical   {}: restored bytes == sample bytes\n", name.string());
    reports.push_back(std::move(report));
  }
  fmt::print("\n");
  print_report_table(stdout, merge_reports(reports, data));
  if (a.keep) fmt::print("kept {}\n", tmp.path.string());
  fmt::print("OK: {} files compressed, verified and restored byte-identical\n", files.size());
  return 0;
}

}  // namespace csfmoe::cli
