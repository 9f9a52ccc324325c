// Host launch code of the narrow decode tiles (sm90_kernel_grouped_gemm_wgmma_narrow.cuh), e4m3
// or 16-bit: the weights' TMA descriptor encoded per launch (host only, graph-capturable), one
// persistent CTA per SM, the M-tile schedule of N-row tiles built by the routing plan or, with
// local_ids, by each CTA.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/gpu/sm90_grouped_gemm_wgmma_narrow.cuh needs nvcc: include it from a .cu file"
#endif

#include <algorithm>
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "moerunner/core/error.hpp"
#include "moerunner/gpu/cuda_check.hpp"
#include "moerunner/gpu/grouped_gemm.cuh"
#include "moerunner/gpu/pdl_launch.cuh"
#include "moerunner/gpu/sm90_grouped_gemm_wgmma.cuh"
#include "moerunner/gpu/sm90_grouped_gemm_wgmma_fp8.cuh"
#include "moerunner/kernels/sm90_kernel_grouped_gemm_wgmma_narrow.cuh"

namespace moerunner::gpu {

namespace narrow_detail {

// The launch both forms share once their operands are checked: b the weights [E, rows, k] (e4m3
// bytes or T), g the parameters' 16-bit part (filled with the schedule here).
template <class T, kernels::moe_gemm_kind Kind, int N, bool Fp8, class B>
void launch(kernels::narrow_params<T, Fp8>& p, kernels::moe_gemm_params<T>& g, const B* b, int num_experts,
            const tile_schedule& schedule, const device_facts& dev, cudaStream_t stream, bool dependent_launch,
            const char* where) {
  using tile_t = kernels::moe_gemm_wgmma_narrow<T, Kind, N, Fp8>;
  MOE_EXPECT(schedule.block_m == N, where, "the tile schedule was built for another block_m");
  if (schedule.capacity == 0) return;
  MOE_EXPECT(g.item_counter == nullptr, where, "narrow tiles run in fixed turns");
  MOE_EXPECT(g.local_ids == nullptr || (g.local_slots <= kernels::local_plan_max_slots && !g.expert_bands), where,
             "a schedule built in the GEMMs holds at most " + std::to_string(kernels::local_plan_max_slots) +
                 " slots, and no expert bands");
  const bool may_split = Kind == kernels::moe_gemm_kind::down &&
                         (g.store == kernels::down_store::accumulate || g.store == kernels::down_store::partials);
  const int k_tiles = (g.k + tile_t::block_k - 1) / tile_t::block_k;
  MOE_EXPECT(g.k_splits == 1 || (may_split && g.k_splits >= 1 && g.k_splits <= k_tiles), where,
             "k_splits must be 1, or at most the K tiles for GEMM2 into the output or partials; got " +
                 std::to_string(g.k_splits));
  check_wgmma_items(g, schedule, where);
  const CUtensorMap map =
      weight_tensor_map(b, g.b_rows_per_expert, g.n, g.k, num_experts, g.interleaved, tile_t::box_rows);
  constexpr auto kernel = kernels::moe_grouped_gemm_wgmma_narrow_kernel<T, Kind, N, Fp8>;
  resident_ctas<kernel>(dev.device, tile_t::threads, tile_t::smem_bytes, where);  // (one CTA per SM)
  const std::int64_t n_tiles = (g.n + tile_t::out_cols - 1) / tile_t::out_cols;
  g.tiles = schedule.tiles;
  g.tile_count = schedule.count;
  g.n_tiles = static_cast<int>(n_tiles);
  const std::int64_t ctas = std::min<std::int64_t>(schedule.capacity * n_tiles * g.k_splits, dev.sm_count);
  launch_dependent(kernel, dim3(static_cast<unsigned>(ctas)), dim3(tile_t::threads), tile_t::smem_bytes, stream,
                   dependent_launch, p, map);
  MOE_CUDA_CHECK_LAUNCH("moe_grouped_gemm_wgmma_narrow_kernel");
}

}  // namespace narrow_detail

// Calls f.template operator()<N>() for the plan's tokens per narrow tile n (8, 16 or 32): the
// kernel instantiation a run's schedule_block_m names.
template <class F>
void with_narrow_tokens(int n, F&& f) {
  if (n == 8) f.template operator()<8>();
  else if (n == 16) f.template operator()<16>();
  else f.template operator()<32>();
}

// Launches one fp8 grouped GEMM on narrow tiles of N tokens over `schedule` (built for N-row
// tiles); b is the e4m3 weights [num_experts, p.g.b_rows_per_expert, p.g.k]. Fills p.g.tiles,
// tile_count and n_tiles. GEMM2 may split K into the output (accumulate) or f32 parts; GEMM1
// does not split. `dependent_launch`: a programmatic dependent of the kernel before it.
template <class T, kernels::moe_gemm_kind Kind, int N>
void launch_moe_gemm_wgmma_narrow(kernels::moe_gemm_fp8_params<T> p, const std::uint8_t* b, int num_experts,
                                  const tile_schedule& schedule, const device_facts& dev, cudaStream_t stream,
                                  bool dependent_launch = false) {
  constexpr const char* where = "gpu::launch_moe_gemm_wgmma_narrow";
  check_wgmma_fp8_gemm<Kind>(p.g, dev, where);
  MOE_EXPECT(p.up_parts == nullptr && !p.a_tma, where, "narrow tiles load A by cp.async, and GEMM1 whole");
  narrow_detail::launch<T, Kind, N, true>(p, p.g, b, num_experts, schedule, dev, stream, dependent_launch, where);
}

// The same over 16-bit operands (the weights p.b); any n and k that are multiples of 8.
template <class T, kernels::moe_gemm_kind Kind, int N>
void launch_moe_gemm_wgmma_narrow(kernels::moe_gemm_params<T> p, int num_experts, const tile_schedule& schedule,
                                  const device_facts& dev, cudaStream_t stream, bool dependent_launch = false) {
  constexpr const char* where = "gpu::launch_moe_gemm_wgmma_narrow";
  check_wgmma_gemm<Kind>(p, dev, where);
  MOE_EXPECT(!p.a_gathered, where, "narrow tiles gather A by cp.async");
  narrow_detail::launch<T, Kind, N, false>(p, p, p.b, num_experts, schedule, dev, stream, dependent_launch, where);
}

}  // namespace moerunner::gpu
