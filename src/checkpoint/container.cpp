// The CSF container: descriptor and restore record (JSON inside __metadata__
// strings), the CSF part tensors, and the header-size bound.
#include "checkpoint/container.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>

#include "checkpoint/json_error.hpp"
#include "checkpoint/storage_table.hpp"
#include "csfmoe/errors.hpp"

namespace csfmoe::detail {
using ojson = nlohmann::ordered_json;

PartNames part_names(const std::string& t) {
  return {t + ".csf.fixed",
          t + ".csf.exceptions",
          t + ".csf.row_prefix",
          t + ".csf.partition_index",
          t + ".csf.planes",
          t + ".csf.expert_exceptions",
          b12x_fixed_name(t, ScaleFormat::nvfp4),
          b12x_exceptions_name(t, ScaleFormat::nvfp4),
          b12x_fixed_name(t, ScaleFormat::mxfp4),
          b12x_exceptions_name(t, ScaleFormat::mxfp4),
          t + ".csf.slabs",
          t + ".csf.slab_escapes"};
}

int container_version_for(const std::vector<CsfEntry>& entries) {
  // Version 2 at least: this build writes no version 1 file (those are only read).
  int version = 2;
  for (const auto& e : entries) version = std::max(version, storage_spec(e.storage).min_version);
  return version;
}

bool planes_storable(const GridShape& g) {
  if (g.layout != ScaleLayout::row_major) return false;
  try {
    check_plane_shape(PlaneShape{g.format, g.rows, g.cols}, "");
    (void)CsfGeometry::of(g);
  } catch (const InvalidArgument&) {
    return false;
  }
  return true;
}

const CsfEntry* ContainerInfo::find(const std::string& name) const {
  for (const auto& e : csf)
    if (e.name == name) return &e;
  return nullptr;
}

void put_container_metadata(const ContainerInfo& info, st::Metadata& md) {
  ojson tensors = ojson::object();
  for (const auto& e : info.csf) {
    ojson t = ojson::object();
    t["dtype"] = std::string(st::to_string(e.dtype));
    t["shape"] = e.shape;
    t["format"] = std::string(to_string(e.grid.format));
    t["layout"] = std::string(to_string(e.grid.layout));
    t["grid"] = {e.grid.experts, e.grid.rows, e.grid.cols};
    t["crc32"] = e.crc32;
    t["exceptions"] = e.exceptions;
    t["layer"] = e.layer;
    t["storage"] = std::string(to_string(e.storage));
    tensors[e.name] = std::move(t);
  }
  ojson desc = ojson::object();
  desc["format"] = kFormatName;
  desc["version"] = container_version_for(info.csf);
  desc["tensors"] = std::move(tensors);
  ojson kept = ojson::object();
  for (const auto& [k, v] : info.native_kept)
    kept[k] = {{"format", std::string(to_string(v.format))}, {"layer", v.layer}, {"reason", v.reason}};
  desc["native_kept"] = std::move(kept);
  md[kContainerKey] = desc.dump();

  ojson orig = ojson::object();
  orig["version"] = container_version_for(info.csf);
  orig["file_size"] = info.original_file_size;
  orig["file_crc32"] = info.original_file_crc32;
  orig["header"] = info.original_header;
  ojson gaps = ojson::array();
  for (const auto& g : info.gaps) gaps.push_back(ojson::array({g.offset, base64_encode(g.bytes)}));
  orig["gaps"] = std::move(gaps);
  ojson crcs = ojson::object();
  for (const auto& [k, v] : info.native_crc32) crcs[k] = v;
  orig["native_crc32"] = std::move(crcs);
  md[kOriginalKey] = orig.dump();
}

namespace {

ojson parse_json(const std::string& text, const std::string& what) {
  // The lexer would stop at a NUL byte and ignore what follows.
  if (const auto nul = text.find('\0'); nul != std::string::npos)
    throw FormatError(fmt::format("{}: not valid JSON: a NUL byte at offset {}", what, nul));
  try {
    return ojson::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(fmt::format("{}: {}", what, json_error_text(e)));
  }
}

const ojson& field(const ojson& obj, const char* key, const std::string& what) {
  auto it = obj.find(key);
  if (it == obj.end()) throw FormatError(fmt::format("{}: missing field '{}'", what, key));
  return *it;
}

template <class T>
T as_uint(const ojson& v, const std::string& what, std::uint64_t max = UINT64_MAX) {
  if (!v.is_number_unsigned() || v.get<std::uint64_t>() > max)
    throw FormatError(fmt::format("{}: must be an integer in [0, {}]", what, max));
  return static_cast<T>(v.get<std::uint64_t>());
}

std::string as_string(const ojson& v, const std::string& what) {
  if (!v.is_string()) throw FormatError(what + ": must be a string");
  return v.get<std::string>();
}

}  // namespace

std::optional<ContainerInfo> get_container_metadata(const std::optional<st::Metadata>& md,
                                                    const std::string& label) {
  if (!md) return std::nullopt;
  auto dit = md->find(kContainerKey);
  if (dit == md->end()) return std::nullopt;
  const std::string dwhat = fmt::format("{}: __metadata__['{}']", label, kContainerKey);
  const ojson desc = parse_json(dit->second, dwhat);
  if (!desc.is_object()) throw FormatError(dwhat + ": not an object");
  if (as_string(field(desc, "format", dwhat), dwhat + ".format") != kFormatName)
    throw FormatError(dwhat + ": format is not " + kFormatName);
  const int version = as_uint<int>(field(desc, "version", dwhat), dwhat + ".version", 1u << 30);
  if (version > kContainerVersion)
    throw Unsupported(fmt::format("{}: container version {} is newer than this build supports ({})", label,
                                  version, kContainerVersion));
  ContainerInfo info;
  const ojson& tensors = field(desc, "tensors", dwhat);
  if (!tensors.is_object()) throw FormatError(dwhat + ".tensors: not an object");
  for (auto it = tensors.begin(); it != tensors.end(); ++it) {
    const std::string what = fmt::format("{}: tensor '{}'", dwhat, it.key());
    const ojson& t = it.value();
    if (!t.is_object()) throw FormatError(what + ": not an object");
    CsfEntry e;
    e.name = it.key();
    const std::string dt = as_string(field(t, "dtype", what), what + ".dtype");
    auto d = st::parse_dtype(dt);
    if (!d) throw FormatError(what + ": unknown dtype '" + dt + "'");
    e.dtype = *d;
    const ojson& shape = field(t, "shape", what);
    if (!shape.is_array()) throw FormatError(what + ".shape: not an array");
    for (const auto& s : shape) e.shape.push_back(as_uint<std::uint64_t>(s, what + ".shape"));
    try {
      e.grid.format = parse_scale_format(as_string(field(t, "format", what), what + ".format"));
      e.grid.layout = parse_scale_layout(as_string(field(t, "layout", what), what + ".layout"));
    } catch (const InvalidArgument& x) {
      throw FormatError(what + ": " + x.what());
    }
    const ojson& grid = field(t, "grid", what);
    if (!grid.is_array() || grid.size() != 3) throw FormatError(what + ".grid: must be [E, R, C]");
    e.grid.experts = as_uint<std::uint32_t>(grid[0], what + ".grid[0]", UINT32_MAX);
    e.grid.rows = as_uint<std::uint32_t>(grid[1], what + ".grid[1]", UINT32_MAX);
    e.grid.cols = as_uint<std::uint32_t>(grid[2], what + ".grid[2]", UINT32_MAX);
    e.crc32 = as_uint<std::uint32_t>(field(t, "crc32", what), what + ".crc32", UINT32_MAX);
    e.exceptions = as_uint<std::uint64_t>(field(t, "exceptions", what), what + ".exceptions");
    if (auto l = t.find("layer"); l != t.end()) e.layer = as_string(*l, what + ".layer");
    if (auto s = t.find("storage"); s != t.end()) {
      const std::string v = as_string(*s, what + ".storage");
      const CsfStorageSpec* spec = find_storage(v);
      if (!spec || version < spec->min_version)
        throw FormatError(
            fmt::format("{}.storage: '{}' is not a storage of container version {}", what, v, version));
      e.storage = spec->storage;
    }
    info.csf.push_back(std::move(e));
  }
  if (auto k = desc.find("native_kept"); k != desc.end()) {
    if (!k->is_object()) throw FormatError(dwhat + ".native_kept: not an object");
    for (auto it = k->begin(); it != k->end(); ++it) {
      const std::string what = dwhat + ".native_kept['" + it.key() + "']";
      if (!it.value().is_object()) throw FormatError(what + ": not an object");
      KeptNative kn;
      try {
        kn.format = parse_scale_format(as_string(field(it.value(), "format", what), what + ".format"));
      } catch (const InvalidArgument& x) {
        throw FormatError(what + ": " + x.what());
      }
      kn.layer = as_string(field(it.value(), "layer", what), what + ".layer");
      kn.reason = as_string(field(it.value(), "reason", what), what + ".reason");
      info.native_kept[it.key()] = std::move(kn);
    }
  }

  auto oit = md->find(kOriginalKey);
  const std::string owhat = fmt::format("{}: __metadata__['{}']", label, kOriginalKey);
  if (oit == md->end()) throw FormatError(owhat + ": missing (needed to restore the original file)");
  const ojson orig = parse_json(oit->second, owhat);
  if (!orig.is_object()) throw FormatError(owhat + ": not an object");
  info.original_file_size = as_uint<std::uint64_t>(field(orig, "file_size", owhat), owhat + ".file_size");
  info.original_file_crc32 =
      as_uint<std::uint32_t>(field(orig, "file_crc32", owhat), owhat + ".file_crc32", UINT32_MAX);
  info.original_header = as_string(field(orig, "header", owhat), owhat + ".header");
  const ojson& gaps = field(orig, "gaps", owhat);
  if (!gaps.is_array()) throw FormatError(owhat + ".gaps: not an array");
  for (const auto& g : gaps) {
    if (!g.is_array() || g.size() != 2) throw FormatError(owhat + ".gaps: entries must be [offset, base64]");
    Gap gap;
    gap.offset = as_uint<std::uint64_t>(g[0], owhat + ".gaps offset");
    gap.bytes = base64_decode(as_string(g[1], owhat + ".gaps bytes"), owhat + ".gaps");
    info.gaps.push_back(std::move(gap));
  }
  const ojson& crcs = field(orig, "native_crc32", owhat);
  if (!crcs.is_object()) throw FormatError(owhat + ".native_crc32: not an object");
  for (auto it = crcs.begin(); it != crcs.end(); ++it)
    info.native_crc32[it.key()] =
        as_uint<std::uint32_t>(it.value(), owhat + ".native_crc32['" + it.key() + "']", UINT32_MAX);
  return info;
}

namespace {
constexpr char kB64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

}  // namespace

std::uint64_t stored_part_bytes(const st::File& c, const CsfEntry& e) {
  std::uint64_t n = 0;
  for (const std::string& name : stored_part_names(e.name, e.storage, e.grid.format))
    if (const st::TensorInfo* t = c.find(name)) n += t->nbytes();
  return n;
}

std::uint64_t container_header_bound(const ContainerInfo& base, const std::vector<BoundTensor>& tensors,
                                     const std::optional<st::Metadata>& metadata) {
  std::uint64_t bound = 1024;
  ContainerInfo ub = base;
  ub.original_file_crc32 = UINT32_MAX;
  std::vector<st::TensorInfo> tens;
  std::uint64_t off = 0;
  auto push = [&](const std::string& n, st::Dtype d, std::uint64_t bytes, std::vector<std::uint64_t> shape) {
    st::TensorInfo t;
    t.name = n;
    t.dtype = d;
    t.shape = std::move(shape);
    t.begin = off;
    off += bytes;
    t.end = off;
    tens.push_back(std::move(t));
  };
  // Every CSF candidate is counted with the parts of every storage (through
  // its bound_as; each part once, in table order) and the longest storage name.
  const auto storages = csf_storages();
  std::vector<const CsfPart*> parts;
  for (const CsfStorageSpec& s : storages)
    for (const CsfPart* part : storage_spec(s.bound_as).parts)
      if (std::find(parts.begin(), parts.end(), part) == parts.end()) parts.push_back(part);
  const CsfStorage longest_name =
      std::max_element(storages.begin(), storages.end(), [](const auto& a, const auto& b) {
        return a.name.size() < b.name.size();
      })->storage;
  for (const BoundTensor& b : tensors) {
    const st::TensorInfo* t = b.tensor;
    ub.native_crc32[t->name] = UINT32_MAX;
    if (b.csf) {
      const CsfGeometry& g = *b.csf;
      const std::uint64_t values = std::uint64_t{g.shape.experts} * g.shape.rows * g.shape.cols;
      // At most max_elements, so no dimension larger: the shape rule's rank of it.
      for (const CsfPart* part : parts) {
        const std::uint64_t n = part->max_elements(g);
        push(part->name(t->name, g.shape.format), part->dtype, n * st::dtype_size(part->dtype),
             std::vector<std::uint64_t>(part->shape(g, {}).size(), n));
      }
      CsfEntry e;
      e.name = t->name;
      e.dtype = t->dtype;
      e.shape = t->shape;
      e.grid = g.shape;
      e.crc32 = UINT32_MAX;
      e.exceptions = values;
      e.layer = b.layer;
      e.storage = longest_name;
      ub.csf.push_back(std::move(e));
      // Its native entry (if kept) and the reason string in the descriptor.
      bound += 2 * ojson(t->name).dump().size() + 21 * (t->shape.size() + 2) + 512;
    } else {
      push(t->name, t->dtype, t->nbytes(), t->shape);
      if (b.scale) bound += 2 * ojson(t->name).dump().size() + 512;
    }
  }
  st::Metadata ubmd = metadata.value_or(st::Metadata{});
  put_container_metadata(ub, ubmd);
  return bound + st::Writer::header_json_size(tens, ubmd);
}

std::string base64_encode(std::string_view in) {
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  std::size_t i = 0;
  for (; i + 3 <= in.size(); i += 3) {
    const std::uint32_t v = (std::uint32_t(std::uint8_t(in[i])) << 16) |
                            (std::uint32_t(std::uint8_t(in[i + 1])) << 8) | std::uint8_t(in[i + 2]);
    out += kB64[v >> 18];
    out += kB64[(v >> 12) & 63];
    out += kB64[(v >> 6) & 63];
    out += kB64[v & 63];
  }
  if (const std::size_t rest = in.size() - i) {
    std::uint32_t v = std::uint32_t(std::uint8_t(in[i])) << 16;
    if (rest == 2) v |= std::uint32_t(std::uint8_t(in[i + 1])) << 8;
    out += kB64[v >> 18];
    out += kB64[(v >> 12) & 63];
    out += rest == 2 ? kB64[(v >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

std::string base64_decode(std::string_view in, const std::string& what) {
  if (in.size() % 4) throw FormatError(what + ": base64 length is not a multiple of 4");
  auto val = [&](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    throw FormatError(what + ": invalid base64 character");
  };
  std::string out;
  out.reserve(in.size() / 4 * 3);
  for (std::size_t i = 0; i < in.size(); i += 4) {
    const bool last = i + 4 == in.size();
    const int pad = last ? (in[i + 3] == '=') + (in[i + 2] == '=') : 0;
    if (pad == 1 && in[i + 2] == '=') throw FormatError(what + ": invalid base64 padding");
    const std::uint32_t v = (std::uint32_t(val(in[i])) << 18) | (std::uint32_t(val(in[i + 1])) << 12) |
                            (pad >= 2 ? 0u : std::uint32_t(val(in[i + 2])) << 6) |
                            (pad >= 1 ? 0u : std::uint32_t(val(in[i + 3])));
    out += char(v >> 16);
    if (pad < 2) out += char((v >> 8) & 0xFF);
    if (pad < 1) out += char(v & 0xFF);
  }
  return out;
}

std::uint32_t crc_of(std::span<const std::uint8_t> b) {
  uLong c = crc32(0L, Z_NULL, 0);
  while (!b.empty()) {
    const std::size_t n = std::min<std::size_t>(b.size(), std::size_t{1} << 30);
    c = crc32(c, b.data(), static_cast<uInt>(n));
    b = b.subspan(n);
  }
  return static_cast<std::uint32_t>(c);
}
std::uint32_t crc_of(std::string_view s) {
  return crc_of(std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(s.data()), s.size()));
}

CsfTensor load_csf_parts(const st::File& c, const CsfEntry& e, const std::string& label) {
  const std::string what = fmt::format("{}: tensor '{}'", label, e.name);
  CsfGeometry geometry;
  try {
    geometry = CsfGeometry::of(e.grid);
  } catch (const InvalidArgument& x) {
    throw FormatError(fmt::format("{}: invalid grid in the descriptor: {}", what, x.what()));
  }
  return storage_spec(e.storage).load(e, geometry, PartReader(c, e, geometry, what));
}

std::vector<std::uint8_t> decode_checked(const CsfTensor& enc, const CsfEntry& e, std::uint64_t nbytes,
                                         const std::string& label, const CodecOptions& options,
                                         bool check_crc) {
  if (enc.source_bytes() != nbytes)
    throw FormatError(fmt::format("{}: tensor '{}': CSF grid of {} bytes for a tensor of {}", label, e.name,
                                  enc.source_bytes(), nbytes));
  std::vector<std::uint8_t> buf(nbytes);
  decode(enc, e.grid.layout, buf, options, /*trusted=*/true);
  if (check_crc)
    if (const std::uint32_t got = crc_of(buf); got != e.crc32)
      throw CorruptData(fmt::format("{}: tensor '{}': CRC32 of the decoded tensor is {:08x}, expected {:08x}",
                                    label, e.name, got, e.crc32));
  return buf;
}

}  // namespace csfmoe::detail
