// What every GPU test needs: whether a device is present (the tests skip
// cleanly without one) and a CUDA status turned into an exception naming
// the step.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

namespace csfmoe::testing {

inline bool have_gpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return n > 0;
}

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

}  // namespace csfmoe::testing

#define REQUIRE_GPU() \
  if (!::csfmoe::testing::have_gpu()) GTEST_SKIP() << "no CUDA device"
