// csf: compress, restore, verify and inspect the FP4 block scales of
// safetensors checkpoints. Errors end as one line `csf: error: ...` on
// stderr with exit code 1; command-line mistakes exit with 2.
#include <fmt/core.h>

#include <CLI/CLI.hpp>
#include <exception>
#include <string>

#include "cli.hpp"
#include "csfmoe/errors.hpp"
#include "csfmoe/synthetic.hpp"
#include "moe_command.hpp"

namespace {

std::string one_line(std::string s) {
  for (auto& c : s)
    if (c == '\n' || c == '\r') c = ' ';
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace csfmoe::cli;
  CLI::App app{"csf: lossless CSF compression of NVFP4/MXFP4 block scales in safetensors checkpoints"};
  app.require_subcommand(1);
  app.footer(R"(Table columns (inspect, compress, demo):
  rows     scale rows (one per output row of each expert projection)
  bases    distinct base bytes among the rows (each row stores one base + 4-bit or 1-bit offsets)
  exc      exceptions: scale bytes outside their row's window, stored whole (share of all scale bytes)
  before   bytes in the source; after: bytes as stored
  ratio    after / before: lower is better (50% = half the bytes)
  action   csf: stored compressed; native_kept: a scale tensor kept as is (CSF would not be smaller, or
           it cannot be encoded; the reason is printed); passthrough: not a block-scale tensor, copied
csf moe scale modes: native (uncompressed scales), expanded (CSF expanded once ahead of calls), routed
  (the call's routed experts expanded per call), stage_read (the GEMM reads CSF scales directly).
Exit codes: 0 success; 1 error (bad or corrupt input, I/O; nothing is written); 2 usage error;
  3 csf moe: the GPU result's error is not below --max-error.)");
  app.set_version_flag("--version", std::string("csf ") + CSFMOE_VERSION);

  const auto layouts = CLI::IsMember({"row_major", "swizzled_128x4"});
  const auto formats = CLI::IsMember({"nvfp4", "mxfp4"});
  constexpr const char* kLayoutHelp =
      "layout of the source scale tensors (default: the file's csfmoe.scale_layout tag, else row_major; "
      "a value that contradicts the tag is an error)";

  InspectArgs inspect;
  auto* c_inspect =
      app.add_subcommand("inspect", "Per-tensor statistics of a native or compressed checkpoint");
  c_inspect->add_option("path", inspect.path, "safetensors file or checkpoint folder")->required();
  c_inspect->add_flag("--json", inspect.json, "machine-readable JSON on stdout");
  c_inspect->add_flag("--device", inspect.device,
                      "resident device memory per layer and model, native vs CSF scales");
  c_inspect->add_option("--layout", inspect.layout, kLayoutHelp)->check(layouts);
  c_inspect->add_option("--threads", inspect.threads, "worker threads (0: all cores)");

  CompressArgs compress;
  auto* c_compress = app.add_subcommand("compress", "Compress the block-scale tensors into CSF");
  c_compress->add_option("in", compress.in, "safetensors file or checkpoint folder")->required();
  c_compress->add_option("out", compress.out, "output file or folder (must not exist)")->required();
  c_compress->add_option("--threads", compress.threads, "worker threads (0: all cores)");
  c_compress->add_option("--layout", compress.layout, kLayoutHelp)->check(layouts);
  c_compress->add_flag("--quiet,-q", compress.quiet, "no progress and no table");
  c_compress
      ->add_option("--tp", compress.tp,
                   "tensor-parallel degree: store only rank --rank's slice of the MoE expert projections")
      ->check(CLI::Range(1u, 1024u));
  c_compress
      ->add_option(
          "--schema", compress.schema,
          "csfmoe (default: every scale that pays, stored compactly) or b12x (b12x / vLLM's canonical "
          "planes, X.nvfp4_csf_fixed + X.nvfp4_csf_exceptions, for every per-expert scale, stacked [E, R, C] "
          "experts split per expert first; a file those loaders read, restored by csf decompress)")
      ->check(CLI::IsMember({"csfmoe", "b12x"}))
      ->capture_default_str();
  c_compress->add_flag(
      "--no-mxfp4-slab", compress.no_mxfp4_slab,
      "csfmoe schema only: store MXFP4 scales as b12x's planes (container version 2) even where "
      "their slab form (version 3: a base per 16 rows, unpadded selectors) is smaller");
  auto* rank_option = c_compress->add_option("--rank", compress.tp_rank,
                                             "tensor-parallel rank in [0, --tp); required with --tp");

  CompressArgs decompress;
  auto* c_decompress = app.add_subcommand(
      "decompress",
      "Restore the original checkpoint byte for byte: csf containers (--schema b12x ones too), files and "
      "folders written by b12x / vLLM (their CSF planes decoded to native scales; b12x's manifest export "
      "becomes a Hugging Face folder), and tensor-parallel containers (compress --tp N --rank R), which "
      "restore to that rank's native slice");
  c_decompress
      ->add_option(
          "in", decompress.in,
          "compressed file or folder: a csf container, a b12x / vLLM file or folder, or a TP container")
      ->required();
  c_decompress->add_option("out", decompress.out, "output file or folder (must not exist)")->required();
  c_decompress->add_option("--threads", decompress.threads, "worker threads (0: all cores)");
  c_decompress->add_flag("--quiet,-q", decompress.quiet, "no progress");

  InspectArgs verify;
  auto* c_verify = app.add_subcommand("verify", "Decode every CSF tensor and check its CRC");
  c_verify->add_option("path", verify.path, "compressed file or folder")->required();
  c_verify->add_option("--threads", verify.threads, "worker threads (0: all cores)");

  QuantizeArgs quantize;
  auto* c_quantize =
      app.add_subcommand("quantize", "Quantize BF16/F16/F32 weight matrices to NVFP4 or MXFP4");
  c_quantize->add_option("in", quantize.in, "BF16/F16/F32 safetensors file")->required();
  c_quantize->add_option("out", quantize.out, "output safetensors file (must not exist)")->required();
  c_quantize->add_option("--format", quantize.format, "nvfp4 (ModelOpt names) or mxfp4 (gpt-oss names)")
      ->required()
      ->check(formats);
  c_quantize->add_option("--include", quantize.include, "ECMAScript regex a tensor name must match")
      ->capture_default_str();
  c_quantize
      ->add_option("--min-rows", quantize.min_rows, "quantize only matrices with at least this many rows")
      ->capture_default_str();
  c_quantize->add_flag("--quiet,-q", quantize.quiet, "print nothing on success");

  DemoArgs demo;
  auto* c_demo =
      app.add_subcommand("demo", "compress -> inspect -> decompress -> verify on the bundled sample");
  c_demo->add_option("--data", demo.data, "folder with the sample .safetensors files (default: data/)");
  c_demo->add_flag("--keep", demo.keep, "keep the temporary folder");
  c_demo->add_option("--threads", demo.threads, "worker threads (0: all cores)");

  SynthArgs synth;
  auto* c_synth = app.add_subcommand("synth", "Write a synthetic MoE checkpoint of a real model's geometry");
  c_synth->add_option("out", synth.out, "output safetensors file (must not exist)")->required();
  std::vector<std::string> geometries;
  for (const csfmoe::MoeGeometry* g : csfmoe::moe_geometries()) geometries.emplace_back(g->name);
  c_synth->add_option("--model", synth.model, "geometry")->required()->check(CLI::IsMember(geometries));
  c_synth->add_option("--format", synth.format, "nvfp4 or mxfp4")->required()->check(formats);
  std::string expert_limits;
  for (const csfmoe::MoeGeometry* g : csfmoe::moe_geometries())
    expert_limits += fmt::format("{}{} {}", expert_limits.empty() ? "" : ", ", g->name, g->experts);
  c_synth
      ->add_option(
          "--experts", synth.experts,
          "experts per layer, 1 up to the model's own count, which is the default (" + expert_limits + ")")
      ->check(CLI::Range(1u, 65536u));
  c_synth->add_option("--layers", synth.layers, "MoE layers")
      ->check(CLI::Range(1u, 4096u))
      ->capture_default_str();
  c_synth->add_option("--seed", synth.seed, "random seed")->capture_default_str();
  c_synth->add_option("--layout", synth.layout, "layout of the written scale tensors")->check(layouts);
  c_synth->add_flag("--quiet,-q", synth.quiet, "print nothing on success");

  // `moe` runs from its own callback and exits with its own code.
  register_moe_command(app);

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion&) {
    fmt::print("csf {}\n", CSFMOE_VERSION);
    return 0;
  } catch (const CLI::ParseError& e) {
    fmt::print(stderr, "csf: usage error: {} (see csf --help)\n", one_line(e.what()));
    return 2;
  }

  try {
    if (c_compress->parsed() && compress.tp > 1 && rank_option->count() == 0)
      throw UsageError(
          fmt::format("--tp {} needs --rank (which slice to store, 0..{})", compress.tp, compress.tp - 1));
    if (c_compress->parsed() && rank_option->count() != 0 && compress.tp <= 1)
      throw UsageError(
          fmt::format("--rank {} needs --tp (the tensor-parallel degree, at least 2)", compress.tp_rank));
    if (c_compress->parsed() && compress.tp > 1 && compress.tp_rank >= compress.tp)
      throw UsageError(fmt::format("--rank {} is outside --tp {}'s ranks 0..{}", compress.tp_rank,
                                   compress.tp, compress.tp - 1));
    if (c_compress->parsed() && compress.schema == "b12x" && compress.no_mxfp4_slab)
      throw UsageError(
          "--no-mxfp4-slab chooses how the csfmoe schema stores MXFP4 scales; --schema b12x always writes "
          "b12x's planes (never the slab form), so drop one of the two");
    if (c_inspect->parsed()) return run_inspect(inspect);
    if (c_compress->parsed()) return run_compress(compress);
    if (c_decompress->parsed()) return run_decompress(decompress);
    if (c_verify->parsed()) return run_verify(verify);
    if (c_quantize->parsed()) return run_quantize(quantize);
    if (c_demo->parsed()) return run_demo(demo);
    if (c_synth->parsed()) return run_synth(synth);
  } catch (const UsageError& e) {
    fmt::print(stderr, "csf: usage error: {}\n", one_line(e.what()));
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "csf: error: {}\n", one_line(e.what()));
    return 1;
  }
  return 2;
}
