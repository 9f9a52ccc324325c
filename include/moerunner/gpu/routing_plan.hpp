// The permutation a GPU runner core builds from topk_ids, on the device, with no
// host round trip. Every GPU policy shares this layout; it lives in the caller's
// workspace. "Slot" s = token * top_k + j; "row" = position in expert-sorted order.
#pragma once

#include <cstddef>
#include <cstdint>

namespace moerunner::gpu {

struct routing_plan {
  std::int32_t* expert_offsets = nullptr;  // [E_local + 1]: rows of expert e are [off[e], off[e+1]); off[E] = valid rows
  std::int32_t* row_to_slot = nullptr;     // [M * k]: rows [0, off[E]) are valid, sorted by expert, then by slot
  std::int32_t* slot_to_row = nullptr;     // [M * k]: -1 for a filtered slot (id == -1)
  std::int32_t* error_flag = nullptr;      // [1]: set non-zero on the device when an id is out of range
  int num_experts = 0;                     // E_local
  int top_k = 0;
  std::int64_t num_tokens = 0;             // M
};

// Bytes needed for a plan (plus the build's own scratch), rounded to 256-byte pieces.
std::size_t routing_plan_bytes(std::int64_t num_tokens, int top_k, int num_experts);

}  // namespace moerunner::gpu
