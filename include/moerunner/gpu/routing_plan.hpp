// The permutation a GPU runner core builds from topk_ids, on the device, with no
// host round trip. Every GPU policy shares this layout; it lives in the caller's
// workspace. "Slot" s = token * top_k + j; "row" = position in expert-sorted order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "moerunner/core/error.hpp"
#include "moerunner/core/limits.hpp"

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

// The plan build's tiling fixes its scratch size, so it lives here beside the size query
// (kernels/moerunner/kernels/kernel_permute.cuh is written against these values).
inline constexpr int plan_max_experts = max_gpu_local_experts;
inline constexpr std::int64_t plan_single_tile_slots = 4096;  // up to this many slots: one block, one launch
inline constexpr std::int64_t plan_tile_slots = 1024;         // above it: tiles of this many slots, three launches
inline constexpr std::size_t plan_piece_alignment = 256;

constexpr std::size_t plan_piece_bytes(std::size_t bytes) {
  return (bytes + plan_piece_alignment - 1) / plan_piece_alignment * plan_piece_alignment;
}

// Bytes needed for a plan (plus the build's own scratch), rounded to 256-byte pieces.
// The pieces, in order: offsets [E+1], row_to_slot [M*k], slot_to_row [M*k], error flag,
// and above plan_single_tile_slots the per-tile counts [E, tiles] and per-tile flags [tiles].
inline std::size_t routing_plan_bytes(std::int64_t num_tokens, int top_k, int num_experts) {
  MOE_EXPECT(num_tokens >= 0 && top_k >= 0 && num_experts >= 0, "gpu::routing_plan_bytes",
             "num_tokens, top_k and num_experts must not be negative");
  const auto slots = static_cast<std::size_t>(num_tokens) * static_cast<std::size_t>(top_k);
  const auto experts = static_cast<std::size_t>(num_experts);
  std::size_t bytes = plan_piece_bytes((experts + 1) * sizeof(std::int32_t)) +
                      2 * plan_piece_bytes(slots * sizeof(std::int32_t)) + plan_piece_bytes(sizeof(std::int32_t));
  if (slots > static_cast<std::size_t>(plan_single_tile_slots)) {
    const std::size_t tiles = (slots + plan_tile_slots - 1) / plan_tile_slots;
    bytes += plan_piece_bytes(tiles * experts * sizeof(std::int32_t)) + plan_piece_bytes(tiles * sizeof(std::int32_t));
  }
  return bytes;
}

// Checks that `plan` came from build_routing_plan before a kernel reads it.
inline void validate_plan(const routing_plan& plan, const char* where) {
  MOE_EXPECT(plan.num_tokens >= 0 && plan.top_k >= 1 && plan.num_experts >= 1, where,
             "the routing plan is not built (num_tokens=" + std::to_string(plan.num_tokens) +
                 ", top_k=" + std::to_string(plan.top_k) + ", num_experts=" + std::to_string(plan.num_experts) + ")");
  MOE_EXPECT(plan.expert_offsets != nullptr && plan.error_flag != nullptr &&
                 (plan.num_tokens == 0 || (plan.row_to_slot != nullptr && plan.slot_to_row != nullptr)),
             where, "the routing plan has null pointers (not built)");
}

}  // namespace moerunner::gpu
