// Must not compile: fp8 block weights cannot feed a backend that consumes only
// unquantized weights, and the static pair says so.
#include "moerunner/moerunner.hpp"

struct unquantized_only_policy {
  static constexpr std::string_view name = "unquantized_only";
  static constexpr moerunner::memory_space tensor_space = moerunner::memory_space::host;
  using quant_infos = moerunner::quant_info_list<moerunner::unquantized_quant_info>;

  explicit unquantized_only_policy(const moerunner::MoeRunnerConfig&) {}
  std::size_t workspace_bytes(std::int64_t) const { return 0; }
  moerunner::CombineInput run_from_dispatch(const moerunner::DispatchOutput&, const moerunner::unquantized_quant_info&,
                                            const moerunner::tensor_view& out, moerunner::workspace_view,
                                            cuda::stream_ref) {
    return {out, true};
  }
};
static_assert(moerunner::explain_dispatch_runner_core<unquantized_only_policy>());

#ifdef MOERUNNER_CONTROL
using method = moerunner::unquantized_method;
#else
using method = moerunner::fp8_block_method;
#endif

auto quant_info_for(const moerunner::moe_weights& weights) {
  return moerunner::get_moe_quant_info<unquantized_only_policy>(method{}, weights);
}
