// The cuda_fused backend against the CPU reference on fresh random data, run through
// MoeRunner<reference_policy, cuda_fused_policy>, with every GEMM tuning the GPU runs (on
// Hopper with sm_90a code: the automatic wgmma one, and the mma.sync sm80 and sm90 ones
// forced, and the narrow decode tiles) in both combine modes (atomics in GEMM2's epilogue, and
// deterministic), plus what is particular to it: sizes that are not multiples of its tiles, K
// split at decode, a misaligned workspace, its own requirement checks, and CUDA-graph capture.
//
// Error bounds, normwise over the whole output: ||out - ref|| / ||ref|| <= 1e-2 for bf16 and
// 2e-3 for fp16 (a few units of each dtype's rounding: act, the rows and the output, or the
// k atomic additions, are each rounded once). Every token (every [token, slot] row with
// no_combine) must also be within 3x that bound on its own, and a row the reference leaves
// at zero must be exactly zero.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gpu_test_util.hpp"
#include "moe_problem.hpp"
#include "moerunner/moerunner.hpp"
#include "moerunner/policies/cuda_fused_policy.cuh"

namespace mr = moerunner;
using mr::test::device_buffer;
using mr::test::host_tensor;

namespace {

using runner_t = mr::MoeRunner<mr::reference_policy, mr::cuda_fused_policy>;
using tuning = mr::gpu::gemm_tuning_choice;

using mr::test::bound_for;
using mr::test::ids_kind;
using shape = mr::test::moe_shape;
using options = mr::test::moe_options;
using problem = mr::test::moe_problem;

constexpr double per_row_factor = 3.0;

std::string describe(const shape& s, mr::dtype t, const options& o, tuning tu, bool deterministic) {
  return mr::test::describe(s, t, o) + " tuning=" + std::string(mr::gpu::gemm_tuning_name(tu)) +
         (deterministic ? " deterministic" : " atomic combine");
}

// cuda_fused's launch-order settings (defaults: the tuning's; unset: the policy's).
struct launch_settings {
  int raster_band = 0;
  std::optional<bool> dependent_launch = std::nullopt;
  bool plan_in_gemms = true;
  std::optional<mr::gpu::stream_l2_use> stream_l2 = std::nullopt;  // stream GEMMs (unset: the policy's)
  std::optional<bool> gather_a = std::nullopt;  // wgmma GEMM1's A by TMA from gathered rows (unset: the plan's)
  std::optional<bool> hand_out = std::nullopt;  // wgmma work items handed out at run time (unset: the plan's)
  std::optional<bool> expert_bands = std::nullopt;  // wgmma raster bands of one expert's tiles (unset: the plan's)
  std::optional<bool> down_a_tma = std::nullopt;  // wgmma GEMM2's A by TMA (unset: the plan's)
  std::optional<bool> narrow = std::nullopt;  // the narrow decode tiles (unset: the plan's)
};

mr::MoeRunnerConfig with_deterministic(const mr::MoeRunnerConfig& cfg, bool deterministic) {
  mr::moe_config_params params = cfg.params();
  params.deterministic = deterministic;
  return mr::MoeRunnerConfig(params);
}

// The problem on the device with a runner that picked cuda_fused, its GEMM tuning forced.
struct on_device : mr::test::moe_on_device<mr::cuda_fused_policy> {
  on_device(const problem& p, tuning tu, bool deterministic, std::size_t ws_misalign = 0,
            const launch_settings& ls = {})
      : moe_on_device(p, with_deterministic(p.cfg, deterministic), ws_misalign) {
    REQUIRE(runner->runner_backend().is_cuda_fused());
    runner->visit([&](auto& core) {
      if constexpr (std::is_same_v<std::decay_t<decltype(core)>, mr::cuda_fused_policy>) {
        core.set_gemm_tuning(tu);
        core.set_raster_band(ls.raster_band);
        if (ls.dependent_launch) core.set_dependent_launch(*ls.dependent_launch);
        core.set_plan_in_gemms(ls.plan_in_gemms);
        if (ls.stream_l2) core.set_stream_l2(*ls.stream_l2);
        if (ls.gather_a) core.set_gather_a(*ls.gather_a);
        core.set_hand_out(ls.hand_out);
        core.set_expert_bands(ls.expert_bands);
        core.set_down_a_tma(ls.down_a_tma);
        core.set_narrow(ls.narrow);
      }
    });
    size_workspace(p, ws_misalign);  // the K splits, and so the size, follow the tuning
  }
};

// Tunings to run on this GPU: its own and the stream GEMMs forced, and where sm_90a code runs
// the mma.sync ones and every wgmma tile forced too (the automatic choice there is by shape).
std::vector<tuning> tunings() {
  const mr::gpu::device_facts dev = mr::gpu::current_device_facts();
  std::vector<tuning> t = {tuning::automatic, tuning::stream, tuning::stream_ordered};
  if (dev.code_arch >= 90) t.push_back(tuning::sm80);
  if (mr::gpu::wgmma_gemm_available(dev))
    t.insert(t.end(), {tuning::sm90, tuning::sm90_wgmma_m64, tuning::sm90_wgmma_m64n128, tuning::sm90_wgmma_m128,
                       tuning::sm90_wgmma_m128x2});
  return t;
}

constexpr bool both_modes[] = {false, true};  // deterministic off (the default), on

// Compares a run (output poisoned with NaN beforehand) with the reference: every element
// written and finite, normwise and per-row errors within bounds, zero rows exactly zero.
void compare(const problem& p, const host_tensor& got) {
  const mr::tensor_view& r = p.ref.view;
  const std::int64_t h = p.s.h, rows = r.numel() / h;
  const double bound = bound_for(p.type);
  const auto* raw = got.view.ptr<const std::uint16_t>();
  std::int64_t unwritten = 0, non_finite = 0, bad_rows = 0, nonzero_zero_rows = 0;
  double num = 0.0, den = 0.0, worst = 0.0;
  for (std::int64_t row = 0; row < rows; ++row) {
    double rn = 0.0, rd = 0.0;
    bool all_zero_ok = true;
    for (std::int64_t c = 0; c < h; ++c) {
      const std::int64_t i = row * h + c;
      if (raw[i] == 0xffff) ++unwritten;
      const double a = mr::test::element(got.view, i), b = mr::test::element(r, i);
      if (!std::isfinite(a) || !std::isfinite(b)) {
        ++non_finite;
        continue;
      }
      rn += (a - b) * (a - b);
      rd += b * b;
      all_zero_ok &= a == 0.0;
    }
    num += rn;
    den += rd;
    if (rd == 0.0) {
      nonzero_zero_rows += all_zero_ok ? 0 : 1;
    } else {
      const double e = std::sqrt(rn / rd);
      worst = std::max(worst, e);
      bad_rows += e <= per_row_factor * bound ? 0 : 1;
    }
  }
  const double err = den > 0.0 ? std::sqrt(num / den) : std::sqrt(num);
  CHECK_MESSAGE(unwritten == 0, unwritten, " elements still hold the poison");
  CHECK_MESSAGE(non_finite == 0, non_finite, " elements are not finite");
  CHECK_MESSAGE(err <= bound, "normwise relative error ", err, " bound ", bound);
  CHECK_MESSAGE(bad_rows == 0, bad_rows, " rows above ", per_row_factor * bound, " (worst ", worst, ")");
  CHECK_MESSAGE(nonzero_zero_rows == 0, nonzero_zero_rows, " rows should be exactly zero");
}

// Runs p once (output and workspace poisoned beforehand) and compares it with the reference.
void check_run(const problem& p, tuning tu, bool det, const launch_settings& ls) {
  // A workspace that is not 256-byte aligned: the policy aligns its pieces itself.
  on_device g(p, tu, det, 8, ls);
  if (!p.opt.inplace) g.fill_out(0xff);
  MOE_CUDA_CHECK(cudaMemset(g.ws_buf.get(), 0xff, g.ws_buf.bytes()));  // nothing may rely on zeroed scratch
  g.launch(p, nullptr);
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  compare(p, g.result(p));
}

// Every tuning in both modes; where sm_90a code runs, also the narrow decode tiles forced at any
// M (the plan takes them only where asked, and never under a forced tuning), building the
// schedule themselves up to 64 slots.
void check_case(const shape& s, mr::dtype t, const options& o = {}, const launch_settings& ls = {}) {
  const unsigned seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  const problem p(s, t, o, rng);
  for (tuning tu : tunings())
    for (bool det : both_modes) {
      CAPTURE(describe(s, t, o, tu, det));
      check_run(p, tu, det, ls);
    }
  if (!mr::gpu::wgmma_gemm_available(mr::gpu::current_device_facts()) || ls.narrow) return;
  launch_settings narrow = ls;
  narrow.narrow = true;
  for (bool det : both_modes) {
    CAPTURE(describe(s, t, o, tuning::automatic, det) + " narrow tiles forced");
    check_run(p, tuning::automatic, det, narrow);
  }
}

constexpr mr::dtype both_types[] = {mr::dtype::bf16, mr::dtype::f16};
// H and I that are multiples of 8 but of no GEMM tile (N tiles 64/128, K tiles 32/64).
constexpr int odd_h = 200, odd_i = 72;

}  // namespace

TEST_CASE("cuda_fused declares what it is") {
  static_assert(mr::cuda_fused_policy::graph_capturable);
  static_assert(mr::cuda_fused_policy::tensor_space == mr::memory_space::device);
  static_assert(std::is_nothrow_move_constructible_v<mr::cuda_fused_policy>);
  CHECK(mr::cuda_fused_policy::name == "cuda_fused");
}

TEST_CASE("cuda_fused matches the reference: token counts") {
  for (mr::dtype t : both_types)
    for (int m : {0, 1, 7, 1000}) check_case({m, 8, 2, odd_h, odd_i}, t);
}

TEST_CASE("cuda_fused matches the reference: experts and top-k") {
  for (mr::dtype t : both_types) {
    check_case({1000, 8, 1, odd_h, odd_i}, t);
    check_case({7, 64, 2, odd_h, odd_i}, t);     // most experts get no tokens
    check_case({1000, 64, 8, odd_h, odd_i}, t);
    check_case({1000, 256, 8, odd_h, odd_i}, t);  // more M tiles than resident CTAs
    check_case({1, 256, 8, odd_h, odd_i}, t);
    check_case({7, 8, 8, 64, 8}, t);              // k = E; H and I below every tile
  }
}

TEST_CASE("cuda_fused matches the reference: routing shapes") {
  for (mr::dtype t : both_types) {
    check_case({1000, 8, 1, odd_h, odd_i}, t, {.ids = ids_kind::one_expert});  // 8 M tiles of one expert
    check_case({300, 8, 2, odd_h, odd_i}, t, {.ids = ids_kind::one_expert});
    check_case({1000, 64, 8, odd_h, odd_i}, t, {.ids = ids_kind::random_filtered});
    check_case({7, 8, 2, odd_h, odd_i}, t, {.ids = ids_kind::random_filtered});
    check_case({300, 64, 2, odd_h, odd_i}, t, {.ids = ids_kind::few_experts});
  }
}

TEST_CASE("cuda_fused matches the reference: long K loops and full tiles") {
  for (mr::dtype t : both_types) {
    check_case({64, 4, 2, 1024, 512}, t);
    check_case({200, 8, 2, 256, 128}, t, {.act = mr::activation_kind::gelu});
    // Several N tiles with a partial last one in both GEMMs (wgmma: 128 act and 256 output columns per tile).
    check_case({300, 8, 2, 520, 264}, t);
    check_case({300, 8, 2, 520, 264}, t, {.gated = false});
  }
}

TEST_CASE("cuda_fused matches the reference: decode, K split over CTAs") {
  // Few (M tile, N tile) items and long K: the atomic mode's GEMM2 splits K (wgmma tuning).
  for (mr::dtype t : both_types) {
    check_case({1, 8, 2, 520, 2048}, t);
    check_case({3, 16, 4, 264, 1032}, t);
    check_case({2, 8, 2, 520, 2048}, t, {.ids = ids_kind::random_filtered});
    check_case({1, 8, 2, 520, 2048}, t, {.scaling = 2.5f});
    check_case({4, 8, 2, 520, 2048}, t, {.inplace = true});
  }
}

TEST_CASE("cuda_fused matches the reference: gpt-oss biases and interleaved gate/up on every GEMM tuning") {
  // Every tuning in both combine modes: the mma.sync, stream and wgmma epilogues add the biases,
  // their B loads (cp.async by row, TMA by the 4D map) read the interleaved rows; at decode the
  // wgmma GEMM2 splits K into the output or into f32 parts, one range adding b2.
  const auto swiglu = mr::activation_kind::swiglu_clamped;
  for (mr::dtype t : both_types)
    for (bool interleaved : {false, true}) {
      const std::optional<mr::dtype> biases[] = {std::nullopt, mr::dtype::f32, t};
      for (const std::optional<mr::dtype>& bias : biases) {
        const options o{.act = swiglu, .limit = 1.5f, .interleaved = interleaved, .bias = bias};
        check_case({1, 8, 4, odd_h, odd_i}, t, o);
        check_case({64, 8, 4, odd_h, odd_i}, t, o);
        check_case({300, 8, 2, 520, 264}, t, o);  // several N tiles in both GEMMs, a partial last one
      }
      check_case({1, 8, 2, 520, 2048}, t, {.act = swiglu, .interleaved = interleaved, .bias = mr::dtype::f32});
      check_case({3, 16, 4, 264, 1032}, t, {.act = swiglu, .interleaved = interleaved, .bias = t});
      check_case({4, 8, 2, 520, 2048}, t, {.inplace = true, .interleaved = interleaved, .bias = t});
      check_case({33, 8, 1, 128, 64}, t, {.weight_on_input = true, .interleaved = interleaved, .bias = mr::dtype::f32});
      check_case({33, 8, 2, 128, 64}, t,
                 {.act = swiglu, .no_combine = true, .scaling = 2.5f, .interleaved = interleaved, .bias = t});
    }
}

TEST_CASE("cuda_fused matches the reference: raster bands forced") {
  // Bands of 1 (N tiles fastest) and 3 M tiles (partial last bands) walk the same work as the
  // default 8 in another order.
  for (int band : {1, 3}) {
    CAPTURE(band);
    const launch_settings ls{.raster_band = band};
    check_case({1000, 8, 1, odd_h, odd_i}, mr::dtype::bf16, {.ids = ids_kind::one_expert}, ls);
    check_case({1000, 64, 8, odd_h, odd_i}, mr::dtype::bf16, {}, ls);
    check_case({300, 8, 2, 520, 264}, mr::dtype::f16, {.ids = ids_kind::random_filtered}, ls);
    check_case({1, 8, 2, 520, 2048}, mr::dtype::bf16, {}, ls);
  }
}

TEST_CASE("cuda_fused matches the reference: programmatic dependent launches on and off") {
  // Unset (the other cases), they are on with the stream GEMMs and off with the others.
  for (bool on : {true, false}) {
    CAPTURE(on);
    const launch_settings ls{.dependent_launch = on};
    check_case({1, 8, 2, 520, 2048}, mr::dtype::bf16, {}, ls);
    check_case({1000, 64, 8, odd_h, odd_i}, mr::dtype::bf16, {}, ls);
    check_case({5000, 8, 1, odd_h, odd_i}, mr::dtype::f16, {.ids = ids_kind::random_filtered}, ls);  // plan in 3 launches
  }
}

TEST_CASE("cuda_fused matches the reference: the decode schedule built in the GEMMs or by the plan kernel") {
  // With plan_in_gemms (the default), up to 64 slots the stream GEMMs (forced, and automatic at
  // decode) order the rows and cut the tiles themselves, and GEMM1 writes the slot_to_row the
  // deterministic combine reads; above, and with it off, the plan kernel does.
  for (bool in_gemms : {true, false}) {
    CAPTURE(in_gemms);
    const launch_settings ls{.plan_in_gemms = in_gemms};
    for (mr::dtype t : both_types) {
      check_case({8, 64, 8, odd_h, odd_i}, t, {}, ls);                               // 64 slots
      check_case({9, 64, 8, odd_h, odd_i}, t, {}, ls);                               // 72: the plan kernel
      check_case({32, 8, 2, odd_h, odd_i}, t, {.ids = ids_kind::one_expert}, ls);    // 8 tiles per expert
      check_case({32, 8, 1, odd_h, odd_i}, t, {.ids = ids_kind::one_expert}, ls);    // 8 tiles of one expert
      check_case({5, 16, 4, odd_h, odd_i}, t, {.ids = ids_kind::all_filtered}, ls);  // no tile at all
      check_case({6, 16, 4, odd_h, odd_i}, t, {.ids = ids_kind::filtered}, ls);
      check_case({1, 8, 1, 520, 2048}, t, {.weight_on_input = true}, ls);
      check_case({3, 8, 2, odd_h, odd_i}, t, {.no_combine = true}, ls);
    }
  }
}

TEST_CASE("cuda_fused deterministic at decode: the same bits with the schedule in the GEMMs or the plan kernel") {
  // Up to 64 slots the stream GEMMs (forced here, whatever the rows per expert) order the rows
  // themselves, GEMM1 writes slot_to_row, and GEMM2's last CTA of each N tile sums the rows in
  // slot order; with the plan kernel, the combine kernel sums them. Same order, same
  // arithmetic: the bits must agree, for both forms of the stream GEMM.
  const unsigned seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  const std::pair<shape, options> cases[] = {
      {{1, 8, 8, odd_h, odd_i}, {}},                                // one token on 8 experts
      {{8, 64, 8, odd_h, odd_i}, {}},                               // 64 slots
      {{6, 16, 4, odd_h, odd_i}, {.ids = ids_kind::filtered}},      // tokens with fewer rows
      {{5, 16, 4, odd_h, odd_i}, {.ids = ids_kind::all_filtered}},  // no row: zeros
      {{32, 8, 2, odd_h, odd_i}, {.ids = ids_kind::one_expert}},    // 8 tiles of one expert
      {{3, 8, 1, 520, 2048}, {.weight_on_input = true}},            // rows carry the weights
      {{4, 8, 2, odd_h, odd_i}, {.scaling = 2.5f}},
  };
  for (const auto& [sh, opt] : cases)
    for (mr::dtype t : both_types)
      for (const tuning tu : {tuning::stream, tuning::stream_ordered}) {
        const problem p(sh, t, opt, rng);
        CAPTURE(describe(sh, t, opt, tu, true));
        on_device kernel(p, tu, true, 0, {.plan_in_gemms = false});
        const host_tensor want = kernel.run_once(p);
        compare(p, want);
        on_device own(p, tu, true, 0, {.plan_in_gemms = true});
        CHECK(own.runner->describe(sh.m).find("combine in GEMM2") != std::string::npos);
        MOE_CUDA_CHECK(cudaMemset(own.ws_buf.get(), 0xff, own.ws_buf.bytes()));  // stale scratch must not matter
        const host_tensor got = own.run_once(p);
        CHECK(std::memcmp(got.view.data, want.view.data, want.view.bytes()) == 0);
        const host_tensor again = own.run_once(p);
        CHECK(std::memcmp(again.view.data, want.view.data, want.view.bytes()) == 0);
      }
}

TEST_CASE("cuda_fused with the stream GEMMs: L2 prefetch of GEMM2's weights and cache hints change no bit") {
  // GEMM1 asks L2 for GEMM2's first weights, after its own first copies or after its last:
  // none, the first K tiles of each warp's range (budgets below one first wave), whole items,
  // or all of them; the weight copies may be evict-first and ask for 256-byte blocks. Only
  // where bytes come from may change: deterministic outputs must keep their bits, and match
  // the reference. {1, 8, 2, 520, 2048}: 34 GEMM2 items, a first wave of 34, 557 KB per K tile
  // of every range, 8 K tiles per range: 64 KB asks for nothing, 1 MB for one tile, 4 MB for
  // seven, 16 MB for whole items.
  const unsigned seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  const std::pair<shape, options> cases[] = {
      {{1, 8, 2, 520, 2048}, {}},
      {{1, 8, 8, odd_h, odd_i}, {}},                                // GEMM2's 2 K tiles over 4 warps
      {{8, 64, 8, odd_h, odd_i}, {}},                               // 64 slots
      {{9, 64, 8, odd_h, odd_i}, {}},                               // 72: the plan kernel's schedule
      {{32, 8, 1, odd_h, odd_i}, {.ids = ids_kind::one_expert}},    // 4 tiles of one expert
      {{5, 16, 4, odd_h, odd_i}, {.ids = ids_kind::all_filtered}},  // no tile: nothing to ask for
  };
  constexpr std::int64_t budgets[] = {-1, 64 << 10, 1 << 20, 4 << 20, 16 << 20, std::int64_t{1} << 40};
  for (const auto& [sh, opt] : cases)
    for (mr::dtype t : both_types) {
      const problem p(sh, t, opt, rng);
      CAPTURE(describe(sh, t, opt, tuning::stream, true));
      on_device none(p, tuning::stream, true, 0,
                     {.stream_l2 = mr::gpu::stream_l2_use{.evict_first = false, .fetch_256_min_k_tiles = 1 << 30}});
      const host_tensor want = none.run_once(p);
      compare(p, want);
      for (std::int64_t bytes : budgets)
        for (bool at_end : {false, true}) {
          const mr::gpu::stream_l2_use use{.prefetch_bytes = bytes,
                                           .prefetch_at_end = at_end,
                                           .evict_first = !at_end,
                                           .fetch_256_min_k_tiles = at_end ? 0 : 1 << 30};
          CAPTURE(bytes);
          CAPTURE(at_end);
          on_device g(p, tuning::stream, true, 0, {.stream_l2 = use});
          const host_tensor got = g.run_once(p);
          CHECK(std::memcmp(got.view.data, want.view.data, want.view.bytes()) == 0);
        }
      // Atomic combine: every hint at once.
      on_device fast(p, tuning::stream, false, 0,
                     {.stream_l2 = mr::gpu::stream_l2_use{.prefetch_bytes = -1, .fetch_256_min_k_tiles = 0}});
      compare(p, fast.run_once(p));
    }
}

TEST_CASE("cuda_fused with the wgmma tiles: both GEMMs' A by TMA or by cp.async, the same bits") {
  // The same A rows reach the same wgmma either way (rows past a tile differ: zeros or the next
  // tile's rows, whose results are never stored), so deterministic outputs keep their bits.
  // GEMM1's by TMA from x's rows gathered in plan order, GEMM2's from act as GEMM1 wrote it.
  if (!mr::gpu::wgmma_gemm_available(mr::gpu::current_device_facts())) return;
  const unsigned seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  const std::pair<shape, options> cases[] = {
      {{300, 8, 2, odd_h, odd_i}, {}},                                // K not a multiple of the box
      {{700, 8, 2, 512, 256}, {.ids = ids_kind::skewed}},             // pairs with empty halves
      {{257, 4, 1, 256, 128}, {.weight_on_input = true}},             // rows carry the weights
      {{200, 16, 4, 256, 256}, {.ids = ids_kind::random_filtered}},   // fewer rows than slots
      {{130, 8, 2, 256, 256}, {.ids = ids_kind::one_expert, .interleaved = true}},
      {{64, 8, 2, 256, 256}, {.gated = false, .inplace = true}},
  };
  const tuning wgmma_tiles[] = {tuning::sm90_wgmma_m64, tuning::sm90_wgmma_m64n128, tuning::sm90_wgmma_m128,
                                tuning::sm90_wgmma_m128x2};
  for (const auto& [sh, opt] : cases)
    for (tuning tu : wgmma_tiles) {
      const problem p(sh, mr::dtype::bf16, opt, rng);
      CAPTURE(describe(sh, mr::dtype::bf16, opt, tu, true));
      on_device copies(p, tu, true, 0, {.gather_a = false, .down_a_tma = false});
      const host_tensor want = copies.run_once(p);
      compare(p, want);
      CHECK(copies.runner->describe(sh.m).find("GEMM2's A by TMA") == std::string::npos);
      on_device down_tma(p, tu, true, 0, {.gather_a = false, .down_a_tma = true});
      CHECK(down_tma.runner->describe(sh.m).find("GEMM2's A by TMA") != std::string::npos);
      const host_tensor got_down = down_tma.run_once(p);
      CHECK(std::memcmp(got_down.view.data, want.view.data, want.view.bytes()) == 0);
      on_device tma(p, tu, true, 0, {.gather_a = true, .down_a_tma = true});
      MOE_CUDA_CHECK(cudaMemset(tma.ws_buf.get(), 0xff, tma.ws_buf.bytes()));  // NaN past the gathered rows
      const host_tensor got = tma.run_once(p);
      CHECK(std::memcmp(got.view.data, want.view.data, want.view.bytes()) == 0);
      on_device fast(p, tu, false, 0, {.gather_a = true});
      compare(p, fast.run_once(p));
    }
}

// The order of the wgmma GEMMs' work items never changes an item's sums: with `reordered`
// deterministic outputs keep the bits they have with `fixed` (`runs` times on a workspace
// poisoned with 0xff first, whatever the plan must zero), and atomic-combine outputs stay within
// the reference's bound. check_plan looks at the reordered runner's policy.
template <class CheckPlan>
void check_reordered_bits(const problem& p, tuning tu, const launch_settings& fixed, const launch_settings& reordered,
                          int runs, const CheckPlan& check_plan) {
  on_device in_order(p, tu, true, 0, fixed);
  const host_tensor want = in_order.run_once(p);
  compare(p, want);
  on_device other(p, tu, true, 0, reordered);
  other.runner->visit([&](const auto& core) {
    if constexpr (std::is_same_v<std::decay_t<decltype(core)>, mr::cuda_fused_policy>) check_plan(core);
  });
  MOE_CUDA_CHECK(cudaMemset(other.ws_buf.get(), 0xff, other.ws_buf.bytes()));
  for (int run = 0; run < runs; ++run) {
    CAPTURE(run);
    const host_tensor got = other.run_once(p);
    CHECK(std::memcmp(got.view.data, want.view.data, want.view.bytes()) == 0);
  }
  on_device fast(p, tu, false, 0, reordered);
  compare(p, fast.run_once(p));
}

TEST_CASE("cuda_fused with the wgmma tiles: work items handed out at run time, the same bits as in fixed turns") {
  // An item's sums do not depend on which cluster runs it or when; a second run on the
  // workspace finds the item counters at 0 again.
  if (!mr::gpu::wgmma_gemm_available(mr::gpu::current_device_facts())) return;
  const unsigned seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  const std::pair<shape, options> cases[] = {
      {{0, 8, 2, 256, 256}, {}},                                       // no tokens: no items
      {{1, 8, 2, 520, 2048}, {}},                                      // one token, GEMM2's K split (atomic mode)
      {{2, 8, 2, odd_h, odd_i}, {}},                                   // fewer items than clusters
      {{300, 8, 2, odd_h, odd_i}, {.ids = ids_kind::random_filtered}},
      {{700, 8, 2, 512, 256}, {.ids = ids_kind::skewed}},              // pairs with empty halves
      {{130, 8, 2, 256, 256}, {.ids = ids_kind::one_expert, .interleaved = true}},
      {{2000, 8, 1, 256, 512}, {.weight_on_input = true}},             // several items per cluster
      {{64, 8, 2, 256, 256}, {.gated = false, .inplace = true}},
  };
  const tuning wgmma_tiles[] = {tuning::sm90_wgmma_m64, tuning::sm90_wgmma_m64n128, tuning::sm90_wgmma_m128,
                                tuning::sm90_wgmma_m128x2};
  for (const auto& [sh, opt] : cases) {
    const problem p(sh, mr::dtype::bf16, opt, rng);
    for (tuning tu : wgmma_tiles)
      for (bool gather : {false, true}) {
        CAPTURE(describe(sh, mr::dtype::bf16, opt, tu, true));
        CAPTURE(gather);
        check_reordered_bits(p, tu, {.gather_a = gather, .hand_out = false}, {.gather_a = gather, .hand_out = true},
                             opt.inplace ? 1 : 2,
                             [&](const mr::cuda_fused_policy& core) { CHECK(core.plan(sh.m).hand_out == (sh.m > 0)); });
      }
  }
}

TEST_CASE("cuda_fused with the wgmma tiles: work items in expert bands, the same bits as in fixed bands") {
  // Experts with one to a dozen tiles, bands narrower and wider than them, alone and with the
  // hand-out.
  if (!mr::gpu::wgmma_gemm_available(mr::gpu::current_device_facts())) return;
  const unsigned seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  const std::pair<shape, options> cases[] = {
      {{0, 8, 2, 256, 256}, {}},
      {{1, 8, 2, 520, 2048}, {}},
      {{300, 8, 2, odd_h, odd_i}, {.ids = ids_kind::random_filtered}},
      {{700, 8, 2, 512, 256}, {.ids = ids_kind::skewed}},  // one expert with most tiles
      {{3000, 8, 2, 256, 512}, {}},                        // 750 rows per expert
      {{400, 64, 6, 256, 384}, {}},                        // many experts, a few tiles each
  };
  for (const auto& [sh, opt] : cases) {
    const problem p(sh, mr::dtype::bf16, opt, rng);
    for (tuning tu : {tuning::sm90_wgmma_m64, tuning::sm90_wgmma_m128, tuning::sm90_wgmma_m128x2})
      for (int band : {1, 3, 8})
        for (bool hand_out : {false, true}) {
          CAPTURE(describe(sh, mr::dtype::bf16, opt, tu, true));
          CAPTURE(band);
          CAPTURE(hand_out);
          check_reordered_bits(p, tu, {.raster_band = band, .expert_bands = false},
                               {.raster_band = band, .hand_out = hand_out, .expert_bands = true}, 1,
                               [&](const mr::cuda_fused_policy& core) {
                                 CHECK(core.plan(sh.m).expert_bands == (sh.m > 0));
                                 CHECK((core.describe(sh.m).find("expert bands") != std::string::npos) == (sh.m > 0));
                               });
        }
  }
}

TEST_CASE("cuda_fused leaves out expert ids outside [-1, E) as it does -1") {
  // Out-of-range ids in place of the -1 of a filtered routing: the same output. 24 * 2 slots
  // with plan_in_gemms take the schedule built in the decode GEMMs, the others the plan kernel.
  for (const std::pair<int, bool>& run : {std::pair{24, true}, std::pair{24, false}, std::pair{300, true}}) {
    const int m = run.first;
    const bool in_gemms = run.second;
    const unsigned seed = mr::test::test_seed();
    CAPTURE(seed);
    CAPTURE(m);
    CAPTURE(in_gemms);
    std::mt19937 rng(seed);
    const problem p({m, 8, 2, odd_h, odd_i}, mr::dtype::bf16, {.ids = ids_kind::random_filtered}, rng);
    std::vector<std::int32_t> bad(static_cast<std::size_t>(p.ids.view.numel()));
    std::memcpy(bad.data(), p.ids.view.data, bad.size() * sizeof(std::int32_t));
    int replaced = 0;
    for (std::int32_t& id : bad)
      if (id == -1) id = replaced++ % 2 == 0 ? p.s.e + 3 : -7;
    REQUIRE(replaced > 0);  // the middle token is always filtered
    for (tuning tu : tunings())
      for (bool det : both_modes) {
        CAPTURE(describe(p.s, p.type, p.opt, tu, det));
        on_device g(p, tu, det, 0, {.plan_in_gemms = in_gemms});
        MOE_CUDA_CHECK(cudaMemcpy(g.ids.view.data, bad.data(), bad.size() * sizeof(std::int32_t),
                                  cudaMemcpyHostToDevice));
        g.fill_out(0xff);
        g.launch(p, nullptr);
        MOE_CUDA_CHECK(cudaDeviceSynchronize());
        compare(p, g.result(p));
      }
  }
}

TEST_CASE("cuda_fused adds out-of-range ids to the caller's status word, directly and under CUDA graph replay") {
  // 24 * 2 slots with plan_in_gemms and the stream GEMMs: GEMM1 builds the schedule and reports
  // them; without plan_in_gemms the plan kernel does, as it does with the automatic tuning at
  // 300 tokens (one block) and 2500 (tiles of slots).
  struct path {
    int m;
    bool in_gemms;
    tuning tu;
  };
  for (const path& run : {path{24, true, tuning::stream}, path{24, false, tuning::stream},
                          path{300, true, tuning::automatic}, path{2500, true, tuning::automatic}}) {
    const unsigned seed = mr::test::test_seed();
    CAPTURE(seed);
    CAPTURE(run.m);
    CAPTURE(run.in_gemms);
    CAPTURE(std::string(mr::gpu::gemm_tuning_name(run.tu)));
    std::mt19937 rng(seed);
    const problem p({run.m, 8, 2, odd_h, odd_i}, mr::dtype::bf16, {.ids = ids_kind::random_filtered}, rng);
    const auto n = static_cast<std::size_t>(p.ids.view.numel());
    const std::vector<std::int32_t> good(p.ids.view.ptr<std::int32_t>(), p.ids.view.ptr<std::int32_t>() + n);
    // Every filtered slot made bad (the output must not change), and the same with one left bad.
    std::vector<std::int32_t> bad = good, one_bad = good;
    int replaced = 0, first = -1, last = -1;
    for (std::size_t s = 0; s < n; ++s)
      if (good[s] == -1) {
        const int r = replaced++;
        bad[s] = r % 3 == 0 ? p.s.e : r % 3 == 1 ? -7 : (1 << 30);
        first = first < 0 ? static_cast<int>(s) : first;
        last = static_cast<int>(s);
      }
    REQUIRE(replaced > 1);  // the middle token is always filtered
    one_bad[last] = p.s.e + 1;

    on_device g(p, run.tu, false, 0, {.plan_in_gemms = run.in_gemms});
    mr::test::device_status status;
    mr::DispatchOutput d = g.dispatch(p);
    d.status = status.get();
    const mr::unquantized_quant_info q{g.w13.view, g.w2.view};
    auto set_ids = [&](const std::vector<std::int32_t>& ids) {
      MOE_CUDA_CHECK(cudaMemcpy(g.ids.view.data, ids.data(), n * sizeof(std::int32_t), cudaMemcpyHostToDevice));
    };
    auto run_on = [&](cudaStream_t s) { g.runner->run(d, q, g.out, g.ws, cuda::stream_ref(s)); };
    auto check_status = [&](int want_count, int want_first) {
      const mr::moe_status st = status.read();
      CHECK(st.bad_slots == want_count);
      CHECK(st.first_bad_slot == want_first);
    };

    // Direct runs add up; the first bad slot stays the first run's.
    set_ids(bad);
    g.fill_out(0xff);
    run_on(nullptr);
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    compare(p, g.result(p));
    check_status(replaced, first);
    set_ids(one_bad);
    run_on(nullptr);
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    check_status(replaced + 1, first);

    cudaStream_t s = nullptr;
    MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    // A graph of the caller's zeroing and the run: each replay reports that replay's ids.
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    MOE_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    MOE_CUDA_CHECK(cudaMemsetAsync(status.get(), 0, sizeof(mr::moe_status), s));
    run_on(s);
    MOE_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    auto replay = [&](cudaGraphExec_t e) {
      g.fill_out(0xff);
      MOE_CUDA_CHECK(cudaDeviceSynchronize());
      MOE_CUDA_CHECK(cudaGraphLaunch(e, s));
      MOE_CUDA_CHECK(cudaStreamSynchronize(s));
      compare(p, g.result(p));
    };
    set_ids(bad);
    for (int r = 0; r < 3; ++r) {
      replay(exec);
      check_status(replaced, first);
    }
    set_ids(one_bad);
    replay(exec);
    check_status(1, last);
    set_ids(good);
    replay(exec);
    check_status(0, 0);

    // A graph of the run alone: the status keeps counting over replays until the caller zeroes it.
    cudaGraph_t run_graph = nullptr;
    cudaGraphExec_t run_exec = nullptr;
    MOE_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    run_on(s);
    MOE_CUDA_CHECK(cudaStreamEndCapture(s, &run_graph));
    MOE_CUDA_CHECK(cudaGraphInstantiate(&run_exec, run_graph, 0));
    set_ids(bad);
    for (int r = 1; r <= 3; ++r) {
      replay(run_exec);
      check_status(r * replaced, first);
    }
    status.zero();
    set_ids(one_bad);
    replay(run_exec);
    check_status(1, last);

    MOE_CUDA_CHECK(cudaGraphExecDestroy(run_exec));
    MOE_CUDA_CHECK(cudaGraphDestroy(run_graph));
    MOE_CUDA_CHECK(cudaGraphExecDestroy(exec));
    MOE_CUDA_CHECK(cudaGraphDestroy(graph));
    MOE_CUDA_CHECK(cudaStreamDestroy(s));
  }
}

TEST_CASE("cuda_fused rejects a misaligned status word before running") {
  std::mt19937 rng(3);
  const problem p({4, 8, 2, odd_h, odd_i}, mr::dtype::bf16, {}, rng);
  on_device g(p, tuning::automatic, false);
  mr::DispatchOutput d = g.dispatch(p);
  d.status = reinterpret_cast<mr::moe_status*>(static_cast<char*>(g.ws_buf.get()) + 2);
  g.fill_out(0x5a);
  CHECK_THROWS_AS(g.runner->run(d, mr::unquantized_quant_info{g.w13.view, g.w2.view}, g.out, g.ws, {}),
                  mr::invalid_argument_error);
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  const host_tensor untouched = g.result(p);
  for (std::size_t b = 0; b < untouched.view.bytes(); ++b)
    REQUIRE(static_cast<const unsigned char*>(untouched.view.data)[b] == 0x5a);
}

TEST_CASE("cuda_fused matches the reference: activations") {
  for (mr::dtype t : both_types) {
    check_case({100, 8, 2, odd_h, odd_i}, t, {.act = mr::activation_kind::gelu});
    // A small limit makes the clamp bite on many gate and up values.
    check_case({100, 8, 2, odd_h, odd_i}, t, {.act = mr::activation_kind::swiglu_clamped, .limit = 0.75f});
    check_case({100, 8, 2, odd_h, odd_i}, t, {.act = mr::activation_kind::swiglu_clamped});
    check_case({129, 8, 2, 136, 40}, t, {.gated = false});
    check_case({129, 8, 2, odd_h, odd_i}, t, {.act = mr::activation_kind::gelu, .gated = false});
  }
}

TEST_CASE("cuda_fused matches the reference: router weight, scaling, combine modes") {
  for (mr::dtype t : both_types) {
    check_case({33, 8, 2, odd_h, odd_i}, t, {.no_combine = true});
    check_case({33, 8, 2, odd_h, odd_i}, t, {.ids = ids_kind::random_filtered, .no_combine = true, .scaling = 2.5f});
    check_case({100, 8, 2, odd_h, odd_i}, t, {.scaling = 2.5f});
    check_case({100, 8, 2, odd_h, odd_i}, t, {.scaling = 2.5f, .scaling_in_weights = true});
    check_case({100, 8, 1, odd_h, odd_i}, t, {.weight_on_input = true});
    check_case({100, 8, 1, odd_h, odd_i}, t, {.act = mr::activation_kind::gelu, .gated = false, .weight_on_input = true});
    check_case({50, 8, 2, odd_h, odd_i}, t, {.inplace = true});
  }
}

TEST_CASE("cuda_fused keeps a NaN inside its token") {
  for (mr::dtype t : both_types) {
    for (tuning tu : tunings())
    for (bool det : both_modes) {
      const unsigned seed = mr::test::test_seed();
      CAPTURE(seed);
      std::mt19937 rng(seed);
      const int bad = 21;
      problem p({64, 8, 2, odd_h, odd_i}, t, {.nan_token = bad}, rng);
      CAPTURE(describe(p.s, t, p.opt, tu, det));
      on_device g(p, tu, det);
      g.fill_out(0x5a);  // a finite poison, so that NaN can only come from the computation
      g.launch(p, nullptr);
      MOE_CUDA_CHECK(cudaDeviceSynchronize());
      const host_tensor got = g.result(p);
      double num = 0.0, den = 0.0;
      for (std::int64_t tok = 0; tok < p.s.m; ++tok) {
        std::int64_t nans = 0;
        for (int c = 0; c < p.s.h; ++c) {
          const std::int64_t i = tok * p.s.h + c;
          const double a = mr::test::element(got.view, i), b = mr::test::element(p.ref.view, i);
          if (std::isnan(a)) ++nans;
          else if (tok != bad) num += (a - b) * (a - b), den += b * b;
        }
        // Every output element of the bad token mixes its NaN row; no other token sees it.
        CHECK_MESSAGE(nans == (tok == bad ? p.s.h : 0), "token ", tok, " has ", nans, " NaNs");
      }
      CHECK(std::sqrt(num / den) <= bound_for(t));
    }
  }
}

namespace {
// Repeated runs and CUDA-graph replays: the same bits in deterministic mode; in the default
// mode each run passes the reference check (the atomics' order may change the last bit).
void check_runs_and_graph(tuning tu, bool deterministic, const shape& sh) {
  const unsigned seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  problem p(sh, mr::dtype::bf16, {}, rng);
  on_device g(p, tu, deterministic);
  g.fill_out(0xff);
  g.launch(p, nullptr);
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  const host_tensor first = g.result(p);
  compare(p, first);
  const auto check_again = [&] {
    const host_tensor again = g.result(p);
    if (deterministic) REQUIRE(std::memcmp(first.view.data, again.view.data, first.view.bytes()) == 0);
    else compare(p, again);
  };
  for (int r = 0; r < 10; ++r) {
    g.fill_out(0xff);
    g.launch(p, nullptr);
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    check_again();
  }
  cudaStream_t s = nullptr;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  MOE_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  g.launch(p, s);
  MOE_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int r = 0; r < 3; ++r) {
    g.fill_out(0xff);
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    MOE_CUDA_CHECK(cudaGraphLaunch(exec, s));
    MOE_CUDA_CHECK(cudaStreamSynchronize(s));
    check_again();
  }
  MOE_CUDA_CHECK(cudaGraphExecDestroy(exec));
  MOE_CUDA_CHECK(cudaGraphDestroy(graph));
  MOE_CUDA_CHECK(cudaStreamDestroy(s));
}
}  // namespace

TEST_CASE("cuda_fused is deterministic when asked, and replays from a CUDA graph in both modes") {
  for (tuning tu : tunings())
    for (bool det : both_modes) {
      CAPTURE(std::string(mr::gpu::gemm_tuning_name(tu)) + (det ? " deterministic" : " atomic combine"));
      check_runs_and_graph(tu, det, {257, 16, 4, odd_h, odd_i});
      check_runs_and_graph(tu, det, {1, 8, 2, 520, 2048});  // K split in GEMM2 (atomic mode)
    }
}

namespace {

// Probe tokens whose rows are placed among random companions in batches of several sizes: their
// inputs, routing and, per batch, their outputs.
struct probes {
  static constexpr int count = 3;
  int e, k, h, i;
  mr::dtype type;
  host_tensor x, weights, ids, w13, w2;

  probes(int e_, int k_, int h_, int i_, mr::dtype t, std::mt19937& rng)
      : e(e_), k(k_), h(h_), i(i_), type(t), x(t, {count, h_}), weights(mr::dtype::f32, {count, k_}),
        ids(mr::dtype::i32, {count, k_}), w13(t, {e_, 2 * i_, h_}), w2(t, {e_, h_, i_}) {
    mr::test::fill_random(x, rng, 1.0f);
    mr::test::fill_random(w13, rng, 2.0f / std::sqrt(static_cast<float>(h)));
    mr::test::fill_random(w2, rng, 2.0f / std::sqrt(static_cast<float>(i)));
    route(count, weights, ids, rng);
    ids.view.ptr<std::int32_t>()[1 * k + 1] = -1;  // probe 1 has a filtered slot
  }

  void route(std::int64_t m, host_tensor& w, host_tensor& id, std::mt19937& rng) const {
    host_tensor logits(mr::dtype::f32, {m, e});
    mr::test::fill_random(logits, rng, 4.0f);
    mr::TopKOutput out{w.view, id.view};
    mr::reference::topk(logits.view, nullptr, {.top_k = k}, out);
  }

  mr::MoeRunnerConfig config(bool batch_invariant) const {
    return mr::MoeRunnerConfig(
        {.num_experts = e, .hidden_size = h, .intermediate_size = i, .top_k = k, .batch_invariant = batch_invariant});
  }

  // Runs a batch of m tokens, probe j at position at[j] (or left out where at[j] < 0), the rest
  // random inputs and routings; returns each probe's output row as bytes (empty where left out).
  std::vector<std::vector<unsigned char>> run(std::int64_t m, const std::vector<std::int64_t>& at, bool invariant,
                                              std::mt19937& rng, std::string* plan = nullptr,
                                              tuning tu = tuning::automatic) const {
    host_tensor bx(type, {m, h}), bw(mr::dtype::f32, {m, k}), bi(mr::dtype::i32, {m, k});
    mr::test::fill_random(bx, rng, 1.0f);
    route(m, bw, bi, rng);
    const std::size_t row = static_cast<std::size_t>(h) * mr::dtype_size(type);
    for (int j = 0; j < count; ++j) {
      if (at[j] < 0) continue;
      std::memcpy(static_cast<char*>(bx.view.data) + at[j] * row, static_cast<const char*>(x.view.data) + j * row, row);
      std::memcpy(bw.view.ptr<float>() + at[j] * k, weights.view.ptr<const float>() + j * k, k * sizeof(float));
      std::memcpy(bi.view.ptr<std::int32_t>() + at[j] * k, ids.view.ptr<const std::int32_t>() + j * k,
                  k * sizeof(std::int32_t));
    }
    const mr::test::device_tensor dx(bx), dw(bw), di(bi), d13(w13), d2(w2);
    host_tensor out(type, {m, h});
    mr::test::device_tensor dout(out);
    MOE_CUDA_CHECK(cudaMemset(dout.buf.get(), 0xff, dout.buf.bytes()));
    runner_t runner("cuda_fused", config(invariant));
    runner.visit([&](auto& core) {
      if constexpr (std::is_same_v<std::decay_t<decltype(core)>, mr::cuda_fused_policy>) core.set_gemm_tuning(tu);
    });
    if (plan != nullptr) *plan = runner.describe(m);
    device_buffer ws(runner.workspace_bytes(m));
    MOE_CUDA_CHECK(cudaMemset(ws.get(), 0xff, ws.bytes()));
    runner.run(mr::DispatchOutput{dx.view, {}, {dw.view, di.view}}, mr::unquantized_quant_info{d13.view, d2.view},
               dout.view, {ws.get(), ws.bytes()}, cuda::stream_ref(cudaStream_t{}));
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    dout.to_host(out);
    std::vector<std::vector<unsigned char>> rows(count);
    for (int j = 0; j < count; ++j)
      if (at[j] >= 0) {
        const auto* b = static_cast<const unsigned char*>(out.view.data) + at[j] * row;
        rows[j].assign(b, b + row);
      }
    return rows;
  }
};

}  // namespace

TEST_CASE("cuda_fused batch_invariant: a token's bits do not depend on the batch it runs in") {
  // E = 16, k = 4: one row per active expert at M = 1 and two at 7 (64-row tiles, where the
  // default runs the stream GEMMs), 16 at 64 (64-row tiles), 128 at 512 (128-row tiles), 1024 at
  // 4096 (2-CTA clusters). E = 8, k = 2 with I long against H: up to 64 rows per expert GEMM1
  // takes 64 x 256 tiles and GEMM2, whose items are few, 64 x 128 tiles. At 1 and 7 tokens the
  // stream GEMM with K in order (forced) must give the wgmma chains' bits too: its mma.sync chains
  // sum K in their order.
  const unsigned seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  struct shape {
    int e, k, h, i;
  };
  for (const shape sh : {shape{16, 4, odd_h, odd_i}, shape{8, 2, 512, 4352}}) {
    for (mr::dtype t : both_types) {
      CAPTURE(sh.e);
      CAPTURE(std::string(mr::dtype_name(t)));
      const probes pr(sh.e, sh.k, sh.h, sh.i, t, rng);
      // The probes' reference output, computed alone.
      host_tensor ref(t, {probes::count, sh.h});
      mr::MoeRunner<mr::reference_policy>("reference", pr.config(false))
          .run(mr::DispatchOutput{pr.x.view, {}, {pr.weights.view, pr.ids.view}},
               mr::unquantized_quant_info{pr.w13.view, pr.w2.view}, ref.view, {}, {});
      const std::pair<std::int64_t, std::vector<std::int64_t>> batches[] = {
          {1, {0, -1, -1}}, {7, {0, 3, 6}}, {64, {63, 1, 30}}, {512, {100, 511, 0}}, {4096, {4095, 2048, 7}}};
      std::vector<std::vector<unsigned char>> first(probes::count);
      for (const auto& [m, at] : batches) {
        std::string plan;
        const auto rows = pr.run(m, at, true, rng, &plan);
        CAPTURE(plan);
        CHECK(plan.find(": wgmma ") != std::string::npos);  // one kernel family at every M
        if (sh.e == 8 && m <= 64) CHECK(plan.find("GEMM2 on m64n128") != std::string::npos);
        const auto check_rows = [&](const std::vector<std::vector<unsigned char>>& got_rows) {
          for (int j = 0; j < probes::count; ++j) {
            if (got_rows[j].empty()) continue;
            CAPTURE(j);
            // Within the dtype's bound of the reference (no poison, nothing non-finite) ...
            host_tensor got(t, {1, sh.h}), want(t, {1, sh.h});
            std::memcpy(got.view.data, got_rows[j].data(), got_rows[j].size());
            std::memcpy(want.view.data, static_cast<const char*>(ref.view.data) + j * got_rows[j].size(),
                        got_rows[j].size());
            CHECK(mr::test::rel_error(got.view, want.view) <= per_row_factor * bound_for(t));
            // ... and bit for bit what the probe got in the first batch it ran in.
            if (first[j].empty()) first[j] = got_rows[j];
            else CHECK_MESSAGE(got_rows[j] == first[j], "probe ", j, " changed its bits at M=", m);
          }
        };
        check_rows(rows);
        if (sh.e == 16 && m <= 7) {
          std::string ordered_plan;
          const auto ordered = pr.run(m, at, true, rng, &ordered_plan, tuning::stream_ordered);
          CAPTURE(ordered_plan);
          CHECK(ordered_plan.find("stream ordered") != std::string::npos);
          check_rows(ordered);
        }
      }
    }
  }
}

TEST_CASE("cuda_fused workspace: the atomic mode needs no [M*k, H] rows, decode no gathered copy of x") {
  // I past gpu::plan_detail::rows_store_max_intermediate: the default keeps the reductions at every M.
  const mr::MoeRunnerConfig fast({.num_experts = 8, .hidden_size = 4096, .intermediate_size = 2048, .top_k = 2});
  mr::moe_config_params det_params = fast.params();
  det_params.deterministic = true;
  const mr::MoeRunnerConfig det(det_params);
  for (std::int64_t m : {1, 64, 4096}) {
    const std::size_t slots = static_cast<std::size_t>(m) * 2;
    const std::size_t act = slots * 2048 * 2, rows = slots * 4096 * 2;
    const mr::cuda_fused_policy fast_runner(fast);
    const std::size_t fast_bytes = fast_runner.workspace_bytes(m);
    const std::size_t det_bytes = mr::cuda_fused_policy(det).workspace_bytes(m);
    // Prefill's 128-row tiles load A by TMA from x's rows gathered in plan order ([M*k, H]
    // more); decode never does.
    const bool gathered = fast_runner.plan(m).gather_a;
    CAPTURE(m);
    CAPTURE(gathered);
    if (m == 1) CHECK_FALSE(gathered);
    CHECK(fast_bytes >= act + (gathered ? rows : 0));
    // The rest is the routing plan (two int32 per slot), the tile schedule (64-row tiles at
    // worst) and alignment.
    CHECK(fast_bytes <= act + (gathered ? rows : 0) + slots * 8 + (slots / 64 + 8) * 16 + 8 * 256 + 64 * 1024);
    CHECK(det_bytes >= fast_bytes + rows);
  }
  // One buffer for every batch up to the largest: the largest need over the token counts (the
  // deterministic decode's K-split parts outweigh larger batches' rows), and no more than runs take.
  const mr::cuda_fused_policy det_runner(det);
  std::size_t most = 0;
  for (std::int64_t m = 0; m <= 300; ++m) most = std::max(most, det_runner.workspace_bytes(m));
  CHECK(det_runner.max_workspace_bytes(300) == most);
  CHECK(most >= det_runner.workspace_bytes(300));
  CHECK_THROWS_AS(det_runner.max_workspace_bytes(std::int64_t{1} << 40), mr::invalid_argument_error);
  CHECK_THROWS_AS(det_runner.max_workspace_bytes(-1), mr::invalid_argument_error);
}

namespace {

// Device tensors of a given config, filled with 0x3c bytes (finite in bf16 and f16); the
// caller bends one argument and expects the run to be refused with the output untouched.
struct raw_setup {
  mr::MoeRunnerConfig cfg;
  mr::dtype x_type, w_type;
  device_buffer x, w13, w2, wt, id, out, ws;
  std::optional<runner_t> runner;

  raw_setup(int h, int i, mr::dtype xt, mr::dtype wt_type)
      : cfg(mr::moe_config_params{.num_experts = 4, .hidden_size = h, .intermediate_size = i, .top_k = 2}),
        x_type(xt),
        w_type(wt_type),
        x(4 * h * mr::dtype_size(xt) + 64),
        w13(4 * cfg.w13_rows() * h * mr::dtype_size(wt_type) + 64),
        w2(4 * h * i * mr::dtype_size(wt_type) + 64),
        wt(4 * 2 * 4),
        id(4 * 2 * 4),
        out(4 * h * mr::dtype_size(xt) + 64) {
    runner.emplace("cuda_fused", cfg);
    ws = device_buffer(runner->workspace_bytes(4));
    for (device_buffer* b : {&x, &w13, &w2, &wt}) MOE_CUDA_CHECK(cudaMemset(b->get(), 0x3c, b->bytes()));
    MOE_CUDA_CHECK(cudaMemset(id.get(), 0, id.bytes()));
    MOE_CUDA_CHECK(cudaMemset(out.get(), 0x5a, out.bytes()));
  }

  // Runs with each pointer offset by the given number of bytes.
  void run(std::size_t x_off = 0, std::size_t w13_off = 0, std::size_t w2_off = 0, std::size_t out_off = 0) {
    const auto dev = mr::memory_space::device;
    const auto h = cfg.hidden_size(), i = cfg.intermediate_size();
    mr::DispatchOutput d{mr::tensor_view::contiguous(static_cast<char*>(x.get()) + x_off, x_type, {4, h}, dev), {},
                         {mr::tensor_view::contiguous(wt.get(), mr::dtype::f32, {4, 2}, dev),
                          mr::tensor_view::contiguous(id.get(), mr::dtype::i32, {4, 2}, dev)}};
    mr::unquantized_quant_info q{
        mr::tensor_view::contiguous(static_cast<char*>(w13.get()) + w13_off, w_type, {4, cfg.w13_rows(), h}, dev),
        mr::tensor_view::contiguous(static_cast<char*>(w2.get()) + w2_off, w_type, {4, h, i}, dev)};
    const auto o = mr::tensor_view::contiguous(static_cast<char*>(out.get()) + out_off, x_type, {4, h}, dev);
    runner->run(d, q, o, {ws.get(), ws.bytes()}, cuda::stream_ref(cudaStream_t{}));
  }

  void require_untouched() {
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    for (unsigned char b : out.download<unsigned char>(out.bytes())) REQUIRE(b == 0x5a);
  }
};

template <class E>
void expect_refusal(raw_setup& s, const char* phrase, std::size_t x_off = 0, std::size_t w13_off = 0,
                    std::size_t w2_off = 0, std::size_t out_off = 0) {
  CAPTURE(phrase);
  try {
    s.run(x_off, w13_off, w2_off, out_off);
    FAIL("the run was accepted");
  } catch (const E& e) {
    CHECK_MESSAGE(std::string(e.what()).find(phrase) != std::string::npos, e.what());
  }
  s.require_untouched();
}

}  // namespace

TEST_CASE("cuda_fused refuses what it cannot run, with a clear error, writing nothing") {
  SUBCASE("f32 activations") {
    raw_setup s(64, 32, mr::dtype::f32, mr::dtype::f32);
    expect_refusal<mr::unsupported_error>(s, "bf16 or f16");
  }
  SUBCASE("weights of another dtype") {
    raw_setup s(64, 32, mr::dtype::bf16, mr::dtype::f16);
    expect_refusal<mr::invalid_argument_error>(s, "dtype of hidden_states");
  }
  SUBCASE("hidden_size not a multiple of 8") {
    raw_setup s(100, 32, mr::dtype::bf16, mr::dtype::bf16);
    expect_refusal<mr::invalid_argument_error>(s, "hidden_size must be a multiple of 8");
  }
  SUBCASE("intermediate_size not a multiple of 8") {
    raw_setup s(64, 36, mr::dtype::f16, mr::dtype::f16);
    expect_refusal<mr::invalid_argument_error>(s, "intermediate_size must be a multiple of 8");
  }
  SUBCASE("misaligned pointers") {
    raw_setup s(64, 32, mr::dtype::bf16, mr::dtype::bf16);
    expect_refusal<mr::invalid_argument_error>(s, "hidden_states must be 16-byte aligned", 8, 0, 0);
    expect_refusal<mr::invalid_argument_error>(s, "w13 must be 16-byte aligned", 0, 2, 0);
    expect_refusal<mr::invalid_argument_error>(s, "w2 must be 16-byte aligned", 0, 0, 4);
    // GEMM2 stores into the output unless it combines deterministically.
    expect_refusal<mr::invalid_argument_error>(s, "output must be 16-byte aligned", 0, 0, 0, 4);
  }
  SUBCASE("a tuning newer than the device") {
    if (mr::gpu::current_device_facts().code_arch < 90) {
      raw_setup s(64, 32, mr::dtype::bf16, mr::dtype::bf16);
      s.runner->visit([](auto& core) {
        if constexpr (std::is_same_v<std::decay_t<decltype(core)>, mr::cuda_fused_policy>)
          core.set_gemm_tuning(tuning::sm90);
      });
      expect_refusal<mr::unsupported_error>(s, "needs code compiled for sm_90");
    }
  }
  SUBCASE("the wgmma tuning without sm_90a code") {
    if (!mr::gpu::wgmma_gemm_available(mr::gpu::current_device_facts())) {
      raw_setup s(64, 32, mr::dtype::bf16, mr::dtype::bf16);
      s.runner->visit([](auto& core) {
        if constexpr (std::is_same_v<std::decay_t<decltype(core)>, mr::cuda_fused_policy>)
          core.set_gemm_tuning(tuning::sm90_wgmma);
      });
      expect_refusal<mr::unsupported_error>(s, "needs code compiled for sm_90");
    }
  }
  SUBCASE("the same runner still runs after refusals") {
    raw_setup s(64, 32, mr::dtype::bf16, mr::dtype::bf16);
    expect_refusal<mr::invalid_argument_error>(s, "hidden_states must be 16-byte aligned", 8, 0, 0);
    s.run();
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    std::int64_t written = 0;
    for (std::uint16_t v : s.out.download<std::uint16_t>(4 * 64)) written += v != 0x5a5a;
    CHECK(written == 4 * 64);
  }
}

int main(int argc, char** argv) {
  if (!mr::test::have_gpu()) {
    std::puts("no GPU: skipping the cuda_fused tests");
    return mr::test::skip_exit_code;
  }
  doctest::Context ctx;
  ctx.applyCommandLine(argc, argv);
  return ctx.run();
}
