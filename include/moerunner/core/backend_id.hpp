// backend_id: the value that names a backend, shared by built-in and registered ones.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <string>
#include <string_view>

#include "moerunner/core/builtin_backends.hpp"
#include "moerunner/core/limits.hpp"

namespace moerunner {

// Messages here and in MOE_REGISTER_BACKEND's static_assert are literals (compile-time text).
static_assert(max_backend_name_length == 63, "the backend name messages quote the limit: update them with it");

// Returns an empty view when `name` is acceptable, else why not. constexpr so that the
// registration macro rejects a malformed Policy::name at compile time.
constexpr std::string_view backend_name_problem(std::string_view name) {
  if (name.empty()) return "a backend name must not be empty";
  if (name.size() > max_backend_name_length) return "a backend name must be at most 63 characters";
  for (char c : name) {
    // Printable ASCII without spaces: names travel through command lines and logs.
    if (c <= ' ' || c > '~') return "a backend name may only hold printable ASCII characters without spaces";
  }
  return {};
}

class backend_id {
 public:
  constexpr backend_id() = default;
  // Unchecked: callers validate with backend_name_problem (the registry always does).
  constexpr explicit backend_id(std::string_view name) : len_(static_cast<unsigned char>(std::min(name.size(), max_backend_name_length))) {
    for (std::size_t i = 0; i < len_; ++i) buf_[i] = name[i];
  }

  constexpr std::string_view name() const { return {buf_.data(), len_}; }
  constexpr bool empty() const { return len_ == 0; }
  friend constexpr bool operator==(const backend_id& a, const backend_id& b) { return a.name() == b.name(); }
  friend constexpr auto operator<=>(const backend_id& a, const backend_id& b) { return a.name() <=> b.name(); }

  constexpr bool is_builtin() const;

  // is_reference(), is_cuda_fused(), ...: one per built-in, generated from the list.
#define MOERUNNER_X(ident, str, doc) \
  constexpr bool is_##ident() const { return name() == std::string_view(str); }
  MOERUNNER_BUILTIN_BACKENDS(MOERUNNER_X)
#undef MOERUNNER_X

 private:
  std::array<char, max_backend_name_length> buf_{};
  unsigned char len_ = 0;
};

namespace builtin {
#define MOERUNNER_X(ident, str, doc) inline constexpr backend_id ident{std::string_view(str)};
MOERUNNER_BUILTIN_BACKENDS(MOERUNNER_X)
#undef MOERUNNER_X

struct builtin_info {
  backend_id id;
  std::string_view description;
};

inline constexpr std::array all = {
#define MOERUNNER_X(ident, str, doc) builtin_info{ident, std::string_view(doc)},
    MOERUNNER_BUILTIN_BACKENDS(MOERUNNER_X)
#undef MOERUNNER_X
};
}  // namespace builtin

constexpr bool backend_id::is_builtin() const {
  for (const auto& b : builtin::all)
    if (b.id == *this) return true;
  return false;
}

constexpr bool is_builtin_name(std::string_view name) {
  for (const auto& b : builtin::all)
    if (b.id.name() == name) return true;
  return false;
}

}  // namespace moerunner
