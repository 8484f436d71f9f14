// Block-scale tensor detection by name, companion tensor, dtype and shape.
#include "checkpoint/detect.hpp"

#include <fmt/format.h>

#include "csfmoe/checkpoint.hpp"
#include "csfmoe/errors.hpp"

namespace csfmoe::detail {

std::string shape_str(const std::vector<std::uint64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

namespace {

// Checks scale grid [.., Rs, Cs] against a weight of R rows by K elements with
// the same leading dims; returns the format or sets `why`.
std::optional<ScaleFormat> match_grid(std::uint64_t rs, std::uint64_t cs, std::uint64_t r, std::uint64_t k,
                                      ScaleLayout layout, std::string& why) {
  for (ScaleFormat f : {ScaleFormat::nvfp4, ScaleFormat::mxfp4}) {
    const std::uint64_t g = group_size(f);
    if (k % g) continue;
    std::uint64_t want_r = r, want_c = k / g;
    if (layout == ScaleLayout::swizzled_128x4) {
      want_r = round_up(r, 128);
      want_c = round_up(k / g, 4);
    }
    if (rs == want_r && cs == want_c) return f;
  }
  why = fmt::format("scale grid {}x{} matches neither K/16 nor K/32 blocks of a {}x{} FP4 weight ({})", rs,
                    cs, r, k, to_string(layout));
  return std::nullopt;
}

}  // namespace

ScaleLayout source_layout(const st::Header& header, std::optional<ScaleLayout> requested,
                          const std::string& label) {
  std::optional<ScaleLayout> tagged;
  if (header.metadata)
    if (auto it = header.metadata->find(std::string(kScaleLayoutKey)); it != header.metadata->end()) {
      try {
        tagged = parse_scale_layout(it->second);
      } catch (const InvalidArgument& e) {
        throw FormatError(fmt::format("{}: __metadata__ '{}': {}", label, kScaleLayoutKey, e.what()));
      }
    }
  if (tagged && requested && *tagged != *requested)
    throw InvalidArgument(
        fmt::format("{}: the file says its scales are {} (__metadata__ '{}'), but {} was asked for", label,
                    to_string(*tagged), kScaleLayoutKey, to_string(*requested)));
  return tagged.value_or(requested.value_or(ScaleLayout::row_major));
}

const ScaleCandidate* Detection::find(std::string_view name) const {
  for (const auto& s : scales)
    if (s.name == name) return &s;
  return nullptr;
}

std::string moe_layer_key(std::string_view name) {
  constexpr std::string_view kExperts = ".experts.";
  const auto pos = name.rfind(kExperts);
  if (pos != std::string_view::npos) return std::string(name.substr(0, pos + kExperts.size() - 1));
  if (name.substr(0, 8) == "experts.") return "experts";
  return "";
}

Detection detect_scales(const st::Header& header, ScaleLayout layout, const std::string& label) {
  Detection out;
  for (const auto& t : header.tensors) {
    std::string companion;
    bool gptoss = false;
    if (t.name.ends_with(".weight_scale")) {
      companion = t.name.substr(0, t.name.size() - 6);  // "X.weight_scale" -> "X.weight"
    } else if (t.name.ends_with(".scale")) {
      companion = t.name.substr(0, t.name.size() - 6) + ".weight";  // DeepSeek-V4.1: "S.scale" -> "S.weight"
    } else if (t.name.ends_with("_scales")) {
      companion = t.name.substr(0, t.name.size() - 7) + "_blocks";
      gptoss = true;
    } else {
      continue;
    }
    auto reject = [&](std::string why) { out.rejected[t.name] = std::move(why); };
    const st::TensorInfo* w = header.find(companion);
    if (!w) {
      reject(fmt::format("no companion tensor '{}'", companion));
      continue;
    }
    if (w->dtype != st::Dtype::U8) {
      reject(fmt::format("companion '{}' is {}, not packed FP4 (U8)", companion, st::to_string(w->dtype)));
      continue;
    }
    const auto& ss = t.shape;
    const auto& ws = w->shape;
    const std::size_t want_rank = ss.size() + (gptoss ? 1 : 0);
    if (ss.size() < 2 || ws.size() != want_rank) {
      reject(fmt::format("shape {} is not consistent with companion '{}' {}", shape_str(ss), companion,
                         shape_str(ws)));
      continue;
    }
    bool lead_ok = true;
    std::uint64_t experts = 1;
    for (std::size_t i = 0; i + 2 < ss.size(); ++i) {
      lead_ok = lead_ok && ss[i] == ws[i];
      experts *= ss[i];
    }
    const std::uint64_t rs = ss[ss.size() - 2], cs = ss.back();
    const std::uint64_t r = ws[ss.size() - 2];
    std::uint64_t k = 0;
    if (gptoss) {
      if (ws.back() != 16) lead_ok = false;
      k = ws[ss.size() - 1] * 32;
    } else {
      k = ws.back() * 2;
    }
    if (!lead_ok) {
      reject(fmt::format("shape {} is not consistent with companion '{}' {}", shape_str(ss), companion,
                         shape_str(ws)));
      continue;
    }
    std::string why;
    auto fmt_found = match_grid(rs, cs, r, k, layout, why);
    if (!fmt_found) {
      reject(fmt::format("{} (companion '{}' {})", why, companion, shape_str(ws)));
      continue;
    }
    // The shape proves the format: now a wrong element type is a malformed file.
    const bool dtype_ok = *fmt_found == ScaleFormat::nvfp4
                              ? (t.dtype == st::Dtype::F8_E4M3 || t.dtype == st::Dtype::U8)
                              : (t.dtype == st::Dtype::F8_E8M0 || t.dtype == st::Dtype::U8);
    if (!dtype_ok)
      throw FormatError(fmt::format("{}: tensor '{}': {} block scale of '{}' must be {}, got {}", label,
                                    t.name, to_string(*fmt_found), companion,
                                    *fmt_found == ScaleFormat::nvfp4 ? "F8_E4M3 (or U8)" : "U8 or F8_E8M0",
                                    st::to_string(t.dtype)));
    if (experts == 0 || rs == 0 || cs == 0) {
      reject("empty tensor");
      continue;
    }
    if (experts > UINT32_MAX || rs > UINT32_MAX || cs > UINT32_MAX) {
      reject("grid dimensions exceed 32 bits");
      continue;
    }
    ScaleCandidate c;
    c.name = t.name;
    c.companion = companion;
    c.shape.format = *fmt_found;
    c.shape.layout = layout;
    c.shape.experts = static_cast<std::uint32_t>(experts);
    c.shape.rows = static_cast<std::uint32_t>(rs);
    c.shape.cols = static_cast<std::uint32_t>(cs);
    c.layer = moe_layer_key(t.name);
    out.scales.push_back(std::move(c));
  }
  return out;
}

}  // namespace csfmoe::detail
