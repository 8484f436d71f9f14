// Helpers shared by the binding sources: checked views of DLPack tensors
// (torch tensors arrive through nb::ndarray without a copy) and output arrays
// that own a std::vector.
#pragma once

#include <fmt/format.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "csfmoe/detail/activation.hpp"
#include "csfmoe/errors.hpp"
#include "csfmoe/formats.hpp"

namespace csfmoe::py {

namespace nb = nanobind;
using Array = nb::ndarray<>;

enum class Dev { cpu, cuda };

inline const char* dev_name(Dev d) { return d == Dev::cpu ? "cpu" : "cuda"; }

// Checks that `a` is C-contiguous, on `dev`, with elements of `bytes` bytes
// (any integer/float code: the bindings reinterpret bytes); names `what` in
// every error. Returns the element count.
inline std::uint64_t check_array(const Array& a, const char* what, Dev dev, unsigned bytes) {
  const bool on_cpu = a.device_type() == nb::device::cpu::value;
  const bool on_cuda = a.device_type() == nb::device::cuda::value;
  if ((dev == Dev::cpu && !on_cpu) || (dev == Dev::cuda && !on_cuda))
    throw InvalidArgument(
        fmt::format("{}: expected a {} tensor, got device type {}", what, dev_name(dev), a.device_type()));
  const auto dt = a.dtype();
  if (dt.lanes != 1 || dt.bits != bytes * 8)
    throw InvalidArgument(fmt::format("{}: expected {}-byte elements, got {} bits", what, bytes, dt.bits));
  std::int64_t expect = 1;
  std::uint64_t n = 1;
  for (std::size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expect)
      throw InvalidArgument(fmt::format("{}: tensor is not contiguous (call .contiguous())", what));
    expect *= static_cast<std::int64_t>(a.shape(i));
    n *= a.shape(i);
  }
  return n;
}

inline std::span<const std::uint8_t> bytes_of(const Array& a, const char* what, Dev dev = Dev::cpu) {
  const auto n = check_array(a, what, dev, 1);
  return {static_cast<const std::uint8_t*>(a.data()), static_cast<std::size_t>(n)};
}
inline std::span<std::uint8_t> mut_bytes_of(const Array& a, const char* what, Dev dev = Dev::cpu) {
  const auto n = check_array(a, what, dev, 1);
  return {static_cast<std::uint8_t*>(a.data()), static_cast<std::size_t>(n)};
}
inline std::span<const std::uint32_t> words_of(const Array& a, const char* what, Dev dev = Dev::cpu) {
  const auto n = check_array(a, what, dev, 4);
  return {static_cast<const std::uint32_t*>(a.data()), static_cast<std::size_t>(n)};
}

// A 1-D torch tensor of element type Out that takes ownership of `v` (no
// copy); Out has T's size (uint32 words travel as int32: torch has few
// uint32 kernels).
template <class Out, class T>
nb::object to_torch(std::vector<T>&& v) {
  static_assert(sizeof(Out) == sizeof(T));
  auto* heap = new std::vector<T>(std::move(v));
  if (heap->empty()) heap->reserve(1);  // a non-null pointer even for 0 elements
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  const std::size_t shape[1] = {heap->size()};
  return nb::cast(
      nb::ndarray<nb::pytorch, Out, nb::ndim<1>>(reinterpret_cast<Out*>(heap->data()), 1, shape, owner));
}

// Throws InvalidArgument naming `what` unless `a` holds floating-point
// values (`type`, e.g. "float32", names them in the error).
inline void require_float(const Array& a, const char* what, const char* type) {
  if (a.dtype().code != static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float))
    throw InvalidArgument(fmt::format("{}: expected {}", what, type));
}

ScaleFormat format_arg(const std::string& s);
ScaleLayout layout_arg(const std::string& s);
// A layer's activation from its binding arguments (validated where it is
// used: plan_weights, the reference, or the caller).
MoeActivationSpec activation_arg(const std::string& activation, double alpha, double limit);

void bind_codec(nb::module_& m);
void bind_checkpoint(nb::module_& m);
void bind_moe(nb::module_& m);
#if defined(CSFMOE_HAVE_CUDA)
void bind_cuda(nb::module_& m);
void bind_moe_cuda(nb::module_& m);
#endif

}  // namespace csfmoe::py
