// Device code of fp8 e4m3 group quantization: rows cut into groups of 128 consecutive values,
// each stored as e4m3 with one f32 scale. One rule for every place that quantizes (the input
// rows here, GEMM1's act in the fp8 GEMM's epilogue), the rule the reference mirrors
// (reference_policy.hpp, fp8_group_roundtrip): scale = amax / 448 (1 where amax is 0, 2^-126
// where the quotient is smaller; NaN values do not count towards amax), q = e4m3(v * (1 / scale))
// rounded to nearest even and saturated to +-448 (NaN stays NaN); each operation an f32 one,
// rounded to nearest, so the host computes the same bits. One reciprocal per group and a
// multiplication per value: an IEEE division per value (a refinement and a slow-path branch)
// took ~10 instructions of GEMM1's epilogue per act value (bench/NOTES.md, round 16). The
// 2^-126 floor keeps 1 / scale finite, so a group of tiny values never multiplies 0 by inf.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/kernels/kernel_quantize_fp8.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstdint>
#include <type_traits>

#include <cuda_fp8.h>

#include "moerunner/kernels/pdl.cuh"
#include "moerunner/kernels/vector_io.cuh"
#include "moerunner/quant/quant_info.hpp"

namespace moerunner::kernels {

inline constexpr int fp8_group = fp8_block_quant_info::group;
inline constexpr float fp8_e4m3_max = 448.0f;

inline constexpr float fp8_min_scale = 1.17549435e-38f;  // 2^-126, the smallest normal f32

__device__ __forceinline__ float fp8_group_scale(float amax) {
  return amax > 0.0f ? fmaxf(__fdiv_rn(amax, fp8_e4m3_max), fp8_min_scale) : 1.0f;
}

// What the group's values are multiplied by (at most 2^126: finite).
__device__ __forceinline__ float fp8_group_inverse(float scale) { return __frcp_rn(scale); }

// Two values times their group's inverse scale, as two e4m3 bytes (lo at the lower address).
__device__ __forceinline__ std::uint16_t fp8_pack2(float lo, float hi, float inverse) {
  return __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(lo, inverse), __fmul_rn(hi, inverse)), __NV_SATFINITE,
                                  __NV_E4M3);
}

// A warp's group of 128 values, four per lane: the lane's four as e4m3 bytes (packed, the first
// at the lowest address) and the group's scale.
struct fp8_lane_quad {
  std::uint32_t packed;
  float scale;
};
__device__ __forceinline__ fp8_lane_quad quantize_warp_group(const float (&f)[4]) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) amax = fmaxf(amax, fabsf(f[i]));
#pragma unroll
  for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float scale = fp8_group_scale(amax), inverse = fp8_group_inverse(scale);
  return {static_cast<std::uint32_t>(fp8_pack2(f[0], f[1], inverse)) |
              (static_cast<std::uint32_t>(fp8_pack2(f[2], f[3], inverse)) << 16),
          scale};
}

// One warp: the f32 group of 128 at src (lane l: values 4l .. 4l + 3; src 16-byte aligned),
// quantized by quantize_warp_group into row `row` of q [rows, n] from column col (a multiple of
// 128), e4m3, and its scale into scales [rows, n / 128] (from lane 0). The fp8 GEMMs' staged
// GEMM1 epilogues store act this way.
__device__ __forceinline__ void quantize_group_to(const float* src, std::int64_t row, int col, int n, std::uint8_t* q,
                                                  float* scales, int lane) {
  const float4 v = *reinterpret_cast<const float4*>(src + 4 * lane);
  const float f[4] = {v.x, v.y, v.z, v.w};
  const fp8_lane_quad r = quantize_warp_group(f);
  *reinterpret_cast<std::uint32_t*>(q + row * n + col + 4 * lane) = r.packed;
  if (lane == 0) scales[row * (n / fp8_group) + col / fp8_group] = r.scale;
}

// One warp per group of 128 (4 values per lane, one load each): q [rows, h] e4m3 and scales
// [rows, h / 128]; h is a multiple of 128, x aligned to 4 values (T: bf16, f16 or f32). May be
// launched as a programmatic dependent of the kernel that writes x.
template <class T>
__global__ void quantize_rows_fp8_kernel(const T* __restrict__ x, std::int64_t groups, int h,
                                         std::uint8_t* __restrict__ q, float* __restrict__ scales) {
  wait_for_prior_grids();
  allow_dependent_grids();
  const std::int64_t group = static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (group >= groups) return;
  const int lane = threadIdx.x % 32;
  const int per_row = h / fp8_group;
  const std::int64_t first = (group / per_row) * h + (group % per_row) * fp8_group + 4 * lane;
  using four = std::conditional_t<sizeof(T) == 4, uint4, uint2>;
  const four raw = *reinterpret_cast<const four*>(x + first);
  const T* v = reinterpret_cast<const T*>(&raw);
  float f[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) f[i] = to_f32(v[i]);
  const fp8_lane_quad r = quantize_warp_group(f);
  *reinterpret_cast<std::uint32_t*>(q + first) = r.packed;
  if (lane == 0) scales[group] = r.scale;
}

}  // namespace moerunner::kernels
