// Must not compile: a policy without `name` is not a DispatchRunnerCore.
#include "moerunner/moerunner.hpp"

struct policy_without_name {
#ifdef MOERUNNER_CONTROL
  static constexpr std::string_view name = "without_name";
#endif
  static constexpr moerunner::memory_space tensor_space = moerunner::memory_space::host;
  using quant_infos = moerunner::quant_info_list<moerunner::unquantized_quant_info>;

  explicit policy_without_name(const moerunner::MoeRunnerConfig&) {}
  std::size_t workspace_bytes(std::int64_t) const { return 0; }
  moerunner::CombineInput run_from_dispatch(const moerunner::DispatchOutput&, const moerunner::unquantized_quant_info&,
                                            const moerunner::tensor_view& out, moerunner::workspace_view,
                                            cuda::stream_ref) {
    return {out, true};
  }
};

static_assert(moerunner::explain_dispatch_runner_core<policy_without_name>());
