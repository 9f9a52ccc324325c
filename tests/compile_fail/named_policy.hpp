// A complete host policy except for its name, for the registration compile-fail tests:
// each test derives from it and adds only the `name` under test.
#pragma once

#include "moerunner/moerunner.hpp"

namespace cf {

struct unnamed_policy {
  static constexpr moerunner::memory_space tensor_space = moerunner::memory_space::host;
  using quant_infos = moerunner::quant_info_list<moerunner::unquantized_quant_info>;

  explicit unnamed_policy(const moerunner::MoeRunnerConfig&) {}
  std::size_t workspace_bytes(std::int64_t) const { return 0; }
  moerunner::CombineInput run_from_dispatch(const moerunner::DispatchOutput&, const moerunner::unquantized_quant_info&,
                                            const moerunner::tensor_view& out, moerunner::workspace_view,
                                            cuda::stream_ref) {
    return {out, true};
  }
};

}  // namespace cf
