// Device code of the fused backend's Hopper grouped GEMMs on wgmma.mma_async (sm_90a only):
// a warp-specialized, persistent kernel over the same M-tile schedule and work-item order
// as moe_grouped_gemm_kernel, with the same epilogues (gate_up, up_only, down).
//
// One CTA = one producer warpgroup + `consumer_warpgroups` consumer warpgroups:
//   producer: per K tile, thread 0 loads the 256 B rows by TMA (two 128-row boxes, 128-byte
//     swizzle, zero fill past n and k); all 128 threads copy the tile's gathered A rows with
//     16-byte cp.async into the same 128-byte-swizzled layout (zero fill past k, and past the
//     tile's rows in 128-row tiles). A is gathered (row r of the tile is x[row_to_slot[r] /
//     top_k]), which one 2D TMA box cannot express; 128 one-row boxes per K tile would serialize.
//     With p.a_gathered (GEMM1: a kernel before wrote x's rows in plan order; GEMM2: act's rows,
//     which GEMM1 writes in plan order), thread 0 loads the A rows by one TMA box too, and the
//     stage completes on its one arrival and the byte count: the other producer threads idle
//     (the cp.async gathers kept too few bytes in flight at prefill: bench/NOTES.md, round 10).
//     Rows past the tile are whatever follows (their results are never stored; a wgmma row
//     reads only its own A row), zeros past R.
//   consumers, 128-row tiles: each owns 64 rows and runs four m64n256k16 wgmma per K tile
//     straight from the shared-memory ring; the f32 accumulators stay in registers and the
//     epilogue pairs gate column j (register block j) with up column j (block j + 16).
//   consumers, 64-row tiles: each takes the 64 rows and 128 of the B rows (of 256 B rows
//     with two warpgroups, or of 128 with one), two m64n64k16 per K step (gated: 64 gate rows
//     and their 64 up rows, paired register for register): where experts see few rows, half
//     the wgmma work per weight byte of one warpgroup over 256 B rows (measured 10-25% faster
//     on the benchmark's M = 64 and 512 cells than 128-row tiles).
// Stage hand-off uses mbarriers: full[s] completes when the 128 producer threads have arrived
// (each after its copies landed and were fenced for the async proxy) and the TMA bytes came;
// empty[s] completes when every consumer warp's wgmma reading stage s has retired. With
// async_a_arrive the hardware makes each producer thread's arrival when its copies land
// (cp.async.mbarrier.arrive), so the signal no longer waits for producer_lag more stages to be
// issued, and the consumers fence the rows for the async proxy after the wait.
//
// Clusters of two (cluster_m = 2): the pair walks the same work items, each of a 256-row
// schedule tile (one expert), CTA rank r on rows [128 r, 128 r + 128) of it. Per stage, rank r's
// producer loads weight box r only and multicasts it into both CTAs' rings at the same offset,
// signalling both CTAs' full[s] (each still expects the whole B tile's bytes). So the peer
// writes into a CTA's stage s: empty[s] of each CTA counts the consumer warps of both, each
// consumer warp arriving on its own and on the peer's, and neither producer refills s before
// both CTAs have read it. Both CTAs run every K tile of every item (a CTA whose half of the tile
// has no rows keeps the protocol with idle consumers), so their stage counters stay in step.
// Cluster barriers after the barriers' set-up and before exit keep either CTA from touching the
// other's shared memory outside its lifetime. The PTX wrappers are in sm90_ptx.cuh.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/kernels/sm90_kernel_grouped_gemm_wgmma.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstdint>

#include <cuda.h>
#include <cuda/ptx>

#include "moerunner/gpu/grouped_gemm_tuning.hpp"
#include "moerunner/kernels/activation_math.cuh"
#include "moerunner/kernels/kernel_grouped_gemm.cuh"
#include "moerunner/kernels/pdl.cuh"
#include "moerunner/kernels/sm90_cluster_tiles.cuh"
#include "moerunner/kernels/sm90_ptx.cuh"
#include "moerunner/kernels/sm90_wgmma_epilogue.cuh"
#include "moerunner/kernels/sm90_work_items.cuh"

namespace moerunner::kernels {

// ---------------------------------------------------------------------------------------------
// The kernel

template <class T, class Policy, moe_gemm_kind Kind, bool HandOut = false>
struct moe_gemm_wgmma {
  static constexpr gpu::wgmma_gemm_tuning tuning = Policy::tuning;
  static constexpr int bm = tuning.block_m, bn = tuning.block_n, bk = tuning.block_k, stages = tuning.stages;
  static constexpr int consumers = tuning.consumer_warpgroups;
  static constexpr int cluster = tuning.cluster_m;
  // 64-row tiles: each warpgroup takes all 64 A rows and 128 of the B rows, as two 64-row
  // blocks, rather than 64 A rows and all 256 B rows.
  static constexpr bool split_n = bm == 64 && bn == 128 * consumers;
  static constexpr int producer_threads = 128;
  static constexpr int consumer_warps = 4 * consumers;
  static constexpr int halves = Kind == moe_gemm_kind::gate_up ? 2 : 1;
  static constexpr int out_cols = bn / halves;  // output columns per CTA
  static constexpr int box_rows = bn / 2;       // one TMA box: half the B rows x 64 K
  static constexpr int a_bytes = bm * bk * 2, b_bytes = bn * bk * 2;
  static constexpr int chunks_per_row = bk / 8;                            // 16-byte chunks
  static constexpr int rows_per_pass = producer_threads / chunks_per_row;  // 16
  static constexpr int a_passes = bm / rows_per_pass;
  static constexpr int k_steps = bk / 16;  // wgmma per K tile
  // Registers: the producer needs few (with both A paths, 72 keeps the 2-CTA kernels free of
  // spills; 56 spilled 36 bytes); consumers hold 128 accumulators each.
  static constexpr int producer_regs = 72, consumer_regs = 216;

  static_assert(gpu::check_wgmma_gemm_tuning(tuning));
  static_assert(sizeof(T) == 2, "the tile layout is written for 16-bit elements");
  static_assert(split_n || bn == 256, "a warpgroup over 64 A rows holds one m64n256k16 accumulator block");
  static_assert(a_bytes % 1024 == 0 && b_bytes % 1024 == 0, "every tile starts on a swizzle-pattern boundary");
  static_assert(rows_per_pass % 8 == 0, "a producer thread's rows share their row % 8 (one swizzled chunk)");
  static_assert(producer_threads * producer_regs + consumers * 128 * consumer_regs <= 65536,
                "the register split must fit the SM's register file");

  struct barriers {
    std::uint64_t full[stages];
    std::uint64_t empty[stages];
  };
  static_assert(work_item_ring::depth > stages + 2, "the producer must never wait for a work item slot");
  using items_t = item_loop<HandOut, cluster>;
  __device__ __forceinline__ static items_t items_of(const moe_gemm_params<T>& p, work_item_ring* ring) {
    return make_item_loop<HandOut, cluster>(*p.tile_count, p.n_tiles, p.k_splits, ring, p.item_counter);
  }
  // Warps of a CTA that read the handed-out items: the producer's (one thread with A by TMA)
  // and the consumers'.
  __device__ __forceinline__ static int item_readers(const moe_gemm_params<T>& p) {
    return (p.a_gathered ? 1 : producer_threads / 32) + consumer_warps;
  }

  __device__ __forceinline__ static gpu::moe_m_tile cta_rows(const gpu::moe_m_tile& t, int rank) {
    return cluster_cta_rows<cluster, bm>(t, rank);
  }

  // The tile's bn B rows as two boxes of the 4D tensor map (weight_tensor_map): for gate_up the
  // bn/2 gate rows of columns n0.. (half 0) then the bn/2 up rows of the same columns (half 1),
  // so the up value of a column sits bn/2 rows below its gate value whatever the layout;
  // otherwise rows n0 and n0 + bn/2. The map's boxes are box_rows rows; its coordinates are
  // {k, row, half, expert}, or {k, half, row, expert} for interleaved gate/up rows.
  // In a cluster, rank r loads box r only, into both CTAs (same offsets, both full barriers).
  __device__ __forceinline__ static void load_b(const CUtensorMap* map, std::uint64_t* bar, unsigned char* sb,
                                                int k0, int n0, int expert, int rank, bool interleaved) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if (cluster > 1 && j != rank) continue;
      const int row = halves == 2 ? n0 : n0 + j * box_rows, half = halves == 2 ? j : 0;
      const bool swapped = halves == 2 && interleaved;
      const std::int32_t coords[4] = {k0, swapped ? half : row, swapped ? row : half, expert};
      tma_load_box<cluster>(sb + j * box_rows * bk * 2, map, coords, bar);
    }
  }

  // p.a_gathered: thread 0 alone, A and B by TMA per K tile.
  __device__ static void producer_tma(const moe_gemm_params<T>& p, const CUtensorMap* a_map,
                                      const CUtensorMap* b_map, unsigned char* ring, barriers& bars,
                                      work_item_ring* item_ring) {
    const int k_tiles = (p.k + bk - 1) / bk;
    const int tiles = *p.tile_count;
    items_t items = items_of(p, item_ring);
    const cta_place me = items.me;
    std::uint32_t it = 0;
    for (auto w = items.first(); w < items.work; w = items.next_thread(w)) {
      items.ask();
      const moe_work_item item = decode_work_item(w, tiles, p.n_tiles, p.k_splits, p.raster_band, band_tiles_of(p));
      const int n0 = item.n_tile * out_cols;
      const gpu::moe_m_tile tile = cta_rows(p.tiles[item.m_tile], me.rank);
      int kt_begin = 0, kt_end = 0;
      split_k_range(k_tiles, item.split, p.k_splits, kt_begin, kt_end);
      for (int kt = kt_begin; kt < kt_end; ++kt, ++it) {
        const int stage = static_cast<int>(it % stages);
        mbarrier_wait(&bars.empty[stage], ((it / stages) & 1) ^ 1);
        unsigned char* sa = ring + stage * tuning.stage_bytes();
        cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared,
                                             &bars.full[stage], static_cast<std::uint32_t>(a_bytes + b_bytes));
        const std::int32_t a_coords[4] = {kt * bk, tile.row_begin, 0, 0};
        tma_load_box<1>(sa, a_map, a_coords, &bars.full[stage]);
        load_b(b_map, &bars.full[stage], sa + a_bytes, kt * bk, n0, tile.expert, me.rank, p.interleaved);
      }
      items.publish();
    }
  }

  __device__ static void producer(const moe_gemm_params<T>& p, const CUtensorMap* b_map, unsigned char* ring,
                                  barriers& bars, work_item_ring* item_ring) {
    const int tid = threadIdx.x;  // 0..127
    const int ld_row = tid / chunks_per_row, ld_chunk = tid % chunks_per_row;
    // All rows this thread copies are congruent mod 8, so the swizzled chunk is the same for all.
    const int st_chunk = ld_chunk ^ (ld_row & 7);
    const int k_tiles = (p.k + bk - 1) / bk;
    const int tiles = *p.tile_count;
    items_t items = items_of(p, item_ring);
    const cta_place me = items.me;
    std::uint32_t it = 0;  // K tiles issued so far, over every work item of this CTA
    for (auto w = items.first(); w < items.work; w = items.next_warp(w)) {
      items.ask();
      const moe_work_item item = decode_work_item(w, tiles, p.n_tiles, p.k_splits, p.raster_band, band_tiles_of(p));
      const int n0 = item.n_tile * out_cols;
      const gpu::moe_m_tile tile = cta_rows(p.tiles[item.m_tile], me.rank);
      const int rows = tile.row_end - tile.row_begin;
      int kt_begin = 0, kt_end = 0;
      split_k_range(k_tiles, item.split, p.k_splits, kt_begin, kt_end);
      int a_src_row[a_passes];
#pragma unroll
      for (int i = 0; i < a_passes; ++i)
        a_src_row[i] = a_source_row<Kind>(tile, ld_row + i * rows_per_pass, p.row_to_slot, p.top_k);
      for (int kt = kt_begin; kt < kt_end; ++kt, ++it) {
        const int stage = static_cast<int>(it % stages);
        // A fresh barrier counts as having completed the phase before its first (parity 1).
        mbarrier_wait(&bars.empty[stage], ((it / stages) & 1) ^ 1);
        unsigned char* sa = ring + stage * tuning.stage_bytes();
        if (tid == 0) {
          cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared,
                                               &bars.full[stage], static_cast<std::uint32_t>(b_bytes));
          load_b(b_map, &bars.full[stage], sa + a_bytes, kt * bk, n0, tile.expert, me.rank, p.interleaved);
        }
        const int kcol = kt * bk + ld_chunk * 8;
        const bool k_ok = kcol < p.k;  // k is a multiple of 8: a chunk is wholly in or out
#pragma unroll
        for (int i = 0; i < a_passes; ++i) {
          // 64-row tiles (decode) leave rows past the tile as they are: their results are never
          // stored, and a wgmma row reads only its own A row. 128-row tiles zero them, which
          // measured faster at prefill, unless the CTA of a pair has no rows (its consumers
          // then idle). Columns past k must be zeros (B's are).
          if ((split_n || (cluster > 1 && rows <= 0)) && a_src_row[i] < 0) continue;
          const int r = ld_row + i * rows_per_pass;
          const bool ok = k_ok && a_src_row[i] >= 0;
          const T* src = ok ? p.a + static_cast<std::int64_t>(a_src_row[i]) * p.k + kcol : p.a;
          cp_async_16(smem_address(sa + r * (bk * 2) + st_chunk * 16), src, ok);
        }
        if constexpr (tuning.async_a_arrive) {
          // The barrier counts this thread's arrival once its copies so far have landed; the
          // consumers fence them for the async proxy (no thread of ours runs after they land).
          cp_async_arrive_noinc(&bars.full[stage]);
        } else {
          cp_async_commit();
          // Signal the stage issued producer_lag tiles ago: its copies have landed (wait_group),
          // and the fence orders them before the consumers' wgmma reads (async proxy).
          if (it >= static_cast<std::uint32_t>(tuning.producer_lag)) {
            cp_async_wait<tuning.producer_lag>();
            cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
            cuda::ptx::mbarrier_arrive(&bars.full[(it - tuning.producer_lag) % stages]);
          }
        }
      }
      items.publish();
    }
    if constexpr (!tuning.async_a_arrive) {
      cp_async_wait<0>();
      cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
      const std::uint32_t first = it > static_cast<std::uint32_t>(tuning.producer_lag) ? it - tuning.producer_lag : 0;
      for (std::uint32_t j = first; j < it; ++j) cuda::ptx::mbarrier_arrive(&bars.full[j % stages]);
    }
  }

  // A consumer thread's accumulators: one 64 x 256 block (128 registers), or with split_n
  // two 64 x 64 blocks (acc1 unused otherwise).
  static constexpr int acc0_regs = split_n ? 32 : 128, acc1_regs = split_n ? 32 : 1;
  // split_n: the B rows (from the stage's first) of warpgroup g's two blocks: gated, its 64
  // gate rows and the 64 up rows of the same columns; otherwise 128 consecutive rows.
  __device__ __forceinline__ static int split_b_row(int group, int block) {
    return halves == 2 ? block * box_rows + 64 * group : 128 * group + 64 * block;
  }

  __device__ static void consumer(const moe_gemm_params<T>& p, unsigned char* ring, barriers& bars,
                                  work_item_ring* item_ring) {
    const int group = threadIdx.x / 128 - 1;  // consumer warpgroup
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int k_tiles = (p.k + bk - 1) / bk;
    // GEMM1 clears the output GEMM2 accumulates into while the first K tiles load.
    if constexpr (Kind != moe_gemm_kind::down)
      clear_output(p, static_cast<int>(threadIdx.x) - producer_threads, 128 * consumers);
    const int tiles = *p.tile_count;
    items_t items = items_of(p, item_ring);
    const auto work = items.work;
    const cta_place me = items.me;
    const std::uint32_t ring_addr = smem_address(ring);
    // A stage read by this warp's wgmma is free again for this CTA's producer and, in a
    // cluster, for the peer's, which multicasts into it.
    const auto release = [&](std::uint32_t stage) {
      cuda::ptx::mbarrier_arrive(&bars.empty[stage]);
      if constexpr (cluster == 2) mbarrier_arrive_cluster(&bars.empty[stage], static_cast<std::uint32_t>(me.rank ^ 1));
    };
    // Rows [64 group, 64 group + 64) of the tile, or with split_n all 64 rows for every group.
    const int row_base = split_n ? 0 : 64 * group;
    std::uint32_t it = 0;
    float acc0[acc0_regs], acc1[acc1_regs];
    // Each work item's tile is loaded one item ahead: read at the item's start, its global-load
    // latency kept the tensor cores idle once per item. Handed out, the next item is known only
    // once the producer has issued this one's K tiles: it is read after the K loop (before, the
    // wait could hold the stages the producer waits for), in the epilogue's shadow.
    moe_work_item next_item{};
    gpu::moe_m_tile next_tile{};
    const auto read_ahead = [&](typename items_t::index next) {
      if (next < work) {
        next_item = decode_work_item(next, tiles, p.n_tiles, p.k_splits, p.raster_band, band_tiles_of(p));
        next_tile = p.tiles[next_item.m_tile];
      }
    };
    read_ahead(items.first());
    for (auto w = items.first(), w_next = w; w < work; w = w_next) {
      const moe_work_item item = next_item;
      const gpu::moe_m_tile tile = cta_rows(next_tile, me.rank);
      if constexpr (!HandOut) {
        w_next = items.next_warp(w);
        read_ahead(w_next);
      }
      const int n0 = item.n_tile * out_cols;
      const int rows = tile.row_end - tile.row_begin;
      int kt_begin = 0, kt_end = 0;
      split_k_range(k_tiles, item.split, p.k_splits, kt_begin, kt_end);
      // A warpgroup whose 64 rows are all past the tile still keeps the barrier protocol.
      const bool active = row_base < rows;
#pragma unroll
      for (int i = 0; i < acc0_regs; ++i) acc0[i] = 0.0f;
#pragma unroll
      for (int i = 0; i < acc1_regs; ++i) acc1[i] = 0.0f;
      wgmma_fence_operands(acc0);
      wgmma_fence_operands(acc1);
      for (int kt = kt_begin; kt < kt_end; ++kt, ++it) {
        const int stage = static_cast<int>(it % stages);
        mbarrier_wait(&bars.full[stage], (it / stages) & 1);
        // The A rows were written by cp.async (generic proxy) and wgmma reads through the async
        // proxy; with async_a_arrive no producer thread fenced them after they landed.
        if constexpr (tuning.async_a_arrive) cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
        if (active) {
          const std::uint32_t sa = ring_addr + stage * tuning.stage_bytes() + row_base * (bk * 2);
          const std::uint32_t sb = ring_addr + stage * tuning.stage_bytes() + a_bytes;
          const std::uint64_t da = sw128_kmajor_desc(sa);
          wgmma_fence();
          if constexpr (split_n) {
            const std::uint64_t d0 = sw128_kmajor_desc(sb + split_b_row(group, 0) * (bk * 2));
            const std::uint64_t d1 = sw128_kmajor_desc(sb + split_b_row(group, 1) * (bk * 2));
#pragma unroll
            for (int kk = 0; kk < k_steps; ++kk) {
              const auto step = static_cast<std::uint64_t>(kk * 32 >> 4);
              wgmma_m64n64k16<T>(acc0, da + step, d0 + step);
              wgmma_m64n64k16<T>(acc1, da + step, d1 + step);
            }
          } else {
            const std::uint64_t db = sw128_kmajor_desc(sb);
#pragma unroll
            for (int kk = 0; kk < k_steps; ++kk) {
              const auto step = static_cast<std::uint64_t>(kk * 32 >> 4);
              wgmma_m64n256k16<T>(acc0, da + step, db + step);
            }
          }
          wgmma_commit();
        }
        // One wgmma group stays in flight; the one before it has retired, so its stage is free.
        wgmma_wait<1>();
        wgmma_fence_operands(acc0);
        wgmma_fence_operands(acc1);
        if (kt > kt_begin && lane == 0) release((it - 1) % stages);
      }
      wgmma_wait<0>();
      wgmma_fence_operands(acc0);
      wgmma_fence_operands(acc1);
      if (lane == 0) release((it - 1) % stages);
      if constexpr (HandOut) {
        w_next = items.next_warp(w);
        read_ahead(w_next);
      }
      if (!active) continue;
      // Accumulator register 4j + 2h + q of a 64 x N block holds row 16 warp + lane / 4 + 8h of
      // the block and column 8j + 2(lane % 4) + q (the PTX m64nNk16 D layout).
      const auto finish = [&]<bool Bias>() {
        using out = wgmma_epilogue<T, Kind>;
        if constexpr (split_n) {
          if constexpr (halves == 2)  // gate column j of acc0 pairs with the same column of acc1
            out::template store<8, Bias>(p, tile, n0 + 64 * group, item.split, row_base, warp, lane,
                                         [&](int j, int i) { return acc0[4 * j + i]; },
                                         [&](int j, int i) { return acc1[4 * j + i]; });
          else
            out::template store<16, Bias>(
                p, tile, n0 + 128 * group, item.split, row_base, warp, lane,
                [&](int j, int i) { return j < 8 ? acc0[4 * j + i] : acc1[4 * (j - 8) + i]; },
                [&](int, int) { return 0.0f; });
        } else {
          // The up value of gate register 4j + 2h + q is register 4(j + 16) + 2h + q.
          out::template store<halves == 2 ? 16 : 32, Bias>(p, tile, n0, item.split, row_base, warp, lane,
                                                           [&](int j, int i) { return acc0[4 * j + i]; },
                                                           [&](int j, int i) { return acc0[4 * (j + 16) + i]; });
        }
      };
      // GEMM2's bias goes with the first of the item's K ranges only: the ranges' sums meet in
      // the output's atomics or in combine's sum of the parts. A uniform branch: without a bias
      // the epilogue is the one compiled without it.
      if (p.bias != nullptr && (Kind != moe_gemm_kind::down || item.split == 0)) finish.template operator()<true>();
      else finish.template operator()<false>();
    }
  }
};

// Persistent CTAs over work items in decode_work_item's order, as the mma.sync kernel, with
// K split into p.k_splits ranges (GEMM2 into the output or into f32 parts only). The body
// exists only in sm_90a code; elsewhere it traps, and its static shared memory is then zero,
// which is how the launch code tells that it cannot run (see gpu::wgmma_gemm_available).
template <class T, class Policy, moe_gemm_kind Kind, bool HandOut = false>
__global__ void __launch_bounds__(Policy::tuning.threads(), 1)
    moe_grouped_gemm_wgmma_kernel(const moe_gemm_params<T> p, const __grid_constant__ CUtensorMap b_map,
                                  const __grid_constant__ CUtensorMap a_map) {
#if MOERUNNER_WGMMA_COMPILED
  using tile_t = moe_gemm_wgmma<T, Policy, Kind, HandOut>;
  __shared__ typename tile_t::barriers bars;
  // Handed-out work items only (unreferenced, and so absent, in fixed turns).
  __shared__ work_item_ring item_ring;
  extern __shared__ unsigned char wgmma_smem_raw[];
  // The 128-byte swizzle repeats every 1024 bytes, and TMA and the descriptors assume tiles on
  // those boundaries; dynamic smem is only promised 16-byte alignment.
  const std::uint32_t raw = smem_address(wgmma_smem_raw);
  unsigned char* ring = wgmma_smem_raw + (((raw + 1023) & ~1023u) - raw);
  if (threadIdx.x == 0) {
    for (int s = 0; s < tile_t::stages; ++s) {
      // Producer threads each arrive once, and thread 0 once more with the TMA byte count; with
      // A by TMA (a_gathered), thread 0 alone.
      cuda::ptx::mbarrier_init(&bars.full[s], p.a_gathered ? 1 : tile_t::producer_threads + 1);
      // Every consumer warp of the cluster releases every CTA's stage (see the top).
      cuda::ptx::mbarrier_init(&bars.empty[s], tile_t::consumer_warps * tile_t::cluster);
    }
    if constexpr (HandOut) init_work_item_ring<tile_t::cluster>(item_ring, tile_t::item_readers(p));
    cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(&b_map) : "memory");
    if (p.a_gathered) asm volatile("prefetch.tensormap [%0];\n" ::"l"(&a_map) : "memory");
  }
  // The peer CTA arrives on these barriers and multicasts into this ring: both must be set up.
  if constexpr (tile_t::cluster > 1) cluster_sync();
  else __syncthreads();
  // Launched as a programmatic dependent of the kernel before it (see launch_moe_gemm_wgmma):
  // the set-up above overlapped that kernel's tail; everything below reads what it wrote.
  wait_for_prior_grids();
  allow_dependent_grids();
  if (threadIdx.x < tile_t::producer_threads) {
    if constexpr (tile_t::consumers > 1) setmaxnreg_dec<tile_t::producer_regs>();
    if (!p.a_gathered) tile_t::producer(p, &b_map, ring, bars, &item_ring);
    else if (threadIdx.x == 0) tile_t::producer_tma(p, &a_map, &b_map, ring, bars, &item_ring);
  } else {
    if constexpr (tile_t::consumers > 1) setmaxnreg_inc<tile_t::consumer_regs>();
    tile_t::consumer(p, ring, bars, &item_ring);
  }
  // The peer's last releases and multicasts land in this CTA's shared memory: stay until both are done.
  if constexpr (tile_t::cluster > 1) cluster_sync();
#else
  (void)p, (void)b_map, (void)a_map;
  __trap();
#endif
}

}  // namespace moerunner::kernels
