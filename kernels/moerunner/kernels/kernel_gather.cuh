// Device code that copies each token's input row to every expert-sorted row that uses it.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/kernels/kernel_gather.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstdint>

namespace moerunner::kernels {

// V is the unit copied per thread (uint4 when rows are 16-byte aligned, else one element).
// Blocks b = row * chunks_per_row + chunk; rows past the plan's valid count (read on the
// device, no host round trip) end the block.
template <class V>
__global__ void gather_rows_kernel(const V* __restrict__ x, V* __restrict__ rows, std::int64_t vecs_per_row,
                                   std::int64_t chunks_per_row, std::int64_t num_blocks,
                                   const std::int32_t* __restrict__ valid_rows,
                                   const std::int32_t* __restrict__ row_to_slot, int top_k) {
  const std::int64_t valid = *valid_rows;
  for (std::int64_t b = blockIdx.x; b < num_blocks; b += gridDim.x) {
    const std::int64_t row = b / chunks_per_row;
    if (row >= valid) return;
    const std::int64_t c = (b % chunks_per_row) * blockDim.x + threadIdx.x;
    if (c >= vecs_per_row) continue;
    const std::int64_t token = row_to_slot[row] / top_k;
    rows[row * vecs_per_row + c] = x[token * vecs_per_row + c];
  }
}

}  // namespace moerunner::kernels
