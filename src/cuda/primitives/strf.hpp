// A tiny "{}" formatter for code compiled by nvcc: fmt's compile-time format
// checks do not build there. Supports "{}" and "{:#x}" (hex with 0x).
#pragma once

#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>

namespace csfmoe::cuda_detail {

inline void strf_step(std::ostringstream& os, std::string_view f) { os << f; }

template <class T, class... A>
void strf_step(std::ostringstream& os, std::string_view f, const T& v, const A&... rest) {
  const std::size_t at = f.find('{');
  const std::size_t end = at == std::string_view::npos ? at : f.find('}', at);
  if (end == std::string_view::npos) return strf_step(os, f);
  os << f.substr(0, at);
  if constexpr (std::is_arithmetic_v<T>) {  // unary +: 8-bit integers print as numbers
    if (f.substr(at, end - at + 1) == "{:#x}")
      os << "0x" << std::hex << +v << std::dec;
    else
      os << +v;
  } else {
    os << v;
  }
  strf_step(os, f.substr(end + 1), rest...);
}

template <class... A>
std::string strf(std::string_view f, const A&... a) {
  std::ostringstream os;
  strf_step(os, f, a...);
  return os.str();
}

}  // namespace csfmoe::cuda_detail
