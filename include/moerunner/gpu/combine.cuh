// Host launch for kernel_combine: each token's k expert rows back to one output row.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/gpu/combine.cuh needs nvcc: include it from a .cu file"
#endif

#include <cmath>
#include <cstdint>
#include <string>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "moerunner/core/dtype.hpp"
#include "moerunner/core/tensor_view.hpp"
#include "moerunner/gpu/cuda_check.hpp"
#include "moerunner/gpu/pdl_launch.cuh"
#include "moerunner/gpu/routing_plan.hpp"
#include "moerunner/gpu/row_launch.hpp"
#include "moerunner/kernels/kernel_combine.cuh"

namespace moerunner::gpu {

namespace combine_launch {

struct args {
  const void* rows;
  void* out;
  std::int64_t hidden;
  const routing_plan* plan;
  const float* weights;
  float scale;
  bool no_combine;
  int splits;
  std::int64_t split_stride;
  bool dependent;  // a programmatic dependent launch (gpu::launch_dependent)
};

template <class TIn, class TOut, int VEC>
void launch(const args& a, cudaStream_t stream) {
  const row_launch l = make_row_launch(a.plan->num_tokens, a.hidden / VEC);
  launch_dependent(kernels::combine_rows_kernel<TIn, TOut, VEC>, dim3(l.grid), dim3(l.threads), 0, stream,
                   a.dependent, static_cast<const TIn*>(a.rows), static_cast<TOut*>(a.out), a.hidden,
                   l.chunks_per_row, l.blocks, a.plan->top_k, static_cast<const std::int32_t*>(a.plan->slot_to_row),
                   a.weights, a.scale, a.no_combine, a.splits, a.split_stride);
}

template <class TIn, class TOut>
void launch_vec(const args& a, cudaStream_t stream) {
  const bool wide = a.hidden % 8 == 0 && reinterpret_cast<std::uintptr_t>(a.rows) % 16 == 0 &&
                    reinterpret_cast<std::uintptr_t>(a.out) % 16 == 0;
  if (wide) launch<TIn, TOut, 8>(a, stream);
  else launch<TIn, TOut, 1>(a, stream);
}

template <class TIn>
void launch_out(const args& a, dtype out_type, cudaStream_t stream) {
  switch (out_type) {
    case dtype::f32: launch_vec<TIn, float>(a, stream); break;
    case dtype::f16: launch_vec<TIn, __half>(a, stream); break;
    default: launch_vec<TIn, __nv_bfloat16>(a, stream); break;  // validated: bf16
  }
}

}  // namespace combine_launch

// rows [M * k, H] of dtype t (bf16, f16, or f32 partial sums) in the plan's expert-sorted
// order -> out [M, H] (f32, f16 or bf16), or [M, k, H] with no_combine, on the device:
//   out[t] = scale * sum_{j = 0..k-1} w[t, j] * rows[slot_to_row[t * k + j]], filtered slots skipped,
// summed in f32 in slot order and rounded once, so repeated runs give the same bits; a token
// with every slot filtered gets zeros. topk_weights [M, k] f32, or nullptr when the rows
// already carry the router weight. With no_combine, out[t, j] = scale * w[t, j] * row (0 if filtered).
// With splits > 1 the rows come in `splits` consecutive [M * k, H] parts (a K-split GEMM's
// partial sums), and each row is the sum of its parts in order. With dependent_launch the
// kernel is a programmatic dependent of the one before it (it waits for it before any read).
inline void combine_rows(const void* rows, dtype t, const routing_plan& plan, const float* topk_weights, float scale,
                         const tensor_view& out, bool no_combine, cudaStream_t stream, int splits = 1,
                         bool dependent_launch = false) {
  constexpr const char* where = "gpu::combine_rows";
  validate_plan(plan, where);
  MOE_EXPECT(t == dtype::bf16 || t == dtype::f16 || t == dtype::f32, where,
             "rows must be bf16, f16 or f32, got " + std::string(dtype_name(t)));
  MOE_EXPECT(splits >= 1, where, "splits must be at least 1, got " + std::to_string(splits));
  MOE_EXPECT(std::isfinite(scale), where, "scale must be finite");
  MOE_EXPECT(is_activation_dtype(out.type), where,
             "out must be f32, f16 or bf16, got " + std::string(dtype_name(out.type)));
  check::rank(out, no_combine ? 3 : 2, where, "out");
  check::space(out, memory_space::device, where, "out");
  check::contiguous(out, where, "out");
  check::non_null(out, where, "out");
  check::dim(out, 0, plan.num_tokens, where, "out");
  if (no_combine) check::dim(out, 1, plan.top_k, where, "out");
  const std::int64_t hidden = out.shape[out.rank - 1];
  MOE_EXPECT(hidden >= 1, where, "out must have at least one column, got shape " + out.shape_string());
  if (plan.num_tokens == 0) return;
  MOE_EXPECT(rows != nullptr, where, "rows is null");
  MOE_EXPECT(reinterpret_cast<std::uintptr_t>(rows) % dtype_size(t) == 0, where,
             "rows must be " + std::to_string(dtype_size(t)) + "-byte aligned");
  check::aligned(out, dtype_size(out.type), where, "out");
  MOE_EXPECT(reinterpret_cast<std::uintptr_t>(topk_weights) % 4 == 0, where, "topk_weights must be 4-byte aligned");
  const combine_launch::args a{rows,  out.data,   hidden, &plan, topk_weights, scale, no_combine,
                               splits, plan.num_tokens * plan.top_k * hidden, dependent_launch};
  if (t == dtype::bf16) combine_launch::launch_out<__nv_bfloat16>(a, out.type, stream);
  else if (t == dtype::f16) combine_launch::launch_out<__half>(a, out.type, stream);
  else combine_launch::launch_out<float>(a, out.type, stream);
  MOE_CUDA_CHECK_LAUNCH("gpu::combine_rows");
}

}  // namespace moerunner::gpu
