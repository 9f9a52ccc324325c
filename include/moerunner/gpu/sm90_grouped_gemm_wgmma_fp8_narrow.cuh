// Host launch code of the fp8 GEMMs' narrow decode tiles (sm90_kernel_grouped_gemm_wgmma_fp8_narrow.cuh):
// the weights' TMA descriptor encoded per launch (host only, graph-capturable), one persistent
// CTA per SM, the M-tile schedule built by the routing plan with N-row tiles.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/gpu/sm90_grouped_gemm_wgmma_fp8_narrow.cuh needs nvcc: include it from a .cu file"
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
#include "moerunner/kernels/sm90_kernel_grouped_gemm_wgmma_fp8_narrow.cuh"

namespace moerunner::gpu {

// Launches one fp8 grouped GEMM on narrow tiles of N tokens over `schedule` (built for N-row
// tiles); b is the e4m3 weights [num_experts, p.g.b_rows_per_expert, p.g.k]. Fills p.g.tiles,
// tile_count and n_tiles. GEMM2 may split K into the output (accumulate) or f32 parts; GEMM1
// does not split. `dependent_launch`: a programmatic dependent of the kernel before it.
template <class T, kernels::moe_gemm_kind Kind, int N>
void launch_moe_gemm_wgmma_fp8_narrow(kernels::moe_gemm_fp8_params<T> p, const std::uint8_t* b, int num_experts,
                                      const tile_schedule& schedule, const device_facts& dev, cudaStream_t stream,
                                      bool dependent_launch = false) {
  constexpr const char* where = "gpu::launch_moe_gemm_wgmma_fp8_narrow";
  using tile_t = kernels::moe_gemm_wgmma_fp8_narrow<T, Kind, N>;
  kernels::moe_gemm_params<T>& g = p.g;
  MOE_EXPECT(schedule.block_m == N, where, "the tile schedule was built for another block_m");
  check_wgmma_fp8_gemm<Kind>(g, dev, where);
  if (schedule.capacity == 0) return;
  MOE_EXPECT(g.item_counter == nullptr && p.up_parts == nullptr, where,
             "narrow tiles run in fixed turns, and GEMM1 without K splits");
  const bool may_split = Kind == kernels::moe_gemm_kind::down &&
                         (g.store == kernels::down_store::accumulate || g.store == kernels::down_store::partials);
  MOE_EXPECT(g.k_splits == 1 || (may_split && g.k_splits >= 1 && g.k_splits <= g.k / tile_t::block_k), where,
             "k_splits must be 1, or at most the K tiles for GEMM2 into the output or partials; got " +
                 std::to_string(g.k_splits));
  check_wgmma_fp8_items(g, schedule, where);
  const CUtensorMap map =
      weight_tensor_map(b, g.b_rows_per_expert, g.n, g.k, num_experts, g.interleaved, tile_t::box_rows);
  constexpr auto kernel = kernels::moe_grouped_gemm_wgmma_fp8_narrow_kernel<T, Kind, N>;
  resident_ctas<kernel>(dev.device, tile_t::threads, tile_t::smem_bytes, where);  // (one CTA per SM)
  const std::int64_t n_tiles = (g.n + tile_t::out_cols - 1) / tile_t::out_cols;
  g.tiles = schedule.tiles;
  g.tile_count = schedule.count;
  g.n_tiles = static_cast<int>(n_tiles);
  const std::int64_t ctas = std::min<std::int64_t>(schedule.capacity * n_tiles * g.k_splits, dev.sm_count);
  launch_dependent(kernel, dim3(static_cast<unsigned>(ctas)), dim3(tile_t::threads), tile_t::smem_bytes, stream,
                   dependent_launch, p, map);
  MOE_CUDA_CHECK_LAUNCH("moe_grouped_gemm_wgmma_fp8_narrow_kernel");
}

}  // namespace moerunner::gpu
