// Exceptions raised by every host entry point. One hierarchy so that engines
// can catch moe_error and still tell configuration, registry and CUDA failures apart.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <string_view>

#include "moerunner/core/limits.hpp"

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

// How every error message quotes a string it was given (a name from a command line, a config
// file, a policy): its first max_echoed_chars characters, with control and non-ASCII bytes
// shown as \xNN (so a NUL cannot cut what() short), and the full length when it was cut.
inline std::string echo(std::string_view s) {
  std::string out;
  const std::size_t shown = s.size() < max_echoed_chars ? s.size() : max_echoed_chars;
  for (std::size_t i = 0; i < shown; ++i) {
    const auto u = static_cast<unsigned char>(s[i]);
    if (u >= 0x20 && u < 0x7f) {
      out += s[i];
    } else {
      constexpr char digits[] = "0123456789abcdef";
      out += "\\x";
      out += digits[u >> 4];
      out += digits[u & 15];
    }
  }
  if (shown < s.size()) out += "... (" + std::to_string(s.size()) + " characters)";
  return out;
}

}  // namespace detail

}  // namespace moerunner

// Validation helper: `MOE_EXPECT(cond, where, what)` throws invalid_argument_error("where: what").
#define MOE_EXPECT(cond, where, what)                            \
  do {                                                           \
    if (!(cond)) ::moerunner::detail::throw_invalid((where), (what)); \
  } while (0)
