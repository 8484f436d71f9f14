// A stand-in fuzz target that checks the replay driver itself: the input
// "crash" aborts, "throw" throws a std::exception, anything else passes.
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  if (in == "crash") std::abort();
  if (in == "throw") throw std::runtime_error("thrown by the input");
  return 0;
}
