// GPU side of the CSF codec: encode native scale grids that are already on
// the device, expand all experts (`expand_scales`), expand only the experts a
// call routes to. Host wrappers check everything before any launch; kernels
// assume checked inputs. Only available when built with CUDA (csfmoe_cuda).
// docs/gpu-codec.md describes the kernels, the guarantees and the numbers.
//
// Every entry point runs on the device that owns the tensor, whatever the
// current device is, and restores the current device before returning.
// Expansions never allocate and never synchronize the host, so they can be
// captured in a CUDA graph; they write every byte of the experts they expand.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "csfmoe/b12x_planes.hpp"
#include "csfmoe/codec.hpp"
#include "csfmoe/memory.hpp"

namespace csfmoe {

enum class IndexType : std::uint8_t { int32 = 0, int64 = 1 };

// Non-owning view of CSF parts resident on one device.
struct CsfDeviceView {
  CsfGeometry geometry;
  const std::uint8_t* fixed = nullptr;             // geometry.fixed_bytes(), 16-byte aligned
  const std::uint32_t* exceptions = nullptr;       // num_exceptions
  const std::uint32_t* row_prefix = nullptr;       // E * padded_rows + 1
  const std::uint32_t* partition_index = nullptr;  // E * partitions_per_expert + 1
  std::uint64_t num_exceptions = 0;
  int device = -1;
};

// Owning device copy of a CSF tensor (cudaMalloc'd on `device`). Copies share
// the parts (reference counted); the parts are freed with the last copy.
class DeviceCsfTensor {
 public:
  DeviceCsfTensor() = default;
  // Upload host parts (validated first) to `device`; synchronous.
  static DeviceCsfTensor upload(const CsfTensor& host, int device);
  // Copy the parts back (for tests and for saving); synchronous.
  CsfTensor download() const;

  const CsfDeviceView& view() const { return view_; }
  std::uint64_t resident_bytes() const;  // device bytes held (== csf_resident_bytes of the host parts)
  bool empty() const { return view_.fixed == nullptr; }

 private:
  struct Storage;
  std::shared_ptr<Storage> storage_;
  CsfDeviceView view_;
  // The tensor that owns `st`, whose parts hold `records` records (internal).
  static DeviceCsfTensor adopt(std::shared_ptr<Storage> st, const CsfGeometry& g, std::uint64_t records);
  friend DeviceCsfTensor encode_on_device(const GridShape&, const std::uint8_t*, int, cudaStream_t);
  friend DeviceCsfTensor planes_to_device(std::span<const CsfPlanes>, ScaleLayout, int, cudaStream_t,
                                          std::string_view);
};

// Encode a native scale tensor that lives on `device` (d_src holds
// CsfGeometry::native_bytes(shape.layout) bytes). Bit-identical to the CPU
// encoder. Synchronizes `stream` once to size the exception stream; that is
// its only allocation point, so it must run before any graph capture.
// Throws Unsupported (like the CPU encoder) when the tensor has more than
// 2^32 - 1 exceptions.
DeviceCsfTensor encode_on_device(const GridShape& shape, const std::uint8_t* d_src, int device,
                                 cudaStream_t stream);

// The resident form of E experts' canonical planes (b12x / vLLM's storage,
// csfmoe/b12x_planes.hpp; every expert the same grid) built on `device`
// without decoding: the fixed planes and records are uploaded as they are,
// then kernels move bases and codes into the resident slabs, re-address the
// records to the padded columns and find row_prefix / partition_index.
// Equal part for part to DeviceCsfTensor::upload(planes_to_csf(experts)),
// with the layout tag `layout` (a swizzled_128x4 tensor holds the same parts:
// positions are logical). Everything is checked on the host before any
// device work: shapes (InvalidArgument), each expert's planes
// (validate_planes: FormatError naming `name` and the expert), a grid the
// layout or the padded form cannot address (InvalidArgument), more than
// 2^32 - 1 records (Unsupported). Records that win over their slot are put
// in the encoder's form first (canonical_planes), on the host, only for the
// experts that have them. Copies and kernels run on `stream`; the host
// planes may be freed once this returns.
DeviceCsfTensor planes_to_device(std::span<const CsfPlanes> experts, ScaleLayout layout, int device,
                                 cudaStream_t stream, std::string_view name = "scale");

// Rebuild every expert's native grid into d_dst (native_bytes(layout) bytes on
// the tensor's device), asynchronously on `stream`. Uses the tensor's device
// whatever the current device is. No allocation, no host synchronization.
// Output is byte-identical to csfmoe::decode(tensor, layout, ...).
void expand_all(const CsfDeviceView& tensor, ScaleLayout layout, std::uint8_t* d_dst, cudaStream_t stream);

// Rebuild only the experts that appear in ids[0..count) (top-k ids of a call,
// int32 or int64, each < E; out-of-range ids, negative ones included, are
// skipped) into d_dst, which holds all E experts' grids; other experts' bytes
// are not touched. No allocation, no host synchronization: capturable in a
// CUDA graph (the ids buffer may be rewritten between replays; count is part
// of the captured launch). ids is read on the device (int64 ids 8-byte aligned).
void expand_routed(const CsfDeviceView& tensor, ScaleLayout layout, const void* ids, IndexType id_type,
                   std::uint64_t count, std::uint8_t* d_dst, cudaStream_t stream);

// ---------------------------------------------------------------------------
// Layer level: the two block-scale tensors of one MoE layer,
//   w13 [E, 2N, H/g] (gate/up) and w2 [E, H, N/g] (down).
// ---------------------------------------------------------------------------

// One scale tensor of a layer: either native on the device or CSF.
struct ScaleTensorRef {
  GridShape shape;                       // native: its shape and layout; CSF: ignored (taken from the tensor)
  const std::uint8_t* native = nullptr;  // set when the tensor is kept native
  const DeviceCsfTensor* csf = nullptr;  // set when the tensor is CSF (then native must be null)

  bool is_csf() const { return csf != nullptr && !csf->empty(); }
  static ScaleTensorRef of_native(const GridShape& s, const std::uint8_t* d) { return {s, d, nullptr}; }
  static ScaleTensorRef of_csf(const DeviceCsfTensor& t) { return {t.view().geometry.shape, nullptr, &t}; }
};

struct LayerScales {
  ScaleTensorRef w13;
  ScaleTensorRef w2;
  bool any_csf() const { return w13.is_csf() || w2.is_csf(); }
};

// Caller-owned scratch that receives the expanded grids (device memory on the
// tensors' device). One scratch can serve every layer of a model: the caller
// orders reuse with events (expand layer i + 1 on a side stream while layer i
// runs, then make the consumer stream wait).
struct ScaleScratch {
  std::uint8_t* w13 = nullptr;
  std::uint64_t w13_bytes = 0;  // >= native_bytes(layout) of w13
  std::uint8_t* w2 = nullptr;
  std::uint64_t w2_bytes = 0;  // >= native_bytes(layout) of w2
};

// Bytes the scratch needs for `layout` (w13 and w2 separately).
struct ScratchSizes {
  std::uint64_t w13 = 0;
  std::uint64_t w2 = 0;
};
ScratchSizes scratch_sizes(const LayerScales& layer, ScaleLayout layout);

// Launch shape of an expansion. blocks_per_sm = 0 (the default) fills every
// SM with expansion blocks: fastest alone. A background expansion (the next
// layer's scales on a side stream of lower priority, next to a running MoE
// call) should use 1: its blocks then take a corner of each SM (256 threads,
// 40 registers each) instead of holding whole SMs that the concurrent
// kernel's blocks wait for (bench/RESULTS.md, "background scale expansion").
struct ExpandLaunch {
  std::uint32_t blocks_per_sm = 0;  // resident expansion blocks per SM at most; 0: as many as fit
};

// Expand-all for a layer. Returns false and does nothing when neither tensor
// is CSF (the caller reads its native tensors). Otherwise expands each CSF
// tensor into its scratch buffer (one fused launch when both are CSF of the
// same format) and returns true; a tensor kept native in a mixed layer is
// left where it is (read it through scale_pointers) and must already be in
// `layout` (else InvalidArgument). Asynchronous on `stream`; no allocation,
// no host synchronization.
bool expand_scales(const LayerScales& layer, const ScaleScratch& scratch, ScaleLayout layout,
                   cudaStream_t stream, const ExpandLaunch& launch = {});

// Expand-routed for a layer: like expand_scales but only the experts listed
// in ids (see expand_routed). Capturable in a CUDA graph.
bool expand_scales_routed(const LayerScales& layer, const ScaleScratch& scratch, ScaleLayout layout,
                          const void* ids, IndexType id_type, std::uint64_t count, cudaStream_t stream);

// Where a GEMM reads each tensor's native scales after expand_scales: the
// scratch buffer for a CSF tensor, the native pointer otherwise.
struct ScalePointers {
  const std::uint8_t* w13 = nullptr;
  const std::uint8_t* w2 = nullptr;
};
ScalePointers scale_pointers(const LayerScales& layer, const ScaleScratch& scratch);

// Resident device bytes of a layer's scales: native = both tensors' native
// bytes, csf = what is actually held (CSF parts, or native bytes for a
// tensor kept native). The host-only variants are in csfmoe/memory.hpp.
ResidentBytes layer_resident_bytes(const LayerScales& layer);

}  // namespace csfmoe
