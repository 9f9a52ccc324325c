// Device code for the gated activation between the two GEMMs, over the plan's valid rows.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/kernels/kernel_activation.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstdint>

#include "moerunner/core/config.hpp"
#include "moerunner/kernels/activation_math.cuh"
#include "moerunner/kernels/vector_io.cuh"

namespace moerunner::kernels {

// in [R, 2I] (gate columns, then up columns) or [R, I] when !gated; out [R, I]; f32 math.
// Each thread handles VEC consecutive columns; rows past the valid count end the block.
template <class T, int VEC>
__global__ void gated_activation_kernel(const T* __restrict__ in, T* __restrict__ out, int inter, bool gated,
                                        activation act, std::int64_t chunks_per_row, std::int64_t num_blocks,
                                        const std::int32_t* __restrict__ valid_rows) {
  const std::int64_t valid = *valid_rows;
  const std::int64_t in_stride = gated ? 2 * static_cast<std::int64_t>(inter) : inter;
  for (std::int64_t b = blockIdx.x; b < num_blocks; b += gridDim.x) {
    const std::int64_t row = b / chunks_per_row;
    if (row >= valid) return;
    const std::int64_t c = ((b % chunks_per_row) * blockDim.x + threadIdx.x) * VEC;
    if (c >= inter) continue;
    const T* src = in + row * in_stride + c;
    float gate[VEC], up[VEC], y[VEC];
    load_f32<VEC>(src, gate);
    if (gated) {
      load_f32<VEC>(src + inter, up);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) up[i] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) y[i] = apply_activation(act, gated, gate[i], up[i]);
    store_f32<VEC>(out + row * inter + c, y);
  }
}

}  // namespace moerunner::kernels
