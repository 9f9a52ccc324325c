// Device code that builds a routing_plan (gpu/routing_plan.hpp) from topk_ids: per-expert
// counts and offsets, rows sorted by (expert, slot), and the inverse map.
//
// Ranking: each warp owns a contiguous run of slots and walks it 32 slots at a time. The
// lanes holding the same expert are found with one ballot per bit of the id (match.any
// serializes on the number of distinct values, and a chunk of slots holds many), so one
// leader per expert bumps the warp's running count in shared memory. That gives every slot
// its stable rank among earlier slots of its expert in one pass, where a block radix sort on
// 11-bit keys would take three. The prefixes over warps and tiles, and the offsets, are
// scans (CUB for the block and warp scans); nothing depends on scheduling, so the plan is
// deterministic.
//
// On request the kernel that computes the expert offsets (the single-tile kernel, or the scan
// kernel of the tiled path) also writes the grouped GEMMs' M-tile schedule
// (kernel_tile_schedule.cuh), which then costs no launch of its own.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/kernels/kernel_permute.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstdint>

#include <cub/block/block_scan.cuh>
#include <cub/warp/warp_scan.cuh>

#include "moerunner/gpu/grouped_gemm_tuning.hpp"
#include "moerunner/gpu/routing_plan.hpp"
#include "moerunner/kernels/bad_slot_report.cuh"
#include "moerunner/kernels/kernel_tile_schedule.cuh"
#include "moerunner/kernels/pdl.cuh"

namespace moerunner::kernels {

inline constexpr int plan_threads = 256;
inline constexpr int plan_warps = plan_threads / 32;
inline constexpr int plan_experts_per_thread = gpu::plan_max_experts / plan_threads;
inline constexpr int plan_tile_items = static_cast<int>(gpu::plan_tile_slots / plan_threads);
inline constexpr int plan_scan_threads = 1024;
inline constexpr int plan_scan_batch = 4;  // experts and 32-tile chunks each warp of the scan loads at once
static_assert(gpu::plan_max_experts % plan_threads == 0, "experts must split evenly over the block scan");
static_assert(plan_tile_items * plan_threads == gpu::plan_tile_slots, "a tile is a whole number of slots per thread");
static_assert(gpu::plan_single_tile_slots == 16 * plan_threads, "the single-tile kernel's largest variant has 16 items");
static_assert(gpu::plan_max_experts <= plan_scan_threads, "the offsets scan gives each expert one thread");

struct plan_args {
  const std::int32_t* ids = nullptr;  // [num_slots]
  std::int64_t num_slots = 0;
  int num_experts = 0;
  int key_bits = 0;                      // bits of (id + 1) for ids in [-1, E]
  int num_tiles = 0;                     // tiled path only
  std::int32_t* offsets = nullptr;       // [E + 1]
  std::int32_t* row_to_slot = nullptr;   // [num_slots]
  std::int32_t* slot_to_row = nullptr;   // [num_slots]
  std::int32_t* error_flag = nullptr;    // [1]
  moe_status* status = nullptr;          // the caller's, or null: bad ids are added to it
  std::int32_t* tile_counts = nullptr;   // [E, num_tiles]: counts, then exclusive prefixes over tiles
  std::int32_t* tile_errors = nullptr;   // [num_tiles]
  // The M-tile schedule, written too when `tiles` is set (not to be confused with the tiles of
  // slots above): as moe_tile_schedule_kernel writes it from the offsets.
  gpu::moe_m_tile* tiles = nullptr;      // [tile_capacity]
  std::int32_t* tile_count = nullptr;    // the schedule head: tiles used, then the item counters
  int block_m = 0;
  int tile_capacity = 0;
  int expert_band = 0;  // > 0: the tiles carry band words for expert bands of at most this many tiles
};

namespace permute_detail {

inline constexpr unsigned full_mask = 0xffffffffu;

// The slot's expert, or -1 for a filtered slot, a slot past the end, or a bad id (reported).
__device__ __forceinline__ int load_key(const plan_args& a, std::int64_t slot, bool& bad) {
  if (slot >= a.num_slots) return -1;
  const int id = a.ids[slot];
  if (id >= 0 && id < a.num_experts) return id;
  bad |= id != -1;
  return -1;
}

// The lanes whose key equals this lane's (keys in [-1, 2^bits - 1)), one ballot per bit.
__device__ __forceinline__ unsigned peer_lanes(int key, int bits) {
  const unsigned v = static_cast<unsigned>(key + 1);
  unsigned peers = full_mask;
  for (int b = 0; b < bits; ++b) {
    const bool set = ((v >> b) & 1u) != 0u;
    const unsigned votes = __ballot_sync(full_mask, set);
    peers &= set ? votes : ~votes;
  }
  return peers;
}

// Warp w of the block owns slots [first, first + ITEMS * 32) with first = tile_begin + w * ITEMS * 32,
// lane l item c being slot first + c * 32 + l. On return rank[c] is the slot's rank among the
// warp's earlier slots of the same expert and warp_count[w * E + e] the warp's count of expert e
// (warp_count must start at zero).
template <int ITEMS>
__device__ __forceinline__ bool rank_warp_slots(const plan_args& a, std::int64_t tile_begin, int* warp_count,
                                                int (&key)[ITEMS], int (&rank)[ITEMS]) {
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  const std::int64_t first = tile_begin + static_cast<std::int64_t>(warp) * ITEMS * 32;
  bool bad = false;
#pragma unroll
  for (int c = 0; c < ITEMS; ++c) key[c] = load_key(a, first + c * 32 + lane, bad);
  unsigned peers[ITEMS];
#pragma unroll
  for (int c = 0; c < ITEMS; ++c) peers[c] = peer_lanes(key[c], a.key_bits);
  int* counts = warp_count + warp * a.num_experts;
  const unsigned lower_lanes = (1u << lane) - 1u;
#pragma unroll
  for (int c = 0; c < ITEMS; ++c) {
    const int leader = __ffs(peers[c]) - 1;
    int base = 0;
    if (key[c] >= 0 && lane == leader) {
      base = counts[key[c]];
      counts[key[c]] = base + __popc(peers[c]);
    }
    base = __shfl_sync(full_mask, base, leader);
    __syncwarp();  // the next chunk's leader for this expert may be another lane
    rank[c] = base + __popc(peers[c] & lower_lanes);
  }
  return bad;
}

// Turns warp_count[w * E + e] into base + (count of expert e in warps before w); returns the
// tile's count of e. The loads are issued together, ahead of the stores.
__device__ __forceinline__ int prefix_over_warps(int* warp_count, int num_experts, int e, int base) {
  int c[plan_warps];
#pragma unroll
  for (int w = 0; w < plan_warps; ++w) c[w] = warp_count[w * num_experts + e];
  int run = base;
#pragma unroll
  for (int w = 0; w < plan_warps; ++w) {
    warp_count[w * num_experts + e] = run;
    run += c[w];
  }
  return run - base;
}

// An expert's rows and M tiles scanned as one 64-bit sum, rows in the high half: neither
// total reaches 2^31 (no expert has more tiles than rows), so the low half never carries.
__device__ __forceinline__ unsigned long long pack_rows_tiles(int rows, int tiles) {
  return (static_cast<unsigned long long>(rows) << 32) | static_cast<unsigned>(tiles);
}
__device__ __forceinline__ int packed_rows(unsigned long long v) { return static_cast<int>(v >> 32); }
__device__ __forceinline__ int packed_tiles(unsigned long long v) { return static_cast<int>(v & 0xffffffffu); }

// The packed value the offsets scan sums for an expert with `rows` rows.
__device__ __forceinline__ unsigned long long scan_item(const plan_args& a, int rows) {
  return pack_rows_tiles(rows, a.tiles != nullptr ? m_tiles_of(rows, a.block_m) : 0);
}

// Records what write_m_tiles reads of expert e, from its exclusive prefix `before`; e == E
// records the totals, and also the used tile count.
__device__ __forceinline__ void note_schedule_bounds(const plan_args& a, int* first_tile, int* first_row, int e,
                                                     unsigned long long before) {
  first_tile[e] = packed_tiles(before);
  first_row[e] = packed_rows(before);
  if (e == a.num_experts) write_schedule_head(a.tile_count, m_tiles_used(packed_tiles(before), a.tile_capacity));
}

// Writes both maps for the slots ranked by rank_warp_slots, given each warp's first row per
// expert in row_base; rows past `valid` in the same index range get -1, so every entry is defined.
template <int ITEMS>
__device__ __forceinline__ void scatter_slots(const plan_args& a, std::int64_t tile_begin, const int* row_base,
                                              const int (&key)[ITEMS], const int (&rank)[ITEMS], int valid) {
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  const std::int64_t first = tile_begin + static_cast<std::int64_t>(warp) * ITEMS * 32;
#pragma unroll
  for (int c = 0; c < ITEMS; ++c) {
    const std::int64_t slot = first + c * 32 + lane;
    if (slot >= a.num_slots) continue;
    int row = -1;
    if (key[c] >= 0) {
      row = row_base[warp * a.num_experts + key[c]] + rank[c];
      a.row_to_slot[row] = static_cast<std::int32_t>(slot);
    }
    a.slot_to_row[slot] = row;
    if (slot >= valid) a.row_to_slot[slot] = -1;  // index `slot` read as a row past the valid ones
  }
}

}  // namespace permute_detail

// The whole plan in one block, for num_slots <= ITEMS * plan_threads (decode-sized batches).
template <int ITEMS>
__global__ void __launch_bounds__(plan_threads) build_plan_single_tile_kernel(plan_args a) {
  using block_scan = cub::BlockScan<unsigned long long, plan_threads>;
  __shared__ int s_warp_count[plan_warps * gpu::plan_max_experts];
  __shared__ int s_first_tile[gpu::plan_max_experts + 1];  // schedule only
  __shared__ int s_first_row[gpu::plan_max_experts + 1];   // schedule only
  __shared__ typename block_scan::TempStorage s_scan;
  __shared__ bad_slot_tally s_bad;
  const int tid = static_cast<int>(threadIdx.x), E = a.num_experts;
  const bool schedule = a.tiles != nullptr;
  // Launched as a programmatic dependent of the routing kernel: wait for its ids. A GEMM
  // launched as ours may set itself up while this block runs.
  wait_for_prior_grids();
  allow_dependent_grids();

  for (int i = tid; i < plan_warps * E; i += plan_threads) s_warp_count[i] = 0;
  __syncthreads();
  int key[ITEMS], rank[ITEMS];
  const bool bad = permute_detail::rank_warp_slots<ITEMS>(a, 0, s_warp_count, key, rank);
  __syncthreads();

  // Thread t owns experts t * EPT .. t * EPT + EPT - 1 (the blocked order of the scan).
  constexpr int EPT = plan_experts_per_thread;
  unsigned long long item[EPT], before[EPT];
#pragma unroll
  for (int q = 0; q < EPT; ++q) {
    const int e = tid * EPT + q;
    int count = 0;
    if (e < E)
#pragma unroll
      for (int w = 0; w < plan_warps; ++w) count += s_warp_count[w * E + e];
    item[q] = permute_detail::scan_item(a, count);
  }
  unsigned long long total = 0;
  block_scan(s_scan).ExclusiveSum(item, before, total);
  const int valid = permute_detail::packed_rows(total);
#pragma unroll
  for (int q = 0; q < EPT; ++q) {
    const int e = tid * EPT + q;
    if (e >= E) continue;
    const int offset = permute_detail::packed_rows(before[q]);
    a.offsets[e] = offset;
    permute_detail::prefix_over_warps(s_warp_count, E, e, offset);
    if (schedule) permute_detail::note_schedule_bounds(a, s_first_tile, s_first_row, e, before[q]);
  }
  if (tid == 0) {
    a.offsets[E] = valid;
    if (schedule) permute_detail::note_schedule_bounds(a, s_first_tile, s_first_row, E, total);
  }
  __syncthreads();

  permute_detail::scatter_slots<ITEMS>(a, 0, s_warp_count, key, rank, valid);
  if (schedule)
    write_m_tiles<plan_threads>(s_first_tile, s_first_row, E, a.block_m,
                                m_tiles_used(permute_detail::packed_tiles(total), a.tile_capacity), a.tiles,
                                a.expert_band);
  const int any_bad = __syncthreads_or(bad);
  if (tid == 0) *a.error_flag = any_bad;
  if (any_bad != 0 && a.status != nullptr)  // the same on every thread
    report_block_bad_slots<plan_threads>(a.ids, a.num_slots, a.num_slots, 1, [](int) { return true; }, E, a.status,
                                         s_bad);
}

// Tiled path, step 1 of 3: each tile's per-expert counts and bad-id flag.
template <int = 0>  // a template: see moe_tile_schedule_kernel
__global__ void __launch_bounds__(plan_threads) plan_count_kernel(plan_args a) {
  __shared__ int s_count[gpu::plan_max_experts];
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, E = a.num_experts;
  for (int e = tid; e < E; e += plan_threads) s_count[e] = 0;
  __syncthreads();
  const std::int64_t tile_begin = static_cast<std::int64_t>(blockIdx.x) * gpu::plan_tile_slots;
  bool bad = false;
  int key[plan_tile_items];
#pragma unroll
  for (int c = 0; c < plan_tile_items; ++c) key[c] = permute_detail::load_key(a, tile_begin + c * plan_threads + tid, bad);
#pragma unroll
  for (int c = 0; c < plan_tile_items; ++c) {
    // One shared atomic per expert per warp, so a tile routed to a single expert does not serialize.
    const unsigned peers = permute_detail::peer_lanes(key[c], a.key_bits);
    if (key[c] >= 0 && lane == __ffs(peers) - 1) atomicAdd(&s_count[key[c]], __popc(peers));
  }
  const int any_bad = __syncthreads_or(bad);
  for (int e = tid; e < E; e += plan_threads)
    a.tile_counts[static_cast<std::int64_t>(e) * a.num_tiles + blockIdx.x] = s_count[e];
  if (tid == 0) a.tile_errors[blockIdx.x] = any_bad;
}

// Tiled path, step 2 of 3 (one block): per expert, the exclusive prefix of its counts over
// tiles (a warp per expert, several experts' loads in flight at once); then the expert
// offsets, the error flag and, on request, the M-tile schedule.
template <int = 0>  // a template: see moe_tile_schedule_kernel
__global__ void __launch_bounds__(plan_scan_threads, 1) plan_scan_kernel(plan_args a) {
  using warp_scan = cub::WarpScan<int>;
  // Warp scans: raking would give each raking thread 32 64-bit items, more registers than
  // 1024 threads have.
  using block_scan = cub::BlockScan<unsigned long long, plan_scan_threads, cub::BLOCK_SCAN_WARP_SCANS>;
  constexpr int warps = plan_scan_threads / 32, B = plan_scan_batch;
  __shared__ typename warp_scan::TempStorage s_warp[warps];
  __shared__ typename block_scan::TempStorage s_block;
  __shared__ int s_total[plan_scan_threads];
  __shared__ int s_first_tile[gpu::plan_max_experts + 1];  // schedule only
  __shared__ int s_first_row[gpu::plan_max_experts + 1];   // schedule only
  __shared__ bad_slot_tally s_bad;
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  const int E = a.num_experts, T = a.num_tiles;

  for (int e0 = warp * B; e0 < E; e0 += warps * B) {
    int carry[B];
#pragma unroll
    for (int x = 0; x < B; ++x) carry[x] = 0;
    for (int t0 = 0; t0 < T; t0 += 32 * B) {
      int c[B][B];  // [expert][chunk]
#pragma unroll
      for (int x = 0; x < B; ++x)
#pragma unroll
        for (int y = 0; y < B; ++y) {
          const int e = e0 + x, t = t0 + 32 * y + lane;
          c[x][y] = e < E && t < T ? a.tile_counts[static_cast<std::int64_t>(e) * T + t] : 0;
        }
#pragma unroll
      for (int x = 0; x < B; ++x)
#pragma unroll
        for (int y = 0; y < B; ++y) {
          const int e = e0 + x, t = t0 + 32 * y + lane;
          int before = 0, chunk_total = 0;
          warp_scan(s_warp[warp]).ExclusiveSum(c[x][y], before, chunk_total);
          __syncwarp();
          if (e < E && t < T) a.tile_counts[static_cast<std::int64_t>(e) * T + t] = carry[x] + before;
          carry[x] += chunk_total;
        }
    }
#pragma unroll
    for (int x = 0; x < B; ++x)
      if (lane == 0 && e0 + x < E) s_total[e0 + x] = carry[x];
  }
  if (tid >= E) s_total[tid] = 0;
  bool bad = false;
  for (int t = tid; t < T; t += plan_scan_threads) bad |= a.tile_errors[t] != 0;
  const int any_bad = __syncthreads_or(bad);
  if (any_bad != 0 && a.status != nullptr)  // the same on every thread; only the flagged tiles are reread
    report_block_bad_slots<plan_scan_threads>(
        a.ids, a.num_slots, gpu::plan_tile_slots, T, [&a](int t) { return a.tile_errors[t] != 0; }, E, a.status, s_bad);

  unsigned long long before = 0, total = 0;
  block_scan(s_block).ExclusiveSum(permute_detail::scan_item(a, s_total[tid]), before, total);
  if (tid < E) a.offsets[tid] = permute_detail::packed_rows(before);
  if (tid == 0) {
    a.offsets[E] = permute_detail::packed_rows(total);
    *a.error_flag = any_bad;
  }
  if (a.tiles == nullptr) return;  // the same for every thread, so no barrier below is left short

  if (tid < E) permute_detail::note_schedule_bounds(a, s_first_tile, s_first_row, tid, before);
  if (tid == 0) permute_detail::note_schedule_bounds(a, s_first_tile, s_first_row, E, total);
  __syncthreads();
  write_m_tiles<plan_scan_threads>(s_first_tile, s_first_row, E, a.block_m,
                                   m_tiles_used(permute_detail::packed_tiles(total), a.tile_capacity), a.tiles,
                                   a.expert_band);
}

// Tiled path, step 3 of 3: ranks each tile's slots again and writes both maps.
template <int = 0>  // a template: see moe_tile_schedule_kernel
__global__ void __launch_bounds__(plan_threads) plan_scatter_kernel(plan_args a) {
  __shared__ int s_warp_count[plan_warps * gpu::plan_max_experts];
  const int tid = static_cast<int>(threadIdx.x), E = a.num_experts;
  for (int i = tid; i < plan_warps * E; i += plan_threads) s_warp_count[i] = 0;
  __syncthreads();
  const std::int64_t tile_begin = static_cast<std::int64_t>(blockIdx.x) * gpu::plan_tile_slots;
  int key[plan_tile_items], rank[plan_tile_items];
  permute_detail::rank_warp_slots<plan_tile_items>(a, tile_begin, s_warp_count, key, rank);
  __syncthreads();
  for (int e = tid; e < E; e += plan_threads) {
    const int base = a.offsets[e] + a.tile_counts[static_cast<std::int64_t>(e) * a.num_tiles + blockIdx.x];
    permute_detail::prefix_over_warps(s_warp_count, E, e, base);
  }
  const int valid = a.offsets[E];
  __syncthreads();
  permute_detail::scatter_slots<plan_tile_items>(a, tile_begin, s_warp_count, key, rank, valid);
}

}  // namespace moerunner::kernels
