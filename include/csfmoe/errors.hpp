// Typed errors thrown by every csfmoe entry point. Messages name the object
// (file, tensor, argument) and the reason, so a caller can print them as is.
#pragma once

#include <stdexcept>
#include <string>

namespace csfmoe {

enum class ErrorKind {
  invalid_argument,  // caller passed a bad shape, dtype, size, device, ...
  unsupported,       // valid request that this build or format does not handle
  format,            // malformed or hostile file / encoded data
  corrupt,           // data decodes but fails its integrity check (CRC)
  io,                // operating-system level I/O failure
  cuda,              // CUDA runtime or driver error
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const noexcept { return kind_; }

 private:
  ErrorKind kind_;
};

struct InvalidArgument : Error {
  explicit InvalidArgument(const std::string& m) : Error(ErrorKind::invalid_argument, m) {}
};
struct Unsupported : Error {
  explicit Unsupported(const std::string& m) : Error(ErrorKind::unsupported, m) {}
};
struct FormatError : Error {
  explicit FormatError(const std::string& m) : Error(ErrorKind::format, m) {}
};
struct CorruptData : Error {
  explicit CorruptData(const std::string& m) : Error(ErrorKind::corrupt, m) {}
};
struct IoError : Error {
  explicit IoError(const std::string& m) : Error(ErrorKind::io, m) {}
};
struct CudaError : Error {
  explicit CudaError(const std::string& m) : Error(ErrorKind::cuda, m) {}
};

}  // namespace csfmoe
