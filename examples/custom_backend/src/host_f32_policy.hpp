// host_f32: a backend written outside moerunner, using only its public headers.
//
// It runs the same math as the reference backend on the host, organised the way a
// GPU backend is: token slots grouped by expert, one expert's weights at a time, f32
// accumulation; its scratch memory comes from the caller's workspace. It consumes
// unquantized weights (f32, f16, bf16) and is registered as "host_f32" in
// host_f32_backend.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include "moerunner/moerunner.hpp"

namespace custom_backend {

class host_f32_policy {
 public:
  static constexpr std::string_view name = "host_f32";
  static constexpr moerunner::memory_space tensor_space = moerunner::memory_space::host;
  using quant_infos = moerunner::quant_info_list<moerunner::unquantized_quant_info>;

  explicit host_f32_policy(const moerunner::MoeRunnerConfig& cfg) : cfg_(cfg) {}

  // f32 output accumulators ([M, H], or [M, k, H] with no_combine) plus one activation row.
  std::size_t workspace_bytes(std::int64_t num_tokens) const;

  moerunner::CombineInput run_from_dispatch(const moerunner::DispatchOutput& d,
                                            const moerunner::unquantized_quant_info& q,
                                            const moerunner::tensor_view& out, moerunner::workspace_view ws,
                                            cuda::stream_ref stream);

 private:
  moerunner::MoeRunnerConfig cfg_;
};

// The contract, checked where the policy is defined (each missing member is named).
static_assert(moerunner::explain_dispatch_runner_core<host_f32_policy>());
static_assert(!std::is_polymorphic_v<host_f32_policy>);

}  // namespace custom_backend
