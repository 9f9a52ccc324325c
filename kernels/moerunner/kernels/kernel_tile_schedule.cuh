// Device code of the M-tile schedule the grouped GEMMs walk: the expert-sorted rows of each
// expert cut into tiles of block_m rows, numbered from the exclusive prefix of
// ceil(count[e] / block_m) over experts. Empty experts own no tile, so no GEMM CTA ever sees
// them; tile i is {expert, row_begin, row_end, band word} (the word 0 unless the schedule is
// written with expert bands: gpu/expert_bands.hpp).
//
//   moe_tile_schedule_kernel: expert_offsets [E+1] -> M tiles (its own launch)
//   write_m_tiles: the tile writer it shares with the routing-plan kernels (kernel_permute.cuh),
//     which build the schedule in the same launch as the plan.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/kernels/kernel_tile_schedule.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstdint>

#include <cub/block/block_scan.cuh>

#include "moerunner/core/config.hpp"
#include "moerunner/gpu/expert_bands.hpp"
#include "moerunner/gpu/grouped_gemm_tuning.hpp"

namespace moerunner::kernels {

inline constexpr int schedule_threads = 1024;
inline constexpr int schedule_max_experts = max_num_experts;
inline constexpr int schedule_items = (schedule_max_experts + schedule_threads - 1) / schedule_threads;

// M tiles of an expert with `rows` rows; computed without rows + block_m - 1, which could overflow.
__device__ __forceinline__ int m_tiles_of(int rows, int block_m) {
  return rows > 0 ? rows / block_m + (rows % block_m != 0 ? 1 : 0) : 0;
}

// The schedule's head (gpu::schedule_head_words): the tiles used, and the wgmma GEMMs' work-item
// counters at 0 (sm90_work_items.cuh: each launch leaves its counter at 0 again; this is for a
// workspace's first use).
__device__ __forceinline__ void write_schedule_head(std::int32_t* head, int used) {
  head[0] = used;
#pragma unroll
  for (int i = 1; i < gpu::schedule_head_words; ++i) head[i] = 0;
}

// The tiles a schedule writes: a plan that promised more rows than slots cannot happen, and
// clamping to the capacity keeps the GEMMs in bounds anyway.
__device__ __forceinline__ int m_tiles_used(int total, int capacity) { return total < capacity ? total : capacity; }

// Writes tiles [0, used), the block's THREADS threads striding over them. For e in [0, E]
// first_tile[e] is the exclusive prefix of m_tiles_of over experts (first_tile[E] the total,
// at least `used`) and first_row[e] the expert's first row (first_row[E] the end of the last);
// both must be visible to the whole block (shared memory written before a barrier). With
// expert_band > 0 each tile carries its band word for expert bands of at most that many tiles.
template <int THREADS>
__device__ __forceinline__ void write_m_tiles(const int* first_tile, const int* first_row, int num_experts,
                                              int block_m, int used, gpu::moe_m_tile* __restrict__ tiles,
                                              int expert_band = 0) {
  for (int i = static_cast<int>(threadIdx.x); i < used; i += THREADS) {
    // Invariant first_tile[lo] <= i < first_tile[hi]; ends on the one expert with tiles holding i.
    int lo = 0, hi = num_experts;
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (first_tile[mid] <= i) lo = mid;
      else hi = mid;
    }
    const int begin = first_row[lo] + (i - first_tile[lo]) * block_m;
    const int last = first_row[lo + 1];
    const int end = last - begin < block_m ? last : begin + block_m;
    const std::int32_t band =
        expert_band > 0
            ? gpu::expert_band_word(i, first_tile[lo], first_tile[lo + 1] - first_tile[lo], used, expert_band)
            : 0;
    tiles[i] = gpu::moe_m_tile{lo, begin, end, band};
  }
}

// One block: the schedule from the plan's expert offsets, for up to schedule_max_experts experts.
// A template with nothing to give (moe_tile_schedule_kernel<>) so that the header may be
// included by several translation units of one program, as CUB's kernels are.
template <int = 0>
__global__ void __launch_bounds__(schedule_threads)
    moe_tile_schedule_kernel(const std::int32_t* __restrict__ expert_offsets, int num_experts, int block_m,
                             gpu::moe_m_tile* __restrict__ tiles, std::int32_t* __restrict__ tile_count,
                             int capacity, int expert_band = 0) {
  using scan_t = cub::BlockScan<int, schedule_threads>;
  __shared__ typename scan_t::TempStorage scan_storage;
  __shared__ int offsets[schedule_max_experts + 1];
  __shared__ int first_tile[schedule_max_experts + 1];

  for (int e = threadIdx.x; e <= num_experts; e += schedule_threads) offsets[e] = expert_offsets[e];
  __syncthreads();

  int counts[schedule_items];
#pragma unroll
  for (int j = 0; j < schedule_items; ++j) {
    const int e = threadIdx.x * schedule_items + j;
    counts[j] = e < num_experts ? m_tiles_of(offsets[e + 1] - offsets[e], block_m) : 0;
  }
  int total = 0;
  scan_t(scan_storage).ExclusiveSum(counts, counts, total);
#pragma unroll
  for (int j = 0; j < schedule_items; ++j) {
    const int e = threadIdx.x * schedule_items + j;
    if (e < num_experts) first_tile[e] = counts[j];
  }
  const int used = m_tiles_used(total, capacity);
  if (threadIdx.x == 0) {
    first_tile[num_experts] = total;
    write_schedule_head(tile_count, used);
  }
  __syncthreads();

  write_m_tiles<schedule_threads>(first_tile, offsets, num_experts, block_m, used, tiles, expert_band);
}

}  // namespace moerunner::kernels
