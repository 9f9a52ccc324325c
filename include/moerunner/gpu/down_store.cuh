// Where a fused run's GEMM2 puts its rows (the run plan's down_store) and the combine kernel that
// sums them afterwards, for the 16-bit and the fp8 backends alike.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/gpu/down_store.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstdint>

#include <cuda_runtime_api.h>

#include "moerunner/core/tensor_view.hpp"
#include "moerunner/gpu/combine.cuh"
#include "moerunner/gpu/routing_plan.hpp"
#include "moerunner/kernels/kernel_grouped_gemm.cuh"

namespace moerunner::gpu {

// GEMM2 (g2.n = H set) stores as `store` says: f32 K-split parts [splits, slots, H] or 16-bit
// rows [slots, H] in `rows` (the workspace's piece), or into the output: its tokens' rows times
// row_weights (null: applied on the input) and scale, or its [token, slot] places.
template <class T>
void set_down_store(kernels::moe_gemm_params<T>& g2, down_store store, void* rows, std::int64_t slots,
                    const tensor_view& out, const float* row_weights, float scale) {
  g2.store = store;
  if (store == down_store::partials) {
    g2.partials = static_cast<float*>(rows);
    g2.split_stride = slots * g2.n;
  } else if (store == down_store::rows) {
    g2.c = static_cast<T*>(rows);
  } else {
    g2.c = static_cast<T*>(out.data);
    g2.out_weights = row_weights;
    g2.out_scale = scale;
  }
}

// The combine kernel GEMM2's parts (summed in split order) or rows (in slot order) need, after
// GEMM2 (as its programmatic dependent where `dependent`); none where GEMM2 stored into the output.
template <class T>
void combine_down(const kernels::moe_gemm_params<T>& g2, const routing_plan& plan, const float* row_weights,
                  float scale, const tensor_view& out, cudaStream_t stream, bool dependent) {
  if (g2.store == down_store::partials)
    combine_rows(g2.partials, dtype::f32, plan, row_weights, scale, out, false, stream, g2.k_splits, dependent);
  else if (g2.store == down_store::rows)
    combine_rows(g2.c, out.type, plan, row_weights, scale, out, false, stream, 1, dependent);
}

}  // namespace moerunner::gpu
