// csf synth: a synthetic MoE checkpoint of a real model's geometry, with
// stacked per-layer expert tensors and realistic block scales.
//   NVFP4 (ModelOpt names, experts stacked), per layer L:
//     model.layers.L.mlp.experts.w13.weight         U8      [E, 2N, H/2]
//     model.layers.L.mlp.experts.w13.weight_scale   F8_E4M3 [E, 2N, H/16]
//     model.layers.L.mlp.experts.w13.weight_scale_2 F32     [E]
//     model.layers.L.mlp.experts.w13.input_scale    F32     [E]
//     ... and the same for w2 with [E, H, N/2], [E, H, N/16].
//   MXFP4 (gpt-oss names), per layer L:
//     model.layers.L.mlp.experts.gate_up_proj_blocks U8 [E, 2N, H/32, 16]
//     model.layers.L.mlp.experts.gate_up_proj_scales U8 [E, 2N, H/32]
//     model.layers.L.mlp.experts.down_proj_blocks    U8 [E, H, N/32, 16]
//     model.layers.L.mlp.experts.down_proj_scales    U8 [E, H, N/32]
#include <fmt/core.h>

#include <cstring>
#include <memory>

#include "cli.hpp"
#include "csfmoe/errors.hpp"
#include "csfmoe/synthetic.hpp"
#include "st_io.hpp"

namespace csfmoe::cli {

namespace {

// Random FP4 nibbles, written in 1 MiB chunks so huge experts never sit in memory.
OutTensor random_bytes_tensor(std::string name, std::vector<std::uint64_t> shape, std::uint64_t seed) {
  std::uint64_t total = 1;
  for (const auto d : shape) total *= d;
  return {std::move(name), st::Dtype::U8, std::move(shape), [total, seed](st::Writer& w) {
            std::uint64_t s = seed;
            std::vector<std::uint8_t> buf(1u << 20);
            for (std::uint64_t done = 0; done < total;) {
              const std::size_t n =
                  static_cast<std::size_t>(std::min<std::uint64_t>(buf.size(), total - done));
              for (std::size_t i = 0; i < n; i += 8) {
                const auto r = splitmix64(s);
                std::memcpy(buf.data() + i, &r, std::min<std::size_t>(8, n - i));
              }
              w.write(std::span<const std::uint8_t>(buf.data(), n));
              done += n;
            }
          }};
}

OutTensor scale_tensor(std::string name, st::Dtype dtype, const GridShape& shape, std::uint64_t seed) {
  const auto geom = CsfGeometry::of(shape);
  std::vector<std::uint64_t> dims = {shape.experts, shape.rows, shape.cols};
  if (shape.layout == ScaleLayout::swizzled_128x4) dims = {shape.experts, geom.padded_rows, geom.padded_cols};
  return {std::move(name), std::move(dtype), std::move(dims), [shape, seed](st::Writer& w) {
            w.write(synthetic_scales(shape, ScaleDistribution::realistic, seed));
          }};
}

OutTensor f32_vector(std::string name, std::vector<float> v) {
  const std::uint64_t n = v.size();
  return {
      std::move(name), st::Dtype::F32, {n}, [v = std::move(v)](st::Writer& w) {
        w.write(std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(v.data()), v.size() * 4));
      }};
}

}  // namespace

int run_synth(const SynthArgs& a) {
  MoeGeometry g = moe_geometry(a.model);
  if (a.experts) {
    if (*a.experts == 0 || *a.experts > g.experts)
      throw UsageError(fmt::format("--experts {} must be in 1..{} for {}", *a.experts, g.experts, g.name));
    g.experts = *a.experts;
  }
  const ScaleFormat f = parse_scale_format(a.format);
  const ScaleLayout layout = parse_scale_layout(a.layout);
  if (std::filesystem::exists(std::filesystem::symlink_status(a.out)))
    throw InvalidArgument(fmt::format("output {} already exists; refusing to overwrite it", a.out.string()));

  const std::uint64_t E = g.experts, H = g.hidden, N = g.intermediate, gs = group_size(f);
  std::uint64_t seed = a.seed;
  std::vector<OutTensor> tensors;
  for (std::uint32_t l = 0; l < a.layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.mlp.experts.", l);
    const auto s13 = w13_scale_shape(g, f, layout), s2 = w2_scale_shape(g, f, layout);
    if (f == ScaleFormat::nvfp4) {
      // Per-expert global scales in the range real ModelOpt checkpoints use.
      std::vector<float> g13(E), g2(E), ones(E, 1.0f);
      for (std::uint64_t e = 0; e < E; ++e) {
        g13[e] = 1e-4f * float(1 + splitmix64(seed) % 64) / 16.0f;
        g2[e] = 1e-4f * float(1 + splitmix64(seed) % 64) / 16.0f;
      }
      tensors.push_back(random_bytes_tensor(p + "w13.weight", {E, 2 * N, H / 2}, splitmix64(seed)));
      tensors.push_back(scale_tensor(p + "w13.weight_scale", st::Dtype::F8_E4M3, s13, splitmix64(seed)));
      tensors.push_back(f32_vector(p + "w13.weight_scale_2", g13));
      tensors.push_back(f32_vector(p + "w13.input_scale", ones));
      tensors.push_back(random_bytes_tensor(p + "w2.weight", {E, H, N / 2}, splitmix64(seed)));
      tensors.push_back(scale_tensor(p + "w2.weight_scale", st::Dtype::F8_E4M3, s2, splitmix64(seed)));
      tensors.push_back(f32_vector(p + "w2.weight_scale_2", g2));
      tensors.push_back(f32_vector(p + "w2.input_scale", ones));
    } else {
      tensors.push_back(
          random_bytes_tensor(p + "gate_up_proj_blocks", {E, 2 * N, H / gs, gs / 2}, splitmix64(seed)));
      tensors.push_back(scale_tensor(p + "gate_up_proj_scales", st::Dtype::U8, s13, splitmix64(seed)));
      tensors.push_back(
          random_bytes_tensor(p + "down_proj_blocks", {E, H, N / gs, gs / 2}, splitmix64(seed)));
      tensors.push_back(scale_tensor(p + "down_proj_scales", st::Dtype::U8, s2, splitmix64(seed)));
    }
  }
  const st::Metadata meta = {
      {"csfmoe.synthetic", "true"},
      {"csfmoe.model", std::string(g.name)},
      {"csfmoe.format", a.format},
      {std::string(kScaleLayoutKey), a.layout},
      {"csfmoe.experts", std::to_string(E)},
      {"csfmoe.layers", std::to_string(a.layers)},
      {"csfmoe.seed", std::to_string(a.seed)},
  };
  write_safetensors(a.out, tensors, meta);
  if (!a.quiet)
    fmt::print("wrote {}: {} {} layer{} x {} expert{} (H={}, N={})\n", a.out.string(), g.name, a.layers,
               a.layers == 1 ? "" : "s", E, E == 1 ? "" : "s", H, N);
  return 0;
}

}  // namespace csfmoe::cli
