// Device code of the fp8 GEMM1's epilogue where GEMM1 ran in K splits (gpu::fp8_plan::up_k_splits):
// its f32 parts (moe_gemm_fp8_params::up_parts) summed in split order, times the row's router
// weight where it is applied on the input, the activation, and act quantized per 128 columns by
// kernel_quantize_fp8.cuh's rule: the values and rounding of the wgmma kernel's own epilogue
// (store_act), but for the order in which K's sums were added.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/kernels/kernel_fp8_up_parts.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstdint>

#include "moerunner/gpu/grouped_gemm_tuning.hpp"
#include "moerunner/kernels/activation_math.cuh"
#include "moerunner/kernels/kernel_quantize_fp8.cuh"
#include "moerunner/kernels/pdl.cuh"

namespace moerunner::kernels {

struct up_parts_args {
  const float* parts = nullptr;  // [splits, rows, gated ? 2n : n]: gate columns, then up
  std::int64_t split_stride = 0;  // floats per split
  int splits = 1;
  int n = 0;  // act columns (a multiple of 128)
  bool gated = true;
  activation act;
  const float* input_weights = nullptr;  // the router weight on the input: [slots], or null
  const std::int32_t* row_to_slot = nullptr;
  const gpu::moe_m_tile* tiles = nullptr;  // the schedule GEMM1 ran: only its rows have parts
  const std::int32_t* tile_count = nullptr;
  std::uint8_t* act_q = nullptr;  // e4m3 act [rows, n]
  float* act_scale = nullptr;     // [rows, n / 128]
};

inline constexpr int up_parts_threads = 256;

// One CTA of Threads per schedule tile (those past the tile count return), one warp per row and
// group of 128 columns at a time, four columns a lane. Launched as GEMM1's programmatic
// dependent. (A template: the translation units that include this header share one definition.)
template <int Threads>
__global__ void __launch_bounds__(Threads) finish_up_parts_kernel(const up_parts_args a) {
  wait_for_prior_grids();
  allow_dependent_grids();
  if (static_cast<int>(blockIdx.x) >= *a.tile_count) return;
  const gpu::moe_m_tile tile = a.tiles[blockIdx.x];
  const int groups = a.n / fp8_group;
  const int warps = Threads / 32, warp = static_cast<int>(threadIdx.x) / 32, lane = threadIdx.x % 32;
  const std::int64_t width = a.gated ? 2 * static_cast<std::int64_t>(a.n) : a.n;
  const int tasks = (tile.row_end - tile.row_begin) * groups;
  for (int t = warp; t < tasks; t += warps) {
    const std::int64_t row = tile.row_begin + t / groups;
    const int col = (t % groups) * fp8_group + 4 * lane;
    const float* src = a.parts + row * width + col;
    float gate[4], up[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    {
      const float4 g = *reinterpret_cast<const float4*>(src);
      gate[0] = g.x, gate[1] = g.y, gate[2] = g.z, gate[3] = g.w;
      if (a.gated) {
        const float4 u = *reinterpret_cast<const float4*>(src + a.n);
        up[0] = u.x, up[1] = u.y, up[2] = u.z, up[3] = u.w;
      }
    }
    for (int s = 1; s < a.splits; ++s) {
      const float* part = src + s * a.split_stride;
      const float4 g = *reinterpret_cast<const float4*>(part);
      gate[0] += g.x, gate[1] += g.y, gate[2] += g.z, gate[3] += g.w;
      if (a.gated) {
        const float4 u = *reinterpret_cast<const float4*>(part + a.n);
        up[0] += u.x, up[1] += u.y, up[2] += u.z, up[3] += u.w;
      }
    }
    // act(W (w x)) = act(w (W x)): the router weight scales the sums, as in the GEMM's epilogue.
    const float weight = a.input_weights != nullptr ? a.input_weights[a.row_to_slot[row]] : 1.0f;
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = apply_activation(a.act, a.gated, gate[i] * weight, up[i] * weight);
    const fp8_lane_quad r = quantize_warp_group(v);
    *reinterpret_cast<std::uint32_t*>(a.act_q + row * a.n + col) = r.packed;
    if (lane == 0) a.act_scale[row * groups + t % groups] = r.scale;
  }
}

}  // namespace moerunner::kernels
