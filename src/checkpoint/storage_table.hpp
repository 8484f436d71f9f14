// The CSF storages, one table entry each (internal; docs/container-format.md
// is the spec). A storage is a payload (what its bytes hold) under a naming
// (whose tensor names its parts take); its entry says which container
// version first holds it, its part tensors, and how they are written,
// counted and loaded. The descriptor's parse and version stamp, the stored
// part names, compress's byte counts and writers, and the loader all read
// this table: adding a storage is a CsfStorage value (container.hpp) and its
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

// Reads the part tensors of one CSF tensor from a container, checking each
// one's dtype and shape: FormatError starting with `what` (file and tensor).
class PartReader {
 public:
  PartReader(const st::File& file, std::string what) : file_(file), what_(std::move(what)) {}
  // `flat_ok`: a b12x fixed plane may also be stored flat, U8 [n] (see foreign_b12x).
  std::span<const std::uint8_t> operator()(const std::string& name, st::Dtype dtype,
                                           const std::vector<std::uint64_t>& shape,
                                           bool flat_ok = false) const;
  const std::string& what() const { return what_; }

 private:
  const st::File& file_;
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
  // Its part tensor names for scale tensor `tensor`, in file order.
  std::vector<std::string> (*parts)(const std::string& tensor, ScaleFormat format);
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
