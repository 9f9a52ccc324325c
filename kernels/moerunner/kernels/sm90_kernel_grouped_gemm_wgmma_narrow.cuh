// Device code of the narrow decode tiles (sm_90a only) of both fused backends' grouped GEMMs, on
// e4m3 block-scaled inputs (cuda_fused_fp8) or 16-bit ones (cuda_fused): the weights are the
// wgmma's M and the tile's tokens its N ("swap-AB"), so that the tensor work of a K tile follows
// the tokens a tile holds (8, 16 or 32) instead of a 64-row tile's. A 64 x 256 wgmma CTA spends
// 512 tensor cycles on every 32 KB weight K tile whatever rows it holds (~1 at decode); here
// 256 x N x 128 e4m3 multiply-adds take N x 8 cycles (16-bit: 64 K, N x 8 cycles too).
//
// Tile: 256 weight rows (four 64-row TMA boxes: for gate_up the gate and up rows of 64 act columns
// each for warpgroup 0, then of the next 64 for warpgroup 1, so the CTA covers 128 act columns,
// one fp8 quantization group; otherwise 256 consecutive rows) x N token rows x one 128-byte
// swizzle row of K per stage (128 e4m3 or 64 16-bit values). The schedule's tiles hold up to N
// rows of one expert (its block_m is N). Consumer warpgroup g runs boxes 2g and 2g + 1, one wgmma
// each per 32 bytes of K. e4m3: a fresh sum per K tile that it adds into f32 accumulators times
// the token's and the weight block's scales (the promotion of the wide kernels,
// sm90_kernel_grouped_gemm_wgmma_fp8.cuh, with the same products and order). 16-bit: the wgmma
// accumulate into the f32 accumulators over all of K, as the wide 16-bit kernels' do.
//
// One producer warp: lane 0 the weight boxes by TMA (zeros past n and k), every lane its share of
// the token rows (16-byte cp.async into the 128-byte swizzle, zeros past k) and of the e4m3
// scales; the stage's full barrier counts the 32 lanes' cp.async arrivals and lane 0's expected
// bytes. Persistent CTAs in fixed turns.
//
// Epilogue, through a staging tile of f32 rows [N][columns]: each consumer thread holds two
// weight rows x N / 4 tokens, so a token's columns are spread over the warpgroup. The consumers
// write their values, meet at a named barrier, and then each warp takes token rows:
//   e4m3 GEMM1: the activation of the router-weighted sums (per-channel scales first) staged, then
//     quantized 128 columns per warp instruction by quantize_group_to (the rule and bits of the
//     input rows' and the wide epilogue's);
//   16-bit GEMM1: the gate and up sums staged, then 8 act columns a lane by store_outputs8 (router
//     weight, bias, activation: the mma.sync GEMMs' epilogue);
//   GEMM2: the sums staged, then 8 columns a lane by store_outputs8 (bias by the first K range,
//     rows, slots or 16-byte reductions into the output) or as f32 K-split parts.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/kernels/sm90_kernel_grouped_gemm_wgmma_narrow.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstdint>
#include <type_traits>

#include <cuda.h>
#include <cuda/ptx>

#include "moerunner/kernels/activation_math.cuh"
#include "moerunner/kernels/kernel_fp8_gemm_params.cuh"
#include "moerunner/kernels/kernel_grouped_gemm.cuh"
#include "moerunner/kernels/kernel_local_plan.cuh"
#include "moerunner/kernels/kernel_quantize_fp8.cuh"
#include "moerunner/kernels/pdl.cuh"
#include "moerunner/kernels/sm90_ptx.cuh"

namespace moerunner::kernels {

// The narrow tiles' parameters: the fp8 GEMMs' (e4m3 operands and scales around the 16-bit
// parameters) or the 16-bit GEMMs' own.
template <class T, bool Fp8>
using narrow_params = std::conditional_t<Fp8, moe_gemm_fp8_params<T>, moe_gemm_params<T>>;

template <class T>
__device__ __forceinline__ const moe_gemm_params<T>& gemm_of(const moe_gemm_params<T>& p) {
  return p;
}
template <class T>
__device__ __forceinline__ const moe_gemm_params<T>& gemm_of(const moe_gemm_fp8_params<T>& p) {
  return p.g;
}
template <class T>
__device__ __forceinline__ moe_gemm_params<T>& gemm_of(moe_gemm_params<T>& p) {
  return p;
}
template <class T>
__device__ __forceinline__ moe_gemm_params<T>& gemm_of(moe_gemm_fp8_params<T>& p) {
  return p.g;
}

// The narrow tile's constants for N tokens, shared with the launch code.
template <moe_gemm_kind Kind, int N, bool Fp8>
struct wgmma_narrow_shape {
  static_assert(N == 8 || N == 16 || N == 32, "narrow tiles hold 8, 16 or 32 tokens");
  static constexpr int block_n = N;  // tokens per tile: the schedule's block_m
  static constexpr int weight_rows = 256, box_rows = 64, row_bytes = 128;
  static constexpr int block_k = Fp8 ? row_bytes : row_bytes / 2;  // K values per stage: one swizzle row
  static constexpr int boxes = weight_rows / box_rows;
  static constexpr int halves = Kind == moe_gemm_kind::gate_up ? 2 : 1;
  static constexpr int out_cols = weight_rows / halves;  // act or output columns per CTA
  static constexpr int w_bytes = weight_rows * row_bytes;
  static constexpr int x_offset = w_bytes, x_bytes = N * row_bytes;  // token rows: 1 KB swizzle atoms
  // e4m3 only: the tokens' and the boxes' scales of the stage's K block.
  static constexpr int a_scale_offset = x_offset + x_bytes, b_scale_offset = a_scale_offset + 4 * N;
  static constexpr int stage_end = Fp8 ? b_scale_offset + 4 * boxes : a_scale_offset;
  static constexpr int stage_bytes = (stage_end + 1023) / 1024 * 1024;
  // f32 staging rows (e4m3 GEMM1: out_cols act values; otherwise every weight row's sum), padded
  // by 16 bytes: the consumers' writes (8 weight rows x 4 tokens two rows apart per instruction)
  // then hit 32 banks.
  static constexpr int staging_cols = Fp8 && Kind != moe_gemm_kind::down ? out_cols : weight_rows;
  static constexpr int staging_row_bytes = 4 * staging_cols + 16;
  static constexpr int staging_bytes = N * staging_row_bytes;
  static constexpr int consumers = 2, consumer_threads = 128 * consumers, threads = consumer_threads + 32;
  // As many stages as fit beside the staging tile (4 KB for alignment and static shared memory:
  // the barriers and a local plan).
  static constexpr int stages_fit = (227 * 1024 - staging_bytes - 4096) / stage_bytes;
  static constexpr int stages = stages_fit > 8 ? 8 : stages_fit;
  static constexpr int smem_bytes = stages * stage_bytes + staging_bytes + 1024;
  static_assert(stages >= 4, "the ring must hold at least four stages");
  static_assert(smem_bytes + 8 * 1024 <= (1 << 18), "descriptor start addresses are 14 bits of bytes / 16");
  static_assert(smem_bytes + 3072 <= 227 * 1024, "the ring, the staging tile and the static shared memory fit");
};

template <class T, moe_gemm_kind Kind, int N, bool Fp8>
struct moe_gemm_wgmma_narrow : wgmma_narrow_shape<Kind, N, Fp8> {
  using shape = wgmma_narrow_shape<Kind, N, Fp8>;
  using shape::a_scale_offset, shape::b_scale_offset, shape::block_k, shape::box_rows, shape::boxes,
      shape::consumer_threads, shape::halves, shape::out_cols, shape::row_bytes, shape::stage_bytes, shape::stages,
      shape::staging_row_bytes, shape::w_bytes, shape::x_offset;
  using params = narrow_params<T, Fp8>;
  using in_t = std::conditional_t<Fp8, std::uint8_t, T>;  // A's and B's elements
  static constexpr int regs = N / 2;  // a box's accumulators per thread
  static constexpr int chunks = N * row_bytes / 16 / 32;  // 16-byte token-row copies per producer lane per stage
  static constexpr int chunk_values = 16 / static_cast<int>(sizeof(in_t));
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

  __device__ static void producer(const params& p, const CUtensorMap* b_map, unsigned char* ring, barriers& bars) {
    const moe_gemm_params<T>& g = gemm_of(p);
    const int lane = threadIdx.x % 32;
    const int k_tiles = (g.k + block_k - 1) / block_k;
    const auto* a = reinterpret_cast<const unsigned char*>(p.a);
    const std::int64_t a_row_bytes = static_cast<std::int64_t>(g.k) * sizeof(in_t);
    // e4m3 scales: lanes 0..N-1 their token's, lanes 0..3 their box's.
    [[maybe_unused]] int scale_src = -1;
    [[maybe_unused]] std::int64_t b_scale_at = 0;
    [[maybe_unused]] bool b_scale_ok = false, copies_b_scale = false, per_block = false;
    if constexpr (Fp8) {
      per_block = p.b_scaling == fp8_weight_scaling::block128;
      copies_b_scale = lane < boxes && p.b_scaling != fp8_weight_scaling::per_channel;
    }
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
      if constexpr (Fp8) {
        scale_src = lane < N ? a_source_row<Kind>(tile, lane, g.row_to_slot, g.top_k) : -1;
        if (copies_b_scale) {
          int col = 0, half = 0;
          box_origin(lane, n0, col, half);
          const std::int64_t row = b_row<Kind>(g, half, col);
          b_scale_ok = row < g.b_rows_per_expert;  // a box past n reads zeros
          b_scale_at = per_block ? (tile.expert * (g.b_rows_per_expert / fp8_group) + row / fp8_group) * k_tiles
                                 : tile.expert;
        }
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
            tma_load_box<1>(sa + b * box_rows * row_bytes, b_map, coords, &bars.full[stage]);
          }
        }
#pragma unroll
        for (int i = 0; i < chunks; ++i) {
          const int c = lane + 32 * i, r = c / 8, chunk = c % 8;
          // k is a multiple of 8 (16-bit) or 128 (e4m3): a chunk is wholly in or out.
          const bool ok = src[i] >= 0 && kt * block_k + chunk * chunk_values < g.k;
          cp_async_16(smem_address(sa + x_offset + r * row_bytes + (chunk ^ (r & 7)) * 16),
                      a + (ok ? src[i] * a_row_bytes + kt * row_bytes + chunk * 16 : 0), ok);
        }
        if constexpr (Fp8) {
          if (lane < N)
            cp_async_4(smem_address(sa + a_scale_offset + 4 * lane),
                       p.a_scale + (scale_src >= 0 ? static_cast<std::int64_t>(scale_src) * k_tiles + kt : 0),
                       scale_src >= 0);
          if (copies_b_scale)
            cp_async_4(smem_address(sa + b_scale_offset + 4 * lane),
                       p.b_scale + (b_scale_ok ? b_scale_at + (per_block ? kt : 0) : 0), b_scale_ok);
        }
        cp_async_arrive_noinc(&bars.full[stage]);
        if (++stage == stages) {
          stage = 0;
          phase ^= 1u;
        }
      }
    }
  }

  // The K tile's wgmma of boxes 2 group + b into d[b] (the stage's descriptors): a fresh sum
  // (e4m3, promoted after) or added to d (16-bit). Once they have retired, the warp's lane 0
  // releases the stage.
  __device__ __forceinline__ static void tile_mma(float (&d)[2][regs], std::uint64_t w_desc, std::uint64_t x_desc,
                                                  std::uint64_t* empty, int lane) {
    constexpr std::uint64_t box_desc = (box_rows * row_bytes) >> 4;
    wgmma_fence();
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int kk = 0; kk < row_bytes / 32; ++kk) {  // 32 bytes of K per wgmma
        const auto step = static_cast<std::uint64_t>(kk * 32 >> 4);
        if constexpr (Fp8) wgmma_m64nk32_e4m3<N>(d[b], w_desc + b * box_desc + step, x_desc + step, kk);
        else wgmma_m64nk16<T, N>(d[b], w_desc + b * box_desc + step, x_desc + step, 1);
      }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(d[0]);
    wgmma_fence_operands(d[1]);
    __syncwarp();
    if (lane < release_lanes) cuda::ptx::mbarrier_arrive(empty);
  }

  __device__ static void consumer(const params& p, unsigned char* ring, barriers& bars) {
    const moe_gemm_params<T>& g = gemm_of(p);
    // Warp-uniform (read from lane 0) so that the descriptors stay in uniform registers.
    const int group = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int k_tiles = (g.k + block_k - 1) / block_k;
    [[maybe_unused]] bool per_channel = false;
    if constexpr (Fp8) per_channel = p.b_scaling == fp8_weight_scaling::per_channel;
    if constexpr (Kind != moe_gemm_kind::down) clear_output(g, static_cast<int>(threadIdx.x), consumer_threads);
    const std::uint32_t ring_addr = smem_address(ring);
    // Boxes 2 group and 2 group + 1 (A) and the token rows (B) in stage 0; a stage or box further
    // is an add to the start-address field.
    const std::uint64_t w_desc = sw128_kmajor_desc(ring_addr + 2 * group * box_rows * row_bytes);
    const std::uint64_t x_desc = sw128_kmajor_desc(ring_addr + x_offset);
    constexpr std::uint64_t stage_desc = stage_bytes >> 4;
    unsigned char* staging = ring + stages * stage_bytes;
    const int tiles = *g.tile_count;
    const std::int64_t work = static_cast<std::int64_t>(tiles) * g.n_tiles * g.k_splits;
    std::uint32_t phase = 0;
    int stage = 0;
    float acc[2][regs];
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
        // The token rows (and scales) came by cp.async (generic proxy): order them before the wgmma's reads.
        cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
        const std::uint64_t off = static_cast<std::uint64_t>(stage) * stage_desc;
        if constexpr (Fp8) {
          const unsigned char* sp = ring + stage * stage_bytes;
          const float* a_scales = reinterpret_cast<const float*>(sp + a_scale_offset);
          const float* b_scales = reinterpret_cast<const float*>(sp + b_scale_offset);
          // Register 4j + 2h + q of a box: weight row 16 warp + lane / 4 + 8h, token 8j + 2(lane % 4) + q.
          float sa[regs / 2];
#pragma unroll
          for (int j = 0; j < N / 8; ++j)
#pragma unroll
            for (int q = 0; q < 2; ++q) sa[2 * j + q] = a_scales[8 * j + 2 * (lane % 4) + q];
          const float sb0 = per_channel ? 1.0f : b_scales[2 * group];
          const float sb1 = per_channel ? 1.0f : b_scales[2 * group + 1];
          float part[2][regs];
          tile_mma(part, w_desc + off, x_desc + off, &bars.empty[stage], lane);
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
        } else {
          tile_mma(acc, w_desc + off, x_desc + off, &bars.empty[stage], lane);
        }
        if (++stage == stages) {
          stage = 0;
          phase ^= 1u;
        }
      }
      const int rows = tile.row_end - tile.row_begin;
      if constexpr (Fp8)
        if (per_channel) scale_rows(p, tile, n0, group, warp, lane, acc);
      // Every consumer warp has read the last item's staging rows.
      named_barrier();
      stage_values(g, tile, staging, group, warp, lane, acc);
      named_barrier();
      const int cw = static_cast<int>(threadIdx.x / 32);  // 0..7
      if constexpr (Kind == moe_gemm_kind::down) store_rows(g, tile, n0, it.split, staging, cw, lane, rows);
      else if constexpr (Fp8) store_act(p, tile, n0, staging, cw, lane, rows);
      else store_act16(g, tile, n0, staging, static_cast<int>(threadIdx.x), rows);
    }
  }

  // Per-channel e4m3 weights: each sum times its weight row's scale (columns past n keep their zeros).
  __device__ __forceinline__ static void scale_rows(const params& p, const gpu::moe_m_tile& tile, int n0, int group,
                                                    int warp, int lane, float (&acc)[2][regs]) {
    const moe_gemm_params<T>& g = gemm_of(p);
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

  // The thread's values into the staging rows (token t at t * staging_row_bytes). e4m3 GEMM1: the
  // act value of each act column (router weight of the token first, as the wide epilogue), at
  // column 64 group + weight row (gated) or 128 group + 64 b + weight row. Otherwise the sums:
  // 16-bit gated GEMM1 the gate sums of act column c at c and their up sums at 128 + c (c = 64
  // group + weight row); others at 128 group + 64 b + weight row.
  __device__ __forceinline__ static void stage_values(const moe_gemm_params<T>& g, const gpu::moe_m_tile& tile,
                                                      unsigned char* staging, int group, int warp, int lane,
                                                      const float (&acc)[2][regs]) {
    const int rows = tile.row_end - tile.row_begin;
    const auto at = [&](int t, int col) { return reinterpret_cast<float*>(staging + t * staging_row_bytes) + col; };
    if constexpr (Kind == moe_gemm_kind::down || !Fp8) {
#pragma unroll
      for (int b = 0; b < 2; ++b)
#pragma unroll
        for (int j = 0; j < N / 8; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int q = 0; q < 2; ++q) {
              const int r = 16 * warp + lane / 4 + 8 * h;
              const int col = halves == 2 ? 128 * b + 64 * group + r : 128 * group + 64 * b + r;
              *at(8 * j + 2 * (lane % 4) + q, col) = acc[b][4 * j + 2 * h + q];
            }
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

  // e4m3 GEMM1: consumer warp cw quantizes token rows cw, cw + 8, .. of the staging tile, one
  // group of 128 act columns per warp instruction (lane l: columns 4l .. 4l + 3; the scale from lane 0).
  __device__ __forceinline__ static void store_act(const params& p, const gpu::moe_m_tile& tile, int n0,
                                                   const unsigned char* staging, int cw, int lane, int rows) {
    const moe_gemm_params<T>& g = gemm_of(p);
    constexpr int groups = out_cols / fp8_group;  // 1 gated, 2 otherwise
    for (int u = cw; u < rows * groups; u += consumer_threads / 32) {
      const int t = u / groups, grp = u % groups, col = n0 + fp8_group * grp;
      if (col >= g.n) continue;  // n is a multiple of 128: a group is wholly in or out
      quantize_group_to(reinterpret_cast<const float*>(staging + t * staging_row_bytes) + fp8_group * grp,
                        tile.row_begin + t, col, g.n, p.act, p.act_scale, lane);
    }
  }

  // 16-bit GEMM1: consumer thread i takes token rows' 8-column pieces i, i + 256, .. (out_cols / 8
  // pieces a row) by store_outputs8: router weight, bias, activation, 16-byte store into act.
  __device__ __forceinline__ static void store_act16(const moe_gemm_params<T>& g, const gpu::moe_m_tile& tile, int n0,
                                                     const unsigned char* staging, int thread, int rows) {
    constexpr int pieces = out_cols / 8;
    for (int u = thread; u < rows * pieces; u += consumer_threads) {
      const int t = u / pieces, c = 8 * (u % pieces), col = n0 + c;
      if (col >= g.n) continue;  // n is a multiple of 8: a piece is wholly in or out
      const float* src = reinterpret_cast<const float*>(staging + t * staging_row_bytes);
      float v[8], up[8];
      load8(v, src + c);
      if constexpr (halves == 2) load8(up, src + 128 + c);
      store_outputs8<T, Kind>(g, tile.expert, tile.row_begin + t, col, v, up);
    }
  }

  // GEMM2: consumer warp cw stores token rows cw, cw + 8, .. (lane l: columns n0 + 8l .. + 7) by
  // store_outputs8 (the bias by the first K range, times the row's factor as 16-bit pairs into
  // rows or slots, or added into the output: the mma.sync GEMMs' epilogue); K-split parts in f32.
  __device__ __forceinline__ static void store_rows(const moe_gemm_params<T>& g, const gpu::moe_m_tile& tile, int n0,
                                                    int split, const unsigned char* staging, int cw, int lane,
                                                    int rows) {
    const int col = n0 + 8 * lane;
    if (col >= g.n) return;  // n is a multiple of 8: 8 columns are wholly in or out
    const bool bias = split == 0 && g.bias != nullptr;  // (none in fp8 runs)
    for (int t = cw; t < rows; t += consumer_threads / 32) {
      const float* src = reinterpret_cast<const float*>(staging + t * staging_row_bytes) + 8 * lane;
      float v[8];
      load8(v, src);
      const int row = tile.row_begin + t;
      if (g.store == down_store::partials) {
        if (bias)
#pragma unroll
          for (int j = 0; j < 8; ++j) v[j] += bias_at(g, tile.expert, col + j);
        float* part = g.partials + split * g.split_stride + static_cast<std::int64_t>(row) * g.n + col;
        *reinterpret_cast<float4*>(part) = make_float4(v[0], v[1], v[2], v[3]);
        *reinterpret_cast<float4*>(part + 4) = make_float4(v[4], v[5], v[6], v[7]);
        continue;
      }
      store_outputs8<T, moe_gemm_kind::down>(g, tile.expert, row, col, v, v, bias);
    }
  }
};

// Persistent CTAs over work items in decode_work_item's order, in fixed turns (GEMM2's K in
// g.k_splits ranges into the output or f32 parts). With g.local_ids (a few slots at decode)
// each CTA orders the rows and cuts the tiles itself in shared memory (kernel_local_plan.cuh;
// GEMM1's first CTA reports bad ids and writes slot_to_row where asked), so that no plan
// kernel runs before. The body exists only in sm_90a code; elsewhere it traps (the launch code
// checks first).
template <class T, moe_gemm_kind Kind, int N, bool Fp8>
__global__ void __launch_bounds__(wgmma_narrow_shape<Kind, N, Fp8>::threads, 1)
    moe_grouped_gemm_wgmma_narrow_kernel(const narrow_params<T, Fp8> p, const __grid_constant__ CUtensorMap b_map) {
#if MOERUNNER_WGMMA_COMPILED
  using tile_t = moe_gemm_wgmma_narrow<T, Kind, N, Fp8>;
  __shared__ typename tile_t::barriers bars;
  __shared__ local_plan plan;
  extern __shared__ unsigned char wgmma_narrow_smem_raw[];
  const std::uint32_t raw = smem_address(wgmma_narrow_smem_raw);
  unsigned char* ring = wgmma_narrow_smem_raw + (((raw + 1023) & ~1023u) - raw);
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
  const auto run = [&](const narrow_params<T, Fp8>& q) {
    if (threadIdx.x >= tile_t::consumer_threads) tile_t::producer(q, &b_map, ring, bars);
    else tile_t::consumer(q, ring, bars);
  };
  const moe_gemm_params<T>& g = gemm_of(p);
  if (g.local_ids != nullptr) {
    const bool writes_plan = Kind != moe_gemm_kind::down && blockIdx.x == 0;
    build_local_plan<tile_t::threads>(g.local_ids, g.local_slots, g.local_experts, N, plan,
                                      writes_plan ? g.local_error : nullptr, writes_plan ? g.local_status : nullptr,
                                      writes_plan ? g.local_slot_to_row : nullptr);
    narrow_params<T, Fp8> q = p;
    moe_gemm_params<T>& qg = gemm_of(q);
    qg.tiles = plan.tiles;
    qg.tile_count = &plan.tile_count;
    qg.row_to_slot = plan.row_to_slot;
    run(q);
  } else {
    run(p);
  }
#else
  (void)p, (void)b_map;
  __trap();
#endif
}

}  // namespace moerunner::kernels
