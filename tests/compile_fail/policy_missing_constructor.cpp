// Must not compile: a policy that cannot be built from the runner's config.
#include "moerunner/moerunner.hpp"

struct policy_without_constructor {
  static constexpr std::string_view name = "without_constructor";
  static constexpr moerunner::memory_space tensor_space = moerunner::memory_space::host;
  using quant_infos = moerunner::quant_info_list<moerunner::unquantized_quant_info>;

#ifdef MOERUNNER_CONTROL
  explicit policy_without_constructor(const moerunner::MoeRunnerConfig&) {}
#else
  explicit policy_without_constructor(int) {}
#endif
  std::size_t workspace_bytes(std::int64_t) const { return 0; }
  moerunner::CombineInput run_from_dispatch(const moerunner::DispatchOutput&, const moerunner::unquantized_quant_info&,
                                            const moerunner::tensor_view& out, moerunner::workspace_view,
                                            cuda::stream_ref) {
    return {out, true};
  }
};

static_assert(moerunner::explain_dispatch_runner_core<policy_without_constructor>());
