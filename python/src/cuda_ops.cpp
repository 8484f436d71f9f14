// CUDA codec bindings: expand all / routed experts into caller-owned scratch
// and encode on the device. Tensors stay where they are: the view is built
// from their pointers; the stream is the caller's (torch's current stream,
// passed as an integer). Sizes and devices are checked before any launch.
#include <cuda_runtime_api.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include "codec_bridge.hpp"
#include "common.hpp"
#include "csfmoe/device_codec.hpp"

namespace csfmoe::py {
namespace {

cudaStream_t stream_arg(std::uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

int same_device(std::initializer_list<std::pair<const Array*, const char*>> arrays) {
  int dev = -1;
  const char* first = nullptr;
  for (const auto& [a, what] : arrays) {
    const int d = a->device_id();
    if (dev < 0) {
      dev = d;
      first = what;
    } else if (d != dev) {
      throw InvalidArgument(fmt::format("{} is on cuda:{} but {} is on cuda:{}", what, d, first, dev));
    }
  }
  return dev;
}

// Device view of parts whose sizes match the grid (contents are trusted:
// they were validated on the host before upload).
CsfDeviceView view_of(const GridShape& shape, const Array& fixed, const Array& exceptions,
                      const Array& row_prefix, const Array& partition_index) {
  CsfDeviceView v;
  v.geometry = CsfGeometry::of(shape);
  const auto nf = check_array(fixed, "fixed", Dev::cuda, 1);
  const auto nx = check_array(exceptions, "exceptions", Dev::cuda, 4);
  const auto nr = check_array(row_prefix, "row_prefix", Dev::cuda, 4);
  const auto np = check_array(partition_index, "partition_index", Dev::cuda, 4);
  const auto& g = v.geometry;
  const std::uint64_t want_r = g.total_rows() + 1;
  const std::uint64_t want_p = std::uint64_t{g.partitions_per_expert} * g.shape.experts + 1;
  if (nf != g.fixed_bytes())
    throw InvalidArgument(fmt::format("fixed: expected {} bytes, got {}", g.fixed_bytes(), nf));
  if (nr != want_r) throw InvalidArgument(fmt::format("row_prefix: expected {} entries, got {}", want_r, nr));
  if (np != want_p)
    throw InvalidArgument(fmt::format("partition_index: expected {} entries, got {}", want_p, np));
  v.device = same_device({{&fixed, "fixed"},
                          {&exceptions, "exceptions"},
                          {&row_prefix, "row_prefix"},
                          {&partition_index, "partition_index"}});
  v.fixed = static_cast<const std::uint8_t*>(fixed.data());
  v.exceptions = static_cast<const std::uint32_t*>(exceptions.data());
  v.row_prefix = static_cast<const std::uint32_t*>(row_prefix.data());
  v.partition_index = static_cast<const std::uint32_t*>(partition_index.data());
  v.num_exceptions = nx;
  return v;
}

std::uint8_t* out_of(const CsfDeviceView& v, ScaleLayout layout, const Array& out) {
  const auto n = check_array(out, "out", Dev::cuda, 1);
  const auto want = v.geometry.native_bytes(layout);
  if (n != want)
    throw InvalidArgument(fmt::format("out: expected {} bytes ({}), got {}", want, to_string(layout), n));
  if (out.device_id() != v.device)
    throw InvalidArgument(
        fmt::format("out is on cuda:{} but the parts are on cuda:{}", out.device_id(), v.device));
  return static_cast<std::uint8_t*>(out.data());
}

template <class T>
nb::object device_array(const T* ptr, std::uint64_t n, int device, nb::handle owner) {
  const std::size_t shape[1] = {static_cast<std::size_t>(n)};
  return nb::cast(nb::ndarray<nb::pytorch, T, nb::ndim<1>>(const_cast<T*>(ptr), 1, shape, owner, nullptr,
                                                           nb::dtype<T>(), nb::device::cuda::value, device));
}

}  // namespace

void bind_cuda(nb::module_& m) {
  m.def(
      "expand_all",
      [](Array fixed, Array exceptions, Array row_prefix, Array partition_index, const std::string& format,
         const std::string& src_layout, std::int64_t e, std::int64_t r, std::int64_t c, Array out,
         const std::string& out_layout, std::uintptr_t stream) {
        const CsfDeviceView v =
            view_of(grid_arg(format, src_layout, e, r, c), fixed, exceptions, row_prefix, partition_index);
        const ScaleLayout layout = layout_arg(out_layout);
        std::uint8_t* dst = out_of(v, layout, out);
        nb::gil_scoped_release nogil;
        expand_all(v, layout, dst, stream_arg(stream));
      },
      nb::arg("fixed"), nb::arg("exceptions"), nb::arg("row_prefix"), nb::arg("partition_index"),
      nb::arg("format"), nb::arg("src_layout"), nb::arg("experts"), nb::arg("rows"), nb::arg("cols"),
      nb::arg("out"), nb::arg("out_layout"), nb::arg("stream"));

  m.def(
      "expand_routed",
      [](Array fixed, Array exceptions, Array row_prefix, Array partition_index, const std::string& format,
         const std::string& src_layout, std::int64_t e, std::int64_t r, std::int64_t c, Array ids, Array out,
         const std::string& out_layout, std::uintptr_t stream) {
        const CsfDeviceView v =
            view_of(grid_arg(format, src_layout, e, r, c), fixed, exceptions, row_prefix, partition_index);
        const ScaleLayout layout = layout_arg(out_layout);
        std::uint8_t* dst = out_of(v, layout, out);
        const unsigned bits = ids.dtype().bits;
        if (ids.dtype().code != static_cast<std::uint8_t>(nb::dlpack::dtype_code::Int) ||
            (bits != 32 && bits != 64))
          throw InvalidArgument("topk_ids: expected int32 or int64");
        const auto count = check_array(ids, "topk_ids", Dev::cuda, bits / 8);
        if (ids.device_id() != v.device)
          throw InvalidArgument(
              fmt::format("topk_ids is on cuda:{} but the parts are on cuda:{}", ids.device_id(), v.device));
        nb::gil_scoped_release nogil;
        expand_routed(v, layout, ids.data(), bits == 32 ? IndexType::int32 : IndexType::int64, count, dst,
                      stream_arg(stream));
      },
      nb::arg("fixed"), nb::arg("exceptions"), nb::arg("row_prefix"), nb::arg("partition_index"),
      nb::arg("format"), nb::arg("src_layout"), nb::arg("experts"), nb::arg("rows"), nb::arg("cols"),
      nb::arg("topk_ids"), nb::arg("out"), nb::arg("out_layout"), nb::arg("stream"));

  m.def(
      "encode_on_device",
      [](Array src, const std::string& format, const std::string& layout, std::int64_t e, std::int64_t r,
         std::int64_t c, std::uintptr_t stream) {
        const GridShape shape = grid_arg(format, layout, e, r, c);
        const auto n = check_array(src, "scales", Dev::cuda, 1);
        const auto want = CsfGeometry::of(shape).native_bytes(shape.layout);
        if (n != want) throw InvalidArgument(fmt::format("scales: expected {} bytes, got {}", want, n));
        auto* t = new DeviceCsfTensor();
        nb::capsule owner(t, [](void* p) noexcept { delete static_cast<DeviceCsfTensor*>(p); });
        {
          nb::gil_scoped_release nogil;
          *t = encode_on_device(shape, static_cast<const std::uint8_t*>(src.data()), src.device_id(),
                                stream_arg(stream));
        }
        // The four tensors share ownership of the device allocation.
        const CsfDeviceView& v = t->view();
        const auto& g = v.geometry;
        return nb::make_tuple(
            device_array<std::uint8_t>(v.fixed, g.fixed_bytes(), v.device, owner),
            device_array<std::int32_t>(reinterpret_cast<const std::int32_t*>(v.exceptions), v.num_exceptions,
                                       v.device, owner),
            device_array<std::int32_t>(reinterpret_cast<const std::int32_t*>(v.row_prefix),
                                       g.total_rows() + 1, v.device, owner),
            device_array<std::int32_t>(reinterpret_cast<const std::int32_t*>(v.partition_index),
                                       std::uint64_t{g.partitions_per_expert} * g.shape.experts + 1, v.device,
                                       owner));
      },
      nb::arg("src"), nb::arg("format"), nb::arg("layout"), nb::arg("experts"), nb::arg("rows"),
      nb::arg("cols"), nb::arg("stream"));
}

}  // namespace csfmoe::py
