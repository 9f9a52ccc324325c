// Host launch code of the fused backend's decode GEMMs (kernel_stream_gemm.cuh): checks the
// schedule and sizes, and launches a persistent grid sized from the schedule's bound and the
// CTAs that fit the device, never from per-expert counts, so a run stays graph-capturable.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/gpu/stream_gemm.cuh needs nvcc: include it from a .cu file"
#endif

#include <cuda_runtime_api.h>

#include "moerunner/gpu/cuda_check.hpp"
#include "moerunner/gpu/grouped_gemm.cuh"
#include "moerunner/gpu/grouped_gemm_tuning.hpp"
#include "moerunner/gpu/pdl_launch.cuh"
#include "moerunner/kernels/kernel_stream_gemm.cuh"

namespace moerunner::gpu {

// Launches one grouped GEMM of a stream tuning over the schedule's tiles (built for its
// block_m); `p.tiles`, `p.tile_count` and `p.n_tiles` are filled here from `schedule`. K is
// never split across CTAs (k_splits 1), so GEMM2 stores rows, slots or adds into the output.
template <class T, class Policy, kernels::moe_gemm_kind Kind>
void launch_moe_stream_gemm(kernels::moe_gemm_params<T> p, const tile_schedule& schedule, const device_facts& dev,
                            cudaStream_t stream, bool dependent_launch = false) {
  constexpr stream_gemm_tuning tuning = Policy::tuning;
  check_mma_gemm_launch(p, schedule, tuning.schedule_block_m(), tuning.min_arch, dev, "gpu::launch_moe_stream_gemm");
  if (schedule.capacity == 0) return;
  const int per_sm = resident_ctas<kernels::moe_stream_gemm_kernel<T, Policy, Kind>>(
      dev.device, tuning.threads(), tuning.smem_bytes(), "gpu::launch_moe_stream_gemm");
  const unsigned grid =
      persistent_gemm_grid(p, schedule, kernels::moe_stream_gemm<T, Policy, Kind>::out_cols, per_sm, dev);
  launch_dependent(kernels::moe_stream_gemm_kernel<T, Policy, Kind>, dim3(grid), dim3(tuning.threads()),
                   tuning.smem_bytes(), stream, dependent_launch, p);
  MOE_CUDA_CHECK_LAUNCH("moe_stream_gemm_kernel");
}

// Launches GEMM1 (`up`, of kind First) and GEMM2 (`down`) as one grid over the schedule, which
// must come straight from the plan kernel (its zeroed counters are the grid's flags), with no
// other work on the output between them (the inplace memset is not possible here). The grid is
// never larger than the device holds at once: GEMM2 items wait for GEMM1 items of other CTAs.
template <class T, class Policy, kernels::moe_gemm_kind First>
void launch_moe_stream_fused(kernels::moe_gemm_params<T> up, kernels::moe_gemm_params<T> down,
                             const tile_schedule& schedule, const device_facts& dev, cudaStream_t stream,
                             bool dependent_launch = false) {
  static_assert(First != kernels::moe_gemm_kind::down, "GEMM1 comes first");
  constexpr stream_gemm_tuning tuning = Policy::tuning;
  constexpr const char* where = "gpu::launch_moe_stream_fused";
  check_mma_gemm_launch(up, schedule, tuning.schedule_block_m(), tuning.min_arch, dev, where);
  check_mma_gemm_launch(down, schedule, tuning.schedule_block_m(), tuning.min_arch, dev, where);
  if (schedule.capacity == 0) return;
  constexpr auto kernel = &kernels::moe_stream_fused_kernel<T, Policy, First>;
  const int per_sm = resident_ctas<kernel>(dev.device, tuning.threads(), tuning.smem_bytes(), where);
  const unsigned grid_up = persistent_gemm_grid(up, schedule, kernels::moe_stream_gemm<T, Policy, First>::out_cols,
                                                per_sm, dev);
  const unsigned grid_down = persistent_gemm_grid(
      down, schedule, kernels::moe_stream_gemm<T, Policy, kernels::moe_gemm_kind::down>::out_cols, per_sm, dev);
  // Both bounds are at most the resident CTAs; so is the larger.
  const unsigned grid = grid_up > grid_down ? grid_up : grid_down;
  const kernels::moe_stream_fused_params<T> f{up, down, {schedule.tiles, schedule.count + 1}};
  launch_dependent(kernel, dim3(grid), dim3(tuning.threads()), tuning.smem_bytes(), stream, dependent_launch, f);
  MOE_CUDA_CHECK_LAUNCH("moe_stream_fused_kernel");
}

}  // namespace moerunner::gpu
