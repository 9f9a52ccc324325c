// A policy defined in a header and registered in that header: every translation unit
// that includes it registers it again from the same file and line, which the registry
// treats as one registration.
#pragma once

#include "moerunner/moerunner.hpp"
#include "moerunner/registry/register_backend.hpp"

namespace two_tu {

class shared_header_policy {
 public:
  static constexpr std::string_view name = "two_tu_shared";
  static constexpr moerunner::memory_space tensor_space = moerunner::memory_space::host;
  using quant_infos = moerunner::quant_info_list<moerunner::unquantized_quant_info>;

  explicit shared_header_policy(const moerunner::MoeRunnerConfig& cfg) : ref_(cfg) {}
  std::size_t workspace_bytes(std::int64_t) const { return 0; }
  moerunner::CombineInput run_from_dispatch(const moerunner::DispatchOutput& d,
                                            const moerunner::unquantized_quant_info& q,
                                            const moerunner::tensor_view& out, moerunner::workspace_view ws,
                                            cuda::stream_ref s) const {
    return ref_.run_from_dispatch(d, q, out, ws, s);
  }

 private:
  moerunner::reference_policy ref_;
};

inline constexpr int shared_registration_line = __LINE__ + 1;
MOE_REGISTER_BACKEND(shared_header_policy);

// What each translation unit reports about itself, for main to compare.
struct tu_report {
  const moerunner::backend_registry* registry;
  const void* shared_key;
  const void* own_key;
  std::string_view own_name;
  bool runs_reference_equal;  // its runner gave the same numbers as a direct reference call
};

tu_report report_a();
tu_report report_b();

}  // namespace two_tu
