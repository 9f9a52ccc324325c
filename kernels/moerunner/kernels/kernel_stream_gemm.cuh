// Device code of the fused backend's decode GEMMs, over the same M-tile schedule, parameters
// and epilogue targets as the grouped GEMMs (kernel_grouped_gemm.cuh):
//
//   moe_stream_gemm_kernel<T, Policy, kind, Fp8>: persistent CTAs stride over (M tile, N tile)
//     items; a CTA's 32 weight rows are the mma.sync's M ("swap-AB") and its tile's tokens the
//     mma's N in blocks of 8; each warp walks its own part of K through a private cp.async ring,
//     and the parts meet in shared memory for the epilogue (bias and activation into act, or
//     GEMM2's bias, store or atomic add), so each output's bias is added once whatever the warps'
//     K split.
//   Fp8: the same rings and fragments over e4m3 operands (a 128-byte stage row is 128 values, one
//     scale block of K; m16n8k32 e4m3 in place of m16n8k16), each stage's sums added into f32
//     times the token's and the weight block's scales as the wgmma fp8 kernels do; GEMM1 writes
//     act in f32 (its 128-column quantization groups span several CTAs: a kernel of its own
//     quantizes it), per-channel weight scales are applied in the epilogue.
//
// Why this shape: where an expert sees a handful of rows, the GEMM is a weight stream, and
// what it needs is many bytes in flight per SM with nothing between a load and the next one.
// A warp-private ring needs no CTA barrier in the main loop, and async copies hold no
// registers, so each warp keeps stages - 1 K tiles of its rows in flight whatever the compiler
// schedules (loads into registers were interleaved with the mma that use them).
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/kernels/kernel_stream_gemm.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "moerunner/gpu/grouped_gemm_tuning.hpp"
#include "moerunner/kernels/activation_math.cuh"
#include "moerunner/kernels/kernel_combine.cuh"
#include "moerunner/kernels/kernel_fp8_gemm_params.cuh"
#include "moerunner/kernels/kernel_grouped_gemm.cuh"
#include "moerunner/kernels/kernel_local_plan.cuh"
#include "moerunner/kernels/l2_hints.cuh"
#include "moerunner/kernels/pdl.cuh"

namespace moerunner::kernels {

// m16n8k32 on e4m3 with f32 accumulators (sm_89 and later; the fp8 stream GEMMs need sm_90).
__device__ __forceinline__ void mma_e4m3_16832(float (&d)[4], const std::uint32_t (&a)[4],
                                               const std::uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  (void)d, (void)a, (void)b;
  __trap();
#endif
}

template <class T, class Policy, moe_gemm_kind Kind, bool Fp8 = false>
struct moe_stream_gemm {
  static constexpr gpu::stream_gemm_tuning tuning = Policy::tuning;
  static constexpr int warps = tuning.warps, threads = tuning.threads(), stages = tuning.stages;
  using params = std::conditional_t<Fp8, moe_gemm_fp8_params<T>, moe_gemm_params<T>>;
  using E = std::conditional_t<Fp8, std::uint8_t, T>;  // operand element
  // A stage row is 128 bytes of K: 64 16-bit values, or 128 e4m3 (one scale block); 16-byte
  // copies of `chunk` values; every mma takes 32 bytes of each row (k16 16-bit, k32 e4m3).
  static constexpr int bm = tuning.block_m, bn = tuning.block_n, bk = 128 / static_cast<int>(sizeof(E));
  static constexpr int chunk = 16 / static_cast<int>(sizeof(E)), k_steps = 4;
  // Weight copies carry an L2 policy (createpolicy) in the 16-bit kernels only: in the e4m3
  // ones, nvcc 13.0's ptxas left the copies' policy descriptor registers unwritten (SASS
  // `LDGSTS ... desc[UR1]` with UR1 never set; an illegal instruction on the H200), so they keep
  // the 256-byte fetch hint alone and the default policy (p.weights_evict_first must be off).
  static constexpr bool l2_policy = !Fp8;
  static constexpr int stage_elems = (bn + bm) * bk;  // weight rows, then token rows
  // Gated: m16 block 0 holds the gate rows of 16 output columns, block 1 their up rows.
  static constexpr bool gated = Kind == moe_gemm_kind::gate_up;
  static constexpr int out_cols = gated ? bn / 2 : bn;
  static constexpr int token_blocks = bm / 8;
  // 16-byte pieces of a stage: 8 per 128-byte row; each lane copies every 32nd.
  static constexpr int copies = (bn + bm) * 8 / 32;
  // Partial sums [warp][token][row], rows padded so that a warp's stores spread over the banks.
  static constexpr int red_stride = bn + 4;
  static constexpr int red_floats = warps * bm * red_stride;
  static constexpr int out_vectors = bm * out_cols / 8;

  static_assert(gpu::check_stream_gemm_tuning(tuning));
  static_assert(sizeof(T) == 2, "the outputs are 16-bit");
  static_assert(!Fp8 || tuning.min_arch >= 90, "e4m3 mma.sync needs sm_89 or later: an sm_90 tuning");
  static_assert(out_vectors <= threads, "the epilogue gives each thread at most one 8-column vector");

  // The 16-bit GEMM's parameters (sizes, schedule, rows, stores) of either operand kind.
  __host__ __device__ __forceinline__ static const moe_gemm_params<T>& gemm(const params& p) {
    if constexpr (Fp8) return p.g;
    else return p;
  }
  __host__ __device__ __forceinline__ static moe_gemm_params<T>& gemm(params& p) {
    if constexpr (Fp8) return p.g;
    else return p;
  }

  // The token row of a tile's row t (its source in a), or -1 past the tile's rows.
  __device__ __forceinline__ static std::int64_t token_source(const moe_gemm_params<T>& p, const gpu::moe_m_tile& tile,
                                                              int t) {
    if (t >= tile.row_end - tile.row_begin) return -1;
    const int row = tile.row_begin + t;
    return Kind == moe_gemm_kind::down ? row : p.row_to_slot[row] / p.top_k;
  }

  // Source row of stage row `r` (weight rows, then token rows), or null past the GEMM or tile.
  __device__ __forceinline__ static const E* source_row(const params& pp, const gpu::moe_m_tile& tile, int n0,
                                                        int r) {
    const moe_gemm_params<T>& p = gemm(pp);
    if (r < bn) {
      const int col = n0 + (gated ? r % 16 : r);
      if (col >= p.n) return nullptr;
      const std::int64_t row = b_row<Kind>(p, gated ? r / 16 : 0, col);
      return pp.b + (static_cast<std::int64_t>(tile.expert) * p.b_rows_per_expert + row) * p.k;
    }
    const std::int64_t src = token_source(p, tile, r - bn);
    return src < 0 ? nullptr : pp.a + src * p.k;
  }

  // The cp.async copies of K tile `kt` into `stage` for stage rows [First * 4, Last * 4) (the
  // weight rows are copies [0, bn / 4), the token rows the rest): pieces past K or of a null row
  // read as zeros. `p_any` is any valid address: a copy that reads nothing still names one.
  // Weight copies carry the L2 policy `weight_policy` (and the 256-byte fetch hint if asked).
  template <int First, int Last>
  __device__ __forceinline__ static void load_stage(E* stage, const E* const (&src)[copies], const E* p_any, int kt,
                                                    int k, int lane, std::uint64_t weight_policy, bool fetch_256) {
    const int piece = lane & 7, kcol = kt * bk + piece * chunk;
#pragma unroll
    for (int i = First; i < Last; ++i) {
      const int r = i * 4 + (lane >> 3);
      const bool ok = src[i] != nullptr && kcol < k;  // k is a multiple of chunk: a piece is wholly in or out
      const std::uint32_t dst = smem_address(stage + r * bk + swizzled_chunk<64>(r, piece) * chunk);
      const E* from = ok ? src[i] + kcol : p_any;
      if (i >= bn / 4) cp_async_16(dst, from, ok);
      else if (!l2_policy) fetch_256 ? cp_async_16_fetch_256(dst, from, ok) : cp_async_16(dst, from, ok);
      else if (fetch_256) cp_async_16_hinted<true>(dst, from, ok, weight_policy);
      else cp_async_16_hinted<false>(dst, from, ok, weight_policy);
    }
  }

  __device__ __forceinline__ static void mma(float (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2]) {
    if constexpr (Fp8) mma_e4m3_16832(d, a, b);
    else mma_16816<T>::run(d, a, b);
  }

  // Four steps of 32 bytes of K: A (weight rows) and B (tokens, stored [n][k]) by ldmatrix as the
  // grouped GEMM reads its tiles. ldmatrix moves 16-byte rows of 8 16-bit values; as bytes, the
  // fragments it gives are also those of m16n8k32 on e4m3 (4 values per register, in K order).
  __device__ __forceinline__ static void compute_stage(const E* stage, int lane, int used_blocks,
                                                       float (&acc)[2][token_blocks][4]) {
    const E* sw = stage;
    const E* sx = stage + bn * bk;
#pragma unroll
    for (int kk = 0; kk < k_steps; ++kk) {
      std::uint32_t a[2][4];
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        const int r = m * 16 + (lane & 15);
        ldmatrix_x4(a[m], smem_address(sw + r * bk + swizzled_chunk<64>(r, kk * 2 + (lane >> 4)) * chunk));
      }
      // Token blocks in pairs by ldmatrix.x4 (lanes 16-31 address the second block), a last
      // odd one by ldmatrix.x2.
#pragma unroll
      for (int j = 0; j < token_blocks; j += 2) {
        if (j >= used_blocks) continue;
        const int c = kk * 2 + ((lane >> 3) & 1);
        std::uint32_t b0[2], b1[2];
        if constexpr (token_blocks % 2 == 0) {
          const int r = j * 8 + (lane & 7) + ((lane >> 4) << 3);
          std::uint32_t x[4];
          ldmatrix_x4(x, smem_address(sx + r * bk + swizzled_chunk<64>(r, c) * chunk));
          b0[0] = x[0], b0[1] = x[1], b1[0] = x[2], b1[1] = x[3];
        } else {
          const int r = j * 8 + (lane & 7);
          ldmatrix_x2(b0, smem_address(sx + r * bk + swizzled_chunk<64>(r, c) * chunk));
        }
        mma(acc[0][j], a[0], b0);
        mma(acc[1][j], a[1], b0);
        if (token_blocks % 2 == 0 && j + 1 < used_blocks) {
          mma(acc[0][j + 1], a[0], b1);
          mma(acc[1][j + 1], a[1], b1);
        }
      }
    }
  }

  // Work item w of the grid: its M tile and the first output column of its N tile.
  struct item_ref {
    gpu::moe_m_tile tile;
    int n0;
  };
  // A word of the schedule. The plan kernel's is read from L2 (ld.global.cg): GEMM2 reads it
  // before its programmatic wait, when only the L2 is sure to hold what the plan kernel wrote
  // (L1 may keep an earlier run's). A CTA-local one (p.local_ids set) is in shared memory.
  template <class U>
  __device__ __forceinline__ static U read_schedule(const moe_gemm_params<T>& p, const U* src) {
    return p.local_ids != nullptr ? *src : __ldcg(src);
  }

  __device__ __forceinline__ static gpu::moe_m_tile tile_at(const moe_gemm_params<T>& p, int m_tile) {
    const int4 t = read_schedule(p, reinterpret_cast<const int4*>(p.tiles + m_tile));
    return {t.x, t.y, t.z, t.w};
  }

  __device__ __forceinline__ static item_ref item_at(const moe_gemm_params<T>& p, int tiles, std::int64_t w) {
    const moe_work_item it = decode_work_item(w, tiles, p.n_tiles, 1, p.raster_band);
    return {tile_at(p, it.m_tile), it.n_tile * out_cols};
  }

  // GEMM1 asks L2 for the weights GEMM2 (the same tuning, over the same schedule) reads first,
  // in GEMM2's item order, up to p.next.bytes in all: whole items when GEMM2's first wave fits
  // (then further items while the bytes last), else the first K tiles of every warp's range of
  // each first-wave item, the tiles GEMM2's rings load first. Meant to fill the HBM's idle
  // time around the hand-off between the GEMMs with bytes GEMM2 reads anyway; on an H200 it
  // measured no faster (GEMM1 slows by what GEMM2 gains; bench/NOTES.md, round 9), so it is off
  // unless asked for (gpu::stream_l2_use). The prefetches hold no registers or shared memory,
  // and change no result.
  __device__ __forceinline__ static void prefetch_next_weights(const moe_gemm_params<T>& p, int tiles) {
    const auto& nx = p.next;
    const std::int64_t work = static_cast<std::int64_t>(tiles) * nx.n_tiles;
    if (nx.b == nullptr || work == 0 || nx.grid <= 0) return;
    constexpr int next_cols = bn;  // GEMM2 is never gated
    constexpr std::int64_t tile_row_bytes = bk * sizeof(T);
    constexpr std::int64_t prefetch_chunk = 64 * 1024;  // bytes of one bulk prefetch
    const int k_tiles = (nx.k + bk - 1) / bk;
    const int longest = (k_tiles + warps - 1) / warps;
    const std::int64_t first = work < nx.grid ? work : nx.grid;
    std::int64_t per_range = nx.bytes / (first * next_cols * warps * tile_row_bytes);  // K tiles
    std::int64_t items = first;
    if (per_range >= longest) {
      per_range = longest;
      const std::int64_t fit = nx.bytes / (static_cast<std::int64_t>(next_cols) * nx.k * sizeof(T));
      items = fit < first ? first : (fit < work ? fit : work);
    }
    if (per_range == 0) return;
    const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * threads;
    // Consecutive tasks on different CTAs: every SM's copy engine takes a share.
    const std::int64_t first_task = threadIdx.x * static_cast<std::int64_t>(gridDim.x) + blockIdx.x;
    if (per_range == longest) {
      // Whole items: an item's rows are consecutive, one range of memory, asked for by one thread.
      for (std::int64_t i = first_task; i < items; i += stride) {
        const moe_work_item it = decode_work_item(i, tiles, nx.n_tiles, 1, p.raster_band);
        const int col = it.n_tile * next_cols;
        const int rows = nx.n - col < next_cols ? nx.n - col : next_cols;
        const std::int64_t row = static_cast<std::int64_t>(tile_at(p, it.m_tile).expert) * nx.b_rows_per_expert + col;
        const char* from = reinterpret_cast<const char*>(nx.b + row * nx.k);
        const std::int64_t bytes = static_cast<std::int64_t>(rows) * nx.k * sizeof(T);
        for (std::int64_t off = 0; off < bytes; off += prefetch_chunk)
          prefetch_l2(from + off, static_cast<std::uint32_t>(bytes - off < prefetch_chunk ? bytes - off : prefetch_chunk));
      }
      return;
    }
    // The first K tiles of each range: one task per (item, weight row, warp range).
    const std::int64_t tasks = items * next_cols * warps;
    for (std::int64_t t = first_task; t < tasks; t += stride) {
      const int range = static_cast<int>(t % warps), r = static_cast<int>(t / warps % next_cols);
      const moe_work_item it = decode_work_item(t / (warps * next_cols), tiles, nx.n_tiles, 1, p.raster_band);
      const int col = it.n_tile * next_cols + r;
      if (col >= nx.n) continue;
      int kt_begin = 0, kt_end = 0;
      split_k_range(k_tiles, range, warps, kt_begin, kt_end);
      const std::int64_t k0 = static_cast<std::int64_t>(kt_begin) * bk;
      const std::int64_t elems = per_range * bk < nx.k - k0 ? per_range * bk : nx.k - k0;
      if (kt_end == kt_begin || elems <= 0) continue;
      const std::int64_t row = static_cast<std::int64_t>(tile_at(p, it.m_tile).expert) * nx.b_rows_per_expert + col;
      prefetch_l2(nx.b + row * nx.k + k0, static_cast<std::uint32_t>(elems * sizeof(T)));
    }
  }

  // A warp's copies, stages - 1 K tiles ahead of its mma: the CTA's items form one sequence of
  // n K tiles each (the warp's part of K is the same in every item), so the next item's first
  // tiles are in flight while this one's partial sums are reduced and stored.
  struct loader {
    const E* src[copies];
    std::int64_t item = -1;  // the CTA-local item src[] points into
    std::uint64_t weight_policy = 0;

    // Issues copies [First, Last) of tile g of the sequence (nothing past `total`).
    template <int First = 0, int Last = copies>
    __device__ __forceinline__ void issue(const params& pp, int tiles, E* ring, std::int64_t g, int n,
                                          std::int64_t total, int kt_begin, int lane) {
      if (g >= total) return;
      const moe_gemm_params<T>& p = gemm(pp);
      const std::int64_t j = g / n;
      if (j != item) {
        item = j;
        const item_ref r = item_at(p, tiles, blockIdx.x + j * gridDim.x);
#pragma unroll
        for (int i = 0; i < copies; ++i) src[i] = source_row(pp, r.tile, r.n0, i * 4 + (lane >> 3));
      }
      load_stage<First, Last>(ring + static_cast<int>(g % stages) * stage_elems, src, pp.b,
                              kt_begin + static_cast<int>(g % n), p.k, lane, weight_policy, p.weights_fetch_256);
    }
  };

  // fp8: the scales one stage's sums are promoted with, for the thread's accumulators: the
  // weight block's of each m16 block, and the token's of each accumulator column.
  struct stage_scales {
    float b[2];
    float a[token_blocks][2];
  };
  // fp8: where a work item's scales come from: each m16 block's first B row (all 16 rows lie in
  // one 128-row block: n0 is a multiple of 16, gate and up rows of a column pair alike), and the
  // token rows of the thread's accumulator columns (-1 past the tile).
  struct scale_sources {
    std::int64_t b_row[2];
    std::int64_t a_src[token_blocks][2];
  };
  __device__ __forceinline__ static scale_sources scale_sources_of(const moe_gemm_params<T>& p, const item_ref& r,
                                                                   int lane) {
    scale_sources s;
#pragma unroll
    for (int m = 0; m < 2; ++m) s.b_row[m] = b_row<Kind>(p, gated ? m : 0, r.n0 + (gated ? 0 : 16 * m));
#pragma unroll
    for (int b = 0; b < token_blocks; ++b)
#pragma unroll
      for (int q = 0; q < 2; ++q) s.a_src[b][q] = token_source(p, r.tile, b * 8 + 2 * (lane & 3) + q);
    return s;
  }
  // The token scales were written by the kernel before (the quantizer): read from L2.
  __device__ __forceinline__ static stage_scales stage_scales_at(const params& pp, const scale_sources& src,
                                                                 int expert, int kt) {
    stage_scales s{};
    if constexpr (Fp8) {
      const int k_tiles = pp.g.k / bk;
#pragma unroll
      for (int m = 0; m < 2; ++m) s.b[m] = fp8_b_block_scale(pp, expert, src.b_row[m], kt);
#pragma unroll
      for (int b = 0; b < token_blocks; ++b)
#pragma unroll
        for (int q = 0; q < 2; ++q)
          s.a[b][q] = src.a_src[b][q] < 0 ? 0.0f : __ldcg(pp.a_scale + src.a_src[b][q] * k_tiles + kt);
    }
    return s;
  }

  // GEMM2's weights depend on nothing GEMM1 writes, and its schedule was written before GEMM1
  // started: launched as GEMM1's programmatic dependent, it loads its first weight tiles while
  // GEMM1's last CTAs run, and waits for GEMM1 only before its first act rows.
  static constexpr bool early_weights = Kind == moe_gemm_kind::down;

  // Every item of this CTA: each warp accumulates its K range, then the CTA sums the ranges
  // and stores. Ring discipline as the grouped GEMM's, per warp: stages - 1 tiles in flight,
  // groups committed even when empty; the __syncwarp after the wait makes every lane's copies
  // visible and orders the ldmatrix reads of the tile before the copies that overwrite it.
  __device__ __forceinline__ static void run(E* ring, float* red, const params& pp) {
    const moe_gemm_params<T>& p = gemm(pp);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int tiles = read_schedule(p, p.tile_count);
    const std::int64_t work = static_cast<std::int64_t>(tiles) * p.n_tiles;
    const std::int64_t items = blockIdx.x < work ? (work - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
    int kt_begin = 0, kt_end = 0;
    split_k_range((p.k + bk - 1) / bk, warp, warps, kt_begin, kt_end);  // as even as integer division gives
    const int n = kt_end - kt_begin;
    const std::int64_t total = items * n;
    E* my_ring = ring + warp * stages * stage_elems;

    loader ld;
    if constexpr (l2_policy) ld.weight_policy = l2_load_policy(p.weights_evict_first);
    if constexpr (early_weights) {
      // The first tiles' weights before the wait, each tile a group; their token rows after it,
      // one more group, which the first wait below takes whole.
#pragma unroll
      for (int s = 0; s < stages - 1; ++s) {
        ld.template issue<0, bn / 4>(pp, tiles, my_ring, s, n, total, kt_begin, lane);
        cp_async_commit();
      }
      wait_for_prior_grids();
#pragma unroll
      for (int s = 0; s < stages - 1; ++s)
        ld.template issue<bn / 4, copies>(pp, tiles, my_ring, s, n, total, kt_begin, lane);
      cp_async_commit();
    } else {
#pragma unroll
      for (int s = 0; s < stages - 1; ++s) {
        ld.issue(pp, tiles, my_ring, s, n, total, kt_begin, lane);
        cp_async_commit();
      }
      // After this GEMM's own first copies, so that they reach HBM first.
      if (!p.next.at_end) prefetch_next_weights(p, tiles);
    }
    // Or in the CTA's tail, once each warp's last copy is issued.
    const std::int64_t last_issue = total > stages - 1 ? total - (stages - 1) : 0;
    if (!early_weights && p.next.at_end && total == 0) prefetch_next_weights(p, tiles);
    for (std::int64_t j = 0; j < items; ++j) {
      const item_ref r = item_at(p, tiles, blockIdx.x + j * gridDim.x);
      const int tile_rows = r.tile.row_end - r.tile.row_begin;  // 1..bm
      const int used_blocks = (tile_rows + 7) / 8;
      float acc[2][token_blocks][4];
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int b = 0; b < token_blocks; ++b)
#pragma unroll
          for (int q = 0; q < 4; ++q) acc[m][b][q] = 0.0f;
      [[maybe_unused]] scale_sources sources;
      if constexpr (Fp8) sources = scale_sources_of(p, r, lane);
      for (int i = 0; i < n; ++i) {
        const std::int64_t g = j * n + i;
        // fp8: the stage's scales asked for first, their latency under the ring's wait.
        [[maybe_unused]] const stage_scales sc = stage_scales_at(pp, sources, r.tile.expert, kt_begin + i);
        if (early_weights && g == 0) cp_async_wait<0>();
        else cp_async_wait<stages - 2>();
        __syncwarp();
        ld.issue(pp, tiles, my_ring, g + stages - 1, n, total, kt_begin, lane);
        cp_async_commit();
        if (!early_weights && p.next.at_end && g == last_issue) prefetch_next_weights(p, tiles);
        const E* stage = my_ring + static_cast<int>(g % stages) * stage_elems;
        if constexpr (Fp8) {
          // A fresh f32 block per 128 K, added in with its scales (the tensor cores' fp8 sums
          // span no more than the block, as in the wgmma fp8 kernels).
          float part[2][token_blocks][4] = {};
          compute_stage(stage, lane, used_blocks, part);
#pragma unroll
          for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int b = 0; b < token_blocks; ++b)
#pragma unroll
              for (int q = 0; q < 4; ++q) acc[m][b][q] = fmaf(part[m][b][q], sc.b[m] * sc.a[b][q & 1], acc[m][b][q]);
        } else {
          compute_stage(stage, lane, used_blocks, acc);
        }
      }

      // Partial sums to shared memory: accumulator q of (block m, tokens b) is weight row
      // m*16 + lane/4 (+8 for q >= 2), token b*8 + 2*(lane%4) (+1 for odd q).
      float* mine = red + warp * bm * red_stride;
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int b = 0; b < token_blocks; ++b)
#pragma unroll
          for (int q = 0; q < 4; ++q)
            mine[(b * 8 + 2 * (lane & 3) + (q & 1)) * red_stride + m * 16 + (lane >> 2) + (q >> 1) * 8] =
                acc[m][b][q];
      __syncthreads();
      if (threadIdx.x < out_vectors) store(red, pp, r.tile, r.n0, tile_rows, threadIdx.x);
      if constexpr (fused_combine) {
        if (p.combine.strips != nullptr) combine_if_last(p, tiles, r.n0);
      }
      // The next item overwrites the partial sums.
      __syncthreads();
    }
    // No rows at all (every slot filtered): no item counts a strip, and the CTAs write the zeros.
    if constexpr (fused_combine) {
      if (p.combine.strips != nullptr && tiles == 0)
        for (int strip = blockIdx.x; strip < p.n_tiles; strip += gridDim.x) combine_strip(p, strip * out_cols);
    }
    cp_async_wait<0>();  // only empty groups are left
  }

  // GEMM2 combining in its last CTAs (p.combine): the 16-bit kernels' rows store.
  static constexpr bool fused_combine = Kind == moe_gemm_kind::down && !Fp8;

  // Counts the item just stored for its N tile; the CTA whose count completes the tile's M tiles
  // sums its columns. Each thread's rows reach L2 before thread 0's count says so (fence, then
  // barrier); the summing CTA reads them through L2.
  __device__ __forceinline__ static void combine_if_last(const moe_gemm_params<T>& p, int tiles, int n0) {
    __threadfence();
    __syncthreads();
    int done = 0;
    if (threadIdx.x == 0) done = atomicAdd(p.combine.strips + n0 / out_cols, 1) == tiles - 1;
    if (__syncthreads_or(done) == 0) return;
    __threadfence();
    combine_strip(p, n0);
  }

  // Every token's output over columns [n0, n0 + out_cols): combine_rows_kernel's sum and rounding.
  __device__ __forceinline__ static void combine_strip(const moe_gemm_params<T>& p, int n0) {
    constexpr int vecs = out_cols / 8;
    const auto& cb = p.combine;
    // A caller's output in deterministic mode may sit on any element boundary.
    const bool aligned = reinterpret_cast<std::uintptr_t>(cb.out) % 16 == 0;
    for (int v = threadIdx.x; v < cb.tokens * vecs; v += threads) {
      const int token = v / vecs, c = n0 + (v % vecs) * 8;
      if (c >= p.n) continue;  // n is a multiple of 8: a vector is wholly in or out
      float acc[8];
      combine_sum<8, true>(p.c, p.n, c, static_cast<std::int64_t>(token) * p.top_k, p.top_k, cb.slot_to_row,
                           cb.weights, 1, 0, acc);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] *= cb.scale;
      T* dst = cb.out + static_cast<std::int64_t>(token) * p.n + c;
      if (aligned) store_f32<8>(dst, acc);
      else
#pragma unroll
        for (int i = 0; i < 8; ++i) dst[i] = from_f32<T>(acc[i]);
    }
  }

  // Eight outputs of one token: the warps' sums of local rows [c, c + 8).
  __device__ __forceinline__ static void sum8(float (&v)[8], const float* red, int token, int c) {
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = 0.0f;
#pragma unroll
    for (int w = 0; w < warps; ++w) {
      float part[8];
      load8(part, red + (w * bm + token) * red_stride + c);
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] += part[e];
    }
  }

  __device__ __forceinline__ static void store(const float* red, const params& pp, const gpu::moe_m_tile& tile,
                                               int n0, int tile_rows, int vector) {
    const moe_gemm_params<T>& p = gemm(pp);
    constexpr int vecs_per_token = out_cols / 8;
    const int token = vector / vecs_per_token, c = (vector % vecs_per_token) * 8;
    const int col = n0 + c;
    if (token >= tile_rows || col >= p.n) return;  // n is a multiple of 8: a vector is wholly in or out
    float v[8], u[8];
    sum8(v, red, token, c);
    if constexpr (gated) sum8(u, red, token, c + out_cols);
    const int row = tile.row_begin + token;
    if constexpr (Fp8) {
      if (pp.b_scaling == fp8_weight_scaling::per_channel) {
        const float* chan = pp.b_scale + static_cast<std::int64_t>(tile.expert) * p.b_rows_per_expert;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          v[e] *= __ldg(chan + b_row<Kind>(p, 0, col + e));
          if constexpr (gated) u[e] *= __ldg(chan + b_row<Kind>(p, 1, col + e));
        }
      }
      if constexpr (Kind != moe_gemm_kind::down) {
        store_act_f32(pp, row, col, v, u);
        return;
      }
    }
    store_outputs8<T, Kind>(p, tile.expert, row, col, v, u);
  }

  // fp8 GEMM1: act = activation(gate, up) in f32 (the router weight first where applied on the
  // input), eight values of row `row` from column col.
  __device__ __forceinline__ static void store_act_f32(const params& pp, int row, int col, float (&v)[8],
                                                       float (&u)[8]) {
    const moe_gemm_params<T>& p = gemm(pp);
    const float scale = p.input_weights != nullptr ? p.input_weights[p.row_to_slot[row]] : 1.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = apply_activation(p.act, gated, v[e] * scale, gated ? u[e] * scale : 0.0f);
    float4* dst = reinterpret_cast<float4*>(pp.act_f32 + static_cast<std::int64_t>(row) * p.n + col);
    dst[0] = make_float4(v[0], v[1], v[2], v[3]);
    dst[1] = make_float4(v[4], v[5], v[6], v[7]);
  }
};

// Persistent CTAs over (M tile, N tile) items in decode_work_item's order; K is split among a
// CTA's warps only. As the other GEMMs, GEMM1 zeroes the output GEMM2 adds into (p.clear).
template <class T, class Policy, moe_gemm_kind Kind, bool Fp8 = false>
__global__ void __launch_bounds__(Policy::tuning.threads())
    moe_stream_gemm_kernel(const typename moe_stream_gemm<T, Policy, Kind, Fp8>::params pp) {
  if constexpr (compiled_sm < Policy::tuning.min_arch) {
    __trap();
  } else {
    using tile_t = moe_stream_gemm<T, Policy, Kind, Fp8>;
    const moe_gemm_params<T>& p = tile_t::gemm(pp);
    __shared__ __align__(16) float red[tile_t::red_floats];
    __shared__ local_plan plan;
    extern __shared__ __align__(128) unsigned char stream_smem_raw[];
    auto* ring = reinterpret_cast<typename tile_t::E*>(stream_smem_raw);
    // Launched as a programmatic dependent of the kernel before it: GEMM1 reads its output (the
    // plan, or topk_ids) from the start; GEMM2 waits inside run, after its first weight copies
    // (topk_ids and the plan came before GEMM1, which passed its own wait before letting GEMM2 start).
    if constexpr (!tile_t::early_weights) wait_for_prior_grids();
    allow_dependent_grids();
    typename tile_t::params qq = pp;
    moe_gemm_params<T>& q = tile_t::gemm(qq);
    if (p.local_ids != nullptr) {
      const bool writes_plan = Kind != moe_gemm_kind::down && blockIdx.x == 0;
      build_local_plan<tile_t::threads>(p.local_ids, p.local_slots, p.local_experts, tile_t::bm, plan,
                                        writes_plan ? p.local_error : nullptr, writes_plan ? p.local_status : nullptr,
                                        writes_plan ? p.local_slot_to_row : nullptr);
      q.tiles = plan.tiles;
      q.tile_count = &plan.tile_count;
      q.row_to_slot = plan.row_to_slot;
    }
    if constexpr (Kind != moe_gemm_kind::down) clear_output(p, static_cast<int>(threadIdx.x), tile_t::threads);
    tile_t::run(ring, red, qq);
  }
}

}  // namespace moerunner::kernels
