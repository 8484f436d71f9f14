// Checkpoint reading and writing for csfmoe.checkpoint, through the library's
// own reader (CheckpointFile: every tensor of a container CRC-checked before
// it is handed out) and writer (st::Writer: temporary file, fsync, rename).
// Native tensors come out as byte views of the file mapping (the Python side
// copies them to their destination device); CSF parts and decoded tensors as
// torch tensors that own their vectors.
#include <nanobind/stl/filesystem.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <memory>

#include "checkpoint/detect.hpp"
#include "common.hpp"
#include "csfmoe/checkpoint.hpp"
#include "csfmoe/checkpoint_reader.hpp"
#include "csfmoe/moe_checkpoint.hpp"
#include "csfmoe/safetensors.hpp"

namespace csfmoe::py {
namespace {

CodecOptions codec_threads(std::int64_t threads) {
  if (threads < 0) throw InvalidArgument(fmt::format("threads must be >= 0, got {}", threads));
  CodecOptions o;
  o.threads = static_cast<unsigned>(threads);
  return o;
}

struct OpenFile {
  std::shared_ptr<CheckpointFile> file;

  explicit OpenFile(const std::filesystem::path& p)
      : file(std::make_shared<CheckpointFile>(CheckpointFile::open(p))) {}

  // The logical tensors (a container's original tensors, not its CSF parts).
  nb::list tensors() const {
    nb::list out;
    for (const auto& t : file->tensors()) {
      nb::dict d;
      d["name"] = t.name;
      d["dtype"] = std::string(st::to_string(t.dtype));
      d["shape"] = t.shape;
      d["nbytes"] = t.nbytes();
      d["csf"] = file->csf_entry(t.name) != nullptr;
      out.append(d);
    }
    return out;
  }

  // Read-only byte view of a tensor stored native (CRC-checked in a
  // container); keeps the mapping alive.
  nb::object bytes(const std::string& name) const {
    std::span<const std::uint8_t> span;
    {
      nb::gil_scoped_release nogil;
      span = file->native_bytes(name);
    }
    auto* keep = new std::shared_ptr<CheckpointFile>(file);
    nb::capsule owner(keep,
                      [](void* p) noexcept { delete static_cast<std::shared_ptr<CheckpointFile>*>(p); });
    const std::size_t shape[1] = {span.size()};
    // An empty tensor still needs a valid pointer.
    static const std::uint8_t empty = 0;
    const std::uint8_t* ptr = span.empty() ? &empty : span.data();
    return nb::cast(
        nb::ndarray<nb::pytorch, std::uint8_t, nb::ndim<1>>(const_cast<std::uint8_t*>(ptr), 1, shape, owner));
  }

  // The four parts of a CSF tensor, validated and CRC-checked.
  nb::tuple csf_parts(const std::string& name, std::int64_t threads) const {
    const CodecOptions o = codec_threads(threads);
    CsfTensor t;
    {
      nb::gil_scoped_release nogil;
      t = file->csf_parts(name, o);
    }
    return nb::make_tuple(to_torch<std::uint8_t>(std::move(t.fixed)),
                          to_torch<std::int32_t>(std::move(t.exceptions)),
                          to_torch<std::int32_t>(std::move(t.row_prefix)),
                          to_torch<std::int32_t>(std::move(t.partition_index)));
  }

  // The original bytes of any tensor (decoded if CSF), CRC-checked.
  nb::object read(const std::string& name, std::int64_t threads) const {
    const CodecOptions o = codec_threads(threads);
    std::vector<std::uint8_t> v;
    {
      nb::gil_scoped_release nogil;
      v = file->read(name, o);
    }
    return to_torch<std::uint8_t>(std::move(v));
  }

  nb::object metadata() const {
    const auto& md = file->metadata();
    if (!md) return nb::none();
    nb::dict d;
    for (const auto& [k, v] : *md) d[nb::str(k.c_str(), k.size())] = nb::str(v.c_str(), v.size());
    return d;
  }

  // The CSF descriptor: name -> entry, or None for a plain safetensors file.
  nb::object csf_entries() const {
    if (!file->is_container() && !file->is_b12x()) return nb::none();
    nb::dict out;
    for (const auto& e : file->csf_entries()) {
      nb::dict d;
      d["dtype"] = std::string(st::to_string(e.dtype));
      d["shape"] = e.shape;
      d["format"] = std::string(to_string(e.grid.format));
      d["layout"] = std::string(to_string(e.grid.layout));
      d["grid"] = nb::make_tuple(e.grid.experts, e.grid.rows, e.grid.cols);
      d["crc32"] = e.has_crc32 ? nb::cast(e.crc32) : nb::none();  // b12x files carry none
      d["exceptions"] = e.exceptions;
      d["layer"] = e.layer;
      d["storage"] = e.storage;
      d["parts"] = nb::tuple(nb::cast(e.parts));
      out[nb::str(e.name.c_str(), e.name.size())] = d;
    }
    return out;
  }

  // The block-scale tensors among the logical tensors -> the layout they are
  // stored in (the file's csfmoe.scale_layout tag, else row_major).
  nb::dict scale_tensors() const {
    const st::Header& h = file->header();
    const std::string label = file->path().string();
    const auto det = detail::detect_scales(h, detail::source_layout(h, std::nullopt, label), label);
    nb::dict out;
    for (const auto& c : det.scales)
      out[nb::str(c.name.c_str(), c.name.size())] = std::string(to_string(c.shape.layout));
    return out;
  }

  nb::dict native_kept() const {
    nb::dict out;
    for (const auto& [k, v] : file->native_kept()) {
      nb::dict d;
      d["format"] = std::string(to_string(v.format));
      d["layer"] = v.layer;
      d["reason"] = v.reason;
      out[nb::str(k.c_str(), k.size())] = d;
    }
    return out;
  }
};

// One tensor for save_safetensors: (name, safetensors dtype, shape, bytes).
using SaveItem = std::tuple<std::string, std::string, std::vector<std::uint64_t>, Array>;

void save_safetensors(const std::filesystem::path& path, const std::vector<SaveItem>& items,
                      const std::optional<st::Metadata>& metadata) {
  std::vector<st::TensorInfo> infos;
  std::vector<std::span<const std::uint8_t>> data;
  std::uint64_t pos = 0;
  for (const auto& [name, dtype, shape, bytes] : items) {
    const std::string what = fmt::format("{}: tensor '{}'", path.string(), name);
    if (name.empty() || name == "__metadata__")
      throw InvalidArgument(fmt::format("{}: invalid tensor name '{}'", path.string(), name));
    const auto d = st::parse_dtype(dtype);
    if (!d) throw InvalidArgument(fmt::format("{}: unknown safetensors dtype '{}'", what, dtype));
    st::TensorInfo t;
    t.name = name;
    t.dtype = *d;
    t.shape = shape;
    const auto span = bytes_of(bytes, what.c_str());
    if (span.size() != t.elements() * st::dtype_size(*d))
      throw InvalidArgument(fmt::format("{}: {} bytes for shape x {}", what, span.size(), dtype));
    t.begin = pos;
    t.end = pos += span.size();
    infos.push_back(std::move(t));
    data.push_back(span);
  }
  nb::gil_scoped_release nogil;
  st::Writer w(path, st::Writer::header_json_size(infos, metadata));
  for (std::size_t i = 0; i < infos.size(); ++i)
    w.add_tensor(infos[i].name, infos[i].dtype, infos[i].shape, data[i]);
  w.commit(metadata);
}

nb::list projections(const std::vector<MoeLayerProjection>& v) {
  nb::list out;
  for (const auto& p : v) {
    nb::dict d;
    d["weight"] = p.weight;
    d["scale"] = p.scale;
    d["scale_layout"] = std::string(to_string(p.scale_layout));
    d["experts"] = p.experts;
    d["rows"] = p.rows;
    d["k"] = p.k;
    out.append(d);
  }
  return out;
}

// The C++ layer rules (resolve_moe_layer) over tensors held by Python:
// `tensors` maps name -> (safetensors dtype, shape, scale layout); `read`
// returns a tensor's bytes (only global and input scales are read).
nb::dict resolve_layer(nb::dict tensors, const std::string& layer, unsigned topk, nb::callable read,
                       const std::string& label) {
  MoeTensorTable table(label, [&](const std::string& name) {
    const Array a = nb::cast<Array>(read(name));
    const auto b = bytes_of(a, name.c_str());
    return std::vector<std::uint8_t>(b.begin(), b.end());
  });
  for (auto [k, v] : tensors) {
    const std::string name = nb::cast<std::string>(k);
    const nb::tuple t = nb::cast<nb::tuple>(v);
    const std::string dtype = nb::cast<std::string>(t[0]);
    const auto d = st::parse_dtype(dtype);
    if (!d)
      throw InvalidArgument(
          fmt::format("{}: tensor '{}': unknown safetensors dtype '{}'", label, name, dtype));
    table.add(name, *d, nb::cast<std::vector<std::uint64_t>>(t[1]), layout_arg(nb::cast<std::string>(t[2])));
  }
  const MoeLayerSpec s = resolve_moe_layer(table, layer, topk);
  nb::dict out;
  out["naming"] = s.naming;
  out["format"] = std::string(to_string(s.format));
  out["experts"] = s.geometry.experts;
  out["hidden"] = s.geometry.hidden;
  out["intermediate"] = s.geometry.intermediate;
  out["w13"] = projections(s.w13);
  out["w2"] = projections(s.w2);
  out["w13_global"] = s.w13_global;
  out["w2_global"] = s.w2_global;
  out["w13_input_scale"] = s.w13_input_scale;
  out["w2_input_scale"] = s.w2_input_scale;
  // A gpt-oss layer with biases: its w13 rows alternate gate, up in the
  // tensors (the caller de-interleaves them); its biases come already in the
  // w13 order.
  out["gate_up_interleaved"] = s.gate_up_interleaved;
  out["activation"] = std::string(to_string(s.geometry.activation.kind));
  out["alpha"] = s.geometry.activation.alpha;
  out["limit"] = s.geometry.activation.limit;
  out["w13_bias"] = s.w13_bias;
  out["w2_bias"] = s.w2_bias;
  return out;
}

}  // namespace

void bind_checkpoint(nb::module_& m) {
  nb::class_<OpenFile>(m, "SafetensorsFile")
      .def(nb::init<const std::filesystem::path&>(), nb::arg("path"))
      .def_prop_ro("path", [](const OpenFile& f) { return f.file->path(); })
      .def_prop_ro("is_container", [](const OpenFile& f) { return f.file->is_container(); })
      .def_prop_ro("is_b12x", [](const OpenFile& f) { return f.file->is_b12x(); })
      .def("tensors", &OpenFile::tensors)
      .def("bytes", &OpenFile::bytes, nb::arg("name"))
      .def("csf_parts", &OpenFile::csf_parts, nb::arg("name"), nb::arg("threads") = 0)
      .def("read", &OpenFile::read, nb::arg("name"), nb::arg("threads") = 0)
      .def("metadata", &OpenFile::metadata)
      .def("csf_entries", &OpenFile::csf_entries)
      .def("native_kept", &OpenFile::native_kept)
      .def("scale_tensors", &OpenFile::scale_tensors);

  m.def("checkpoint_files", &checkpoint_files, nb::arg("checkpoint"));
  m.def("resolve_moe_layer", &resolve_layer, nb::arg("tensors"), nb::arg("layer"), nb::arg("topk"),
        nb::arg("read"), nb::arg("label"));
  m.def("save_safetensors", &save_safetensors, nb::arg("path"), nb::arg("tensors"),
        nb::arg("metadata") = nb::none());
  m.def(
      "is_csf_container", [](const std::filesystem::path& p) { return is_csf_container(p); },
      nb::arg("path"));
  m.def(
      "verify_checkpoint",
      [](const std::filesystem::path& in, unsigned threads) {
        CompressOptions o;
        o.threads = threads;
        nb::gil_scoped_release nogil;
        const CheckpointReport r = verify_checkpoint(in, o);
        std::size_t csf = 0;
        for (const auto& t : r.tensors) csf += t.action == TensorAction::csf;
        return csf;
      },
      nb::arg("path"), nb::arg("threads") = 0);
  m.def(
      "compress_checkpoint",
      [](const std::filesystem::path& in, const std::filesystem::path& out, const std::string& layout,
         unsigned threads, const std::string& schema, unsigned tp, unsigned rank, bool mxfp4_slab) {
        CompressOptions o;
        if (!layout.empty()) o.layout = layout_arg(layout);  // else each file's own tag
        o.threads = threads;
        if (schema != "csfmoe" && schema != "b12x")
          throw InvalidArgument("compress_checkpoint: schema '" + schema + "' is not csfmoe or b12x");
        o.schema = schema == "b12x" ? CheckpointSchema::b12x : CheckpointSchema::csfmoe;
        o.tp = tp;
        o.tp_rank = rank;
        o.mxfp4_slab = mxfp4_slab;
        nb::gil_scoped_release nogil;
        const CheckpointReport r = compress_checkpoint(in, out, o);
        return std::make_pair(r.scale_source_bytes, r.scale_stored_bytes);
      },
      nb::arg("src"), nb::arg("dst"), nb::arg("layout") = "", nb::arg("threads") = 0,
      nb::arg("schema") = "csfmoe", nb::arg("tp") = 1, nb::arg("rank") = 0, nb::arg("mxfp4_slab") = true);
}

}  // namespace csfmoe::py
