// Device code that sums each token's expert rows back into its output row, in slot order.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/kernels/kernel_combine.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstdint>

#include "moerunner/kernels/vector_io.cuh"
#include "moerunner/kernels/pdl.cuh"

namespace moerunner::kernels {

// The row `row` as f32: the sum of its `splits` parts (split_stride elements apart) in order.
// L2Only: read through L2 (rows written by other CTAs of the running kernel).
template <int VEC, bool L2Only = false, class TIn>
__device__ __forceinline__ void load_row_parts(const TIn* rows, std::int64_t row, std::int64_t hidden, std::int64_t c,
                                               int splits, std::int64_t split_stride, float (&v)[VEC]) {
  load_f32<VEC, L2Only>(rows + row * hidden + c, v);
  for (int s = 1; s < splits; ++s) {
    float part[VEC];
    load_f32<VEC, L2Only>(rows + s * split_stride + row * hidden + c, part);
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] += part[i];
  }
}

// sum_{j = 0..k-1} w[t, j] * rows[slot_to_row[t * k + j]] over columns [c, c + VEC) of the token
// whose first slot is first_slot (w = 1 without weights), skipping filtered slots, accumulated
// in f32 in slot order from zero: combine_rows_kernel's sum, and the stream GEMM2's where it
// combines in its last CTAs (the same bits either way). Slots in batches: a batch's row
// indices, then all its rows, are loaded before any sum, so a token pays two memory round
// trips per batch instead of two per slot. (At one token on an H200 this measured no faster:
// the kernel's launch and completion outweigh its loads; bench/NOTES.md, round 9.)
inline constexpr int combine_batch = 8;  // slots whose rows are loaded together
template <int VEC, bool L2Only = false, class TIn>
__device__ __forceinline__ void combine_sum(const TIn* rows, std::int64_t hidden, std::int64_t c,
                                            std::int64_t first_slot, int top_k, const std::int32_t* slot_to_row,
                                            const float* weights, int splits, std::int64_t split_stride,
                                            float (&acc)[VEC]) {
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc[i] = 0.0f;
  for (int j0 = 0; j0 < top_k; j0 += combine_batch) {
    std::int64_t row[combine_batch];
    float w[combine_batch];
#pragma unroll
    for (int b = 0; b < combine_batch; ++b) {
      const bool in = j0 + b < top_k;
      row[b] = in ? (L2Only ? __ldcg(slot_to_row + first_slot + j0 + b) : slot_to_row[first_slot + j0 + b]) : -1;
      w[b] = in && weights != nullptr ? weights[first_slot + j0 + b] : 1.0f;
    }
    float v[combine_batch][VEC];
#pragma unroll
    for (int b = 0; b < combine_batch; ++b)
      if (row[b] >= 0) load_row_parts<VEC, L2Only>(rows, row[b], hidden, c, splits, split_stride, v[b]);
#pragma unroll
    for (int b = 0; b < combine_batch; ++b) {
      if (row[b] < 0) continue;
      if (weights != nullptr) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] = fmaf(w[b], v[b][i], acc[i]);
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] += v[b][i];
      }
    }
  }
}

// out[t] = scale * sum_{j = 0..k-1} w[t, j] * rows[slot_to_row[t * k + j]] (combine_sum), rounded
// once: the same bits on every run. With no_combine, out[t, j] = scale * w[t, j] * row, or 0
// when filtered. A row given as `splits` parts (K-split GEMM partial sums) is their sum in
// split order.
template <class TIn, class TOut, int VEC>
__global__ void combine_rows_kernel(const TIn* __restrict__ rows, TOut* __restrict__ out, std::int64_t hidden,
                                    std::int64_t chunks_per_row, std::int64_t num_blocks, int top_k,
                                    const std::int32_t* __restrict__ slot_to_row,
                                    const float* __restrict__ weights, float scale, bool no_combine, int splits,
                                    std::int64_t split_stride) {
  wait_for_prior_grids();  // launched as GEMM2's programmatic dependent: its rows come first
  for (std::int64_t b = blockIdx.x; b < num_blocks; b += gridDim.x) {
    const std::int64_t token = b / chunks_per_row;
    const std::int64_t c = ((b % chunks_per_row) * blockDim.x + threadIdx.x) * VEC;
    if (c >= hidden) continue;
    const std::int64_t first_slot = token * top_k;
    if (!no_combine) {
      float acc[VEC];
      combine_sum<VEC>(rows, hidden, c, first_slot, top_k, slot_to_row, weights, splits, split_stride, acc);
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] *= scale;
      store_f32<VEC>(out + token * hidden + c, acc);
    } else {
      for (int j = 0; j < top_k; ++j) {
        const std::int64_t row = slot_to_row[first_slot + j];
        float v[VEC];
        if (row < 0) {
#pragma unroll
          for (int i = 0; i < VEC; ++i) v[i] = 0.0f;
        } else {
          load_row_parts<VEC>(rows, row, hidden, c, splits, split_stride, v);
          const float w = weights != nullptr ? weights[first_slot + j] : 1.0f;
#pragma unroll
          for (int i = 0; i < VEC; ++i) v[i] = scale * (w * v[i]);
        }
        store_f32<VEC>(out + (first_slot + j) * hidden + c, v);
      }
    }
  }
}

}  // namespace moerunner::kernels
