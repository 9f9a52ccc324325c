// Device code of the fused backend's decode GEMMs, over the same M-tile schedule, parameters
// and epilogue targets as the grouped GEMMs (kernel_grouped_gemm.cuh):
//
//   moe_stream_gemm_kernel<T, Policy, kind>: persistent CTAs stride over (M tile, N tile) items;
//     a CTA's 32 weight rows are the mma.sync's M ("swap-AB") and its tile's tokens the mma's N
//     in blocks of 8; each warp walks its own part of K through a private cp.async ring, and
//     the parts meet in shared memory for the epilogue (activation into act, or GEMM2's store
//     or atomic add).
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

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "moerunner/gpu/grouped_gemm_tuning.hpp"
#include "moerunner/kernels/grid_sync.cuh"
#include "moerunner/kernels/kernel_grouped_gemm.cuh"
#include "moerunner/kernels/pdl.cuh"

namespace moerunner::kernels {

// Work item w of a stream GEMM: its M tile (index and rows) and the first output column of its N tile.
struct stream_item {
  gpu::moe_m_tile tile;
  int m_tile;
  int n0;
};

template <class T, class Policy, moe_gemm_kind Kind>
struct moe_stream_gemm {
  static constexpr gpu::stream_gemm_tuning tuning = Policy::tuning;
  static constexpr int warps = tuning.warps, threads = tuning.threads(), stages = tuning.stages;
  static constexpr int bm = tuning.block_m, bn = tuning.block_n, bk = 64;
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
  static_assert(sizeof(T) == 2, "the tile layout is written for 16-bit elements");
  static_assert(out_vectors <= threads, "the epilogue gives each thread at most one 8-column vector");

  // Source row of stage row `r` (weight rows, then token rows), or null past the GEMM or tile.
  __device__ __forceinline__ static const T* source_row(const moe_gemm_params<T>& p, const gpu::moe_m_tile& tile,
                                                        int n0, int r) {
    if (r < bn) {
      const int col = n0 + (gated ? r % 16 : r);
      if (col >= p.n) return nullptr;
      const std::int64_t row = (gated ? static_cast<std::int64_t>(r / 16) * p.n : 0) + col;
      return p.b + (static_cast<std::int64_t>(tile.expert) * p.b_rows_per_expert + row) * p.k;
    }
    const int t = r - bn;
    if (t >= tile.row_end - tile.row_begin) return nullptr;
    const int row = tile.row_begin + t;
    const std::int64_t src = Kind == moe_gemm_kind::down ? row : p.row_to_slot[row] / p.top_k;
    return p.a + src * p.k;
  }

  // The cp.async copies of K tile `kt` into `stage` for stage rows [First * 4, Last * 4) (the
  // weight rows are copies [0, bn / 4), the token rows the rest): pieces past K or of a null row
  // read as zeros. `p_any` is any valid address: a copy that reads nothing still names one.
  template <int First, int Last>
  __device__ __forceinline__ static void load_stage(T* stage, const T* const (&src)[copies], const T* p_any, int kt,
                                                    int k, int lane) {
    const int piece = lane & 7, kcol = kt * bk + piece * 8;
#pragma unroll
    for (int i = First; i < Last; ++i) {
      const int r = i * 4 + (lane >> 3);
      const bool ok = src[i] != nullptr && kcol < k;  // k is a multiple of 8: a piece is wholly in or out
      cp_async_16(smem_address(stage + r * bk + swizzled_chunk<bk>(r, piece) * 8), ok ? src[i] + kcol : p_any, ok);
    }
  }

  // Four k16 steps: A (weight rows) and B (tokens, stored [n][k]) by ldmatrix as the grouped
  // GEMM reads its tiles.
  __device__ __forceinline__ static void compute_stage(const T* stage, int lane, int used_blocks,
                                                       float (&acc)[2][token_blocks][4]) {
    const T* sw = stage;
    const T* sx = stage + bn * bk;
#pragma unroll
    for (int kk = 0; kk < bk / 16; ++kk) {
      std::uint32_t a[2][4];
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        const int r = m * 16 + (lane & 15);
        ldmatrix_x4(a[m], smem_address(sw + r * bk + swizzled_chunk<bk>(r, kk * 2 + (lane >> 4)) * 8));
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
          ldmatrix_x4(x, smem_address(sx + r * bk + swizzled_chunk<bk>(r, c) * 8));
          b0[0] = x[0], b0[1] = x[1], b1[0] = x[2], b1[1] = x[3];
        } else {
          const int r = j * 8 + (lane & 7);
          ldmatrix_x2(b0, smem_address(sx + r * bk + swizzled_chunk<bk>(r, c) * 8));
        }
        mma_16816<T>::run(acc[0][j], a[0], b0);
        mma_16816<T>::run(acc[1][j], a[1], b0);
        if (token_blocks % 2 == 0 && j + 1 < used_blocks) {
          mma_16816<T>::run(acc[0][j + 1], a[0], b1);
          mma_16816<T>::run(acc[1][j + 1], a[1], b1);
        }
      }
    }
  }

  // The schedule is read from L2 (ld.global.cg): GEMM2 reads it before its programmatic wait,
  // when only the L2 is sure to hold what the plan kernel wrote (L1 may keep an earlier run's),
  // and the fused kernel's GEMM1 items count into the tiles' `ready` words meanwhile.
  __device__ __forceinline__ static stream_item item_at(const moe_gemm_params<T>& p, int tiles, std::int64_t w) {
    const moe_work_item it = decode_work_item(w, tiles, p.n_tiles, 1, p.raster_band);
    const int4 t = __ldcg(reinterpret_cast<const int4*>(p.tiles + it.m_tile));
    return {{t.x, t.y, t.z, t.w}, it.m_tile, it.n_tile * out_cols};
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

  __device__ __forceinline__ static void store(const float* red, const moe_gemm_params<T>& p,
                                               const gpu::moe_m_tile& tile, int n0, int tile_rows, int vector) {
    constexpr int vecs_per_token = out_cols / 8;
    const int token = vector / vecs_per_token, c = (vector % vecs_per_token) * 8;
    const int col = n0 + c;
    if (token >= tile_rows || col >= p.n) return;  // n is a multiple of 8: a vector is wholly in or out
    float v[8], u[8];
    sum8(v, red, token, c);
    if constexpr (gated) sum8(u, red, token, c + out_cols);
    store_outputs8<T, Kind>(p, tile.row_begin + token, col, v, u);
  }
};

// The flags between the fused kernel's GEMMs, in the schedule the plan wrote (zeroed there).
struct stream_sync {
  gpu::moe_m_tile* tiles = nullptr;  // tile t's `ready`: GEMM1 items of t finished
  std::int32_t* cleared = nullptr;   // CTAs that have zeroed their share of the output
};

// The fused decode kernel's arguments: GEMM1 and GEMM2 over one schedule.
template <class T>
struct moe_stream_fused_params {
  moe_gemm_params<T> up;    // gate_up or up_only
  moe_gemm_params<T> down;  // its store as the standalone GEMM2's
  stream_sync sync;
};

// A CTA's walk over its items, each warp over its part of K in every item: the items of the
// GEMM of kind First, then, when Fused, GEMM2's items, which read act rows that GEMM1 items of
// the same grid write. A GEMM2 item's weights need nothing, so its first tiles' weights are
// copied ahead ("pending" stages), and its act rows only once its gate is open: the prior
// grids finished (standalone GEMM2, a programmatic dependent of GEMM1), or every GEMM1 item of
// its M tile counted in the tile's `ready` (fused).
template <class T, class Policy, moe_gemm_kind First, bool Fused>
struct moe_stream_runner {
  using first_t = moe_stream_gemm<T, Policy, First>;
  using down_t = moe_stream_gemm<T, Policy, moe_gemm_kind::down>;
  static constexpr int warps = first_t::warps, stages = first_t::stages, bk = first_t::bk, bn = first_t::bn,
                       bm = first_t::bm, stage_elems = first_t::stage_elems, copies = first_t::copies,
                       token_blocks = first_t::token_blocks, red_stride = first_t::red_stride;
  static_assert(!Fused || First != moe_gemm_kind::down, "the fused kernel runs GEMM1 first");
  static_assert(stages <= 32, "pending stages are bits of a word");
  // Which items read act only behind a gate.
  static constexpr bool gated_first = First == moe_gemm_kind::down;

  // The CTA's items j < j1 are the first GEMM's (n1 K tiles per warp from kt1), the rest
  // GEMM2's (n2 from kt2); g numbers the warp's K tiles over all of them.
  struct walk {
    int tiles;
    std::int64_t first_items;  // the first GEMM's items over the grid
    std::int64_t items, j1, total;
    int n1, kt1, n2, kt2;
    __device__ __forceinline__ std::int64_t start_of(std::int64_t j) const {
      return j < j1 ? j * n1 : j1 * n1 + (j - j1) * n2;
    }
    __device__ __forceinline__ std::int64_t item_of(std::int64_t g) const {
      const std::int64_t g1 = j1 * n1;
      return g < g1 ? g / n1 : j1 + (g - g1) / n2;
    }
  };

  __device__ __forceinline__ static walk make_walk(const moe_gemm_params<T>& pf, const moe_gemm_params<T>& pd,
                                                   int tiles, int warp) {
    walk w;
    w.tiles = tiles;
    const std::int64_t b = blockIdx.x, grid = gridDim.x;
    w.first_items = static_cast<std::int64_t>(tiles) * pf.n_tiles;
    const std::int64_t work = w.first_items + (Fused ? static_cast<std::int64_t>(tiles) * pd.n_tiles : 0);
    w.items = b < work ? (work - b + grid - 1) / grid : 0;
    w.j1 = b < w.first_items ? (w.first_items - b + grid - 1) / grid : 0;
    int end = 0;
    split_k_range((pf.k + bk - 1) / bk, warp, warps, w.kt1, end);  // as even as integer division gives
    w.n1 = end - w.kt1;
    w.kt2 = w.n2 = 0;
    if constexpr (Fused) {
      split_k_range((pd.k + bk - 1) / bk, warp, warps, w.kt2, end);
      w.n2 = end - w.kt2;
    }
    w.total = w.j1 * w.n1 + (w.items - w.j1) * w.n2;
    return w;
  }

  __device__ __forceinline__ static stream_item item_at(const walk& w, const moe_gemm_params<T>& pf,
                                                     const moe_gemm_params<T>& pd, std::int64_t j) {
    const std::int64_t gi = blockIdx.x + j * gridDim.x;
    if (!Fused || j < w.j1) return first_t::item_at(pf, w.tiles, gi);
    return down_t::item_at(pd, w.tiles, gi - w.first_items);
  }

  // A warp's copies, stages - 1 K tiles ahead of its mma, across item boundaries (the next
  // item's first tiles are in flight while this one's partial sums are reduced and stored).
  struct loader {
    const T* src[copies];
    std::int64_t item = -1;   // the CTA-local item src[] points into
    unsigned pending = 0;     // ring stages whose act rows are not yet copied
    bool open = !gated_first; // standalone GEMM2: the prior grids have finished
    std::int64_t gated = -1;  // fused: the last GEMM2 item whose gate this warp passed

    // Issues tile g of the walk (nothing past its end); a GEMM2 item's act rows wait for its gate.
    __device__ __forceinline__ void issue(const walk& w, const moe_gemm_params<T>& pf,
                                          const moe_gemm_params<T>& pd, T* ring, std::int64_t g, int lane) {
      if (g >= w.total) return;
      const std::int64_t j = w.item_of(g);
      const bool second = Fused && j >= w.j1;
      const moe_gemm_params<T>& p = second ? pd : pf;
      if (j != item) {
        item = j;
        const stream_item r = item_at(w, pf, pd, j);
#pragma unroll
        for (int i = 0; i < copies; ++i)
          src[i] = second ? down_t::source_row(p, r.tile, r.n0, i * 4 + (lane >> 3))
                          : first_t::source_row(p, r.tile, r.n0, i * 4 + (lane >> 3));
      }
      const int kt = (second ? w.kt2 : w.kt1) + static_cast<int>(g - w.start_of(j));
      const int stage = static_cast<int>(g % stages);
      T* dst = ring + stage * stage_elems;
      first_t::template load_stage<0, bn / 4>(dst, src, p.b, kt, p.k, lane);
      const bool defer = Fused ? second && j > gated : !open;
      if (defer) pending |= 1u << stage;
      else first_t::template load_stage<bn / 4, copies>(dst, src, p.b, kt, p.k, lane);
    }

    // At the start of GEMM2 item j (tiles from g0), its gate open: copies the act rows of its
    // pending stages. Returns whether it committed a group.
    __device__ __forceinline__ bool release(const walk& w, const moe_gemm_params<T>& pd, T* ring, std::int64_t j,
                                            const stream_item& r, int lane) {
      const std::int64_t g0 = w.start_of(j);
      const int n = Fused ? w.n2 : w.n1, kt0 = Fused ? w.kt2 : w.kt1;
      const T* rows[copies];
#pragma unroll
      for (int i = 0; i < copies; ++i)
        rows[i] = i < bn / 4 ? nullptr : down_t::source_row(pd, r.tile, r.n0, i * 4 + (lane >> 3));
      bool any = false;
#pragma unroll
      for (int s = 0; s < stages - 1; ++s) {
        const int stage = static_cast<int>((g0 + s) % stages);
        if (s < n && ((pending >> stage) & 1u) != 0u) {
          first_t::template load_stage<bn / 4, copies>(ring + stage * stage_elems, rows, pd.b, kt0 + s, pd.k, lane);
          pending &= ~(1u << stage);
          any = true;
        }
      }
      if (any) cp_async_commit();
      return any;
    }
  };

  // Every item of this CTA: each warp accumulates its K range, then the CTA sums the ranges
  // and stores. Ring discipline as the grouped GEMM's, per warp: stages - 1 tiles in flight,
  // groups committed even when empty; the __syncwarp after the wait makes every lane's copies
  // visible and orders the ldmatrix reads of the tile before the copies that overwrite it.
  __device__ __forceinline__ static void run(T* ring, float* red, const moe_gemm_params<T>& pf,
                                             const moe_gemm_params<T>& pd, const stream_sync& sync) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const walk w = make_walk(pf, pd, __ldcg(pf.tile_count), warp);
    T* my_ring = ring + warp * stages * stage_elems;

    loader ld;
#pragma unroll
    for (int s = 0; s < stages - 1; ++s) {
      ld.issue(w, pf, pd, my_ring, s, lane);
      cp_async_commit();
    }
    bool cleared = false;  // fused, thread 0: every CTA has zeroed its share of the output
    for (std::int64_t j = 0; j < w.items; ++j) {
      const bool second = Fused && j >= w.j1;
      const bool down = gated_first || second;
      const moe_gemm_params<T>& p = second ? pd : pf;
      const stream_item r = item_at(w, pf, pd, j);
      bool released = false;
      if (down) {
        if constexpr (Fused) {
          if (lane == 0) wait_at_least(&sync.tiles[r.m_tile].ready, pf.n_tiles);
          __syncwarp();
          ld.gated = j;
        } else if (!ld.open) {
          wait_for_prior_grids();
          ld.open = true;
        }
        if (ld.pending != 0u) released = ld.release(w, p, my_ring, j, r, lane);
      }
      const int tile_rows = r.tile.row_end - r.tile.row_begin;  // 1..bm
      const int used_blocks = (tile_rows + 7) / 8;
      float acc[2][token_blocks][4];
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int b = 0; b < token_blocks; ++b)
#pragma unroll
          for (int q = 0; q < 4; ++q) acc[m][b][q] = 0.0f;
      const std::int64_t g0 = w.start_of(j);
      const int n = second ? w.n2 : w.n1;
      for (int i = 0; i < n; ++i) {
        const std::int64_t g = g0 + i;
        if (released && i == 0) cp_async_wait<0>();  // the act rows were committed last
        else cp_async_wait<stages - 2>();
        __syncwarp();
        ld.issue(w, pf, pd, my_ring, g + stages - 1, lane);
        cp_async_commit();
        first_t::compute_stage(my_ring + static_cast<int>(g % stages) * stage_elems, lane, used_blocks, acc);
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
      if constexpr (Fused) {
        // GEMM2 adds into (or stores around) the output that every CTA zeroed a share of.
        if (second && pf.clear != nullptr && threadIdx.x == 0 && !cleared) {
          wait_at_least(sync.cleared, static_cast<std::int32_t>(gridDim.x));
          cleared = true;
        }
      }
      __syncthreads();
      if (second) {
        if (threadIdx.x < down_t::out_vectors) down_t::store(red, p, r.tile, r.n0, tile_rows, threadIdx.x);
      } else if (threadIdx.x < first_t::out_vectors) {
        first_t::store(red, p, r.tile, r.n0, tile_rows, threadIdx.x);
      }
      // The next item overwrites the partial sums.
      __syncthreads();
      if constexpr (Fused)
        if (!second && threadIdx.x == 0) release_add(&sync.tiles[r.m_tile].ready, 1);  // act rows written
    }
    cp_async_wait<0>();  // only empty groups are left
  }
};

// The body of both kernels below: GEMM1 (and the fused kernel) read the plan from the start; a
// standalone GEMM2 waits inside run, after its first weight copies. GEMM1 zeroes the output
// GEMM2 adds into (p.clear); in the fused kernel each CTA counts itself in once its share is done.
template <class T, class Policy, moe_gemm_kind First, bool Fused>
__device__ __forceinline__ void stream_kernel_body(const moe_gemm_params<T>& pf, const moe_gemm_params<T>& pd,
                                                   const stream_sync& sync) {
  if constexpr (compiled_sm < Policy::tuning.min_arch) {
    __trap();
  } else {
    using runner_t = moe_stream_runner<T, Policy, First, Fused>;
    __shared__ __align__(16) float red[moe_stream_gemm<T, Policy, First>::red_floats];
    extern __shared__ __align__(128) unsigned char stream_smem_raw[];
    if constexpr (!runner_t::gated_first) wait_for_prior_grids();
    allow_dependent_grids();
    if constexpr (First != moe_gemm_kind::down) {
      clear_output(pf, static_cast<int>(threadIdx.x), runner_t::first_t::threads);
      if constexpr (Fused) {
        if (pf.clear != nullptr) {
          __syncthreads();
          if (threadIdx.x == 0) release_add(sync.cleared, 1);
        }
      }
    }
    runner_t::run(reinterpret_cast<T*>(stream_smem_raw), red, pf, pd, sync);
  }
}

// One GEMM: persistent CTAs over (M tile, N tile) items in decode_work_item's order; K is
// split among a CTA's warps only.
template <class T, class Policy, moe_gemm_kind Kind>
__global__ void __launch_bounds__(Policy::tuning.threads()) moe_stream_gemm_kernel(const moe_gemm_params<T> p) {
  stream_kernel_body<T, Policy, Kind, false>(p, p, stream_sync{});
}

// Both GEMMs in one persistent grid (decode): each CTA runs its GEMM1 items, then its GEMM2
// items, whose weights stream while GEMM1's last items finish on other CTAs. A GEMM2 item waits
// for its M tile's GEMM1 items (and its first add into the output for every CTA's share of the
// zeroing); GEMM1 items wait for nothing and come first in every CTA's sequence, so a grid that
// fits on the device at once always finishes (the launch sizes it so).
template <class T, class Policy, moe_gemm_kind First>
__global__ void __launch_bounds__(Policy::tuning.threads())
    moe_stream_fused_kernel(const moe_stream_fused_params<T> f) {
  stream_kernel_body<T, Policy, First, true>(f.up, f.down, f.sync);
}

}  // namespace moerunner::kernels
