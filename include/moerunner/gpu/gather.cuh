// Host launch for kernel_gather: copies token rows into the plan's expert-sorted order.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/gpu/gather.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "moerunner/core/tensor_view.hpp"
#include "moerunner/gpu/cuda_check.hpp"
#include "moerunner/gpu/routing_plan.hpp"
#include "moerunner/gpu/row_launch.hpp"
#include "moerunner/kernels/kernel_gather.cuh"

namespace moerunner::gpu {

namespace gather_launch {

template <class V>
void launch(const tensor_view& x, const routing_plan& plan, void* rows, std::int64_t row_bytes,
            cudaStream_t stream) {
  const std::int64_t vecs = row_bytes / static_cast<std::int64_t>(sizeof(V));
  const row_launch l = make_row_launch(plan.num_tokens * plan.top_k, vecs);
  kernels::gather_rows_kernel<V><<<l.grid, l.threads, 0, stream>>>(
      static_cast<const V*>(x.data), static_cast<V*>(rows), vecs, l.chunks_per_row, l.blocks,
      plan.expert_offsets + plan.num_experts, plan.row_to_slot, plan.top_k);
}

}  // namespace gather_launch

// rows[r] = x[row_to_slot[r] / k] for every valid row r < offsets[E] (counted on the device);
// x [M, H] on the device (any dtype), rows [M * k, H] of the same dtype. Rows past the valid
// count are left untouched. 16-byte copies when rows are 16-byte aligned, elements otherwise.
inline void gather_rows(const tensor_view& x, const routing_plan& plan, void* rows, cudaStream_t stream) {
  constexpr const char* where = "gpu::gather_rows";
  validate_plan(plan, where);
  check::rank(x, 2, where, "x");
  check::space(x, memory_space::device, where, "x");
  check::contiguous(x, where, "x");
  check::non_null(x, where, "x");
  check::dim(x, 0, plan.num_tokens, where, "x");
  MOE_EXPECT(x.shape[1] >= 1, where, "x must have at least one column, got shape " + x.shape_string());
  if (plan.num_tokens == 0) return;
  MOE_EXPECT(rows != nullptr, where, "rows is null");
  const std::size_t elem = dtype_size(x.type);
  MOE_EXPECT(reinterpret_cast<std::uintptr_t>(x.data) % elem == 0 && reinterpret_cast<std::uintptr_t>(rows) % elem == 0,
             where, "x and rows must be aligned to their element size (" + std::to_string(elem) + " bytes)");
  const std::int64_t row_bytes = x.shape[1] * static_cast<std::int64_t>(dtype_size(x.type));
  const bool wide = row_bytes % 16 == 0 && reinterpret_cast<std::uintptr_t>(x.data) % 16 == 0 &&
                    reinterpret_cast<std::uintptr_t>(rows) % 16 == 0;
  if (wide) gather_launch::launch<uint4>(x, plan, rows, row_bytes, stream);
  else if (elem == 4) gather_launch::launch<std::uint32_t>(x, plan, rows, row_bytes, stream);
  else if (elem == 2) gather_launch::launch<std::uint16_t>(x, plan, rows, row_bytes, stream);
  else gather_launch::launch<std::uint8_t>(x, plan, rows, row_bytes, stream);
  MOE_CUDA_CHECK_LAUNCH("gpu::gather_rows");
}

}  // namespace moerunner::gpu
