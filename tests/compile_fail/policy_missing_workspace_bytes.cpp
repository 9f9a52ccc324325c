// Must not compile: a policy without the workspace query is not a DispatchRunnerCore,
// here caught where a runner lists it.
#include "moerunner/moerunner.hpp"

struct policy_without_workspace_bytes {
  static constexpr std::string_view name = "without_workspace_bytes";
  static constexpr moerunner::memory_space tensor_space = moerunner::memory_space::host;
  using quant_infos = moerunner::quant_info_list<moerunner::unquantized_quant_info>;

  explicit policy_without_workspace_bytes(const moerunner::MoeRunnerConfig&) {}
#ifdef MOERUNNER_CONTROL
  std::size_t workspace_bytes(std::int64_t) const { return 0; }
#endif
  moerunner::CombineInput run_from_dispatch(const moerunner::DispatchOutput&, const moerunner::unquantized_quant_info&,
                                            const moerunner::tensor_view& out, moerunner::workspace_view,
                                            cuda::stream_ref) {
    return {out, true};
  }
};

std::size_t runner_size() { return sizeof(moerunner::MoeRunner<moerunner::reference_policy, policy_without_workspace_bytes>); }
