// Host launch for kernel_expert_bias: per-expert biases added to expert-sorted rows (the
// cublas_grouped backend's GEMM outputs).
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/gpu/expert_bias.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstdint>
#include <string>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "moerunner/core/dtype.hpp"
#include "moerunner/core/tensor_view.hpp"
#include "moerunner/gpu/cuda_check.hpp"
#include "moerunner/gpu/routing_plan.hpp"
#include "moerunner/gpu/row_launch.hpp"
#include "moerunner/kernels/kernel_expert_bias.cuh"

namespace moerunner::gpu {

namespace expert_bias_launch {

template <class T, class B>
void launch(void* rows, std::int64_t cols, const void* bias, const routing_plan& plan, cudaStream_t stream) {
  const row_launch l = make_row_launch(plan.num_tokens * plan.top_k, cols);
  kernels::add_expert_bias_kernel<T, B><<<l.grid, l.threads, 0, stream>>>(
      static_cast<T*>(rows), cols, static_cast<const B*>(bias), plan.expert_offsets, plan.num_experts,
      l.chunks_per_row, l.blocks);
}

template <class T>
void launch_bias(void* rows, std::int64_t cols, const tensor_view& bias, const routing_plan& plan,
                 cudaStream_t stream) {
  if (bias.type == dtype::f32) launch<T, float>(rows, cols, bias.data, plan, stream);
  else launch<T, T>(rows, cols, bias.data, plan, stream);
}

}  // namespace expert_bias_launch

// rows [R, cols] of dtype t (bf16 or f16) on the device, sorted by expert as the plan orders
// them: rows[r] += bias[e] for each valid row r of expert e (r < offsets[E], counted on the
// device); bias [E, cols] is f32 or t, on the device.
inline void add_expert_bias(void* rows, dtype t, std::int64_t cols, const tensor_view& bias, const routing_plan& plan,
                            cudaStream_t stream) {
  constexpr const char* where = "gpu::add_expert_bias";
  validate_plan(plan, where);
  MOE_EXPECT(t == dtype::bf16 || t == dtype::f16, where, "rows must be bf16 or f16, got " + std::string(dtype_name(t)));
  MOE_EXPECT(cols >= 1, where, "cols must be positive, got " + std::to_string(cols));
  check::rank(bias, 2, where, "bias");
  check::space(bias, memory_space::device, where, "bias");
  check::contiguous(bias, where, "bias");
  check::non_null(bias, where, "bias");
  check::dim(bias, 0, plan.num_experts, where, "bias");
  check::dim(bias, 1, cols, where, "bias");
  MOE_EXPECT(bias.type == dtype::f32 || bias.type == t, where,
             "bias must be f32 or " + std::string(dtype_name(t)) + ", got " + std::string(dtype_name(bias.type)));
  if (plan.num_tokens == 0) return;
  MOE_EXPECT(rows != nullptr, where, "rows is null");
  if (t == dtype::bf16) expert_bias_launch::launch_bias<__nv_bfloat16>(rows, cols, bias, plan, stream);
  else expert_bias_launch::launch_bias<__half>(rows, cols, bias, plan, stream);
  MOE_CUDA_CHECK_LAUNCH("gpu::add_expert_bias");
}

}  // namespace moerunner::gpu
