// GPU MoE bindings: a prepared layer (plan -> prepare_weights) that binds
// lazily once per stream, with its workspace a caller (torch) allocation.
// Tensors are referenced, never copied; the Python object keeps them alive.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <map>
#include <memory>

#include "common.hpp"
#include "csfmoe/moe_cuda.hpp"

namespace csfmoe::py {
namespace {

const std::uint8_t* dptr(const Array& a, const char* what, std::uint64_t bytes, int device,
                         unsigned elem = 1) {
  const auto n = check_array(a, what, Dev::cuda, elem);
  if (n * elem != bytes)
    throw InvalidArgument(fmt::format("{}: expected {} bytes, got {}", what, bytes, n * elem));
  if (a.device_id() != device)
    throw InvalidArgument(
        fmt::format("{}: on cuda:{}, the layer is on cuda:{}", what, a.device_id(), device));
  return static_cast<const std::uint8_t*>(a.data());
}

// An optional FP32 device tensor of `values` values (expert biases).
const float* f32_dptr(const std::optional<Array>& a, const char* what, std::uint64_t values, int device) {
  if (!a) return nullptr;
  require_float(*a, what, "float32");
  return reinterpret_cast<const float*>(dptr(*a, what, 4 * values, device, 4));
}

struct CudaLayer {
  MoePlan plan;
  MoeWeights weights;
  std::optional<ScaleScratch> scratch;
  std::map<std::uintptr_t, BoundMoe> bound;
  int device = 0;
  bool scales_expanded = false;
  MoeBindOptions options;

  CudaLayer(const std::string& format, std::int64_t e, std::int64_t h, std::int64_t n, std::int64_t k,
            const std::string& order, const std::string& compression, std::int64_t max_tokens,
            std::int64_t stage_read_max_tokens, const std::string& scale_layout, Array w13,
            nb::object w13_scale, std::optional<Array> w13_global, Array w2, nb::object w2_scale,
            std::optional<Array> w2_global, std::optional<Array> scratch_w13, std::optional<Array> scratch_w2,
            bool expanded, const std::string& force_mode, std::uintptr_t stream,
            const std::string& activation, double alpha, double limit, std::optional<Array> w13_bias,
            std::optional<Array> w2_bias) {
    MoeLayerGeometry g;
    g.experts = static_cast<std::uint32_t>(e);
    g.hidden = static_cast<std::uint32_t>(h);
    g.intermediate = static_cast<std::uint32_t>(n);
    g.topk = static_cast<std::uint32_t>(k);
    g.order = parse_gate_up_order(order);
    g.activation = activation_arg(activation, alpha, limit);
    if (e < 1 || h < 1 || n < 1 || k < 1 || e > 0xFFFFFFFF || h > 0xFFFFFFFF || n > 0xFFFFFFFF ||
        k > 0xFFFFFFFF)
      throw InvalidArgument("experts, hidden, intermediate and topk must be positive 32-bit values");
    MoeConstraints c;
    c.compression = parse_scale_compression(compression);
    c.max_tokens = static_cast<std::uint32_t>(max_tokens);
    c.stage_read_max_tokens = static_cast<std::uint32_t>(stage_read_max_tokens);
    c.scale_layout = layout_arg(scale_layout);
    plan = plan_weights(format_arg(format), g, c);
    device = w13.device_id();
    MoeDeviceWeights dw;
    dw.device = device;
    dw.w13 = dptr(w13, "w13", plan.w13_bytes, device);
    dw.w2 = dptr(w2, "w2", plan.w2_bytes, device);
    // Native device scales (Array), or a CSF layer's resident parts on the
    // host (HostCsfTensor), uploaded as they are.
    const CsfTensor* csf13 = nullptr;
    const CsfTensor* csf2 = nullptr;
    if (nb::try_cast(w13_scale, csf13) != nb::try_cast(w2_scale, csf2))
      throw InvalidArgument("w13_scale and w2_scale: both native tensors or both CSF parts");
    if (!csf13) {
      dw.w13_scales = dptr(nb::cast<Array>(w13_scale), "w13_scale", plan.w13_scale_bytes, device);
      dw.w2_scales = dptr(nb::cast<Array>(w2_scale), "w2_scale", plan.w2_scale_bytes, device);
    }
    if (w13_global)
      dw.w13_global =
          reinterpret_cast<const float*>(dptr(*w13_global, "w13_global", 4ull * g.experts, device, 4));
    if (w2_global)
      dw.w2_global =
          reinterpret_cast<const float*>(dptr(*w2_global, "w2_global", 4ull * g.experts, device, 4));
    dw.w13_bias = f32_dptr(w13_bias, "w13_bias", 2ull * g.experts * g.intermediate, device);
    dw.w2_bias = f32_dptr(w2_bias, "w2_bias", std::uint64_t(g.experts) * g.hidden, device);
    if (scratch_w13.has_value() != scratch_w2.has_value())
      throw InvalidArgument("scratch_w13 and scratch_w2 must be given together");
    if (scratch_w13) {
      const auto need = moe_scale_scratch_bytes(plan);
      ScaleScratch s;
      s.w13 = const_cast<std::uint8_t*>(dptr(*scratch_w13, "scratch_w13", need.w13, device));
      s.w2 = const_cast<std::uint8_t*>(dptr(*scratch_w2, "scratch_w2", need.w2, device));
      s.w13_bytes = need.w13;
      s.w2_bytes = need.w2;
      scratch = s;
    }
    scales_expanded = expanded;
    if (!force_mode.empty()) options.force_mode = parse_moe_scale_mode(force_mode);
    nb::gil_scoped_release nogil;
    const ScaleScratch* sp = scratch ? &*scratch : nullptr;
    const auto st = reinterpret_cast<cudaStream_t>(stream);
    weights = csf13 ? prepare_weights(plan, dw, MoeCsfTensors{csf13, csf2}, sp, st)
                    : prepare_weights(plan, dw, sp, st);
  }

  std::uint64_t workspace_bytes(std::int64_t max_tokens) const {
    return moe_workspace_bytes(plan, static_cast<std::uint32_t>(max_tokens));
  }

  bool is_bound(std::uintptr_t stream) const { return bound.count(stream) != 0; }

  void bind_stream(std::uintptr_t stream, Array workspace) {
    MoeWorkspace ws;
    ws.bytes = check_array(workspace, "workspace", Dev::cuda, 1);
    ws.data = workspace.data();
    bound.insert_or_assign(stream, bind(weights, reinterpret_cast<cudaStream_t>(stream),
                                        plan.constraints.max_tokens, ws, scales_expanded, options));
  }

  void expand(std::uintptr_t stream, std::int64_t blocks_per_sm) {
    if (blocks_per_sm < 0 || blocks_per_sm > 0xFFFF)
      throw InvalidArgument(fmt::format("expand_scales: blocks_per_sm {} is not in 0..65535", blocks_per_sm));
    nb::gil_scoped_release nogil;
    expand_scales(weights, reinterpret_cast<cudaStream_t>(stream),
                  ExpandLaunch{static_cast<std::uint32_t>(blocks_per_sm)});
  }

  std::string mode_for(std::uintptr_t stream, std::int64_t tokens) const {
    auto it = bound.find(stream);
    if (it == bound.end()) throw InvalidArgument("mode_for: stream not bound");
    return std::string(to_string(it->second.mode_for(static_cast<std::uint32_t>(tokens))));
  }

  void run_call(std::uintptr_t stream, Array hidden, Array ids, Array wts, Array out) {
    auto it = bound.find(stream);
    if (it == bound.end()) throw InvalidArgument("run: stream not bound (PreparedExperts binds it first)");
    const std::uint64_t H = plan.geometry.hidden, k = plan.geometry.topk;
    const auto nh = check_array(hidden, "hidden", Dev::cuda, 2);
    const auto no = check_array(out, "out", Dev::cuda, 2);
    const unsigned bits = ids.dtype().bits;
    const auto ni = check_array(ids, "topk_ids", Dev::cuda, bits == 32 ? 4 : 8);
    const auto nw = check_array(wts, "topk_weights", Dev::cuda, 4);
    const std::uint64_t T = nh / H;
    if (nh != T * H || no != nh || ni != T * k || nw != T * k)
      throw InvalidArgument(
          fmt::format("run: hidden {} / out {} / topk_ids {} / topk_weights {} elements do not "
                      "fit [T, H={}] and [T, k={}]",
                      nh, no, ni, nw, H, k));
    if (T > plan.constraints.max_tokens)
      throw InvalidArgument(
          fmt::format("run: {} tokens exceed max_tokens {}", T, plan.constraints.max_tokens));
    for (const Array* a : {&hidden, &ids, &wts, &out})
      if (a->device_id() != device)
        throw InvalidArgument(
            fmt::format("run: a tensor is on cuda:{}, the layer on cuda:{}", a->device_id(), device));
    nb::gil_scoped_release nogil;
    run(it->second, hidden.data(), static_cast<std::uint32_t>(T), ids.data(),
        bits == 32 ? IndexType::int32 : IndexType::int64, static_cast<const float*>(wts.data()), out.data());
  }
};

}  // namespace

void bind_moe_cuda(nb::module_& m) {
  nb::class_<CudaLayer>(m, "CudaMoeLayer")
      .def(nb::init<const std::string&, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                    const std::string&, const std::string&, std::int64_t, std::int64_t, const std::string&,
                    Array, nb::object, std::optional<Array>, Array, nb::object, std::optional<Array>,
                    std::optional<Array>, std::optional<Array>, bool, const std::string&, std::uintptr_t,
                    const std::string&, double, double, std::optional<Array>, std::optional<Array>>())
      .def("workspace_bytes", &CudaLayer::workspace_bytes)
      .def("is_bound", &CudaLayer::is_bound)
      .def("bind_stream", &CudaLayer::bind_stream)
      .def("expand_scales", &CudaLayer::expand)
      .def("mode_for", &CudaLayer::mode_for)
      .def("run", &CudaLayer::run_call)
      .def("resident_scale_bytes", [](const CudaLayer& l) { return l.weights.resident_scale_bytes(); })
      .def("scratch_bytes", [](const CudaLayer& l) {
        const auto s = moe_scale_scratch_bytes(l.plan);
        return nb::make_tuple(s.w13, s.w2);
      });
}

}  // namespace csfmoe::py
