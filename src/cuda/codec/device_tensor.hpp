// Internals shared by the GPU codec's host files (csf_codec.cu,
// planes_upload.cu): the storage behind a DeviceCsfTensor and the device check.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "csfmoe/device_codec.hpp"
#include "csfmoe/errors.hpp"
#include "cuda/primitives/cuda_check.hpp"
#include "cuda/primitives/strf.hpp"

namespace csfmoe {

namespace codec_detail {
inline void check_device(int device, const char* who) {
  int count = 0;
  CSFMOE_CUDA_CHECK(cudaGetDeviceCount(&count));
  if (device < 0 || device >= count)
    throw InvalidArgument(
        cuda_detail::strf("{}: device {} does not exist ({} CUDA devices)", who, device, count));
}
}  // namespace codec_detail

// The parts of a DeviceCsfTensor, freed with its last copy.
struct DeviceCsfTensor::Storage {
  int device = -1;
  std::uint8_t* fixed = nullptr;
  std::uint32_t* exceptions = nullptr;
  std::uint32_t* row_prefix = nullptr;
  std::uint32_t* partition_index = nullptr;
  cudaEvent_t ready = nullptr;  // set by the kernels that build the parts: complete once it fires

  explicit Storage(int d) : device(d) {}
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  ~Storage() {
    try {
      cuda_detail::DeviceGuard guard(device);
      if (ready) (void)cudaEventSynchronize(ready);  // never free under a running kernel
      (void)cudaFree(fixed);
      (void)cudaFree(exceptions);
      (void)cudaFree(row_prefix);
      (void)cudaFree(partition_index);
      if (ready) (void)cudaEventDestroy(ready);
    } catch (...) {
      // Destructors must not throw; the context is gone or the device is lost.
    }
  }
  // Records `ready` on `stream` after the work that builds the parts.
  void mark_ready(cudaStream_t stream) {
    CSFMOE_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    CSFMOE_CUDA_CHECK(cudaEventRecord(ready, stream));
  }
  template <class T>
  static T* alloc(std::uint64_t count, const char* what) {
    if (count == 0) return nullptr;
    void* p = nullptr;
    CSFMOE_CUDA_CHECK_WHAT(
        cudaMalloc(&p, count * sizeof(T)),
        cuda_detail::strf("CSF device tensor: cudaMalloc of {} bytes for {}", count * sizeof(T), what));
    return static_cast<T*>(p);
  }
};

inline DeviceCsfTensor DeviceCsfTensor::adopt(std::shared_ptr<Storage> st, const CsfGeometry& g,
                                              std::uint64_t records) {
  DeviceCsfTensor t;
  t.view_ = {g, st->fixed, st->exceptions, st->row_prefix, st->partition_index, records, st->device};
  t.storage_ = std::move(st);
  return t;
}

}  // namespace csfmoe
