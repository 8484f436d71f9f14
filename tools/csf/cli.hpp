// Internal interface of the `csf` tool: one function per sub-command plus
// the shared report printing and progress helpers. The tool is a thin layer
// over the library; every check that matters lives in the library.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "csfmoe/checkpoint.hpp"

namespace csfmoe::cli {

// A bad command line that CLI11 could not catch (exit code 2).
struct UsageError : std::runtime_error {
  explicit UsageError(const std::string& m) : std::runtime_error(m) {}
};

struct InspectArgs {
  std::filesystem::path path;
  bool json = false;
  bool device = false;  // inspect only: resident device memory per layer and model
  std::string layout;   // "" = each file's csfmoe.scale_layout tag, else row_major
  unsigned threads = 0;
};

struct CompressArgs {
  std::filesystem::path in, out;
  std::string layout;  // "" = each file's csfmoe.scale_layout tag, else row_major
  unsigned threads = 0;
  bool quiet = false;
  unsigned tp = 1, tp_rank = 0;   // compress only: tensor-parallel slice to store
  std::string schema = "csfmoe";  // compress only: csfmoe | b12x
  bool no_mxfp4_slab = false;     // compress only: keep MXFP4 scales as planes
};

struct QuantizeArgs {
  std::filesystem::path in, out;
  std::string format;
  std::string include = R"(.*\.weight$)";
  std::uint64_t min_rows = 1;
  bool quiet = false;
};

struct DemoArgs {
  std::optional<std::filesystem::path> data;
  bool keep = false;
  unsigned threads = 0;
};

struct SynthArgs {
  std::filesystem::path out;
  std::string model;
  std::string format;
  std::optional<std::uint32_t> experts;
  std::uint32_t layers = 1;
  std::uint64_t seed = 1;
  std::string layout = "row_major";
  bool quiet = false;
};

int run_inspect(const InspectArgs& a);
int run_compress(const CompressArgs& a);
int run_decompress(const CompressArgs& a);
int run_verify(const InspectArgs& a);
int run_quantize(const QuantizeArgs& a);
int run_demo(const DemoArgs& a);
int run_synth(const SynthArgs& a);

// --- report.cpp ------------------------------------------------------------
// Bytes a tensor of this safetensors dtype and shape occupies (0 if the
// dtype is unknown).
std::uint64_t tensor_bytes(const std::string& dtype, const std::vector<std::uint64_t>& shape);
// Bytes of the tensor in the source checkpoint.
std::uint64_t source_bytes(const TensorReport& t);
// Bytes as stored after compression (CSF parts, native scale or passthrough).
std::uint64_t stored_bytes(const TensorReport& t);
std::string human_bytes(std::uint64_t bytes);
std::string_view to_string(TensorAction a);
// Concatenates reports of several files into one (totals summed).
CheckpointReport merge_reports(const std::vector<CheckpointReport>& reports,
                               const std::filesystem::path& path);
void print_report_table(std::FILE* out, const CheckpointReport& report);
nlohmann::json report_to_json(const CheckpointReport& report);
// Resident device memory of the checkpoint's tensors with native scales and
// with CSF scales, per MoE layer and for the model, plus the expand scratch
// (one shared by all layers: the largest layer's native scales).
void print_device_report(std::FILE* out, const CheckpointReport& report);
nlohmann::json device_report_json(const CheckpointReport& report);
// "tensor-parallel slice: rank R of tp N ..." for a file that holds one.
std::string tp_slice_text(const TpSliceInfo& t);
// One line per file of the report that holds a tensor-parallel slice.
void print_tp_slices(std::FILE* out, const CheckpointReport& report);
// One line per tensor kept native, with the reason.
void print_kept_native(std::FILE* out, const CheckpointReport& report);

// --- progress.cpp ----------------------------------------------------------
// Progress on stderr: a redrawn bar on a terminal, plain lines every few
// seconds otherwise, nothing when quiet.
class ProgressPrinter {
 public:
  ProgressPrinter(std::string verb, bool quiet);
  ~ProgressPrinter();
  ProgressPrinter(const ProgressPrinter&) = delete;
  ProgressPrinter& operator=(const ProgressPrinter&) = delete;

  ProgressFn callback();
  // Ends the bar line (call once the job finished or failed).
  void finish();

 private:
  void update(const Progress& p);
  std::string verb_;
  bool quiet_;
  bool tty_;
  bool drawn_ = false;
  double start_ = 0, last_ = -1e9;
  Progress latest_;
};

// --- shared helpers (commands.cpp) -----------------------------------------
// "" (not given): each file's own tag, else row_major (CompressOptions::layout).
std::optional<ScaleLayout> layout_arg(const std::string& s);
// Output rules shared by the commands that write: out must not exist and
// must differ from in. Throws InvalidArgument naming the path.
void check_output_path(const std::filesystem::path& in, const std::filesystem::path& out);

}  // namespace csfmoe::cli
