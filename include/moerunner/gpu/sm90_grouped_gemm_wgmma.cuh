// Host launch code of the fused backend's Hopper wgmma grouped GEMMs (the opt-in
// sm90_wgmma tuning): encodes the weights' TMA descriptor for each launch (a host-only
// call, no stream work, so a run stays graph-capturable), checks that the device runs
// sm_90a code, and launches one persistent CTA per SM (or 2-CTA cluster per SM pair) over
// an M-tile schedule built as for the mma.sync kernels.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/gpu/sm90_grouped_gemm_wgmma.cuh needs nvcc: include it from a .cu file"
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "moerunner/core/error.hpp"
#include "moerunner/gpu/cuda_check.hpp"
#include "moerunner/gpu/fused_plan.hpp"
#include "moerunner/gpu/grouped_gemm.cuh"
#include "moerunner/gpu/grouped_gemm_tuning.hpp"
#include "moerunner/gpu/pdl_launch.cuh"
#include "moerunner/kernels/sm90_kernel_grouped_gemm_wgmma.cuh"

namespace moerunner::gpu {

// cuTensorMapEncodeTiled through the runtime's driver entry point, so that nothing links libcuda.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    MOE_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || f == nullptr)
      throw unsupported_error("gpu::tensor_map_encoder: the CUDA driver has no cuTensorMapEncodeTiled (needs 12.0+)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// The weights [E, rows_per_expert, k], rows_per_expert = halves * n, as a 4D map whose element
// (c, j, h, e) is column c of row j of half h (gate 0, up 1) of expert e, so that a box never
// crosses from gate rows into up rows or into the next expert: rows past n and columns past k
// read as zeros. Halves (row h * n + j) map as {k, n, halves, E}; interleaved gate/up rows (row
// 2j + h) as {k, 2, n, E}, the half before the row so that the strides still grow with the
// dimension. Boxes are box_rows rows x 128 bytes (one swizzle row: 64 16-bit elements or 128
// fp8 ones, as bytes) of one half of one expert, laid out in shared memory alike in both orders.
template <class T>
CUtensorMap weight_tensor_map(const T* b, std::int64_t rows_per_expert, int n, int k, int num_experts,
                              bool interleaved = false, int box_rows = 128) {
  constexpr const char* where = "gpu::weight_tensor_map";
  MOE_EXPECT(n > 0 && (rows_per_expert == n || rows_per_expert == 2 * static_cast<std::int64_t>(n)), where,
             "rows per expert must be n or 2n (gate and up halves)");
  MOE_EXPECT(!interleaved || rows_per_expert == 2 * static_cast<std::int64_t>(n), where,
             "interleaved gate/up rows need 2n rows per expert");
  const auto halves = static_cast<cuuint64_t>(rows_per_expert / n);
  const auto row_bytes = static_cast<cuuint64_t>(k) * sizeof(T);
  const cuuint64_t expert_bytes = static_cast<cuuint64_t>(rows_per_expert) * row_bytes;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(k), interleaved ? 2 : static_cast<cuuint64_t>(n),
                              interleaved ? static_cast<cuuint64_t>(n) : halves,
                              static_cast<cuuint64_t>(num_experts)};
  const cuuint64_t strides[3] = {row_bytes, interleaved ? 2 * row_bytes : static_cast<cuuint64_t>(n) * row_bytes,
                                 expert_bytes};
  MOE_EXPECT(box_rows > 0 && box_rows <= 256 && box_rows % 8 == 0, where, "box_rows must be a multiple of 8 up to 256");
  const cuuint32_t box[4] = {128 / sizeof(T), interleaved ? 1 : static_cast<cuuint32_t>(box_rows),
                             interleaved ? static_cast<cuuint32_t>(box_rows) : 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half> || std::is_same_v<T, std::uint8_t>,
                "weights are bf16, f16 or fp8 bytes");
  constexpr CUtensorMapDataType type = std::is_same_v<T, __nv_bfloat16> ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                       : std::is_same_v<T, __half>      ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                                        : CU_TENSOR_MAP_DATA_TYPE_UINT8;
  CUtensorMap map{};
  const CUresult r = tensor_map_encoder()(&map, type, 4, const_cast<T*>(b), dims, strides, box, element_strides,
                                          CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                          CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw cuda_error(std::string(where) + ": cuTensorMapEncodeTiled failed with CUresult " + std::to_string(r) +
                     " (k=" + std::to_string(k) + ", n=" + std::to_string(n) + ")");
  return map;
}

// Whether the device runs code that holds the wgmma kernel's body: only sm_90a images do,
// and the compute capability cannot tell an sm_90a image from an sm_90 one; the body's
// barriers are its only static shared memory, so a trap-only image reports none.
inline bool wgmma_gemm_available(const device_facts& dev) {
  constexpr int cached_devices = 64;
  static std::array<std::atomic<int>, cached_devices> cache{};  // 0 unknown, 1 no, 2 yes
  if (dev.device >= 0 && dev.device < cached_devices) {
    if (const int a = cache[dev.device].load(std::memory_order_relaxed); a > 0) return a == 2;
  }
  bool ok = false;
  if (dev.arch >= 90 && dev.code_arch >= 90) {
    cudaFuncAttributes attr{};
    MOE_CUDA_CHECK(cudaFuncGetAttributes(
        &attr, kernels::moe_grouped_gemm_wgmma_kernel<__nv_bfloat16, sm90_wgmma_gemm_policy,
                                                      kernels::moe_gemm_kind::down>));
    ok = attr.sharedSizeBytes > 0;
  }
  if (dev.device >= 0 && dev.device < cached_devices) cache[dev.device].store(ok ? 2 : 1, std::memory_order_relaxed);
  return ok;
}

// What the run plan reads of a device (gpu::make_fused_plan).
inline device_target device_target_of(const device_facts& dev) {
  return {dev.code_arch, wgmma_gemm_available(dev), dev.sm_count};
}

// The target of device `device`, asked with it made current for the query (the kernel images a
// device runs are asked of the current one); the caller's current device is restored.
inline device_target device_target_of(int device) {
  int current = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&current));
  MOE_CUDA_CHECK(cudaSetDevice(device));
  struct restore {
    int device;
    ~restore() { (void)cudaSetDevice(device); }
  } const back{current};
  return device_target_of(current_device_facts());
}

// The current device's target, or none (code_arch 0) where no device is usable: host-only
// callers size workspaces for the mma.sync family, which takes no K-split parts.
inline device_target current_device_target_or_none() {
  int device = 0, count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0 || cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: leave no error behind for the caller's next check
    return {};
  }
  return device_target_of(current_device_facts());
}

// Raises the kernel's dynamic shared memory limit on the device (once), checks that a CTA
// (a cluster of cluster_m CTAs) fits, and returns how many clusters run at once on the device,
// sm_count for single CTAs; a cluster needs its CTAs on SMs of one GPC, which may leave some
// SMs out.
template <class T, class Policy, kernels::moe_gemm_kind Kind, bool HandOut>
int prepare_wgmma_gemm(const device_facts& dev) {
  constexpr wgmma_gemm_tuning tuning = Policy::tuning;
  constexpr const char* where = "gpu::launch_moe_gemm_wgmma";
  constexpr int cached_devices = 64;
  static std::array<std::atomic<int>, cached_devices> places{};  // 0: not prepared yet
  const bool cached = dev.device >= 0 && dev.device < cached_devices;
  if (cached) {
    if (const int n = places[dev.device].load(std::memory_order_relaxed); n > 0) return n;
  }
  const auto kernel = kernels::moe_grouped_gemm_wgmma_kernel<T, Policy, Kind, HandOut>;
  MOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, tuning.smem_bytes()));
  int n = 0;
  if constexpr (tuning.cluster_m == 1) {
    MOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, tuning.threads(), tuning.smem_bytes()));
    n = n > 0 ? dev.sm_count : 0;
  } else {
    const launch_config c(dim3(tuning.cluster_m * dev.sm_count), dim3(tuning.threads()), tuning.smem_bytes(), nullptr,
                          false, tuning.cluster_m);
    MOE_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, kernel, &c.config));
  }
  MOE_EXPECT(n > 0, where,
             "the wgmma GEMM does not fit on this device (" + std::to_string(tuning.smem_bytes()) +
                 " bytes of shared memory per CTA, clusters of " + std::to_string(tuning.cluster_m) + ")");
  if (cached) places[dev.device].store(n, std::memory_order_relaxed);
  return n;
}

// What every 16-bit wgmma launch (the wide tiles' and the narrow ones') checks first: the code the
// device runs, the sizes, and interleaved gate/up rows only where GEMM1 reads them.
template <kernels::moe_gemm_kind Kind, class T>
void check_wgmma_gemm(const kernels::moe_gemm_params<T>& p, const device_facts& dev, const char* where) {
  if (!wgmma_gemm_available(dev))
    throw unsupported_error(std::string(where) + ": the wgmma GEMMs need code compiled for sm_90a; this device (sm_" +
                            std::to_string(dev.arch) + ") runs code compiled for sm_" + std::to_string(dev.code_arch) +
                            " without it");
  MOE_EXPECT(p.k > 0 && p.k % 8 == 0 && p.n > 0 && p.n % 8 == 0, where,
             "the GEMM's n and k must be positive multiples of 8");
  MOE_EXPECT(!p.interleaved || Kind == kernels::moe_gemm_kind::gate_up, where,
             "only the gated GEMM1 reads interleaved gate/up rows");
}

// What every wgmma launch's work items need (16-bit and fp8): K-split parts where GEMM2 stores
// them, a positive raster band, and expert bands only over a schedule written with them.
template <class T>
void check_wgmma_items(const kernels::moe_gemm_params<T>& p, const tile_schedule& schedule, const char* where) {
  MOE_EXPECT(p.store != kernels::down_store::partials || p.partials != nullptr, where, "partials is null");
  MOE_EXPECT(p.raster_band >= 1, where, "raster_band must be positive");
  MOE_EXPECT(!p.expert_bands || schedule.expert_band > 0, where,
             "expert bands need a schedule written with them (its tiles carry the band words)");
}

// Launches one grouped GEMM of a wgmma tuning (Policy: sm90_wgmma_gemm_policy,
// sm90_wgmma_m128x2_gemm_policy, sm90_wgmma_m64_gemm_policy or sm90_wgmma_m64n128_gemm_policy,
// whose schedule_block_m the schedule must have been built for); `p.tiles`, `p.tile_count`
// and `p.n_tiles` are filled here from `schedule`, as launch_moe_gemm does. With p.item_counter
// (zero: schedule.item_counters) the work items are handed out at run time.
template <class T, kernels::moe_gemm_kind Kind, class Policy = sm90_wgmma_gemm_policy>
void launch_moe_gemm_wgmma(kernels::moe_gemm_params<T> p, int num_experts, const tile_schedule& schedule,
                           const device_facts& dev, cudaStream_t stream, bool dependent_launch = false) {
  constexpr const char* where = "gpu::launch_moe_gemm_wgmma";
  constexpr wgmma_gemm_tuning tuning = Policy::tuning;
  MOE_EXPECT(schedule.block_m == tuning.schedule_block_m(), where,
             "the tile schedule was built for another block_m (a cluster's CTAs share one schedule tile)");
  check_wgmma_gemm<Kind>(p, dev, where);
  if (schedule.capacity == 0) return;
  const CUtensorMap map =
      weight_tensor_map(p.b, p.b_rows_per_expert, p.n, p.k, num_experts, p.interleaved, tuning.block_n / 2);
  // A rows in plan order [a_rows, k] (GEMM1: x's, gathered by a kernel before; GEMM2: act, as
  // GEMM1 wrote it) as one expert's rows of a weight-shaped map: boxes of block_m rows, zeros
  // past a_rows. Without them the kernel never reads the map (B's is passed).
  MOE_EXPECT(!p.a_gathered || (p.a_rows > 0 && p.a_rows <= 0x7fffffff), where,
             "A rows in plan order need their count");
  const CUtensorMap a_map = p.a_gathered ? weight_tensor_map(p.a, p.a_rows, static_cast<int>(p.a_rows), p.k, 1,
                                                             false, tuning.block_m)
                                         : map;
  const bool hand_out = p.item_counter != nullptr;
  const int places =
      hand_out ? prepare_wgmma_gemm<T, Policy, Kind, true>(dev) : prepare_wgmma_gemm<T, Policy, Kind, false>(dev);
  constexpr int cols = kernels::moe_gemm_wgmma<T, Policy, Kind>::out_cols;
  const std::int64_t n_tiles = (p.n + cols - 1) / cols;
  const int k_splits = p.k_splits;
  MOE_EXPECT(p.local_ids == nullptr, where, "only the stream GEMMs build their own schedule");
  const bool may_split = Kind == kernels::moe_gemm_kind::down && (p.store == kernels::down_store::accumulate ||
                                                                   p.store == kernels::down_store::partials);
  MOE_EXPECT(k_splits == 1 || (may_split && k_splits >= 1 && k_splits <= (p.k + tuning.block_k - 1) / tuning.block_k),
             where, "k_splits must be 1, or for GEMM2 into the output or partials at most the K tiles, got " +
                        std::to_string(k_splits));
  check_wgmma_items(p, schedule, where);
  // One work item per cluster at a time: as many clusters as run at once, or as items.
  const std::int64_t work_bound = schedule.capacity * n_tiles * k_splits;
  const std::int64_t clusters = std::min<std::int64_t>({work_bound, places, 0x7fffffff / tuning.cluster_m});
  MOE_EXPECT(!hand_out || hand_out_items_fit(work_bound, clusters), where,
             "too many work items to hand out at run time (they are numbered in 32 bits)");
  p.tiles = schedule.tiles;
  p.tile_count = schedule.count;
  p.n_tiles = static_cast<int>(n_tiles);
  // The CTAs may start (barrier set-up, descriptor prefetch) while the previous kernel drains.
  const dim3 grid(static_cast<unsigned>(clusters * tuning.cluster_m));
  if (hand_out)
    launch_dependent_clusters(kernels::moe_grouped_gemm_wgmma_kernel<T, Policy, Kind, true>, grid,
                              dim3(tuning.threads()), tuning.smem_bytes(), stream, dependent_launch, tuning.cluster_m,
                              p, map, a_map);
  else
    launch_dependent_clusters(kernels::moe_grouped_gemm_wgmma_kernel<T, Policy, Kind, false>, grid,
                              dim3(tuning.threads()), tuning.smem_bytes(), stream, dependent_launch, tuning.cluster_m,
                              p, map, a_map);
  MOE_CUDA_CHECK_LAUNCH("moe_grouped_gemm_wgmma_kernel");
}

}  // namespace moerunner::gpu
