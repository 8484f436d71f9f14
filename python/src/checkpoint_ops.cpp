// safetensors / CSF container reading for csfmoe.checkpoint: the file is
// memory-mapped once and tensors are handed out as byte views of the map
// (the Python side copies them to their destination device).
#include <nanobind/stl/filesystem.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>

#include "checkpoint/container.hpp"
#include "common.hpp"
#include "csfmoe/checkpoint.hpp"
#include "csfmoe/safetensors.hpp"

namespace csfmoe::py {
namespace {

struct OpenFile {
  std::shared_ptr<st::File> file;
  std::optional<detail::ContainerInfo> container;

  explicit OpenFile(const std::filesystem::path& p) {
    file = std::make_shared<st::File>(st::File::open(p));
    container = detail::get_container_metadata(file->header().metadata, p.string());
  }

  nb::list tensors() const {
    nb::list out;
    for (const auto& t : file->tensors()) {
      nb::dict d;
      d["name"] = t.name;
      d["dtype"] = std::string(st::to_string(t.dtype));
      d["shape"] = t.shape;
      d["nbytes"] = t.nbytes();
      out.append(d);
    }
    return out;
  }

  // Read-only byte view of one tensor; keeps the mapping alive.
  nb::object bytes(const std::string& name) const {
    const st::TensorInfo* t = file->find(name);
    if (!t) throw InvalidArgument(fmt::format("{}: no tensor named '{}'", file->path().string(), name));
    const auto span = file->data(*t);
    auto* keep = new std::shared_ptr<st::File>(file);
    nb::capsule owner(keep, [](void* p) noexcept { delete static_cast<std::shared_ptr<st::File>*>(p); });
    const std::size_t shape[1] = {span.size()};
    // An empty tensor still needs a valid pointer.
    static const std::uint8_t empty = 0;
    const std::uint8_t* ptr = span.empty() ? &empty : span.data();
    return nb::cast(
        nb::ndarray<nb::pytorch, std::uint8_t, nb::ndim<1>>(const_cast<std::uint8_t*>(ptr), 1, shape, owner));
  }

  nb::object metadata() const {
    const auto& md = file->header().metadata;
    if (!md) return nb::none();
    nb::dict d;
    for (const auto& [k, v] : *md) d[nb::str(k.c_str(), k.size())] = nb::str(v.c_str(), v.size());
    return d;
  }

  // The CSF descriptor: name -> entry, or None for a plain safetensors file.
  nb::object csf_entries() const {
    if (!container) return nb::none();
    nb::dict out;
    for (const auto& e : container->csf) {
      const auto parts = detail::part_names(e.name);
      nb::dict d;
      d["dtype"] = std::string(st::to_string(e.dtype));
      d["shape"] = e.shape;
      d["format"] = std::string(to_string(e.grid.format));
      d["layout"] = std::string(to_string(e.grid.layout));
      d["grid"] = nb::make_tuple(e.grid.experts, e.grid.rows, e.grid.cols);
      d["crc32"] = e.crc32;
      d["exceptions"] = e.exceptions;
      d["layer"] = e.layer;
      d["parts"] = nb::make_tuple(parts.fixed, parts.exceptions, parts.row_prefix, parts.partition_index);
      out[nb::str(e.name.c_str(), e.name.size())] = d;
    }
    return out;
  }

  nb::dict native_kept() const {
    nb::dict out;
    if (container)
      for (const auto& [k, v] : container->native_kept) {
        nb::dict d;
        d["format"] = std::string(to_string(v.format));
        d["layer"] = v.layer;
        d["reason"] = v.reason;
        out[nb::str(k.c_str(), k.size())] = d;
      }
    return out;
  }
};

}  // namespace

void bind_checkpoint(nb::module_& m) {
  nb::class_<OpenFile>(m, "SafetensorsFile")
      .def(nb::init<const std::filesystem::path&>(), nb::arg("path"))
      .def_prop_ro("path", [](const OpenFile& f) { return f.file->path(); })
      .def("tensors", &OpenFile::tensors)
      .def("bytes", &OpenFile::bytes, nb::arg("name"))
      .def("metadata", &OpenFile::metadata)
      .def("csf_entries", &OpenFile::csf_entries)
      .def("native_kept", &OpenFile::native_kept);

  m.def(
      "is_csf_container", [](const std::filesystem::path& p) { return is_csf_container(p); },
      nb::arg("path"));
  m.def(
      "compress_checkpoint",
      [](const std::filesystem::path& in, const std::filesystem::path& out, const std::string& layout,
         unsigned threads) {
        CompressOptions o;
        if (!layout.empty()) o.layout = layout_arg(layout);  // else each file's own tag
        o.threads = threads;
        nb::gil_scoped_release nogil;
        const CheckpointReport r = compress_checkpoint(in, out, o);
        return std::make_pair(r.scale_source_bytes, r.scale_stored_bytes);
      },
      nb::arg("src"), nb::arg("dst"), nb::arg("layout") = "", nb::arg("threads") = 0);
}

}  // namespace csfmoe::py
