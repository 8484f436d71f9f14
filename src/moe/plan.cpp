// Planning and validation of a fused MoE layer (host only).
#include <fmt/core.h>

#include <cmath>
#include <limits>
#include <string>

#include "csfmoe/errors.hpp"
#include "csfmoe/moe.hpp"

namespace csfmoe {

std::string_view to_string(GateUpOrder o) noexcept {
  switch (o) {
    case GateUpOrder::w13:
      return "w13";
    case GateUpOrder::w31:
      return "w31";
  }
  return "unknown";
}

std::string_view to_string(ScaleCompression c) noexcept {
  switch (c) {
    case ScaleCompression::none:
      return "none";
    case ScaleCompression::csf:
      return "csf";
  }
  return "unknown";
}

std::string_view to_string(MoeScaleMode m) noexcept {
  switch (m) {
    case MoeScaleMode::native:
      return "native";
    case MoeScaleMode::expanded:
      return "expanded";
    case MoeScaleMode::routed:
      return "routed";
    case MoeScaleMode::stage_read:
      return "stage_read";
  }
  return "unknown";
}

std::string_view to_string(MoeActivation a) noexcept {
  switch (a) {
    case MoeActivation::silu:
      return "silu";
    case MoeActivation::gpt_oss:
      return "gpt_oss";
  }
  return "unknown";
}

MoeActivation parse_moe_activation(std::string_view s) {
  if (s == "silu") return MoeActivation::silu;
  if (s == "gpt_oss") return MoeActivation::gpt_oss;
  throw InvalidArgument(fmt::format("activation '{}' is not one of silu, gpt_oss", s));
}

void validate(const MoeActivationSpec& a) {
  if (a.kind != MoeActivation::silu && a.kind != MoeActivation::gpt_oss)
    throw InvalidArgument(fmt::format("activation kind {} is not silu or gpt_oss", unsigned(a.kind)));
  if (a.kind != MoeActivation::gpt_oss) return;
  // A non-positive limit would clamp gate and up to an empty or inverted range.
  if (!std::isfinite(a.alpha) || !(a.alpha > 0))
    throw InvalidArgument(fmt::format("activation.alpha = {} must be finite and > 0", a.alpha));
  if (!std::isfinite(a.limit) || !(a.limit > 0))
    throw InvalidArgument(fmt::format("activation.limit = {} must be finite and > 0", a.limit));
}

GateUpOrder parse_gate_up_order(std::string_view s) {
  if (s == "w13") return GateUpOrder::w13;
  if (s == "w31") return GateUpOrder::w31;
  throw InvalidArgument(fmt::format("gate/up order '{}' is not one of w13, w31", s));
}

ScaleCompression parse_scale_compression(std::string_view s) {
  if (s == "none") return ScaleCompression::none;
  if (s == "csf") return ScaleCompression::csf;
  throw InvalidArgument(fmt::format("scale compression '{}' is not one of none, csf", s));
}

MoeScaleMode parse_moe_scale_mode(std::string_view s) {
  if (s == "native") return MoeScaleMode::native;
  if (s == "expanded") return MoeScaleMode::expanded;
  if (s == "routed") return MoeScaleMode::routed;
  if (s == "stage_read") return MoeScaleMode::stage_read;
  throw InvalidArgument(fmt::format("scale mode '{}' is not one of native, expanded, routed, stage_read", s));
}

namespace {

GridShape scale_shape(ScaleFormat f, ScaleLayout l, std::uint32_t experts, std::uint32_t rows,
                      std::uint32_t k) {
  GridShape s;
  s.format = f;
  s.layout = l;
  s.experts = experts;
  s.rows = rows;
  s.cols = k / group_size(f);
  if (l == ScaleLayout::swizzled_128x4) {
    // A swizzled tensor is stored padded; its GridShape is the padded grid.
    s.rows = static_cast<std::uint32_t>(round_up(s.rows, 128));
    s.cols = static_cast<std::uint32_t>(round_up(s.cols, 4));
  }
  return s;
}

}  // namespace

MoePlan plan_weights(ScaleFormat f, const MoeLayerGeometry& g, const MoeConstraints& c) {
  const auto bad = [](const std::string& what) { throw InvalidArgument("plan_weights: " + what); };
  if (f != ScaleFormat::nvfp4 && f != ScaleFormat::mxfp4)
    bad(fmt::format("source_format {} is not nvfp4 or mxfp4", unsigned(f)));
  if (g.order != GateUpOrder::w13 && g.order != GateUpOrder::w31)
    bad(fmt::format("geometry.order {} is not w13 or w31", unsigned(g.order)));
  try {
    validate(g.activation);
  } catch (const InvalidArgument& e) {
    bad(fmt::format("geometry.{}", e.what()));
  }
  if (c.compression != ScaleCompression::none && c.compression != ScaleCompression::csf)
    bad(fmt::format("constraints.compression {} is not none or csf", unsigned(c.compression)));
  if (c.scale_layout != ScaleLayout::row_major && c.scale_layout != ScaleLayout::swizzled_128x4)
    bad(fmt::format("constraints.scale_layout {} is not row_major or swizzled_128x4",
                    unsigned(c.scale_layout)));
  if (g.experts == 0 || g.experts > MoePlan::kMaxExperts)
    bad(fmt::format("geometry.experts = {} must be in [1, {}]", g.experts, MoePlan::kMaxExperts));
  if (g.topk == 0 || g.topk > MoePlan::kMaxTopk)
    bad(fmt::format("geometry.topk = {} must be in [1, {}]", g.topk, MoePlan::kMaxTopk));
  // A token routes to k distinct experts.
  if (g.topk > g.experts)
    bad(fmt::format("geometry.topk = {} exceeds geometry.experts = {}: a token routes to k distinct experts",
                    g.topk, g.experts));
  if (g.hidden == 0 || g.hidden % MoePlan::kTile != 0)
    bad(fmt::format("geometry.hidden = {} must be a non-zero multiple of {} (the kernels' tile)", g.hidden,
                    MoePlan::kTile));
  if (g.intermediate == 0 || g.intermediate % MoePlan::kTile != 0)
    bad(fmt::format("geometry.intermediate = {} must be a non-zero multiple of {} (the kernels' tile)",
                    g.intermediate, MoePlan::kTile));
  if (g.intermediate > (1u << 30) || g.hidden > (1u << 30))
    bad(fmt::format("geometry hidden {} / intermediate {} too large", g.hidden, g.intermediate));
  if (c.max_tokens == 0 ||
      std::uint64_t{c.max_tokens} * g.topk >= std::uint64_t{std::numeric_limits<std::int32_t>::max()})
    bad(fmt::format("constraints.max_tokens = {} must be in [1, 2^31 / topk {})", c.max_tokens, g.topk));

  MoePlan p;
  p.format = f;
  p.geometry = g;
  p.constraints = c;
  p.w13_scales = scale_shape(f, c.scale_layout, g.experts, 2 * g.intermediate, g.hidden);
  p.w2_scales = scale_shape(f, c.scale_layout, g.experts, g.hidden, g.intermediate);
  p.w13_bytes = std::uint64_t{g.experts} * 2 * g.intermediate * (g.hidden / 2);
  p.w2_bytes = std::uint64_t{g.experts} * g.hidden * (g.intermediate / 2);
  // Native tensors are stored whole (a swizzled GridShape is already padded).
  p.w13_scale_bytes = std::uint64_t{p.w13_scales.experts} * p.w13_scales.rows * p.w13_scales.cols;
  p.w2_scale_bytes = std::uint64_t{p.w2_scales.experts} * p.w2_scales.rows * p.w2_scales.cols;
  if (c.compression == ScaleCompression::csf) {
    // CsfGeometry::of checks the 2^24 positions per expert that CSF records address.
    try {
      (void)CsfGeometry::of(p.w13_scales);
      (void)CsfGeometry::of(p.w2_scales);
    } catch (const InvalidArgument& e) {
      bad(std::string("CSF scales: ") + e.what());
    }
  }
  return p;
}

}  // namespace csfmoe
