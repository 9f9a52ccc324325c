// Device code: the routing plan's row order and M-tile schedule for a handful of slots, built
// by every CTA of a decode GEMM in its own shared memory from topk_ids, so that no plan kernel
// runs before the GEMMs. The result is the plan kernel's (kernel_permute.cuh) for those ids:
// rows sorted by (expert, slot), tiles of block_m rows in expert order, ids outside
// [0, num_experts) left out (and an id other than -1 reported in *error_flag and the caller's
// moe_status when given). One CTA may also write the plan's slot_to_row (-1 for a slot left
// out), which the deterministic combine reads after the GEMMs.
//
// Each slot has a thread; with at most local_plan_max_slots slots, counting by a loop over the
// other slots in shared memory (routing/plan_rules.hpp) is a few hundred cycles, where a scan
// would cost barriers.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/kernels/kernel_local_plan.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstdint>

#include "moerunner/gpu/grouped_gemm_tuning.hpp"
#include "moerunner/kernels/bad_slot_report.cuh"
#include "moerunner/routing/plan_rules.hpp"

namespace moerunner::kernels {

inline constexpr int local_plan_max_slots = gpu::local_plan_max_slots;

struct local_plan {
  gpu::moe_m_tile tiles[local_plan_max_slots];  // at most one tile per slot
  std::int32_t row_to_slot[local_plan_max_slots];
  std::int32_t expert[local_plan_max_slots];  // per slot, -1 when left out
  std::int32_t count[local_plan_max_slots];   // per slot: its expert's rows at the expert's first slot, else 0
  std::int32_t before[local_plan_max_slots];  // per slot: rows of smaller experts, at the expert's first slot
  std::int32_t tile_count;
};

// Every thread of the block calls it; thread t takes slots t, t + THREADS, ... (one each where
// THREADS >= slots). `ids` is read through L2 (written by an earlier kernel). Ends with a
// barrier: the plan is then visible to the whole block. `error_flag`, `status` and
// `slot_to_row` (global, or null) are written by the calling block; `status` only with
// `error_flag`.
template <int THREADS>
__device__ __forceinline__ void build_local_plan(const std::int32_t* ids, int slots, int num_experts, int block_m,
                                                 local_plan& s, std::int32_t* error_flag, moe_status* status,
                                                 std::int32_t* slot_to_row) {
  const int first_slot = static_cast<int>(threadIdx.x);
  bool bad = false;
  for (int t = first_slot; t < slots; t += THREADS) {
    const int id = __ldcg(ids + t);
    s.expert[t] = id >= 0 && id < num_experts ? id : -1;
    bad = bad || bad_expert_id(id, num_experts);
  }
  if (error_flag != nullptr) {
    const int any_bad = __syncthreads_or(bad ? 1 : 0);
    if (first_slot == 0) *error_flag = any_bad != 0 ? 1 : 0;
    if (first_slot == 0 && any_bad != 0 && status != nullptr) {  // at most local_plan_max_slots ids to reread
      int count = 0, first = 0;
      for (int slot = 0; slot < slots; ++slot)
        if (bad_expert_id(__ldcg(ids + slot), num_experts)) {
          first = count == 0 ? slot : first;
          ++count;
        }
      report_bad_slots(status, count, first);
    }
  } else {
    __syncthreads();
  }

  // Each slot's row and its expert's rows (routing/plan_rules.hpp, as the host test checks them).
  for (int t = first_slot; t < slots; t += THREADS) {
    const int e = s.expert[t];
    routing::slot_place at;
    if (e >= 0) {
      at = routing::place_of_slot(s.expert, slots, t);
      s.row_to_slot[at.before + at.rank] = t;
    }
    if (slot_to_row != nullptr) slot_to_row[t] = e >= 0 ? at.before + at.rank : -1;
    s.count[t] = e >= 0 && at.rank == 0 ? at.count : 0;
    s.before[t] = at.before;
  }
  __syncthreads();

  // An expert's first slot writes its tiles after those of the smaller experts.
  for (int t = first_slot; t < slots; t += THREADS) {
    const int e = s.expert[t], count = s.count[t];
    if (count == 0) continue;  // not an expert's first slot (every expert there has a row)
    const routing::slot_place at{s.before[t], 0, count};
    const int first_tile = routing::first_tile_of(s.expert, s.count, slots, e, block_m);
    for (int i = 0; i < routing::m_tiles_for(count, block_m); ++i) {
      int begin = 0, end = 0;
      routing::expert_tile_rows(at, i, block_m, begin, end);
      s.tiles[first_tile + i] = gpu::moe_m_tile{e, begin, end, 0};
    }
  }
  if (first_slot == 0) s.tile_count = routing::tiles_total(s.count, slots, block_m);
  __syncthreads();
}

}  // namespace moerunner::kernels
