// Host launch code of the fused backend's grouped GEMMs: sizes the M-tile schedule,
// picks a tuning for the device, and launches persistent grids whose size never depends
// on per-expert token counts (those exist only on the device), so a run needs no host
// round trip and can be captured in a CUDA graph.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/gpu/grouped_gemm.cuh needs nvcc: include it from a .cu file"
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>

#include <cuda_runtime_api.h>

#include "moerunner/core/error.hpp"
#include "moerunner/gpu/cuda_check.hpp"
#include "moerunner/gpu/expert_bands.hpp"
#include "moerunner/gpu/grouped_gemm_tuning.hpp"
#include "moerunner/gpu/routing_plan.hpp"
#include "moerunner/kernels/kernel_grouped_gemm.cuh"
#include "moerunner/kernels/kernel_tile_schedule.cuh"

namespace moerunner::gpu {

// ---------------------------------------------------------------------------------------------
// M-tile schedule

struct tile_schedule {
  const moe_m_tile* tiles = nullptr;
  const std::int32_t* count = nullptr;  // device: tiles actually used
  std::int64_t capacity = 0;            // host: the bound the grids are sized for
  int block_m = 0;
  // device: [2] work-item counters (GEMM1's, GEMM2's) for wgmma GEMMs whose items are handed
  // out at run time; zeroed with the count (null where the schedule is built in the GEMMs).
  std::int32_t* item_counters = nullptr;
  int expert_band = 0;  // > 0: the tiles carry band words for expert bands of at most this many tiles
};

// A schedule's checked arguments and its pieces, carved from the caller's workspace.
struct tile_schedule_pieces {
  moe_m_tile* tiles = nullptr;
  std::int32_t* count = nullptr;  // the head: count, then the item counters (schedule_head_words)
  tile_schedule schedule;         // the same pieces, as the GEMM launches read them
};

// Checks the arguments of a schedule for `rows` rows over num_experts experts (errors name
// `where` and call the workspace `name`) and carves it from `workspace`: the tile count (and
// the item counters after it), then the tiles, each in its own 256-byte piece. With
// expert_band > 0 (at most expert_band_max) the schedule is to carry band words for expert
// bands of at most that many tiles (expert_bands.hpp). Launches nothing.
inline tile_schedule_pieces carve_tile_schedule(int num_experts, std::int64_t rows, int block_m, void* workspace,
                                                std::size_t bytes, const char* where, const char* name,
                                                int expert_band = 0) {
  MOE_EXPECT(expert_band >= 0 && expert_band <= expert_band_max, where,
             "expert_band must be in [0, " + std::to_string(expert_band_max) + "], got " + std::to_string(expert_band));
  MOE_EXPECT(num_experts >= 1 && num_experts <= kernels::schedule_max_experts, where,
             "the plan must have between 1 and " + std::to_string(kernels::schedule_max_experts) +
                 " experts, got " + std::to_string(num_experts));
  MOE_EXPECT(block_m > 0, where, "block_m must be positive, got " + std::to_string(block_m));
  MOE_EXPECT(rows >= 0, where, "rows must not be negative, got " + std::to_string(rows));
  MOE_EXPECT(workspace != nullptr, where, std::string(name) + " is null");
  MOE_EXPECT(reinterpret_cast<std::uintptr_t>(workspace) % plan_piece_alignment == 0, where,
             std::string(name) + " must be " + std::to_string(plan_piece_alignment) + "-byte aligned");
  const std::size_t need = tile_schedule_bytes(rows, num_experts, block_m);
  MOE_EXPECT(bytes >= need, where,
             std::string(name) + " holds " + std::to_string(bytes) + " bytes, the tile schedule needs " +
                 std::to_string(need));
  const std::int64_t capacity = moe_m_tile_capacity(rows, num_experts, block_m);
  MOE_EXPECT(capacity <= 0x7fffffff, where, "too many M tiles for one launch");
  auto* base = static_cast<char*>(workspace);
  tile_schedule_pieces p;
  p.count = reinterpret_cast<std::int32_t*>(base);
  p.tiles = reinterpret_cast<moe_m_tile*>(base + plan_piece_bytes(schedule_head_words * sizeof(std::int32_t)));
  p.schedule = {p.tiles, p.count, capacity, block_m, p.count + 1, expert_band};
  return p;
}

// Turns the plan's device-side expert offsets into the M-tile list, on the device.
// `workspace` must be 256-byte aligned and hold tile_schedule_bytes(rows, E, block_m);
// expert_band as carve_tile_schedule's.
inline tile_schedule build_tile_schedule(const routing_plan& plan, std::int64_t rows, int block_m, void* workspace,
                                         std::size_t bytes, cudaStream_t stream, int expert_band = 0) {
  const tile_schedule_pieces p = carve_tile_schedule(plan.num_experts, rows, block_m, workspace, bytes,
                                                     "gpu::build_tile_schedule", "workspace", expert_band);
  kernels::moe_tile_schedule_kernel<><<<1, kernels::schedule_threads, 0, stream>>>(
      plan.expert_offsets, plan.num_experts, block_m, p.tiles, p.count, static_cast<int>(p.schedule.capacity),
      expert_band);
  MOE_CUDA_CHECK_LAUNCH("moe_tile_schedule_kernel");
  return p.schedule;
}

// ---------------------------------------------------------------------------------------------
// Device facts the launch needs (no stream work, so legal while a stream is being captured)

struct device_facts {
  int device = 0;
  int arch = 0;       // compute capability as 80, 86, 90, ...
  int code_arch = 0;  // virtual architecture of the kernel image this device runs
  int sm_count = 0;
  int l2_bytes = 0;
};

// Which of the compiled images the device runs decides what a kernel body holds (each
// tuning's body exists only in code for its min_arch and newer), so it is asked, not
// assumed from the compute capability; a device with no matching image fails here,
// before anything is launched.
inline int kernel_code_arch(int device) {
  constexpr int cached_devices = 64;
  static std::array<std::atomic<int>, cached_devices> cache{};
  if (device >= 0 && device < cached_devices) {
    if (const int a = cache[device].load(std::memory_order_relaxed); a > 0) return a;
  }
  cudaFuncAttributes attr{};
  MOE_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernels::moe_tile_schedule_kernel<>));
  if (device >= 0 && device < cached_devices) cache[device].store(attr.ptxVersion, std::memory_order_relaxed);
  return attr.ptxVersion;
}

// The current device's SM count, or 0 where there is no usable device (host-only callers).
inline int current_sm_count_or_zero() noexcept {
  int device = 0, n = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: leave no error behind for the caller's next check
    return 0;
  }
  return n;
}

// The current device's facts. Every run asks for them and they never change for a device, so
// each device's are queried once (four attribute queries and the kernel image's) and kept.
inline device_facts current_device_facts() {
  int device = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&device));
  const auto query = [device] {
    device_facts f;
    int major = 0, minor = 0;
    f.device = device;
    MOE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    MOE_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    MOE_CUDA_CHECK(cudaDeviceGetAttribute(&f.sm_count, cudaDevAttrMultiProcessorCount, device));
    MOE_CUDA_CHECK(cudaDeviceGetAttribute(&f.l2_bytes, cudaDevAttrL2CacheSize, device));
    f.arch = major * 10 + minor;
    f.code_arch = kernel_code_arch(device);
    return f;
  };
  constexpr int cached_devices = 64;
  if (device < 0 || device >= cached_devices) return query();
  static std::array<std::once_flag, cached_devices> once;
  static std::array<device_facts, cached_devices> facts;
  std::call_once(once[device], [&] { facts[device] = query(); });  // a throw leaves it to the next call
  return facts[device];
}

// ---------------------------------------------------------------------------------------------
// Grouped GEMM launch

// CTAs of `Kernel` (threads and dynamic shared memory per CTA as given) that fit an SM, cached
// per device after the first launch there (which also raises the kernel's dynamic shared
// memory limit on that device). Errors name `where`.
template <auto Kernel>
int resident_ctas(int device, int threads, int smem_bytes, const char* where) {
  constexpr int cached_devices = 64;
  static std::array<std::atomic<int>, cached_devices> cache{};
  if (device >= 0 && device < cached_devices) {
    if (const int n = cache[device].load(std::memory_order_relaxed); n > 0) return n;
  }
  MOE_CUDA_CHECK(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  int n = 0;
  MOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, Kernel, threads, smem_bytes));
  MOE_EXPECT(n > 0, where,
             "the GEMM tuning does not fit on this device (" + std::to_string(smem_bytes) +
                 " bytes of shared memory per CTA)");
  if (device >= 0 && device < cached_devices) cache[device].store(n, std::memory_order_relaxed);
  return n;
}

// Output columns one CTA covers for a GEMM kind.
template <class Policy, kernels::moe_gemm_kind Kind>
constexpr int gemm_out_cols() {
  return Kind == kernels::moe_gemm_kind::gate_up ? Policy::tuning.block_n / 2 : Policy::tuning.block_n;
}

// What every mma.sync grouped GEMM launch (this one and the stream GEMM's) checks before it
// runs: the schedule's tile rows, the code the device runs, the sizes, and no K split across CTAs.
template <class T>
void check_mma_gemm_launch(const kernels::moe_gemm_params<T>& p, const tile_schedule& schedule, int block_m,
                           int min_arch, const device_facts& dev, const char* where) {
  MOE_EXPECT(schedule.block_m == block_m, where, "the tile schedule was built for another block_m");
  MOE_EXPECT(dev.code_arch >= min_arch, where,
             "the grouped GEMM tuning needs code compiled for sm_" + std::to_string(min_arch) +
                 " or newer; this device (sm_" + std::to_string(dev.arch) + ") runs code compiled for sm_" +
                 std::to_string(dev.code_arch));
  MOE_EXPECT(p.k > 0 && p.k % 8 == 0 && p.n > 0 && p.n % 8 == 0, where,
             "the GEMM's n and k must be positive multiples of 8");
  MOE_EXPECT(p.k_splits == 1 && p.store != kernels::down_store::partials, where,
             "this grouped GEMM does not split K across CTAs");
  MOE_EXPECT(p.raster_band >= 1, where, "raster_band must be positive");
  MOE_EXPECT(!p.expert_bands, where, "expert bands are the wgmma GEMMs' order (this GEMM walks fixed bands)");
}

// A persistent grid over the schedule's (M tile, N tile) items of `cols` output columns: as
// many CTAs as fit the device, or as items can exist. Fills p.tiles, p.tile_count, p.n_tiles.
template <class T>
unsigned persistent_gemm_grid(kernels::moe_gemm_params<T>& p, const tile_schedule& schedule, int cols,
                              int ctas_per_sm, const device_facts& dev) {
  const std::int64_t n_tiles = (p.n + cols - 1) / cols;
  const std::int64_t work_bound = schedule.capacity * n_tiles;
  const std::int64_t resident = static_cast<std::int64_t>(dev.sm_count) * ctas_per_sm;
  p.tiles = schedule.tiles;
  p.tile_count = schedule.count;
  p.n_tiles = static_cast<int>(n_tiles);
  return static_cast<unsigned>(std::min<std::int64_t>({work_bound, resident, 0x7fffffff}));
}

// Launches one grouped GEMM over the schedule's tiles. `p.tiles`, `p.tile_count` and
// `p.n_tiles` are filled here from `schedule`.
template <class T, class Policy, kernels::moe_gemm_kind Kind>
void launch_moe_gemm(kernels::moe_gemm_params<T> p, const tile_schedule& schedule, const device_facts& dev,
                     cudaStream_t stream) {
  constexpr grouped_gemm_tuning tuning = Policy::tuning;
  check_mma_gemm_launch(p, schedule, tuning.block_m, tuning.min_arch, dev, "gpu::launch_moe_gemm");
  MOE_EXPECT(p.local_ids == nullptr, "gpu::launch_moe_gemm", "only the stream GEMMs build their own schedule");
  if (schedule.capacity == 0) return;
  const int per_sm = resident_ctas<kernels::moe_grouped_gemm_kernel<T, Policy, Kind>>(
      dev.device, tuning.threads(), tuning.smem_bytes(), "gpu::launch_moe_gemm");
  const unsigned grid = persistent_gemm_grid(p, schedule, gemm_out_cols<Policy, Kind>(), per_sm, dev);
  kernels::moe_grouped_gemm_kernel<T, Policy, Kind><<<grid, tuning.threads(), tuning.smem_bytes(), stream>>>(p);
  MOE_CUDA_CHECK_LAUNCH("moe_grouped_gemm_kernel");
}

}  // namespace moerunner::gpu
