// Exceptions raised by every host entry point. One hierarchy so that engines
// can catch moe_error and still tell configuration, registry and CUDA failures apart.
#pragma once

#include <stdexcept>
#include <string>

namespace moerunner {

class moe_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A shape, dtype, stride, alignment, id range or config field is wrong.
class invalid_argument_error : public moe_error {
 public:
  using moe_error::moe_error;
};

// A backend name is malformed, unknown, duplicated or registered too late.
class registry_error : public moe_error {
 public:
  using moe_error::moe_error;
};

// The chosen backend cannot do what was asked (quant format, LoRA, memory space).
class unsupported_error : public moe_error {
 public:
  using moe_error::moe_error;
};

// A CUDA runtime or library call failed.
class cuda_error : public moe_error {
 public:
  using moe_error::moe_error;
};

namespace detail {
[[noreturn]] inline void throw_invalid(const std::string& where, const std::string& what) {
  throw invalid_argument_error(where + ": " + what);
}
}  // namespace detail

}  // namespace moerunner

// Validation helper: `MOE_EXPECT(cond, where, what)` throws invalid_argument_error("where: what").
#define MOE_EXPECT(cond, where, what)                            \
  do {                                                           \
    if (!(cond)) ::moerunner::detail::throw_invalid((where), (what)); \
  } while (0)
