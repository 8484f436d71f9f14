// CPU codec bindings: geometry, encode, decode (all or some experts),
// validate, stats, and the 128x4 swizzle's index map. Inputs are read in place; encoded parts come back as
// torch tensors that own the encoder's vectors.
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include "codec_bridge.hpp"
#include "common.hpp"
#include "csfmoe/codec.hpp"

namespace csfmoe::py {

GridShape grid_arg(const std::string& format, const std::string& layout, std::int64_t experts,
                   std::int64_t rows, std::int64_t cols) {
  auto dim = [](std::int64_t v, const char* what) {
    if (v < 1 || v > 0xFFFFFFFFll)
      throw InvalidArgument(fmt::format("grid {} must be in [1, 2^32), got {}", what, v));
    return static_cast<std::uint32_t>(v);
  };
  GridShape s;
  s.format = format_arg(format);
  s.layout = layout_arg(layout);
  s.experts = dim(experts, "experts");
  s.rows = dim(rows, "rows");
  s.cols = dim(cols, "cols");
  return s;
}

CsfTensor tensor_from_parts(const GridShape& shape, const Array& fixed, const Array& exceptions,
                            const Array& row_prefix, const Array& partition_index) {
  CsfTensor t;
  t.geometry = CsfGeometry::of(shape);
  const auto f = bytes_of(fixed, "fixed");
  const auto x = words_of(exceptions, "exceptions");
  const auto rp = words_of(row_prefix, "row_prefix");
  const auto pi = words_of(partition_index, "partition_index");
  // The codec's parts are vectors, so the (compressed) parts are copied once.
  t.fixed.assign(f.begin(), f.end());
  t.exceptions.assign(x.begin(), x.end());
  t.row_prefix.assign(rp.begin(), rp.end());
  t.partition_index.assign(pi.begin(), pi.end());
  return t;
}

namespace {

nb::dict geometry_dict(const CsfGeometry& g) {
  nb::dict d;
  d["padded_rows"] = g.padded_rows;
  d["padded_cols"] = g.padded_cols;
  d["slab_rows"] = g.slab_rows;
  d["slab_bytes"] = g.slab_bytes;
  d["fixed_bytes_per_expert"] = g.fixed_bytes_per_expert;
  d["fixed_bytes"] = g.fixed_bytes();
  d["partition_rows"] = g.partition_rows;
  d["partitions_per_expert"] = g.partitions_per_expert;
  d["row_prefix_len"] = g.total_rows() + 1;
  d["partition_index_len"] = std::uint64_t{g.partitions_per_expert} * g.shape.experts + 1;
  d["native_bytes_row_major"] = g.native_bytes(ScaleLayout::row_major);
  d["native_bytes_swizzled_128x4"] = g.native_bytes(ScaleLayout::swizzled_128x4);
  return d;
}

CodecOptions opts(std::int64_t threads) {
  if (threads < 0) throw InvalidArgument(fmt::format("threads must be >= 0, got {}", threads));
  CodecOptions o;
  o.threads = static_cast<unsigned>(threads);
  return o;
}

}  // namespace

void bind_codec(nb::module_& m) {
  // A host copy of a CsfScales' parts, handed to the CUDA MoE layer as it is
  // (uploaded there, not decoded); validated where it is used.
  nb::class_<CsfTensor>(m, "HostCsfTensor");
  m.def(
      "host_csf_tensor",
      [](Array fixed, Array exceptions, Array row_prefix, Array partition_index, const std::string& format,
         const std::string& src_layout, std::int64_t e, std::int64_t r, std::int64_t c) {
        return tensor_from_parts(grid_arg(format, src_layout, e, r, c), fixed, exceptions, row_prefix,
                                 partition_index);
      },
      nb::arg("fixed"), nb::arg("exceptions"), nb::arg("row_prefix"), nb::arg("partition_index"),
      nb::arg("format"), nb::arg("src_layout"), nb::arg("experts"), nb::arg("rows"), nb::arg("cols"));

  m.def(
      "geometry",
      [](const std::string& format, const std::string& layout, std::int64_t e, std::int64_t r,
         std::int64_t c) { return geometry_dict(CsfGeometry::of(grid_arg(format, layout, e, r, c))); },
      nb::arg("format"), nb::arg("layout"), nb::arg("experts"), nb::arg("rows"), nb::arg("cols"));

  m.def(
      "encode",
      [](Array src, const std::string& format, const std::string& layout, std::int64_t e, std::int64_t r,
         std::int64_t c, std::int64_t threads) {
        const GridShape shape = grid_arg(format, layout, e, r, c);
        const auto bytes = bytes_of(src, "scales");
        CsfTensor t;
        {
          nb::gil_scoped_release nogil;
          t = encode(shape, bytes, opts(threads));
        }
        return nb::make_tuple(to_torch<std::uint8_t>(std::move(t.fixed)),
                              to_torch<std::int32_t>(std::move(t.exceptions)),
                              to_torch<std::int32_t>(std::move(t.row_prefix)),
                              to_torch<std::int32_t>(std::move(t.partition_index)));
      },
      nb::arg("src"), nb::arg("format"), nb::arg("layout"), nb::arg("experts"), nb::arg("rows"),
      nb::arg("cols"), nb::arg("threads") = 0);

  m.def(
      "decode",
      [](Array fixed, Array exceptions, Array row_prefix, Array partition_index, const std::string& format,
         const std::string& src_layout, std::int64_t e, std::int64_t r, std::int64_t c, Array out,
         const std::string& out_layout, std::int64_t threads, bool trusted, nb::object experts) {
        const CsfTensor t = tensor_from_parts(grid_arg(format, src_layout, e, r, c), fixed, exceptions,
                                              row_prefix, partition_index);
        const ScaleLayout layout = layout_arg(out_layout);
        const auto dst = mut_bytes_of(out, "out");
        if (experts.is_none()) {
          nb::gil_scoped_release nogil;
          decode(t, layout, dst, opts(threads), trusted);
        } else {
          const Array ids = nb::cast<Array>(experts);
          const auto list = words_of(ids, "experts");
          nb::gil_scoped_release nogil;
          decode_experts(t, list, layout, dst, opts(threads), trusted);
        }
      },
      nb::arg("fixed"), nb::arg("exceptions"), nb::arg("row_prefix"), nb::arg("partition_index"),
      nb::arg("format"), nb::arg("src_layout"), nb::arg("experts"), nb::arg("rows"), nb::arg("cols"),
      nb::arg("out"), nb::arg("out_layout"), nb::arg("threads") = 0, nb::arg("trusted") = false,
      nb::arg("expert_ids") = nb::none());

  m.def(
      "validate",
      [](Array fixed, Array exceptions, Array row_prefix, Array partition_index, const std::string& format,
         const std::string& src_layout, std::int64_t e, std::int64_t r, std::int64_t c) {
        const CsfTensor t = tensor_from_parts(grid_arg(format, src_layout, e, r, c), fixed, exceptions,
                                              row_prefix, partition_index);
        nb::gil_scoped_release nogil;
        validate(t);
      },
      nb::arg("fixed"), nb::arg("exceptions"), nb::arg("row_prefix"), nb::arg("partition_index"),
      nb::arg("format"), nb::arg("src_layout"), nb::arg("experts"), nb::arg("rows"), nb::arg("cols"));

  m.def(
      "stats",
      [](Array fixed, Array exceptions, Array row_prefix, Array partition_index, const std::string& format,
         const std::string& src_layout, std::int64_t e, std::int64_t r, std::int64_t c) {
        const CsfTensor t = tensor_from_parts(grid_arg(format, src_layout, e, r, c), fixed, exceptions,
                                              row_prefix, partition_index);
        validate(t);
        const CsfStats s = stats(t);
        nb::dict d;
        d["rows"] = s.rows;
        d["values"] = s.values;
        d["exceptions"] = s.exceptions;
        d["distinct_bases"] = s.distinct_bases;
        d["source_bytes"] = s.source_bytes;
        d["encoded_bytes"] = s.encoded_bytes;
        d["exception_rate"] = s.exception_rate();
        d["ratio"] = s.ratio();
        return d;
      },
      nb::arg("fixed"), nb::arg("exceptions"), nb::arg("row_prefix"), nb::arg("partition_index"),
      nb::arg("format"), nb::arg("src_layout"), nb::arg("experts"), nb::arg("rows"), nb::arg("cols"));

  // int64 [rows * cols]: byte index of (r, c) in a swizzled_128x4 grid whose
  // stored width is padded_cols (swizzled_index), so Python gathers a
  // row-major grid out of a swizzled one on any device without restating it.
  m.def(
      "swizzled_indices",
      [](std::int64_t rows, std::int64_t cols, std::int64_t padded_cols) {
        if (rows < 1 || cols < 1 || padded_cols < cols || padded_cols % 4 != 0 || rows > 0xFFFFFFFFll ||
            padded_cols > 0xFFFFFFFFll)
          throw InvalidArgument(
              fmt::format("swizzled_indices: need rows, cols >= 1 and cols <= padded_cols, a multiple of 4; "
                          "got {}, {}, {}",
                          rows, cols, padded_cols));
        std::vector<std::int64_t> idx(static_cast<std::size_t>(rows * cols));
        for (std::int64_t r = 0; r < rows; ++r)
          for (std::int64_t c = 0; c < cols; ++c)
            idx[static_cast<std::size_t>(r * cols + c)] = static_cast<std::int64_t>(
                swizzled_index(std::size_t(r), std::size_t(c), std::size_t(padded_cols)));
        return to_torch<std::int64_t>(std::move(idx));
      },
      nb::arg("rows"), nb::arg("cols"), nb::arg("padded_cols"));
}

}  // namespace csfmoe::py
