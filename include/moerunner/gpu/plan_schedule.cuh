// Host launch for the routing plan and the grouped GEMMs' M-tile schedule built together:
// the kernel that computes the expert offsets writes the tiles too, so at decode sizes the
// plan and the schedule cost one launch, where build_routing_plan + build_tile_schedule
// cost two. No allocation, no host synchronization: capturable.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/gpu/plan_schedule.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "moerunner/core/tensor_view.hpp"
#include "moerunner/gpu/grouped_gemm.cuh"
#include "moerunner/gpu/permute.cuh"
#include "moerunner/gpu/routing_plan.hpp"

namespace moerunner::gpu {

struct plan_and_schedule {
  routing_plan plan;
  tile_schedule schedule;
};

// The plan of build_routing_plan in `plan_workspace` (routing_plan_bytes(M, k, num_experts))
// and the schedule of build_tile_schedule for its M * k rows in `schedule_workspace`
// (tile_schedule_bytes(M * k, num_experts, block_m)), bit for bit, both 256-byte aligned.
// Every argument is checked before anything is launched. One launch up to
// plan_single_tile_slots slots, three above. M = 0 still writes the offsets, the flag and a
// zero tile count. With dependent_launch the one-block kernel is a programmatic dependent
// of the kernel before it (gpu::launch_dependent). Bad ids are added to `status` as
// build_routing_plan does. expert_band: as carve_tile_schedule's.
inline plan_and_schedule build_routing_plan_and_schedule(const tensor_view& topk_ids, int num_experts, int block_m,
                                                         void* plan_workspace, std::size_t plan_bytes,
                                                         void* schedule_workspace, std::size_t schedule_bytes,
                                                         cudaStream_t stream, bool dependent_launch = false,
                                                         moe_status* status = nullptr, int expert_band = 0) {
  constexpr const char* where = "gpu::build_routing_plan_and_schedule";
  plan_detail::plan_build b =
      plan_detail::prepare_routing_plan(topk_ids, num_experts, plan_workspace, plan_bytes, where, "plan_workspace");
  const std::int64_t rows = b.plan.num_tokens * b.plan.top_k;
  const tile_schedule_pieces s =
      carve_tile_schedule(num_experts, rows, block_m, schedule_workspace, schedule_bytes, where, "schedule_workspace",
                          expert_band);
  b.args.tiles = s.tiles;
  b.args.tile_count = s.count;
  b.args.block_m = block_m;
  b.args.tile_capacity = static_cast<int>(s.schedule.capacity);
  b.args.status = status;
  b.args.expert_band = expert_band;
  plan_detail::launch_routing_plan(b.args, stream, dependent_launch);
  return {b.plan, s.schedule};
}

}  // namespace moerunner::gpu
