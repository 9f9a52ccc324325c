// Must not compile: a policy whose move can throw (a runner keeps its policy in a variant
// and moves it with the layer).
#include "moerunner/moerunner.hpp"

struct policy_with_throwing_move {
  static constexpr std::string_view name = "throwing_move";
  static constexpr moerunner::memory_space tensor_space = moerunner::memory_space::host;
  using quant_infos = moerunner::quant_info_list<moerunner::unquantized_quant_info>;

  explicit policy_with_throwing_move(const moerunner::MoeRunnerConfig&) {}
#ifdef MOERUNNER_CONTROL
  policy_with_throwing_move(policy_with_throwing_move&&) noexcept {}
#else
  policy_with_throwing_move(policy_with_throwing_move&&) noexcept(false) {}
#endif
  std::size_t workspace_bytes(std::int64_t) const { return 0; }
  moerunner::CombineInput run_from_dispatch(const moerunner::DispatchOutput&, const moerunner::unquantized_quant_info&,
                                            const moerunner::tensor_view& out, moerunner::workspace_view,
                                            cuda::stream_ref) {
    return {out, true};
  }
};

static_assert(moerunner::explain_dispatch_runner_core<policy_with_throwing_move>());
