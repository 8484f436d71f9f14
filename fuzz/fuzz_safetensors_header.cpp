// Fuzzer for the safetensors header parser (st::parse_header) and, through an
// in-memory file, st::File::open.
//
// Input: the bytes of a whole .safetensors file (8-byte length, JSON, data).
// Properties: every rejection is a FormatError; an accepted header describes
// tensors that lie inside the data section, whose byte counts match shape x
// dtype, that do not overlap and have distinct names; writing the accepted
// header back out (Writer::header_json) and parsing it again gives the same
// tensors and metadata.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>

#include "csfmoe/errors.hpp"
#include "csfmoe/safetensors.hpp"

using namespace csfmoe;

namespace {

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fuzz_safetensors_header: property violated: %s\n", what);
  std::abort();
}

void check_header(const st::Header& h, std::uint64_t data_size) {
  std::set<std::string> names;
  for (const auto& t : h.tensors) {
    if (!names.insert(t.name).second) fail("duplicate tensor name accepted");
    if (t.begin > t.end || t.end > data_size) fail("tensor outside the data section accepted");
    unsigned __int128 want = st::dtype_size(t.dtype);
    for (auto d : t.shape) want *= d;
    if (want != t.nbytes()) fail("byte count does not match shape x dtype");
  }
  for (const auto& a : h.tensors)
    for (const auto& b : h.tensors)
      if (&a != &b && a.nbytes() && b.nbytes() && a.begin < b.end && b.begin < a.end)
        fail("overlap accepted");
  const std::string again = st::Writer::header_json(h.tensors, h.metadata);
  const st::Header h2 = st::parse_header(again, data_size, "rewritten");
  if (h2.tensors.size() != h.tensors.size() || h2.metadata != h.metadata) fail("rewritten header differs");
  for (std::size_t i = 0; i < h.tensors.size(); ++i) {
    const auto &a = h.tensors[i], &b = h2.tensors[i];
    if (a.name != b.name || a.dtype != b.dtype || a.shape != b.shape || a.begin != b.begin || a.end != b.end)
      fail("rewritten header differs");
  }
}

int memfd() {
  static const int fd = ::memfd_create("fuzz_st", MFD_CLOEXEC);
  if (fd < 0) fail("memfd_create");
  return fd;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // 1. The parser alone, on the JSON part with the data size the file implies.
  if (size >= 8) {
    std::uint64_t n = 0;
    std::memcpy(&n, data, 8);
    const std::uint64_t json_len = std::min<std::uint64_t>(n, size - 8);
    const std::uint64_t data_size = size - 8 - json_len;
    try {
      const st::Header h = st::parse_header(
          std::string_view(reinterpret_cast<const char*>(data) + 8, static_cast<std::size_t>(json_len)),
          data_size, "fuzz");
      check_header(h, data_size);
    } catch (const FormatError&) {
    }
  }
  // 2. The same bytes as a file (length checks, mmap bounds).
  const int fd = memfd();
  if (::ftruncate(fd, 0) != 0 || (size && ::pwrite(fd, data, size, 0) != static_cast<ssize_t>(size)))
    fail("memfd write");
  try {
    const st::File f = st::File::open("/proc/self/fd/" + std::to_string(fd));
    check_header(f.header(), f.data_size());
    std::uint64_t sum = 0;
    for (const auto& t : f.tensors())
      for (auto b : f.data(t)) sum += b;  // touch every byte: ASan catches an out-of-map span
    (void)sum;
  } catch (const FormatError&) {
  }
  return 0;
}
