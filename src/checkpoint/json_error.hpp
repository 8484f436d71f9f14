// What a JSON parse error says about untrusted bytes (internal): where it
// stopped, never what it read. nlohmann's messages quote the bytes last read
// ("last read: '...'"), and the file may be one that was refused or that
// holds secrets (docs/security.md, "What is checked").
#pragma once

#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <string>

namespace csfmoe::detail {

inline std::string json_error_text(const nlohmann::json::exception& e) {
  if (const auto* p = dynamic_cast<const nlohmann::json::parse_error*>(&e))
    return fmt::format("not valid JSON (parse error at byte {})", p->byte);
  return fmt::format("not valid JSON (error {})", e.id);
}

}  // namespace csfmoe::detail
