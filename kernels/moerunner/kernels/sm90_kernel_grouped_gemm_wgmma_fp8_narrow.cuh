// Device code of the fp8 block-scaled grouped GEMMs' narrow tiles (sm_90a only), for decode:
// the weights are the wgmma's M and the tile's tokens its N ("swap-AB"), so that the tensor work
// of a K tile follows the tokens a tile holds (8, 16 or 32) instead of a 64-row tile's. A 64 x 256
// wgmma CTA spends 512 tensor cycles on every 32 KB weight K tile whatever rows it holds (~1 at
// decode); here 256 x N x 128 multiply-adds take N x 8 cycles.
//
// Tile: 256 weight rows (four 64-row TMA boxes: for gate_up the gate and up rows of 64 act columns
// each for warpgroup 0, then of the next 64 for warpgroup 1, so the CTA covers 128 act columns,
// one quantization group; otherwise 256 consecutive rows) x N token rows x 128 K per stage. The
// schedule's tiles hold up to N rows of one expert (its block_m is N). Consumer warpgroup g runs
// boxes 2g and 2g + 1, one m64nNk32 each per 32 K, into a fresh sum per K tile that it adds into
// f32 accumulators times the token's and the weight block's scales (the promotion of the wide
// kernels, sm90_kernel_grouped_gemm_wgmma_fp8.cuh, with the same products and order).
//
// One producer warp: lane 0 the weight boxes by TMA, every lane its share of the token rows
// (16-byte cp.async into the 128-byte swizzle) and of the scales; the stage's full barrier counts
// the 32 lanes' cp.async arrivals and lane 0's expected bytes. Persistent CTAs in fixed turns.
//
// Epilogue, through a staging tile of f32 rows [N][columns]: each consumer thread holds two
// weight rows x N / 4 tokens, so a token's columns are spread over the warpgroup. The consumers
// write their values (GEMM1: the activation of the router-weighted sums, per-channel scales
// first; GEMM2: the sums), meet at a named barrier, and then each warp takes a token row: GEMM1
// quantizes 128 columns per warp instruction by quantize_warp_group (the rule and bits of the
// input rows' and the wide epilogue's), GEMM2 stores 8 columns a lane as the wide epilogue forms
// them (rows, slots, 16-byte reductions into the output, or f32 K-split parts).
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/kernels/sm90_kernel_grouped_gemm_wgmma_fp8_narrow.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstdint>

#include <cuda.h>
#include <cuda/ptx>

#include "moerunner/gpu/fp8_plan.hpp"
#include "moerunner/kernels/activation_math.cuh"
#include "moerunner/kernels/kernel_fp8_gemm_params.cuh"
#include "moerunner/kernels/kernel_grouped_gemm.cuh"
#include "moerunner/kernels/kernel_quantize_fp8.cuh"
#include "moerunner/kernels/pdl.cuh"
#include "moerunner/kernels/sm90_ptx.cuh"

namespace moerunner::kernels {

// The narrow tile's constants for N tokens, shared with the launch code.
template <moe_gemm_kind Kind, int N>
struct wgmma_fp8_narrow_shape {
  static_assert(N == 8 || N == 16 || N == 32, "narrow tiles hold 8, 16 or 32 tokens");
  static constexpr int block_n = N;  // tokens per tile: the schedule's block_m
  static constexpr int weight_rows = gpu::fp8_down_cols, block_k = gpu::fp8_block_k, box_rows = 64;
  static constexpr int boxes = weight_rows / box_rows;
  static constexpr int halves = Kind == moe_gemm_kind::gate_up ? 2 : 1;
  static constexpr int out_cols = weight_rows / halves;  // act or output columns per CTA
  static constexpr int w_bytes = weight_rows * block_k;
  static constexpr int x_offset = w_bytes, x_bytes = N * block_k;  // token rows: 1 KB swizzle atoms
  static constexpr int a_scale_offset = x_offset + x_bytes, b_scale_offset = a_scale_offset + 4 * N;
  static constexpr int stage_bytes = (b_scale_offset + 4 * boxes + 1023) / 1024 * 1024;
  // f32 staging rows of out_cols values, padded by 16 bytes: the consumers' writes (8 weight rows
  // x 4 tokens two rows apart per instruction) then hit 32 banks.
  static constexpr int staging_row_bytes = 4 * out_cols + 16;
  static constexpr int staging_bytes = N * staging_row_bytes;
  static constexpr int consumers = 2, consumer_threads = 128 * consumers, threads = consumer_threads + 32;
  // As many stages as fit beside the staging tile (2 KB for alignment and static shared memory).
  static constexpr int stages_fit = (227 * 1024 - staging_bytes - 2048) / stage_bytes;
  static constexpr int stages = stages_fit > 8 ? 8 : stages_fit;
  static constexpr int smem_bytes = stages * stage_bytes + staging_bytes + 1024;
  static_assert(stages >= 4, "the ring must hold at least four stages");
  static_assert(smem_bytes + 8 * 1024 <= (1 << 18), "descriptor start addresses are 14 bits of bytes / 16");
};

template <class T, moe_gemm_kind Kind, int N>
struct moe_gemm_wgmma_fp8_narrow : wgmma_fp8_narrow_shape<Kind, N> {
  using shape = wgmma_fp8_narrow_shape<Kind, N>;
  using shape::a_scale_offset, shape::b_scale_offset, shape::block_k, shape::box_rows, shape::boxes,
      shape::consumer_threads, shape::halves, shape::out_cols, shape::stage_bytes, shape::stages,
      shape::staging_row_bytes, shape::w_bytes, shape::x_offset;
  static constexpr int regs = N / 2;  // a box's accumulators per thread
  static constexpr int chunks = N * block_k / 16 / 32;  // 16-byte token-row copies per producer lane per stage
#if defined(MOERUNNER_RELEASE_ALL_LANES)
  static constexpr int release_lanes = 32;
#else
  static constexpr int release_lanes = 1;
#endif
  static constexpr int epilogue_barrier = 1;  // named barrier of the consumer warps (0: __syncthreads)

  struct barriers {
    std::uint64_t full[stages];
    std::uint64_t empty[stages];
  };

  // Box b's first output column (gate_up: its act column) and half (gate_up: b % 2) for the item
  // at output column n0.
  __device__ __forceinline__ static void box_origin(int b, int n0, int& col, int& half) {
    if constexpr (halves == 2) {
      col = n0 + box_rows * (b / 2);
      half = b % 2;
    } else {
      col = n0 + box_rows * b;
      half = 0;
    }
  }

  // Work item w (the producer and the consumers walk the same ones): its tile, first output
  // column, K split and K tiles.
  struct narrow_item {
    gpu::moe_m_tile tile;
    int n0, split, kt_begin, kt_end;
  };
  __device__ __forceinline__ static narrow_item item_at(const moe_gemm_params<T>& g, std::int64_t w, int tiles,
                                                        int k_tiles) {
    const moe_work_item item = decode_work_item(w, tiles, g.n_tiles, g.k_splits, g.raster_band, band_tiles_of(g));
    narrow_item it{g.tiles[item.m_tile], item.n_tile * out_cols, item.split, 0, 0};
    split_k_range(k_tiles, item.split, g.k_splits, it.kt_begin, it.kt_end);
    return it;
  }

  __device__ __forceinline__ static void named_barrier() {
    asm volatile("bar.sync %0, %1;\n" ::"n"(epilogue_barrier), "n"(consumer_threads) : "memory");
  }

  __device__ static void producer(const moe_gemm_fp8_params<T>& p, const CUtensorMap* b_map, unsigned char* ring,
                                  barriers& bars) {
    const moe_gemm_params<T>& g = p.g;
    const int lane = threadIdx.x % 32;
    const int k_tiles = g.k / block_k;
    const std::int64_t b_scale_rows = g.b_rows_per_expert / fp8_group;
    const bool per_block = p.b_scaling == fp8_weight_scaling::block128;
    const bool copies_b_scale = lane < boxes && p.b_scaling != fp8_weight_scaling::per_channel;
    const int tiles = *g.tile_count;
    const std::int64_t work = static_cast<std::int64_t>(tiles) * g.n_tiles * g.k_splits;
    std::uint32_t phase = 0;
    int stage = 0;
    for (std::int64_t w = blockIdx.x; w < work; w += gridDim.x) {
      const narrow_item it = item_at(g, w, tiles, k_tiles);
      const int n0 = it.n0;
      const gpu::moe_m_tile& tile = it.tile;
      // Copy c = lane + 32 i: token row c / 8, 16-byte chunk c % 8 (rows past the tile: zeros).
      int src[chunks];
#pragma unroll
      for (int i = 0; i < chunks; ++i)
        src[i] = a_source_row<Kind>(tile, (lane + 32 * i) / 8, g.row_to_slot, g.top_k);
      const int scale_src = lane < N ? a_source_row<Kind>(tile, lane, g.row_to_slot, g.top_k) : -1;
      std::int64_t b_scale_at = 0;
      bool b_scale_ok = false;
      if (copies_b_scale) {
        int col = 0, half = 0;
        box_origin(lane, n0, col, half);
        const std::int64_t row = b_row<Kind>(g, half, col);
        b_scale_ok = row < g.b_rows_per_expert;  // a box past n reads zeros
        b_scale_at = per_block ? (tile.expert * b_scale_rows + row / fp8_group) * k_tiles : tile.expert;
      }
      for (int kt = it.kt_begin; kt < it.kt_end; ++kt) {
        mbarrier_wait(&bars.empty[stage], phase ^ 1u);  // a fresh barrier passes parity 1
        unsigned char* sa = ring + stage * stage_bytes;
        if (lane == 0) {
          cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared,
                                               &bars.full[stage], static_cast<std::uint32_t>(w_bytes));
#pragma unroll
          for (int b = 0; b < boxes; ++b) {
            int col = 0, half = 0;
            box_origin(b, n0, col, half);
            const bool swapped = halves == 2 && g.interleaved;
            const std::int32_t coords[4] = {kt * block_k, swapped ? half : col, swapped ? col : half, tile.expert};
            tma_load_box<1>(sa + b * box_rows * block_k, b_map, coords, &bars.full[stage]);
          }
        }
#pragma unroll
        for (int i = 0; i < chunks; ++i) {
          const int c = lane + 32 * i, r = c / 8, chunk = c % 8;
          const bool ok = src[i] >= 0;
          cp_async_16(smem_address(sa + x_offset + r * block_k + (chunk ^ (r & 7)) * 16),
                      p.a + (ok ? static_cast<std::int64_t>(src[i]) * g.k + kt * block_k + chunk * 16 : 0), ok);
        }
        if (lane < N)
          cp_async_4(smem_address(sa + a_scale_offset + 4 * lane),
                     p.a_scale + (scale_src >= 0 ? static_cast<std::int64_t>(scale_src) * k_tiles + kt : 0),
                     scale_src >= 0);
        if (copies_b_scale)
          cp_async_4(smem_address(sa + b_scale_offset + 4 * lane),
                     p.b_scale + (b_scale_ok ? b_scale_at + (per_block ? kt : 0) : 0), b_scale_ok);
        cp_async_arrive_noinc(&bars.full[stage]);
        if (++stage == stages) {
          stage = 0;
          phase ^= 1u;
        }
      }
    }
  }

  __device__ static void consumer(const moe_gemm_fp8_params<T>& p, unsigned char* ring, barriers& bars) {
    const moe_gemm_params<T>& g = p.g;
    // Warp-uniform (read from lane 0) so that the descriptors stay in uniform registers.
    const int group = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int k_tiles = g.k / block_k;
    const bool per_channel = p.b_scaling == fp8_weight_scaling::per_channel;
    if constexpr (Kind != moe_gemm_kind::down) clear_output(g, static_cast<int>(threadIdx.x), consumer_threads);
    const std::uint32_t ring_addr = smem_address(ring);
    // Boxes 2 group and 2 group + 1 (A) and the token rows (B) in stage 0; a stage or box further
    // is an add to the start-address field.
    const std::uint64_t w_desc = sw128_kmajor_desc(ring_addr + 2 * group * box_rows * block_k);
    const std::uint64_t x_desc = sw128_kmajor_desc(ring_addr + x_offset);
    constexpr std::uint64_t stage_desc = stage_bytes >> 4, box_desc = (box_rows * block_k) >> 4;
    unsigned char* staging = ring + stages * stage_bytes;
    const int tiles = *g.tile_count;
    const std::int64_t work = static_cast<std::int64_t>(tiles) * g.n_tiles * g.k_splits;
    std::uint32_t phase = 0;
    int stage = 0;
    float acc[2][regs], part[2][regs];
    for (std::int64_t w = blockIdx.x; w < work; w += gridDim.x) {
      const narrow_item it = item_at(g, w, tiles, k_tiles);
      const int n0 = it.n0;
      const gpu::moe_m_tile& tile = it.tile;
#pragma unroll
      for (int b = 0; b < 2; ++b)
#pragma unroll
        for (int i = 0; i < regs; ++i) acc[b][i] = 0.0f;
      for (int kt = it.kt_begin; kt < it.kt_end; ++kt) {
        mbarrier_wait(&bars.full[stage], phase);
        // The token rows and scales came by cp.async (generic proxy): order them before the wgmma's reads.
        cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
        const unsigned char* sp = ring + stage * stage_bytes;
        const float* a_scales = reinterpret_cast<const float*>(sp + a_scale_offset);
        const float* b_scales = reinterpret_cast<const float*>(sp + b_scale_offset);
        // Register 4j + 2h + q of a box: weight row 16 warp + lane / 4 + 8h, token 8j + 2(lane % 4) + q.
        float sa[regs / 2];
#pragma unroll
        for (int j = 0; j < N / 8; ++j)
#pragma unroll
          for (int q = 0; q < 2; ++q) sa[2 * j + q] = a_scales[8 * j + 2 * (lane % 4) + q];
        const float sb0 = per_channel ? 1.0f : b_scales[2 * group], sb1 = per_channel ? 1.0f : b_scales[2 * group + 1];
        const std::uint64_t off = static_cast<std::uint64_t>(stage) * stage_desc;
        wgmma_fence();
#pragma unroll
        for (int b = 0; b < 2; ++b)
#pragma unroll
          for (int kk = 0; kk < block_k / 32; ++kk) {
            const auto step = static_cast<std::uint64_t>(kk * 32 >> 4);
            wgmma_m64nk32_e4m3<N>(part[b], w_desc + off + b * box_desc + step, x_desc + off + step, kk);
          }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands(part[0]);
        wgmma_fence_operands(part[1]);
        __syncwarp();
        if (lane < release_lanes) cuda::ptx::mbarrier_arrive(&bars.empty[stage]);
#pragma unroll
        for (int j = 0; j < N / 8; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int q = 0; q < 2; ++q) {
              const int i = 4 * j + 2 * h + q;
              acc[0][i] = fmaf(part[0][i], sa[2 * j + q] * sb0, acc[0][i]);
              acc[1][i] = fmaf(part[1][i], sa[2 * j + q] * sb1, acc[1][i]);
            }
        if (++stage == stages) {
          stage = 0;
          phase ^= 1u;
        }
      }
      const int rows = tile.row_end - tile.row_begin;
      if (per_channel) scale_rows(p, tile, n0, group, warp, lane, acc);
      // Every consumer warp has read the last item's staging rows.
      named_barrier();
      stage_values(g, tile, staging, group, warp, lane, acc);
      named_barrier();
      const int cw = static_cast<int>(threadIdx.x / 32);  // 0..7
      if constexpr (Kind == moe_gemm_kind::down) store_rows(g, tile, n0, it.split, staging, cw, lane, rows);
      else store_act(p, tile, n0, staging, cw, lane, rows);
    }
  }

  // Per-channel weights: each sum times its weight row's scale (columns past n keep their zeros).
  __device__ __forceinline__ static void scale_rows(const moe_gemm_fp8_params<T>& p, const gpu::moe_m_tile& tile,
                                                    int n0, int group, int warp, int lane, float (&acc)[2][regs]) {
    const moe_gemm_params<T>& g = p.g;
    const float* chan = p.b_scale + static_cast<std::int64_t>(tile.expert) * g.b_rows_per_expert;
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        int col = 0, half = 0;
        box_origin(2 * group + b, n0, col, half);
        col += 16 * warp + lane / 4 + 8 * h;
        if (col >= g.n) continue;
        const float s = chan[b_row<Kind>(g, half, col)];
#pragma unroll
        for (int j = 0; j < N / 8; ++j)
#pragma unroll
          for (int q = 0; q < 2; ++q) acc[b][4 * j + 2 * h + q] *= s;
      }
  }

  // The thread's values into the staging rows (token t at t * staging_row_bytes): GEMM1 the act
  // value of each act column (router weight of the token first, as the wide epilogue), GEMM2 the
  // sums. Staging column: gate_up 64 group + weight row; otherwise 128 group + 64 b + weight row.
  __device__ __forceinline__ static void stage_values(const moe_gemm_params<T>& g, const gpu::moe_m_tile& tile,
                                                      unsigned char* staging, int group, int warp, int lane,
                                                      const float (&acc)[2][regs]) {
    const int rows = tile.row_end - tile.row_begin;
    const auto at = [&](int t, int col) { return reinterpret_cast<float*>(staging + t * staging_row_bytes) + col; };
    if constexpr (Kind == moe_gemm_kind::down) {
#pragma unroll
      for (int b = 0; b < 2; ++b)
#pragma unroll
        for (int j = 0; j < N / 8; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int q = 0; q < 2; ++q)
              *at(8 * j + 2 * (lane % 4) + q, 128 * group + 64 * b + 16 * warp + lane / 4 + 8 * h) =
                  acc[b][4 * j + 2 * h + q];
    } else {
      with_activation(g.act, halves == 2, [&](const auto& act) {
#pragma unroll
        for (int j = 0; j < N / 8; ++j)
#pragma unroll
          for (int q = 0; q < 2; ++q) {
            const int t = 8 * j + 2 * (lane % 4) + q;
            // act(W (w x)) = act(w (W x)): the router weight scales the f32 sums instead of x.
            const float weight =
                t < rows && g.input_weights != nullptr ? g.input_weights[g.row_to_slot[tile.row_begin + t]] : 1.0f;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int i = 4 * j + 2 * h + q, r = 16 * warp + lane / 4 + 8 * h;
              if constexpr (halves == 2) {
                *at(t, 64 * group + r) = act(acc[0][i] * weight, acc[1][i] * weight);
              } else {
                *at(t, 128 * group + r) = act(acc[0][i] * weight, 0.0f);
                *at(t, 128 * group + 64 + r) = act(acc[1][i] * weight, 0.0f);
              }
            }
          }
      });
    }
  }

  // GEMM1: consumer warp cw quantizes token rows cw, cw + 8, .. of the staging tile, one group of
  // 128 act columns per warp instruction (lane l: columns 4l .. 4l + 3; the scale from lane 0).
  __device__ __forceinline__ static void store_act(const moe_gemm_fp8_params<T>& p, const gpu::moe_m_tile& tile,
                                                   int n0, const unsigned char* staging, int cw, int lane, int rows) {
    const moe_gemm_params<T>& g = p.g;
    constexpr int groups = out_cols / fp8_group;  // 1 gated, 2 otherwise
    for (int u = cw; u < rows * groups; u += consumer_threads / 32) {
      const int t = u / groups, grp = u % groups, col = n0 + fp8_group * grp;
      if (col >= g.n) continue;  // n is a multiple of 128: a group is wholly in or out
      quantize_group_to(reinterpret_cast<const float*>(staging + t * staging_row_bytes) + fp8_group * grp,
                        tile.row_begin + t, col, g.n, p.act, p.act_scale, lane);
    }
  }

  // GEMM2: consumer warp cw stores token rows cw, cw + 8, .. (lane l: columns n0 + 8l .. + 7) by
  // store_outputs8 (times the row's factor as 16-bit pairs into rows or slots, or added into the
  // output: the mma.sync GEMMs' epilogue); K-split parts in f32.
  __device__ __forceinline__ static void store_rows(const moe_gemm_params<T>& g, const gpu::moe_m_tile& tile, int n0,
                                                    int split, const unsigned char* staging, int cw, int lane,
                                                    int rows) {
    const int col = n0 + 8 * lane;
    if (col >= g.n) return;  // n is a multiple of 128: 8 columns are wholly in or out
    for (int t = cw; t < rows; t += consumer_threads / 32) {
      const float* src = reinterpret_cast<const float*>(staging + t * staging_row_bytes) + 8 * lane;
      float v[8];
      load8(v, src);
      const int row = tile.row_begin + t;
      if (g.store == down_store::partials) {
        float* part = g.partials + split * g.split_stride + static_cast<std::int64_t>(row) * g.n + col;
        *reinterpret_cast<float4*>(part) = make_float4(v[0], v[1], v[2], v[3]);
        *reinterpret_cast<float4*>(part + 4) = make_float4(v[4], v[5], v[6], v[7]);
        continue;
      }
      store_outputs8<T, moe_gemm_kind::down>(g, tile.expert, row, col, v, v);  // (no bias in fp8: none added)
    }
  }
};

// Persistent CTAs over work items in decode_work_item's order, in fixed turns (GEMM2's K in
// g.k_splits ranges into the output or f32 parts). The body exists only in sm_90a code;
// elsewhere it traps (the launch code checks first).
template <class T, moe_gemm_kind Kind, int N>
__global__ void __launch_bounds__(wgmma_fp8_narrow_shape<Kind, N>::threads, 1)
    moe_grouped_gemm_wgmma_fp8_narrow_kernel(const moe_gemm_fp8_params<T> p, const __grid_constant__ CUtensorMap b_map) {
#if MOERUNNER_WGMMA_COMPILED
  using tile_t = moe_gemm_wgmma_fp8_narrow<T, Kind, N>;
  __shared__ typename tile_t::barriers bars;
  extern __shared__ unsigned char wgmma_fp8_narrow_smem_raw[];
  const std::uint32_t raw = smem_address(wgmma_fp8_narrow_smem_raw);
  unsigned char* ring = wgmma_fp8_narrow_smem_raw + (((raw + 1023) & ~1023u) - raw);
  if (threadIdx.x == 0) {
    for (int s = 0; s < tile_t::stages; ++s) {
      cuda::ptx::mbarrier_init(&bars.full[s], 32 + 1);  // the producer lanes' cp.async, lane 0's bytes
      cuda::ptx::mbarrier_init(&bars.empty[s], tile_t::consumer_threads / 32 * tile_t::release_lanes);
    }
    cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(&b_map) : "memory");
  }
  __syncthreads();
  wait_for_prior_grids();
  allow_dependent_grids();
  if (threadIdx.x >= tile_t::consumer_threads) tile_t::producer(p, &b_map, ring, bars);
  else tile_t::consumer(p, ring, bars);
#else
  (void)p, (void)b_map;
  __trap();
#endif
}

}  // namespace moerunner::kernels
