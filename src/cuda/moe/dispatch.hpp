// Runtime value -> template argument, one helper per axis of the MoE GEMM
// kernels (scale format, scale kind, projection and activation, decode token pass, decode
// ring copy, grouped token tile and scale path), each driven by one list. The launchers (tiled_launch.cu,
// decode_launch.cu, prefill_launch.cu) dispatch and configure their
// instantiations through these, so adding a value to a list instantiates and
// dispatches it everywhere:
//   dispatch_format(f, [&]<ScaleFormat F>() { ... });
//   for_each_value(ScaleKinds{}, [&]<ScaleKind K>() { ... });
#pragma once

#include <cstddef>
#include <string>
#include <utility>

#include "csfmoe/errors.hpp"
#include "cuda/moe/launchers.hpp"
#include "moe/decode_shape.hpp"
#include "moe/grouped_shape.hpp"

namespace csfmoe::moe_detail {

template <auto... Values>
struct ValueList {
  static constexpr std::size_t size = sizeof...(Values);
};

// Calls fn.template operator()<V>() for every V of the list, in order.
template <auto... Values, class Fn>
void for_each_value(ValueList<Values...>, Fn&& fn) {
  (fn.template operator()<Values>(), ...);
}

// Calls fn.template operator()<V>() for the V of the list equal to `value`;
// false if there is none.
template <auto... Values, class T, class Fn>
bool dispatch_value(ValueList<Values...>, const T& value, Fn&& fn) {
  return ((value == Values ? (fn.template operator()<Values>(), true) : false) || ...);
}

namespace dispatch_detail {
template <const auto& Array, std::size_t... I>
constexpr auto list_of(std::index_sequence<I...>) {
  return ValueList<Array[I]...>{};
}
[[noreturn]] inline void no_instance(const char* axis, long long value) {
  throw InvalidArgument(std::string("MoE GEMM dispatch: no kernel for ") + axis + " " +
                        std::to_string(value));
}
}  // namespace dispatch_detail

// The lists, one per axis.
using ScaleFormats = ValueList<ScaleFormat::nvfp4, ScaleFormat::mxfp4>;
using ScaleKinds = ValueList<ScaleKind::dense_row_major, ScaleKind::dense_swizzled, ScaleKind::csf>;
// The prefill kernel reads dense scales only.
using DenseScaleKinds = ValueList<ScaleKind::dense_row_major, ScaleKind::dense_swizzled>;
// Down, and gate/up with each activation's epilogue (Projection).
using Projections = ValueList<Projection::down, Projection::gate_up_silu, Projection::gate_up_gpt_oss>;
// NT: passes of 8 * NT tokens (kDecodeTokenPasses, which also bounds the
// decode kernel's shared memory: decode_smem_bytes).
using DecodeTokenPasses =
    decltype(dispatch_detail::list_of<kDecodeTokenPasses>(std::make_index_sequence<kDecodeTokenPassCount>{}));
using DecodeRingCopies = ValueList<1, 2>;  // K blocks per ring copy
// Token tiles of the grouped kernel (kGroupedTokenTiles).
using GroupedTokenTiles = decltype(dispatch_detail::list_of<kGroupedTokenTiles>(
    std::make_index_sequence<kGroupedTokenTileCount>{}));

// The grouped kernel's scale path: false each consumer thread loads its scale
// words, true the producer copies them into the ring (ring scales).
using GroupedScalePaths = ValueList<false, true>;

static_assert(DecodeTokenPasses::size == 3 && int(GemmPath::decode_32) - int(GemmPath::decode_8) == 2,
              "one decode GemmPath per token pass");

template <class Fn>
void dispatch_format(ScaleFormat f, Fn&& fn) {
  if (!dispatch_value(ScaleFormats{}, f, fn)) dispatch_detail::no_instance("scale format", int(f));
}

template <class Fn>
void dispatch_scale_kind(ScaleKind k, Fn&& fn) {
  if (!dispatch_value(ScaleKinds{}, k, fn)) dispatch_detail::no_instance("scale kind", int(k));
}

template <class Fn>
void dispatch_dense_scale_kind(ScaleKind k, Fn&& fn) {
  if (!dispatch_value(DenseScaleKinds{}, k, fn)) dispatch_detail::no_instance("dense scale kind", int(k));
}

// The projection of a launch: down, or gate/up with the layer's activation.
template <class Fn>
void dispatch_projection(bool gate_up, MoeActivation activation, Fn&& fn) {
  const Projection p = projection_of(gate_up, activation);
  if (!dispatch_value(Projections{}, p, fn)) dispatch_detail::no_instance("projection", int(p));
}

// A decode path (GemmPath::decode_8, _16, _32) as its NT.
template <class Fn>
void dispatch_token_pass(GemmPath path, Fn&& fn) {
  const int pass = int(path) - int(GemmPath::decode_8);
  if (pass < 0 || pass >= kDecodeTokenPassCount) dispatch_detail::no_instance("decode path", int(path));
  (void)dispatch_value(DecodeTokenPasses{}, kDecodeTokenPasses[pass], fn);
}

template <class Fn>
void dispatch_ring_copy(std::uint32_t kblocks_per_copy, Fn&& fn) {
  if (!dispatch_value(DecodeRingCopies{}, int(kblocks_per_copy), fn))
    dispatch_detail::no_instance("K blocks per ring copy", kblocks_per_copy);
}

template <class Fn>
void dispatch_token_tile(std::uint32_t token_tile, Fn&& fn) {
  if (!dispatch_value(GroupedTokenTiles{}, int(token_tile), fn))
    dispatch_detail::no_instance("grouped token tile", token_tile);
}

template <class Fn>
void dispatch_grouped_scale_path(bool ring_scales, Fn&& fn) {
  if (!dispatch_value(GroupedScalePaths{}, ring_scales, fn))
    dispatch_detail::no_instance("grouped scale path", int(ring_scales));
}

}  // namespace csfmoe::moe_detail
