// Tuning values of the grouped tensor-core GEMM (mma.sync m16n8k16) and the small
// selector that picks them per GPU architecture, in the manner of CUB's policy hubs:
// a tuning is a value (a struct of ints with ==), checked where it is defined.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "moerunner/gpu/routing_plan.hpp"

namespace moerunner::gpu {

// One CTA computes a block_m x block_n tile of C = A * B^T, A [rows, K], B [N, K] row-major.
// For the gated first GEMM block_n counts B rows: half gate rows, half the matching up rows.
struct grouped_gemm_tuning {
  int block_m;
  int block_n;
  int block_k;  // 32 or 64 (elements): one smem row is 4 or 8 16-byte chunks
  int warps_m;
  int warps_n;
  int stages;       // cp.async pipeline depth
  int min_arch;     // lowest SM version (80, 90) this tuning is compiled and launched for
  int raster_band;  // M tiles that walk the N tiles together (see decode_work_item)

  constexpr int threads() const { return 32 * warps_m * warps_n; }
  constexpr int schedule_block_m() const { return block_m; }  // rows of one M tile of the schedule
  constexpr int warp_tile_m() const { return block_m / warps_m; }
  constexpr int warp_tile_n() const { return block_n / warps_n; }
  // 16-bit elements only (bf16 / f16); the A and B tiles of every stage.
  constexpr int pipeline_smem_bytes() const { return stages * (block_m + block_n) * block_k * 2; }
  // The f32 C tile the epilogue stages through smem, rows padded by 8 floats (no bank conflicts).
  constexpr int epilogue_smem_bytes() const { return block_m * (block_n + 8) * 4; }
  // The two phases reuse the same buffer.
  constexpr int smem_bytes() const {
    return pipeline_smem_bytes() > epilogue_smem_bytes() ? pipeline_smem_bytes() : epilogue_smem_bytes();
  }
  friend constexpr bool operator==(const grouped_gemm_tuning&, const grouped_gemm_tuning&) = default;
};

// The conditions the kernel's index arithmetic relies on; each says why in its message.
consteval bool check_grouped_gemm_tuning(grouped_gemm_tuning t) {
  if (t.block_k != 32 && t.block_k != 64) throw "block_k must be 32 or 64 (the smem swizzle assumes it)";
  if (t.warps_m < 1 || t.warps_n < 1) throw "warps_m and warps_n must be positive";
  if (t.block_m % (16 * t.warps_m) != 0) throw "each warp's M tile must be a multiple of the mma M (16)";
  // Gated GEMM1 splits each warp's N tile into gate and up halves, each loaded with ldmatrix.x4 (16 rows).
  if (t.block_n % (32 * t.warps_n) != 0) throw "each warp's N tile must be a multiple of 32 (two 16-row halves)";
  const int rows_per_pass = t.threads() / (t.block_k / 8);
  if (rows_per_pass % 8 != 0) throw "a load pass must cover whole 8-row swizzle groups";
  if (t.block_m % rows_per_pass != 0 || t.block_n % rows_per_pass != 0)
    throw "block_m and block_n must be whole multiples of the rows one load pass covers";
  if (t.stages < 2) throw "the pipeline needs at least two stages";
  if (t.smem_bytes() > 227 * 1024) throw "the pipeline does not fit in shared memory";
  if (t.min_arch != 80 && t.min_arch != 90) throw "min_arch must be 80 or 90";
  if (t.raster_band < 1) throw "raster_band must be positive";
  return true;
}

// The tunings travel through kernel templates as types that carry the value (the CUB way):
// nvcc's generated host stubs cannot spell class-type template arguments.
// Ampere (and every sm_8x): 68 KiB of smem per CTA so that two CTAs fit an A100 SM and one an sm_86 SM.
struct sm80_gemm_policy {
  static constexpr grouped_gemm_tuning tuning{
      .block_m = 128, .block_n = 128, .block_k = 32, .warps_m = 2, .warps_n = 2, .stages = 4, .min_arch = 80, .raster_band = 8};
};
// Hopper, mma.sync path: deeper K tile (half the barriers per FLOP); 96 KiB, two CTAs per SM.
struct sm90_gemm_policy {
  static constexpr grouped_gemm_tuning tuning{
      .block_m = 128, .block_n = 128, .block_k = 64, .warps_m = 2, .warps_n = 2, .stages = 3, .min_arch = 90, .raster_band = 8};
};
static_assert(check_grouped_gemm_tuning(sm80_gemm_policy::tuning));
static_assert(check_grouped_gemm_tuning(sm90_gemm_policy::tuning));
// Both GEMMs and both tunings share one M-tile schedule (see build_tile_schedule).
static_assert(sm80_gemm_policy::tuning.block_m == sm90_gemm_policy::tuning.block_m);
inline constexpr int moe_gemm_block_m = sm80_gemm_policy::tuning.block_m;

// Hopper, wgmma path (sm_90a only): a producer warpgroup fills a ring of K tiles (B by TMA,
// gathered A rows by cp.async) and consumer warpgroups run wgmma.mma_async on them, each on
// 64 rows of the tile, or (64-row tiles, two warpgroups) both on its rows and half its B rows;
// the accumulators stay in registers through the epilogue.
struct wgmma_gemm_tuning {
  int block_m;              // rows of a tile: consumer_warpgroups * 64, or 64 (split B rows)
  int block_n;              // B rows of a tile (256, or 128 per warpgroup in 64-row tiles);
                            // gated GEMM1: half gate, half up
  int block_k;              // elements; 64 bf16/f16 = one 128-byte swizzle row
  int consumer_warpgroups;
  int stages;               // shared-memory ring depth
  int producer_lag;         // K tiles of A copies a producer thread keeps in flight before it signals
  int min_arch;
  int raster_band;          // M tiles that walk the N tiles together (see decode_work_item)
  int cluster_m = 1;        // CTAs of a cluster, each on block_m rows of one schedule tile, that
                            // share the weight tile by TMA multicast (1 or 2)
  bool async_a_arrive = false;  // each producer thread's A copies arrive on the stage's barrier when
                                // they land (cp.async.mbarrier.arrive), not producer_lag stages later

  constexpr int threads() const { return 128 * (1 + consumer_warpgroups); }
  // A schedule tile spans the cluster: its CTAs take consecutive block_m-row parts of it.
  constexpr int schedule_block_m() const { return block_m * cluster_m; }
  constexpr int stage_bytes() const { return (block_m + block_n) * block_k * 2; }
  // The ring, plus slack to align it to the 1024 bytes a 128-byte swizzle pattern repeats over.
  constexpr int smem_bytes() const { return stages * stage_bytes() + 1024; }
  friend constexpr bool operator==(const wgmma_gemm_tuning&, const wgmma_gemm_tuning&) = default;
};

consteval bool check_wgmma_gemm_tuning(wgmma_gemm_tuning t) {
  if (t.block_k != 64) throw "block_k must be 64: one K tile row is one 128-byte swizzle row";
  if (t.consumer_warpgroups < 1 || t.consumer_warpgroups > 2) throw "one or two consumer warpgroups";
  if (t.block_m != 64 * t.consumer_warpgroups && t.block_m != 64)
    throw "each consumer warpgroup owns 64 rows (the wgmma M), or all of them share 64";
  if (t.block_n != 256 && !(t.block_m == 64 && t.block_n == 128 * t.consumer_warpgroups))
    throw "block_n must be 256 (one m64n256k16 per 64 A rows), or 128 per warpgroup in 64-row tiles";
  // Each of the 128 producer threads copies whole 8-row swizzle groups of one 16-byte column.
  if ((t.block_m * t.block_k / 8) % 128 != 0) throw "the A tile must split evenly over 128 producer threads";
  if (t.producer_lag < 0 || t.producer_lag > t.stages - 2)
    throw "producer_lag must leave two stages for the consumers (else producer and consumers wait on each other)";
  if (t.smem_bytes() > 227 * 1024) throw "the ring does not fit in shared memory";
  if (t.min_arch != 90) throw "wgmma needs sm_90a";
  if (t.raster_band < 1) throw "raster_band must be positive";
  if (t.cluster_m != 1 && t.cluster_m != 2) throw "cluster_m must be 1 or 2";
  // Each CTA of a pair issues one of the two weight boxes to both; a 64-row tile's warpgroups
  // split the B rows differently.
  if (t.cluster_m == 2 && t.block_m != 128) throw "2-CTA clusters are written for 128-row tiles";
  if (t.async_a_arrive && t.producer_lag != 0) throw "with async_a_arrive the producer keeps no lag";
  return true;
}

// Tiles of 128 rows: two consumer warpgroups share each B stage (half the weight traffic
// from shared memory per FLOP of 64-row tiles); for experts with many rows (prefill).
struct sm90_wgmma_gemm_policy {
  static constexpr wgmma_gemm_tuning tuning{.block_m = 128,
                                            .block_n = 256,
                                            .block_k = 64,
                                            .consumer_warpgroups = 2,
                                            .stages = 4,
                                            .producer_lag = 2,
                                            .min_arch = 90,
                                            .raster_band = 8};
};
// The 128-row tile in clusters of two CTAs on the two 128-row halves of a 256-row schedule
// tile (one expert): each CTA loads half of the stage's weight tile from L2 and multicasts it
// to both, so a CTA draws 32 KB per K tile instead of 48 (16 KB of A rows, 16 of B), and an
// expert's weights leave L2 once per pair. Its A copies signal their stage as they land.
struct sm90_wgmma_m128x2_gemm_policy {
  static constexpr wgmma_gemm_tuning tuning{.block_m = 128,
                                            .block_n = 256,
                                            .block_k = 64,
                                            .consumer_warpgroups = 2,
                                            .stages = 4,
                                            .producer_lag = 0,
                                            .min_arch = 90,
                                            .raster_band = 4,  // 4 x 256 rows: the 128-row tile's band
                                            .cluster_m = 2,
                                            .async_a_arrive = true};
};
// Tiles of 64 rows, for experts that see few rows, where the GEMMs stream weights: two
// warpgroups share the rows and split the B rows (each runs half the wgmma work of one
// warpgroup over all 256), and a stage without 64 idle A rows leaves room for a fifth.
struct sm90_wgmma_m64_gemm_policy {
  static constexpr wgmma_gemm_tuning tuning{.block_m = 64,
                                            .block_n = 256,
                                            .block_k = 64,
                                            .consumer_warpgroups = 2,
                                            .stages = 5,
                                            .producer_lag = 3,
                                            .min_arch = 90,
                                            .raster_band = 8};
};
// Tiles of 64 rows and 128 B rows with one consumer warpgroup: twice the (M tile, N tile)
// items of the above, for decode shapes whose active experts leave most SMs idle.
struct sm90_wgmma_m64n128_gemm_policy {
  static constexpr wgmma_gemm_tuning tuning{.block_m = 64,
                                            .block_n = 128,
                                            .block_k = 64,
                                            .consumer_warpgroups = 1,
                                            .stages = 8,
                                            .producer_lag = 6,
                                            .min_arch = 90,
                                            .raster_band = 8};
};
static_assert(check_wgmma_gemm_tuning(sm90_wgmma_gemm_policy::tuning));
static_assert(check_wgmma_gemm_tuning(sm90_wgmma_m128x2_gemm_policy::tuning));
static_assert(check_wgmma_gemm_tuning(sm90_wgmma_m64_gemm_policy::tuning));
static_assert(check_wgmma_gemm_tuning(sm90_wgmma_m64n128_gemm_policy::tuning));
static_assert(sm90_wgmma_gemm_policy::tuning.block_m == moe_gemm_block_m);

// Narrow decode tiles (kernels/sm90_kernel_grouped_gemm_wgmma_narrow.cuh, 16-bit and e4m3): 256
// weight rows as the wgmma's M and block_m tokens (8, 16 or 32) as its N, one producer warp and
// two consumer warpgroups, so that a K tile's tensor work follows the tokens a tile holds.
struct wgmma_narrow_tuning {
  int block_m;      // tokens of a tile: the wgmma's N
  int min_arch;
  int raster_band;  // M tiles that walk the N tiles together (see decode_work_item)

  constexpr int schedule_block_m() const { return block_m; }
  friend constexpr bool operator==(const wgmma_narrow_tuning&, const wgmma_narrow_tuning&) = default;
};

consteval bool check_wgmma_narrow_tuning(wgmma_narrow_tuning t) {
  if (t.block_m != 8 && t.block_m != 16 && t.block_m != 32) throw "block_m must be 8, 16 or 32 (m64nNk16 shapes)";
  if (t.min_arch != 90) throw "wgmma needs sm_90a";
  if (t.raster_band < 1) throw "raster_band must be positive";
  return true;
}

template <int N>
struct sm90_wgmma_narrow_gemm_policy {
  static constexpr wgmma_narrow_tuning tuning{
      .block_m = N, .min_arch = 90, .raster_band = sm90_wgmma_gemm_policy::tuning.raster_band};
  static_assert(check_wgmma_narrow_tuning(tuning));
};

// The narrow tiles' tokens for `slots` rows over `active_experts`: the smallest N that holds the
// active experts' average rows (at most 32; an expert with more takes several tiles).
constexpr int narrow_tile_tokens(std::int64_t slots, std::int64_t active_experts) {
  const std::int64_t avg = active_experts > 0 ? (slots + active_experts - 1) / active_experts : 1;
  return avg <= 8 ? 8 : avg <= 16 ? 16 : 32;
}

// Decode GEMMs for experts that see a few rows each, where a GEMM only streams weights: the
// weight rows are the mma.sync's M and the tile's tokens its N in blocks of 8 ("swap-AB"), so
// an 8-row tile wastes no 64-row wgmma on one token; every warp of a CTA streams the CTA's
// weight rows over its own part of K through a private cp.async ring (no CTA barrier in the
// main loop), and the parts meet in shared memory for the epilogue (sm_80 and newer).
struct stream_gemm_tuning {
  int block_m;      // rows (tokens) of an M tile: blocks of 8, the mma's N
  int block_n;      // weight rows of a CTA: two m16 blocks (gated: 16 gate rows, their 16 up rows)
  int warps;        // K ranges per CTA, one per warp
  int stages;       // each warp's ring depth, in 64-element K tiles
  int min_arch;
  int raster_band;  // M tiles that walk the N tiles together (see decode_work_item)

  constexpr int threads() const { return 32 * warps; }
  constexpr int schedule_block_m() const { return block_m; }
  constexpr int stage_bytes() const { return (block_n + block_m) * 64 * 2; }
  constexpr int smem_bytes() const { return warps * stages * stage_bytes(); }
  friend constexpr bool operator==(const stream_gemm_tuning&, const stream_gemm_tuning&) = default;
};

consteval bool check_stream_gemm_tuning(stream_gemm_tuning t) {
  // ldmatrix.x4 loads two 8-token blocks at a time, .x2 one.
  if (t.block_m != 8 && t.block_m != 16 && t.block_m != 32) throw "block_m must be 8, 16 or 32 (8-token mma blocks)";
  if (t.block_n != 32) throw "block_n must be 32 (two 16-row mma blocks)";
  if (t.warps < 1 || t.warps > 8) throw "one to eight warps";
  if (t.stages < 2) throw "a ring needs at least two stages";
  if (t.smem_bytes() > 200 * 1024) throw "the rings do not fit in shared memory";
  if (t.min_arch != 80 && t.min_arch != 90) throw "min_arch must be 80 or 90";
  if (t.raster_band < 1) throw "raster_band must be positive";
  return true;
}

// 8 tokens per tile; four warps on a quarter of K each, each with two of its three 5 KB stages
// in flight (60 KB per CTA: three CTAs, 96 KB of weights in flight per SM, and 396 CTAs, so
// that Qwen3-30B-A3B's 384 GEMM1 items at one token run in one wave).
struct stream_gemm_policy {
  static constexpr stream_gemm_tuning tuning{
      .block_m = 8, .block_n = 32, .warps = 4, .stages = 3, .min_arch = 80, .raster_band = 8};
};
static_assert(check_stream_gemm_tuning(stream_gemm_policy::tuning));
// The same GEMM with K in order: one warp per CTA walks all of K, so each output is one chain of
// k16 tensor-core sums from K = 0 up, the order of the wgmma kernels' chains (a split over warps
// adds its parts in another; the batch-invariance test found the bits equal to the wgmma
// tiles'). Forced only (gemm_tuning_choice::stream_ordered): at decode it measured 1.7-2.3x the
// split form's time (H100, bench/NOTES.md round 24), slower than the wgmma tiles that
// batch-invariant runs keep. That was with sixteen stages (80 KB): two CTAs per SM, so two warps
// issued an SM's copies, and Qwen3-30B-A3B's one-token items (384 and 512) came in 1.5 and 2
// waves. Eight stages (40 KB) fit five CTAs per SM: 2.5x the warps, and those items in one wave.
struct stream_gemm_ordered_policy {
  static constexpr stream_gemm_tuning tuning{
      .block_m = 8, .block_n = 32, .warps = 1, .stages = 8, .min_arch = 80, .raster_band = 8};
};
static_assert(check_stream_gemm_tuning(stream_gemm_ordered_policy::tuning));
// The same rings over e4m3 operands (cuda_fused_fp8 at decode): 128-byte stage rows hold 128
// values, so the stages are the 16-bit tuning's in bytes; e4m3 mma.sync needs sm_89+ (sm_90 here).
struct stream_gemm_fp8_policy {
  static constexpr stream_gemm_tuning tuning = [] {
    stream_gemm_tuning t = stream_gemm_policy::tuning;
    t.min_arch = 90;
    return t;
  }();
};
static_assert(check_stream_gemm_tuning(stream_gemm_fp8_policy::tuning));
// The smallest M tile of any tuning: workspaces size the tile schedule for it.
inline constexpr int moe_gemm_min_block_m = stream_gemm_policy::tuning.block_m;

// The sm_90a kernel set's tile for `rows` routed rows over `num_experts` experts: the stream
// GEMM (no wgmma: weights straight into mma.sync fragments) when an active expert averages at
// most 4 rows (decode); 64-row wgmma tiles up to 64 rows (prefill over many experts); 128-row
// tiles in 2-CTA clusters when it averages at least 512 (at 256, Qwen3-30B-A3B at 4096 tokens,
// the experts' half-empty 256-row tiles idle one CTA of the pair too often: measured 1.2x
// slower than single tiles), single 128-row tiles between; and 64 x 128 instead of 64 x 256
// when GEMM1's items (at most one M tile per active expert, I/128 N tiles) fill at most half
// the SMs (round 3: 7% faster at 48 items, 7% slower at 128). A function of the shape only,
// so that the workspace query and the run agree.
enum class sm90_tile : std::uint8_t { stream, m64, m64n128, m128, m128x2, stream_ordered, narrow };

// Measured on an H200 (bench/NOTES.md, round 6): the stream GEMMs lead the 64-row wgmma tiles by
// 5-30% at 1-2 rows per active expert (M <= 8 on the three benchmark shapes) and by 7% at 4
// (Qwen3-30B-A3B, 64 tokens), tie at 2 with every expert active (DeepSeek-V3, 64 tokens), and
// trail by 1.6x at 16 (Mixtral-8x7B, 64 tokens).
inline constexpr int stream_max_rows_per_expert = 4;

// `allow_stream` false keeps every M on the wgmma kernels (batch-invariant runs: one kernel
// family, hence one K order, whatever the batch).
constexpr sm90_tile sm90_tile_for(std::int64_t rows, int num_experts, int intermediate_size, int sm_count,
                                  bool allow_stream = true) {
  const std::int64_t active = rows < num_experts ? rows : num_experts;
  if (active > 0 && rows >= 512 * active) return sm90_tile::m128x2;
  if (rows > 64 * active) return sm90_tile::m128;
  if (allow_stream && rows <= stream_max_rows_per_expert * active) return sm90_tile::stream;
  const std::int64_t gemm1_items = active * ((intermediate_size + 127) / 128);
  return 2 * gemm1_items <= sm_count ? sm90_tile::m64n128 : sm90_tile::m64;
}

// Rows of one tile of the M-tile schedule the tile walks (a 2-CTA cluster shares one).
constexpr int sm90_schedule_block_m(sm90_tile t) {
  switch (t) {
    case sm90_tile::stream: return stream_gemm_policy::tuning.schedule_block_m();
    case sm90_tile::stream_ordered: return stream_gemm_ordered_policy::tuning.schedule_block_m();
    case sm90_tile::m128: return sm90_wgmma_gemm_policy::tuning.schedule_block_m();
    case sm90_tile::m128x2: return sm90_wgmma_m128x2_gemm_policy::tuning.schedule_block_m();
    default: return sm90_wgmma_m64_gemm_policy::tuning.schedule_block_m();
  }
}

// CTAs that run one work item together.
constexpr int sm90_cluster_m(sm90_tile t) {
  return t == sm90_tile::m128x2 ? sm90_wgmma_m128x2_gemm_policy::tuning.cluster_m : 1;
}

// Output columns of a wgmma GEMM2 item (the stream GEMM never splits K, see its policy).
constexpr int sm90_block_n(sm90_tile t) {
  return t == sm90_tile::m64n128 ? sm90_wgmma_m64n128_gemm_policy::tuning.block_n
                                 : sm90_wgmma_gemm_policy::tuning.block_n;
}

// Which tuning a run uses: the selector's choice for the device, or one forced (tests, benchmarks).
// sm90_wgmma picks its tile by shape (sm90_tile_for); the _m64, _m64n128, _m128 and _m128x2
// forms force one, stream forces the stream GEMM (which sm_80 code runs too) and stream_ordered
// its form with K in order.
enum class gemm_tuning_choice : std::uint8_t {
  automatic,
  sm80,
  sm90,
  sm90_wgmma,
  sm90_wgmma_m64,
  sm90_wgmma_m64n128,
  sm90_wgmma_m128,
  sm90_wgmma_m128x2,
  stream,
  stream_ordered
};

constexpr std::string_view gemm_tuning_name(gemm_tuning_choice c) {
  switch (c) {
    case gemm_tuning_choice::automatic: return "automatic";
    case gemm_tuning_choice::sm80: return "sm80";
    case gemm_tuning_choice::sm90: return "sm90";
    case gemm_tuning_choice::sm90_wgmma: return "sm90_wgmma";
    case gemm_tuning_choice::sm90_wgmma_m64: return "sm90_wgmma_m64";
    case gemm_tuning_choice::sm90_wgmma_m64n128: return "sm90_wgmma_m64n128";
    case gemm_tuning_choice::sm90_wgmma_m128: return "sm90_wgmma_m128";
    case gemm_tuning_choice::sm90_wgmma_m128x2: return "sm90_wgmma_m128x2";
    case gemm_tuning_choice::stream: return "stream";
    case gemm_tuning_choice::stream_ordered: return "stream_ordered";
  }
  return "?";
}

// The selector: the newest tuning the running code was compiled for. `code_arch` is the
// virtual architecture of the kernel image the device runs (80 for sm_80 code, also when it
// runs on a newer GPU; 90 for sm_90 and sm_90a), as CUB picks its policies by PTX version;
// `has_wgmma` says whether that image is sm_90a code (the wgmma kernels exist only there).
constexpr gemm_tuning_choice select_gemm_tuning(int code_arch, bool has_wgmma) {
  if (code_arch >= 90) return has_wgmma ? gemm_tuning_choice::sm90_wgmma : gemm_tuning_choice::sm90;
  return gemm_tuning_choice::sm80;
}

// Whether a choice runs the wgmma kernels (one of their tiles, or the one picked by shape).
constexpr bool is_wgmma_choice(gemm_tuning_choice c) {
  return c == gemm_tuning_choice::sm90_wgmma || c == gemm_tuning_choice::sm90_wgmma_m64 ||
         c == gemm_tuning_choice::sm90_wgmma_m64n128 || c == gemm_tuning_choice::sm90_wgmma_m128 ||
         c == gemm_tuning_choice::sm90_wgmma_m128x2;
}

constexpr int gemm_tuning_min_arch(gemm_tuning_choice c) {
  if (is_wgmma_choice(c)) return sm90_wgmma_gemm_policy::tuning.min_arch;
  if (c == gemm_tuning_choice::stream) return stream_gemm_policy::tuning.min_arch;
  if (c == gemm_tuning_choice::stream_ordered) return stream_gemm_ordered_policy::tuning.min_arch;
  return c == gemm_tuning_choice::sm90 ? sm90_gemm_policy::tuning.min_arch : sm80_gemm_policy::tuning.min_arch;
}

// One M tile of the grouped GEMM: rows [row_begin, row_end) of expert `expert` in
// expert-sorted row order. 16 bytes so that a CTA reads it with one vector load.
struct alignas(16) moe_m_tile {
  std::int32_t expert;
  std::int32_t row_begin;
  std::int32_t row_end;
  std::int32_t band;  // schedules written with expert bands: its band word (expert_bands.hpp); else 0
};

// Where GEMM2 (down) puts the row of each (token, expert) pair.
enum class down_store : std::uint8_t {
  rows,        // c = rows [R, n] in row order; combine_rows sums them later in a fixed order
  slots,       // c = out [M, k, n]: row r to its slot, times scale * router weight (no_combine)
  accumulate,  // c = out [M, n], zeroed first: added to its token's row, times scale * router weight
  partials,    // split-K, deterministic: split s of row r to partials[s * R * n + r * n] in f32
};

// Up to this many slots (M * k) the stream GEMMs can build the schedule and row order in each
// CTA from topk_ids (kernels/moerunner/kernels/kernel_local_plan.cuh): its shared-memory tables.
inline constexpr int local_plan_max_slots = 64;

// The most M tiles any routing of `rows` rows over `num_experts` experts can need:
// sum_e ceil(n_e / bm) <= ceil(rows / bm) + num_experts.
inline std::int64_t moe_m_tile_capacity(std::int64_t rows, int num_experts, int block_m) {
  return (rows + block_m - 1) / block_m + num_experts;
}

// The most M tiles with rows a run can have (every tile holds one at least): the bound the
// plans size GEMM2's items by.
inline std::int64_t moe_m_tile_bound(std::int64_t rows, int num_experts, int block_m) {
  return std::min(moe_m_tile_capacity(rows, num_experts, block_m), rows);
}

// Handed-out work items are 32-bit numbers: the largest a cluster can be given is the items
// plus the clusters (kernels/moerunner/kernels/sm90_work_items.cuh).
inline bool hand_out_items_fit(std::int64_t work_bound, std::int64_t clusters) {
  return work_bound + clusters <= 0x7fffffff;
}

// The fp8 kernels' producers, handed out, hold each A row as a 32-bit byte offset (all ones: no
// row): every byte of `rows` rows of k bytes must be addressable below that. The launch and the
// plan bound the rows by the schedule's (capacity x schedule tile rows).
inline bool hand_out_offsets_fit(std::int64_t rows, std::int64_t k) { return rows * k < 0xffffffffLL; }

// A tile schedule's head: the tile count, then the work-item counters of the wgmma GEMMs that
// hand their items out at run time (GEMM1's, GEMM2's), which the schedule writers zero.
inline constexpr int schedule_head_words = 3;

inline std::size_t tile_schedule_bytes(std::int64_t rows, int num_experts, int block_m) {
  // The head, then the tiles, each in its own 256-byte piece.
  return plan_piece_bytes(schedule_head_words * sizeof(std::int32_t)) +
         plan_piece_bytes(static_cast<std::size_t>(moe_m_tile_capacity(rows, num_experts, block_m)) *
                          sizeof(moe_m_tile));
}

// GEMM2 splits K only where its items come in at most two waves. Beyond, the shorter last wave
// is worth a few percent at most, and a split multiplies the output's reductions (or, in
// deterministic runs, writes and reads f32 parts) by its count: Mixtral-8x7B at 1024 tokens,
// 384 items of 128-row tiles, would split 11 ways for a 3% shorter last wave, with 369 MB of
// f32 parts in deterministic runs (the fp8 plan met the same at 512 tokens; bench/NOTES.md).
inline constexpr std::int64_t down_split_max_waves = 2;

// K splits for the wgmma GEMM2 (n = H columns in items of `cols`, k = I in K tiles of `bk`)
// over a schedule of at most `tile_bound` M tiles. Where the (M tile, N tile) items come in few waves over the SMs
// (decode: few active experts), a whole wave is idle in the worst case (224 items on 132 SMs
// take two item times, 1.7 of them busy): splitting each item's K range into s parts makes
// items * s work items, and the split count with the fewest item times, ceil(items * s /
// SMs) / s, within 3% of the best is taken, the smallest such. A split keeps at least
// min_k_tiles_per_split K tiles so that its pipeline fills; items beyond max_waves waves are
// never split. Host arithmetic only: the workspace query and the run agree on it.
constexpr int wgmma_down_k_splits(std::int64_t tile_bound, int n, int k, int sm_count,
                                  int cols = sm90_wgmma_gemm_policy::tuning.block_n,
                                  int bk = sm90_wgmma_gemm_policy::tuning.block_k,
                                  std::int64_t max_waves = down_split_max_waves) {
  constexpr std::int64_t min_k_tiles_per_split = 4, max_splits = 16;
  const std::int64_t items = tile_bound * ((n + cols - 1) / cols);
  if (items <= 0 || sm_count <= 0 || items > max_waves * sm_count) return 1;
  const std::int64_t k_tiles = (k + bk - 1) / bk;
  const std::int64_t most = std::max<std::int64_t>(1, std::min(max_splits, k_tiles / min_k_tiles_per_split));
  const auto item_times = [&](std::int64_t s) {
    return static_cast<double>((items * s + sm_count - 1) / sm_count) / static_cast<double>(s);
  };
  double best = item_times(1);
  for (std::int64_t s = 2; s <= most; ++s) best = std::min(best, item_times(s));
  for (std::int64_t s = 1; s <= most; ++s)
    if (item_times(s) <= best * 1.03) return static_cast<int>(s);
  return 1;
}

}  // namespace moerunner::gpu
