// csf quantize: BF16/F16/F32 weight matrices -> NVFP4 (ModelOpt names) or
// MXFP4 (gpt-oss names). Everything else is copied unchanged.
#include <fmt/core.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <regex>

#include "cli.hpp"
#include "csfmoe/errors.hpp"
#include "csfmoe/quantize.hpp"
#include "st_io.hpp"

namespace csfmoe::cli {

namespace {

float f16_to_float(std::uint16_t h) {
  const std::uint32_t sign = (h >> 15) & 1u, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  float v;
  if (exp == 0) {
    v = std::ldexp(float(man), -24);  // subnormal (or zero)
  } else if (exp == 31) {
    v = man ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    v = std::ldexp(float(man | 0x400u), int(exp) - 25);
  }
  return sign ? -v : v;
}

std::vector<float> to_float(st::Dtype dtype, std::span<const std::uint8_t> bytes) {
  std::vector<float> out;
  const auto* p = bytes.data();
  if (dtype == st::Dtype::F32) {
    out.resize(bytes.size() / 4);
    std::memcpy(out.data(), p, out.size() * 4);
  } else {
    out.resize(bytes.size() / 2);
    for (std::size_t i = 0; i < out.size(); ++i) {
      const auto bits = static_cast<std::uint16_t>(p[2 * i] | (p[2 * i + 1] << 8));
      out[i] = dtype == st::Dtype::BF16 ? bf16_to_float(bits) : f16_to_float(bits);
    }
  }
  return out;
}

// A tensor whose bytes are already in memory (shared so the writer can run later).
OutTensor bytes_tensor(std::string name, st::Dtype dtype, std::vector<std::uint64_t> shape,
                       std::shared_ptr<const std::vector<std::uint8_t>> data) {
  return {std::move(name), dtype, std::move(shape), [data](st::Writer& w) { w.write(*data); }};
}

OutTensor span_tensor(std::string name, st::Dtype dtype, std::vector<std::uint64_t> shape,
                      std::span<const std::uint8_t> data) {
  return {std::move(name), dtype, std::move(shape), [data](st::Writer& w) { w.write(data); }};
}

OutTensor f32_scalar(std::string name, float v) {
  auto d = std::make_shared<std::vector<std::uint8_t>>(4);
  std::memcpy(d->data(), &v, 4);  // safetensors is little-endian, as is every target we build for
  return bytes_tensor(std::move(name), st::Dtype::F32, {}, d);
}

}  // namespace

int run_quantize(const QuantizeArgs& a) {
  const ScaleFormat format = parse_scale_format(a.format);
  std::regex include;
  try {
    include = std::regex(a.include, std::regex::ECMAScript);
  } catch (const std::regex_error& e) {
    throw UsageError(fmt::format("--include '{}' is not a valid regex: {}", a.include, e.what()));
  }
  if (std::filesystem::is_directory(a.in))
    throw InvalidArgument(
        fmt::format("{}: quantize takes one safetensors file, not a folder", a.in.string()));
  check_output_path(a.in, a.out);
  const auto src = st::File::open(a.in);
  const unsigned g = group_size(format);

  std::vector<OutTensor> out;
  std::size_t quantized = 0, passed = 0;
  // Matrices the user asked for (name matches --include) but that stay as they are, and why.
  std::vector<std::string> kept;
  for (const auto& t : src.tensors()) {
    const bool float_dtype =
        t.dtype == st::Dtype::BF16 || t.dtype == st::Dtype::F16 || t.dtype == st::Dtype::F32;
    std::string why;
    if (!std::regex_search(t.name, include))
      why = "name does not match --include";
    else if (!float_dtype)
      why = fmt::format("dtype {} is not BF16, F16 or F32", st::to_string(t.dtype));
    else if (t.shape.size() != 2)
      why = fmt::format("{} dimensions, not a 2-D matrix", t.shape.size());
    else if (t.shape[1] == 0 || t.shape[1] % g != 0)
      why = fmt::format("K = {} is not a positive multiple of the {}-element {} block", t.shape[1], g,
                        a.format);
    else if (t.shape[0] == 0 || t.shape[0] < a.min_rows)
      why = fmt::format("{} rows, below --min-rows {}", t.shape[0], std::max<std::uint64_t>(a.min_rows, 1));
    if (!why.empty()) {
      ++passed;
      if (std::regex_search(t.name, include))
        kept.push_back(fmt::format("  kept as is: {} {} [{}]: {}", t.name, st::to_string(t.dtype),
                                   fmt::join(t.shape, ", "), why));
      out.push_back(span_tensor(t.name, t.dtype, t.shape, src.data(t)));
      continue;
    }
    const auto rows = static_cast<std::size_t>(t.shape[0]), cols = static_cast<std::size_t>(t.shape[1]);
    const auto x = to_float(t.dtype, src.data(t));
    for (std::size_t i = 0; i < x.size(); ++i)
      if (!std::isfinite(x[i]))
        throw InvalidArgument(fmt::format("{}: tensor {}: element {} is not finite; cannot quantize",
                                          a.in.string(), t.name, i));
    auto q = format == ScaleFormat::nvfp4 ? quantize_nvfp4(x, rows, cols) : quantize_mxfp4(x, rows, cols);
    // ModelOpt names scales after the module ("X.weight" -> "X.weight_scale");
    // gpt-oss after the parameter stem ("X.weight" -> "X_blocks", "X_scales").
    const std::string stem =
        t.name.size() > 7 && t.name.ends_with(".weight") ? t.name.substr(0, t.name.size() - 7) : t.name;
    auto packed = std::make_shared<const std::vector<std::uint8_t>>(std::move(q.packed));
    auto scales = std::make_shared<const std::vector<std::uint8_t>>(std::move(q.scales));
    const std::uint64_t c = cols / g;
    if (format == ScaleFormat::nvfp4) {
      out.push_back(bytes_tensor(stem + ".weight", st::Dtype::U8, {rows, cols / 2}, packed));
      out.push_back(bytes_tensor(stem + ".weight_scale", st::Dtype::F8_E4M3, {rows, c}, scales));
      out.push_back(f32_scalar(stem + ".weight_scale_2", q.global_scale));
      out.push_back(f32_scalar(stem + ".input_scale", 1.0f));
    } else {
      out.push_back(bytes_tensor(stem + "_blocks", st::Dtype::U8, {rows, c, g / 2}, packed));
      out.push_back(bytes_tensor(stem + "_scales", st::Dtype::U8, {rows, c}, scales));
    }
    ++quantized;
  }
  st::Metadata meta = src.header().metadata.value_or(st::Metadata{});
  meta["csfmoe.quantized_by"] = fmt::format("csf quantize --format {}", a.format);
  if (format == ScaleFormat::nvfp4) meta["quantization"] = "modelopt-nvfp4";
  write_safetensors(a.out, out, meta);
  if (!a.quiet) {
    for (const auto& k : kept) fmt::print("{}\n", k);
    fmt::print("quantized {} matrices to {}, passed {} tensors through ({} matching --include); wrote {}\n",
               quantized, a.format, passed, kept.size(), a.out.string());
  }
  return 0;
}

}  // namespace csfmoe::cli
