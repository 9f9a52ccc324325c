// Must not compile: a policy that lists fp8 weights but only runs unquantized ones
// lacks run_from_dispatch for one of its formats; caught by the registration macro.
#include "moerunner/moerunner.hpp"

struct policy_without_fp8_run {
  static constexpr std::string_view name = "without_fp8_run";
  static constexpr moerunner::memory_space tensor_space = moerunner::memory_space::host;
  using quant_infos = moerunner::quant_info_list<moerunner::unquantized_quant_info, moerunner::fp8_block_quant_info>;

  explicit policy_without_fp8_run(const moerunner::MoeRunnerConfig&) {}
  std::size_t workspace_bytes(std::int64_t) const { return 0; }
  moerunner::CombineInput run_from_dispatch(const moerunner::DispatchOutput&, const moerunner::unquantized_quant_info&,
                                            const moerunner::tensor_view& out, moerunner::workspace_view,
                                            cuda::stream_ref) {
    return {out, true};
  }
#ifdef MOERUNNER_CONTROL
  moerunner::CombineInput run_from_dispatch(const moerunner::DispatchOutput&, const moerunner::fp8_block_quant_info&,
                                            const moerunner::tensor_view& out, moerunner::workspace_view,
                                            cuda::stream_ref) {
    return {out, true};
  }
#endif
};

MOE_REGISTER_BACKEND(policy_without_fp8_run);
