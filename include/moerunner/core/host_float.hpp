// Bit-exact host conversions for bf16, fp16 and fp8 e4m3, so the CPU reference
// needs no CUDA headers and rounds exactly as the device intrinsics do (RNE).
#pragma once

#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

namespace moerunner::host_float {

inline float bf16_to_float(std::uint16_t b) { return std::bit_cast<float>(std::uint32_t{b} << 16); }

inline std::uint16_t float_to_bf16(float f) {
  std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  if (std::isnan(f)) return static_cast<std::uint16_t>((u >> 16) | 0x40);  // keep NaN quiet
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

inline float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t{h & 0x8000u} << 16;
  const std::uint32_t exp = (h >> 10) & 0x1f;
  const std::uint32_t man = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: value = man * 2^-24
    const float v = std::ldexp(static_cast<float>(man), -24);
    return sign ? -v : v;
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (man << 13));
  return std::bit_cast<float>(sign | ((exp + 112) << 23) | (man << 13));
}

inline std::uint16_t float_to_half(float f) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  if (std::isnan(f)) return static_cast<std::uint16_t>(sign | 0x7e00u);
  const float a = std::fabs(f);
  if (a >= 65520.0f) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (a < 6.103515625e-05f) {  // subnormal range: quantize to multiples of 2^-24 with RNE
    const float q = std::nearbyint(a * 16777216.0f);
    return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(q));
  }
  std::uint32_t m = u & 0x7fffffffu;
  m += 0xfffu + ((m >> 13) & 1u);
  return static_cast<std::uint16_t>(sign | ((m >> 13) - (112u << 10)));
}

// fp8 e4m3 (OCP "fn": no infinities, 0x7f/0xff are NaN, max 448).
inline float e4m3_to_float(std::uint8_t v) {
  const float sign = (v & 0x80) ? -1.0f : 1.0f;
  const int exp = (v >> 3) & 0xf;
  const int man = v & 0x7;
  if (exp == 15 && man == 7) return std::numeric_limits<float>::quiet_NaN();
  if (exp == 0) return sign * std::ldexp(static_cast<float>(man), -9);
  return sign * std::ldexp(1.0f + static_cast<float>(man) / 8.0f, exp - 7);
}

// e4m3_to_float of every byte, for decoding whole weight rows (e4m3_to_float's ldexp costs
// tens of nanoseconds, which a reference pass over a model's weights pays billions of times).
inline const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int v = 0; v < 256; ++v) t[v] = e4m3_to_float(static_cast<std::uint8_t>(v));
    return t;
  }();
  return table;
}

// Saturating RNE conversion, as __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3).
inline std::uint8_t float_to_e4m3(float f) {
  if (std::isnan(f)) return 0x7f;
  const std::uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  float a = std::fabs(f);
  if (a >= 448.0f) return static_cast<std::uint8_t>(sign | 0x7e);
  if (a < std::ldexp(1.0f, -6)) {  // subnormal: multiples of 2^-9
    const int q = static_cast<int>(std::nearbyint(std::ldexp(a, 9)));
    return static_cast<std::uint8_t>(sign | q);  // q == 8 lands exactly on the smallest normal
  }
  int e = 0;
  const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  int exp = e - 1 + 7;
  int man = static_cast<int>(std::nearbyint((m * 2.0f - 1.0f) * 8.0f));
  if (man == 8) { man = 0; ++exp; }
  if (exp > 15 || (exp == 15 && man == 7)) return static_cast<std::uint8_t>(sign | 0x7e);
  return static_cast<std::uint8_t>(sign | (exp << 3) | man);
}

}  // namespace moerunner::host_float
