// Device code that adds each expert's bias to its rows of an expert-sorted [R, cols] buffer.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/kernels/kernel_expert_bias.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstdint>

#include "moerunner/kernels/vector_io.cuh"

namespace moerunner::kernels {

// The expert whose rows [offsets[e], offsets[e + 1]) hold `row` < offsets[num_experts]: the last
// e with offsets[e] <= row (an empty expert before it shares its offset, one after it cannot).
__device__ __forceinline__ int expert_of_row(const std::int32_t* offsets, int num_experts, std::int64_t row) {
  int lo = 0, hi = num_experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= row) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// rows[r, c] += bias[e, c] for every valid row r (r < offsets[num_experts]) of expert e, in f32,
// rounded once. One element per thread; rows past the valid count end the block.
template <class T, class B>
__global__ void add_expert_bias_kernel(T* __restrict__ rows, std::int64_t cols, const B* __restrict__ bias,
                                       const std::int32_t* __restrict__ offsets, int num_experts,
                                       std::int64_t chunks_per_row, std::int64_t num_blocks) {
  const std::int64_t valid = offsets[num_experts];
  for (std::int64_t b = blockIdx.x; b < num_blocks; b += gridDim.x) {
    const std::int64_t row = b / chunks_per_row;
    if (row >= valid) return;
    const std::int64_t c = (b % chunks_per_row) * blockDim.x + threadIdx.x;
    if (c >= cols) continue;
    const int e = expert_of_row(offsets, num_experts, row);
    T& v = rows[row * cols + c];
    v = from_f32<T>(to_f32(v) + to_f32(bias[e * cols + c]));
  }
}

}  // namespace moerunner::kernels
