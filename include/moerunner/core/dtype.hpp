// Element types the library understands, with their sizes and names.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace moerunner {

enum class dtype : std::uint8_t { f32, f16, bf16, f8_e4m3, i32 };

constexpr std::size_t dtype_size(dtype t) {
  switch (t) {
    case dtype::f32: return 4;
    case dtype::f16: return 2;
    case dtype::bf16: return 2;
    case dtype::f8_e4m3: return 1;
    case dtype::i32: return 4;
  }
  return 0;
}

constexpr std::string_view dtype_name(dtype t) {
  switch (t) {
    case dtype::f32: return "f32";
    case dtype::f16: return "f16";
    case dtype::bf16: return "bf16";
    case dtype::f8_e4m3: return "f8_e4m3";
    case dtype::i32: return "i32";
  }
  return "?";
}

constexpr bool is_half_precision(dtype t) { return t == dtype::f16 || t == dtype::bf16; }
constexpr bool is_activation_dtype(dtype t) { return t == dtype::f32 || is_half_precision(t); }

}  // namespace moerunner
