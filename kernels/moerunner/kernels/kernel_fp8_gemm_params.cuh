// The operands of the fp8 GEMMs (the wgmma kernels and the decode stream GEMMs): e4m3 A and B
// with f32 scales, around the 16-bit kernels' parameters.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/kernels/kernel_fp8_gemm_params.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstdint>

#include "moerunner/kernels/kernel_grouped_gemm.cuh"
#include "moerunner/quant/quant_info.hpp"

namespace moerunner::kernels {

// T: the output's 16-bit type (GEMM2's rows and output). `g` carries the schedule, sizes, row
// order, router weights and GEMM2's store as for the 16-bit kernels; its a, b and c are not read
// by the fp8 kernels except GEMM2's c (the output or rows).
template <class T>
struct moe_gemm_fp8_params {
  moe_gemm_params<T> g;
  const std::uint8_t* a = nullptr;  // e4m3: GEMM1 x [M, k] (rows gathered), GEMM2 act [R, k]
  const float* a_scale = nullptr;   // [rows of a, k / 128]
  const std::uint8_t* b = nullptr;  // stream GEMMs: e4m3 weights [E, b_rows_per_expert, k] (wgmma: a tensor map)
  const float* b_scale = nullptr;   // block128: [E, b_rows_per_expert / 128, k / 128]; per_tensor:
                                    // [E]; per_channel: [E, b_rows_per_expert]
  fp8_weight_scaling b_scaling = fp8_weight_scaling::block128;
  std::uint8_t* act = nullptr;      // wgmma GEMM1: e4m3 act [R, n]
  float* act_scale = nullptr;       // wgmma GEMM1: [R, n / 128]
  float* act_f32 = nullptr;         // stream GEMM1: f32 act [R, n], quantized by its own kernel
  // wgmma GEMM1 with K splits (g.k_splits > 1): each item's f32 sums of its K range, as
  // up_parts[split * up_parts_stride + row * halves * n + c] (gate_up: gate columns c < n, then
  // up), for finish_up_parts_kernel; act and act_scale are then that kernel's to write.
  float* up_parts = nullptr;
  std::int64_t up_parts_stride = 0;
  // wgmma GEMM2: act's rows (already in plan order) loaded by TMA through the kernel's A tensor
  // map, one box per stage, instead of by the producer threads' cp.async.
  bool a_tma = false;
};

// The scale of B rows [row, row + 32) (one 128-row block) for K tile kt of expert e, 1 where
// the epilogue applies per-channel scales.
template <class T>
__device__ __forceinline__ float fp8_b_block_scale(const moe_gemm_fp8_params<T>& p, int e, std::int64_t row, int kt) {
  switch (p.b_scaling) {
    case fp8_weight_scaling::per_tensor: return __ldg(p.b_scale + e);
    case fp8_weight_scaling::per_channel: return 1.0f;
    case fp8_weight_scaling::block128: break;
  }
  const std::int64_t blocks_per_expert = p.g.b_rows_per_expert / 128, k_tiles = p.g.k / 128;
  return __ldg(p.b_scale + (e * blocks_per_expert + row / 128) * k_tiles + kt);
}

}  // namespace moerunner::kernels
