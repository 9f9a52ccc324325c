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

// in [R, 2I] (gate columns, then up columns; interleaved: column 2i gate i, 2i + 1 up i) or
// [R, I] when !gated; out [R, I]; f32 math. Each thread handles VEC consecutive columns; rows
// past the valid count end the block.
template <class T, int VEC>
__global__ void gated_activation_kernel(const T* __restrict__ in, T* __restrict__ out, int inter, bool gated,
                                        bool interleaved, activation act, std::int64_t chunks_per_row,
                                        std::int64_t num_blocks, const std::int32_t* __restrict__ valid_rows) {
  const std::int64_t valid = *valid_rows;
  const std::int64_t in_stride = gated ? 2 * static_cast<std::int64_t>(inter) : inter;
  for (std::int64_t b = blockIdx.x; b < num_blocks; b += gridDim.x) {
    const std::int64_t row = b / chunks_per_row;
    if (row >= valid) return;
    const std::int64_t c = ((b % chunks_per_row) * blockDim.x + threadIdx.x) * VEC;
    if (c >= inter) continue;
    const T* src = in + row * in_stride + c;
    float gate[VEC], up[VEC], y[VEC];
    if (interleaved) {
      float pairs[2][VEC];  // the 2 VEC values from column 2c on
      load_f32<VEC>(in + row * in_stride + 2 * c, pairs[0]);
      load_f32<VEC>(in + row * in_stride + 2 * c + VEC, pairs[1]);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        gate[i] = pairs[(2 * i) / VEC][(2 * i) % VEC];
        up[i] = pairs[(2 * i + 1) / VEC][(2 * i + 1) % VEC];
      }
    } else if (gated) {
      load_f32<VEC>(src, gate);
      load_f32<VEC>(src + inter, up);
    } else {
      load_f32<VEC>(src, gate);
#pragma unroll
      for (int i = 0; i < VEC; ++i) up[i] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) y[i] = apply_activation(act, gated, gate[i], up[i]);
    store_f32<VEC>(out + row * inter + c, y);
  }
}

}  // namespace moerunner::kernels
