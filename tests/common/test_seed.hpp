// Fresh seeds for property tests. Every test draws a new seed per run (or
// takes CSFMOE_TEST_SEED from the environment to reproduce a failure) and
// attaches it to every assertion through SCOPED_TRACE.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>

namespace csfmoe::testing {

inline std::uint64_t fresh_seed() {
  if (const char* env = std::getenv("CSFMOE_TEST_SEED")) return std::strtoull(env, nullptr, 0);
  std::random_device rd;
  return (std::uint64_t{rd()} << 32) ^ rd();
}

inline std::string seed_note(std::uint64_t seed) {
  return "seed " + std::to_string(seed) + " (rerun with CSFMOE_TEST_SEED=" + std::to_string(seed) + ")";
}

}  // namespace csfmoe::testing

// Draws a fresh seed into `var` and traces it for every failure in scope.
#define CSFMOE_SEEDED(var)                                   \
  const std::uint64_t var = ::csfmoe::testing::fresh_seed(); \
  SCOPED_TRACE(::csfmoe::testing::seed_note(var))
