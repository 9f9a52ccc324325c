// Device code of the fused backend's grouped GEMMs (mma.sync m16n8k16, bf16/f16 in, f32
// accumulate, ldmatrix, cp.async multi-stage pipeline) over the M-tile schedule that
// kernel_tile_schedule.cuh builds from the routing plan.
//
//   moe_grouped_gemm_kernel<T, tuning, kind>: persistent CTAs stride over (M tile, N tile)
//     gate_up / up_only (GEMM1): A row r = x[row_to_slot[r] / k], epilogue = (+ b13) activation -> act [R, I]
//     down (GEMM2): A = act rows [R, I] in row order, epilogue (+ b2) per down_store: rows [R, H],
//       the output's [token, slot] rows, or atomic adds into the output's token rows
// The parameters, work order and epilogue helpers here are shared with the wgmma kernels.
//
// Written by hand rather than with CUTLASS because the A gather, the gate/up pairing inside
// one CTA tile and the device-side tile schedule all live inside the mainloop and epilogue.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/kernels/kernel_grouped_gemm.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstdint>
#include <cstring>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "moerunner/core/config.hpp"
#include "moerunner/core/types.hpp"
#include "moerunner/gpu/expert_bands.hpp"
#include "moerunner/gpu/grouped_gemm_tuning.hpp"
#include "moerunner/kernels/activation_math.cuh"
#include "moerunner/kernels/kernel_tile_schedule.cuh"
#include "moerunner/kernels/vector_io.cuh"

namespace moerunner::kernels {

// ---------------------------------------------------------------------------------------------
// PTX wrappers

__device__ __forceinline__ std::uint32_t smem_address(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global->shared copy; `valid` false writes zeros and reads nothing (src-size 0).
__device__ __forceinline__ void cp_async_16(std::uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// 4-byte global->shared copy (through L1: cp.async.cg takes 16 bytes only); `valid` false
// writes zeros and reads nothing.
__device__ __forceinline__ void cp_async_4(std::uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int Pending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Two 8x8 matrices: lanes 0-15 give the row addresses (the others are not read).
__device__ __forceinline__ void ldmatrix_x2(std::uint32_t (&r)[2], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

// The mma has no side effects, so it is not volatile: the compiler may interleave it with
// the (volatile, smem-reading) ldmatrix of the next step.
template <class T>
struct mma_16816;

template <>
struct mma_16816<__nv_bfloat16> {
  __device__ __forceinline__ static void run(float (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2]) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  // Two floats rounded to bf16, `lo` in the low half (the lower address once stored).
  __device__ __forceinline__ static std::uint32_t pack2(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    std::uint32_t r;
    memcpy(&r, &v, sizeof(r));
    return r;
  }
};

template <>
struct mma_16816<__half> {
  __device__ __forceinline__ static void run(float (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2]) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  __device__ __forceinline__ static std::uint32_t pack2(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);
    std::uint32_t r;
    memcpy(&r, &v, sizeof(r));
    return r;
  }
};

// ---------------------------------------------------------------------------------------------
// Grouped GEMM

enum class moe_gemm_kind : std::uint8_t {
  gate_up,  // GEMM1, gated: B = w13[e] ([2I, H]); C tile pairs gate column i with up column i (b_row)
  up_only,  // GEMM1, not gated: B = w13[e] ([I, H])
  down,     // GEMM2: B = w2[e] ([H, I]); A = act rows in row order
};

// Where GEMM2 puts its rows: chosen by the run plan (gpu/grouped_gemm_tuning.hpp).
using down_store = gpu::down_store;

template <class T>
struct moe_gemm_params {
  const T* a;                           // GEMM1: x [M, K=H] (a_gathered: its rows in plan order, [R, K]); GEMM2: act [R, K=I]
  const std::int32_t* row_to_slot;      // row r holds slot row_to_slot[r] (token slot / top_k)
  int top_k;
  const T* b;                           // [E, b_rows_per_expert, K] row-major
  std::int64_t b_rows_per_expert;
  int n;                                // output columns: I for GEMM1, H for GEMM2
  int k;                                // reduction length, a multiple of 8
  T* c;                                 // GEMM1: act [R, n]; GEMM2: see `store`
  const gpu::moe_m_tile* tiles;         // from the tile schedule
  const std::int32_t* tile_count;
  int n_tiles;                          // ceil(n / output columns per CTA)
  int k_splits = 1;                     // K ranges per tile (GEMM2 with accumulate or partials only)
  int raster_band = 1;                  // M tiles that walk the N tiles together (decode_work_item)
  bool expert_bands = false;            // the bands are the tiles' band words (a schedule written with them)
  const float* input_weights;           // GEMM1 with apply_router_weight_on_input: topk_weights [M*k]; else null
  activation act;
  bool interleaved = false;             // gate_up: B row 2j is gate j, 2j + 1 up j (else rows j and n + j)
  // Per-expert bias [E, b_rows_per_expert] indexed as B's rows (f32, or T unless bias_f32), added
  // to the f32 sums in the epilogue (GEMM2: by exactly one K range); null: none.
  const void* bias = nullptr;
  bool bias_f32 = false;
  // GEMM2 only.
  down_store store = down_store::rows;
  const float* out_weights = nullptr;  // slots / accumulate: topk_weights [M*k], or null when applied on the input
  float out_scale = 1.0f;              // slots / accumulate: routed_scaling_factor, or 1
  float* partials = nullptr;           // partials: f32 [k_splits, R, n]
  std::int64_t split_stride = 0;       // partials: R * n
  // GEMM1 only: 16-byte vectors at `clear` that the grid zeroes before it ends (the output GEMM2
  // accumulates into; GEMM2 starts after GEMM1 has finished).
  uint4* clear = nullptr;
  std::int64_t clear_vectors = 0;
  // Stream GEMMs only: when set, each CTA builds the schedule and the row order itself from
  // these topk_ids (kernel_local_plan.cuh), and tiles, tile_count and row_to_slot are not read.
  const std::int32_t* local_ids = nullptr;  // [local_slots]
  int local_slots = 0;
  int local_experts = 0;
  std::int32_t* local_error = nullptr;  // GEMM1: the plan's error flag, written by CTA 0
  moe_status* local_status = nullptr;   // GEMM1, or null: the caller's status, added to by CTA 0
  std::int32_t* local_slot_to_row = nullptr;  // GEMM1, or null: the plan's slot_to_row, written by CTA 0
  // Stream GEMM1 only: the GEMM2 whose first weights its CTAs ask L2 for (next.b null: none).
  struct next_gemm {
    const T* b = nullptr;  // GEMM2's weights, [E, b_rows_per_expert, k]
    std::int64_t b_rows_per_expert = 0;
    int n = 0, k = 0, n_tiles = 0;
    int grid = 0;            // GEMM2's CTAs: its first `grid` items are its first wave
    std::int64_t bytes = 0;  // what may be asked for in all
    bool at_end = false;     // asked for once a CTA's own copies are all issued (else after its first)
  } next;
  // Stream GEMMs: weight copies marked evict-first in L2 (streamed once, they should not push
  // out the act rows, the output or lines asked for through `next`), and fetched from HBM 256
  // bytes at a time (the warp's next K tile of each row comes with its current one).
  bool weights_evict_first = false;
  bool weights_fetch_256 = false;
  // wgmma GEMMs: a holds its rows in plan order (row r at r * k: GEMM1's x gathered by a kernel
  // before, GEMM2's act as GEMM1 wrote it), which the producer loads by TMA boxes (the kernel's
  // a_map over them) instead of gathering by cp.async. The fp8 GEMMs read a_rows for GEMM2's.
  bool a_gathered = false;
  std::int64_t a_rows = 0;  // rows of a in plan order (M * top_k): a_gathered, and the fp8 GEMM2's TMA
  // Stream GEMM2 storing rows: the CTA that stores the last item of an N tile (one count per N
  // tile in `strips`, zeroed by GEMM1 through `clear`) sums every token's rows over the tile's
  // columns in slot order into `out`, as combine_rows would (kernel_combine.cuh): no combine
  // kernel follows. strips null: one does.
  struct combine_in_gemm {
    std::int32_t* strips = nullptr;
    T* out = nullptr;                         // [tokens, n]
    const std::int32_t* slot_to_row = nullptr;  // the plan's, written before GEMM2 starts
    const float* weights = nullptr;           // topk_weights [tokens * top_k], or null
    float scale = 1.0f;
    int tokens = 0;
  } combine;
  // wgmma only: the work items are handed out at run time from this counter (0 before the
  // launch, and again after it: sm90_work_items.cuh) instead of in fixed turns; null: fixed.
  std::int32_t* item_counter = nullptr;
};

// The row of expert's B holding output column `col`: for gate_up its gate (half 0) or up (half 1)
// row in the layout p.interleaved names; otherwise row `col`. Biases are indexed alike.
template <moe_gemm_kind Kind, class T>
__device__ __forceinline__ std::int64_t b_row(const moe_gemm_params<T>& p, int half, int col) {
  if constexpr (Kind == moe_gemm_kind::gate_up)
    return p.interleaved ? 2 * static_cast<std::int64_t>(col) + half : static_cast<std::int64_t>(half) * p.n + col;
  else return col;
}

// The bias of B row `row` of expert `expert` as f32 (p.bias set).
template <class T>
__device__ __forceinline__ float bias_at(const moe_gemm_params<T>& p, int expert, std::int64_t row) {
  const std::int64_t i = static_cast<std::int64_t>(expert) * p.b_rows_per_expert + row;
  return p.bias_f32 ? static_cast<const float*>(p.bias)[i] : to_f32(static_cast<const T*>(p.bias)[i]);
}

// One work item of a persistent grid: an M tile, an N tile and a K range.
struct moe_work_item {
  int m_tile;
  int n_tile;
  int split;
};

// The tiles decode_work_item reads band words from: the schedule's where it was written with
// expert bands, else none (fixed bands).
template <class T>
__device__ __forceinline__ const gpu::moe_m_tile* band_tiles_of(const moe_gemm_params<T>& p) {
  return p.expert_bands ? p.tiles : nullptr;
}

// Work item w -> tile coordinates. K splits vary fastest, then the M tiles of a band of
// `band` of them, then N tiles: the CTAs that run together cover one band times a few N tiles,
// so each weight tile comes from HBM once per band and then from L2. (M tiles outer, N
// fastest, re-streamed an expert's weights from HBM once per M tile.) With band_tiles (the
// schedule's tiles, written with expert bands) the bands are the tiles' own: one expert's
// tiles each (gpu/expert_bands.hpp).
__device__ __forceinline__ moe_work_item decode_work_item(std::int64_t w, int tile_count, int n_tiles, int k_splits,
                                                          int band, const gpu::moe_m_tile* band_tiles = nullptr) {
  moe_work_item r;
  r.split = static_cast<int>(w % k_splits);
  const std::int64_t t = w / k_splits;
  if (band_tiles != nullptr) {
    gpu::expert_band_coords(t, n_tiles, band_tiles[t / n_tiles].band, r.m_tile, r.n_tile);
    return r;
  }
  const std::int64_t per_band = static_cast<std::int64_t>(band) * n_tiles;
  const int first = static_cast<int>(t / per_band) * band;
  const int within = static_cast<int>(t % per_band);
  const int width = tile_count - first < band ? tile_count - first : band;
  r.n_tile = within / width;
  r.m_tile = first + within % width;
  return r;
}

// Where tile row r's A row comes from (-1 past the tile's rows): GEMM1 gathers its token's row
// of x (row_to_slot / top_k), GEMM2 reads the act rows in order.
template <moe_gemm_kind Kind>
__device__ __forceinline__ int a_source_row(const gpu::moe_m_tile& tile, int r, const std::int32_t* row_to_slot,
                                            int top_k) {
  if (r >= tile.row_end - tile.row_begin) return -1;
  if constexpr (Kind == moe_gemm_kind::down) return tile.row_begin + r;
  else return row_to_slot[tile.row_begin + r] / top_k;
}

// K tiles [begin, end) of split `split` out of `splits`: as even as integer division allows.
__device__ __forceinline__ void split_k_range(int k_tiles, int split, int splits, int& begin, int& end) {
  begin = static_cast<int>(static_cast<std::int64_t>(k_tiles) * split / splits);
  end = static_cast<int>(static_cast<std::int64_t>(k_tiles) * (split + 1) / splits);
}

// Adds eight 16-bit values, packed in pairs as mma_16816<T>::pack2 packs them, to out[0..8)
// (16-byte aligned): one vector reduction on sm_90 (a quarter of the atomics' L2 requests),
// four packed atomics before it. The same additions either way.
template <class T>
__device__ __forceinline__ void atomic_add8(T* out, const std::uint32_t (&packed)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm volatile("red.global.add.noftz.v4.bf16x2 [%0], {%1, %2, %3, %4};\n" ::"l"(out), "r"(packed[0]),
                 "r"(packed[1]), "r"(packed[2]), "r"(packed[3])
                 : "memory");
  else
    asm volatile("red.global.add.noftz.v4.f16x2 [%0], {%1, %2, %3, %4};\n" ::"l"(out), "r"(packed[0]),
                 "r"(packed[1]), "r"(packed[2]), "r"(packed[3])
                 : "memory");
#else
  using pair_t = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, __nv_bfloat162, __half2>;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    pair_t v;
    memcpy(&v, &packed[j], sizeof(v));
    atomicAdd(reinterpret_cast<pair_t*>(out) + j, v);
  }
#endif
}

// Zeroes the GEMM1 launch's `clear` range, spread over every thread of the grid that calls it.
template <class T>
__device__ __forceinline__ void clear_output(const moe_gemm_params<T>& p, int thread, int threads_per_cta) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * threads_per_cta;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * threads_per_cta + thread; i < p.clear_vectors;
       i += stride)
    p.clear[i] = make_uint4(0, 0, 0, 0);
}

// GEMM2's destination and factor for row `row`: the rows buffer as is, or the row's slot (or
// its token) in the output times scale * router weight.
template <class T>
struct down_target {
  T* dst;
  float factor;

  __device__ __forceinline__ static down_target at(const moe_gemm_params<T>& p, int row) {
    if (p.store == down_store::rows) return {p.c + static_cast<std::int64_t>(row) * p.n, 1.0f};
    const std::int64_t slot = p.row_to_slot[row];
    const float w = p.out_weights != nullptr ? p.out_weights[slot] : 1.0f;
    const std::int64_t out_row = p.store == down_store::slots ? slot : slot / p.top_k;
    return {p.c + out_row * p.n, p.out_scale * w};
  }
};

// Eight consecutive floats from 16-byte-aligned smem, as two vector loads.
__device__ __forceinline__ void load8(float (&v)[8], const float* src) {
  const float4 a = *reinterpret_cast<const float4*>(src);
  const float4 b = *reinterpret_cast<const float4*>(src + 4);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// The epilogue of eight outputs [col, col + 8) of row `row` of expert `expert`'s tile (n is a
// multiple of 8, so they are all in or all out), from their f32 sums `v` (and, gated GEMM1, the
// up sums `u`; ignored otherwise) over all of K: GEMM1 adds b13 and applies the activation and
// writes act; GEMM2 adds b2, scales by its target's factor and stores, or adds into its token's
// output row. `bias` false: GEMM2's bias is another K range's to add (a K split's others).
template <class T, moe_gemm_kind Kind>
__device__ __forceinline__ void store_outputs8(const moe_gemm_params<T>& p, int expert, int row, int col,
                                               float (&v)[8], float (&u)[8], bool bias = true) {
  T* dst;
  if constexpr (Kind == moe_gemm_kind::down) {
    const down_target<T> t = down_target<T>::at(p, row);
    dst = t.dst + col;
    if (bias && p.bias != nullptr)
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] += bias_at(p, expert, col + j);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] *= t.factor;
  } else {
    dst = p.c + static_cast<std::int64_t>(row) * p.n + col;
    // act(W (w x) + b) = act(w (W x) + b): the router weight scales the f32 sums instead of x.
    const float scale = p.input_weights != nullptr ? p.input_weights[p.row_to_slot[row]] : 1.0f;
    constexpr bool gated = Kind == moe_gemm_kind::gate_up;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      v[j] *= scale;
      if constexpr (gated) u[j] *= scale;
    }
    if (p.bias != nullptr)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        v[j] += bias_at(p, expert, b_row<Kind>(p, 0, col + j));
        if constexpr (gated) u[j] += bias_at(p, expert, b_row<Kind>(p, 1, col + j));
      }
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = apply_activation(p.act, gated, v[j], gated ? u[j] : 0.0f);
  }
  const std::uint32_t packed[4] = {mma_16816<T>::pack2(v[0], v[1]), mma_16816<T>::pack2(v[2], v[3]),
                                   mma_16816<T>::pack2(v[4], v[5]), mma_16816<T>::pack2(v[6], v[7])};
  if (Kind == moe_gemm_kind::down && p.store == down_store::accumulate) atomic_add8(dst, packed);
  else *reinterpret_cast<uint4*>(dst) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

// Where the 16-byte chunk `chunk` of smem tile row `row` lives: XOR-swizzled so that the
// 8 rows one ldmatrix phase reads (and cp.async writes) fall in 8 different bank groups.
template <int BlockK>
__device__ __forceinline__ int swizzled_chunk(int row, int chunk) {
  if constexpr (BlockK == 64) return chunk ^ (row & 7);  // 128-byte rows: 8 chunks
  else return chunk ^ ((row >> 1) & 3);                  // 64-byte rows: two rows per 128-byte line
}

template <class T, class Policy, moe_gemm_kind Kind>
struct moe_gemm_tile {
  static constexpr gpu::grouped_gemm_tuning tuning = Policy::tuning;
  static constexpr int bm = tuning.block_m, bn = tuning.block_n, bk = tuning.block_k, stages = tuning.stages;
  static constexpr int threads = tuning.threads();
  static constexpr int wtm = tuning.warp_tile_m(), wtn = tuning.warp_tile_n();
  static constexpr int mi_count = wtm / 16;   // mma tiles along M per warp
  static constexpr int ni_count = wtn / 8;    // mma tiles along N per warp (B rows)
  static constexpr int ki_count = bk / 16;    // mma steps per K tile
  // Gated: the B tile's first half holds gate rows, the second half the up rows of the same columns.
  static constexpr int halves = Kind == moe_gemm_kind::gate_up ? 2 : 1;
  static constexpr int ni_half = ni_count / halves;
  static constexpr int out_cols = bn / halves;  // output columns per CTA
  static constexpr int chunks_per_row = bk / 8;
  static constexpr int rows_per_pass = threads / chunks_per_row;
  static constexpr int a_passes = bm / rows_per_pass;
  static constexpr int b_passes = bn / rows_per_pass;
  static constexpr int stage_elems = (bm + bn) * bk;

  static_assert(gpu::check_grouped_gemm_tuning(tuning));
  static_assert(ni_half % 2 == 0, "ldmatrix.x4 loads two n8 tiles of one half at a time");
  static_assert(sizeof(T) == 2, "the tile layout is written for 16-bit elements");

  // Smem row of the B tile that holds mma tile `ni` of warp column `warp_n`.
  __device__ __forceinline__ static int b_tile_row(int warp_n, int ni) {
    return (ni / ni_half) * (bn / halves) + warp_n * (wtn / halves) + (ni % ni_half) * 8;
  }

  // Issues the cp.async copies of K tile `kt` into stage buffer `stage`.
  __device__ __forceinline__ static void load_stage(T* smem, int stage, int kt, const moe_gemm_params<T>& p,
                                                    const T* b_expert, const int (&a_src_row)[a_passes],
                                                    const int (&b_src_row)[b_passes], int ld_row, int ld_chunk) {
    T* sa = smem + stage * stage_elems;
    T* sb = sa + bm * bk;
    const int kcol = kt * bk + ld_chunk * 8;
    const bool k_ok = kcol < p.k;  // k is a multiple of 8, so a chunk is wholly in or out
    const int st_chunk = swizzled_chunk<bk>(ld_row, ld_chunk);  // rows_per_pass is a multiple of 8
#pragma unroll
    for (int i = 0; i < a_passes; ++i) {
      const int r = ld_row + i * rows_per_pass;
      const bool ok = k_ok && a_src_row[i] >= 0;
      const T* src = ok ? p.a + static_cast<std::int64_t>(a_src_row[i]) * p.k + kcol : p.a;
      cp_async_16(smem_address(sa + r * bk + st_chunk * 8), src, ok);
    }
#pragma unroll
    for (int i = 0; i < b_passes; ++i) {
      const int r = ld_row + i * rows_per_pass;
      const bool ok = k_ok && b_src_row[i] >= 0;
      const T* src = ok ? b_expert + static_cast<std::int64_t>(b_src_row[i]) * p.k + kcol : p.b;
      cp_async_16(smem_address(sb + r * bk + st_chunk * 8), src, ok);
    }
  }

  // One K tile of mma: fragments straight from the swizzled smem by ldmatrix.
  __device__ __forceinline__ static void compute_stage(const T* smem, int stage, int warp_m, int warp_n, int lane,
                                                       float (&acc)[mi_count][ni_count][4]) {
    const T* sa = smem + stage * stage_elems;
    const T* sb = sa + bm * bk;
#pragma unroll
    for (int kk = 0; kk < ki_count; ++kk) {
      // A 16x16: lanes 0-15 address rows 0-15 at k 0-7, lanes 16-31 the same rows at k 8-15,
      // giving registers a0 (rows 0-7, k 0-7), a1 (rows 8-15), a2 (k 8-15), a3 as mma expects.
      std::uint32_t af[mi_count][4];
#pragma unroll
      for (int mi = 0; mi < mi_count; ++mi) {
        const int r = warp_m * wtm + mi * 16 + (lane & 15);
        const int c = kk * 2 + (lane >> 4);
        ldmatrix_x4(af[mi], smem_address(sa + r * bk + swizzled_chunk<bk>(r, c) * 8));
      }
      // B stored [n][k]: matrix 0 = (n 0-7, k 0-7) -> b0 of tile ni, 1 = (n 0-7, k 8-15) -> b1,
      // 2 and 3 the same for n 8-15 -> tile ni + 1.
      std::uint32_t bf[ni_count][2];
#pragma unroll
      for (int ni = 0; ni < ni_count; ni += 2) {
        const int r = b_tile_row(warp_n, ni) + (lane & 7) + ((lane >> 4) << 3);
        const int c = kk * 2 + ((lane >> 3) & 1);
        std::uint32_t t[4];
        ldmatrix_x4(t, smem_address(sb + r * bk + swizzled_chunk<bk>(r, c) * 8));
        bf[ni][0] = t[0];
        bf[ni][1] = t[1];
        bf[ni + 1][0] = t[2];
        bf[ni + 1][1] = t[3];
      }
#pragma unroll
      for (int mi = 0; mi < mi_count; ++mi)
#pragma unroll
        for (int ni = 0; ni < ni_count; ++ni) mma_16816<T>::run(acc[mi][ni], af[mi], bf[ni]);
    }
  }

  __device__ __forceinline__ static void run(T* smem, const moe_gemm_params<T>& p, const gpu::moe_m_tile& tile,
                                             int n_tile) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int warp_m = warp % tuning.warps_m, warp_n = warp / tuning.warps_m;
    const int rows = tile.row_end - tile.row_begin;  // 1..bm
    const int n0 = n_tile * out_cols;
    const T* b_expert = p.b + static_cast<std::int64_t>(tile.expert) * p.b_rows_per_expert * p.k;

    // Each thread copies the same chunk column of a fixed set of rows in every K tile;
    // -1 marks a row past the tile (zero-filled, never stored).
    const int ld_row = tid / chunks_per_row, ld_chunk = tid % chunks_per_row;
    int a_src_row[a_passes];
#pragma unroll
    for (int i = 0; i < a_passes; ++i) {
      const int r = ld_row + i * rows_per_pass;
      if (r >= rows) {
        a_src_row[i] = -1;
      } else if constexpr (Kind == moe_gemm_kind::down) {
        a_src_row[i] = tile.row_begin + r;
      } else {
        a_src_row[i] = p.row_to_slot[tile.row_begin + r] / p.top_k;
      }
    }
    int b_src_row[b_passes];  // within the expert: below 2^31 (n is an int)
#pragma unroll
    for (int i = 0; i < b_passes; ++i) {
      const int r = ld_row + i * rows_per_pass;
      const int half = r / (bn / halves);
      const int col = n0 + r % (bn / halves);
      b_src_row[i] = col < p.n ? static_cast<int>(b_row<Kind>(p, half, col)) : -1;
    }

    float acc[mi_count][ni_count][4];
#pragma unroll
    for (int mi = 0; mi < mi_count; ++mi)
#pragma unroll
      for (int ni = 0; ni < ni_count; ++ni)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[mi][ni][q] = 0.0f;

    // Multistage pipeline: stages-1 K tiles in flight. Before computing K tile kt, at most
    // stages-2 newer groups may still be pending; the barrier then also guarantees that every
    // warp has finished computing on the buffer the next prefetch overwrites (tile kt-1's).
    // Groups are committed even when empty so the count stays exact at the tail.
    const int k_tiles = (p.k + bk - 1) / bk;
#pragma unroll
    for (int s = 0; s < stages - 1; ++s) {
      if (s < k_tiles) load_stage(smem, s, s, p, b_expert, a_src_row, b_src_row, ld_row, ld_chunk);
      cp_async_commit();
    }
    for (int kt = 0; kt < k_tiles; ++kt) {
      cp_async_wait<stages - 2>();
      __syncthreads();
      const int next = kt + stages - 1;
      if (next < k_tiles) load_stage(smem, next % stages, next, p, b_expert, a_src_row, b_src_row, ld_row, ld_chunk);
      cp_async_commit();
      compute_stage(smem, kt % stages, warp_m, warp_n, lane, acc);
    }
    // The epilogue reuses the pipeline's smem, which other warps may still be reading.
    cp_async_wait<0>();
    __syncthreads();
    epilogue(smem, p, tile, n0, warp_m, warp_n, lane, acc);
  }

  // Accumulators -> f32 C tile in smem -> activation (GEMM1) -> 16-byte stores of 8 outputs.
  // Going through smem keeps one copy of the activation code in a rolled loop (unrolled over
  // every fragment it would push the accumulators to local memory) and makes stores coalesced.
  __device__ __forceinline__ static void epilogue(T* smem, const moe_gemm_params<T>& p, const gpu::moe_m_tile& tile,
                                                  int n0, int warp_m, int warp_n, int lane,
                                                  const float (&acc)[mi_count][ni_count][4]) {
    constexpr int cs_stride = bn + 8;  // floats; +8 spreads the 8 rows of a fragment over the banks
    float* cs = reinterpret_cast<float*>(smem);
    // Accumulator q of mma tile (mi, ni) sits at row g (+8 for q >= 2) and columns 2t, 2t+1
    // (q even, odd) with g = lane / 4, t = lane % 4; columns are kept in B-tile order, so for
    // gate_up the gate value of output column c is at c and its up value at bn/2 + c.
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mi = 0; mi < mi_count; ++mi)
#pragma unroll
      for (int ni = 0; ni < ni_count; ++ni)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = warp_m * wtm + mi * 16 + g + h * 8;
          const int c = b_tile_row(warp_n, ni) + 2 * t;
          *reinterpret_cast<float2*>(cs + r * cs_stride + c) = make_float2(acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]);
        }
    __syncthreads();

    constexpr int vecs_per_row = out_cols / 8;
    const int rows = tile.row_end - tile.row_begin;
    for (int item = threadIdx.x; item < bm * vecs_per_row; item += threads) {
      const int r = item / vecs_per_row;
      const int c = (item % vecs_per_row) * 8;
      const int col = n0 + c;
      if (r >= rows || col >= p.n) continue;  // n is a multiple of 8: a vector is wholly in or out
      const float* src = cs + r * cs_stride + c;
      float v[8], u[8];
      load8(v, src);
      if constexpr (Kind == moe_gemm_kind::gate_up) load8(u, src + out_cols);
      store_outputs8<T, Kind>(p, tile.expert, tile.row_begin + r, col, v, u);
    }
    // The next tile's prologue overwrites the C tile.
    __syncthreads();
  }
};

#if defined(__CUDA_ARCH__)
inline constexpr int compiled_sm = __CUDA_ARCH__ / 10;
#else
inline constexpr int compiled_sm = 0;
#endif

// Persistent CTAs over work items in decode_work_item's order (bands of M tiles, N tiles
// across a band); this kernel never splits K. The number of M tiles is only known on the
// device; the grid never depends on it.
template <class T, class Policy, moe_gemm_kind Kind>
__global__ void __launch_bounds__(Policy::tuning.threads()) moe_grouped_gemm_kernel(const moe_gemm_params<T> p) {
  // A tuning is only compiled for the architectures it was written for; the launch code
  // never starts it elsewhere, and if it did the trap would say so instead of writing nothing.
  if constexpr (compiled_sm < Policy::tuning.min_arch) {
    __trap();
  } else {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* smem = reinterpret_cast<T*>(smem_raw);
    if constexpr (Kind != moe_gemm_kind::down)
      clear_output(p, static_cast<int>(threadIdx.x), moe_gemm_tile<T, Policy, Kind>::threads);
    const int tiles = *p.tile_count;
    const std::int64_t work = static_cast<std::int64_t>(tiles) * p.n_tiles;
    for (std::int64_t w = blockIdx.x; w < work; w += gridDim.x) {
      const moe_work_item item = decode_work_item(w, tiles, p.n_tiles, 1, p.raster_band);
      const gpu::moe_m_tile tile = p.tiles[item.m_tile];
      moe_gemm_tile<T, Policy, Kind>::run(smem, p, tile, item.n_tile);
    }
  }
}

}  // namespace moerunner::kernels
