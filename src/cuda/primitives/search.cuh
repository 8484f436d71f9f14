// Binary search over ascending prefix sums, shared by the codec kernels (the
// expert of a record, the slot-th used expert of a routing bitmap).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace csfmoe::ptx {

// The last index in [0, n) whose prefix is at most v, for prefix ascending
// and prefix[0] <= v (prefix[n] is not read).
template <class V>
__device__ __forceinline__ std::uint32_t last_at_most(const std::uint32_t* prefix, std::uint32_t n, V v) {
  std::uint32_t lo = 0, hi = n;  // prefix[lo] <= v < prefix[hi]
  while (hi - lo > 1) {
    const std::uint32_t mid = (lo + hi) / 2;
    if (prefix[mid] <= v)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

}  // namespace csfmoe::ptx
