// Device code of expert-parallel dispatch and combine (gpu/ep_pack.cuh launches it): each
// rank's send lists, packing rows by destination, the local runner's routing from what
// arrived, and each token's parts summed in rank order. The per-row rules are
// dispatch/ep_rules.hpp's, which the host tests check against dispatch/ep_layout.hpp.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/kernels/kernel_ep.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstdint>

#include "moerunner/core/limits.hpp"
#include "moerunner/core/types.hpp"
#include "moerunner/dispatch/ep_layout.hpp"
#include "moerunner/dispatch/ep_rules.hpp"
#include "moerunner/kernels/atomic_saturating.cuh"
#include "moerunner/kernels/vector_io.cuh"

namespace moerunner::kernels {

// Block d of world_size: the tokens with a slot on rank d, in token order (a block-wide scan
// per chunk of THREADS tokens, so positions follow token order as make_ep_send_layout's do):
//   send_pos[t * R + d] = t's position in d's list, or -1;
//   send_token[d * token_stride + pos] = t;  send_counts[d] = the list's length.
template <int THREADS>
__global__ void __launch_bounds__(THREADS)
    ep_send_positions_kernel(const std::int32_t* __restrict__ ids, std::int64_t m, int k, ep_topology topo,
                             std::int32_t* __restrict__ send_pos, std::int32_t* __restrict__ send_token,
                             std::int64_t token_stride, std::int64_t* __restrict__ send_counts) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "ep_send_positions_kernel: whole warps, one block");
  constexpr int warps = THREADS / 32;
  __shared__ int warp_base[warps];
  __shared__ int chunk_total;
  const int d = static_cast<int>(blockIdx.x), r = topo.world_size;
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  std::int64_t running = 0;
  for (std::int64_t first = 0; first < m; first += THREADS) {  // uniform over the block
    const std::int64_t t = first + threadIdx.x;
    const bool goes = t < m && ep_goes_to(ids + t * k, k, topo, d);
    const unsigned ballot = __ballot_sync(0xffffffffu, goes);
    if (lane == 0) warp_base[warp] = __popc(ballot);
    __syncthreads();
    if (threadIdx.x == 0) {
      int sum = 0;
      for (int w = 0; w < warps; ++w) {
        const int n = warp_base[w];
        warp_base[w] = sum;
        sum += n;
      }
      chunk_total = sum;
    }
    __syncthreads();
    const std::int64_t pos = running + warp_base[warp] + __popc(ballot & ((1u << lane) - 1u));
    if (t < m) send_pos[t * r + d] = goes ? static_cast<std::int32_t>(pos) : -1;
    if (goes) send_token[d * token_stride + pos] = static_cast<std::int32_t>(t);
    running += chunk_total;
    __syncthreads();  // the next chunk rewrites warp_base and chunk_total
  }
  if (threadIdx.x == 0) send_counts[d] = running;
}

// Every thread of the block: base[p] (ep_peer_bases) and the rows kept of each peer, in
// shared memory.
__device__ inline void load_peer_bases(const std::int64_t* counts, int peers, std::int64_t fixed_stride,
                                       std::int64_t rows_per_peer, std::int64_t* base, std::int64_t* kept) {
  if (threadIdx.x == 0) {
    ep_peer_bases(counts, peers, fixed_stride, base);
    for (int p = 0; p < peers; ++p) kept[p] = counts != nullptr ? ep_rows_kept(counts[p], fixed_stride) : rows_per_peer;
  }
  __syncthreads();
}

// One block per chunk of one packed row: row i < kept[d] of destination d's list (token
// send_token[d * token_stride + i]) goes to send_rows[base[d] + i] with its meta (k global ids,
// then the k weights' bits). Items are (d, i) for i < rows_per_dest; with fixed_stride > 0 a full
// list's overflow is added to `status` (once per destination, by item (d, 0)).
template <class UNIT>
__global__ void ep_pack_kernel(const UNIT* __restrict__ x, const std::int32_t* __restrict__ ids,
                               const float* __restrict__ weights, int k, int world,
                               const std::int32_t* __restrict__ send_token, std::int64_t token_stride,
                               const std::int64_t* __restrict__ send_counts, std::int64_t fixed_stride,
                               std::int64_t rows_per_dest, std::int64_t units_per_row, std::int64_t chunks_per_row,
                               std::int64_t num_blocks, UNIT* __restrict__ send_rows,
                               std::int32_t* __restrict__ send_meta, ep_status* status) {
  __shared__ std::int64_t base[max_ep_world_size], kept[max_ep_world_size];
  load_peer_bases(send_counts, world, fixed_stride, rows_per_dest, base, kept);
  for (std::int64_t b = blockIdx.x; b < num_blocks; b += gridDim.x) {
    const std::int64_t item = b / chunks_per_row, chunk = b % chunks_per_row;
    const int d = static_cast<int>(item / rows_per_dest);
    const std::int64_t i = item % rows_per_dest;
    if (status != nullptr && fixed_stride > 0 && i == 0 && chunk == 0 && threadIdx.x == 0) {
      const std::int64_t wanted = send_counts[d];
      atomicMax(&status->needed_capacity, static_cast<int>(wanted));
      if (wanted > fixed_stride) atomic_add_saturating(&status->dropped_rows, wanted - fixed_stride);
    }
    if (i >= kept[d]) continue;
    const std::int64_t t = send_token[d * token_stride + i];
    const std::int64_t row = base[d] + i;
    const std::int64_t u = chunk * blockDim.x + threadIdx.x;
    if (u < units_per_row) send_rows[row * units_per_row + u] = x[t * units_per_row + u];
    if (chunk == 0)
      for (int w = threadIdx.x; w < 2 * k; w += blockDim.x)
        send_meta[row * 2 * k + w] = w < k ? ids[t * k + w] : __float_as_int(weights[t * k + w - k]);
  }
}

// allgather: this rank's slot of max_tokens rows in the gathered buffers (rows and meta point
// at it). Rows t < m get x's row and the token's meta; rows past m only meta with every id -1,
// so the receivers route them nowhere.
template <class UNIT>
__global__ void ep_gather_pack_kernel(const UNIT* __restrict__ x, const std::int32_t* __restrict__ ids,
                                      const float* __restrict__ weights, std::int64_t m, int k,
                                      std::int64_t units_per_row, std::int64_t chunks_per_row, std::int64_t num_blocks,
                                      UNIT* __restrict__ rows, std::int32_t* __restrict__ meta) {
  for (std::int64_t b = blockIdx.x; b < num_blocks; b += gridDim.x) {
    const std::int64_t t = b / chunks_per_row, chunk = b % chunks_per_row;
    const std::int64_t u = chunk * blockDim.x + threadIdx.x;
    if (t < m && u < units_per_row) rows[t * units_per_row + u] = x[t * units_per_row + u];
    if (chunk == 0)
      for (int w = threadIdx.x; w < 2 * k; w += blockDim.x) {
        std::int32_t v = w < k ? -1 : 0;
        if (t < m) v = w < k ? ids[t * k + w] : __float_as_int(weights[t * k + w - k]);
        meta[t * 2 * k + w] = v;
      }
  }
}

// The local runner's routing from the received meta: slot (p, i, j) of the items (p < world,
// i < rows_per_peer, j < k) is row base[p] + i's slot j, its global id mapped to this rank's
// local id (-1 where another rank owns the expert) and its weight as sent. recv_counts: what
// each peer sent (null: every row of every slot arrived). With fixed_stride > 0 a slot's rows
// past what arrived get id -1 and weight 0, so the runner leaves them out. (A template, as every
// kernel here: a header's kernels must not be defined twice in a program.)
template <int THREADS>
__global__ void __launch_bounds__(THREADS) ep_unpack_kernel(const std::int32_t* __restrict__ recv_meta, const std::int64_t* __restrict__ recv_counts,
                                 std::int64_t fixed_stride, std::int64_t rows_per_peer, int k, ep_topology topo,
                                 std::int64_t items, std::int32_t* __restrict__ ids, float* __restrict__ weights) {
  __shared__ std::int64_t base[max_ep_world_size], kept[max_ep_world_size];
  load_peer_bases(recv_counts, topo.world_size, fixed_stride, rows_per_peer, base, kept);
  const std::int64_t per_peer = rows_per_peer * k;
  for (std::int64_t q = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; q < items;
       q += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const int p = static_cast<int>(q / per_peer);
    const std::int64_t i = q % per_peer / k;
    const int j = static_cast<int>(q % k);
    const std::int64_t row = base[p] + i;
    if (i < kept[p]) {
      const std::int32_t* meta = recv_meta + row * 2 * k;
      ids[row * k + j] = topo.local_on_me(meta[j]);
      weights[row * k + j] = __int_as_float(meta[k + j]);
    } else if (fixed_stride > 0) {
      ids[row * k + j] = -1;
      weights[row * k + j] = 0.0f;
    }
  }
}

// out[t] = the sum over destinations d, in rank order, of the part row base[d] + send_pos[t, d]
// that came back from d (where t went to d and its row was kept), in f32, rounded once; a
// token sent nowhere gets zeros.
template <class T, int VEC>
__global__ void ep_reduce_kernel(const T* __restrict__ back, const std::int32_t* __restrict__ send_pos,
                                 const std::int64_t* __restrict__ send_counts, std::int64_t fixed_stride, int world,
                                 std::int64_t hidden, std::int64_t chunks_per_row, std::int64_t num_blocks,
                                 T* __restrict__ out) {
  __shared__ std::int64_t base[max_ep_world_size], kept[max_ep_world_size];
  load_peer_bases(send_counts, world, fixed_stride, 0, base, kept);
  for (std::int64_t b = blockIdx.x; b < num_blocks; b += gridDim.x) {
    const std::int64_t t = b / chunks_per_row;
    const std::int64_t c = ((b % chunks_per_row) * blockDim.x + threadIdx.x) * VEC;
    if (c >= hidden) continue;
    float acc[VEC];
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[v] = 0.0f;
    for (int d = 0; d < world; ++d) {
      const std::int32_t pos = send_pos[t * world + d];
      if (pos < 0 || pos >= kept[d]) continue;
      float part[VEC];
      load_f32<VEC>(back + (base[d] + pos) * hidden + c, part);
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[v] += part[v];
    }
    store_f32<VEC>(out + t * hidden + c, acc);
  }
}

}  // namespace moerunner::kernels
