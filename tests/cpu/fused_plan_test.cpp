// The cuda_fused run plan (gpu::make_fused_plan): the one value the workspace query and the run
// both read, checked on the host for the devices it plans for.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <tuple>

#include "moerunner/core/workspace_max.hpp"
#include "moerunner/gpu/fp8_plan.hpp"
#include "moerunner/gpu/fused_plan.hpp"

namespace g = moerunner::gpu;
using moerunner::MoeRunnerConfig;
using moerunner::moe_config_params;

namespace {

constexpr g::device_target h200{.code_arch = 90, .has_wgmma = true, .sm_count = 132};

moe_config_params mixtral() { return {.num_experts = 8, .hidden_size = 4096, .intermediate_size = 14336, .top_k = 2}; }
moe_config_params qwen3() { return {.num_experts = 128, .hidden_size = 2048, .intermediate_size = 768, .top_k = 8}; }
moe_config_params deepseek() {
  return {.num_experts = 256, .hidden_size = 7168, .intermediate_size = 2048, .top_k = 8};
}

g::fused_plan plan_of(moe_config_params p, std::int64_t m, g::device_target dev = h200, g::fused_settings s = {}) {
  return g::make_fused_plan(MoeRunnerConfig(p), s, m, dev);
}

g::fused_settings with_gather(bool on) {
  g::fused_settings s;
  s.gather_a = on;
  return s;
}

g::fused_settings with_tuning(g::gemm_tuning_choice t) {
  g::fused_settings s;
  s.tuning = t;
  return s;
}

// The pieces follow each other, 256-byte aligned, and the total holds them and the start's slack.
void check_layout(const g::fused_plan& p, const moe_config_params& c) {
  const g::fused_workspace& w = p.workspace;
  const auto slots = static_cast<std::size_t>(p.num_tokens) * static_cast<std::size_t>(c.top_k);
  CHECK(w.plan == 0);
  CHECK(w.schedule == w.plan + w.plan_bytes);
  CHECK(w.act == w.schedule + w.schedule_bytes);
  CHECK(w.rows == w.act + w.act_bytes);
  CHECK(w.gathered == w.rows + w.rows_bytes);
  CHECK(w.strips == w.gathered + w.gathered_bytes);
  CHECK(w.total == w.strips + w.strips_bytes + g::plan_piece_alignment);
  for (std::size_t off : {w.schedule, w.act, w.rows, w.gathered, w.strips}) CHECK(off % g::plan_piece_alignment == 0);
  // A count per 32 output columns of GEMM2 where it combines its rows, none elsewhere.
  CHECK(w.strips_bytes == (p.combine_in_gemm2 ? g::plan_piece_bytes((c.hidden_size + 31) / 32 * 4) : 0));
  // Rows are summed once: by GEMM2's last CTAs (the stream GEMMs building the schedule), by a
  // kernel, or not at all.
  CHECK_FALSE((p.combine_in_gemm2 && p.combine_kernel));
  if (p.combine_in_gemm2) {
    CHECK(p.family == g::gemm_family::stream);
    CHECK(p.schedule_in_gemms);
    CHECK(p.down == g::down_store::rows);
    CHECK_FALSE(p.clear_in_gemm1);
    CHECK_FALSE(p.memset_between);
  }
  // x's rows gathered for GEMM1's TMA loads with the 128-row wgmma tiles only (prefill), where I
  // is long enough for the copy to be cheap.
  const bool large =
      p.family == g::gemm_family::wgmma && (p.tile == g::sm90_tile::m128 || p.tile == g::sm90_tile::m128x2);
  CHECK(p.gather_a == (large && p.num_tokens > 0 && c.intermediate_size >= g::gather_a_min_intermediate));
  if (p.gather_a) CHECK(w.gathered_bytes >= slots * static_cast<std::size_t>(c.hidden_size) * 2);
  else CHECK(w.gathered_bytes == 0);
  // GEMM2's A rows by TMA on every wide wgmma run (act is in plan order: no copy, no workspace).
  const bool narrow = p.tile == g::sm90_tile::narrow;
  CHECK(p.down_a_tma == (p.family == g::gemm_family::wgmma && !narrow && p.num_tokens > 0));
  if (narrow) {
    CHECK(p.family == g::gemm_family::wgmma);
    CHECK((p.schedule_block_m == 8 || p.schedule_block_m == 16 || p.schedule_block_m == 32));
    CHECK((!p.schedule_in_gemms || slots <= 64));  // up to 64 slots each CTA may order the rows
    CHECK_FALSE(p.combine_in_gemm2);
    CHECK_FALSE(p.hand_out);
    CHECK(p.cluster_m == 1);
  }
  CHECK(w.act_bytes >= slots * static_cast<std::size_t>(c.intermediate_size) * 2);
  const std::size_t row_elems = slots * static_cast<std::size_t>(c.hidden_size);
  switch (p.down) {
    case g::down_store::rows: CHECK(w.rows_bytes >= row_elems * 2); break;
    case g::down_store::partials: CHECK(w.rows_bytes >= row_elems * 4 * static_cast<std::size_t>(p.down_k_splits)); break;
    default: CHECK(w.rows_bytes == 0);
  }
}

}  // namespace

TEST_CASE("default runs: stream GEMMs with the schedule built in them at decode, 2-CTA wgmma tiles at prefill") {
  const g::fused_plan one = plan_of(qwen3(), 1);
  CHECK(one.choice == g::gemm_tuning_choice::sm90_wgmma);
  CHECK(one.family == g::gemm_family::stream);
  CHECK(one.schedule_in_gemms);  // 8 slots
  CHECK(one.dependent_launch);
  CHECK(one.down == g::down_store::accumulate);
  CHECK(one.clear_in_gemm1);
  CHECK_FALSE(one.combine_kernel);
  CHECK_FALSE(one.memset_between);
  check_layout(one, qwen3());

  const g::fused_plan nine = plan_of(qwen3(), 9);  // 72 slots: past the in-GEMM schedule's tables
  CHECK(nine.family == g::gemm_family::stream);
  CHECK_FALSE(nine.schedule_in_gemms);

  const g::fused_plan big = plan_of(mixtral(), 4096);
  CHECK(big.family == g::gemm_family::wgmma);
  CHECK(big.tile == g::sm90_tile::m128x2);
  CHECK(big.cluster_m == 2);
  CHECK(big.schedule_block_m == 256);
  CHECK(big.down_k_splits == 1);
  CHECK_FALSE(big.dependent_launch);
  check_layout(big, mixtral());
  CHECK(big.gather_a);
  const std::string line = big.describe();
  CHECK(line.find("wgmma m128x2") != std::string::npos);
  CHECK(line.find("A gathered for TMA") != std::string::npos);
  // Forced either way (the setting only measures it); never on the other families.
  CHECK_FALSE(plan_of(mixtral(), 4096, h200, with_gather(false)).gather_a);
  CHECK(plan_of(mixtral(), 64, h200, with_gather(true)).gather_a);
  CHECK_FALSE(plan_of(qwen3(), 1, h200, with_gather(true)).gather_a);
  // Short I: the large tiles without the copy (4H bytes per slot against GEMM1's 4IH flops).
  const g::fused_plan short_i = plan_of(qwen3(), 4096);
  CHECK((short_i.tile == g::sm90_tile::m128 || short_i.tile == g::sm90_tile::m128x2));
  CHECK_FALSE(short_i.gather_a);
  check_layout(short_i, qwen3());
  CHECK(plan_of(qwen3(), 4096, h200, with_gather(true)).gather_a);
  CHECK(line.find("GEMM2's A by TMA") != std::string::npos);
  // GEMM2's A by TMA forced off (measuring only); the workspace is the same either way.
  g::fused_settings no_tma;
  no_tma.down_a_tma = false;
  const g::fused_plan copies = plan_of(mixtral(), 4096, h200, no_tma);
  CHECK_FALSE(copies.down_a_tma);
  CHECK(copies.describe().find("GEMM2's A by TMA") == std::string::npos);
  CHECK(copies.workspace.total == big.workspace.total);
  CHECK_FALSE(plan_of(qwen3(), 1).down_a_tma);  // the stream GEMMs
  CHECK(line.find("M=4096") != std::string::npos);
  CHECK(line.find(std::to_string(big.workspace.total)) != std::string::npos);
}

TEST_CASE("narrow wgmma tiles where asked: N the smallest of 8, 16, 32 that holds the average rows") {
  g::fused_settings on;
  on.narrow = true;
  const g::fused_plan one = plan_of(qwen3(), 1, h200, on);
  CHECK(one.choice == g::gemm_tuning_choice::sm90_wgmma);
  CHECK(one.family == g::gemm_family::wgmma);
  CHECK(one.tile == g::sm90_tile::narrow);
  CHECK(one.schedule_block_m == 8);
  CHECK(one.schedule_in_gemms);  // 8 slots: each CTA orders the rows, no plan kernel
  CHECK_FALSE(one.dependent_launch);
  CHECK(one.down == g::down_store::accumulate);
  CHECK(one.clear_in_gemm1);
  CHECK_FALSE(one.combine_kernel);
  CHECK(one.describe().find("wgmma narrow (tuning sm90_wgmma, schedule tiles of 8 rows), schedule built in the GEMMs") !=
        std::string::npos);
  check_layout(one, qwen3());
  g::fused_settings plan_kernel = on;
  plan_kernel.plan_in_gemms = false;
  CHECK_FALSE(plan_of(qwen3(), 1, h200, plan_kernel).schedule_in_gemms);
  CHECK_FALSE(plan_of(qwen3(), 9, h200, on).schedule_in_gemms);  // 72 slots
  for (const auto& [c, m, n] : {std::tuple{qwen3(), 64, 8}, std::tuple{deepseek(), 256, 8}, std::tuple{mixtral(), 32, 8},
                                std::tuple{mixtral(), 64, 16}, std::tuple{deepseek(), 512, 16},
                                std::tuple{mixtral(), 4096, 32}}) {
    CAPTURE(m);
    const g::fused_plan p = plan_of(c, m, h200, on);
    CHECK(p.tile == g::sm90_tile::narrow);
    CHECK(p.schedule_block_m == n);
    check_layout(p, c);
  }
  // N forced (measuring a wider tile than the average rows ask); a count no wgmma takes is refused.
  g::fused_settings wide_n = on;
  wide_n.narrow_tokens = 32;
  CHECK(plan_of(mixtral(), 64, h200, wide_n).schedule_block_m == 32);
  check_layout(plan_of(mixtral(), 64, h200, wide_n), mixtral());
  wide_n.narrow_tokens = 24;
  CHECK_THROWS_WITH_AS(plan_of(mixtral(), 64, h200, wide_n), "make_fused_plan: narrow_tokens must be 8, 16 or 32, got 24",
                       moerunner::invalid_argument_error);
  g::fused_settings unread;
  unread.narrow_tokens = 24;
  CHECK(plan_of(mixtral(), 64, h200, unread).tile == g::sm90_tile::m64);  // not taken: not read
  const g::fp8_plan f8 = g::make_fp8_plan(MoeRunnerConfig(deepseek()), 512, h200, {.narrow = true, .narrow_tokens = 32});
  CHECK(f8.tile == g::fp8_tile::narrow);
  CHECK(f8.schedule_block_m == 32);
  CHECK_THROWS_WITH_AS(g::make_fp8_plan(MoeRunnerConfig(deepseek()), 1, h200, {.narrow_tokens = 12}),
                       "make_fp8_plan: narrow_tokens must be 8, 16 or 32, got 12", moerunner::invalid_argument_error);
  // Deterministic: rows, or the f32 parts of a K split, that the combine kernel sums.
  moe_config_params det = qwen3();
  det.deterministic = true;
  const g::fused_plan rows = plan_of(det, 1, h200, on);
  CHECK(rows.tile == g::sm90_tile::narrow);
  CHECK((rows.down == g::down_store::rows || rows.down == g::down_store::partials));
  CHECK(rows.combine_kernel);
  CHECK_FALSE(rows.combine_in_gemm2);
  check_layout(rows, det);
  // Never batch-invariant, nor where a tuning is forced, nor without tokens; off unless asked.
  moe_config_params inv = qwen3();
  inv.batch_invariant = true;
  CHECK(plan_of(inv, 1, h200, on).tile == g::sm90_tile::m64n128);
  g::fused_settings forced = with_tuning(g::gemm_tuning_choice::sm90_wgmma_m64);
  forced.narrow = true;
  CHECK(plan_of(qwen3(), 1, h200, forced).tile == g::sm90_tile::m64);
  CHECK(plan_of(qwen3(), 0, h200, on).tile != g::sm90_tile::narrow);
  for (std::int64_t m : {1, 8, 64, 512}) CHECK(plan_of(qwen3(), m).tile != g::sm90_tile::narrow);
}

TEST_CASE("deterministic decode: GEMM2's last CTA of each N tile sums the rows where the GEMMs build the schedule") {
  // The stream GEMMs as the plan picks them with the narrow tiles off, and their form with K in
  // order (forced).
  for (const g::gemm_tuning_choice tuning : {g::gemm_tuning_choice::automatic, g::gemm_tuning_choice::stream_ordered}) {
    CAPTURE(g::gemm_tuning_name(tuning));
    const bool ordered = tuning == g::gemm_tuning_choice::stream_ordered;
    moe_config_params c = qwen3();
    c.deterministic = true;
    g::fused_settings s = with_tuning(tuning);
    s.narrow = false;
    const g::fused_plan one = plan_of(c, 1, h200, s);  // 8 slots
    CHECK(one.family == g::gemm_family::stream);
    CHECK(one.tile == (ordered ? g::sm90_tile::stream_ordered : g::sm90_tile::stream));
    CHECK(one.schedule_in_gemms);
    CHECK(one.down == g::down_store::rows);
    CHECK(one.combine_in_gemm2);
    CHECK_FALSE(one.combine_kernel);
    CHECK(one.workspace.strips_bytes == g::plan_piece_bytes(2048 / 32 * 4));
    CHECK(one.describe().find("GEMM2 rows + combine in GEMM2") != std::string::npos);
    check_layout(one, c);
    // 72 slots: the plan kernel orders the rows, and the combine kernel sums them.
    const g::fused_plan nine = plan_of(c, 9, h200, s);
    CHECK(nine.family == g::gemm_family::stream);
    CHECK_FALSE(nine.combine_in_gemm2);
    CHECK(nine.combine_kernel);
    // So does a runner told to build the schedule in a plan kernel.
    g::fused_settings plan_kernel = s;
    plan_kernel.plan_in_gemms = false;
    CHECK_FALSE(plan_of(c, 1, h200, plan_kernel).combine_in_gemm2);
    CHECK(plan_of(c, 1, h200, plan_kernel).combine_kernel);
    // no_combine stores to the slots: nothing to sum.
    c.no_combine = true;
    CHECK_FALSE(plan_of(c, 1, h200, s).combine_in_gemm2);
    CHECK_FALSE(plan_of(c, 1, h200, s).combine_kernel);
  }
  // Batch-invariant decode runs the wgmma tiles, whose rows the combine kernel sums.
  moe_config_params inv = qwen3();
  inv.batch_invariant = true;
  const g::fused_plan one = plan_of(inv, 1);
  CHECK(one.family == g::gemm_family::wgmma);
  CHECK_FALSE(one.combine_in_gemm2);
  CHECK(one.combine_kernel);
  check_layout(one, inv);
}

TEST_CASE("without deterministic, GEMM2 writes rows for the combine kernel where its K is short and slots many") {
  // Qwen3-30B-A3B (I = 768): rows from 4096 slots; Mixtral-8x7B (I = 14336): always the reductions.
  const g::fused_plan few = plan_of(qwen3(), 511);  // 4088 slots
  CHECK(few.down == g::down_store::accumulate);
  const g::fused_plan many = plan_of(qwen3(), 512);
  CHECK(many.family == g::gemm_family::wgmma);
  CHECK(many.down == g::down_store::rows);
  CHECK(many.combine_kernel);
  CHECK_FALSE(many.clear_in_gemm1);
  check_layout(many, qwen3());
  CHECK(plan_of(mixtral(), 16384).down == g::down_store::accumulate);
  // Only the wgmma kernels were measured so: the mma.sync family keeps the reductions.
  CHECK(plan_of(qwen3(), 512, {.code_arch = 80, .has_wgmma = false, .sm_count = 108}).down ==
        g::down_store::accumulate);
}

TEST_CASE("deterministic decode on the wgmma tiles splits GEMM2's K into f32 parts; batch-invariant never splits") {
  moe_config_params det = mixtral();
  det.deterministic = true;
  // 64 tokens: 16 rows per expert, 64-row tiles, GEMM2's 160 items on 132 SMs.
  const g::fused_plan p = plan_of(det, 64);
  CHECK(p.tile == g::sm90_tile::m64);
  CHECK(p.down_k_splits == 4);
  CHECK(p.down == g::down_store::partials);
  CHECK(p.combine_kernel);
  CHECK_FALSE(p.clear_in_gemm1);
  check_layout(p, det);
  CHECK(p.describe().find("4 K splits") != std::string::npos);

  moe_config_params inv = mixtral();
  inv.batch_invariant = true;
  CHECK(MoeRunnerConfig(inv).deterministic());  // implied
  const g::fused_plan q = plan_of(inv, 64);
  CHECK(q.tile == g::sm90_tile::m64);
  CHECK(q.down_k_splits == 1);
  CHECK(q.down == g::down_store::rows);
  CHECK(q.combine_kernel);
  check_layout(q, inv);
}

TEST_CASE("batch-invariant runs stay on the wgmma kernels at every M, with GEMM2 rows summed in slot order") {
  for (const moe_config_params base : {mixtral(), qwen3()}) {
    moe_config_params inv = base;
    inv.batch_invariant = true;
    for (std::int64_t m : {1, 2, 7, 8, 64, 512, 4096, 16384}) {
      CAPTURE(m);
      const g::fused_plan p = plan_of(inv, m);
      CHECK(p.family == g::gemm_family::wgmma);
      CHECK(p.tile != g::sm90_tile::stream);
      CHECK(p.down_k_splits == 1);
      CHECK(p.down == g::down_store::rows);
      CHECK_FALSE(p.schedule_in_gemms);
      // The default at the same M may take the stream GEMMs or the narrow tiles; it never changes
      // the tile rule above.
      const g::fused_plan d = plan_of(base, m);
      if (d.family == g::gemm_family::wgmma && d.tile != g::sm90_tile::narrow) CHECK(d.tile == p.tile);
    }
  }
  // no_combine stores each row to its slot: batch-invariant without a combine kernel.
  moe_config_params nc = qwen3();
  nc.batch_invariant = true;
  nc.no_combine = true;
  const g::fused_plan p = plan_of(nc, 64);
  CHECK(p.down == g::down_store::slots);
  CHECK_FALSE(p.combine_kernel);
  CHECK(p.clear_in_gemm1);
}

TEST_CASE("GEMM2 splits K only where its items come in at most two waves") {
  // Mixtral-8x7B at 1024 tokens: up to 24 128-row tiles x 16 N tiles = 384 items, 2.9 waves on
  // 132 SMs. Splitting 11 ways would shorten the last wave by 3% and multiply the output's
  // reductions (deterministic: 369 MB of f32 parts) by 11: no split.
  for (bool det : {false, true}) {
    moe_config_params c = mixtral();
    c.deterministic = det;
    CAPTURE(det);
    const g::fused_plan p = plan_of(c, 1024);
    CHECK(p.family == g::gemm_family::wgmma);
    CHECK(p.down_k_splits == 1);
    CHECK(p.down == (det ? g::down_store::rows : g::down_store::accumulate));
    check_layout(p, c);
    CHECK(plan_of(c, 64).down_k_splits == 4);  // 160 items, 1.2 waves: split
  }
  CHECK(g::wgmma_down_k_splits(24, 4096, 14336, 132) == 1);
  CHECK(g::wgmma_down_k_splits(10, 4096, 14336, 132) == 4);
  CHECK(g::wgmma_down_k_splits(24, 4096, 14336, 132, 256, 64, 4) > 1);  // four waves allowed: the old rule
}

TEST_CASE("GEMM2 on 64 x 128 tiles where its unsplit items would fill at most half the SMs") {
  // Batch-invariant Mixtral-8x7B at one token: GEMM1's 224 items take 64 x 256 tiles, GEMM2's
  // would be 32 (2 experts x 16 N tiles) and may not split: 64 x 128 doubles them.
  moe_config_params inv = mixtral();
  inv.batch_invariant = true;
  const g::fused_plan one = plan_of(inv, 1);
  CHECK(one.tile == g::sm90_tile::m64);
  CHECK(one.down_tile == g::sm90_tile::m64n128);
  CHECK(one.down_k_splits == 1);
  CHECK(one.describe().find("GEMM2 on m64n128") != std::string::npos);
  check_layout(one, inv);
  // Eight tokens reach every expert: 8 x 16 = 128 items, nearly a wave already.
  CHECK(plan_of(inv, 8).down_tile == g::sm90_tile::m64);
  // The default run at 64 tokens splits K instead; a forced tuning keeps its tile for both GEMMs.
  CHECK(plan_of(mixtral(), 64).down_tile == g::sm90_tile::m64);
  CHECK(plan_of(inv, 1, h200, with_tuning(g::gemm_tuning_choice::sm90_wgmma_m64)).down_tile == g::sm90_tile::m64);
  // Of the benchmark's cells only that one changes: every other plan runs GEMM2 on GEMM1's tile.
  for (const moe_config_params& base : {mixtral(), qwen3(), deepseek()})
    for (int mode = 0; mode < 3; ++mode) {
      moe_config_params c = base;
      c.deterministic = mode == 1;
      c.batch_invariant = mode == 2;
      for (std::int64_t m : {1, 8, 64, 512, 4096, 16384}) {
        CAPTURE(m);
        CAPTURE(mode);
        const g::fused_plan p = plan_of(c, m);
        const bool changed = c.batch_invariant && c.num_experts == 8 && m == 1;
        CHECK((p.down_tile != p.tile) == changed);
      }
    }
}

TEST_CASE("the device decides the family: no device, sm_80 code, sm_90 code without wgmma") {
  const g::fused_plan none = plan_of(qwen3(), 64, g::device_target{});
  CHECK(none.choice == g::gemm_tuning_choice::sm80);
  CHECK(none.family == g::gemm_family::mma);
  CHECK(none.down_k_splits == 1);
  CHECK(none.schedule_block_m == 128);
  const g::fused_plan a100 = plan_of(qwen3(), 64, {.code_arch = 80, .has_wgmma = false, .sm_count = 108});
  CHECK(a100.choice == g::gemm_tuning_choice::sm80);
  const g::fused_plan sm90 = plan_of(qwen3(), 64, {.code_arch = 90, .has_wgmma = false, .sm_count = 132});
  CHECK(sm90.choice == g::gemm_tuning_choice::sm90);
  CHECK(sm90.family == g::gemm_family::mma);
  // A forced tuning is planned as asked; the run checks the device can take it.
  const g::fused_plan forced =
      plan_of(qwen3(), 64, {.code_arch = 80, .sm_count = 108}, with_tuning(g::gemm_tuning_choice::stream));
  CHECK(forced.family == g::gemm_family::stream);
  CHECK(forced.schedule_block_m == g::moe_gemm_min_block_m);
  const g::fused_plan m128 =
      plan_of(qwen3(), 1, h200, with_tuning(g::gemm_tuning_choice::sm90_wgmma_m128));
  CHECK(m128.family == g::gemm_family::wgmma);
  CHECK(m128.tile == g::sm90_tile::m128);
}

TEST_CASE("the workspace follows the device: one sized for a MIG slice is too small on the whole GPU") {
  moe_config_params det = mixtral();
  det.deterministic = true;
  const g::fused_plan full = plan_of(det, 64);
  const g::fused_plan slice = plan_of(det, 64, {.code_arch = 90, .has_wgmma = true, .sm_count = 16});
  CHECK(slice.down_k_splits == 1);  // 160 items fill 16 SMs: no split
  CHECK(full.down_k_splits > 1);
  CHECK(slice.workspace.total < full.workspace.total);
  check_layout(slice, det);
}

TEST_CASE("settings: dependent launches and the in-GEMM schedule as set") {
  const g::fused_plan p = plan_of(qwen3(), 1, h200,
                                  {.dependent_launch = false, .plan_in_gemms = false, .gather_a = std::nullopt,
                                   .hand_out = std::nullopt, .narrow = false});
  CHECK(p.family == g::gemm_family::stream);
  CHECK_FALSE(p.dependent_launch);
  CHECK_FALSE(p.schedule_in_gemms);
  CHECK(p.describe().find("plan kernel") != std::string::npos);
  moe_config_params inplace = qwen3();
  inplace.inplace = true;
  const g::fused_plan q = plan_of(inplace, 64);
  CHECK(q.memset_between);
  CHECK_FALSE(q.clear_in_gemm1);
  CHECK(q.describe().find("zeroed between") != std::string::npos);
  const g::fused_plan zero = plan_of(qwen3(), 0);
  check_layout(zero, qwen3());
}

// ---- cuda_fused_fp8 (gpu::make_fp8_plan)

namespace {

void check_fp8_layout(const g::fp8_plan& p, const moe_config_params& c) {
  const g::fp8_workspace& w = p.workspace;
  const auto m = static_cast<std::size_t>(p.num_tokens);
  const auto slots = m * static_cast<std::size_t>(c.top_k);
  const auto h = static_cast<std::size_t>(c.hidden_size), inter = static_cast<std::size_t>(c.intermediate_size);
  CHECK(w.schedule == w.plan + w.plan_bytes);
  CHECK(w.x_q == w.schedule + w.schedule_bytes);
  CHECK(w.x_scale == w.x_q + w.x_q_bytes);
  CHECK(w.act == w.x_scale + w.x_scale_bytes);
  CHECK(w.act_scale == w.act + w.act_bytes);
  CHECK(w.rows == w.act_scale + w.act_scale_bytes);
  CHECK(w.act_f32 == w.rows + w.rows_bytes);
  CHECK(w.total == w.act_f32 + w.act_f32_bytes + g::plan_piece_alignment);
  for (std::size_t off : {w.schedule, w.x_q, w.x_scale, w.act, w.act_scale, w.rows, w.act_f32})
    CHECK(off % g::plan_piece_alignment == 0);
  if (p.stream) CHECK(w.act_f32_bytes >= slots * inter * 4);
  else CHECK(w.act_f32_bytes == 0);
  CHECK(w.x_q_bytes >= m * h);
  CHECK(w.x_scale_bytes >= m * (h / 128) * 4);
  CHECK(w.act_bytes >= slots * inter);
  CHECK(w.act_scale_bytes >= slots * (inter / 128) * 4);
  CHECK(w.schedule_bytes >= g::tile_schedule_bytes(static_cast<std::int64_t>(slots), c.num_experts, p.schedule_block_m));
  switch (p.down) {
    case g::down_store::rows: CHECK(w.rows_bytes >= slots * h * 2); break;
    case g::down_store::partials: CHECK(w.rows_bytes >= slots * h * 4 * static_cast<std::size_t>(p.down_k_splits)); break;
    default: CHECK(w.rows_bytes == 0);
  }
}

g::fp8_plan fp8_plan_of(moe_config_params p, std::int64_t m, g::device_target dev = h200,
                        const g::fp8_settings& s = {}) {
  return g::make_fp8_plan(MoeRunnerConfig(p), m, dev, s);
}

// The plan of a run with settings forced.
g::fp8_plan fp8_plan_with(const moe_config_params& c, std::int64_t m, const g::fp8_settings& s) {
  return g::make_fp8_plan(MoeRunnerConfig(c), m, h200, s);
}

// Qwen3-30B-A3B's shape with an ungated GEMM1 (gelu).
moe_config_params ungated_qwen3() {
  moe_config_params c = qwen3();
  c.act.kind = moerunner::activation_kind::gelu;
  c.is_gated = false;
  return c;
}

}  // namespace

TEST_CASE("fp8 plan: narrow tiles up to 8 rows per expert, pairs of CTAs from 96 rows per expert, K split where items come in few waves") {
  for (const moe_config_params& c : {mixtral(), qwen3(), deepseek()})
    for (std::int64_t m : {0, 1, 7, 64, 512, 4096, 16384}) {
      CAPTURE(c.num_experts);
      CAPTURE(m);
      const g::fp8_plan p = fp8_plan_of(c, m);
      // Narrow tiles of 8 tokens where the active experts average at most 8 rows (the stream
      // GEMMs only where forced); pairs of CTAs on 128-row tiles where the experts average at
      // least 96 rows; 128-row CTAs only when asked.
      const std::int64_t slots = m * c.top_k, active = std::min<std::int64_t>(slots, c.num_experts);
      const bool pair = active > 0 && slots >= 96 * active;
      const bool narrow = active > 0 && slots <= 8 * active;
      CHECK_FALSE(p.stream);
      CHECK(p.schedule_block_m == (narrow ? 8 : pair ? 128 : 64));
      CHECK(p.cluster_m == (pair ? 2 : 1));
      CHECK(p.tile == (narrow ? g::fp8_tile::narrow : pair ? g::fp8_tile::m64x2 : g::fp8_tile::m64));
      CHECK(p.describe().find(p.stream ? "stream e4m3" : "wgmma e4m3 " + std::string(g::fp8_tile_name(p.tile))) !=
            std::string::npos);
      CHECK(p.schedule_in_gemms == (p.stream && slots <= 64));
      // The narrow tiles order the rows themselves only where asked (up to 64 slots).
      g::fp8_settings local;
      local.schedule_in_gemms = true;
      const g::fp8_plan q = g::make_fp8_plan(MoeRunnerConfig(c), m, h200, local);
      CHECK(q.tile == p.tile);
      CHECK(q.schedule_in_gemms == (p.tile == g::fp8_tile::narrow && slots <= 64));
      CHECK((q.describe().find("built in the GEMMs") != std::string::npos) == q.schedule_in_gemms);
      check_fp8_layout(q, c);
      check_fp8_layout(p, c);
      CHECK(p.describe().find("cuda_fused_fp8 M=" + std::to_string(m)) == 0);
      // A split keeps at least 4 K tiles of 128; the stream GEMMs never split across CTAs.
      CHECK(p.down_k_splits <= std::max(1, c.intermediate_size / 128 / 4));
      if (m >= 512 || p.stream) CHECK(p.down_k_splits == 1);  // items in more than two waves
    }
  // Pairs from an average of 96 rows per active expert, on a shape the loop above does not name.
  const moe_config_params other{.num_experts = 64, .hidden_size = 3072, .intermediate_size = 1536, .top_k = 6};
  CHECK(fp8_plan_of(other, 1024).tile == g::fp8_tile::m64x2);  // 6144 slots = 96 x 64
  CHECK(fp8_plan_of(other, 1023).tile == g::fp8_tile::m64);
  CHECK(fp8_plan_of(other, 1023).cluster_m == 1);
  // With the narrow tiles forced off, the stream GEMMs' rule: of the benchmark's cells only
  // Qwen3-30B-A3B at one token (8 experts x 6 act tiles: 48 wgmma items on 132 SMs); DeepSeek-V3
  // at one token would give 128, Mixtral-8x7B 224, and a 32-SM device part streams Qwen3 at no
  // token count.
  const g::fp8_settings wide{.narrow = false};
  CHECK(fp8_plan_of(qwen3(), 1, h200, wide).stream);
  for (std::int64_t m : {1, 8, 64}) {
    CHECK_FALSE(fp8_plan_of(mixtral(), m, h200, wide).stream);
    CHECK_FALSE(fp8_plan_of(deepseek(), m, h200, wide).stream);
  }
  CHECK_FALSE(fp8_plan_of(qwen3(), 8, h200, wide).stream);
  CHECK_FALSE(fp8_plan_of(qwen3(), 1, {.code_arch = 90, .has_wgmma = true, .sm_count = 32}, wide).stream);
  // Mixtral-8x7B at 64 tokens: 8 experts' 64-row tiles x 16 N tiles come in two waves on 132
  // SMs; splitting K evens them out, and the parts meet in the output's reductions.
  const g::fp8_plan x64 = fp8_plan_of(mixtral(), 64);
  CHECK(x64.down_k_splits > 1);
  CHECK(x64.down == g::down_store::accumulate);
  CHECK(x64.clear_in_gemm1);
  CHECK_FALSE(x64.combine_kernel);
}

TEST_CASE("fp8 plan: the stream GEMMs, pairs, fours and 128-row CTAs forced on or off (for measuring one against the other)") {
  const auto forced = [](const moe_config_params& c, std::int64_t m, g::fp8_settings s) {
    const g::fp8_plan p = g::make_fp8_plan(MoeRunnerConfig(c), m, h200, s);
    check_fp8_layout(p, c);
    return p;
  };
  // Decode on the wide wgmma tiles, prefill on the stream GEMMs (the schedule then from the plan kernel).
  const g::fp8_plan wgmma_decode = forced(qwen3(), 1, {.stream = false, .pairs = std::nullopt, .narrow = false});
  CHECK_FALSE(wgmma_decode.stream);
  CHECK(wgmma_decode.schedule_block_m == 64);
  CHECK(wgmma_decode.workspace.act_f32_bytes == 0);
  CHECK(wgmma_decode.describe().find("wgmma e4m3") != std::string::npos);
  const g::fp8_plan stream_prefill = forced(mixtral(), 512, {.stream = true, .pairs = std::nullopt});
  CHECK(stream_prefill.stream);
  CHECK_FALSE(stream_prefill.schedule_in_gemms);  // 1024 slots: more than the GEMMs order themselves
  CHECK(stream_prefill.schedule_block_m == 8);
  CHECK(stream_prefill.describe().find("stream e4m3") != std::string::npos);
  CHECK_FALSE(forced(mixtral(), 0, {.stream = true, .pairs = std::nullopt}).stream);  // nothing to run
  CHECK(forced(qwen3(), 1, {.stream = true, .pairs = std::nullopt}).schedule_in_gemms);
  CHECK_FALSE(forced(qwen3(), 1, {.stream = true, .pairs = std::nullopt, .schedule_in_gemms = false}).schedule_in_gemms);
  // Pairs off where the rule pairs, on where it would not.
  CHECK(fp8_plan_of(mixtral(), 16384).cluster_m == 2);  // 4096 rows per expert
  const g::fp8_plan single = forced(mixtral(), 16384, {.stream = std::nullopt, .pairs = false, .tall = false});
  CHECK(single.cluster_m == 1);
  CHECK(single.schedule_block_m == 64);
  CHECK(single.tile == g::fp8_tile::m64);
  CHECK(forced(mixtral(), 16384, {.stream = std::nullopt, .pairs = false}).tile == g::fp8_tile::m64);
  // 128-row CTAs only when asked, wherever the stream GEMMs and pairs are not taken.
  const g::fp8_plan tall = forced(qwen3(), 512, {.tall = true});
  CHECK(tall.tile == g::fp8_tile::m128);
  CHECK(tall.cluster_m == 1);
  CHECK(tall.schedule_block_m == 128);
  CHECK(fp8_plan_of(qwen3(), 512).tile == g::fp8_tile::m64);
  const g::fp8_plan forced_tall = forced(mixtral(), 64, {.tall = true});
  CHECK(forced_tall.tile == g::fp8_tile::m128);
  CHECK(forced_tall.schedule_block_m == 128);
  CHECK(forced(mixtral(), 64, {.pairs = true, .tall = true}).tile == g::fp8_tile::m64x2);  // pairs first
  const g::fp8_plan paired = forced(mixtral(), 64, {.stream = std::nullopt, .pairs = true});
  CHECK(paired.cluster_m == 2);
  CHECK(paired.schedule_block_m == 128);
  CHECK(forced(qwen3(), 1, {.stream = std::nullopt, .pairs = true, .narrow = false}).stream);  // the stream GEMMs first
  // Fours of CTAs only when asked, before pairs, on 256-row tiles with the plain K loop in fixed turns.
  const g::fp8_plan fours = forced(mixtral(), 4096, {.pairs = true, .quads = true});
  CHECK(fours.tile == g::fp8_tile::m64x4);
  CHECK(fours.cluster_m == 4);
  CHECK(fours.schedule_block_m == 256);
  CHECK(fours.describe().find("wgmma e4m3 m64x4") != std::string::npos);
  const g::fp8_plan fours_asked_more =
      forced(mixtral(), 4096, {.quads = true, .k_loop = g::fp8_k_loop::overlap, .hand_out = true});
  CHECK(fours_asked_more.k_loop == g::fp8_k_loop::plain);
  CHECK_FALSE(fours_asked_more.hand_out);
  CHECK(forced(qwen3(), 1, {.stream = std::nullopt, .quads = true, .narrow = false}).stream);  // the stream GEMMs first
  CHECK(fp8_plan_of(mixtral(), 16384).tile == g::fp8_tile::m64x2);        // not by the rules
  // Batch-invariant runs keep single wgmma CTAs whatever is asked.
  moe_config_params inv = deepseek();
  inv.batch_invariant = true;
  const g::fp8_plan kept = forced(inv, 1, {.stream = true, .pairs = true});
  CHECK_FALSE(kept.stream);
  CHECK(kept.cluster_m == 1);
  CHECK(forced(inv, 4096, {.tall = true}).tile == g::fp8_tile::m64);
  CHECK(forced(inv, 4096, {.quads = true}).tile == g::fp8_tile::m64);
  CHECK(forced(inv, 8, {.stream = false, .narrow = true}).tile == g::fp8_tile::m64);
  // Narrow tiles only when asked, before fours, pairs and 128-row CTAs: N by the active experts'
  // average rows, the plain K loop in fixed turns, GEMM2's A by cp.async, no store warps.
  const g::fp8_plan narrow8 = forced(qwen3(), 8, {.stream = false, .narrow = true});  // 64 slots on <= 64 experts
  CHECK(narrow8.tile == g::fp8_tile::narrow);
  CHECK(narrow8.schedule_block_m == 8);
  CHECK(narrow8.cluster_m == 1);
  CHECK(narrow8.k_loop == g::fp8_k_loop::plain);
  CHECK_FALSE(narrow8.down_a_tma);
  CHECK(narrow8.describe().find("wgmma e4m3 narrow") != std::string::npos);
  CHECK(narrow8.describe().find("schedule tiles of 8 rows") != std::string::npos);
  CHECK(forced(mixtral(), 64, {.stream = false, .narrow = true}).schedule_block_m == 16);   // 128 slots on 8
  CHECK(forced(mixtral(), 4096, {.stream = false, .narrow = true}).schedule_block_m == 32);  // capped
  const g::fp8_plan narrow_asked_more = forced(mixtral(), 64, {.stream = false, .pairs = true, .quads = true,
                                                               .tall = true, .hand_out = true, .staged_down = true,
                                                               .staged_up = true, .up_k_splits = 2, .narrow = true});
  CHECK(narrow_asked_more.tile == g::fp8_tile::narrow);
  CHECK_FALSE(narrow_asked_more.hand_out);
  CHECK_FALSE(narrow_asked_more.staged_down);
  CHECK_FALSE(narrow_asked_more.staged_up);
  CHECK(narrow_asked_more.up_k_splits == 1);
  CHECK(forced(qwen3(), 1, {.stream = true, .narrow = true}).stream);  // the stream GEMMs where forced
  CHECK(fp8_plan_of(qwen3(), 8).tile == g::fp8_tile::narrow);           // by the rule: 1 row per expert
  CHECK(fp8_plan_of(mixtral(), 64).tile == g::fp8_tile::m64);           // 16 rows per expert
  CHECK(forced(mixtral(), 64, {.narrow = true}).tile == g::fp8_tile::narrow);
  CHECK(forced(qwen3(), 8, {.narrow = false}).tile == g::fp8_tile::m64);
  CHECK(g::narrow_tile_tokens(8, 1) == 8);
  CHECK(g::narrow_tile_tokens(9, 1) == 16);
  CHECK(g::narrow_tile_tokens(31, 2) == 16);  // 16 rows each, rounded up
  CHECK(g::narrow_tile_tokens(33, 2) == 32);
  CHECK(g::narrow_tile_tokens(1000, 2) == 32);
  CHECK(g::narrow_tile_tokens(0, 0) == 8);
  // GEMM2's K splits where the plan may split, at most its K tiles; never in batch-invariant runs.
  const g::fp8_plan split3 = forced(qwen3(), 8, {.stream = false, .down_k_splits = 3});
  CHECK(split3.down_k_splits == 3);
  CHECK(split3.describe().find("in 3 K splits") != std::string::npos);
  CHECK(fp8_plan_of(qwen3(), 8).down_k_splits == 1);                                 // the rule's
  CHECK(forced(qwen3(), 8, {.stream = false, .down_k_splits = 40}).down_k_splits == 6);  // 768 / 128
  CHECK(forced(inv, 8, {.down_k_splits = 3}).down_k_splits == 1);
  CHECK(forced(qwen3(), 1, {.stream = true, .down_k_splits = 3}).down_k_splits == 1);
  CHECK_THROWS_AS(forced(qwen3(), 8, {.down_k_splits = 0}), moerunner::invalid_argument_error);
  moe_config_params det = qwen3();
  det.deterministic = true;
  const g::fp8_plan det_split = forced(det, 8, {.stream = false, .down_k_splits = 3});
  CHECK(det_split.down == g::down_store::partials);  // deterministic: f32 parts, summed by the combine
  CHECK(det_split.workspace.rows_bytes >= 3u * 8u * 8u * 2048u * 4u);
}

TEST_CASE("fp8 plan: the overlapped K loop unless asked otherwise, the raster band only where asked") {
  const auto forced = [](const moe_config_params& c, std::int64_t m, g::fp8_settings s) {
    const g::fp8_plan p = g::make_fp8_plan(MoeRunnerConfig(c), m, h200, s);
    check_fp8_layout(p, c);
    return p;
  };
  for (const moe_config_params& c : {mixtral(), qwen3(), deepseek()})
    for (std::int64_t m : {0, 1, 64, 4096, 16384}) {
      CAPTURE(c.num_experts);
      CAPTURE(m);
      // Unasked: the overlapped K loop on the wide wgmma CTAs (the narrow ones and the stream
      // GEMMs have one loop), the 16-bit wgmma tunings' band (8 M tiles).
      const g::fp8_plan unasked = fp8_plan_of(c, m);
      const bool one_loop = unasked.stream || unasked.tile == g::fp8_tile::narrow;
      CHECK(unasked.k_loop == (one_loop ? g::fp8_k_loop::plain : g::fp8_k_loop::overlap));
      CHECK(unasked.raster_band == g::sm90_wgmma_gemm_policy::tuning.raster_band);
      CHECK(unasked.raster_band == 8);
      CHECK((unasked.describe().find("overlapped") != std::string::npos) == !one_loop);
      // Work items handed out take the plain loop (the overlap's lean producer spilled there).
      CHECK(forced(c, m, {.hand_out = true}).k_loop == g::fp8_k_loop::plain);
      for (const g::fp8_k_loop loop : {g::fp8_k_loop::plain, g::fp8_k_loop::overlap, g::fp8_k_loop::stagger}) {
        CAPTURE(g::fp8_k_loop_name(loop));
        // Asked: taken on the 64-row wgmma CTAs, alone or in pairs; the tiles, splits and
        // workspace are the unasked plan's (the K loop changes nothing else).
        const g::fp8_plan o = forced(c, m, {.k_loop = loop});
        CHECK(o.k_loop == (one_loop ? g::fp8_k_loop::plain : loop));
        CHECK(o.tile == unasked.tile);
        CHECK(o.stream == unasked.stream);
        CHECK(o.down_k_splits == unasked.down_k_splits);
        CHECK(o.workspace.total == unasked.workspace.total);
        if (loop == g::fp8_k_loop::plain)
          for (const char* name : {"overlapped", "staggered"}) CHECK(o.describe().find(name) == std::string::npos);
        else CHECK((o.describe().find(std::string(" ") + g::fp8_k_loop_name(loop)) != std::string::npos) == !one_loop);
        const g::fp8_plan paired = forced(c, m, {.stream = false, .pairs = true, .k_loop = loop, .narrow = false});
        CHECK(paired.k_loop == loop);
        // Never other than plain on 128-row CTAs or the stream GEMMs.
        const g::fp8_plan tall = forced(c, m, {.stream = false, .pairs = false, .tall = true, .k_loop = loop});
        if (tall.tile == g::fp8_tile::m128) CHECK(tall.k_loop == g::fp8_k_loop::plain);
        const g::fp8_plan streamed = forced(c, m, {.stream = true, .k_loop = loop});
        if (streamed.stream) CHECK(streamed.k_loop == g::fp8_k_loop::plain);
        if (m > 0) CHECK(streamed.stream);
      }
      const g::fp8_plan band = forced(c, m, {.raster_band = 16});
      CHECK(band.raster_band == 16);
      CHECK(band.tile == unasked.tile);
      CHECK(band.workspace.total == unasked.workspace.total);
      if (!band.stream) CHECK(band.describe().find(" band 16") != std::string::npos);
    }
  // Batch-invariant runs keep the plain K loop (one kernel at every M); the band orders work
  // items only, so it is taken in every mode.
  moe_config_params inv = mixtral();
  inv.batch_invariant = true;
  CHECK(forced(inv, 4096, {}).k_loop == g::fp8_k_loop::plain);
  CHECK(forced(inv, 4096, {.k_loop = g::fp8_k_loop::overlap}).k_loop == g::fp8_k_loop::plain);
  CHECK(forced(inv, 4096, {.k_loop = g::fp8_k_loop::stagger}).k_loop == g::fp8_k_loop::plain);
  CHECK(forced(inv, 4096, {.raster_band = 3}).raster_band == 3);
  CHECK_THROWS_AS(forced(mixtral(), 64, {.raster_band = 0}), moerunner::invalid_argument_error);
  CHECK_THROWS_AS(forced(mixtral(), 64, {.raster_band = -2}), moerunner::invalid_argument_error);
}

TEST_CASE("fp8 plan: GEMM2 writes rows for the combine kernel up to twice the 16-bit K, from as many slots") {
  // DeepSeek-V3 (I = 2048): rows in e4m3, the reductions in 16 bits.
  const g::fp8_plan ds = fp8_plan_of(deepseek(), 4096);
  CHECK(ds.down == g::down_store::rows);
  CHECK(ds.combine_kernel);
  CHECK_FALSE(ds.clear_in_gemm1);
  CHECK(ds.workspace.rows_bytes >= std::size_t{4096} * 8 * 7168 * 2);
  check_fp8_layout(ds, deepseek());
  CHECK(plan_of(deepseek(), 4096).down == g::down_store::accumulate);
  CHECK(ds.describe().find("GEMM2 " + std::string(g::down_store_name(g::down_store::rows)) + " + combine kernel") !=
        std::string::npos);
  // The bound is inclusive, in K; below 4096 slots (DeepSeek-V3: 512 tokens) the reductions stay.
  moe_config_params at = deepseek();
  at.intermediate_size = g::fp8_rows_store_max_intermediate;
  CHECK(g::fp8_rows_store_max_intermediate == 2 * g::plan_detail::rows_store_max_intermediate);
  CHECK(fp8_plan_of(at, 512).down == g::down_store::rows);
  CHECK(fp8_plan_of(at, 511).down != g::down_store::rows);
  at.intermediate_size += g::fp8_group_size;
  CHECK(fp8_plan_of(at, 512).down == g::down_store::accumulate);
  CHECK(fp8_plan_of(mixtral(), 16384).down == g::down_store::accumulate);  // I = 14336
  CHECK(fp8_plan_of(qwen3(), 512).down == g::down_store::rows);            // as in 16 bits
  // The stream GEMMs keep the reductions (decode; forced here at a prefill count).
  CHECK(g::make_fp8_plan(MoeRunnerConfig(deepseek()), 4096, h200, {.stream = true}).down ==
        g::down_store::accumulate);

  // Forced either way where the run may do either; the workspace follows.
  const auto forced = [](const moe_config_params& c, std::int64_t m, g::fp8_settings s) {
    const g::fp8_plan p = g::make_fp8_plan(MoeRunnerConfig(c), m, h200, s);
    check_fp8_layout(p, c);
    return p;
  };
  const g::fp8_plan reduced = forced(deepseek(), 4096, {.down_rows = false});
  CHECK(reduced.down == g::down_store::accumulate);
  CHECK_FALSE(reduced.combine_kernel);
  CHECK(reduced.clear_in_gemm1);
  CHECK(reduced.workspace.rows_bytes == 0);
  const g::fp8_plan rows_mixtral = forced(mixtral(), 16384, {.down_rows = true});
  CHECK(rows_mixtral.down == g::down_store::rows);
  CHECK(rows_mixtral.combine_kernel);
  CHECK(forced(qwen3(), 511, {.down_rows = true}).down == g::down_store::rows);  // below 4096 slots too
  // Deterministic, batch-invariant and no_combine runs, and the stream GEMMs, keep their store.
  moe_config_params det = deepseek();
  det.deterministic = true;
  CHECK(forced(det, 4096, {.down_rows = false}).down == g::down_store::rows);
  moe_config_params inv = deepseek();
  inv.batch_invariant = true;
  CHECK(forced(inv, 4096, {.down_rows = false}).down == g::down_store::rows);
  moe_config_params nc = deepseek();
  nc.no_combine = true;
  CHECK(forced(nc, 4096, {.down_rows = true}).down == g::down_store::slots);
  CHECK(forced(deepseek(), 4096, {.stream = true, .down_rows = true}).down == g::down_store::accumulate);
  // Rows forced where GEMM2's K is split at decode become its f32 parts.
  const g::fp8_plan split_rows = forced(mixtral(), 1, {.stream = false, .down_k_splits = 3, .down_rows = true});
  CHECK(split_rows.down == g::down_store::partials);
  CHECK(split_rows.combine_kernel);
}

TEST_CASE("fp8 plan: GEMM2's A rows by TMA on the wgmma GEMMs") {
  // Every wide wgmma run by default, batch-invariant ones too (the rows past a tile are never
  // stored, so the bits are the cp.async path's); never the narrow tiles (their few token rows
  // come by cp.async), the stream GEMMs or an empty run; forced off.
  for (const moe_config_params& c : {mixtral(), deepseek(), qwen3()})
    for (const std::int64_t m : {1, 8, 64, 512, 4096, 16384}) {
      CAPTURE(m);
      const g::fp8_plan p = fp8_plan_of(c, m);
      CHECK(p.down_a_tma == (!p.stream && p.tile != g::fp8_tile::narrow));
      CHECK((p.describe().find("GEMM2's A by TMA") != std::string::npos) == p.down_a_tma);
      CHECK_FALSE(g::make_fp8_plan(MoeRunnerConfig(c), m, h200, {.down_a_tma = false}).down_a_tma);
      CHECK_FALSE(g::make_fp8_plan(MoeRunnerConfig(c), m, h200, {.stream = true, .down_a_tma = true}).down_a_tma);
      CHECK(g::make_fp8_plan(MoeRunnerConfig(c), m, h200, {.stream = false, .narrow = false}).down_a_tma);
      CHECK_FALSE(g::make_fp8_plan(MoeRunnerConfig(c), m, h200, {.stream = false, .narrow = true}).down_a_tma);
    }
  moe_config_params inv = qwen3();
  inv.batch_invariant = true;
  CHECK(fp8_plan_of(inv, 1).down_a_tma);
  CHECK_FALSE(fp8_plan_of(qwen3(), 0).down_a_tma);
  // The workspace does not change: act is read where GEMM1 wrote it.
  CHECK(fp8_plan_of(deepseek(), 4096).workspace.total ==
        g::make_fp8_plan(MoeRunnerConfig(deepseek()), 4096, h200, {.down_a_tma = false}).workspace.total);
}

TEST_CASE("fp8 plan: GEMM2's store warps where its K loop is short, with any K loop of GEMM1") {
  const auto plan = [](const moe_config_params& c, std::int64_t m, g::fp8_settings s) {
    return g::make_fp8_plan(MoeRunnerConfig(c), m, h200, s);
  };
  // Where the tile, the store and the item order allow them.
  const auto may = [](const g::fp8_plan& p) {
    return !p.stream && p.num_tokens > 0 && p.down_a_tma && !p.hand_out &&
           (p.tile == g::fp8_tile::m64 || p.tile == g::fp8_tile::m64x2) && p.down != g::down_store::partials;
  };
  moe_config_params i3072 = qwen3(), i4224 = qwen3();
  i3072.intermediate_size = 3072;  // 24 K tiles: taken
  i4224.intermediate_size = 4224;  // 33 K tiles: not
  for (const moe_config_params& c : {mixtral(), deepseek(), qwen3(), i3072, i4224})
    for (const std::int64_t m : {0, 1, 8, 64, 512, 4096, 16384}) {
      CAPTURE(c.intermediate_size);
      CAPTURE(m);
      const bool short_k = c.intermediate_size <= g::fp8_staged_max_k_tiles * g::fp8_block_k;
      const g::fp8_plan p = fp8_plan_of(c, m);
      CHECK(p.staged_down == (may(p) && short_k));  // by default: the rule
      CHECK((p.describe().find("GEMM2 stored by store warps") != std::string::npos) == p.staged_down);
      // GEMM1 keeps its loop (the overlap by default); the store warps' GEMM2 runs the plain one.
      CHECK(p.k_loop == plan(c, m, {.staged_down = false}).k_loop);
      CHECK(p.workspace.total == plan(c, m, {.staged_down = false}).workspace.total);
      // Forced either way where they may run, with every K loop of GEMM1.
      for (const auto loop : {g::fp8_k_loop::plain, g::fp8_k_loop::overlap, g::fp8_k_loop::stagger}) {
        const g::fp8_plan on = plan(c, m, {.k_loop = loop, .staged_down = true});
        CHECK(on.staged_down == may(on));
        CHECK_FALSE(plan(c, m, {.k_loop = loop, .staged_down = false}).staged_down);
      }
      // Not on 128-row CTAs, with GEMM2's A copied, or with handed-out items.
      CHECK_FALSE(plan(c, m, {.pairs = false, .tall = true, .staged_down = true}).staged_down);
      CHECK_FALSE(plan(c, m, {.down_a_tma = false, .staged_down = true}).staged_down);
      CHECK_FALSE(plan(c, m, {.hand_out = true, .staged_down = true}).staged_down);
    }
  // K split into f32 parts (deterministic decode) keeps the direct epilogue; batch-invariant runs
  // keep it unless asked.
  moe_config_params det = mixtral();
  det.deterministic = true;
  const g::fp8_plan parts = plan(det, 64, {.staged_down = true});
  CHECK(parts.down == g::down_store::partials);
  CHECK_FALSE(parts.staged_down);
  moe_config_params inv = qwen3();
  inv.batch_invariant = true;
  for (const std::int64_t m : {1, 64, 4096}) {
    CHECK_FALSE(fp8_plan_of(inv, m).staged_down);
    CHECK(plan(inv, m, {.staged_down = true}).staged_down == may(plan(inv, m, {.staged_down = true})));
  }
}

TEST_CASE("fp8 plan: dependent wgmma launches only where asked, nothing else changed") {
  for (const moe_config_params& c : {mixtral(), deepseek(), qwen3()})
    for (const std::int64_t m : {0, 1, 8, 64, 512, 4096, 16384}) {
      CAPTURE(m);
      const g::fp8_plan base = fp8_plan_of(c, m);
      CHECK_FALSE(base.dependent_gemms);  // never by default
      const g::fp8_plan p = g::make_fp8_plan(MoeRunnerConfig(c), m, h200, {.dependent_gemms = true});
      CHECK(p.dependent_gemms == (!p.stream && m > 0));  // (the stream GEMMs are dependents already)
      CHECK((p.describe().find("dependent launches") != std::string::npos) == p.dependent_gemms);
      CHECK(p.stream == base.stream);
      CHECK(p.tile == base.tile);
      CHECK(p.k_loop == base.k_loop);
      CHECK(p.down == base.down);
      CHECK(p.down_k_splits == base.down_k_splits);
      CHECK(p.workspace.total == base.workspace.total);
    }
}

TEST_CASE("fp8 plan: GEMM1's K splits only where asked, on single 64-row CTAs, with their parts") {
  const auto plan = fp8_plan_with;
  for (const moe_config_params& c : {mixtral(), deepseek(), qwen3(), ungated_qwen3()})
    for (const std::int64_t m : {0, 1, 8, 64, 512, 4096}) {
      CAPTURE(m);
      const g::fp8_plan base = fp8_plan_of(c, m);
      CHECK(base.up_k_splits == 1);  // never by default
      CHECK(base.workspace.up_parts_bytes == 0);
      for (const int splits : {2, 3}) {
        const g::fp8_plan p = plan(c, m, {.pairs = false, .up_k_splits = splits});
        const bool may = !p.stream && m > 0 && p.tile == g::fp8_tile::m64;
        CHECK(p.up_k_splits == (may ? splits : 1));
        CHECK((p.describe().find("GEMM1 in " + std::to_string(splits) + " K splits") != std::string::npos) == may);
        const std::size_t parts = static_cast<std::size_t>(splits) * m * c.top_k * (c.is_gated ? 2 : 1) *
                                  c.intermediate_size * 4;
        CHECK(p.workspace.up_parts_bytes == (may ? g::plan_piece_bytes(parts) : 0));
        CHECK(p.workspace.total == plan(c, m, {.pairs = false}).workspace.total + p.workspace.up_parts_bytes);
        CHECK(p.workspace.up_parts % g::plan_piece_alignment == 0);
        CHECK(p.workspace.up_parts + p.workspace.up_parts_bytes + g::plan_piece_alignment == p.workspace.total);
      }
      // Not with pairs, 128-row CTAs or handed-out items; at most GEMM1's K tiles.
      if (m >= 512) {
        CHECK(plan(c, m, {.pairs = true, .up_k_splits = 2}).up_k_splits == 1);
        CHECK(plan(c, m, {.pairs = false, .tall = true, .up_k_splits = 2}).up_k_splits == 1);
        CHECK(plan(c, m, {.pairs = false, .k_loop = g::fp8_k_loop::plain, .hand_out = true, .up_k_splits = 2})
                  .up_k_splits == (plan(c, m, {.pairs = false, .k_loop = g::fp8_k_loop::plain, .hand_out = true})
                                           .hand_out
                                       ? 1
                                       : 2));
        CHECK(plan(c, m, {.pairs = false, .up_k_splits = 1000}).up_k_splits == c.hidden_size / g::fp8_block_k);
      }
    }
  moe_config_params inv = qwen3();
  inv.batch_invariant = true;
  CHECK(plan(inv, 64, {.up_k_splits = 2}).up_k_splits == 1);
  CHECK_THROWS_AS(plan(qwen3(), 64, {.up_k_splits = 0}), moerunner::invalid_argument_error);
}

TEST_CASE("fp8 plan: GEMM1's store warps only where asked, on the gated GEMM1's 64-row CTAs") {
  const auto plan = fp8_plan_with;
  for (const moe_config_params& c : {mixtral(), deepseek(), qwen3(), ungated_qwen3()})
    for (const std::int64_t m : {0, 1, 8, 64, 512, 4096, 16384}) {
      CAPTURE(c.is_gated);
      CAPTURE(m);
      const g::fp8_plan base = fp8_plan_of(c, m);
      CHECK_FALSE(base.staged_up);  // never by default
      for (const std::optional<bool> pairs : {std::optional<bool>{}, std::optional<bool>{false}, std::optional<bool>{true}}) {
        const g::fp8_plan p = plan(c, m, {.pairs = pairs, .staged_up = true});
        const bool may = !p.stream && m > 0 && c.is_gated && !p.hand_out && p.up_k_splits == 1 &&
                         (p.tile == g::fp8_tile::m64 || p.tile == g::fp8_tile::m64x2);
        CHECK(p.staged_up == may);
        CHECK((p.describe().find("GEMM1's act quantized by store warps") != std::string::npos) == may);
        // Nothing else in the plan moves: the tile, loops, GEMM2's store and the workspace.
        const g::fp8_plan off = plan(c, m, {.pairs = pairs});
        CHECK(p.tile == off.tile);
        CHECK(p.k_loop == off.k_loop);
        CHECK(p.down == off.down);
        CHECK(p.staged_down == off.staged_down);
        CHECK(p.workspace.total == off.workspace.total);
      }
      // Not on 128-row CTAs or fours, with GEMM1 in K splits, or with handed-out items.
      if (m >= 512) {
        CHECK_FALSE(plan(c, m, {.pairs = false, .tall = true, .staged_up = true}).staged_up);
        CHECK_FALSE(plan(c, m, {.quads = true, .staged_up = true}).staged_up);
        CHECK_FALSE(plan(c, m, {.pairs = false, .staged_up = true, .up_k_splits = 2}).staged_up);
        const g::fp8_plan handed = plan(c, m, {.pairs = false, .k_loop = g::fp8_k_loop::plain, .hand_out = true,
                                               .staged_up = true});
        CHECK(handed.staged_up == (c.is_gated && !handed.hand_out));
      }
    }
  moe_config_params inv = qwen3();
  inv.batch_invariant = true;
  for (const std::int64_t m : {1, 64, 4096}) CHECK_FALSE(plan(inv, m, {.staged_up = true}).staged_up);
}

TEST_CASE("fp8 plan: deterministic, batch-invariant and no_combine stores") {
  moe_config_params det = mixtral();
  det.deterministic = true;
  const g::fp8_plan d = fp8_plan_of(det, 64);
  CHECK(d.down == g::down_store::partials);  // split K: f32 parts summed in split order
  CHECK(d.combine_kernel);
  CHECK_FALSE(d.clear_in_gemm1);
  check_fp8_layout(d, det);
  moe_config_params det_ds = qwen3();
  det_ds.deterministic = true;
  const g::fp8_plan ds = fp8_plan_of(det_ds, 1);  // narrow tiles: rows summed in slot order
  CHECK(ds.tile == g::fp8_tile::narrow);
  CHECK(ds.down == g::down_store::rows);
  CHECK(ds.combine_kernel);
  check_fp8_layout(ds, det_ds);
  moe_config_params inv = deepseek();
  inv.batch_invariant = true;
  for (std::int64_t m : {1, 7, 64, 4096}) {
    const g::fp8_plan p = fp8_plan_of(inv, m);
    CHECK_FALSE(p.stream);  // one kernel family, one K order, whatever the batch
    CHECK(p.down_k_splits == 1);
    CHECK(p.down == g::down_store::rows);
    CHECK(p.combine_kernel);
    CHECK(p.schedule_block_m == 64);  // single 64-row CTAs at every M
    CHECK(p.cluster_m == 1);
    CHECK(p.tile == g::fp8_tile::m64);
  }
  // Where the default pairs CTAs, batch-invariant runs keep single ones.
  CHECK(fp8_plan_of(mixtral(), 16384).schedule_block_m == 128);
  moe_config_params inv_mixtral = mixtral();
  inv_mixtral.batch_invariant = true;
  CHECK(fp8_plan_of(inv_mixtral, 16384).cluster_m == 1);
  moe_config_params nc = mixtral();
  nc.no_combine = true;
  const g::fp8_plan s = fp8_plan_of(nc, 5);
  CHECK(s.down == g::down_store::slots);
  CHECK(s.down_k_splits == 1);
  CHECK(s.clear_in_gemm1);  // the slots of filtered ids stay zero
}

TEST_CASE("fp8 plan: the split count follows the device's SMs (workspace sized per device)") {
  moe_config_params det = mixtral();
  det.deterministic = true;
  const g::device_target slice{.code_arch = 90, .has_wgmma = true, .sm_count = 16};
  const g::fp8_plan whole = fp8_plan_of(det, 64), small = fp8_plan_of(det, 64, slice);
  CHECK(whole.down_k_splits != small.down_k_splits);
  CHECK(whole.workspace.total != small.workspace.total);
}

// ---- shapes no other case names: the plans' invariants over a grid of configs, token counts,
// devices and modes (the rules are general: no shape of the benchmark is special to them)

namespace {

struct grid_shape {
  int e, k, h, i;
};

// E from 8 to 384, k from 1 to 10, H from 2048 to 7168, I from 256 to 14336, some of them
// not multiples of 128 (no fp8 plan there).
constexpr grid_shape grid_shapes[] = {
    {8, 1, 2048, 256},    {8, 2, 4096, 14336},  {16, 4, 2880, 2880},  {60, 4, 2048, 1408},
    {64, 6, 5120, 1536},  {128, 8, 4096, 768},  {160, 6, 5120, 1536}, {256, 8, 7168, 2048},
    {384, 8, 7168, 2048}, {384, 10, 3072, 512}, {32, 10, 2048, 8192}, {40, 3, 6144, 9216},
};
constexpr std::int64_t grid_tokens[] = {0, 1, 3, 8, 17, 64, 255, 1023, 4097, 16384};
constexpr g::device_target grid_devices[] = {
    h200, {.code_arch = 90, .has_wgmma = true, .sm_count = 16}, {.code_arch = 80, .has_wgmma = false, .sm_count = 108},
    {}};

enum class grid_mode { plain, deterministic, batch_invariant, no_combine, inplace };
constexpr grid_mode grid_modes[] = {grid_mode::plain, grid_mode::deterministic, grid_mode::batch_invariant,
                                    grid_mode::no_combine, grid_mode::inplace};

// The case's line in a failure's report.
std::string grid_label(const grid_shape& s, grid_mode mode, const g::device_target& dev) {
  return "E=" + std::to_string(s.e) + " k=" + std::to_string(s.k) + " H=" + std::to_string(s.h) +
         " I=" + std::to_string(s.i) + " mode " + std::to_string(static_cast<int>(mode)) + " on " +
         std::to_string(dev.sm_count) + " SMs (code sm_" + std::to_string(dev.code_arch) + ")";
}

moe_config_params grid_config(const grid_shape& s, grid_mode mode) {
  moe_config_params p{.num_experts = s.e, .hidden_size = s.h, .intermediate_size = s.i, .top_k = s.k};
  p.deterministic = mode == grid_mode::deterministic;
  p.batch_invariant = mode == grid_mode::batch_invariant;
  p.no_combine = mode == grid_mode::no_combine;
  p.inplace = mode == grid_mode::inplace;
  return p;
}

// Calls f(shape, mode, device, config) for every shape and mode of the grid on each of
// `devices`, the case named in a failure's report. The fp8 plans take H and I in 128 blocks only.
template <class F>
void for_each_grid_case(std::span<const g::device_target> devices, bool fp8_shapes_only, F&& f) {
  for (const grid_shape& s : grid_shapes) {
    if (fp8_shapes_only && (s.h % 128 != 0 || s.i % 128 != 0)) continue;
    for (const grid_mode mode : grid_modes)
      for (const g::device_target& dev : devices) {
        INFO(grid_label(s, mode, dev));
        f(s, mode, dev, grid_config(s, mode));
      }
  }
}

}  // namespace

TEST_CASE("grid: every bf16 plan is laid out, sized within its bounds, batch-invariant where asked") {
  for_each_grid_case(grid_devices, false, [](const grid_shape& s, grid_mode mode, const g::device_target& dev,
                                            const moe_config_params& c) {
    std::optional<g::fused_plan> first;  // the batch-invariant run's plan at the first M > 0
    for (const std::int64_t m : grid_tokens) {
      CAPTURE(m);
      const g::fused_plan p = plan_of(c, m, dev);
      check_layout(p, c);
      CHECK(p.choice != g::gemm_tuning_choice::automatic);
      CHECK(p.down_k_splits >= 1);
      CHECK(p.cluster_m >= 1);
      CHECK(p.schedule_block_m % p.cluster_m == 0);
      CHECK(p.describe().find("cuda_fused M=" + std::to_string(m) + ": ") == 0);
      // No device or no wgmma image: never a wgmma plan.
      if (!dev.has_wgmma) CHECK(p.family != g::gemm_family::wgmma);
      // A split keeps whole K tiles of GEMM2 and never exceeds them.
      CHECK(p.down_k_splits <= std::max(1, s.i / 64));
      // GEMM2 leaves GEMM1's tile only for 64 x 128, from 64 x 256, unsplit, where its items are few.
      if (p.down_tile != p.tile) {
        CHECK(p.tile == g::sm90_tile::m64);
        CHECK(p.down_tile == g::sm90_tile::m64n128);
        CHECK(p.down_k_splits == 1);
        const std::int64_t slots_m = m * s.k;
        const std::int64_t tiles = std::min(g::moe_m_tile_capacity(slots_m, s.e, 64), slots_m);
        CHECK(2 * tiles * ((s.h + 255) / 256) <= dev.sm_count);
      }
      if (p.down_k_splits > 1) {  // only where the items come in at most two waves
        const std::int64_t slots_m = m * s.k;
        const std::int64_t tiles = std::min(g::moe_m_tile_capacity(slots_m, s.e, p.schedule_block_m), slots_m);
        const std::int64_t items = tiles * ((s.h + g::sm90_block_n(p.tile) - 1) / g::sm90_block_n(p.tile));
        CHECK(items <= g::down_split_max_waves * (dev.sm_count / p.cluster_m));
      }
      // The decode workspace (no gathered copy, no rows for a combine kernel) holds act and
      // O(E + slots) bytes of plan and schedule besides.
      const auto slots = static_cast<std::size_t>(m) * static_cast<std::size_t>(s.k);
      if (!p.gather_a && p.workspace.rows_bytes == 0)
        CHECK(p.workspace.total <= slots * static_cast<std::size_t>(s.i) * 2 + 64 * slots +
                                       64 * static_cast<std::size_t>(s.e) + 4096);
      if (mode == grid_mode::batch_invariant && m > 0 && dev.has_wgmma) {
        // One kernel family and K order at every M: wgmma tiles, no K split, rows summed
        // per token in slot order.
        CHECK(p.family == g::gemm_family::wgmma);
        CHECK(p.down_k_splits == 1);
        CHECK(p.down == g::down_store::rows);
        CHECK(p.combine_kernel);
        if (!first) first = p;
        CHECK(p.choice == first->choice);
      }
    }
  });
}

TEST_CASE("grid: every fp8 plan is laid out and keeps one K order where batch-invariant") {
  // An H200 and a 16-SM slice: the fp8 kernels are sm_90a's alone.
  for_each_grid_case(std::span(grid_devices).first(2), true, [](const grid_shape& s, grid_mode mode,
                                                                const g::device_target& dev,
                                                                const moe_config_params& c) {
    for (const std::int64_t m : grid_tokens) {
      CAPTURE(m);
      const g::fp8_plan p = fp8_plan_of(c, m, dev);
      check_fp8_layout(p, c);
      CHECK(p.down_k_splits >= 1);
      CHECK(p.down_k_splits <= std::max(1, s.i / 128 / 4));
      CHECK(p.schedule_block_m == (p.stream || p.tile == g::fp8_tile::narrow ? 8
                                   : p.tile == g::fp8_tile::m64             ? 64
                                                                             : 128));
      CHECK(p.cluster_m == (!p.stream && p.tile == g::fp8_tile::m64x2 ? 2 : 1));
      if (p.stream || m == 0) CHECK(p.down_k_splits == 1);
      if (mode == grid_mode::batch_invariant) {
        CHECK_FALSE(p.stream);
        CHECK(p.tile == g::fp8_tile::m64);
        CHECK(p.down_k_splits == 1);
        if (m > 0) CHECK(p.down == g::down_store::rows);
      }
      if (mode == grid_mode::no_combine) CHECK(p.down == g::down_store::slots);
    }
  });
}

TEST_CASE("grid: a run's need falls with M only after decode's f32 pieces; the maximum over token counts serves every run") {
  // A smaller run can need more than a larger one only where its plan keeps f32 pieces that a
  // larger batch's plan does not: deterministic K-split parts (bf16 and fp8), or the fp8 stream
  // GEMMs' f32 act. An engine sizing one buffer asks max_workspace_bytes (the same maximum).
  for_each_grid_case(grid_devices, false, [](const grid_shape& s, grid_mode, const g::device_target& dev,
                                            const moe_config_params& c) {
    const bool fp8 = s.h % 128 == 0 && s.i % 128 == 0;
    std::optional<g::fused_plan> bf16_before;
    std::optional<g::fp8_plan> fp8_before;
    std::size_t bf16_most = 0, fp8_most = 0;
    for (std::int64_t m = 0; m <= 6000; m = m < 300 ? m + 1 : m + 1 + m / 9) {
      CAPTURE(m);
      const g::fused_plan p = plan_of(c, m, dev);
      if (bf16_before && p.workspace.total < bf16_before->workspace.total)
        CHECK(bf16_before->down == g::down_store::partials);
      bf16_before = p;
      bf16_most = std::max(bf16_most, p.workspace.total);
      if (fp8) {
        const g::fp8_plan q = fp8_plan_of(c, m, dev);
        if (fp8_before && q.workspace.total < fp8_before->workspace.total)
          CHECK((fp8_before->down == g::down_store::partials || fp8_before->stream));
        fp8_before = q;
        fp8_most = std::max(fp8_most, q.workspace.total);
      }
      if (m % 97 == 0) {  // the policies' maximum is the largest need up to m
        const MoeRunnerConfig cfg(c);
        CHECK(g::max_plan_workspace(cfg, m, [&](std::int64_t t) { return plan_of(c, t, dev); }, "test") >= bf16_most);
        if (fp8)
          CHECK(g::max_plan_workspace(cfg, m, [&](std::int64_t t) { return fp8_plan_of(c, t, dev); }, "test") >=
                fp8_most);
      }
    }
  });
  // Where it falls: deterministic decode (Mixtral-8x7B: 32 tokens' nine K-split parts outweigh 33
  // tokens' four) and fp8 decode with the narrow tiles off (Qwen3-30B-A3B at one token then
  // streams with act in f32).
  moe_config_params det = mixtral();
  det.deterministic = true;
  bool falls = false;
  for (std::int64_t m = 1; m < 400 && !falls; ++m) falls = plan_of(det, m + 1).workspace.total < plan_of(det, m).workspace.total;
  CHECK(falls);
  const g::fp8_settings wide{.narrow = false};
  CHECK(fp8_plan_of(qwen3(), 1, h200, wide).workspace.total > fp8_plan_of(qwen3(), 2, h200, wide).workspace.total);
}

TEST_CASE("the maximum over token counts: every count from 0 to max_tokens, a negative max_tokens refused") {
  const auto need = [](std::int64_t m) -> std::size_t { return m == 3 ? 1000 : static_cast<std::size_t>(m); };
  CHECK(moerunner::detail::max_workspace_over_tokens(0, need, "test") == 0);
  CHECK(moerunner::detail::max_workspace_over_tokens(2, need, "test") == 2);
  CHECK(moerunner::detail::max_workspace_over_tokens(3, need, "test") == 1000);
  CHECK(moerunner::detail::max_workspace_over_tokens(1100, need, "test") == 1100);
  CHECK_THROWS_WITH_AS(moerunner::detail::max_workspace_over_tokens(-1, need, "where"),
                       "where: max_tokens must not be negative, got -1", moerunner::invalid_argument_error);
  // The plans' maximum stops at the tokens a run takes (num_tokens * top_k in 32 bits).
  const MoeRunnerConfig cfg(mixtral());
  const auto plan_at = [&](std::int64_t m) { return plan_of(mixtral(), m); };
  CHECK(g::max_plan_workspace(cfg, 40, plan_at, "where") >= plan_of(mixtral(), 32).workspace.total);
  CHECK_THROWS_WITH_AS(g::max_plan_workspace(cfg, std::int64_t{1} << 30, plan_at, "where"),
                       "where: max_tokens * top_k must fit in 32 bits, as a run's num_tokens * top_k",
                       moerunner::invalid_argument_error);
}

TEST_CASE("work items handed out at run time: only where asked, on the wgmma GEMMs, where their numbers fit 32 bits") {
  for (const moe_config_params& c : {mixtral(), qwen3(), deepseek()})
    for (std::int64_t m : {0, 1, 64, 4096, 16384}) {
      CAPTURE(c.num_experts);
      CAPTURE(m);
      // Unasked: fixed turns.
      CHECK_FALSE(plan_of(c, m).hand_out);
      CHECK_FALSE(fp8_plan_of(c, m).hand_out);
      // Asked: the wide wgmma tiles only, with tokens; the rest of the plan is unasked's.
      g::fused_settings s;
      s.hand_out = true;
      const g::fused_plan fixed = plan_of(c, m), handed = plan_of(c, m, h200, s);
      check_layout(handed, c);
      const bool wide = handed.family == g::gemm_family::wgmma && handed.tile != g::sm90_tile::narrow;
      CHECK(handed.hand_out == (wide && m > 0));
      CHECK(handed.tile == fixed.tile);
      CHECK(handed.workspace.total == fixed.workspace.total);
      CHECK((handed.describe().find("handed out") != std::string::npos) == handed.hand_out);
      const g::fp8_plan fp8_fixed = fp8_plan_of(c, m),
                        fp8_handed = g::make_fp8_plan(MoeRunnerConfig(c), m, h200, {.hand_out = true});
      check_fp8_layout(fp8_handed, c);
      CHECK(fp8_handed.hand_out == (!fp8_handed.stream && fp8_handed.tile != g::fp8_tile::narrow && m > 0));
      // Not on 128-row CTAs (their lean producer spilled with the hand-out's state).
      CHECK_FALSE(g::make_fp8_plan(MoeRunnerConfig(c), m, h200,
                                   {.stream = false, .pairs = false, .tall = true, .hand_out = true})
                      .hand_out);
      CHECK(fp8_handed.tile == fp8_fixed.tile);
      CHECK(fp8_handed.workspace.total == fp8_fixed.workspace.total);
      CHECK((fp8_handed.describe().find("handed out") != std::string::npos) == fp8_handed.hand_out);
      // Not with the overlapped or staggered K loops (their kernels take fixed turns only).
      const g::fp8_plan looped = g::make_fp8_plan(MoeRunnerConfig(c), m, h200,
                                                  {.stream = false, .k_loop = g::fp8_k_loop::overlap, .hand_out = true});
      CHECK_FALSE(looped.hand_out);
    }
  // Item numbers are 32-bit: with H = 16384 and the most tokens a run takes (M * k < 2^31), up
  // to 2^31 / 128 M tiles times 64 or more N tiles, too many to hand out; the plan falls back to
  // fixed turns.
  g::fused_settings s;
  s.hand_out = true;
  moe_config_params wide = deepseek();
  wide.hidden_size = 16384;
  const std::int64_t huge = 0x7fffffff / 8;
  CHECK(plan_of(wide, 65536, h200, s).hand_out);
  CHECK(plan_of(deepseek(), huge, h200, s).hand_out);
  CHECK_FALSE(plan_of(wide, huge, h200, s).hand_out);
  CHECK_FALSE(g::make_fp8_plan(MoeRunnerConfig(wide), huge, h200, {.hand_out = true}).hand_out);
  CHECK(g::hand_out_items_fit(0x7fffffff - 132, 132));
  CHECK_FALSE(g::hand_out_items_fit(0x7fffffff - 131, 132));
  // fp8 A rows are 32-bit byte offsets: DeepSeek-V3's act rows (I = 2048 bytes) fit up to 2^21
  // schedule rows, which 65536 tokens stay under and 262144 do not.
  CHECK(g::make_fp8_plan(MoeRunnerConfig(deepseek()), 65536, h200, {.hand_out = true}).hand_out);
  CHECK_FALSE(g::make_fp8_plan(MoeRunnerConfig(deepseek()), 262144, h200, {.hand_out = true}).hand_out);
  CHECK(g::hand_out_offsets_fit(0xffffffffLL / 2048, 2048));
  CHECK_FALSE(g::hand_out_offsets_fit(0xffffffffLL / 2048 + 1, 2048));
}

TEST_CASE("expert bands: only where asked, on the wgmma GEMMs, the workspace unchanged") {
  for (const moe_config_params& c : {mixtral(), qwen3(), deepseek()})
    for (std::int64_t m : {0, 1, 64, 4096}) {
      CAPTURE(c.num_experts);
      CAPTURE(m);
      g::fused_settings asked;
      asked.expert_bands = true;
      const g::fused_plan fixed = plan_of(c, m), banded = plan_of(c, m, h200, asked);
      CHECK_FALSE(fixed.expert_bands);
      CHECK(fixed.describe().find("expert bands") == std::string::npos);
      // The stream GEMMs and schedules built in the GEMMs (decode) walk fixed bands: their
      // schedules carry no band words.
      CHECK(banded.expert_bands == (banded.family == g::gemm_family::wgmma && !banded.schedule_in_gemms && m > 0));
      CHECK((banded.describe().find("expert bands") != std::string::npos) == banded.expert_bands);
      CHECK(banded.tile == fixed.tile);
      CHECK(banded.workspace.total == fixed.workspace.total);
      // fp8: the same rule.
      const g::fp8_plan f8 = fp8_plan_of(c, m);
      const g::fp8_plan f8_banded = g::make_fp8_plan(MoeRunnerConfig(c), m, h200, {.expert_bands = true});
      CHECK_FALSE(f8.expert_bands);
      CHECK(f8_banded.expert_bands == (!f8_banded.stream && !f8_banded.schedule_in_gemms && m > 0));
      CHECK((f8_banded.describe().find("expert bands of 8") != std::string::npos) == f8_banded.expert_bands);
      CHECK(f8_banded.tile == f8.tile);
      CHECK(f8_banded.workspace.total == f8.workspace.total);
    }
  // The mma.sync family (no wgmma code) never takes them.
  g::fused_settings asked;
  asked.expert_bands = true;
  CHECK_FALSE(plan_of(mixtral(), 4096, {.code_arch = 80, .has_wgmma = false, .sm_count = 108}, asked).expert_bands);
}
