// The CSF storages, one table entry each (internal; docs/container-format.md
// is the spec). A storage is a payload (what its bytes hold) under a naming
// (whose tensor names its parts take); its entry says which container
// version first holds it, its part tensors, and how they are written,
// counted and loaded. Each part is one descriptor (CsfPart): its name, its
// dtype, its exact shape as a function of the grid and counts, and its
// largest element count for the header bound. The descriptor's parse and
// version stamp, the stored part names, the header bound, compress's byte
// counts and writers, and the loaders all read this table: adding a storage
// is a CsfStorage value (container.hpp), its parts' descriptors and its
// entry in storage_table.cpp.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "checkpoint/container.hpp"

namespace csfmoe::detail {

// What a storage's bytes hold: the resident form, b12x's canonical planes, or
// their MXFP4 slab form.
enum class CsfPayload { resident, planes, mxfp4_slab };
// Whose names its part tensors take: csfmoe's container (X.csf.*) or b12x /
// vLLM's schema (X.nvfp4_csf_fixed, ...), which those loaders read as is.
enum class CsfNaming { container, b12x };

// The forms compress made of one tensor; a storage writes and counts its own.
struct CsfForms {
  const CsfTensor* resident = nullptr;
  std::span<const CsfPlanes> planes;             // per expert
  std::span<const Mxfp4SlabPlanes> mxfp4_slabs;  // per expert
};

// What a part's shape depends on besides the grid: the descriptor's record
// count and, for the slab escapes, the escape count read from the slabs.
struct PartCounts {
  std::uint64_t records = 0;
  std::uint64_t escapes = 0;
};

// One part tensor of a CSF storage. Parts that several storages share (the
// records, the per-expert record counts) are one descriptor.
struct CsfPart {
  // Its tensor name for scale tensor `tensor` (part_names, or b12x's names).
  std::string (*name)(const std::string& tensor, ScaleFormat format);
  st::Dtype dtype;
  // The exact shape the loader accepts, from the descriptor's grid
  // (`g.shape`, already checked) and counts.
  std::vector<std::uint64_t> (*shape)(const CsfGeometry& g, const PartCounts& counts);
  // Also accepted stored flat, [product of the shape] (b12x's fixed plane: see foreign_b12x).
  bool flat_ok;
  // At most this many elements for any counts, hence no dimension larger:
  // what the container header bound reserves (from the geometry alone).
  std::uint64_t (*max_elements)(const CsfGeometry& g);
};

// Reads the part tensors of one CSF tensor from a container, checking each
// one's dtype and shape against its descriptor: FormatError starting with
// `what` (file and tensor) and naming the part.
class PartReader {
 public:
  PartReader(const st::File& file, const CsfEntry& entry, const CsfGeometry& geometry, std::string what)
      : file_(file), entry_(entry), geometry_(geometry), what_(std::move(what)) {}
  std::span<const std::uint8_t> operator()(const CsfPart& part, const PartCounts& counts) const;
  const std::string& what() const { return what_; }

 private:
  const st::File& file_;
  const CsfEntry& entry_;
  const CsfGeometry& geometry_;
  std::string what_;
};

struct CsfStorageSpec {
  CsfStorage storage;
  std::string_view name;  // in the descriptor and the reports
  // The first container version that holds it; 0: every version (the one
  // storage of version 1, and what a descriptor without "storage" means).
  int min_version;
  CsfPayload payload;
  CsfNaming naming;
  // Its part tensors, in file order.
  std::span<const CsfPart* const> parts;
  // The storage whose parts container_header_bound counts for this one:
  // itself, or one whose header entries are never shorter (b12x: planes,
  // three parts for the same payload that b12x stores in two).
  CsfStorage bound_as;
  // Writes its parts of `tensor`; stored_bytes: the bytes they take.
  void (*write)(st::Writer& w, const std::string& tensor, const CsfForms& forms);
  std::uint64_t (*stored_bytes)(const CsfForms& forms);
  // The resident form of entry `e` from its parts (untrusted: all checked;
  // `geometry` is the descriptor's grid, already checked).
  CsfTensor (*load)(const CsfEntry& e, const CsfGeometry& geometry, const PartReader& get);
};

// Every storage, in CsfStorage order.
std::span<const CsfStorageSpec> csf_storages();
const CsfStorageSpec& storage_spec(CsfStorage s);
// The storage of this payload under this naming (b12x's naming holds planes
// only: InvalidArgument for another payload).
const CsfStorageSpec& storage_of(CsfPayload payload, CsfNaming naming);
// The storage named `name` in a descriptor; nullptr for none.
const CsfStorageSpec* find_storage(std::string_view name);

}  // namespace csfmoe::detail
