// The CSF container format (internal; docs/container-format.md is the spec):
// its metadata, the CSF part tensors, and the bound on its header size.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "csfmoe/b12x_planes.hpp"
#include "csfmoe/codec.hpp"
#include "csfmoe/mxfp4_slab_planes.hpp"
#include "csfmoe/safetensors.hpp"

namespace csfmoe::detail {

// The newest container version this build reads and writes: version 2 adds
// the planes storage, version 3 the mxfp4_slab storage (CsfStorage); a file
// is stamped with the lowest version that holds its storages
// (container_version_for), and versions 1..3 load.
inline constexpr int kContainerVersion = 3;
inline constexpr const char* kContainerKey = "csfmoe.container";  // __metadata__ key of the descriptor
inline constexpr const char* kOriginalKey = "csfmoe.original";    // __metadata__ key of the restore record
inline constexpr const char* kFormatName = "csfmoe-csf";

// How a CSF tensor's parts are stored (docs/container-format.md). Each value
// has one entry in the storage table (storage_table.hpp: name, first version,
// payload and naming, parts, writer, byte count, loader), in this order.
enum class CsfStorage {
  // The resident form as is: padded fixed slabs, records, row prefix and
  // partition index (the only storage of version 1).
  resident,
  // Per expert what b12x stores: the canonical fixed plane (16-row slabs of
  // bases and codes, no padding) and the records, plus a record count per
  // expert; the resident form is derived at load without re-encoding.
  planes,
  // One expert projection's planes under b12x / vLLM's own tensor names
  // (`csf compress --schema b12x`): a file those loaders read as is.
  b12x,
  // MXFP4 only (version 3): the planes in slab form (include/csfmoe/mxfp4_slab_planes.hpp):
  // per 16-row slab one base byte, 2-bit row deltas and unpadded selector
  // bits, the bases of escaped rows, the records and a record count per
  // expert; loads through the same planes.
  mxfp4_slab,
};
std::string_view to_string(CsfStorage s);

// Part tensor names of a compressed tensor (resident: fixed, exceptions,
// row_prefix, partition_index; planes: planes, exceptions, expert_exceptions;
// b12x: its format's b12x fixed and exceptions names; mxfp4_slab: slabs,
// slab_escapes, exceptions, expert_exceptions).
struct PartNames {
  std::string fixed, exceptions, row_prefix, partition_index, planes, expert_exceptions;
  std::string b12x_nvfp4_fixed, b12x_nvfp4_exceptions, b12x_mxfp4_fixed, b12x_mxfp4_exceptions;
  std::string slabs, slab_escapes;
  std::vector<const std::string*> all() const {
    return {&fixed,
            &exceptions,
            &row_prefix,
            &partition_index,
            &planes,
            &expert_exceptions,
            &b12x_nvfp4_fixed,
            &b12x_nvfp4_exceptions,
            &b12x_mxfp4_fixed,
            &b12x_mxfp4_exceptions,
            &slabs,
            &slab_escapes};
  }
};
PartNames part_names(const std::string& tensor);

// Whether a grid can be stored as planes: row-major, rows a multiple of 16,
// NVFP4 columns even, 2^24 positions per expert (b12x's plane rules).
bool planes_storable(const GridShape& g);

struct CsfEntry {
  std::string name;  // original tensor name
  st::Dtype dtype = st::Dtype::U8;
  std::vector<std::uint64_t> shape;  // logical (original) shape
  GridShape grid;
  std::uint32_t crc32 = 0;  // zlib crc32 of the original tensor bytes
  std::uint64_t exceptions = 0;
  std::string layer;
  CsfStorage storage = CsfStorage::resident;
};
// The lowest container version that can hold these entries' storages: 3 with
// an mxfp4_slab entry, else 2.
int container_version_for(const std::vector<CsfEntry>& entries);

struct KeptNative {
  ScaleFormat format = ScaleFormat::nvfp4;
  std::string layer;
  std::string reason;
};

struct Gap {
  std::uint64_t offset = 0;  // inside the original data section
  std::string bytes;
};

struct ContainerInfo {
  std::vector<CsfEntry> csf;    // in original data order
  std::string original_header;  // N bytes verbatim
  std::uint64_t original_file_size = 0;
  std::uint32_t original_file_crc32 = 0;
  std::vector<Gap> gaps;                              // data-section bytes outside every tensor
  std::map<std::string, std::uint32_t> native_crc32;  // every original tensor not stored as CSF
  std::map<std::string, KeptNative> native_kept;      // block-scale tensors kept native, and why
  const CsfEntry* find(const std::string& name) const;
};

// Adds the two metadata entries to `md` (which holds the original's metadata, if any).
void put_container_metadata(const ContainerInfo& info, st::Metadata& md);
// Reads them back; std::nullopt if the file is not a container; FormatError if malformed.
std::optional<ContainerInfo> get_container_metadata(const std::optional<st::Metadata>& md,
                                                    const std::string& label);

// Writes the four resident part tensors of CSF tensor `name` (what load_csf_parts reads).
void write_csf_parts(st::Writer& w, const std::string& name, const CsfTensor& t);
// Writes the three plane part tensors of CSF tensor `name`, one plane per expert.
void write_csf_planes(st::Writer& w, const std::string& name, std::span<const CsfPlanes> experts);
// Writes one expert projection's planes under the b12x names of `name`.
void write_b12x_planes(st::Writer& w, const std::string& name, const CsfPlanes& planes);
// Bytes those plane parts take in the file.
std::uint64_t planes_stored_bytes(std::span<const CsfPlanes> experts);
// Writes the four mxfp4_slab part tensors of CSF tensor `name`, one slab form
// per expert (all of one shape); mxfp4_slabs_stored_bytes counts their bytes.
void write_csf_mxfp4_slabs(st::Writer& w, const std::string& name, std::span<const Mxfp4SlabPlanes> experts);
// The part tensor names a CSF tensor has with this storage, in file order.
std::vector<std::string> stored_part_names(const std::string& tensor, CsfStorage storage, ScaleFormat format);
// Bytes the parts of `e` take in container `c` (0 for a part that is missing).
std::uint64_t stored_part_bytes(const st::File& c, const CsfEntry& e);

// A tensor of the source file as the container header bound sees it.
struct BoundTensor {
  const st::TensorInfo* tensor = nullptr;
  const CsfGeometry* csf = nullptr;  // set when it may be stored as CSF
  std::string layer;                 // the MoE layer of a CSF candidate
  bool scale = false;                // a block-scale tensor (a native one carries its reason)
};

// Upper bound of the container header for `tensors` (in data order): every
// CSF candidate with the largest possible counts, offsets and CRCs, plus room
// for its native entry and reason string. `base` holds the restore record of
// the original file, `metadata` its own __metadata__.
std::uint64_t container_header_bound(const ContainerInfo& base, const std::vector<BoundTensor>& tensors,
                                     const std::optional<st::Metadata>& metadata);

// Loads and validates the parts of CSF tensor `e` from container file `c`
// (untrusted: shapes, dtypes and the parts themselves are checked) and
// returns the resident form; planes are converted without re-encoding.
// FormatError messages start with `label` and the tensor name.
CsfTensor load_csf_parts(const st::File& c, const CsfEntry& e, const std::string& label);

// Decodes the loaded parts of CSF tensor `e` into its source layout, after
// checking they make `nbytes` bytes, and (with `check_crc`; files written by
// b12x / vLLM have no checksum) that their CRC32 is the descriptor's:
// FormatError / CorruptData naming `label` and the tensor.
std::vector<std::uint8_t> decode_checked(const CsfTensor& enc, const CsfEntry& e, std::uint64_t nbytes,
                                         const std::string& label, const CodecOptions& options,
                                         bool check_crc);

// zlib CRC32 of any number of bytes (zlib takes at most 4 GiB a call).
std::uint32_t crc_of(std::span<const std::uint8_t> bytes);
std::uint32_t crc_of(std::string_view bytes);

std::string base64_encode(std::string_view in);
std::string base64_decode(std::string_view in, const std::string& what);  // FormatError on bad input

}  // namespace csfmoe::detail
