// GPU side of the CSF codec: encode native scale grids that are already on
// the device, expand all experts (`expand_scales`), expand only the experts a
// call routes to. Host wrappers check everything before any launch; kernels
// assume checked inputs. Only available when built with CUDA (csfmoe_cuda).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "csfmoe/codec.hpp"

namespace csfmoe {

enum class IndexType : std::uint8_t { int32 = 0, int64 = 1 };

// Non-owning view of CSF parts resident on one device.
struct CsfDeviceView {
  CsfGeometry geometry;
  const std::uint8_t* fixed = nullptr;             // geometry.fixed_bytes()
  const std::uint32_t* exceptions = nullptr;       // num_exceptions
  const std::uint32_t* row_prefix = nullptr;       // E * padded_rows + 1
  const std::uint32_t* partition_index = nullptr;  // E * partitions_per_expert + 1
  std::uint64_t num_exceptions = 0;
  int device = -1;
};

// Owning device copy of a CSF tensor (cudaMalloc'd on `device`).
class DeviceCsfTensor {
 public:
  DeviceCsfTensor() = default;
  // Upload host parts (validated first) to `device`; synchronous.
  static DeviceCsfTensor upload(const CsfTensor& host, int device);
  // Copy the parts back (for tests and for saving); synchronous.
  CsfTensor download() const;

  const CsfDeviceView& view() const { return view_; }
  std::uint64_t resident_bytes() const;  // device bytes held
  bool empty() const { return view_.fixed == nullptr; }

 private:
  struct Storage;
  std::shared_ptr<Storage> storage_;
  CsfDeviceView view_;
  friend DeviceCsfTensor encode_on_device(const GridShape&, const std::uint8_t*, int, cudaStream_t);
};

// Encode a native scale tensor that lives on `device` (d_src holds
// CsfGeometry::native_bytes(shape.layout) bytes). Bit-identical to the CPU
// encoder. Synchronizes `stream` once to size the exception stream; that is
// its only allocation point, so it must run before any graph capture.
DeviceCsfTensor encode_on_device(const GridShape& shape, const std::uint8_t* d_src, int device,
                                 cudaStream_t stream);

// Rebuild every expert's native grid into d_dst (native_bytes(layout) bytes on
// the tensor's device), asynchronously on `stream`. Uses the tensor's device
// whatever the current device is. No allocation, no host synchronization.
void expand_all(const CsfDeviceView& tensor, ScaleLayout layout, std::uint8_t* d_dst, cudaStream_t stream);

// Rebuild only the experts that appear in ids[0..count) (top-k ids of a call,
// int32 or int64, each < E; out-of-range ids are skipped) into d_dst, which
// holds all E experts' grids. No allocation, no host synchronization:
// capturable in a CUDA graph.
void expand_routed(const CsfDeviceView& tensor, ScaleLayout layout, const void* ids, IndexType id_type,
                   std::uint64_t count, std::uint8_t* d_dst, cudaStream_t stream);

}  // namespace csfmoe
