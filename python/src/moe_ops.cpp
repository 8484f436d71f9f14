// MoE bindings that need no GPU: planning (validation of a layer's geometry),
// synthetic layers for tests, the quantizer of stacked expert weights and the
// float64 CPU reference.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>

#include "common.hpp"
#include "csfmoe/moe.hpp"
#include "csfmoe/quantize.hpp"

namespace csfmoe::py {

MoeActivationSpec activation_arg(const std::string& activation, double alpha, double limit) {
  MoeActivationSpec spec;
  spec.kind = parse_moe_activation(activation);
  spec.alpha = alpha;
  spec.limit = limit;
  return spec;
}

namespace {

MoeLayerGeometry layer_arg(std::int64_t e, std::int64_t h, std::int64_t n, std::int64_t k,
                           const std::string& order) {
  auto dim = [](std::int64_t v, const char* what) {
    if (v < 0 || v > 0xFFFFFFFFll) throw InvalidArgument(fmt::format("{} out of range: {}", what, v));
    return static_cast<std::uint32_t>(v);
  };
  MoeLayerGeometry g;
  g.experts = dim(e, "experts");
  g.hidden = dim(h, "hidden");
  g.intermediate = dim(n, "intermediate");
  g.topk = dim(k, "topk");
  g.order = parse_gate_up_order(order);
  return g;
}

nb::dict shape_dict(const GridShape& s) {
  nb::dict d;
  d["experts"] = s.experts;
  d["rows"] = s.rows;
  d["cols"] = s.cols;
  d["layout"] = std::string(to_string(s.layout));
  return d;
}

template <class T>
std::vector<T> vec_of(const Array& a, const char* what, std::uint64_t want) {
  const auto n = check_array(a, what, Dev::cpu, sizeof(T));
  if (n != want) throw InvalidArgument(fmt::format("{}: expected {} elements, got {}", what, want, n));
  const T* p = static_cast<const T*>(a.data());
  return std::vector<T>(p, p + n);
}

// An optional FP32 tensor of `want` values (expert biases).
std::vector<float> f32_vec_of(const std::optional<Array>& a, const char* what, std::uint64_t want) {
  if (!a) return {};
  require_float(*a, what, "float32");
  return vec_of<float>(*a, what, want);
}

// Quantizes `experts` stacked float32 matrices [rows, cols] (one global scale
// per expert for NVFP4) on up to `threads` threads (0: all cores); the
// outputs are concatenated in expert order.
struct StackedQuantized {
  std::vector<std::uint8_t> packed, scales;
  std::vector<float> global;
};

StackedQuantized quantize_stacked(ScaleFormat f, std::span<const float> x, std::uint64_t experts,
                                  std::uint64_t rows, std::uint64_t cols, unsigned threads) {
  const std::uint64_t g = group_size(f);
  const std::uint64_t per = rows * cols;
  StackedQuantized out;
  out.packed.resize(experts * per / 2);
  out.scales.resize(experts * per / g);
  out.global.resize(experts);
  std::atomic<std::uint64_t> next{0};
  std::exception_ptr failure;
  std::mutex failure_lock;
  auto work = [&] {
    try {
      for (std::uint64_t e; (e = next.fetch_add(1)) < experts;) {
        const auto part = x.subspan(e * per, per);
        const QuantizedMatrix q =
            f == ScaleFormat::nvfp4 ? quantize_nvfp4(part, rows, cols) : quantize_mxfp4(part, rows, cols);
        std::copy(q.packed.begin(), q.packed.end(), out.packed.begin() + e * per / 2);
        std::copy(q.scales.begin(), q.scales.end(), out.scales.begin() + e * per / g);
        out.global[e] = q.global_scale;
      }
    } catch (...) {
      const std::lock_guard lock(failure_lock);
      if (!failure) failure = std::current_exception();
      next = experts;
    }
  };
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  const auto n = static_cast<unsigned>(std::min<std::uint64_t>(threads, experts));
  std::vector<std::thread> pool;
  for (unsigned i = 1; i < n; ++i) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  if (failure) std::rethrow_exception(failure);
  return out;
}

}  // namespace

void bind_moe(nb::module_& m) {
  m.def(
      "quantize_experts",
      [](const std::string& format, Array x, std::int64_t experts, std::int64_t rows, std::int64_t cols,
         std::int64_t threads) {
        const auto f = format_arg(format);
        if (experts < 1 || rows < 1 || cols < 1 || experts > 0xFFFFFFFFll || rows > 0xFFFFFFFFll ||
            cols > 0xFFFFFFFFll)
          throw InvalidArgument(
              fmt::format("quantize_experts: experts {}, rows {}, cols {} must all be in [1, 2^32)", experts,
                          rows, cols));
        const std::uint64_t g = group_size(f);
        if (static_cast<std::uint64_t>(cols) % g)
          throw InvalidArgument(fmt::format(
              "quantize_experts: cols = {} is not a multiple of the {} group size {}", cols, format, g));
        if (threads < 0) throw InvalidArgument("quantize_experts: threads must be >= 0");
        const auto n = check_array(x, "weights", Dev::cpu, 4);
        const std::uint64_t want = static_cast<std::uint64_t>(experts) * rows * cols;
        if (n != want)
          throw InvalidArgument(fmt::format("weights: expected {} float32 elements ([{}, {}, {}]), got {}",
                                            want, experts, rows, cols, n));
        const std::span<const float> xs(static_cast<const float*>(x.data()), n);
        StackedQuantized q;
        {
          nb::gil_scoped_release nogil;
          q = quantize_stacked(f, xs, experts, rows, cols, static_cast<unsigned>(threads));
        }
        nb::dict d;
        d["packed"] = to_torch<std::uint8_t>(std::move(q.packed));
        d["scales"] = to_torch<std::uint8_t>(std::move(q.scales));
        d["global"] = to_torch<float>(std::move(q.global));
        return d;
      },
      nb::arg("format"), nb::arg("weights"), nb::arg("experts"), nb::arg("rows"), nb::arg("cols"),
      nb::arg("threads") = 0);

  m.def(
      "moe_plan",
      [](const std::string& format, std::int64_t e, std::int64_t h, std::int64_t n, std::int64_t k,
         const std::string& order, const std::string& compression, std::int64_t max_tokens,
         std::int64_t stage_read_max_tokens, const std::string& scale_layout, const std::string& activation,
         double alpha, double limit) {
        MoeConstraints c;
        c.compression = parse_scale_compression(compression);
        if (max_tokens < 1 || max_tokens > 0x7FFFFFFF)
          throw InvalidArgument(fmt::format("max_tokens out of range: {}", max_tokens));
        if (stage_read_max_tokens < 0 || stage_read_max_tokens > 0x7FFFFFFF)
          throw InvalidArgument(fmt::format("stage_read_max_tokens out of range: {}", stage_read_max_tokens));
        c.max_tokens = static_cast<std::uint32_t>(max_tokens);
        c.stage_read_max_tokens = static_cast<std::uint32_t>(stage_read_max_tokens);
        c.scale_layout = layout_arg(scale_layout);
        MoeLayerGeometry g = layer_arg(e, h, n, k, order);
        g.activation = activation_arg(activation, alpha, limit);
        const MoePlan p = plan_weights(format_arg(format), g, c);
        nb::dict d;
        d["w13_scales"] = shape_dict(p.w13_scales);
        d["w2_scales"] = shape_dict(p.w2_scales);
        d["w13_bytes"] = p.w13_bytes;
        d["w2_bytes"] = p.w2_bytes;
        d["w13_scale_bytes"] = p.w13_scale_bytes;
        d["w2_scale_bytes"] = p.w2_scale_bytes;
        return d;
      },
      nb::arg("format"), nb::arg("experts"), nb::arg("hidden"), nb::arg("intermediate"), nb::arg("topk"),
      nb::arg("order") = "w13", nb::arg("compression") = "none", nb::arg("max_tokens") = 4096,
      nb::arg("stage_read_max_tokens") = 1536, nb::arg("scale_layout") = "row_major",
      nb::arg("activation") = "silu", nb::arg("alpha") = kGptOssAlpha, nb::arg("limit") = kGptOssLimit);

  m.def(
      "synthetic_moe_weights",
      [](const std::string& format, std::int64_t e, std::int64_t h, std::int64_t n, std::int64_t k,
         const std::string& order, std::uint64_t seed, bool fast) {
        MoeHostWeights w;
        {
          const auto g = layer_arg(e, h, n, k, order);
          const auto f = format_arg(format);
          nb::gil_scoped_release nogil;
          w = synthetic_moe_weights(f, g, seed, fast);
        }
        nb::dict d;
        d["w13"] = to_torch<std::uint8_t>(std::move(w.w13));
        d["w13_scale"] = to_torch<std::uint8_t>(std::move(w.w13_scales));
        d["w13_global"] = to_torch<float>(std::move(w.w13_global));
        d["w2"] = to_torch<std::uint8_t>(std::move(w.w2));
        d["w2_scale"] = to_torch<std::uint8_t>(std::move(w.w2_scales));
        d["w2_global"] = to_torch<float>(std::move(w.w2_global));
        return d;
      },
      nb::arg("format"), nb::arg("experts"), nb::arg("hidden"), nb::arg("intermediate"), nb::arg("topk"),
      nb::arg("order"), nb::arg("seed"), nb::arg("fast") = false);

  // The library's activation (csfmoe/detail/activation.hpp) in float64 over
  // matching gate and up values: what the C++ reference applies, for the
  // Python integration's float64 path.
  m.def(
      "moe_activation",
      [](Array gate, Array up, Array out, const std::string& activation, double alpha, double limit) {
        const auto f64 = [](const Array& a, const char* what) {
          const auto n = check_array(a, what, Dev::cpu, 8);
          require_float(a, what, "float64");
          return n;
        };
        const auto n = f64(gate, "gate");
        if (f64(up, "up") != n || f64(out, "out") != n)
          throw InvalidArgument("moe_activation: gate, up and out must hold the same number of values");
        const MoeActivationSpec spec = activation_arg(activation, alpha, limit);
        validate(spec);
        const auto* g = static_cast<const double*>(gate.data());
        const auto* u = static_cast<const double*>(up.data());
        auto* o = static_cast<double*>(out.data());
        nb::gil_scoped_release nogil;
        for (std::uint64_t i = 0; i < n; ++i) o[i] = apply_activation(spec, g[i], u[i]);
      },
      nb::arg("gate"), nb::arg("up"), nb::arg("out"), nb::arg("activation"), nb::arg("alpha") = kGptOssAlpha,
      nb::arg("limit") = kGptOssLimit);

  m.def(
      "moe_reference",
      [](const std::string& format, std::int64_t e, std::int64_t h, std::int64_t n, std::int64_t k,
         const std::string& order, Array w13, Array w13_scale, Array w13_global, Array w2, Array w2_scale,
         Array w2_global, Array hidden, Array topk_ids, Array topk_weights, Array out, std::int64_t threads,
         const std::string& activation, double alpha, double limit, std::optional<Array> w13_bias,
         std::optional<Array> w2_bias) {
        MoeHostWeights w;
        w.format = format_arg(format);
        w.geometry = layer_arg(e, h, n, k, order);
        w.geometry.activation = activation_arg(activation, alpha, limit);
        validate(w.geometry.activation);
        const std::uint64_t E = w.geometry.experts, H = w.geometry.hidden, N = w.geometry.intermediate;
        const std::uint64_t g = group_size(w.format);
        if (H % g || N % g)
          throw InvalidArgument(
              fmt::format("hidden {} and intermediate {} must be multiples of {}", H, N, g));
        // The reference takes owning vectors: one host copy of the weights.
        w.w13 = vec_of<std::uint8_t>(w13, "w13", E * 2 * N * H / 2);
        w.w13_scales = vec_of<std::uint8_t>(w13_scale, "w13_scale", E * 2 * N * H / g);
        w.w13_global = vec_of<float>(w13_global, "w13_global", E);
        w.w2 = vec_of<std::uint8_t>(w2, "w2", E * H * N / 2);
        w.w2_scales = vec_of<std::uint8_t>(w2_scale, "w2_scale", E * H * N / g);
        w.w2_global = vec_of<float>(w2_global, "w2_global", E);
        w.w13_bias = f32_vec_of(w13_bias, "w13_bias", E * 2 * N);
        w.w2_bias = f32_vec_of(w2_bias, "w2_bias", E * H);
        const auto nh = check_array(hidden, "hidden", Dev::cpu, 2);
        if (nh % H) throw InvalidArgument(fmt::format("hidden: {} elements is not [T, {}]", nh, H));
        const auto tokens = nh / H;
        const unsigned id_bytes = topk_ids.dtype().bits / 8;
        const auto ni = check_array(topk_ids, "topk_ids", Dev::cpu, id_bytes == 4 ? 4 : 8);
        const auto nw = check_array(topk_weights, "topk_weights", Dev::cpu, 4);
        const auto no = check_array(out, "out", Dev::cpu, 4);
        if (ni != tokens * w.geometry.topk || nw != ni || no != tokens * H)
          throw InvalidArgument(fmt::format(
              "moe_reference: for T={} tokens, k={}, H={}: topk_ids has {}, topk_weights {}, out {} elements",
              tokens, w.geometry.topk, H, ni, nw, no));
        if (threads < 0) throw InvalidArgument("threads must be >= 0");
        const std::span<const std::uint16_t> hs(static_cast<const std::uint16_t*>(hidden.data()), nh);
        const std::span<const float> ws(static_cast<const float*>(topk_weights.data()), nw);
        const std::span<float> os(static_cast<float*>(out.data()), no);
        nb::gil_scoped_release nogil;
        if (id_bytes == 4)
          moe_reference(w, hs, static_cast<std::uint32_t>(tokens),
                        std::span<const std::int32_t>(static_cast<const std::int32_t*>(topk_ids.data()), ni),
                        ws, os, static_cast<unsigned>(threads));
        else
          moe_reference(w, hs, static_cast<std::uint32_t>(tokens),
                        std::span<const std::int64_t>(static_cast<const std::int64_t*>(topk_ids.data()), ni),
                        ws, os, static_cast<unsigned>(threads));
      },
      nb::arg("format"), nb::arg("experts"), nb::arg("hidden_size"), nb::arg("intermediate"), nb::arg("topk"),
      nb::arg("order"), nb::arg("w13"), nb::arg("w13_scale"), nb::arg("w13_global"), nb::arg("w2"),
      nb::arg("w2_scale"), nb::arg("w2_global"), nb::arg("hidden"), nb::arg("topk_ids"),
      nb::arg("topk_weights"), nb::arg("out"), nb::arg("threads") = 0, nb::arg("activation") = "silu",
      nb::arg("alpha") = kGptOssAlpha, nb::arg("limit") = kGptOssLimit, nb::arg("w13_bias") = nb::none(),
      nb::arg("w2_bias") = nb::none());
}

}  // namespace csfmoe::py
