// Host launch for kernel_scale_rows: rows [valid, H] of a routing plan, each
// multiplied in place by its slot's router weight.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/gpu/scale_rows.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "moerunner/core/dtype.hpp"
#include "moerunner/core/error.hpp"
#include "moerunner/gpu/cuda_check.hpp"
#include "moerunner/gpu/routing_plan.hpp"
#include "moerunner/kernels/kernel_scale_rows.cuh"

namespace moerunner::gpu {

// `rows` holds the plan's rows in expert order; `slot_weights` is topk_weights [M, k] on the device.
inline void scale_rows_by_weight(void* rows, dtype type, std::int64_t hidden, const routing_plan& plan,
                                 const float* slot_weights, cudaStream_t stream) {
  constexpr const char* where = "gpu::scale_rows_by_weight";
  MOE_EXPECT(type == dtype::bf16 || type == dtype::f16, where,
             "rows must be bf16 or f16, got " + std::string(dtype_name(type)));
  MOE_EXPECT(hidden > 0, where, "hidden size must be positive");
  const std::int64_t max_rows = plan.num_tokens * plan.top_k;
  if (max_rows == 0) return;
  MOE_EXPECT(rows != nullptr && slot_weights != nullptr, where, "rows and slot_weights must not be null");
  MOE_EXPECT(max_rows <= 0x7fffffff, where, "too many token slots for one launch");
  const dim3 grid(static_cast<unsigned>(max_rows));
  const dim3 block(hidden >= 256 ? 256 : 128);
  const std::int32_t* valid = plan.expert_offsets + plan.num_experts;
  if (type == dtype::bf16) {
    kernels::scale_rows_kernel<__nv_bfloat16><<<grid, block, 0, stream>>>(
        static_cast<__nv_bfloat16*>(rows), hidden, valid, plan.row_to_slot, slot_weights);
  } else {
    kernels::scale_rows_kernel<__half><<<grid, block, 0, stream>>>(static_cast<__half*>(rows), hidden, valid,
                                                                   plan.row_to_slot, slot_weights);
  }
  MOE_CUDA_CHECK_LAUNCH("scale_rows_kernel");
}

}  // namespace moerunner::gpu
