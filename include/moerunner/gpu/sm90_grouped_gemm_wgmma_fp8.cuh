// Host launch code of the fp8 block-scaled grouped GEMMs (sm90_kernel_grouped_gemm_wgmma_fp8.cuh)
// and of the input rows' group quantization (kernel_quantize_fp8.cuh). Like the 16-bit wgmma
// GEMMs: the weights' TMA descriptor encoded per launch (host only, graph-capturable), one
// persistent CTA per SM (or pair of CTAs per two SMs), the M-tile schedule built by the routing plan;
// GEMM2's act rows by TMA too where p.a_tma asks (a second descriptor, over act).
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/gpu/sm90_grouped_gemm_wgmma_fp8.cuh needs nvcc: include it from a .cu file"
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "moerunner/core/error.hpp"
#include "moerunner/gpu/cuda_check.hpp"
#include "moerunner/gpu/grouped_gemm.cuh"
#include "moerunner/gpu/pdl_launch.cuh"
#include "moerunner/gpu/sm90_grouped_gemm_wgmma.cuh"
#include "moerunner/kernels/kernel_fp8_up_parts.cuh"
#include "moerunner/kernels/kernel_quantize_fp8.cuh"
#include "moerunner/kernels/sm90_kernel_grouped_gemm_wgmma_fp8.cuh"

namespace moerunner::gpu {

// x [rows, h] (bf16, f16 or f32, h a multiple of 128, aligned to 4 values) -> q [rows, h]
// e4m3 and scales [rows, h / 128] f32; `dependent`: a programmatic dependent of the kernel before.
template <class T>
void quantize_rows_fp8(const T* x, std::int64_t rows, int h, std::uint8_t* q, float* scales, cudaStream_t stream,
                       bool dependent = false) {
  MOE_EXPECT(h > 0 && h % kernels::fp8_group == 0, "gpu::quantize_rows_fp8", "h must be a positive multiple of 128");
  const std::int64_t groups = rows * (h / kernels::fp8_group);
  if (groups == 0) return;
  constexpr int warps = 8;
  const std::int64_t blocks = (groups + warps - 1) / warps;
  MOE_EXPECT(blocks <= 0x7fffffff, "gpu::quantize_rows_fp8", "too many rows");
  launch_dependent(kernels::quantize_rows_fp8_kernel<T>, dim3(static_cast<unsigned>(blocks)), dim3(32 * warps), 0,
                   stream, dependent, x, groups, h, q, scales);
  MOE_CUDA_CHECK_LAUNCH("quantize_rows_fp8_kernel");
}

// The rest of GEMM1's epilogue where it ran in K splits into g1.up_parts
// (gpu::fp8_plan::up_k_splits): kernels::finish_up_parts_kernel over the schedule GEMM1 ran, as
// its programmatic dependent, writing g1.act and g1.act_scale.
template <class T>
void finish_up_parts_fp8(const kernels::moe_gemm_fp8_params<T>& g1, bool gated, const tile_schedule& schedule,
                         cudaStream_t stream) {
  MOE_EXPECT(g1.up_parts != nullptr && g1.g.k_splits > 1 && g1.g.n % kernels::fp8_group == 0,
             "gpu::finish_up_parts_fp8", "GEMM1's parts, split count or n are not set");
  if (schedule.capacity == 0) return;
  MOE_EXPECT(schedule.capacity <= 0x7fffffff, "gpu::finish_up_parts_fp8", "too many tiles");
  kernels::up_parts_args a;
  a.parts = g1.up_parts;
  a.split_stride = g1.up_parts_stride;
  a.splits = g1.g.k_splits;
  a.n = g1.g.n;
  a.gated = gated;
  a.act = g1.g.act;
  a.input_weights = g1.g.input_weights;
  a.row_to_slot = g1.g.row_to_slot;
  a.tiles = schedule.tiles;
  a.tile_count = schedule.count;
  a.act_q = g1.act;
  a.act_scale = g1.act_scale;
  launch_dependent(kernels::finish_up_parts_kernel<kernels::up_parts_threads>,
                   dim3(static_cast<unsigned>(schedule.capacity)),
                   dim3(kernels::up_parts_threads), 0, stream, true, a);
  MOE_CUDA_CHECK_LAUNCH("finish_up_parts_kernel");
}

// What every fp8 wgmma launch needs (wide or narrow tiles): every wgmma launch's checks
// (check_wgmma_gemm: sm_90a code, interleaved gate/up rows only in the gated GEMM1), and n and k
// whole scale blocks.
template <kernels::moe_gemm_kind Kind, class T>
void check_wgmma_fp8_gemm(const kernels::moe_gemm_params<T>& g, const device_facts& dev, const char* where) {
  check_wgmma_gemm<Kind>(g, dev, where);
  MOE_EXPECT(g.k % kernels::fp8_group == 0 && g.n % kernels::fp8_group == 0, where,
             "the GEMM's n and k must be positive multiples of 128 (the scale blocks)");
}

// Sets the kernel's dynamic shared memory limit once per device, checks that a CTA (a cluster of
// them) fits, and returns how many run at once: sm_count CTAs, or the clusters resident at once
// (a cluster needs SMs of one GPC, which may leave some SMs out).
template <class T, kernels::moe_gemm_kind Kind, int Cluster, int BlockM, fp8_k_loop Loop, bool HandOut,
          bool Staged = false>
int prepare_wgmma_fp8_gemm(const device_facts& dev) {
  constexpr int cached_devices = 64;
  static std::array<std::atomic<int>, cached_devices> places{};  // 0: not prepared yet
  const bool cached = dev.device >= 0 && dev.device < cached_devices;
  if (cached) {
    if (const int n = places[dev.device].load(std::memory_order_relaxed); n > 0) return n;
  }
  using tile_t = kernels::moe_gemm_wgmma_fp8<T, Kind, Cluster, BlockM, Loop, HandOut, Staged>;
  const auto kernel = kernels::moe_grouped_gemm_wgmma_fp8_kernel<T, Kind, Cluster, BlockM, Loop, HandOut, Staged>;
  MOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, tile_t::smem_bytes));
  int n = 0;
  if constexpr (Cluster == 1) {
    MOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, tile_t::threads, tile_t::smem_bytes));
    n = n > 0 ? dev.sm_count : 0;
  } else {
    const launch_config c(dim3(Cluster * dev.sm_count), dim3(tile_t::threads), tile_t::smem_bytes, nullptr, false,
                          Cluster);
    MOE_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, kernel, &c.config));
  }
  MOE_EXPECT(n > 0, "gpu::launch_moe_gemm_wgmma_fp8",
             "the fp8 wgmma GEMM does not fit on this device (" + std::to_string(tile_t::smem_bytes) +
                 " bytes of shared memory per CTA, clusters of " + std::to_string(Cluster) + ")");
  if (cached) places[dev.device].store(n, std::memory_order_relaxed);
  return n;
}

// Launches one fp8 grouped GEMM over `schedule` (built for BlockM-row tiles, or with Cluster 2 or
// 4 for tiles of 128 or 256 rows that the cluster's 64-row CTAs share, each weight tile multicast
// into all), with the K loop Loop (fp8_k_loop; other than plain on 64-row CTAs alone or in pairs
// only); b is the e4m3 weights [num_experts, p.g.b_rows_per_expert, p.g.k]. Fills p.g.tiles,
// tile_count and n_tiles. With p.g.item_counter (zero: schedule.item_counters) the work items
// are handed out at run time (64-row CTAs alone or in pairs with the plain K loop only: the
// 128-row CTAs' producer, at 40 registers, spilled with the hand-out's state). Staged (64-row
// CTAs alone or in pairs; GEMM2 with A by TMA, not into K-split parts, or the gated GEMM1 without
// K splits): store warps write the sums, or quantize and write act.
// `dependent_launch`: a programmatic dependent of the kernel before it, which must not be the
// kernel that wrote the schedule (the kernel reads the schedule before its wait to load its
// first weight tiles: kernels::moe_gemm_wgmma_fp8::load_first_weights).
template <class T, kernels::moe_gemm_kind Kind, int Cluster, int BlockM = fp8_block_m,
          fp8_k_loop Loop = fp8_k_loop::plain, bool Staged = false>
void launch_moe_gemm_wgmma_fp8(kernels::moe_gemm_fp8_params<T> p, const std::uint8_t* b, int num_experts,
                               const tile_schedule& schedule, const device_facts& dev, cudaStream_t stream,
                               bool dependent_launch = false) {
  constexpr const char* where = "gpu::launch_moe_gemm_wgmma_fp8";
  using tile_t = kernels::moe_gemm_wgmma_fp8<T, Kind, Cluster, BlockM, Loop, false, Staged>;
  kernels::moe_gemm_params<T>& g = p.g;
  MOE_EXPECT(schedule.block_m == tile_t::schedule_block_m, where, "the tile schedule was built for another block_m");
  check_wgmma_fp8_gemm<Kind>(g, dev, where);
  if (schedule.capacity == 0) return;
  const CUtensorMap map =
      weight_tensor_map(b, g.b_rows_per_expert, g.n, g.k, num_experts, g.interleaved, tile_t::box_rows);
  // GEMM2's act rows [a_rows, k] as one expert's rows of a weight-shaped map: boxes of a CTA's
  // rows, zeros past a_rows. Without them the kernel never reads the map (B's is passed).
  MOE_EXPECT(!p.a_tma || (Kind == kernels::moe_gemm_kind::down && g.a_rows > 0 && g.a_rows <= 0x7fffffff), where,
             "only GEMM2 loads its A rows by TMA, and their count must be set");
  MOE_EXPECT(!Staged || (g.item_counter == nullptr && (Kind != kernels::moe_gemm_kind::down ||
                                                       (p.a_tma && g.store != kernels::down_store::partials))),
             where, "store warps need fixed turns, and GEMM2's its A rows by TMA and a 16-bit store");
  const CUtensorMap a_map =
      p.a_tma ? weight_tensor_map(p.a, g.a_rows, static_cast<int>(g.a_rows), g.k, 1, false, tile_t::bm) : map;
  const bool hand_out = g.item_counter != nullptr;
  constexpr bool may_hand_out = Loop == fp8_k_loop::plain && BlockM == fp8_block_m && Cluster <= 2;
  MOE_EXPECT(!hand_out || may_hand_out, where,
             "work items are handed out to 64-row CTAs alone or in pairs with the plain K loop only");
  int places = 0;
  if constexpr (Staged) places = prepare_wgmma_fp8_gemm<T, Kind, Cluster, BlockM, Loop, false, true>(dev);
  else if constexpr (may_hand_out)
    places = hand_out ? prepare_wgmma_fp8_gemm<T, Kind, Cluster, BlockM, Loop, true>(dev)
                      : prepare_wgmma_fp8_gemm<T, Kind, Cluster, BlockM, Loop, false>(dev);
  else places = prepare_wgmma_fp8_gemm<T, Kind, Cluster, BlockM, Loop, false>(dev);
  const std::int64_t n_tiles = (g.n + tile_t::out_cols - 1) / tile_t::out_cols;
  // GEMM2 splits K into the output or f32 parts; GEMM1 into f32 parts where its kernel can
  // (tile_t::up_splits: 64-row CTAs alone; finish_up_parts_fp8 completes it).
  const bool may_split = Kind == kernels::moe_gemm_kind::down
                             ? g.store == kernels::down_store::accumulate || g.store == kernels::down_store::partials
                             : p.up_parts != nullptr && tile_t::up_splits;
  MOE_EXPECT(g.k_splits == 1 || (may_split && g.k_splits >= 1 && g.k_splits <= g.k / tile_t::block_k), where,
             "k_splits must be 1, or at most the K tiles: for GEMM2 into the output or partials, for GEMM1 "
             "into up_parts on 64-row CTAs alone; got " +
                 std::to_string(g.k_splits));
  check_wgmma_items(g, schedule, where);
  const std::int64_t work_bound = schedule.capacity * n_tiles * g.k_splits;
  const std::int64_t clusters = std::min<std::int64_t>(work_bound, places);
  MOE_EXPECT(!hand_out || hand_out_items_fit(work_bound, clusters), where,
             "too many work items to hand out at run time (they are numbered in 32 bits)");
  MOE_EXPECT(!hand_out || hand_out_offsets_fit(schedule.capacity * schedule.block_m, g.k), where,
             "too many rows to hand out the work items (their A rows are 32-bit byte offsets)");
  g.tiles = schedule.tiles;
  g.tile_count = schedule.count;
  g.n_tiles = static_cast<int>(n_tiles);
  const dim3 grid(static_cast<unsigned>(clusters * Cluster));
  if constexpr (may_hand_out && !Staged) {
    if (hand_out) {
      launch_dependent_clusters(kernels::moe_grouped_gemm_wgmma_fp8_kernel<T, Kind, Cluster, BlockM, Loop, true>,
                                grid, dim3(tile_t::threads), tile_t::smem_bytes, stream, dependent_launch, Cluster, p,
                                a_map, map);
      MOE_CUDA_CHECK_LAUNCH("moe_grouped_gemm_wgmma_fp8_kernel");
      return;
    }
  }
  launch_dependent_clusters(kernels::moe_grouped_gemm_wgmma_fp8_kernel<T, Kind, Cluster, BlockM, Loop, false, Staged>,
                            grid, dim3(tile_t::threads), tile_t::smem_bytes, stream, dependent_launch, Cluster, p,
                            a_map, map);
  MOE_CUDA_CHECK_LAUNCH("moe_grouped_gemm_wgmma_fp8_kernel");
}

}  // namespace moerunner::gpu
