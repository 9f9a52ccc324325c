// Host launch for the routing plan: carves it from the caller's workspace and builds it on
// the device (kernel_permute.cuh). No allocation, no host synchronization: capturable.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/gpu/permute.cuh needs nvcc: include it from a .cu file"
#endif

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "moerunner/core/config.hpp"
#include "moerunner/core/tensor_view.hpp"
#include "moerunner/core/types.hpp"
#include "moerunner/gpu/cuda_check.hpp"
#include "moerunner/gpu/pdl_launch.cuh"
#include "moerunner/gpu/routing_plan.hpp"
#include "moerunner/kernels/kernel_permute.cuh"

namespace moerunner::gpu {

namespace plan_detail {

// A checked plan build: the plan carved from the workspace and the kernels' arguments.
struct plan_build {
  routing_plan plan;
  kernels::plan_args args;
};

// Checks the arguments of a plan build (errors name `where` and call the workspace `name`)
// and carves the plan and the build's scratch from `workspace`; launches nothing.
inline plan_build prepare_routing_plan(const tensor_view& topk_ids, int num_experts, void* workspace,
                                       std::size_t workspace_bytes, const char* where, const char* name) {
  check::dense(topk_ids, 2, dtype::i32, memory_space::device, where, "topk_ids");
  const std::int64_t m = topk_ids.shape[0];
  const std::int64_t k = topk_ids.shape[1];
  MOE_EXPECT(k >= 1 && k <= max_top_k, where,
             "topk_ids dimension 1 (top_k) must be in [1, " + std::to_string(max_top_k) + "], got shape " +
                 topk_ids.shape_string());
  MOE_EXPECT(num_experts >= 1 && num_experts <= plan_max_experts, where,
             "num_experts must be in [1, " + std::to_string(plan_max_experts) + "], got " +
                 std::to_string(num_experts));
  const std::int64_t slots = m * k;
  MOE_EXPECT(slots <= 0x7fffffff - plan_tile_slots, where,
             "num_tokens * top_k must fit in 31 bits (rows are int32), got " + std::to_string(slots));
  const std::size_t need = routing_plan_bytes(m, static_cast<int>(k), num_experts);
  MOE_EXPECT(workspace != nullptr, where, std::string(name) + " is null");
  MOE_EXPECT(reinterpret_cast<std::uintptr_t>(workspace) % plan_piece_alignment == 0, where,
             std::string(name) + " must be " + std::to_string(plan_piece_alignment) + "-byte aligned");
  MOE_EXPECT(workspace_bytes >= need, where,
             std::string(name) + " holds " + std::to_string(workspace_bytes) + " bytes, the plan needs " +
                 std::to_string(need));

  auto* cursor = static_cast<char*>(workspace);
  auto take = [&cursor](std::size_t count) {
    auto* piece = reinterpret_cast<std::int32_t*>(cursor);
    cursor += plan_piece_bytes(count * sizeof(std::int32_t));
    return piece;
  };
  const auto e = static_cast<std::size_t>(num_experts);
  const auto n = static_cast<std::size_t>(slots);
  plan_build b;
  routing_plan& plan = b.plan;
  plan.expert_offsets = take(e + 1);
  plan.row_to_slot = take(n);
  plan.slot_to_row = take(n);
  plan.error_flag = take(1);
  plan.num_experts = num_experts;
  plan.top_k = static_cast<int>(k);
  plan.num_tokens = m;

  kernels::plan_args& a = b.args;
  a.ids = topk_ids.ptr<const std::int32_t>();
  a.num_slots = slots;
  a.num_experts = num_experts;
  a.key_bits = std::bit_width(static_cast<unsigned>(num_experts));  // id + 1 lies in [0, E]
  a.offsets = plan.expert_offsets;
  a.row_to_slot = plan.row_to_slot;
  a.slot_to_row = plan.slot_to_row;
  a.error_flag = plan.error_flag;
  if (slots > plan_single_tile_slots) {
    const std::int64_t tiles = (slots + plan_tile_slots - 1) / plan_tile_slots;
    a.num_tiles = static_cast<int>(tiles);
    a.tile_counts = take(static_cast<std::size_t>(tiles) * e);
    a.tile_errors = take(static_cast<std::size_t>(tiles));
  }
  return b;
}

// Launches the build prepared by prepare_routing_plan: one launch up to plan_single_tile_slots
// slots, three above.
inline void launch_routing_plan(const kernels::plan_args& a, cudaStream_t stream, bool dependent_launch = false) {
  constexpr unsigned threads = kernels::plan_threads;
  if (a.num_slots <= plan_single_tile_slots) {
    // A programmatic dependent of the routing kernel before it: the launch overlaps its tail.
    const auto kernel = a.num_slots <= threads       ? kernels::build_plan_single_tile_kernel<1>
                        : a.num_slots <= 4 * threads ? kernels::build_plan_single_tile_kernel<4>
                                                     : kernels::build_plan_single_tile_kernel<16>;
    launch_dependent(kernel, dim3(1), dim3(threads), 0, stream, dependent_launch, a);
    MOE_CUDA_CHECK_LAUNCH("build_plan_single_tile_kernel");
    return;
  }
  const auto tiles = static_cast<unsigned>(a.num_tiles);
  kernels::plan_count_kernel<><<<tiles, threads, 0, stream>>>(a);
  MOE_CUDA_CHECK_LAUNCH("plan_count_kernel");
  kernels::plan_scan_kernel<><<<1, kernels::plan_scan_threads, 0, stream>>>(a);
  MOE_CUDA_CHECK_LAUNCH("plan_scan_kernel");
  kernels::plan_scatter_kernel<><<<tiles, threads, 0, stream>>>(a);
  MOE_CUDA_CHECK_LAUNCH("plan_scatter_kernel");
}

}  // namespace plan_detail

// Builds the plan for topk_ids [M, k] (i32, device) over num_experts local experts in
// `workspace` (256-byte aligned, at least routing_plan_bytes(M, k, num_experts) bytes).
// Ids outside [-1, num_experts) count as -1 and set *plan.error_flag, which the build zeroes
// first; read it with read_plan_error or copy it in a later stream operation. With `status`
// (device memory) they are also added to it (moe_status: never cleared here). One launch up to
// plan_single_tile_slots slots, three above. M = 0 still writes offsets (all zero) and the flag.
inline routing_plan build_routing_plan(const tensor_view& topk_ids, int num_experts, void* workspace,
                                       std::size_t workspace_bytes, cudaStream_t stream,
                                       moe_status* status = nullptr) {
  plan_detail::plan_build b =
      plan_detail::prepare_routing_plan(topk_ids, num_experts, workspace, workspace_bytes, "gpu::build_routing_plan",
                                        "workspace");
  b.args.status = status;
  plan_detail::launch_routing_plan(b.args, stream);
  return b.plan;
}

// Checks topk_ids and the workspace as build_routing_plan does and carves the plan's pieces,
// launching nothing: for a caller whose own kernels write the plan (the decode GEMMs of
// cuda_fused write its error flag, and slot_to_row when combine reads it). Errors name `where`.
inline routing_plan carve_routing_plan(const tensor_view& topk_ids, int num_experts, void* workspace,
                                       std::size_t workspace_bytes, const char* where) {
  return plan_detail::prepare_routing_plan(topk_ids, num_experts, workspace, workspace_bytes, where, "workspace")
      .plan;
}

// Copies the plan's bad-id flag to the host. SYNCHRONIZES `stream` (so it cannot be captured
// in a graph): meant for tests and for callers that validate ids outside a captured run; under
// graphs, pass a moe_status to the build instead and read it asynchronously.
inline int read_plan_error(const routing_plan& plan, cudaStream_t stream) {
  MOE_EXPECT(plan.error_flag != nullptr, "gpu::read_plan_error", "the plan has no error flag (not built)");
  std::int32_t flag = 0;
  MOE_CUDA_CHECK(cudaMemcpyAsync(&flag, plan.error_flag, sizeof flag, cudaMemcpyDeviceToHost, stream));
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return flag;
}

}  // namespace moerunner::gpu
