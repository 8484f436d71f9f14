// Fuzzer for the CSF container reader: a whole compressed .safetensors file
// is opened, its descriptor and restore record parsed, every CSF tensor's
// parts loaded, validated and decoded, and the original rebuilt (without
// writing it) with every CRC checked: verify_checkpoint and
// inspect_checkpoint on an in-memory file.
//
// Properties: a bad file is rejected with a typed csfmoe::Error
// (FormatError, CorruptData, Unsupported; never a crash, an out-of-bounds
// access or another exception type), and the reader allocates no more than
// the file's contents justify (libFuzzer's -rss_limit_mb and
// -malloc_limit_mb catch a header that talks it into a huge buffer).
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "checkpoint/container.hpp"
#include "csfmoe/checkpoint.hpp"
#include "csfmoe/errors.hpp"
#include "csfmoe/safetensors.hpp"

using namespace csfmoe;

namespace {

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fuzz_container: property violated: %s\n", what);
  std::abort();
}

int memfd() {
  static const int fd = ::memfd_create("fuzz_container", MFD_CLOEXEC);
  if (fd < 0) fail("memfd_create");
  return fd;
}

bool expected(const Error& e) {
  return e.kind() == ErrorKind::format || e.kind() == ErrorKind::corrupt ||
         e.kind() == ErrorKind::unsupported;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const int fd = memfd();
  if (::ftruncate(fd, 0) != 0 || (size && ::pwrite(fd, data, size, 0) != static_cast<ssize_t>(size)))
    fail("memfd write");
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  CompressOptions o;
  o.threads = 1;
  bool container = false;
  try {
    const st::File f = st::File::open(path);
    container = detail::get_container_metadata(f.header().metadata, path).has_value();
  } catch (const Error& e) {
    if (!expected(e)) fail("unexpected error kind while opening");
    return 0;
  }
  if (container != is_csf_container(path)) fail("is_csf_container disagrees with the descriptor");
  try {
    (void)inspect_checkpoint(path, o);
  } catch (const Error& e) {
    if (!expected(e)) fail("unexpected error kind from inspect");
  }
  if (!container) return 0;
  try {
    const CheckpointReport r = verify_checkpoint(path, o);
    // A file that verifies rebuilds an original whose CSF tensors are all present.
    for (const auto& t : r.tensors)
      if (t.action == TensorAction::csf && !t.format) fail("CSF tensor without a format in the report");
  } catch (const Error& e) {
    if (!expected(e)) fail("unexpected error kind from verify");
  }
  return 0;
}
