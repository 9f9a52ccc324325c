// The cuda_fused backend's run plan: every choice one run makes for (config, M, device) as one
// value, computed in one place (make_fused_plan). The workspace query, the run, the tests and
// an engine's logs (describe) all read it; nothing else repeats its rules. Host arithmetic
// only: it builds with the host compiler and is tested without a GPU.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "moerunner/core/config.hpp"
#include "moerunner/core/error.hpp"
#include "moerunner/core/workspace_max.hpp"
#include "moerunner/gpu/grouped_gemm_tuning.hpp"
#include "moerunner/gpu/routing_plan.hpp"

namespace moerunner::gpu {

// What the plan reads of a device. Made from the device by gpu::device_target_of
// (sm90_grouped_gemm_wgmma.cuh), or written out to size a workspace for another device.
struct device_target {
  int code_arch = 0;       // virtual architecture of the kernel image the device runs (80, 90); 0: none
  bool has_wgmma = false;  // that image is sm_90a code (the wgmma and TMA kernels exist there only)
  int sm_count = 0;
  friend constexpr bool operator==(const device_target&, const device_target&) = default;
};

// The kernels that run both GEMMs.
enum class gemm_family : std::uint8_t {
  mma,     // mma.sync tiles of 128 x 128 (sm80 or sm90 tuning)
  wgmma,   // warp-specialized wgmma fed by TMA (sm_90a), tile by shape
  stream,  // decode: mma.sync with the weight rows as M, warp-private copy rings
};

constexpr std::string_view gemm_family_name(gemm_family f) {
  switch (f) {
    case gemm_family::mma: return "mma";
    case gemm_family::wgmma: return "wgmma";
    case gemm_family::stream: return "stream";
  }
  return "?";
}

constexpr std::string_view sm90_tile_name(sm90_tile t) {
  switch (t) {
    case sm90_tile::stream: return "stream";
    case sm90_tile::m64: return "m64";
    case sm90_tile::m64n128: return "m64n128";
    case sm90_tile::m128: return "m128";
    case sm90_tile::m128x2: return "m128x2";
    case sm90_tile::stream_ordered: return "ordered";
    case sm90_tile::narrow: return "narrow";
  }
  return "?";
}

constexpr std::string_view down_store_name(down_store d) {
  switch (d) {
    case down_store::rows: return "rows";
    case down_store::slots: return "slots";
    case down_store::accumulate: return "accumulate";
    case down_store::partials: return "partials";
  }
  return "?";
}

// The policy's own settings (cuda_fused_policy's setters), as the plan reads them.
struct fused_settings {
  gemm_tuning_choice tuning = gemm_tuning_choice::automatic;
  std::optional<bool> dependent_launch;  // unset: with the stream GEMMs only
  bool plan_in_gemms = true;
  std::optional<bool> gather_a;          // unset: with the 128-row wgmma tiles (prefill), long I
  std::optional<bool> hand_out;          // wgmma work items handed out at run time (unset: off)
  std::optional<bool> expert_bands = std::nullopt;  // wgmma items in expert bands (unset: off; expert_bands.hpp)
  std::optional<bool> down_a_tma = std::nullopt;    // wgmma GEMM2's A rows by TMA (unset: on)
  // The narrow decode tiles (sm90_tile::narrow) where the tile is chosen by shape (sm90_wgmma;
  // never batch-invariant): 256 weight rows as the wgmma's M and a tile's 8, 16 or 32 tokens as
  // its N (narrow_tile_tokens), so that a K tile's tensor work follows the tokens instead of a
  // 64-row tile's, with the wide tiles' K order and epilogue math. Only where asked (true) until
  // measured against the stream GEMMs they would replace at decode.
  std::optional<bool> narrow = std::nullopt;
  // The narrow tiles' tokens (8, 16 or 32) instead of narrow_tile_tokens' (for measuring a wider
  // N than the average rows ask).
  std::optional<int> narrow_tokens = std::nullopt;
};

// The narrow tiles' N: `forced` (8, 16 or 32; else refused, naming `where`) or narrow_tile_tokens'.
inline int narrow_tokens_of(std::optional<int> forced, std::int64_t slots, std::int64_t active, const char* where) {
  if (!forced) return narrow_tile_tokens(slots, active);
  if (*forced != 8 && *forced != 16 && *forced != 32)
    throw invalid_argument_error(std::string(where) + ": narrow_tokens must be 8, 16 or 32, got " +
                                 std::to_string(*forced));
  return *forced;
}

// Whether a wgmma run's work items can be handed out (hand_out_items_fit) in both GEMMs: every
// wgmma CTA covers 64 output columns or more, and K splits are GEMM2's only.
inline bool hand_out_fits(const MoeRunnerConfig& cfg, std::int64_t slots, int schedule_block_m, int down_k_splits,
                          int sm_count) {
  constexpr int min_cols = 64;
  const int widest = cfg.hidden_size() > cfg.intermediate_size() ? cfg.hidden_size() : cfg.intermediate_size();
  const std::int64_t work = moe_m_tile_capacity(slots, cfg.num_local_experts(), schedule_block_m) *
                            ((widest + min_cols - 1) / min_cols) * down_k_splits;
  return hand_out_items_fit(work, sm_count);
}

// GEMM1's A gathered into plan order for TMA only where the copy is cheap against GEMM1: it
// moves 4H bytes per slot (written, then read) against GEMM1's 4IH flops, about 170/I to 260/I
// of GEMM1's time at Hopper's bf16 rate per byte of DRAM. Measured in one run (H100): Mixtral-8x7B
// (I = 14336) 6-8% faster at 4096 and 16384 tokens, DeepSeek-V3 (I = 2048) and Qwen3-30B-A3B
// (I = 768) 7-9% slower. bench/NOTES.md, round 12.
inline constexpr int gather_a_min_intermediate = 8192;

// The workspace pieces, as byte offsets from the 256-byte aligned start; total includes the
// slack that aligns the start.
struct fused_workspace {
  std::size_t plan = 0, plan_bytes = 0;
  std::size_t schedule = 0, schedule_bytes = 0;
  std::size_t act = 0, act_bytes = 0;
  std::size_t rows = 0, rows_bytes = 0;  // GEMM2's rows or f32 K-split parts (combine reads them)
  std::size_t gathered = 0, gathered_bytes = 0;  // gather_a: x's rows in plan order [M*k, H]
  std::size_t strips = 0, strips_bytes = 0;  // combine_in_gemm2: a count per GEMM2 N tile
  std::size_t total = 0;
};

struct fused_plan {
  std::int64_t num_tokens = 0;
  gemm_tuning_choice choice = gemm_tuning_choice::automatic;  // the tuning that runs (never automatic)
  gemm_family family = gemm_family::mma;
  sm90_tile tile = sm90_tile::m128;  // wgmma and stream families: the tile
  sm90_tile down_tile = sm90_tile::m128;  // GEMM2's tile: `tile`, or 64 x 128 where GEMM2's items are few
  int schedule_block_m = 0;          // rows of one tile of the M-tile schedule
  int cluster_m = 1;                 // CTAs that run one work item together
  int down_k_splits = 1;             // GEMM2's K ranges over CTAs
  down_store down = down_store::accumulate;
  bool combine_kernel = false;     // a combine kernel sums GEMM2's rows or parts per token afterwards
  // The stream GEMM2's CTA that stores an N tile's last rows sums them per token instead (the
  // combine kernel's sums, no launch after GEMM2): where the GEMMs build the schedule (decode).
  bool combine_in_gemm2 = false;
  bool schedule_in_gemms = false;  // no plan kernel: each CTA orders the rows from topk_ids
  bool dependent_launch = false;   // programmatic dependent launches between the kernels
  bool clear_in_gemm1 = false;     // GEMM1 zeroes the output GEMM2 adds or scatters into
  bool memset_between = false;     // inplace: a memset zeroes it after GEMM1 has read x
  // wgmma GEMM1 loads A by TMA boxes from x's rows gathered in plan order by a kernel before
  // it (M*k*H*2 workspace bytes), instead of gathering them by cp.async: with the 128-row tiles
  // (prefill), where the cp.async gathers measured a third of the consumers' time waiting for
  // stages (bench/NOTES.md, round 10). Decode keeps M*k*I*2 + O(E) workspace.
  bool gather_a = false;
  // wgmma GEMM2 loads its A rows (act, which GEMM1 wrote in plan order) by TMA boxes too, instead
  // of by the producer's cp.async: no copy, no workspace (as fp8_plan's down_a_tma). Measured on
  // an H100 (bench/NOTES.md, round 26): Mixtral-8x7B and Qwen3-30B-A3B prefill 3-5% faster,
  // DeepSeek-V3 within one run's spread.
  bool down_a_tma = false;
  // wgmma: the work items handed out at run time, each cluster asking for the next as it starts
  // one (kernels/moerunner/kernels/sm90_work_items.cuh), instead of in fixed turns.
  bool hand_out = false;
  // wgmma: the M tiles that walk the N tiles together are one expert's (gpu/expert_bands.hpp:
  // each weight tile from HBM once per expert), not fixed bands that may mix two experts'.
  bool expert_bands = false;
  fused_workspace workspace;

  // One line for an engine's log: what runs and the workspace it takes.
  std::string describe() const {
    std::string s = "cuda_fused M=" + std::to_string(num_tokens) + ": " + std::string(gemm_family_name(family));
    if (family != gemm_family::mma) s += " " + std::string(sm90_tile_name(tile));
    s += " (tuning " + std::string(gemm_tuning_name(choice)) + ", schedule tiles of " +
         std::to_string(schedule_block_m) + " rows";
    if (cluster_m > 1) s += ", clusters of " + std::to_string(cluster_m);
    if (down_tile != tile) s += ", GEMM2 on " + std::string(sm90_tile_name(down_tile));
    s += "), ";
    s += schedule_in_gemms ? "schedule built in the GEMMs" : "plan kernel";
    s += ", GEMM2 " + std::string(down_store_name(down));
    if (down_k_splits > 1) s += " in " + std::to_string(down_k_splits) + " K splits";
    if (combine_kernel) s += " + combine kernel";
    if (combine_in_gemm2) s += " + combine in GEMM2";
    if (memset_between) s += ", output zeroed between the GEMMs";
    s += dependent_launch ? ", dependent launches" : ", plain launches";
    if (gather_a) s += ", A gathered for TMA";
    if (down_a_tma) s += ", GEMM2's A by TMA";
    if (hand_out) s += ", work items handed out";
    if (expert_bands) s += ", expert bands";
    s += "; workspace " + std::to_string(workspace.total) + " B (act " + std::to_string(workspace.act_bytes) +
         ", rows " + std::to_string(workspace.rows_bytes) + ", gathered x " + std::to_string(workspace.gathered_bytes) +
         ", plan + schedule " +
         std::to_string(workspace.plan_bytes + workspace.schedule_bytes) + ")";
    return s;
  }
};

namespace plan_detail {

// GEMM2's N tiles on the stream GEMMs (32 output columns each), a count each where it combines.
inline std::size_t combine_strips(int hidden_size) {
  constexpr int cols = stream_gemm_policy::tuning.block_n;
  static_assert(stream_gemm_ordered_policy::tuning.block_n == cols);
  return static_cast<std::size_t>((hidden_size + cols - 1) / cols);
}

// Without deterministic, the wgmma GEMM2 still writes rows for the combine kernel where its K
// (I) is short and the slots many: there its epilogue's packed reductions into the output weigh
// most against the main loop, and rows + combine measured faster (H200, bench/NOTES.md round 10:
// Qwen3-30B-A3B, I = 768, 5-8% from 4096 slots; DeepSeek-V3, I = 2048, within 1-3% either way;
// Mixtral-8x7B, I = 14336, the reductions 1-4% faster). It costs M*k*H*2 workspace bytes.
inline constexpr int rows_store_max_intermediate = 1024;
inline constexpr std::int64_t rows_store_min_slots = 4096;

// Where GEMM2 puts its rows before any K split: its token's slot (no_combine), a rows buffer the
// combine kernel sums in slot order (deterministic, or where that pays: K up to
// rows_max_intermediate), or added into the output.
inline down_store store_mode(const MoeRunnerConfig& cfg, gemm_family family, std::int64_t slots,
                             int rows_max_intermediate = rows_store_max_intermediate) {
  if (cfg.no_combine()) return down_store::slots;
  if (cfg.deterministic()) return down_store::rows;
  const bool rows_pay = family == gemm_family::wgmma && cfg.intermediate_size() <= rows_max_intermediate &&
                        slots >= rows_store_min_slots;
  return rows_pay ? down_store::rows : down_store::accumulate;
}

inline fused_workspace layout(const MoeRunnerConfig& cfg, std::int64_t num_tokens, down_store down, int splits,
                              bool gather_a, bool combine_in_gemm2) {
  const auto slots = static_cast<std::size_t>(num_tokens) * static_cast<std::size_t>(cfg.top_k());
  const int e = cfg.num_local_experts();
  fused_workspace w;
  w.plan_bytes = plan_piece_bytes(routing_plan_bytes(num_tokens, cfg.top_k(), e));
  w.schedule = w.plan + w.plan_bytes;
  // Sized for the smallest tile, so that any tuning's schedule fits.
  w.schedule_bytes = plan_piece_bytes(tile_schedule_bytes(static_cast<std::int64_t>(slots), e, moe_gemm_min_block_m));
  w.act = w.schedule + w.schedule_bytes;
  w.act_bytes = plan_piece_bytes(slots * static_cast<std::size_t>(cfg.intermediate_size()) * 2);
  w.rows = w.act + w.act_bytes;
  const std::size_t row_elems = slots * static_cast<std::size_t>(cfg.hidden_size());
  if (down == down_store::rows) w.rows_bytes = plan_piece_bytes(row_elems * 2);
  else if (down == down_store::partials) w.rows_bytes = plan_piece_bytes(static_cast<std::size_t>(splits) * row_elems * 4);
  w.gathered = w.rows + w.rows_bytes;
  if (gather_a) w.gathered_bytes = plan_piece_bytes(row_elems * 2);
  w.strips = w.gathered + w.gathered_bytes;
  if (combine_in_gemm2) w.strips_bytes = plan_piece_bytes(combine_strips(cfg.hidden_size()) * sizeof(std::int32_t));
  w.total = w.strips + w.strips_bytes + plan_piece_alignment;
  return w;
}

}  // namespace plan_detail

// The plan of one run over num_tokens tokens on `dev`. A forced tuning (settings.tuning) is
// planned as asked; whether the device can run it is the run's check.
inline fused_plan make_fused_plan(const MoeRunnerConfig& cfg, const fused_settings& settings, std::int64_t num_tokens,
                                  const device_target& dev) {
  fused_plan p;
  p.num_tokens = num_tokens;
  p.choice = settings.tuning == gemm_tuning_choice::automatic
                 ? select_gemm_tuning(dev.code_arch, dev.code_arch >= 90 && dev.has_wgmma)
                 : settings.tuning;
  const std::int64_t slots = num_tokens * cfg.top_k();
  const bool invariant = cfg.batch_invariant();
  if (p.choice == gemm_tuning_choice::stream || p.choice == gemm_tuning_choice::stream_ordered) {
    p.family = gemm_family::stream;
    p.tile = p.choice == gemm_tuning_choice::stream ? sm90_tile::stream : sm90_tile::stream_ordered;
  } else if (is_wgmma_choice(p.choice)) {
    switch (p.choice) {
      case gemm_tuning_choice::sm90_wgmma_m64: p.tile = sm90_tile::m64; break;
      case gemm_tuning_choice::sm90_wgmma_m64n128: p.tile = sm90_tile::m64n128; break;
      case gemm_tuning_choice::sm90_wgmma_m128: p.tile = sm90_tile::m128; break;
      case gemm_tuning_choice::sm90_wgmma_m128x2: p.tile = sm90_tile::m128x2; break;
      default: {
        // Batch-invariant: the wide wgmma tiles at every M (their K order is the same whatever the
        // tile), never the stream GEMMs, whose warps split K (the one form that does not, the
        // forced stream_ordered, measured slower than the wgmma tiles at decode), nor the narrow
        // tiles, whose GEMM2 splits K by M.
        const std::int64_t active = std::min<std::int64_t>(cfg.num_local_experts(), slots);
        const bool narrow = !invariant && active > 0 && settings.narrow.value_or(false);
        p.tile = narrow ? sm90_tile::narrow
                        : sm90_tile_for(slots, cfg.num_local_experts(), cfg.intermediate_size(), dev.sm_count,
                                        !invariant);
        if (narrow) p.schedule_block_m = narrow_tokens_of(settings.narrow_tokens, slots, active, "make_fused_plan");
      }
    }
    const bool stream = p.tile == sm90_tile::stream || p.tile == sm90_tile::stream_ordered;
    p.family = stream ? gemm_family::stream : gemm_family::wgmma;
  } else {
    p.family = gemm_family::mma;
  }
  if (p.family == gemm_family::mma) {
    p.schedule_block_m = p.choice == gemm_tuning_choice::sm90 ? sm90_gemm_policy::tuning.schedule_block_m()
                                                              : sm80_gemm_policy::tuning.schedule_block_m();
  } else if (p.tile != sm90_tile::narrow) {
    p.schedule_block_m = sm90_schedule_block_m(p.tile);
    p.cluster_m = sm90_cluster_m(p.tile);
  }
  const bool narrow = p.tile == sm90_tile::narrow;

  const down_store store = plan_detail::store_mode(cfg, p.family, slots);
  const std::int64_t tile_bound = moe_m_tile_bound(slots, cfg.num_local_experts(), p.schedule_block_m);
  // GEMM2's K splits: wgmma only, only when it combines, never batch-invariant (the split count
  // follows M), and only where its (M tile, N tile) items come in few waves (decode).
  if (p.family == gemm_family::wgmma && !cfg.no_combine() && !invariant && num_tokens > 0) {
    p.down_k_splits = wgmma_down_k_splits(tile_bound, cfg.hidden_size(), cfg.intermediate_size(),
                                          dev.sm_count / p.cluster_m, sm90_block_n(p.tile));
  }
  p.down = store == down_store::rows && p.down_k_splits > 1 ? down_store::partials : store;
  // GEMM2 on 64 x 128 tiles where, unsplit, its 64 x 256 items would fill at most half the SMs
  // (the rule GEMM1's tile follows, sm90_tile_for): batch-invariant decode, whose K order allows
  // no split (Mixtral-8x7B at one token: 32 items, 2 experts x 16 N tiles, on 132 SMs), and K too
  // short to split. Both tiles walk one schedule of 64-row tiles, and a tile's width does not
  // change any output's K order. Only where the plan chose the tile by shape.
  p.down_tile = p.tile;
  if (p.choice == gemm_tuning_choice::sm90_wgmma && p.tile == sm90_tile::m64 && p.down_k_splits == 1 &&
      num_tokens > 0) {
    const int cols = sm90_block_n(p.tile);
    const std::int64_t items = tile_bound * ((cfg.hidden_size() + cols - 1) / cols);
    if (2 * items <= dev.sm_count) p.down_tile = sm90_tile::m64n128;
  }
  p.schedule_in_gemms = (p.family == gemm_family::stream || narrow) && settings.plan_in_gemms &&
                        slots <= local_plan_max_slots;
  p.combine_in_gemm2 = p.schedule_in_gemms && p.family == gemm_family::stream && p.down == down_store::rows;
  p.combine_kernel = (p.down == down_store::rows || p.down == down_store::partials) && !p.combine_in_gemm2;
  p.dependent_launch = settings.dependent_launch.value_or(p.family == gemm_family::stream);
  // Rows summed per token (by a kernel or in GEMM2) write every output element: nothing to zero.
  const bool combines_rows = p.combine_kernel || p.combine_in_gemm2;
  p.clear_in_gemm1 = !combines_rows && !cfg.inplace();
  p.memset_between = !combines_rows && cfg.inplace();
  // The narrow tiles load A by cp.async and run in fixed turns.
  const bool large_tiles = p.family == gemm_family::wgmma && (p.tile == sm90_tile::m128 || p.tile == sm90_tile::m128x2);
  p.gather_a = p.family == gemm_family::wgmma && !narrow && num_tokens > 0 &&
               settings.gather_a.value_or(large_tiles && cfg.intermediate_size() >= gather_a_min_intermediate);
  p.down_a_tma = p.family == gemm_family::wgmma && !narrow && num_tokens > 0 && settings.down_a_tma.value_or(true);
  p.hand_out = p.family == gemm_family::wgmma && !narrow && num_tokens > 0 && settings.hand_out.value_or(false) &&
               hand_out_fits(cfg, slots, p.schedule_block_m, p.down_k_splits, dev.sm_count);
  p.expert_bands = p.family == gemm_family::wgmma && !p.schedule_in_gemms && num_tokens > 0 &&
                   settings.expert_bands.value_or(false);
  p.workspace = plan_detail::layout(cfg, num_tokens, p.down, p.down_k_splits, p.gather_a, p.combine_in_gemm2);
  return p;
}

// The largest workspace of the plans over 0..max_tokens tokens, `plan_of(m)` each (cuda_fused's
// and cuda_fused_fp8's: a run's need is not monotone in M, core/workspace_max.hpp). Refused past
// the tokens a run takes (num_tokens * top_k in 32 bits), which also bounds the scan.
template <class PlanOf>
std::size_t max_plan_workspace(const MoeRunnerConfig& cfg, std::int64_t max_tokens, PlanOf&& plan_of,
                               const char* where) {
  MOE_EXPECT(max_tokens <= 0x7fffffff / cfg.top_k(), where,
             "max_tokens * top_k must fit in 32 bits, as a run's num_tokens * top_k");
  return detail::max_workspace_over_tokens(
      max_tokens, [&](std::int64_t m) { return plan_of(m).workspace.total; }, where);
}

}  // namespace moerunner::gpu
