// The values that flow between routing, dispatch, the runner core and combine.
#pragma once

#include <cstddef>
#include <cstdint>

#include "moerunner/core/tensor_view.hpp"

namespace moerunner {

// Routing result: weights [M, k] f32 and ids [M, k] i32 (-1 = filtered slot).
struct TopKOutput {
  tensor_view topk_weights;
  tensor_view topk_ids;
  // True when routed_scaling_factor is already folded into topk_weights.
  bool routed_scaling_applied = false;
};

// What a run found wrong on the device, in caller-owned memory (device memory for device
// backends), readable without a synchronization inside the run (under CUDA graph replay too).
// Runs only add to it: the caller zeroes it (cudaMemsetAsync) where a new count should start,
// for example once per step, so one word can serve every layer of a step.
struct moe_status {
  // Slots (token * top_k + j) whose expert id was outside [-1, num_local_experts), left out
  // like -1; saturates at INT32_MAX.
  std::int32_t bad_slots = 0;
  // The lowest such slot of the first run since the zeroing that had any; 0 while bad_slots is.
  std::int32_t first_bad_slot = 0;
};

// What expert-parallel dispatch in low-latency mode found on the device (ep_nccl_dispatcher), in
// caller-owned device memory, zeroed by the caller like moe_status. Its buffers hold `capacity`
// rows per (source, destination) pair; a row that does not fit is left out, never written past
// the buffer: its token then lacks that destination's experts in the output.
struct ep_status {
  // (token, destination) rows left out because a buffer was full; saturates at INT32_MAX.
  std::int32_t dropped_rows = 0;
  // The most rows one (source, destination) pair needed in a run since the zeroing: a capacity
  // at least this large drops nothing.
  std::int32_t needed_capacity = 0;
};

// What a dispatcher hands a runner core: the (local) tokens and their routing.
struct DispatchOutput {
  tensor_view hidden_states;  // [M, H]
  tensor_view hidden_scales;  // optional per-token-group scales for quantized activations
  TopKOutput topk;
  // Optional: where a backend that leaves bad expert ids out on the device (cuda_fused)
  // counts them. Backends that check ids on the host (reference, cublas_grouped) reject
  // them with invalid_argument_error instead and never write it.
  moe_status* status = nullptr;
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
