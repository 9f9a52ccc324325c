// Device code of the fp8 block-scaled grouped GEMMs (sm_90a only): e4m3 A and B, one f32 scale
// per 128 x 128 block of B and per row and 128 columns of A, f32 results. The same warp-specialized,
// persistent structure, work order, M-tile schedule and GEMM2 epilogue as the 16-bit wgmma
// kernels (sm90_kernel_grouped_gemm_wgmma.cuh); GEMM1's epilogue quantizes act for GEMM2.
//
// Tile: 64 or 128 rows x 256 B rows x 128 K (one scale block of K per stage, 128 bytes: one
// 128-byte swizzle row). The 256 B rows are two blocks of 128: for gate_up block b holds the 64
// gate rows of act columns n0 + 64b.. and their 64 up rows (four 64-row TMA boxes: gate, up of
// block 0, then of block 1), so the CTA covers 128 act columns, one quantization group;
// otherwise 128 consecutive rows each. A block's product is one m64n128k32 per 32 K.
//   64 rows (five stages): consumer warpgroup g takes all 64 rows and B block g.
//   128 rows (four stages, BlockM 128; the plan takes them only on request): warpgroup g takes
//     rows [64g, 64g + 64) and both blocks in turn, one block's sum in flight at a time (64
//     registers besides the 128 accumulators; consumers at 232 registers). Per K tile a CTA
//     draws 49 KB for 8.4 M multiply-adds against 41 KB for 4.2 M, yet it measured slower than
//     64-row CTAs on most prefill shapes (bench/NOTES.md, round 14).
//
// Pairs (Cluster 2, where experts see many rows): two CTAs on one 128-row schedule tile, CTA rank
// r on its rows [64 r, 64 r + 64); rank r loads half the B boxes and multicasts them into both
// CTAs' rings (both full barriers expect the whole B tile), and each consumer warp releases the
// stage in both CTAs, so neither producer refills it before both have read it: a CTA draws 24 KB
// per stage instead of 40. Both run every K tile of every item (a CTA without rows keeps the
// protocol with idle consumers); cluster barriers after the barriers' set-up and before exit.
// Fours (Cluster 4, plain K loop, fixed turns; only where asked) do the same on a 256-row
// schedule tile: the boxes are spread over the ranks (GEMM2's two over ranks 0 and 1), each
// multicast into all four rings, and each consumer warp releases the stage in all four CTAs.
//
// Precision: the tensor cores add fp8 products with fewer mantissa bits than f32 (about 14),
// so a K tile's four wgmma run into a fresh f32 block (scale-d 0 on the first) that the
// consumer then adds into its f32 accumulators times the row's A scale and the block's B scale
// (the promotion DeepSeek-V3's report describes): the reduced-precision sums span 128 products,
// never the whole K. Both warpgroups wait on the same stage, so they tend to promote at the same
// time, with the tensor pipe idle (Mixtral-8x7B 4096's GEMM1: 39% busy). Two K loops address
// that (gpu::fp8_k_loop): overlap (64-row CTAs; the plan's default there) keeps two sums and K
// tile kt + 1's wgmma queued behind kt's, so that kt's retirement and promotion run beside tensor
// work (k_loop_overlapped: 4-9% faster than plain at 4096 and 16384 tokens, bench/NOTES.md
// round 24; its first form, which issued kt + 1 only after kt's wait, measured slower at
// prefill: rounds 15 and 21). stagger (only on request) has the warpgroups take turns
// to issue each block's wgmma (two named barriers), so that one promotes while the other's run,
// with the registers of the plain loop; it measured 0-22% slower (rounds 16 and 21). Round 21's
// profile: per K tile (1273 cycles against 512 of tensor work) the consumers spent ~600 cycles
// on non-tensor instructions and the producer was busy ~80% of it.
//
// The producer copies per stage: the B boxes by TMA (thread 0), the gathered A rows by 16-byte
// cp.async (every thread, as the 16-bit kernel; GEMM2 with p.a_tma: act's rows, which are in plan
// order, by one TMA box from thread 0 instead), each row's A scale of the K tile and the
// warpgroups' B block scales by 4-byte cp.async, all signalled through the stage's full barrier
// (cp.async.mbarrier.arrive); the consumers read the scales from shared memory. (compute-sanitizer
// racecheck reports hazards between those scale reads and the producer's next cp.async into the
// stage, in every variant; the stage's full and empty barriers order both ways, and the reads'
// values are used before the warp's one-lane release: bench/NOTES.md, round 20. A diagnostic
// build with MOERUNNER_RELEASE_ALL_LANES, meson setup -Dcuda_args=-DMOERUNNER_RELEASE_ALL_LANES,
// has every consumer lane release the stage, to tell which of the two racecheck does not follow;
// there every lane of the consumer and store warps also arrives on the staging tile's barriers.)
//
// Store warps (Staged, GEMM2 on 64-row CTAs alone or in pairs, plain K loop, A by TMA; where
// GEMM2's K loop is short, gpu::fp8_staged_max_k_tiles): warp 0 of the producer warpgroup alone
// loads the stages (A and B boxes, the scales two a lane), and warps 1-3 store GEMM2's sums. The
// consumers write each item's sums (times the row's factor, packed as the direct epilogue packs
// them) into a staging tile after the ring, arrive on staged_full and start the next item; the
// store warps, walking the same items, copy one row per warp instruction (16 bytes a lane) to the
// rows, slots or (16-byte reductions) the output, then arrive on staged_empty, which the
// consumers wait on before the next item's writes. The gated GEMM1 the same way (Staged, only
// where asked: fp8_plan::staged_up): its consumers leave each item's act values in f32 (after
// the activation and the router weight) in the staging tile, and two store warps quantize them,
// a row of 128 columns per warp instruction (quantize_warp_group: the amax, scale and e4m3 of the
// rule below, so act and its scales keep every bit), while two warps load (A by cp.async).
//
// GEMM1's epilogue: act = activation(gate, up) in f32 (times the router weight where applied on
// the input), each row's amax over the CTA's 128 columns (a quad shuffle, then across the two
// blocks: in the thread's registers with 128-row tiles, else the two warpgroups' halves through
// shared memory), and e4m3 act + its scale, by the rule of kernel_quantize_fp8.cuh. GEMM2's:
// the 16-bit kernels' (sm90_wgmma_epilogue.cuh).
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/kernels/sm90_kernel_grouped_gemm_wgmma_fp8.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstdint>
#include <type_traits>

#include <cuda.h>
#include <cuda/ptx>

#include "moerunner/gpu/fp8_plan.hpp"
#include "moerunner/kernels/activation_math.cuh"
#include "moerunner/kernels/kernel_fp8_gemm_params.cuh"
#include "moerunner/kernels/kernel_grouped_gemm.cuh"
#include "moerunner/kernels/kernel_quantize_fp8.cuh"
#include "moerunner/kernels/pdl.cuh"
#include "moerunner/kernels/sm90_cluster_tiles.cuh"
#include "moerunner/kernels/sm90_ptx.cuh"
#include "moerunner/kernels/sm90_wgmma_epilogue.cuh"
#include "moerunner/kernels/sm90_work_items.cuh"

namespace moerunner::kernels {

// Bytes of a staging-tile row (store warps, 64-row tiles; 0 without them): GEMM2's 256 sums as
// 16-bit pairs, padded by 16 bytes (a warp's 4-byte writes of 8 rows x 4 pairs then hit 32
// banks), or GEMM1's 128 act values in f32, padded by 32 (a half-warp's 8-byte writes of 4 rows x
// 4 pairs then hit 32 banks).
constexpr int wgmma_fp8_staging_row_bytes(bool staged, moe_gemm_kind kind) {
  return !staged ? 0 : kind == moe_gemm_kind::down ? 2 * gpu::fp8_down_cols + 16 : 4 * (gpu::fp8_down_cols / 2) + 32;
}

// The tile's constants (sizes from the run plan's), shared with the launch code. With a staging
// tile (store warps, 64-row tiles): four stages and the tile, StagingRowBytes a row.
template <int BlockM, int StagingRowBytes = 0>
struct wgmma_fp8_shape {
  static constexpr int block_m = BlockM, block_n = gpu::fp8_down_cols, block_k = gpu::fp8_block_k;
  static constexpr bool staged = StagingRowBytes > 0;
  static constexpr int stages = BlockM == gpu::fp8_block_m && !staged ? 5 : 4, consumers = 2;
  static_assert(!staged || BlockM == gpu::fp8_block_m, "the store warps take 64-row tiles");
  static_assert((block_m == gpu::fp8_block_m || block_m == gpu::fp8_large_block_m) && block_n == 256 &&
                    block_k == 128,
                "the layout below is written for 64 or 128 x 256 x 128");
  static constexpr int a_bytes = block_m * block_k, b_bytes = block_n * block_k;
  static constexpr int scale_bytes = 1024;  // A scales (64 or 128 floats), B scales (4), padding to 1024
  static constexpr int stage_bytes = a_bytes + b_bytes + scale_bytes;
  static constexpr int staging_row_bytes = StagingRowBytes;
  static constexpr int staging_bytes = block_m * staging_row_bytes;
  static constexpr int smem_bytes = stages * stage_bytes + staging_bytes + 1024;  // + alignment slack
  static constexpr int threads = 128 * (1 + consumers);
  static_assert(smem_bytes <= 227 * 1024, "the ring must fit in shared memory");
  static_assert(stage_bytes % 1024 == 0 && a_bytes % 1024 == 0, "tiles start on swizzle-pattern boundaries");
};

// Four consumer threads (a quad) share a row: the max over the quad's values.
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// A position in a ring of Stages stages: the stage and the parity of its barriers' current phase,
// stepped without a division per K tile.
template <int Stages>
struct ring_slot {
  int stage = 0;
  std::uint32_t phase = 0;
  __device__ __forceinline__ void next() {
    if (++stage == Stages) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

template <class T, moe_gemm_kind Kind, int Cluster, int BlockM = gpu::fp8_block_m,
          gpu::fp8_k_loop Loop = gpu::fp8_k_loop::plain, bool HandOut = false, bool Staged = false>
struct moe_gemm_wgmma_fp8 : wgmma_fp8_shape<BlockM, wgmma_fp8_staging_row_bytes(Staged, Kind)> {
  using shape = wgmma_fp8_shape<BlockM, wgmma_fp8_staging_row_bytes(Staged, Kind)>;
  using shape::a_bytes, shape::b_bytes, shape::block_k, shape::block_m, shape::block_n, shape::consumers,
      shape::scale_bytes, shape::stage_bytes, shape::stages, shape::staging_row_bytes;
  // Staged: GEMM2's consumers leave their sums (times the row's factor, as bf16/f16 pairs) in the
  // staging tile and go on to the next item; producer warps 1-3 store them, 16 bytes a lane, one
  // row per warp instruction, while warp 0 alone loads the stages (A by TMA only). The gated
  // GEMM1's leave f32 act; warps 2-3 quantize and store it, warps 0-1 load (A by cp.async).
  static_assert(!Staged || (Kind != moe_gemm_kind::up_only && !HandOut && Cluster <= 2),
                "store warps are for GEMM2 and the gated GEMM1 in fixed turns, alone or in pairs");
  static_assert(Cluster == 1 || Cluster == 2 || Cluster == 4, "CTAs run alone, in pairs or in fours along M");
  static_assert(Cluster <= 2 || (Loop == gpu::fp8_k_loop::plain && !HandOut),
                "fours of CTAs run the plain K loop in fixed turns");
  static constexpr bool tall = BlockM == gpu::fp8_large_block_m;  // warpgroups on rows of their own
  static_assert(!tall || Cluster == 1, "128-row CTAs run alone");
  static constexpr bool overlap = Loop == gpu::fp8_k_loop::overlap, stagger = Loop == gpu::fp8_k_loop::stagger;
  // (128-row tiles: a staggered gate_up spilled, and the overlap needs 128 more registers.)
  static_assert(!tall || Loop == gpu::fp8_k_loop::plain, "the overlapped and staggered K loops are for 64-row tiles");
  static constexpr int bm = block_m, bn = block_n, bk = block_k, cluster = Cluster;
  static constexpr int blocks = tall ? 2 : 1;  // 128-row B blocks per warpgroup
  static constexpr int schedule_block_m = block_m * Cluster;
  static constexpr int halves = Kind == moe_gemm_kind::gate_up ? 2 : 1;
  // GEMM1 splits K (into f32 parts) on 64-row CTAs alone only: the branch is not compiled
  // elsewhere (beside the 128-row tile's accumulators it spilled).
  static constexpr bool up_splits = Kind != moe_gemm_kind::down && Cluster == 1 && !tall && !Staged;
  static constexpr int out_cols = bn / halves;        // output columns per CTA: 128 gated, else 256
  static constexpr int box_rows = halves == 2 ? 64 : 128;
  static constexpr int boxes = bn / box_rows;
  static constexpr int b_scales = boxes;  // per stage: one per B box (each warpgroup's gate, and up, rows)
  static constexpr int a_scale_offset = a_bytes + b_bytes, b_scale_offset = a_scale_offset + block_m * 4;
  static constexpr int producer_threads = 128, consumer_warps = 4 * consumers;
  // Threads that load the stages (and arrive on their full barriers), and the store warps.
  // GEMM2's A comes by TMA alone where it has store warps.
  static constexpr bool a_tma_only = Staged && Kind == moe_gemm_kind::down;
  static constexpr int load_threads = !Staged ? producer_threads : a_tma_only ? 32 : 64;
  static constexpr int store_warps = (producer_threads - load_threads) / 32;
  // Lanes of a consumer warp that release a stage, and of a consumer or store warp that arrive on
  // the staging tile's barriers (see MOERUNNER_RELEASE_ALL_LANES above).
#if defined(MOERUNNER_RELEASE_ALL_LANES)
  static constexpr int release_lanes = 32;
#else
  static constexpr int release_lanes = 1;
#endif
  static constexpr int chunks_per_row = bk / 16;  // 16-byte chunks: 8
  // A rows copied per pass of the loading threads (16, or 8 beside GEMM1's store warps; none
  // copied where A comes by TMA alone), and the passes per stage.
  static constexpr int rows_per_pass = a_tma_only ? bm : load_threads / chunks_per_row;
  static constexpr int a_passes = bm / rows_per_pass;
  static_assert(a_tma_only || rows_per_pass % 8 == 0, "the A copies' swizzle takes rows in eights");
  static constexpr int k_steps = bk / 32;                                  // wgmma per K tile
  // A descriptor's start address (bytes / 16) one stage, or one 128-row B block, further.
  static constexpr std::uint64_t stage_desc = stage_bytes >> 4, block_desc = (128 * bk) >> 4;
  // A consumer thread holds 128 accumulators and a block's 64-register sum (128-row tiles), 64
  // accumulators and one sum (64-row tiles), or 64 and two sums (overlap).
  static constexpr bool lean_producer = tall || overlap;
  // GEMM1 beside store warps copies its A rows with half the threads (8 rows each per stage): at
  // 56 registers its producer warps spilled, at 72 (all that the plain loop's consumers leave,
  // the rows' addresses formed per K tile) none did; the overlapped loop's consumers spilled at 216.
  static constexpr bool wide_producer = Staged && Kind != moe_gemm_kind::down;
  static_assert(!wide_producer || Loop == gpu::fp8_k_loop::plain, "GEMM1's store warps take the plain K loop");
  static constexpr int producer_regs = lean_producer ? 40 : wide_producer ? 72 : 56;
  static constexpr int consumer_regs = lean_producer ? 232 : 216;
  // setmaxnreg moves registers within what the CTA got at launch: 168 per thread for 384
  // threads (launch bounds of one CTA per SM).
  static_assert(producer_threads * producer_regs + consumers * 128 * consumer_regs <= 168 * shape::threads,
                "the register split must fit the CTA's registers");
  static_assert(b_scale_offset + b_scales * 4 <= a_bytes + b_bytes + scale_bytes, "the scales fit their area");
  static_assert(shape::smem_bytes + 8 * 1024 <= (1 << 18),
                "the consumers offset a descriptor's 14-bit start address (bytes / 16) per stage: the ring, "
                "after the static shared memory, must end below 256 KB");

  struct barriers {
    std::uint64_t full[stages];
    std::uint64_t empty[stages];
    std::uint64_t staged_full, staged_empty;  // Staged: the staging tile holds an item's sums / is free
  };
  static_assert(work_item_ring::depth > stages + 2, "the producer must never wait for a work item slot");
  static_assert(!HandOut || (!lean_producer && Loop == gpu::fp8_k_loop::plain),
                "work items are handed out to 64-row CTAs with the plain K loop (a lean producer spilled)");
  using items_t = item_loop<HandOut, Cluster>;
  __device__ __forceinline__ static items_t items_of(const moe_gemm_params<T>& g, work_item_ring* ring) {
    return make_item_loop<HandOut, Cluster>(*g.tile_count, g.n_tiles, g.k_splits, ring, g.item_counter);
  }
  static constexpr int item_readers = producer_threads / 32 + consumer_warps;  // warps that read the items

  // stagger: named barriers 2 and 3 (0 is __syncthreads', 1 the gate_up epilogue's exchange) are
  // the warpgroups' turns; each counts both warpgroups (one waits, the other arrives).
  static constexpr int turn_barrier = 2;
  __device__ __forceinline__ static void named_barrier_sync(int id) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(128 * consumers) : "memory");
  }
  __device__ __forceinline__ static void named_barrier_arrive(int id) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(128 * consumers) : "memory");
  }

  // The first output column of B box `box` of the tile at output column n0, and the half it is in
  // (gate_up: warpgroup box / 2, half box % 2).
  __device__ __forceinline__ static void box_origin(int box, int n0, int& col, int& half) {
    if constexpr (halves == 2) {
      col = n0 + 64 * (box / 2);
      half = box % 2;
    } else {
      col = n0 + 128 * box;
      half = 0;
    }
  }

  // An A row a producer thread copies: its source row (-1: none), or handed out its byte offset
  // in 32 bits (all ones: none), one register where the item loop takes a few more
  // (gpu::hand_out_offsets_fit bounds the rows). Rows are k bytes, their scales k / 128 floats.
  using a_row = std::conditional_t<HandOut, std::uint32_t, int>;
  static constexpr std::uint32_t no_a_row = 0xffffffffu;
  __device__ __forceinline__ static a_row a_row_of(int src, int k) {
    if constexpr (HandOut) return src < 0 ? no_a_row : static_cast<std::uint32_t>(src) * static_cast<std::uint32_t>(k);
    else return src;
  }
  __device__ __forceinline__ static bool a_row_valid(a_row a) {
    if constexpr (HandOut) return a != no_a_row;
    else return a >= 0;
  }
  __device__ __forceinline__ static std::int64_t a_data_offset(a_row a, int k, int kcol) {
    if constexpr (HandOut) return a + static_cast<std::uint32_t>(kcol);
    else return static_cast<std::int64_t>(a) * k + kcol;
  }
  __device__ __forceinline__ static std::int64_t a_scale_index(a_row a, int stride, int kt) {
    if constexpr (HandOut) return (a / fp8_group) + static_cast<std::uint32_t>(kt);
    else return static_cast<std::int64_t>(a) * stride + kt;
  }

  __device__ static void producer(const moe_gemm_fp8_params<T>& p, const CUtensorMap* a_map, const CUtensorMap* b_map,
                                  unsigned char* ring, barriers& bars, work_item_ring* item_ring, int early) {
    const moe_gemm_params<T>& g = p.g;
    const int tid = threadIdx.x;  // 0..127
    if constexpr (Staged) {
      if (tid >= load_threads) {
        if constexpr (Kind == moe_gemm_kind::down)
          store_rows(p, ring + stages * stage_bytes, bars, item_ring, tid - load_threads);
        else store_act_rows(p, ring + stages * stage_bytes, bars, item_ring, tid - load_threads);
        return;
      }
    }
    const int ld_row = tid / chunks_per_row, ld_chunk = tid % chunks_per_row;
    const int st_chunk = ld_chunk ^ (ld_row & 7);  // rows_per_pass is a multiple of 8
    const int k_tiles = g.k / bk;
    const int a_scale_stride = k_tiles;
    const std::int64_t b_scale_rows = g.b_rows_per_expert / fp8_group;
    const int tiles = *g.tile_count;
    items_t items = items_of(g, item_ring);
    const cta_place me = items.me;
    // Per stage, the loading threads copy A scales of rows tid, tid + load_threads, .. (whole
    // warps: no lane of a copying warp idles), and lane j < b_scales of the last loading warp box
    // j's B scale.
    constexpr int a_scale_copies = (bm + load_threads - 1) / load_threads;
    const int b_scale_box = tid - (load_threads - 32);
    const bool a_tma = a_by_tma(p);
    ring_slot<stages> slot;
    for (auto w = items.first(); w < items.work; w = items.next_warp(w)) {
      items.ask();
      const moe_work_item item = decode_work_item(w, tiles, g.n_tiles, g.k_splits, g.raster_band, band_tiles_of(g));
      const int n0 = item.n_tile * out_cols;
      const gpu::moe_m_tile tile = cluster_cta_rows<Cluster, bm>(g.tiles[item.m_tile], me.rank);
      int kt_begin = 0, kt_end = 0;
      split_k_range(k_tiles, item.split, g.k_splits, kt_begin, kt_end);
      a_row a_src_row[a_passes];
#pragma unroll
      for (int i = 0; i < a_passes; ++i) {
        const int r = ld_row + i * rows_per_pass;  // (a_tma_only: no row to copy)
        a_src_row[i] = a_row_of(a_tma_only ? -1 : a_source_row<Kind>(tile, r, g.row_to_slot, g.top_k), g.k);
      }
      a_row a_scale_row[a_scale_copies];
#pragma unroll
      for (int i = 0; i < a_scale_copies; ++i) {
        const int r = tid + i * load_threads;
        a_scale_row[i] = a_row_of(r < bm ? a_source_row<Kind>(tile, r, g.row_to_slot, g.top_k) : -1, g.k);
      }
      // The B scale this thread copies per stage, or none (per channel: the epilogue applies the scales).
      const bool per_block = p.b_scaling == fp8_weight_scaling::block128;
      const bool copies_b_scale =
          b_scale_box >= 0 && b_scale_box < b_scales && p.b_scaling != fp8_weight_scaling::per_channel;
      std::int64_t b_scale_base = 0;
      bool b_scale_ok = false;
      if (copies_b_scale) {
        // The first expert row of the box, whose 128-row scale block the box's rows share.
        int col = 0, half = 0;
        box_origin(b_scale_box, n0, col, half);
        const std::int64_t row = b_row<Kind>(g, half, col);
        b_scale_ok = row < g.b_rows_per_expert;  // a box past n (GEMM2's last N tile) reads zeros
        b_scale_base = per_block ? (tile.expert * b_scale_rows + row / fp8_group) * k_tiles : tile.expert;
      }
      for (int kt = kt_begin; kt < kt_end; ++kt, slot.next()) {
        const int stage = slot.stage;
        // A fresh barrier counts as having completed the phase before its first (parity 1).
        mbarrier_wait(&bars.empty[stage], slot.phase ^ 1u);
        unsigned char* sa = ring + stage * stage_bytes;
        if (tid == 0) {
          // The first item's first K tiles may have had their bytes expected and B boxes loaded
          // before the kernel's programmatic wait (load_first_weights).
          if (early > 0) --early;
          else {
            expect_stage(a_tma, &bars.full[stage]);
            load_b_boxes(g, b_map, sa, &bars.full[stage], kt, n0, tile.expert, me.rank);
          }
          if (a_tma) {
            const std::int32_t a_coords[4] = {kt * bk, tile.row_begin, 0, 0};
            tma_load_box<1>(sa, a_map, a_coords, &bars.full[stage]);
          }
        }
        const int kcol = kt * bk + ld_chunk * 16;
        // Rows past the tile are zero-filled (no read, no branch): their results are never
        // stored, and a wgmma row reads only its own A row and scale.
        if (!a_tma) {
#pragma unroll
          for (int i = 0; i < a_passes; ++i) {
            // At 40 registers, or 8 rows a thread: the row's addresses formed anew per K tile (a
            // few integer operations) rather than held across the loop, 64 bits each.
            if constexpr (lean_producer || wide_producer) asm volatile("" : "+r"(a_src_row[i]));
            const bool ok = a_row_valid(a_src_row[i]);
            const int r = ld_row + i * rows_per_pass;
            cp_async_16(smem_address(sa + r * bk + st_chunk * 16),
                        p.a + (ok ? a_data_offset(a_src_row[i], g.k, kcol) : 0), ok);
          }
        }
#pragma unroll
        for (int i = 0; i < a_scale_copies; ++i) {
          const int r = tid + i * load_threads;
          if (r >= bm) break;
          const bool ok = a_row_valid(a_scale_row[i]);
          cp_async_4(smem_address(sa + a_scale_offset + r * 4),
                     p.a_scale + (ok ? a_scale_index(a_scale_row[i], a_scale_stride, kt) : 0), ok);
        }
        if (copies_b_scale)
          cp_async_4(smem_address(sa + b_scale_offset + b_scale_box * 4),
                     p.b_scale + (b_scale_ok ? b_scale_base + (per_block ? kt : 0) : 0), b_scale_ok);
        cp_async_arrive_noinc(&bars.full[stage]);
      }
      items.publish();
    }
  }

  // GEMM2's A rows (act, in plan order) by one TMA box per stage: the tile's rows and whatever
  // follows them (never stored: a wgmma row reads only its own A row), zeros past act's end.
  // With store warps one warp loads: TMA only.
  __device__ __forceinline__ static bool a_by_tma(const moe_gemm_fp8_params<T>& p) {
    return Kind == moe_gemm_kind::down && (a_tma_only || p.a_tma);
  }

  // Thread 0: the TMA bytes a stage's full barrier expects (B, and A where it comes by TMA), with
  // the thread's own arrival.
  __device__ __forceinline__ static void expect_stage(bool a_tma, std::uint64_t* full) {
    cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared, full,
                                         static_cast<std::uint32_t>(b_bytes + (a_tma ? a_bytes : 0)));
  }

  // Thread 0: K tile kt's B boxes of the item at output column n0 into stage `sa`. In a cluster,
  // rank r loads its share of the boxes into every CTA (same offsets, every full barrier): a pair
  // half of them each; fours one each, or GEMM2's two by ranks 0 and 1.
  __device__ __forceinline__ static void load_b_boxes(const moe_gemm_params<T>& g, const CUtensorMap* b_map,
                                                      unsigned char* sa, std::uint64_t* full, int kt, int n0,
                                                      int expert, int rank) {
#pragma unroll
    for (int b = 0; b < boxes; ++b) {
      if (Cluster > 1 && (boxes >= Cluster ? b / (boxes / Cluster) : b) != rank) continue;
      int col = 0, half = 0;
      box_origin(b, n0, col, half);
      const bool swapped = halves == 2 && g.interleaved;
      const std::int32_t coords[4] = {kt * bk, swapped ? half : col, swapped ? col : half, expert};
      tma_load_box<Cluster>(sa + a_bytes + b * box_rows * bk, b_map, coords, full);
    }
  }

  // Thread 0, before the kernel's programmatic wait: the expected bytes and B boxes of the first
  // K tiles (as many as the ring holds) of this CTA's first item, which read only the weights and
  // the tile schedule. Launched as a programmatic dependent, the kernel's CTAs start on the SMs
  // that the grid before it leaves as its last CTAs run, and the weight stream starts there
  // instead of after that grid's end. The schedule's writer has finished by then (the launch
  // code makes this grid a dependent only of a later kernel: the input's quantization, GEMM1 or
  // its parts kernel), but L1 may hold an earlier run's words: they are read from L2. Expert
  // bands (band words read by the item order) start after the wait. Returns the K tiles issued.
  __device__ static int load_first_weights(const moe_gemm_fp8_params<T>& p, const CUtensorMap* b_map,
                                           unsigned char* ring, barriers& bars) {
    const moe_gemm_params<T>& g = p.g;
    if (g.expert_bands) return 0;
    const cta_place me = cluster_place<Cluster>();
    const int tiles = __ldcg(g.tile_count);
    if (me.first >= static_cast<std::int64_t>(tiles) * g.n_tiles * g.k_splits) return 0;
    const moe_work_item item = decode_work_item(me.first, tiles, g.n_tiles, g.k_splits, g.raster_band);
    const int expert = __ldcg(reinterpret_cast<const int4*>(g.tiles + item.m_tile)).x;
    int kt_begin = 0, kt_end = 0;
    split_k_range(g.k / bk, item.split, g.k_splits, kt_begin, kt_end);
    const int early = kt_end - kt_begin < stages ? kt_end - kt_begin : stages;
    // The ring's first stages, fresh (no release to wait for).
    for (int i = 0; i < early; ++i) {
      expect_stage(a_by_tma(p), &bars.full[i]);
      load_b_boxes(g, b_map, ring + i * stage_bytes, &bars.full[i], kt_begin + i, item.n_tile * out_cols, expert,
                   me.rank);
    }
    return early;
  }

  // Staged: store warp `warp` (0..store_warps-1) of the CTA walks the items as the consumers do
  // and, for each with rows, waits for the staging tile to hold them, calls store(tile, n0, rows)
  // and frees the tile.
  template <class Store>
  __device__ __forceinline__ static void walk_staged_items(const moe_gemm_params<T>& g, barriers& bars,
                                                           work_item_ring* item_ring, int lane, const Store& store) {
    const int tiles = *g.tile_count;
    items_t items = items_of(g, item_ring);
    const cta_place me = items.me;
    std::uint32_t phase = 0;
    for (auto w = items.first(); w < items.work; w = items.next_warp(w)) {
      const moe_work_item item = decode_work_item(w, tiles, g.n_tiles, g.k_splits, g.raster_band, band_tiles_of(g));
      const gpu::moe_m_tile tile = cluster_cta_rows<Cluster, bm>(g.tiles[item.m_tile], me.rank);
      const int rows = tile.row_end - tile.row_begin;
      if (rows <= 0) continue;  // (its consumers stage nothing either)
      mbarrier_wait(&bars.staged_full, phase);
      phase ^= 1u;
      store(tile, item.n_tile * out_cols, rows < bm ? rows : bm);
      __syncwarp();
      if (lane < release_lanes) cuda::ptx::mbarrier_arrive(&bars.staged_empty);
    }
  }

  // Staged GEMM2: store warp `warp` stores rows warp, warp + store_warps, .. of each item's sums
  // (lane l: columns n0 + 8l .. + 7, 16 bytes; a reduction into the output where GEMM2 accumulates).
  __device__ static void store_rows(const moe_gemm_fp8_params<T>& p, const unsigned char* staging, barriers& bars,
                                    work_item_ring* item_ring, int t) {
    const moe_gemm_params<T>& g = p.g;
    const int warp = t / 32, lane = t % 32;
    walk_staged_items(g, bars, item_ring, lane, [&](const gpu::moe_m_tile& tile, int n0, int rows) {
      const int col = n0 + 8 * lane;
      if (col >= g.n) return;  // n is a multiple of 128: 8 columns are wholly in or out
      for (int r = warp; r < rows; r += store_warps) {
        T* dst = down_target<T>::at(g, tile.row_begin + r).dst + col;  // (the consumers applied its factor)
        const uint4 v = *reinterpret_cast<const uint4*>(staging + r * staging_row_bytes + 16 * lane);
        if (g.store == down_store::accumulate) atomic_add8(dst, {v.x, v.y, v.z, v.w});
        else *reinterpret_cast<uint4*>(dst) = v;
      }
    });
  }

  // Staged GEMM1: store warp `warp` quantizes rows warp, warp + store_warps, .. of each item's f32
  // act (lane l: columns n0 + 4l .. + 3 of the row's one group, n being a multiple of 128; the
  // row's scale from lane 0).
  __device__ static void store_act_rows(const moe_gemm_fp8_params<T>& p, const unsigned char* staging,
                                        barriers& bars, work_item_ring* item_ring, int t) {
    const moe_gemm_params<T>& g = p.g;
    const int warp = t / 32, lane = t % 32;
    walk_staged_items(g, bars, item_ring, lane, [&](const gpu::moe_m_tile& tile, int n0, int rows) {
      for (int r = warp; r < rows; r += store_warps)
        quantize_group_to(reinterpret_cast<const float*>(staging + r * staging_row_bytes), tile.row_begin + r, n0, g.n,
                          p.act, p.act_scale, lane);
    });
  }

  // Staged GEMM1: the warpgroup's act values (act: a callable of activation_math.cuh) of the
  // tile's rows, its block's 64 columns (64 group + ..), in f32 into the staging tile: the values
  // store_act quantizes, formed the same way.
  template <class Act>
  __device__ __forceinline__ static void stage_act(const moe_gemm_params<T>& g, const Act& act,
                                                   const gpu::moe_m_tile& tile, unsigned char* staging, int group,
                                                   int warp, int lane, const float (&acc)[64 * blocks]) {
    static_assert(halves == 2 && blocks == 1, "the gated GEMM1 on 64-row tiles");
    const int rows = tile.row_end - tile.row_begin;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = 16 * warp + lane / 4 + 8 * h;
      if (r >= rows) continue;
      const float weight = g.input_weights != nullptr ? g.input_weights[g.row_to_slot[tile.row_begin + r]] : 1.0f;
      unsigned char* dst = staging + r * staging_row_bytes + 4 * (64 * group + 2 * (lane % 4));
      // Register 4j + 2h + q: the gate row (j < 8) or up row (j + 8) of act column 8j + 2(lane % 4) + q.
#pragma unroll
      for (int j = 0; j < 8; ++j)
        *reinterpret_cast<float2*>(dst + 32 * j) =
            make_float2(act(acc[4 * j + 2 * h] * weight, acc[4 * (j + 8) + 2 * h] * weight),
                        act(acc[4 * j + 2 * h + 1] * weight, acc[4 * (j + 8) + 2 * h + 1] * weight));
    }
  }

  // Staged: the warpgroup's sums of the tile's rows (block `block`'s 128 columns) times each row's
  // factor, as 16-bit pairs into the staging tile: the values and rounding of the direct epilogue.
  __device__ __forceinline__ static void stage_rows(const moe_gemm_params<T>& g, const gpu::moe_m_tile& tile,
                                                    unsigned char* staging, int block, int warp, int lane,
                                                    const float (&acc)[64 * blocks]) {
    const int rows = tile.row_end - tile.row_begin;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = 16 * warp + lane / 4 + 8 * h;
      if (r >= rows) continue;
      const float f = down_target<T>::at(g, tile.row_begin + r).factor;
      unsigned char* dst = staging + r * staging_row_bytes + 2 * (128 * block + 2 * (lane % 4));
#pragma unroll
      for (int j = 0; j < 16; ++j)
        *reinterpret_cast<std::uint32_t*>(dst + 16 * j) =
            mma_16816<T>::pack2(acc[4 * j + 2 * h] * f, acc[4 * j + 2 * h + 1] * f);
    }
  }

  __device__ static void consumer(const moe_gemm_fp8_params<T>& p, unsigned char* ring, barriers& bars,
                                  float (&amax_exchange)[2][consumers][block_m], work_item_ring* item_ring) {
    const moe_gemm_params<T>& g = p.g;
    // The consumer warpgroup, read from lane 0 so that ptxas sees it warp-uniform: the wgmma
    // descriptors below then live in uniform registers, formed without per-thread arithmetic.
    const int group = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128) - 1, 0);
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int k_tiles = g.k / bk;
    const bool per_channel = p.b_scaling == fp8_weight_scaling::per_channel;
    if constexpr (Kind != moe_gemm_kind::down)
      clear_output(g, static_cast<int>(threadIdx.x) - producer_threads, 128 * consumers);
    const int tiles = *g.tile_count;
    items_t items = items_of(g, item_ring);
    const std::uint32_t ring_addr = smem_address(ring);
    const cta_place me = items.me;
    // The warpgroup's rows of the tile, and its first B block (the other follows with tall tiles).
    const int row_base = tall ? 64 * group : 0, first_block = tall ? 0 : group;
    // The warpgroup's A and the CTA's B descriptors in stage 0; a stage or block further is an
    // add to the start-address field (addresses stay below 256 KB: no carry out of it).
    const std::uint64_t a_desc = sw128_kmajor_desc(ring_addr + row_base * bk);
    const std::uint64_t b_desc = sw128_kmajor_desc(ring_addr + a_bytes);
    ring_slot<stages> slot;  // the stage of the CTA's next K tile
    std::uint32_t staged_phase = 0;  // Staged: items staged so far, mod 2
    int exchange = 0;  // which half of amax_exchange this item uses (see the gate_up epilogue)
    // stagger: warpgroup 0 issues first; each then waits on its own turn barrier and passes the
    // other's. The two run the same blocks in the same order, so the turns pair up; warpgroup 0
    // takes the last pass after the loop (no barrier is left half arrived at exit).
    if constexpr (stagger)
      if (group == 1) named_barrier_arrive(turn_barrier);
    float acc[64 * blocks], part[overlap ? 1 : 64];  // overlap: the sums are k_loop_overlapped's
    // Handed out, the next item is read as the loop goes on to it: by then the producer has
    // issued this item's K tiles, and with them published the next.
    for (auto w = items.first(); w < items.work; w = items.next_warp(w)) {
      const moe_work_item item = decode_work_item(w, tiles, g.n_tiles, g.k_splits, g.raster_band, band_tiles_of(g));
      const int n0 = item.n_tile * out_cols;
      const gpu::moe_m_tile tile = cluster_cta_rows<Cluster, bm>(g.tiles[item.m_tile], me.rank);
      const int rows = tile.row_end - tile.row_begin;
      // A warpgroup without rows of the tile (a CTA of a cluster, or the second of a 128-row tile)
      // keeps the protocol with idle tensor work: the producers need its releases.
      const bool active = row_base < rows;
      int kt_begin = 0, kt_end = 0;
      split_k_range(k_tiles, item.split, g.k_splits, kt_begin, kt_end);
#pragma unroll
      for (int i = 0; i < 64 * blocks; ++i) acc[i] = 0.0f;
      if constexpr (overlap) {
        if (kt_begin < kt_end)
          k_loop_overlapped(bars, ring, slot, kt_end - kt_begin, a_desc, b_desc + first_block * block_desc, first_block,
                            r0_of(row_base, warp, lane), per_channel, lane, static_cast<std::uint32_t>(me.rank ^ 1), acc);
      } else {
        for (int kt = kt_begin; kt < kt_end; ++kt, slot.next()) {
          const int stage = slot.stage;
          const stage_scales sc = await_stage(bars, ring, slot);
          const std::uint64_t stage_off = static_cast<std::uint64_t>(stage) * stage_desc;
          const int r0 = r0_of(row_base, warp, lane);
          const float sa0 = sc.a[r0], sa1 = sc.a[r0 + 8];
#pragma unroll
          for (int blk = 0; blk < blocks; ++blk) {
            const int b = first_block + blk;
            // The promotion's factors before the wgmma, so that their shared-memory reads wait in
            // the wgmma's shadow rather than after it (each K tile's promotion waited on them).
            float f[2][2];
            promotion_factors(sc.b, b, per_channel, sa0, sa1, f);
            if constexpr (stagger) {
              // This warpgroup's turn, then the other's: nothing branches between the wgmma and
              // their wait (ptxas would serialize them), so a warpgroup without rows multiplies
              // whatever the stage holds (never stored).
              named_barrier_sync(turn_barrier + group);
              mma_block(part, a_desc + stage_off, b_desc + stage_off + b * block_desc);
              named_barrier_arrive(turn_barrier + (group ^ 1));
              wgmma_wait<0>();
            } else if (active) {
              mma_block(part, a_desc + stage_off, b_desc + stage_off + b * block_desc);
              wgmma_wait<0>();
            }
            wgmma_fence_operands(part);
            if (blk == blocks - 1) {
              __syncwarp();
              // The stage is free again for this CTA's producer and, in a cluster, for the other
              // CTAs', which multicast into it.
              if (lane < release_lanes) {
                cuda::ptx::mbarrier_arrive(&bars.empty[stage]);
#pragma unroll
                for (int r = 1; r < Cluster; ++r)
                  mbarrier_arrive_cluster(&bars.empty[stage], static_cast<std::uint32_t>(me.rank ^ r));
              }
            }
            if (!active) continue;
            promote(part, f, acc, blk);
          }
        }
      }
      // (64-row tiles: both warpgroups are active or neither, so the gate_up epilogue's barrier
      // sees both or none.)
      if (!active) continue;
      // Per channel, each column's sums times its weight row's scale first, in place, so that the
      // epilogues below are the block format's: with the scales read behind a runtime test in
      // every value, every item's epilogue carried ~200 predicated loads and their tests (fp8
      // decode, where items are short, lost 2-12%: bench/NOTES.md, round 14).
      if (per_channel) scale_columns(p, tile, n0, first_block, lane, acc);
      if constexpr (Staged) {
        // The store warps have stored the last item's sums (a fresh barrier counts as having
        // completed the phase before its first).
        mbarrier_wait(&bars.staged_empty, staged_phase ^ 1u);
        unsigned char* staging = ring + stages * stage_bytes;
        if constexpr (Kind == moe_gemm_kind::down) stage_rows(g, tile, staging, first_block, warp, lane, acc);
        else
          with_activation(g.act, true,
                          [&](const auto& act) { stage_act(g, act, tile, staging, group, warp, lane, acc); });
        __syncwarp();
        if (lane < release_lanes) cuda::ptx::mbarrier_arrive(&bars.staged_full);
        staged_phase ^= 1u;
      } else if constexpr (Kind == moe_gemm_kind::down) {
#pragma unroll
        for (int blk = 0; blk < blocks; ++blk)
          wgmma_epilogue<T, Kind>::template store<16, false>(
              g, tile, n0 + 128 * (first_block + blk), item.split, row_base, warp, lane,
              [&](int j, int i) { return acc[64 * blk + 4 * j + i]; }, [&](int, int) { return 0.0f; });
      } else if (up_splits && g.k_splits > 1) {
        store_parts(p, tile, n0, first_block, row_base, warp, lane, acc, item.split);
      } else {
        const auto store = [&](const auto& act) {
          store_act(p, act, tile, n0, first_block, row_base, warp, lane, acc, amax_exchange[exchange], group);
        };
        // One epilogue per activation kind, except where registers are short (128-row tiles:
        // three copies spilled): there the kind is chosen per value.
        if constexpr (tall) store(activation_any{g.act, halves == 2});
        else with_activation(g.act, halves == 2, store);
        exchange ^= 1;
      }
    }
    if constexpr (stagger)
      if (group == 0) named_barrier_sync(turn_barrier);
  }

  // A stage's scales in shared memory: its A rows' and its B blocks'.
  struct stage_scales {
    const float* a;
    const float* b;
  };
  // Waits until K tile `at`'s stage is full and orders its A rows and scales, which came by
  // cp.async (generic proxy), before the wgmma reads them (async proxy).
  __device__ __forceinline__ static stage_scales await_stage(barriers& bars, const unsigned char* ring,
                                                             const ring_slot<stages>& at) {
    mbarrier_wait(&bars.full[at.stage], at.phase);
    cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
    const unsigned char* stage_ptr = ring + at.stage * stage_bytes;
    return {reinterpret_cast<const float*>(stage_ptr + a_scale_offset),
            reinterpret_cast<const float*>(stage_ptr + b_scale_offset)};
  }

  // One B block's four m64n128k32 over a K tile (descriptors da, db of its A rows and B block)
  // into `part` (scale-d 0 on the first), one commit group.
  __device__ __forceinline__ static void mma_block(float (&part)[64], std::uint64_t da, std::uint64_t db) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < k_steps; ++kk) {
      const auto step = static_cast<std::uint64_t>(kk * 32 >> 4);
      wgmma_m64n128k32_e4m3(part, da + step, db + step, kk);
    }
    wgmma_commit();
  }

  // Block blk's accumulators += one K tile's sums times their factors f[h][c] (the row scale of
  // row r0 + 8h times the B scale of the block's first, c = 0, or last 64 B rows). Register
  // 4j + 2h + q: row r0 + 8h, column 8j + 2(lane % 4) + q of the block's 128 B rows (gate_up:
  // j < 8 gate rows, j >= 8 their up rows).
  __device__ __forceinline__ static void promote(const float (&sums)[64], const float (&f)[2][2],
                                                 float (&acc)[64 * blocks], int blk) {
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[64 * blk + i] = fmaf(sums[i], f[(i >> 1) & 1][i >= 32 ? 1 : 0], acc[64 * blk + i]);
  }

  // The factors f[h][c] of block b's promotion: the row scales sa0, sa1 (rows r0 and r0 + 8)
  // times the stage's scale of the block's first (c = 0) or last 64 B rows (1 per channel: the
  // epilogue applies those).
  __device__ __forceinline__ static void promotion_factors(const float* b_scales, int b, bool per_channel, float sa0,
                                                           float sa1, float (&f)[2][2]) {
    const float sb0 = per_channel ? 1.0f : b_scales[b * halves];
    const float sb1 = per_channel ? 1.0f : b_scales[b * halves + halves - 1];
    f[0][0] = sa0 * sb0, f[0][1] = sa0 * sb1, f[1][0] = sa1 * sb0, f[1][1] = sa1 * sb1;
  }

  // The first of the thread's two rows in the tile (the other is 8 below).
  __device__ __forceinline__ static int r0_of(int row_base, int warp, int lane) {
    return row_base + 16 * warp + lane / 4;
  }

  // overlap: one item's n K tiles (the CTA's next n, from `slot` on; da, db: the warpgroup's A
  // rows and B block in stage 0) with one K tile's wgmma always queued behind the running one:
  // K tile kt + 1's stage is awaited, its scales read and its wgmma issued (into the other of two
  // sum blocks) before kt's are waited for (wgmma.wait_group 1), so the tensor pipe goes on from
  // kt to kt + 1 while this warpgroup retires, releases and promotes kt. kt's stage is released
  // once its wgmma are done. The loop goes in pairs so that every path into and out of it has
  // the same group in flight (kt's, in `sums_a`): ptxas tracks groups without relating branch
  // conditions, and serializes every wgmma of the kernel where one path may leave a group in
  // flight that another does not (C7514 / C7518). For the same reason nothing between a wgmma
  // and its wait branches: releases are predicated, and a CTA of a pair without rows multiplies
  // whatever its stages hold (never stored). (Until round 21 the loop waited for kt before
  // issuing kt + 1, hiding only the promotion; it measured slower than the plain loop:
  // bench/NOTES.md, rounds 15 and 21.)
  __device__ __forceinline__ static void k_loop_overlapped(barriers& bars, unsigned char* ring,
                                                           ring_slot<stages>& slot, int n, std::uint64_t da,
                                                           std::uint64_t db, int block, int r0, bool per_channel,
                                                           int lane, std::uint32_t peer, float (&acc)[64 * blocks]) {
    float sums_a[64], sums_b[64], f_a[2][2], f_b[2][2];
    // Waits for the stage of K tile `at`, reads its scale factors and starts its wgmma into `sums`.
    const auto issue = [&](const ring_slot<stages>& at, float(&sums)[64], float(&f)[2][2]) {
      const stage_scales sc = await_stage(bars, ring, at);
      promotion_factors(sc.b, block, per_channel, sc.a[r0], sc.a[r0 + 8], f);
      const std::uint64_t stage_off = static_cast<std::uint64_t>(at.stage) * stage_desc;
      const std::uint64_t a = da + stage_off, b = db + stage_off;
      wgmma_fence();
      wgmma_m64n128k32_e4m3_fresh(sums, a, b);
#pragma unroll
      for (int kk = 1; kk < k_steps; ++kk) {
        const auto step = static_cast<std::uint64_t>(kk * 32 >> 4);
        wgmma_m64n128k32_e4m3(sums, a + step, b + step, 1);
      }
      wgmma_commit();
    };
    // K tile `at`'s wgmma are done (Pending: groups issued after it, still running): its stage is
    // free (for the peer's multicast too), its sums readable.
    const auto retire = [&](auto pending, const ring_slot<stages>& at, float(&sums)[64]) {
      wgmma_wait<decltype(pending)::value>();
      wgmma_fence_operands(sums);
      mbarrier_arrive_where<Cluster == 2>(lane < release_lanes, &bars.empty[at.stage], peer);
    };
    const auto after = [](ring_slot<stages> at) {
      at.next();
      return at;
    };
    constexpr std::integral_constant<int, 0> none{};
    constexpr std::integral_constant<int, 1> one{};
    ring_slot<stages> a = slot;  // the K tile in flight in sums_a
    issue(a, sums_a, f_a);
    int j = 1;  // K tiles issued
    for (; j + 1 < n; j += 2) {
      const ring_slot<stages> b = after(a);
      issue(b, sums_b, f_b);
      retire(one, a, sums_a);
      promote(sums_a, f_a, acc, 0);
      a = after(b);
      issue(a, sums_a, f_a);
      retire(one, b, sums_b);
      promote(sums_b, f_b, acc, 0);
    }
    if (j < n) {
      const ring_slot<stages> b = after(a);
      issue(b, sums_b, f_b);
      retire(one, a, sums_a);
      promote(sums_a, f_a, acc, 0);
      retire(none, b, sums_b);
      promote(sums_b, f_b, acc, 0);
      slot = after(b);
    } else {
      retire(none, a, sums_a);
      promote(sums_a, f_a, acc, 0);
      slot = after(a);
    }
  }

  // Per-channel weights: the thread's sums of its blocks times the scale of each one's weight row
  // (columns past n, whose sums are zeros, keep them: nothing to read there). Register
  // 4j + 2h + q of a block is its B row 8j + 2(lane % 4) + q: for gate_up the gate (j < 8) or up
  // row of act column n0 + 64 b + that row % 64, otherwise output column n0 + 128 b + that row.
  __device__ __forceinline__ static void scale_columns(const moe_gemm_fp8_params<T>& p, const gpu::moe_m_tile& tile,
                                                       int n0, int first_block, int lane, float (&acc)[64 * blocks]) {
    const moe_gemm_params<T>& g = p.g;
    const float* chan = p.b_scale + static_cast<std::int64_t>(tile.expert) * g.b_rows_per_expert;
#pragma unroll
    for (int blk = 0; blk < blocks; ++blk)
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const int row = 8 * j + 2 * (lane % 4) + q;  // of the block's 128 B rows
          const int half = halves == 2 && j >= 8 ? 1 : 0;
          const int col = halves == 2 ? n0 + 64 * (first_block + blk) + row % 64 : n0 + 128 * (first_block + blk) + row;
          if (col >= g.n) continue;
          const float s = chan[b_row<Kind>(g, half, col)];
          acc[64 * blk + 4 * j + q] *= s;      // row r0
          acc[64 * blk + 4 * j + 2 + q] *= s;  // row r0 + 8
        }
  }

  // GEMM1 in K splits: the warpgroup's f32 sums over its K range (per-channel scales applied) of
  // rows row_base + r0 and r0 + 8, as split `split`'s part (moe_gemm_fp8_params::up_parts): the
  // gate and up sums of act column c at c and n + c (gate_up), or the sum of column c (up_only).
  // finish_up_parts_kernel does the rest of GEMM1's epilogue.
  __device__ __forceinline__ static void store_parts(const moe_gemm_fp8_params<T>& p, const gpu::moe_m_tile& tile,
                                                     int n0, int first_block, int row_base, int warp, int lane,
                                                     const float (&acc)[64 * blocks], int split) {
    const moe_gemm_params<T>& g = p.g;
    constexpr int cols = halves == 2 ? 64 : 128;  // act columns of one block
    const int rows = tile.row_end - tile.row_begin;
    const std::int64_t width = static_cast<std::int64_t>(halves) * g.n;
    float* part = p.up_parts + split * p.up_parts_stride;
#pragma unroll
    for (int blk = 0; blk < blocks; ++blk) {
      const int col_base = n0 + cols * (first_block + blk);
      if (col_base >= g.n) continue;  // up_only's block past n
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = row_base + 16 * warp + lane / 4 + 8 * h;
        if (r >= rows) continue;
        float* dst = part + (tile.row_begin + r) * width + col_base + 2 * (lane % 4);
        // Register 4j + 2h + q: B row 8j + 2(lane % 4) + q of the block (gate_up: j < 8 gate
        // rows, then their up rows), act column col_base + 8 (j % 8) + 2(lane % 4) + q.
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const std::int64_t at = halves == 2 && j >= 8 ? g.n + 8 * (j - 8) : 8 * j;
          *reinterpret_cast<float2*>(dst + at) =
              make_float2(acc[64 * blk + 4 * j + 2 * h], acc[64 * blk + 4 * j + 2 * h + 1]);
        }
      }
    }
  }

  // GEMM1's epilogue: the warpgroup's act values (act: a callable of activation_math.cuh) of
  // rows row_base + r0 and r0 + 8 over its blocks, quantized per 128 columns. gate_up: the CTA's
  // 128 columns are 64 of each block; with 128-row tiles one thread holds both, else each
  // warpgroup one and their amax meet in `exchange` (both warpgroups run every item, so the
  // named barrier sees all 256 threads). Alternating halves of amax_exchange per item keep a
  // warpgroup's next writes off the other's reads: writing half e again needs the barrier of the
  // item between, which the other passes only after its reads of half e. up_only: each block's
  // 128 columns are a group of their own.
  template <class Act>
  __device__ __forceinline__ static void store_act(const moe_gemm_fp8_params<T>& p, const Act& act,
                                                   const gpu::moe_m_tile& tile, int n0, int first_block,
                                                   int row_base, int warp, int lane, const float (&acc)[64 * blocks],
                                                   float (&exchange)[consumers][block_m], int group) {
    const moe_gemm_params<T>& g = p.g;
    constexpr int cols = halves == 2 ? 64 : 128;  // act columns of one block
    const int rows = tile.row_end - tile.row_begin;
    const int scales_per_row = g.n / fp8_group;
    // The router weight of the thread's row h (act(W (w x)) = act(w (W x)): it scales the f32
    // sums instead of x), and act of its column 8j + 2(lane % 4) + q of block blk.
    const auto row_weight = [&](int h) {
      const int r = row_base + 16 * warp + lane / 4 + 8 * h;
      return r < rows && g.input_weights != nullptr ? g.input_weights[g.row_to_slot[tile.row_begin + r]] : 1.0f;
    };
    const auto act_at = [&](int blk, int h, int j, int q, float weight) {
      const float s = acc[64 * blk + 4 * j + 2 * h + q] * weight;
      if constexpr (halves == 2) return act(s, acc[64 * blk + 4 * (j + 8) + 2 * h + q] * weight);
      else return act(s, 0.0f);
    };
    // The values stay in registers (gate_up: 2 x 16 per block), except up_only's beside 128
    // accumulators or the overlapped K loop's two sums (2 x 32 per block: they spilled), formed
    // twice: for the amax and the store.
    constexpr bool keep = halves == 2 || !lean_producer;
    constexpr int kept = keep ? cols / 4 : 1;
    float v[blocks][2][kept];
    float amax[blocks][2];
    const auto block_past_n = [&](int blk) { return halves == 1 && n0 + cols * (first_block + blk) >= g.n; };
    // Block blk's amax of the thread's two rows over the quad (a block past n: no scales to read there).
    const auto compute = [&](int blk) {
      if (block_past_n(blk)) return;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float weight = row_weight(h);
        amax[blk][h] = 0.0f;
#pragma unroll
        for (int j = 0; j < cols / 8; ++j)
#pragma unroll
          for (int q = 0; q < 2; ++q) {
            const float x = act_at(blk, h, j, q, weight);
            if constexpr (keep) v[blk][h][2 * j + q] = x;
            amax[blk][h] = fmaxf(amax[blk][h], fabsf(x));
          }
        amax[blk][h] = quad_max(amax[blk][h]);
      }
    };
    // Block blk's e4m3 act of the thread's rows, and (gate_up: block 0's threads) the scales.
    const auto write = [&](int blk) {
      if (block_past_n(blk)) return;
      const int col_base = n0 + cols * (first_block + blk);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = row_base + 16 * warp + lane / 4 + 8 * h;
        if (r >= rows) continue;
        const std::int64_t row = tile.row_begin + r;
        const float scale = fp8_group_scale(amax[blk][h]), inverse = fp8_group_inverse(scale);
        const float weight = keep ? 1.0f : row_weight(h);
        std::uint8_t* dst = p.act + row * g.n + col_base + 2 * (lane % 4);
#pragma unroll
        for (int j = 0; j < cols / 8; ++j) {
          float x[2];
#pragma unroll
          for (int q = 0; q < 2; ++q) {
            if constexpr (keep) x[q] = v[blk][h][2 * j + q];
            else x[q] = act_at(blk, h, j, q, weight);
          }
          *reinterpret_cast<std::uint16_t*>(dst + 8 * j) = fp8_pack2(x[0], x[1], inverse);
        }
        if (lane % 4 == 0 && (halves == 1 || first_block + blk == 0))
          p.act_scale[row * scales_per_row + (halves == 2 ? n0 : col_base) / fp8_group] = scale;
      }
    };
    if constexpr (halves == 1) {
      // Each block's columns are a group of their own: one block at a time.
#pragma unroll
      for (int blk = 0; blk < blocks; ++blk) {
        compute(blk);
        write(blk);
      }
    } else {
#pragma unroll
      for (int blk = 0; blk < blocks; ++blk) compute(blk);
      if constexpr (blocks == 2) {
#pragma unroll
        for (int h = 0; h < 2; ++h) amax[0][h] = amax[1][h] = fmaxf(amax[0][h], amax[1][h]);
      } else {
        if (lane % 4 == 0)
#pragma unroll
          for (int h = 0; h < 2; ++h) exchange[group][16 * warp + lane / 4 + 8 * h] = amax[0][h];
        asm volatile("bar.sync 1, %0;\n" ::"n"(128 * consumers) : "memory");
#pragma unroll
        for (int h = 0; h < 2; ++h) amax[0][h] = fmaxf(amax[0][h], exchange[group ^ 1][16 * warp + lane / 4 + 8 * h]);
      }
#pragma unroll
      for (int blk = 0; blk < blocks; ++blk) write(blk);
    }
  }
};

// Persistent CTAs over work items in decode_work_item's order, K split into g.k_splits ranges
// (GEMM2 into the output or f32 parts; GEMM1 into f32 parts, on 64-row CTAs alone). The body
// exists only in sm_90a code; elsewhere it traps (the launch code checks first).
template <class T, moe_gemm_kind Kind, int Cluster, int BlockM, gpu::fp8_k_loop Loop = gpu::fp8_k_loop::plain,
          bool HandOut = false, bool Staged = false>
__global__ void __launch_bounds__(wgmma_fp8_shape<BlockM>::threads, 1)
    moe_grouped_gemm_wgmma_fp8_kernel(const moe_gemm_fp8_params<T> p, const __grid_constant__ CUtensorMap a_map,
                                      const __grid_constant__ CUtensorMap b_map) {
#if MOERUNNER_WGMMA_COMPILED
  using tile_t = moe_gemm_wgmma_fp8<T, Kind, Cluster, BlockM, Loop, HandOut, Staged>;
  __shared__ typename tile_t::barriers bars;
  __shared__ work_item_ring item_ring;  // handed-out work items only
  __shared__ float amax_exchange[2][tile_t::consumers][tile_t::block_m];
  extern __shared__ unsigned char wgmma_fp8_smem_raw[];
  const std::uint32_t raw = smem_address(wgmma_fp8_smem_raw);
  unsigned char* ring = wgmma_fp8_smem_raw + (((raw + 1023) & ~1023u) - raw);
  if (threadIdx.x == 0) {
    for (int s = 0; s < tile_t::stages; ++s) {
      cuda::ptx::mbarrier_init(&bars.full[s], tile_t::load_threads + 1);
      // Every consumer warp of the cluster releases every CTA's stage (see the consumer).
      cuda::ptx::mbarrier_init(&bars.empty[s], tile_t::consumer_warps * tile_t::release_lanes * Cluster);
    }
    if constexpr (HandOut) init_work_item_ring<Cluster>(item_ring, tile_t::item_readers);
    if constexpr (Staged) {
      cuda::ptx::mbarrier_init(&bars.staged_full, tile_t::consumer_warps * tile_t::release_lanes);
      cuda::ptx::mbarrier_init(&bars.staged_empty, tile_t::store_warps * tile_t::release_lanes);
    }
    cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(&b_map) : "memory");
    if (p.a_tma) asm volatile("prefetch.tensormap [%0];\n" ::"l"(&a_map) : "memory");
  }
  // The other CTAs of a cluster arrive on these barriers and multicast into this ring: all must be set up.
  if constexpr (Cluster > 1) cluster_sync();
  else __syncthreads();
  const int early = threadIdx.x == 0 ? tile_t::load_first_weights(p, &b_map, ring, bars) : 0;
  wait_for_prior_grids();
  allow_dependent_grids();
  if (threadIdx.x < tile_t::producer_threads) {
    setmaxnreg_dec<tile_t::producer_regs>();
    tile_t::producer(p, &a_map, &b_map, ring, bars, &item_ring, early);
  } else {
    setmaxnreg_inc<tile_t::consumer_regs>();
    tile_t::consumer(p, ring, bars, amax_exchange, &item_ring);
  }
  // The other CTAs' last releases and multicasts land in this CTA's shared memory: stay until all are done.
  if constexpr (Cluster > 1) cluster_sync();
#else
  (void)p, (void)a_map, (void)b_map;
  __trap();
#endif
}

}  // namespace moerunner::kernels
