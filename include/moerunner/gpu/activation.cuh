// Host launch for kernel_activation: the gated activation over the plan's valid rows.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/gpu/activation.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstdint>
#include <string>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "moerunner/core/config.hpp"
#include "moerunner/core/dtype.hpp"
#include "moerunner/gpu/cuda_check.hpp"
#include "moerunner/gpu/routing_plan.hpp"
#include "moerunner/gpu/row_launch.hpp"
#include "moerunner/kernels/kernel_activation.cuh"

namespace moerunner::gpu {

namespace activation_launch {

template <class T, int VEC>
void launch(const void* in, void* out, int inter, bool gated, bool interleaved, const activation& act,
            const routing_plan& plan, cudaStream_t stream) {
  const row_launch l = make_row_launch(plan.num_tokens * plan.top_k, inter / VEC);
  kernels::gated_activation_kernel<T, VEC><<<l.grid, l.threads, 0, stream>>>(
      static_cast<const T*>(in), static_cast<T*>(out), inter, gated, interleaved, act, l.chunks_per_row, l.blocks,
      plan.expert_offsets + plan.num_experts);
}

template <class T>
void launch_vec(const void* in, void* out, int inter, bool gated, bool interleaved, const activation& act,
                const routing_plan& plan, cudaStream_t stream) {
  const bool wide = inter % 8 == 0 && reinterpret_cast<std::uintptr_t>(in) % 16 == 0 &&
                    reinterpret_cast<std::uintptr_t>(out) % 16 == 0;
  if (wide) launch<T, 8>(in, out, inter, gated, interleaved, act, plan, stream);
  else launch<T, 1>(in, out, inter, gated, interleaved, act, plan, stream);
}

}  // namespace activation_launch

// in [R, 2I] (gate columns then up columns, or in pairs with `layout` interleaved; [R, I] when
// !gated) -> out [R, I], both of dtype t (bf16 or f16) on the device, for the rows r < offsets[E]
// (counted on the device); R = M * k.
inline void gated_activation(const void* in, void* out, dtype t, int intermediate_size, bool gated,
                             const activation& act, const routing_plan& plan, cudaStream_t stream,
                             w13_layout layout = w13_layout::halves) {
  constexpr const char* where = "gpu::gated_activation";
  validate_plan(plan, where);
  MOE_EXPECT(t == dtype::bf16 || t == dtype::f16, where,
             "activations must be bf16 or f16, got " + std::string(dtype_name(t)));
  MOE_EXPECT(intermediate_size >= 1, where,
             "intermediate_size must be positive, got " + std::to_string(intermediate_size));
  MOE_EXPECT(gated || act.kind != activation_kind::swiglu_clamped, where, "swiglu_clamped needs gated = true");
  const bool interleaved = layout == w13_layout::interleaved;
  MOE_EXPECT(gated || !interleaved, where, "interleaved gate/up columns need gated = true");
  if (plan.num_tokens == 0) return;
  MOE_EXPECT(in != nullptr && out != nullptr, where, "in and out must not be null");
  MOE_EXPECT(reinterpret_cast<std::uintptr_t>(in) % 2 == 0 && reinterpret_cast<std::uintptr_t>(out) % 2 == 0, where,
             "in and out must be 2-byte aligned");
  if (t == dtype::bf16)
    activation_launch::launch_vec<__nv_bfloat16>(in, out, intermediate_size, gated, interleaved, act, plan, stream);
  else activation_launch::launch_vec<__half>(in, out, intermediate_size, gated, interleaved, act, plan, stream);
  MOE_CUDA_CHECK_LAUNCH("gpu::gated_activation");
}

}  // namespace moerunner::gpu
