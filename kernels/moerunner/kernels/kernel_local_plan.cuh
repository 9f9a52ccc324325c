// Device code: the routing plan's row order and M-tile schedule for a handful of slots, built
// by every CTA of a decode GEMM in its own shared memory from topk_ids, so that no plan kernel
// runs before the GEMMs. The result is the plan kernel's (kernel_permute.cuh) for those ids:
// rows sorted by (expert, slot), tiles of block_m rows in expert order, ids outside
// [0, num_experts) left out (and an id other than -1 reported in *error_flag when given).
//
// Each slot has a thread; with at most local_plan_max_slots slots, counting by a loop over the
// other slots in shared memory is a few hundred cycles, where a scan would cost barriers.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/kernels/kernel_local_plan.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstdint>

#include "moerunner/gpu/grouped_gemm_tuning.hpp"

namespace moerunner::kernels {

inline constexpr int local_plan_max_slots = 64;

struct local_plan {
  gpu::moe_m_tile tiles[local_plan_max_slots];  // at most one tile per slot
  std::int32_t row_to_slot[local_plan_max_slots];
  std::int32_t expert[local_plan_max_slots];  // per slot, -1 when left out
  std::int32_t count[local_plan_max_slots];   // per slot: its expert's rows at the expert's first slot, else 0
  std::int32_t tile_count;
};

// Every thread of the block calls it (THREADS >= slots); `ids` is read through L2 (written by an
// earlier kernel). Ends with a barrier: the plan is then visible to the whole block.
template <int THREADS>
__device__ __forceinline__ void build_local_plan(const std::int32_t* ids, int slots, int num_experts, int block_m,
                                                 local_plan& s, std::int32_t* error_flag) {
  static_assert(THREADS >= local_plan_max_slots, "one thread per slot");
  const int t = static_cast<int>(threadIdx.x);
  int e = -1;
  bool bad = false;
  if (t < slots) {
    const int id = __ldcg(ids + t);
    if (id >= 0 && id < num_experts) e = id;
    else bad = id != -1;
    s.expert[t] = e;
  }
  if (error_flag != nullptr) {
    const int any_bad = __syncthreads_or(bad ? 1 : 0);
    if (t == 0) *error_flag = any_bad != 0 ? 1 : 0;
  } else {
    __syncthreads();
  }

  // Rows of smaller experts (the expert's first row), this slot's rank within its expert, and
  // the expert's row count.
  int before = 0, rank = 0, count = 0;
  if (e >= 0) {
    for (int j = 0; j < slots; ++j) {
      const int o = s.expert[j];
      before += (o >= 0 && o < e) ? 1 : 0;
      count += o == e ? 1 : 0;
      rank += (o == e && j < t) ? 1 : 0;
    }
    s.row_to_slot[before + rank] = t;
  }
  if (t < slots) s.count[t] = (e >= 0 && rank == 0) ? count : 0;
  __syncthreads();

  // The expert's first slot writes its tiles after those of the smaller experts.
  if (e >= 0 && rank == 0) {
    int first_tile = 0;
    for (int j = 0; j < slots; ++j) {
      const int c = s.count[j];
      if (c > 0 && s.expert[j] < e) first_tile += (c + block_m - 1) / block_m;
    }
    for (int i = 0; i * block_m < count; ++i) {
      const int begin = before + i * block_m;
      const int end = count - i * block_m < block_m ? before + count : begin + block_m;
      s.tiles[first_tile + i] = gpu::moe_m_tile{e, begin, end, 0};
    }
  }
  if (t == 0) {
    int total = 0;
    for (int j = 0; j < slots; ++j) total += (s.count[j] + block_m - 1) / block_m;
    s.tile_count = total;
  }
  __syncthreads();
}

}  // namespace moerunner::kernels
