// The cuda_fused_fp8 backend's run plan: every choice one run makes for (config, M, device), the
// single source of its workspace query and of the run (as fused_plan.hpp is for cuda_fused).
// Host arithmetic only: built with the host compiler, tested without a GPU.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "moerunner/core/config.hpp"
#include "moerunner/core/error.hpp"
#include "moerunner/gpu/fused_plan.hpp"
#include "moerunner/gpu/grouped_gemm_tuning.hpp"
#include "moerunner/gpu/routing_plan.hpp"
#include "moerunner/quant/quant_info.hpp"

namespace moerunner::gpu {

// The fp8 GEMMs' tiles (kernels::wgmma_fp8_shape reads these): 64 rows, 256 B rows (GEMM2: 256
// output columns), K tiles of one scale block; alone, in pairs of CTAs on a 128-row schedule
// tile that share each weight tile by TMA multicast (or fours on a 256-row tile), or 128 rows in
// one CTA (each consumer warpgroup on 64 of them and all 256 B rows).
inline constexpr int fp8_group_size = fp8_block_quant_info::group;
inline constexpr int fp8_block_m = 64, fp8_down_cols = 256, fp8_block_k = fp8_group_size;
enum class fp8_tile : std::uint8_t { m64, m64x2, m64x4, m128, narrow };
inline constexpr const char* fp8_tile_name(fp8_tile t) {
  return t == fp8_tile::m64     ? "m64"
         : t == fp8_tile::m64x2 ? "m64x2"
         : t == fp8_tile::m64x4 ? "m64x4"
         : t == fp8_tile::m128  ? "m128"
                                : "narrow";
}
// Narrow tiles (decode): 256 weight rows as the wgmma's M and a tile's 8, 16 or 32 tokens as its
// N (kernels::wgmma_narrow_shape), so that a K tile's tensor work follows the tokens instead
// of a 64-row tile's; the schedule's tiles then hold N rows (narrow_tile_tokens). The plan takes
// them where the active experts average at most fp8_narrow_max_rows_per_expert rows, before the
// stream GEMMs: on an H100 they measured 0.2-14% faster than the plan before them on all 14 such
// cells of five shapes (the stream GEMMs at one token included: 13-14%), equal at 16 rows
// (Mixtral-8x7B, 64 tokens) and 6-59% slower at 16-128 rows with 512 tokens, where the 64-row
// tiles' weight reads serve more rows (bench/NOTES.md, round 29).
inline constexpr std::int64_t fp8_narrow_max_rows_per_expert = 8;
// Pairs where the active experts average at least 96 rows. A pair draws 0.6x the L2 bytes per
// multiply-add of a 64-row CTA (each weight tile multicast into both: 48 KB per 4.2 M MAC
// against 40 KB per 2.1 M), but pads each expert's rows to a multiple of 128 instead of 64, and
// its CTAs wait on each other's stages. Once GEMM1's epilogue stopped holding the consumers, the
// 64-row CTAs ran L2-bound (Mixtral-8x7B 4096's GEMM1 at 8.8 TB/s of L2 traffic) or, with many
// large experts, DRAM-bound on weight tiles that L2 did not keep (DeepSeek-V3 16384: 37% L2
// hits). On an H100, pairs then measured faster on 6 of the bench's 7 cells at 128-4096 rows per
// expert (3-26%; Mixtral-8x7B 4096: 1% slower and 10% faster in two passes), 6% slower at 256
// (Qwen3-30B-A3B 4096: K = 2048 and 768, short K loops, where the pad costs more than the L2
// bytes save), and 5-9% slower at 16-32 rows, where most of a pair's 128 rows are pad
// (bench/NOTES.md, round 17; round 13's H200 verdict, pairs 2-11% slower, predates the epilogue
// change). From about 96 rows per expert both pad alike (two 64-row tiles or one of 128), so
// pairs then only save L2 bytes.
inline constexpr int fp8_large_block_m = 128;
inline constexpr std::int64_t fp8_pair_min_rows = 96;
// Fours of 64-row CTAs on a 256-row schedule tile, each weight tile multicast into all four, only
// where asked (fp8_settings::quads): 0.4x the L2 bytes per multiply-add of a 64-row CTA (0.67x a
// pair's), for pad to a multiple of 256 rows, four CTAs that wait on each other's stages, and
// fewer SMs in use (a four takes four SMs of one GPC). They measured slower than pairs on all 9
// prefill cells of an H100 run, 10% even at 4096 rows per expert where the pad is under 1%: the
// pairs are not held by L2 bytes (bench/NOTES.md, round 20). Plain K loop, fixed turns.
inline constexpr int fp8_quad_block_m = 256;
// 128-row CTAs (each warpgroup on 64 rows and all 256 weight rows) only where asked
// (fp8_settings::tall): they draw 0.6x the shared-memory fill per multiply-add of 64-row CTAs,
// but measured slower on 5 of the 6 prefill cells where experts average more than 64 rows
// (H100, one run: 10-48%; 14% faster only at DeepSeek-V3 4096 tokens). bench/NOTES.md, round 14.
// The wgmma K loop: each warpgroup waits for its K tile's wgmma and then promotes the sums
// (plain), both warpgroups at once as they wait on the same stage; or K tile kt + 1's wgmma are
// issued before kt's are waited for, and run while kt's sums are promoted (overlap: two sum
// blocks); or the two warpgroups take turns to issue (stagger: one promotes while the other's
// wgmma run); either on 64-row CTAs alone or in pairs. The plan takes overlap on those CTAs,
// plain where work items are handed out (the lean producer of the overlap spilled there) and
// on 128-row CTAs and fours; fp8_settings::k_loop forces one. Measured on an H100 in one run
// each (bench/NOTES.md, round 24): overlap 4-9% faster than plain at 4096 and 16384 tokens,
// within +-4% at 512 and +-2% at decode; stagger 0-22% slower (rounds 16 and 21).
enum class fp8_k_loop : std::uint8_t { plain, overlap, stagger };
inline constexpr const char* fp8_k_loop_name(fp8_k_loop l) {
  return l == fp8_k_loop::plain ? "plain" : l == fp8_k_loop::overlap ? "overlapped" : "staggered";
}
// GEMM2 writes rows for the combine kernel, instead of adding each into its token's output row,
// up to twice the 16-bit GEMMs' K (plan_detail::rows_store_max_intermediate), from as many
// slots. The additions cost the same per item in either format, while the e4m3 main loop takes
// about half as long, so they weigh about as much at twice the K. Measured on H100s (bench/
// NOTES.md, round 25), rows against the reductions: DeepSeek-V3 (I = 2048) 5-8% faster at 4096
// and 16384 tokens (GEMM2 7.03 ms against 5.29 + 0.84 for the combine: its reductions missed L2
// on 235 MB of output), 1% at 512; I = 1536 (E = 128 and 160, shapes the bench does not name)
// 5-9% at 4096 tokens, 0-3% at 512; I = 768 4-12%; I = 3072 within 2%; Mixtral-8x7B (I =
// 14336) 3% faster and 1% slower. It costs M*k*H*2 workspace bytes, as the engines' Triton
// path allocates for its own sum.
inline constexpr int fp8_rows_store_max_intermediate = 2 * plan_detail::rows_store_max_intermediate;
// GEMM2 with store warps (fp8_plan::staged_down) where its K loop has at most 32 K tiles (I <=
// 4096), else the consumers' own epilogue. The store warps take an item's epilogue off the
// consumers' path (GEMM2 on an H100, ncu, one run each: Qwen3-30B-A3B 4096 tokens 182 µs against
// 220 with the overlapped loop, 6 K tiles; DeepSeek-V3 4096 1.66 ms against 1.83, 16 K tiles),
// but run the plain K loop, which measured 4-9% slower than the overlapped one at prefill
// (round 24): at Mixtral-8x7B (I = 14336, 112 K tiles) the layer with them (and GEMM1's plain
// loop) was 1-3% slower in three of four prefill cells of two runs, 2% faster in the fourth. An
// epilogue costs about two to three K tiles' time, 5% of a K loop of 40-60: 32 keeps to the side
// that measured faster. bench/NOTES.md, round 27.
inline constexpr int fp8_staged_max_k_tiles = 32;
// The wgmma GEMM2 loads its A rows (act, which GEMM1 wrote in plan order) by one TMA box per
// stage, as it loads the weights, instead of by the producer warpgroup's 16-byte cp.async (512 a
// stage; the producer was busy for ~1000 of a K tile's ~1270 cycles, bench/NOTES.md round 21).
// Measured on an H100 in one run (round 26), the layer against the copies: Mixtral-8x7B 4-8%
// faster at 4096 and 16384 tokens (GEMM2's 112 K tiles per item, all main loop), DeepSeek-V3
// 1-2%, Qwen3-30B-A3B 0-1% (6 K tiles: its items are held elsewhere). No copy, no workspace.
// GEMM1's A rows stay gathered by cp.async: a copy of x in plan order costs M*k*H bytes written
// and read (round 13's fp8 try measured no change). Rows past a tile are the ones that follow
// it, never stored.
// M tiles per raster band (decode_work_item): the 16-bit wgmma tunings' unless asked otherwise.
inline constexpr int fp8_raster_band = sm90_wgmma_gemm_policy::tuning.raster_band;

// Workspace pieces as byte offsets from the 256-byte aligned start; total includes the slack.
struct fp8_workspace {
  std::size_t plan = 0, plan_bytes = 0;
  std::size_t schedule = 0, schedule_bytes = 0;
  std::size_t x_q = 0, x_q_bytes = 0;          // the input rows in e4m3 [M, H] (unless given so)
  std::size_t x_scale = 0, x_scale_bytes = 0;  // their scales [M, H / 128]
  std::size_t act = 0, act_bytes = 0;          // GEMM1's e4m3 act [M*k, I]
  std::size_t act_scale = 0, act_scale_bytes = 0;  // [M*k, I / 128]
  std::size_t rows = 0, rows_bytes = 0;        // GEMM2's rows (16-bit) or f32 K-split parts
  std::size_t act_f32 = 0, act_f32_bytes = 0;  // stream GEMM1's f32 act [M*k, I], before quantization
  std::size_t up_parts = 0, up_parts_bytes = 0;  // wgmma GEMM1 in K splits: f32 parts [splits, M*k, 2I or I]
  std::size_t total = 0;
};

// Choices a caller may force, for measuring one against the other (cuda_fused_fp8_policy's
// set_stream_gemms, set_pairs, set_quads, set_tall, set_k_loop, set_raster_band,
// set_down_k_splits, set_down_rows, set_down_a_tma, set_staged_down, set_staged_up,
// set_dependent_gemms and set_up_k_splits); unset, the plan's rules decide.
// Batch-invariant runs keep single 64-row wgmma CTAs with the plain K loop whatever is asked
// (one kernel family at every M is what the mode promises). Each member is initialized, so a
// designated initializer names only what it forces.
struct fp8_settings {
  std::optional<bool> stream = std::nullopt;   // the stream GEMMs (any M > 0), or never
  std::optional<bool> pairs = std::nullopt;    // wgmma CTAs in pairs on 128-row tiles, or never
  std::optional<bool> quads = std::nullopt;    // wgmma CTAs in fours on 256-row tiles (before pairs; unset: never)
  std::optional<bool> tall = std::nullopt;     // 128-row wgmma CTAs where pairs are not taken (unset: never)
  // The wgmma K loop (unset: overlap, plain where work items are handed out; 128-row CTAs and
  // fours: plain whatever is asked).
  std::optional<fp8_k_loop> k_loop = std::nullopt;
  std::optional<int> raster_band = std::nullopt;  // M tiles per raster band of the wgmma GEMMs (>= 1; any mode)
  // wgmma work items handed out at run time (unset: off; 64-row CTAs alone or in pairs, plain K loop)
  std::optional<bool> hand_out = std::nullopt;
  // The wgmma GEMM2's K splits (>= 1, at most its K tiles: fewer where I has fewer) wherever the
  // plan may split it (not the stream GEMMs, batch-invariant or no-combine runs); unset: its rule.
  std::optional<int> down_k_splits = std::nullopt;
  // The wgmma GEMMs' raster bands one expert's M tiles each (unset: off; expert_bands.hpp).
  std::optional<bool> expert_bands = std::nullopt;
  // The wgmma GEMM2 writes rows for the combine kernel (true) or adds them into the output
  // (false) where the run may do either (not deterministic, batch-invariant or no_combine runs,
  // nor the stream GEMMs); unset: fp8_rows_store_max_intermediate's rule.
  std::optional<bool> down_rows = std::nullopt;
  // The wgmma GEMM2's A rows by TMA (true) or by the producer's cp.async (false); unset: TMA.
  std::optional<bool> down_a_tma = std::nullopt;
  // The wgmma GEMM2's sums stored by store warps (fp8_plan::staged_down) where it may (unset:
  // fp8_staged_max_k_tiles' rule).
  std::optional<bool> staged_down = std::nullopt;
  // The gated wgmma GEMM1's act quantized by store warps (fp8_plan::staged_up) where it may
  // (unset: never).
  std::optional<bool> staged_up = std::nullopt;
  // The wgmma GEMMs launched as programmatic dependents (fp8_plan::dependent_gemms; unset: never).
  std::optional<bool> dependent_gemms = std::nullopt;
  // The wgmma GEMM1's K splits (fp8_plan::up_k_splits; >= 1, at most its K tiles) where it may
  // split (64-row CTAs alone in fixed turns, not batch-invariant runs); unset: 1.
  std::optional<int> up_k_splits = std::nullopt;
  // Narrow wgmma tiles (fp8_tile::narrow; before the stream GEMMs where those are not forced, and
  // before fours, pairs and 128-row CTAs), except in batch-invariant runs; unset:
  // fp8_narrow_max_rows_per_expert's rule.
  std::optional<bool> narrow = std::nullopt;
  // The decode GEMMs order the rows themselves up to local_plan_max_slots slots, no plan kernel
  // (fp8_plan::schedule_in_gemms): unset, the stream GEMMs do (as measured with cuda_fused's) and
  // the narrow tiles do not (their plan kernel was in every measurement so far).
  std::optional<bool> schedule_in_gemms = std::nullopt;
  // The narrow tiles' tokens (8, 16 or 32) instead of narrow_tile_tokens' (for measuring a wider
  // N than the average rows ask).
  std::optional<int> narrow_tokens = std::nullopt;
};

struct fp8_plan {
  std::int64_t num_tokens = 0;
  // The stream GEMMs on e4m3 (GEMM1 writing f32 act that a kernel of its own quantizes, the
  // kernels chained by programmatic launches) where forced, or where the narrow tiles are forced
  // off and the wgmma tiles would be few (active experts average at most
  // stream_max_rows_per_expert rows and GEMM1's wgmma items fill under half the SMs); else the
  // wgmma GEMMs.
  bool stream = false;
  bool schedule_in_gemms = false;      // stream, narrow: every CTA orders the rows itself (no plan kernel)
  fp8_tile tile = fp8_tile::m64;       // wgmma: the CTA tile
  int schedule_block_m = fp8_block_m;  // stream: 8; wgmma: 64, 128 for a pair of CTAs or a 128-row CTA, 256 for four
  int cluster_m = 1;                   // wgmma CTAs on one schedule tile
  fp8_k_loop k_loop = fp8_k_loop::plain;  // wgmma: how the warpgroups' wgmma and promotions interleave
  int raster_band = fp8_raster_band;   // wgmma: M tiles that walk the N tiles together
  bool hand_out = false;               // wgmma: work items handed out at run time (as fused_plan's)
  bool expert_bands = false;           // wgmma: raster bands of one expert's M tiles (as fused_plan's)
  int down_k_splits = 1;
  down_store down = down_store::accumulate;
  bool down_a_tma = false;      // wgmma: GEMM2's A rows by TMA
  // wgmma GEMM2 on 64-row CTAs alone or in pairs (A by TMA, fixed turns, not into K-split parts)
  // with store warps and the plain K loop, whatever GEMM1's loop (with the overlapped one the
  // consumers spilled): its consumers leave each item's sums in a shared-memory staging tile and
  // go on to the next item, and three warps of the producer warpgroup store them, 16 bytes a lane
  // (four stages instead of five). The plan takes them where GEMM2's K loop is short
  // (fp8_staged_max_k_tiles).
  bool staged_down = false;
  // The gated wgmma GEMM1 on 64-row CTAs alone or in pairs, in fixed turns and without K splits,
  // only where asked: its consumers leave each item's f32 act (after the activation) in a staging
  // tile and go on to the next item, two warps of the producer warpgroup quantize and store it
  // (the same bits as the consumers' own epilogue), and the other two load the stages (four);
  // plain K loop whatever the plan's (with the overlapped one the consumers spilled). On an H200
  // it measured 15-23% slower than the plain loop at prefill, within 2.5% at decode: GEMM1's A
  // rows, gathered by cp.async, then have half the producer threads (bench/NOTES.md, round 28).
  bool staged_up = false;
  // wgmma: GEMM2 (and GEMM1 where the input rows are quantized just before it) launched as the
  // previous kernel's programmatic dependent, only where asked: its CTAs start on the SMs that
  // kernel's last CTAs leave, load their first item's first weight tiles (which depend on nothing
  // it writes) and then wait for it. Meant for the last wave of GEMM1 at decode, which leaves
  // most SMs idle (Qwen3-30B-A3B at 8 tokens: 300 items on 132 SMs); on an H100 the layer
  // measured within 1% at 8-64 tokens and 0.4-4% slower at 4096-16384 (bench/NOTES.md, round 27).
  bool dependent_gemms = false;
  // wgmma GEMM1 on 64-row CTAs alone in fixed turns, only where asked: each item's K tiles in
  // up_k_splits ranges, each range's f32 gate and up sums written as parts, and a kernel after it
  // that sums an item's parts in split order and applies the activation and act's quantization
  // (GEMM1's epilogue, moved). Meant for decode, where GEMM1's items fill few waves (Qwen3-30B-A3B
  // at 8 tokens: 300 items of 16 K tiles on 132 CTAs, the last wave 36 CTAs); on an H200 it
  // measured within 2% there and slower nearly everywhere else (Mixtral-8x7B at 64 tokens 2.1x:
  // the parts kernel runs one CTA per schedule tile), so the plan never takes it (bench/NOTES.md,
  // round 28).
  int up_k_splits = 1;
  bool combine_kernel = false;  // a combine kernel sums GEMM2's rows or parts per token afterwards
  bool clear_in_gemm1 = false;  // GEMM1 zeroes the output GEMM2 adds or scatters into
  fp8_workspace workspace;

  std::string describe() const {
    std::string s = "cuda_fused_fp8 M=" + std::to_string(num_tokens) + ": " +
                    (stream ? std::string("stream e4m3")
                            : "wgmma e4m3 " + std::string(fp8_tile_name(tile)) +
                                  (k_loop != fp8_k_loop::plain ? " " + std::string(fp8_k_loop_name(k_loop)) : "") +
                                  (expert_bands ? " expert bands of " : " band ") + std::to_string(raster_band) +
                                  (hand_out ? " handed out" : "")) +
                    " (schedule tiles of " + std::to_string(schedule_block_m) + " rows" +
                    (schedule_in_gemms ? ", built in the GEMMs" : "") + "), GEMM2 " + std::string(down_store_name(down));
    if (down_k_splits > 1) s += " in " + std::to_string(down_k_splits) + " K splits";
    if (combine_kernel) s += " + combine kernel";
    if (up_k_splits > 1) s += ", GEMM1 in " + std::to_string(up_k_splits) + " K splits + activation kernel";
    if (down_a_tma) s += ", GEMM2's A by TMA";
    if (staged_up) s += ", GEMM1's act quantized by store warps (plain K loop)";
    if (staged_down) s += ", GEMM2 stored by store warps (plain K loop)";
    if (dependent_gemms) s += ", dependent launches";
    s += "; workspace " + std::to_string(workspace.total) + " B (x e4m3 + scales " +
         std::to_string(workspace.x_q_bytes + workspace.x_scale_bytes) + ", act e4m3 + scales " +
         std::to_string(workspace.act_bytes + workspace.act_scale_bytes) +
         (stream ? ", f32 act " + std::to_string(workspace.act_f32_bytes) : std::string()) +
         (up_k_splits > 1 ? ", GEMM1's parts " + std::to_string(workspace.up_parts_bytes) : std::string()) + ", rows " +
         std::to_string(workspace.rows_bytes) + ", plan + schedule " +
         std::to_string(workspace.plan_bytes + workspace.schedule_bytes) + ")";
    return s;
  }
};

// The plan of one run over num_tokens tokens on `dev` (its SM count sets GEMM2's K splits).
// GEMM2 stores by cuda_fused's rule (plan_detail::store_mode) with rows up to a longer K
// (fp8_rows_store_max_intermediate); the input rows are quantized into the workspace first, so
// GEMM1 may clear the output even when it aliases x.
inline fp8_plan make_fp8_plan(const MoeRunnerConfig& cfg, std::int64_t num_tokens, const device_target& dev,
                              const fp8_settings& settings = {}) {
  fp8_plan p;
  p.num_tokens = num_tokens;
  const std::int64_t slots = num_tokens * cfg.top_k();
  const int e = cfg.num_local_experts();
  // Batch-invariant runs stay on single wgmma CTAs at every M (the stream GEMMs' warps split K;
  // a pair sums alike, but one kernel is what the mode promises).
  const std::int64_t active = std::min<std::int64_t>(e, slots);
  // Hopper runs the stream GEMMs' e4m3 mma.sync by emulation (converted to f16 for the tensor
  // cores): they measured 2-9% slower than the wgmma tiles on 6 of 8 decode cells, and won only
  // where those tiles leave most SMs idle (Qwen3-30B-A3B at one token: 48 GEMM1 items on 132
  // SMs, 27% faster; bench/NOTES.md, round 12). The narrow tiles measured faster still there,
  // so the stream GEMMs' rule now applies only where the narrow tiles are forced off.
  const int act_tile_cols = cfg.is_gated() ? fp8_down_cols / 2 : fp8_down_cols;
  const std::int64_t wgmma_gemm1_items = active * ((cfg.intermediate_size() + act_tile_cols - 1) / act_tile_cols);
  const bool narrow = settings.narrow.value_or(slots <= fp8_narrow_max_rows_per_expert * active);
  p.stream = !cfg.batch_invariant() && slots > 0 &&
             settings.stream.value_or(!narrow && slots <= stream_max_rows_per_expert * active &&
                                      2 * wgmma_gemm1_items < dev.sm_count);
  if (p.stream) {
    p.schedule_block_m = stream_gemm_fp8_policy::tuning.schedule_block_m();
  } else if (!cfg.batch_invariant() && active > 0 && narrow) {
    p.tile = fp8_tile::narrow;
    p.schedule_block_m = narrow_tokens_of(settings.narrow_tokens, slots, active, "make_fp8_plan");
  } else if (!cfg.batch_invariant() && active > 0 && settings.quads.value_or(false)) {
    p.tile = fp8_tile::m64x4;
    p.schedule_block_m = fp8_quad_block_m;
    p.cluster_m = fp8_quad_block_m / fp8_block_m;
  } else if (!cfg.batch_invariant() && active > 0 &&
             settings.pairs.value_or(slots >= fp8_pair_min_rows * active)) {
    p.tile = fp8_tile::m64x2;
    p.schedule_block_m = fp8_large_block_m;
    p.cluster_m = fp8_large_block_m / fp8_block_m;
  } else if (!cfg.batch_invariant() && active > 0 && settings.tall.value_or(false)) {
    p.tile = fp8_tile::m128;
    p.schedule_block_m = fp8_large_block_m;
  }
  // Up to local_plan_max_slots slots the decode GEMMs may order the rows themselves: no plan kernel.
  const bool local_plan = p.stream ? settings.schedule_in_gemms.value_or(true)
                                   : p.tile == fp8_tile::narrow && settings.schedule_in_gemms.value_or(false);
  p.schedule_in_gemms = local_plan && slots <= local_plan_max_slots;
  if (!p.stream && !cfg.batch_invariant()) {
    p.k_loop = settings.k_loop.value_or(settings.hand_out.value_or(false) ? fp8_k_loop::plain : fp8_k_loop::overlap);
    if (p.tile == fp8_tile::m128 || p.tile == fp8_tile::m64x4 || p.tile == fp8_tile::narrow)
      p.k_loop = fp8_k_loop::plain;
  }
  // The band orders the work items only (each item's sums are the same in any order).
  if (settings.raster_band) {
    if (*settings.raster_band < 1)
      throw invalid_argument_error("make_fp8_plan: raster_band must be positive, got " +
                                   std::to_string(*settings.raster_band));
    p.raster_band = *settings.raster_band;
  }
  down_store store = plan_detail::store_mode(cfg, p.stream ? gemm_family::stream : gemm_family::wgmma, slots,
                                             fp8_rows_store_max_intermediate);
  // Deterministic runs (batch-invariant ones are too) keep their rows, no_combine its slots.
  if (settings.down_rows && !p.stream && !cfg.deterministic() && store != down_store::slots)
    store = *settings.down_rows ? down_store::rows : down_store::accumulate;
  if (settings.down_k_splits && *settings.down_k_splits < 1)
    throw invalid_argument_error("make_fp8_plan: down_k_splits must be positive, got " +
                                 std::to_string(*settings.down_k_splits));
  if (!p.stream && !cfg.no_combine() && !cfg.batch_invariant() && num_tokens > 0) {
    p.down_k_splits = settings.down_k_splits
                          ? std::min(*settings.down_k_splits, (cfg.intermediate_size() + fp8_block_k - 1) / fp8_block_k)
                          : wgmma_down_k_splits(moe_m_tile_bound(slots, e, p.schedule_block_m), cfg.hidden_size(),
                                                cfg.intermediate_size(), dev.sm_count / p.cluster_m, fp8_down_cols,
                                                fp8_block_k);
  }
  p.down = store == down_store::rows && p.down_k_splits > 1 ? down_store::partials : store;
  p.combine_kernel = p.down == down_store::rows || p.down == down_store::partials;
  p.clear_in_gemm1 = !p.combine_kernel;
  p.hand_out = !p.stream && (p.tile == fp8_tile::m64 || p.tile == fp8_tile::m64x2) &&
               p.k_loop == fp8_k_loop::plain && num_tokens > 0 && settings.hand_out.value_or(false) &&
               hand_out_fits(cfg, slots, p.schedule_block_m, p.down_k_splits, dev.sm_count) &&
               hand_out_offsets_fit(moe_m_tile_capacity(slots, e, p.schedule_block_m) * p.schedule_block_m,
                                    std::max(cfg.hidden_size(), cfg.intermediate_size()));

  if (settings.up_k_splits && *settings.up_k_splits < 1)
    throw invalid_argument_error("make_fp8_plan: up_k_splits must be positive, got " +
                                 std::to_string(*settings.up_k_splits));
  if (!p.stream && p.tile == fp8_tile::m64 && !p.hand_out && !cfg.batch_invariant() && num_tokens > 0)
    p.up_k_splits = std::min(settings.up_k_splits.value_or(1), (cfg.hidden_size() + fp8_block_k - 1) / fp8_block_k);
  p.expert_bands = !p.schedule_in_gemms && !p.stream && num_tokens > 0 && settings.expert_bands.value_or(false);
  p.down_a_tma = !p.stream && p.tile != fp8_tile::narrow && num_tokens > 0 && settings.down_a_tma.value_or(true);
  p.staged_down = p.down_a_tma && (p.tile == fp8_tile::m64 || p.tile == fp8_tile::m64x2) && !p.hand_out &&
                  p.down != down_store::partials &&
                  settings.staged_down.value_or(!cfg.batch_invariant() &&
                                               cfg.intermediate_size() <= fp8_staged_max_k_tiles * fp8_block_k);
  p.staged_up = !p.stream && num_tokens > 0 && cfg.is_gated() && !cfg.batch_invariant() &&
                (p.tile == fp8_tile::m64 || p.tile == fp8_tile::m64x2) && !p.hand_out && p.up_k_splits == 1 &&
                settings.staged_up.value_or(false);
  p.dependent_gemms = !p.stream && num_tokens > 0 && settings.dependent_gemms.value_or(false);

  const auto m = static_cast<std::size_t>(num_tokens);
  const auto r = static_cast<std::size_t>(slots);
  const auto h = static_cast<std::size_t>(cfg.hidden_size()), inter = static_cast<std::size_t>(cfg.intermediate_size());
  const auto groups = [](std::size_t n) { return (n + fp8_group_size - 1) / fp8_group_size; };
  fp8_workspace& w = p.workspace;
  w.plan_bytes = plan_piece_bytes(routing_plan_bytes(num_tokens, cfg.top_k(), e));
  w.schedule = w.plan + w.plan_bytes;
  w.schedule_bytes = plan_piece_bytes(tile_schedule_bytes(slots, e, p.schedule_block_m));
  w.x_q = w.schedule + w.schedule_bytes;
  w.x_q_bytes = plan_piece_bytes(m * h);
  w.x_scale = w.x_q + w.x_q_bytes;
  w.x_scale_bytes = plan_piece_bytes(m * groups(h) * 4);
  w.act = w.x_scale + w.x_scale_bytes;
  w.act_bytes = plan_piece_bytes(r * inter);
  w.act_scale = w.act + w.act_bytes;
  w.act_scale_bytes = plan_piece_bytes(r * groups(inter) * 4);
  w.rows = w.act_scale + w.act_scale_bytes;
  if (p.down == down_store::rows) w.rows_bytes = plan_piece_bytes(r * h * 2);
  else if (p.down == down_store::partials) w.rows_bytes = plan_piece_bytes(static_cast<std::size_t>(p.down_k_splits) * r * h * 4);
  w.act_f32 = w.rows + w.rows_bytes;
  if (p.stream) w.act_f32_bytes = plan_piece_bytes(r * inter * 4);
  w.up_parts = w.act_f32 + w.act_f32_bytes;
  if (p.up_k_splits > 1)
    w.up_parts_bytes = plan_piece_bytes(static_cast<std::size_t>(p.up_k_splits) * r * (cfg.is_gated() ? 2 : 1) * inter * 4);
  w.total = w.up_parts + w.up_parts_bytes + plan_piece_alignment;
  return p;
}

}  // namespace moerunner::gpu
