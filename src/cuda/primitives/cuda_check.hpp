// CUDA error checking for host code: every runtime call goes through
// CSFMOE_CUDA_CHECK (or CSFMOE_CUDA_CHECK_WHAT where the call alone does not
// say what failed), which throws csfmoe::CudaError naming file:line, what
// failed and the runtime's error, so a failure is never silently ignored.
#pragma once

#include <cuda_runtime_api.h>

#include <string>
#include <string_view>

#include "csfmoe/errors.hpp"

namespace csfmoe::cuda_detail {

// Throws "file:line: <what> failed: <error name> (<error string>)". The
// thread's last-error state is reset first: the exception reports the error,
// so a later cudaGetLastError must not report it again.
[[noreturn]] inline void throw_cuda_error(cudaError_t err, std::string_view what, const char* file,
                                          int line) {
  (void)cudaGetLastError();
  throw CudaError(std::string(file) + ":" + std::to_string(line) + ": " + std::string(what) +
                  " failed: " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

// Sets `device` current for the scope and restores the previous current
// device afterwards (also when an exception leaves the scope).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (const cudaError_t e = cudaGetDevice(&previous_); e != cudaSuccess)
      throw_cuda_error(e, "cudaGetDevice(&previous_)", __FILE__, __LINE__);
    if (previous_ != device) {
      if (const cudaError_t e = cudaSetDevice(device); e != cudaSuccess)
        throw_cuda_error(e, "cudaSetDevice(device)", __FILE__, __LINE__);
      switched_ = true;
    }
  }
  ~DeviceGuard() {
    if (switched_) (void)cudaSetDevice(previous_);  // a destructor must not throw
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

}  // namespace csfmoe::cuda_detail

#define CSFMOE_CUDA_CHECK(call)                                                             \
  do {                                                                                      \
    const cudaError_t csfmoe_cuda_err_ = (call);                                            \
    if (csfmoe_cuda_err_ != cudaSuccess)                                                    \
      ::csfmoe::cuda_detail::throw_cuda_error(csfmoe_cuda_err_, #call, __FILE__, __LINE__); \
  } while (0)

// After a kernel launch: launch-configuration errors surface here.
#define CSFMOE_CUDA_CHECK_LAUNCH(what)                                                     \
  do {                                                                                     \
    const cudaError_t csfmoe_cuda_err_ = cudaGetLastError();                               \
    if (csfmoe_cuda_err_ != cudaSuccess)                                                   \
      ::csfmoe::cuda_detail::throw_cuda_error(csfmoe_cuda_err_, what, __FILE__, __LINE__); \
  } while (0)

// Like CSFMOE_CUDA_CHECK, with `what` (anything a std::string_view is built
// from, evaluated only on failure) naming the step instead of the call's text.
#define CSFMOE_CUDA_CHECK_WHAT(call, what)                                                 \
  do {                                                                                     \
    const cudaError_t csfmoe_cuda_err_ = (call);                                           \
    if (csfmoe_cuda_err_ != cudaSuccess)                                                   \
      ::csfmoe::cuda_detail::throw_cuda_error(csfmoe_cuda_err_, what, __FILE__, __LINE__); \
  } while (0)
