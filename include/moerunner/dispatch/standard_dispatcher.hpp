// Standard (single-GPU) dispatch and combine: tokens stay where they are; the runner
// core permutes internally and combines each token's k rows before returning.
#pragma once

#include "moerunner/core/config.hpp"
#include "moerunner/core/types.hpp"

namespace moerunner {

class standard_dispatcher {
 public:
  explicit standard_dispatcher(const MoeRunnerConfig& cfg) : cfg_(cfg) {}

  DispatchOutput dispatch(const tensor_view& hidden_states, const TopKOutput& topk,
                          const tensor_view& hidden_scales = {}) const {
    check::rank(hidden_states, 2, "standard_dispatcher::dispatch", "hidden_states");
    check::dim(hidden_states, 1, cfg_.hidden_size(), "standard_dispatcher::dispatch", "hidden_states");
    return {hidden_states, hidden_scales, topk};
  }

  // The runner core already reduced each token's rows; combine hands back the output.
  tensor_view combine(const CombineInput& c) const { return c.hidden_states; }

 private:
  MoeRunnerConfig cfg_;
};

}  // namespace moerunner
