// The seed of a test's random data: fresh on every run, so that each run checks new data, and
// fixed by the environment variable MOERUNNER_TEST_SEED to replay a failure (tests CAPTURE it).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <random>

namespace moerunner::test {

inline std::uint32_t test_seed() {
  if (const char* s = std::getenv("MOERUNNER_TEST_SEED")) return static_cast<std::uint32_t>(std::strtoul(s, nullptr, 10));
  return std::random_device{}();
}

}  // namespace moerunner::test
