// Tensor- and expert-parallel slicing of MoE layers and checkpoint tensors.
#include "csfmoe/parallel.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstring>

#include "csfmoe/errors.hpp"

namespace csfmoe {

// ---------------------------------------------------------------------------
TpRange tensor_parallel_range(ScaleFormat format, const MoeLayerGeometry& g, unsigned tp, unsigned rank) {
  if (tp == 0) throw InvalidArgument("tensor parallel: tp must be at least 1");
  if (rank >= tp)
    throw InvalidArgument(fmt::format("tensor parallel: rank {} is not below tp = {}", rank, tp));
  const unsigned G = group_size(format);
  const std::uint32_t N = g.intermediate;
  if (N == 0 || N % tp)
    throw InvalidArgument(
        fmt::format("tensor parallel: intermediate size N = {} is not divisible by tp = {}", N, tp));
  const std::uint32_t n = N / tp;
  if (n % G || n % MoePlan::kTile)
    throw InvalidArgument(
        fmt::format("tensor parallel: N/tp = {}/{} = {} must be a multiple of the {} group size {} and of "
                    "the kernel tile {}",
                    N, tp, n, to_string(format), G, MoePlan::kTile));
  return {rank * n, n};
}

namespace {

// slice_axis over FP32 elements (the expert biases).
std::vector<float> slice_floats(const std::vector<float>& v, std::span<const std::uint64_t> shape,
                                std::size_t axis, std::span<const AxisRange> ranges) {
  const std::span<const std::uint8_t> bytes(reinterpret_cast<const std::uint8_t*>(v.data()),
                                            v.size() * sizeof(float));
  const std::vector<std::uint8_t> cut = slice_axis(bytes, shape, sizeof(float), axis, ranges);
  std::vector<float> out(cut.size() / sizeof(float));
  if (!cut.empty()) std::memcpy(out.data(), cut.data(), cut.size());
  return out;
}

}  // namespace

MoeHostWeights slice_tensor_parallel(const MoeHostWeights& w, unsigned tp, unsigned rank) {
  validate(w);
  const TpRange r = tensor_parallel_range(w.format, w.geometry, tp, rank);
  const unsigned G = group_size(w.format);
  const std::uint64_t E = w.geometry.experts, H = w.geometry.hidden, N = w.geometry.intermediate;
  MoeHostWeights s;
  s.format = w.format;
  s.geometry = w.geometry;
  s.geometry.intermediate = r.count;
  // w13 [E, 2N, *]: the same slice of both halves, whatever their order.
  const std::array<AxisRange, 2> halves{AxisRange{r.first, r.count}, AxisRange{N + r.first, r.count}};
  const std::array<std::uint64_t, 3> w13_shape{E, 2 * N, H / 2}, w13s_shape{E, 2 * N, H / G};
  s.w13 = slice_axis(w.w13, w13_shape, 1, 1, halves);
  s.w13_scales = slice_axis(w.w13_scales, w13s_shape, 1, 1, halves);
  // w2 [E, H, N]: columns of N, i.e. row-wise blocks of the packed bytes and scales.
  const std::array<AxisRange, 1> wcol{AxisRange{r.first / 2, r.count / 2}};
  const std::array<AxisRange, 1> scol{AxisRange{r.first / G, r.count / G}};
  const std::array<std::uint64_t, 2> w2_shape{E * H, N / 2}, w2s_shape{E * H, N / G};
  s.w2 = slice_axis(w.w2, w2_shape, 1, 1, wcol);
  s.w2_scales = slice_axis(w.w2_scales, w2s_shape, 1, 1, scol);
  s.w13_global = w.w13_global;
  s.w2_global = w.w2_global;
  // The gate/up bias goes with its rows; the down bias is added once, by
  // rank 0, so that the sum over ranks adds it once as the whole layer does.
  if (!w.w13_bias.empty()) {
    const std::array<std::uint64_t, 2> b13_shape{E, 2 * N};
    s.w13_bias = slice_floats(w.w13_bias, b13_shape, 1, halves);
  }
  if (rank == 0) s.w2_bias = w.w2_bias;
  return s;
}

// ---------------------------------------------------------------------------
ExpertPartition expert_parallel_partition(std::uint32_t experts, unsigned ep, unsigned rank) {
  if (ep == 0) throw InvalidArgument("expert parallel: ep must be at least 1");
  if (experts < ep)
    throw InvalidArgument(fmt::format(
        "expert parallel: {} experts cannot be spread over ep = {} ranks (each needs one)", experts, ep));
  if (rank >= ep)
    throw InvalidArgument(fmt::format("expert parallel: rank {} is not below ep = {}", rank, ep));
  ExpertPartition p;
  p.experts = experts;
  p.ranks = ep;
  p.rank = rank;
  const std::uint32_t base = experts / ep, extra = experts % ep;
  p.count = base + (rank < extra ? 1 : 0);
  p.first = rank * base + std::min<std::uint32_t>(rank, extra);
  return p;
}

unsigned expert_owner(std::uint32_t experts, unsigned ep, std::uint32_t expert) {
  (void)expert_parallel_partition(experts, ep, 0);  // validates E and ep
  if (expert >= experts)
    throw InvalidArgument(fmt::format("expert parallel: expert {} is outside [0, {})", expert, experts));
  const std::uint32_t base = experts / ep, extra = experts % ep;
  // The first `extra` ranks hold base + 1 experts each.
  const std::uint32_t big = extra * (base + 1);
  return expert < big ? expert / (base + 1) : extra + (expert - big) / base;
}

MoeHostWeights slice_expert_parallel(const MoeHostWeights& w, unsigned ep, unsigned rank) {
  validate(w);
  const ExpertPartition p = expert_parallel_partition(w.geometry.experts, ep, rank);
  const unsigned G = group_size(w.format);
  const std::uint64_t E = w.geometry.experts, H = w.geometry.hidden, N = w.geometry.intermediate;
  MoeHostWeights s;
  s.format = w.format;
  s.geometry = w.geometry;
  s.geometry.experts = p.count;
  auto take = [&](const auto& v, std::uint64_t per_expert) {
    using V = std::decay_t<decltype(v)>;
    (void)E;
    return V(v.begin() + p.first * per_expert, v.begin() + (p.first + p.count) * per_expert);
  };
  s.w13 = take(w.w13, 2 * N * (H / 2));
  s.w13_scales = take(w.w13_scales, 2 * N * (H / G));
  s.w13_global = take(w.w13_global, 1);
  s.w2 = take(w.w2, H * (N / 2));
  s.w2_scales = take(w.w2_scales, H * (N / G));
  s.w2_global = take(w.w2_global, 1);
  if (!w.w13_bias.empty()) s.w13_bias = take(w.w13_bias, 2 * N);
  if (!w.w2_bias.empty()) s.w2_bias = take(w.w2_bias, H);
  return s;
}

// ---------------------------------------------------------------------------
}  // namespace csfmoe
