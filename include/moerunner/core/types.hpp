// The values that flow between routing, dispatch, the runner core and combine.
#pragma once

#include <cstddef>

#include "moerunner/core/tensor_view.hpp"

namespace moerunner {

// Routing result: weights [M, k] f32 and ids [M, k] i32 (-1 = filtered slot).
struct TopKOutput {
  tensor_view topk_weights;
  tensor_view topk_ids;
  // True when routed_scaling_factor is already folded into topk_weights.
  bool routed_scaling_applied = false;
};

// What a dispatcher hands a runner core: the (local) tokens and their routing.
struct DispatchOutput {
  tensor_view hidden_states;  // [M, H]
  tensor_view hidden_scales;  // optional per-token-group scales for quantized activations
  TopKOutput topk;
  std::int64_t num_tokens() const { return hidden_states.rank ? hidden_states.shape[0] : 0; }
};

// What a runner core hands back for combine: [M, H] when combined, [M, k, H] otherwise.
struct CombineInput {
  tensor_view hidden_states;
  bool combined = true;
};

// Caller-owned device (or host) scratch memory; its size comes from the workspace query.
struct workspace_view {
  void* data = nullptr;
  std::size_t bytes = 0;
};

}  // namespace moerunner
