// Device code that multiplies each expert-sorted row by its slot's router weight
// (apply_router_weight_on_input: the weight scales the GEMM1 input, not the output).
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/kernels/kernel_scale_rows.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace moerunner::kernels {

// One block per possible row; rows past the plan's valid count (read on the device,
// so no host round trip is needed) return at once.
template <class T>
__global__ void scale_rows_kernel(T* __restrict__ rows, std::int64_t hidden,
                                  const std::int32_t* __restrict__ valid_rows,
                                  const std::int32_t* __restrict__ row_to_slot,
                                  const float* __restrict__ slot_weights) {
  const std::int64_t row = blockIdx.x;
  if (row >= *valid_rows) return;
  const float w = slot_weights[row_to_slot[row]];
  T* r = rows + row * hidden;
  for (std::int64_t c = threadIdx.x; c < hidden; c += blockDim.x) r[c] = static_cast<T>(static_cast<float>(r[c]) * w);
}

}  // namespace moerunner::kernels
