// Host launch for kernel_ep: the device steps of expert-parallel dispatch and combine that
// move no data between GPUs (ep_nccl_dispatcher wraps them around its NCCL calls). Buffers
// and their shapes are dispatch/ep_buffers.hpp's; every launch is on the caller's stream and
// never synchronizes.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/gpu/ep_pack.cuh needs nvcc: include it from a .cu file"
#endif

#include <algorithm>
#include <cstdint>
#include <string>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "moerunner/core/dtype.hpp"
#include "moerunner/core/error.hpp"
#include "moerunner/core/limits.hpp"
#include "moerunner/core/tensor_view.hpp"
#include "moerunner/core/types.hpp"
#include "moerunner/dispatch/ep_layout.hpp"
#include "moerunner/gpu/cuda_check.hpp"
#include "moerunner/gpu/row_launch.hpp"
#include "moerunner/kernels/kernel_ep.cuh"

namespace moerunner::gpu {

namespace ep_launch {

inline constexpr int scan_threads = 1024;
inline constexpr int slot_threads = 256;

inline bool aligned_to(const void* p, std::size_t bytes) { return reinterpret_cast<std::uintptr_t>(p) % bytes == 0; }

// f.template operator()<UNIT>() with the widest copy unit that row_bytes and every pointer allow.
template <class F>
void with_copy_unit(std::int64_t row_bytes, const void* a, const void* b, F&& f) {
  const auto fits = [&](std::size_t n) {
    return row_bytes % static_cast<std::int64_t>(n) == 0 && aligned_to(a, n) && aligned_to(b, n);
  };
  if (fits(16)) f.template operator()<uint4>();
  else if (fits(4)) f.template operator()<std::uint32_t>();
  else f.template operator()<std::uint16_t>();  // rows are 16-bit or f32 elements, aligned to them
}

inline void check_world(int world, const char* where) {
  MOE_EXPECT(world >= 1 && world <= max_ep_world_size, where,
             "world_size must be in [1, " + std::to_string(max_ep_world_size) + "], got " + std::to_string(world));
}

inline unsigned slot_grid(std::int64_t items) {
  return static_cast<unsigned>(std::min<std::int64_t>((items + slot_threads - 1) / slot_threads, std::int64_t{1} << 20));
}

}  // namespace ep_launch

// The send lists of a rank's m tokens (ids [m, k] global expert ids on the device), as
// make_ep_send_layout orders them: send_pos [m, R] (position in each destination's list or
// -1), send_token [R, token_stride] (each list), send_counts [R] (their lengths).
inline void ep_send_positions(const std::int32_t* ids, std::int64_t m, int k, const ep_topology& topo,
                              std::int32_t* send_pos, std::int32_t* send_token, std::int64_t token_stride,
                              std::int64_t* send_counts, cudaStream_t stream) {
  constexpr const char* where = "gpu::ep_send_positions";
  topo.validate(where);
  ep_launch::check_world(topo.world_size, where);
  MOE_EXPECT(m >= 0 && m <= token_stride, where, "m must be in [0, token_stride]");
  MOE_EXPECT(k >= 1 && k <= max_top_k, where, "k out of range");
  MOE_EXPECT(send_counts != nullptr && (m == 0 || (ids && send_pos && send_token)), where, "a buffer is null");
  kernels::ep_send_positions_kernel<ep_launch::scan_threads>
      <<<topo.world_size, ep_launch::scan_threads, 0, stream>>>(ids, m, k, topo, send_pos, send_token, token_stride,
                                                                 send_counts);
  MOE_CUDA_CHECK_LAUNCH("gpu::ep_send_positions");
}

struct ep_pack_args {
  std::int64_t tokens = 0;  // m: with none, x, ids and weights may be null (an empty tensor's data)
  const void* x = nullptr;  // [m, H]
  const std::int32_t* ids = nullptr;
  const float* weights = nullptr;
  int k = 1;
  int world = 1;
  const std::int32_t* send_token = nullptr;
  std::int64_t token_stride = 0;
  const std::int64_t* send_counts = nullptr;
  std::int64_t fixed_stride = 0;   // low_latency: the capacity; 0: lists packed back to back
  std::int64_t rows_per_dest = 0;  // items per destination: m (throughput) or the capacity
  std::int64_t row_bytes = 0;
  void* send_rows = nullptr;
  std::int32_t* send_meta = nullptr;
  ep_status* status = nullptr;  // low_latency overflow, or null
};

// Each destination's list packed into send_rows/send_meta at the rules of dispatch/ep_rules.hpp.
inline void ep_pack_rows(const ep_pack_args& a, cudaStream_t stream) {
  constexpr const char* where = "gpu::ep_pack_rows";
  ep_launch::check_world(a.world, where);
  MOE_EXPECT(a.fixed_stride >= 0 && a.rows_per_dest >= 0 && a.row_bytes >= 2, where, "negative size");
  MOE_EXPECT(a.fixed_stride == 0 || a.rows_per_dest == a.fixed_stride, where,
             "with a fixed stride every slot of it is an item");
  if (a.rows_per_dest == 0) return;
  MOE_EXPECT(a.tokens >= 0, where, "negative token count");
  MOE_EXPECT((a.tokens == 0 || (a.x && a.ids && a.weights)) && a.send_token && a.send_counts && a.send_rows &&
                 a.send_meta,
             where, "a buffer is null");
  ep_launch::with_copy_unit(a.row_bytes, a.x, a.send_rows, [&]<class UNIT>() {
    const std::int64_t units = a.row_bytes / static_cast<std::int64_t>(sizeof(UNIT));
    const row_launch l = make_row_launch(a.world * a.rows_per_dest, units);
    kernels::ep_pack_kernel<UNIT><<<l.grid, l.threads, 0, stream>>>(
        static_cast<const UNIT*>(a.x), a.ids, a.weights, a.k, a.world, a.send_token, a.token_stride, a.send_counts,
        a.fixed_stride, a.rows_per_dest, units, l.chunks_per_row, l.blocks, static_cast<UNIT*>(a.send_rows),
        a.send_meta, a.status);
  });
  MOE_CUDA_CHECK_LAUNCH("gpu::ep_pack_rows");
}

// allgather: this rank's max_tokens rows of the gathered buffers (rows, meta point at them).
inline void ep_gather_pack(const void* x, const std::int32_t* ids, const float* weights, std::int64_t m, int k,
                           std::int64_t max_tokens, std::int64_t row_bytes, void* rows, std::int32_t* meta,
                           cudaStream_t stream) {
  constexpr const char* where = "gpu::ep_gather_pack";
  MOE_EXPECT(m >= 0 && m <= max_tokens && row_bytes >= 2, where, "m must be in [0, max_tokens]");
  MOE_EXPECT(rows && meta && (m == 0 || (x && ids && weights)), where, "a buffer is null");
  ep_launch::with_copy_unit(row_bytes, m > 0 ? x : rows, rows, [&]<class UNIT>() {
    const std::int64_t units = row_bytes / static_cast<std::int64_t>(sizeof(UNIT));
    const row_launch l = make_row_launch(max_tokens, units);
    kernels::ep_gather_pack_kernel<UNIT><<<l.grid, l.threads, 0, stream>>>(
        static_cast<const UNIT*>(x), ids, weights, m, k, units, l.chunks_per_row, l.blocks, static_cast<UNIT*>(rows),
        meta);
  });
  MOE_CUDA_CHECK_LAUNCH("gpu::ep_gather_pack");
}

// The local runner's ids and weights [R * rows_per_peer or the received rows, k] from the
// received meta (recv_counts null: every row of every fixed slot arrived).
inline void ep_unpack(const std::int32_t* recv_meta, const std::int64_t* recv_counts, std::int64_t fixed_stride,
                      std::int64_t rows_per_peer, int k, const ep_topology& topo, std::int32_t* ids, float* weights,
                      cudaStream_t stream) {
  constexpr const char* where = "gpu::ep_unpack";
  topo.validate(where);
  ep_launch::check_world(topo.world_size, where);
  MOE_EXPECT(fixed_stride >= 0 && rows_per_peer >= 0, where, "negative size");
  MOE_EXPECT(recv_counts != nullptr || fixed_stride > 0, where, "recv_counts is null without a fixed stride");
  MOE_EXPECT(fixed_stride == 0 || rows_per_peer == fixed_stride, where, "with a fixed stride every slot is an item");
  const std::int64_t items = topo.world_size * rows_per_peer * k;
  if (items == 0) return;
  MOE_EXPECT(recv_meta && ids && weights, where, "a buffer is null");
  kernels::ep_unpack_kernel<ep_launch::slot_threads><<<ep_launch::slot_grid(items), ep_launch::slot_threads, 0, stream>>>(
      recv_meta, recv_counts, fixed_stride, rows_per_peer, k, topo, items, ids, weights);
  MOE_CUDA_CHECK_LAUNCH("gpu::ep_unpack");
}

// out [m, H] (dtype t, on the device) = each token's parts from back, in rank order.
inline void ep_reduce(const void* back, const std::int32_t* send_pos, const std::int64_t* send_counts,
                      std::int64_t fixed_stride, int world, const tensor_view& out, cudaStream_t stream) {
  constexpr const char* where = "gpu::ep_reduce";
  ep_launch::check_world(world, where);
  MOE_EXPECT(is_activation_dtype(out.type), where, "out must be f32, f16 or bf16");
  check::rank(out, 2, where, "out");
  check::space(out, memory_space::device, where, "out");
  check::contiguous(out, where, "out");
  check::non_null(out, where, "out");
  const std::int64_t m = out.shape[0], hidden = out.shape[1];
  if (m == 0 || hidden == 0) return;
  MOE_EXPECT(back && send_pos && send_counts, where, "a buffer is null");
  const std::size_t elem = dtype_size(out.type);
  check::aligned(out, elem, where, "out");
  const bool wide = hidden % 8 == 0 && ep_launch::aligned_to(back, 16) && ep_launch::aligned_to(out.data, 16);
  const auto launch = [&]<class T, int VEC>() {
    const row_launch l = make_row_launch(m, hidden / VEC);
    kernels::ep_reduce_kernel<T, VEC><<<l.grid, l.threads, 0, stream>>>(
        static_cast<const T*>(back), send_pos, send_counts, fixed_stride, world, hidden, l.chunks_per_row, l.blocks,
        static_cast<T*>(out.data));
  };
  const auto by_width = [&]<class T>() {
    if (wide) launch.template operator()<T, 8>();
    else launch.template operator()<T, 1>();
  };
  if (out.type == dtype::bf16) by_width.template operator()<__nv_bfloat16>();
  else if (out.type == dtype::f16) by_width.template operator()<__half>();
  else by_width.template operator()<float>();
  MOE_CUDA_CHECK_LAUNCH("gpu::ep_reduce");
}

}  // namespace moerunner::gpu
