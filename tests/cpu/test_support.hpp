// Helpers shared by the CPU tests: sentinel checks, independent float decoders and small
// host policies whose names are template arguments (host tensors and random fills: tests/common).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <cuda/stream_ref>

#include "moerunner/core/concepts.hpp"
#include "moerunner/core/host_float.hpp"
#include "moerunner/core/tensor_view.hpp"
#include "moerunner/lora/lora.hpp"
#include "moerunner/policies/reference_policy.hpp"
#include "../common/test_seed.hpp"
#include "../common/test_tensors.hpp"

namespace moerunner::cpu_test {

// A string usable as a template argument, so each test policy can carry its own name.
template <std::size_t N>
struct fixed_string {
  char chars[N]{};
  std::size_t size = N - 1;
  constexpr fixed_string(const char (&s)[N]) {
    for (std::size_t i = 0; i < N; ++i) chars[i] = s[i];
  }
  constexpr std::string_view view() const { return {chars, size}; }
};

using test::fill_uniform;
using test::host_tensor;
using test::set_element;

// Fills every byte with a pattern no computation produces, so untouched memory is recognizable.
inline void fill_sentinel(host_tensor& t) {
  auto* p = static_cast<unsigned char*>(t.view.data);
  for (std::size_t i = 0; i < t.view.bytes(); ++i) p[i] = static_cast<unsigned char>(0xA5 ^ (i * 37));
}

// Decoders written from the format definitions, independent of host_float's.
inline double decode_bf16(std::uint16_t b) {
  const int sign = b >> 15, exp = (b >> 7) & 0xff, man = b & 0x7f;
  double v = exp == 0 ? std::ldexp(man, -133) : std::ldexp(128 + man, exp - 134);
  if (exp == 0xff) v = man ? NAN : INFINITY;
  return sign ? -v : v;
}
inline double decode_f16(std::uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  double v = exp == 0 ? std::ldexp(man, -24) : std::ldexp(1024 + man, exp - 25);
  if (exp == 0x1f) v = man ? NAN : INFINITY;
  return sign ? -v : v;
}
inline double decode_e4m3(std::uint8_t q) {
  const int sign = q >> 7, exp = (q >> 3) & 0xf, man = q & 0x7;
  if (exp == 15 && man == 7) return NAN;
  const double v = exp == 0 ? std::ldexp(man, -9) : std::ldexp(8 + man, exp - 10);
  return sign ? -v : v;
}

// Nearest e4m3 value (ties to the even code), saturating at +-448: found by search, not bit tricks.
inline std::uint8_t encode_e4m3_by_search(double x) {
  if (std::isnan(x)) return 0x7f;
  const std::uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const double a = std::fabs(x);
  int best = 0;
  for (int c = 1; c <= 0x7e; ++c) {
    const double dc = std::fabs(decode_e4m3(static_cast<std::uint8_t>(c)) - a);
    const double db = std::fabs(decode_e4m3(static_cast<std::uint8_t>(best)) - a);
    if (dc < db || (dc == db && (c & 1) == 0)) best = c;
  }
  return static_cast<std::uint8_t>(sign | best);
}

inline double decode(const tensor_view& t, std::int64_t i) {
  switch (t.type) {
    case dtype::f32: return t.ptr<const float>()[i];
    case dtype::bf16: return decode_bf16(t.ptr<const std::uint16_t>()[i]);
    case dtype::f16: return decode_f16(t.ptr<const std::uint16_t>()[i]);
    case dtype::f8_e4m3: return decode_e4m3(t.ptr<const std::uint8_t>()[i]);
    case dtype::i32: return t.ptr<const std::int32_t>()[i];
  }
  return NAN;
}

inline cuda::stream_ref host_stream() { return cuda::stream_ref{}; }

// A host backend computing the reference math; counts its runs and what it was handed.
// Name, workspace need and LoRA capability are template arguments so tests can make
// as many distinct policy types as they need.
template <fixed_string Name, std::size_t WorkspacePerToken = 0, bool Lora = false>
class echo_policy {
 public:
  static constexpr std::string_view name = Name.view();
  static constexpr memory_space tensor_space = memory_space::host;
  static constexpr bool supports_lora = Lora;
  using quant_infos = quant_info_list<unquantized_quant_info>;

  struct counters {
    int runs = 0;
    int lora_runs = 0;
    std::string last_lora_backend;
    float last_lora_scaling = 0.0f;
    const void* last_workspace = nullptr;
  };
  static counters& stats() {
    static counters c;
    return c;
  }

  explicit echo_policy(const MoeRunnerConfig& cfg) : ref_(cfg) {}
  std::size_t workspace_bytes(std::int64_t num_tokens) const {
    return WorkspacePerToken * static_cast<std::size_t>(num_tokens);
  }

  CombineInput run_from_dispatch(const DispatchOutput& d, const unquantized_quant_info& q, const tensor_view& out,
                                 workspace_view ws, cuda::stream_ref s) {
    ++stats().runs;
    stats().last_workspace = ws.data;
    return ref_.run_from_dispatch(d, q, out, ws, s);
  }

  CombineInput run_from_dispatch(const DispatchOutput& d, const unquantized_quant_info& q, const tensor_view& out,
                                 workspace_view ws, cuda::stream_ref s, const lora_hooks& hooks)
    requires Lora
  {
    ++stats().lora_runs;
    stats().last_lora_backend = std::string(hooks.backend.name());
    stats().last_lora_scaling = hooks.weights.scaling;
    return run_from_dispatch(d, q, out, ws, s);
  }

 private:
  reference_policy ref_;
};

}  // namespace moerunner::cpu_test
