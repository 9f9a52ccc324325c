// Host launch code of the fused backend's decode GEMMs (kernel_stream_gemm.cuh): checks the
// schedule and sizes, and launches a persistent grid sized from the schedule's bound and the
// CTAs that fit the device, never from per-expert counts, so a run stays graph-capturable.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/gpu/stream_gemm.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "moerunner/gpu/cuda_check.hpp"
#include "moerunner/gpu/grouped_gemm.cuh"
#include "moerunner/gpu/grouped_gemm_tuning.hpp"
#include "moerunner/gpu/pdl_launch.cuh"
#include "moerunner/kernels/kernel_stream_gemm.cuh"

namespace moerunner::gpu {

// The persistent grid of a stream GEMM over `schedule` (fills p.tiles, p.tile_count, p.n_tiles).
template <class T, class Policy, kernels::moe_gemm_kind Kind, bool Fp8 = false>
unsigned stream_gemm_grid(kernels::moe_gemm_params<T>& p, const tile_schedule& schedule, const device_facts& dev) {
  const int per_sm = resident_ctas<kernels::moe_stream_gemm_kernel<T, Policy, Kind, Fp8>>(
      dev.device, Policy::tuning.threads(), Policy::tuning.smem_bytes(), "gpu::launch_moe_stream_gemm");
  return persistent_gemm_grid(p, schedule, kernels::moe_stream_gemm<T, Policy, Kind, Fp8>::out_cols, per_sm, dev);
}

// How the stream GEMMs use L2 (cuda_fused_policy::set_stream_l2). The defaults are what
// measured fastest on an H200 (bench/NOTES.md, round 9): weight copies evict-first (Qwen3-30B-A3B
// at one token 8% faster; likely because the act rows and the output GEMM2 adds into keep their
// L2 lines), 256-byte fetches where a warp walks 16 or more K tiles of its rows (DeepSeek-V3 and
// Mixtral-8x7B at 8 and 64 tokens 3-5% faster; with fewer, as on Qwen3-30B-A3B, 3% slower), and
// no prefetch of GEMM2's weights (it moved no cell forward: GEMM1 slowed by what GEMM2 gained).
struct stream_l2_use {
  std::int64_t prefetch_bytes = 0;  // GEMM2 weights GEMM1 asks L2 for (moe_stream_gemm::prefetch_next_weights);
                                    // -1: half the device's L2
  bool prefetch_at_end = false;     // asked for once a GEMM1 CTA has issued its last copies, not its first
  bool evict_first = true;          // both GEMMs' weight copies marked evict-first in L2
  int fetch_256_min_k_tiles = 16;   // a GEMM's weight copies ask HBM for the 256-byte block around them
                                    // where each warp walks at least this many K tiles (0: always)
  friend constexpr bool operator==(const stream_l2_use&, const stream_l2_use&) = default;
};

// Whether a stream GEMM of reduction length k (elements of elem_bytes: 2, or 1 for e4m3)
// fetches its weights 256 bytes at a time; its K tiles are 128-byte stage rows.
template <class Policy>
constexpr bool stream_fetch_256(const stream_l2_use& use, int k, int elem_bytes = 2) {
  constexpr int warps = Policy::tuning.warps, row_bytes = 128;
  const std::int64_t k_bytes = static_cast<std::int64_t>(k) * elem_bytes;
  return (k_bytes + row_bytes - 1) / row_bytes / warps >= use.fetch_256_min_k_tiles;
}
// By default: Mixtral-8x7B's GEMM1 (K = 4096, 16 tiles per warp) and DeepSeek-V3's (7168) fetch
// 256 bytes; Qwen3-30B-A3B's (2048) and every GEMM2 of K = I <= 2048 do not.
static_assert(stream_fetch_256<stream_gemm_policy>(stream_l2_use{}, 4096) &&
              !stream_fetch_256<stream_gemm_policy>(stream_l2_use{}, 2048));

// What GEMM1 of a stream pair needs to ask L2 for GEMM2's first weights as `use` says: GEMM2's
// operand `g2` as it will be launched, and its grid.
template <class T, class Policy>
typename kernels::moe_gemm_params<T>::next_gemm stream_next_gemm(kernels::moe_gemm_params<T> g2,
                                                                 const tile_schedule& schedule,
                                                                 const device_facts& dev, const stream_l2_use& use) {
  typename kernels::moe_gemm_params<T>::next_gemm nx;
  const std::int64_t bytes = use.prefetch_bytes < 0 ? dev.l2_bytes / 2 : use.prefetch_bytes;
  if (bytes <= 0 || schedule.capacity == 0) return nx;
  nx.grid = static_cast<int>(stream_gemm_grid<T, Policy, kernels::moe_gemm_kind::down>(g2, schedule, dev));
  nx.b = g2.b;
  nx.b_rows_per_expert = g2.b_rows_per_expert;
  nx.n = g2.n;
  nx.k = g2.k;
  nx.n_tiles = g2.n_tiles;
  nx.bytes = bytes;
  nx.at_end = use.prefetch_at_end;
  return nx;
}

// Launches one grouped GEMM of a stream tuning over the schedule's tiles (built for its
// block_m); `p.tiles`, `p.tile_count` and `p.n_tiles` are filled here from `schedule`, or with
// p.local_ids set each CTA builds the schedule itself and only the schedule's capacity (the
// grid's bound) and block_m are used. K is never split across CTAs (k_splits 1), so GEMM2
// stores rows, slots or adds into the output. Fp8: e4m3 operands with their scales
// (kernels::moe_gemm_fp8_params; K a multiple of 128; GEMM1 writes f32 act into act_f32).
template <class T, class Policy, kernels::moe_gemm_kind Kind, bool Fp8 = false>
void launch_moe_stream_gemm(typename kernels::moe_stream_gemm<T, Policy, Kind, Fp8>::params pp,
                            const tile_schedule& schedule, const device_facts& dev, cudaStream_t stream,
                            bool dependent_launch = false) {
  using tile_t = kernels::moe_stream_gemm<T, Policy, Kind, Fp8>;
  constexpr stream_gemm_tuning tuning = Policy::tuning;
  constexpr const char* where = "gpu::launch_moe_stream_gemm";
  kernels::moe_gemm_params<T>& p = tile_t::gemm(pp);
  check_mma_gemm_launch(p, schedule, tuning.schedule_block_m(), tuning.min_arch, dev, where);
  if constexpr (Fp8) {
    MOE_EXPECT(pp.a != nullptr && pp.a_scale != nullptr && pp.b != nullptr && pp.b_scale != nullptr, where,
               "fp8 operands need a, b and their scales");
    MOE_EXPECT(p.k % tile_t::bk == 0, where, "fp8 K must be a multiple of 128 (the scale blocks)");
    MOE_EXPECT(Kind == kernels::moe_gemm_kind::down || pp.act_f32 != nullptr, where,
               "the fp8 GEMM1 writes f32 act: act_f32 must be set");
    MOE_EXPECT(p.next.b == nullptr, where, "the fp8 GEMMs ask L2 for nothing ahead");
    MOE_EXPECT(!p.weights_evict_first, where, "the fp8 GEMMs' weight copies carry no L2 policy (see tile_t::l2_policy)");
  }
  MOE_EXPECT(p.local_ids != nullptr || (schedule.tiles != nullptr && schedule.count != nullptr), where,
             "the tile schedule is not built, and the GEMM is not asked to build its own");
  MOE_EXPECT(p.local_ids == nullptr || (p.local_slots >= 1 && p.local_slots <= kernels::local_plan_max_slots &&
                                        p.local_experts >= 1),
             where, "a schedule built in the GEMM takes 1 to " + std::to_string(kernels::local_plan_max_slots) +
                        " slots, got " + std::to_string(p.local_slots));
  MOE_EXPECT((p.local_error == nullptr && p.local_status == nullptr && p.local_slot_to_row == nullptr) ||
                 (p.local_ids != nullptr && Kind != kernels::moe_gemm_kind::down),
             where, "only GEMM1 building its own schedule writes the plan's error flag, the status and slot_to_row");
  MOE_EXPECT(p.local_status == nullptr || p.local_error != nullptr, where,
             "the status is written only with the plan's error flag");
  MOE_EXPECT(p.next.b == nullptr || (Kind != kernels::moe_gemm_kind::down && p.next.k > 0 && p.next.k % 8 == 0 &&
                                      p.next.n > 0 && p.next.n_tiles > 0 && p.next.bytes >= 0),
             where, "only GEMM1 asks L2 for the next GEMM's weights, and that GEMM's sizes must be set");
  MOE_EXPECT(p.combine.strips == nullptr ||
                 (Kind == kernels::moe_gemm_kind::down && !Fp8 && p.store == kernels::down_store::rows &&
                  p.combine.out != nullptr && p.combine.slot_to_row != nullptr && p.combine.tokens >= 0),
             where, "only the 16-bit GEMM2 storing rows combines them, into an output, with the plan's slot_to_row");
  if (schedule.capacity == 0) return;
  const unsigned grid = stream_gemm_grid<T, Policy, Kind, Fp8>(p, schedule, dev);
  launch_dependent(kernels::moe_stream_gemm_kernel<T, Policy, Kind, Fp8>, dim3(grid), dim3(tuning.threads()),
                   tuning.smem_bytes(), stream, dependent_launch, pp);
  MOE_CUDA_CHECK_LAUNCH("moe_stream_gemm_kernel");
}

}  // namespace moerunner::gpu
