// The cuda_fused_fp8 backend against the reference's fp8 path (block, per-tensor and per-channel
// weight scales), which quantizes at the same points by the same rule: random and edge shapes,
// every combine mode, pre-quantized inputs, NaN isolation, determinism and graph replay, batch invariance, bad
// input rejected with nothing written, and the bad-id status. Exit 77 without a GPU; the
// cases skip on a GPU without sm_90a code (the backend then refuses with unsupported_error).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gpu_test_util.hpp"
#include "moe_problem.hpp"
#include "moerunner/moerunner.hpp"
#include "moerunner/policies/cuda_fused_fp8_policy.cuh"

namespace mr = moerunner;
using mr::test::host_tensor;
using mr::test::ids_kind;
using shape = mr::test::moe_shape;
using options = mr::test::moe_options;

namespace {

// Normwise bound against the reference, which shares the quantization points: what differs is
// the f32 (and, within a 128-K block, the tensor cores' narrower) summation order, which moves
// an act value across an e4m3 rounding boundary now and then (a 1/8 relative step of that one
// value), plus the output's bf16/f16 rounding.
constexpr double fp8_bound = 1e-2;
// Per token, on shapes with I >= 1024 (model shapes): 3e-2. A flip moves one act value by 1/8 of
// itself; with I = 256 one flip of a token's largest act value moves that token's row by ~3%
// (measured up to 3.05e-2), while the normwise error over all tokens stays under 1e-2.
constexpr double fp8_token_bound = 3e-2;
constexpr int fp8_token_bound_min_i = 1024;
// The normwise bound rests on averaging over many act values. Where the output comes from few
// (M * k * I under 16384), one flip of a large act value moves all of it by about 1% (measured
// 1.11e-2 at M = 1, k = 2, I = 128, and at M = 7, k = 2, I = 256): there the bound that holds is
// the per-token one (one flip per token).
constexpr std::int64_t fp8_normwise_min_act = 16384;
double normwise_bound(const shape& s) {
  return static_cast<std::int64_t>(s.m) * s.k * s.i >= fp8_normwise_min_act ? fp8_bound : fp8_token_bound;
}

bool fp8_gpu() { return mr::gpu::wgmma_gemm_available(mr::gpu::current_device_facts()); }

// A problem of moe_problem's inputs with fp8 weights (scales of `scaling`) and the reference's
// fp8 output.
struct fp8_problem {
  mr::test::moe_problem base;  // x, ids, weights, config (its unquantized reference left uncomputed)
  host_tensor w13, w2, s13, s2, ref;
  host_tensor xq, xs;  // with prequantized: x in e4m3 and its group scales
  bool prequantized;
  mr::fp8_weight_scaling scaling;

  // edit_x: changes x before anything is quantized or computed from it.
  fp8_problem(const shape& s, mr::dtype t, const options& o, std::mt19937& rng, bool preq = false,
              std::optional<mr::MoeRunnerConfig> cfg = std::nullopt,
              mr::fp8_weight_scaling weight_scaling = mr::fp8_weight_scaling::block128,
              const std::function<void(host_tensor&)>& edit_x = {})
      : base(s, t, o, rng, /*with_reference=*/false), prequantized(preq), scaling(weight_scaling) {
    if (cfg) base.cfg = *cfg;
    if (edit_x) edit_x(base.x);
    if (scaling == mr::fp8_weight_scaling::block128) {
      mr::test::quantize_e4m3_blocks(base.w13, 128, w13, s13);
      mr::test::quantize_e4m3_blocks(base.w2, 128, w2, s2);
    } else {
      const bool per_tensor = scaling == mr::fp8_weight_scaling::per_tensor;
      mr::test::quantize_e4m3_rows(base.w13, per_tensor, w13, s13);
      mr::test::quantize_e4m3_rows(base.w2, per_tensor, w2, s2);
    }
    if (preq) mr::test::quantize_e4m3_blocks(base.x, 1, xq, xs);
    const mr::dtype out_type = preq ? mr::dtype::bf16 : t;
    ref = o.no_combine ? host_tensor(out_type, {s.m, s.k, s.h}) : host_tensor(out_type, {s.m, s.h});
    if (o.inplace) {
      host_tensor xin = base.x;
      with_quant(w13, s13, w2, s2, [&](const auto& q) {
        mr::test::run_reference(base.cfg, mr::DispatchOutput{xin.view, {}, base.topk(base.weights.view, base.ids.view)},
                                q, xin.view);
      });
      std::memcpy(ref.view.data, xin.view.data, ref.view.bytes());
    } else {
      with_quant(w13, s13, w2, s2, [&](const auto& q) {
        mr::test::run_reference(base.cfg, dispatch_of(base.x, xq, xs, base.weights, base.ids), q, ref.view);
      });
    }
  }

  template <class Tensor>
  static mr::fp8_block_quant_info quant(const Tensor& w13, const Tensor& s13, const Tensor& w2, const Tensor& s2) {
    return {w13.view, s13.view, w2.view, s2.view};
  }

  // Calls f with the quant info of this problem's scaling over the four tensors.
  template <class Tensor, class F>
  void with_quant(const Tensor& w13, const Tensor& s13, const Tensor& w2, const Tensor& s2, F&& f) const {
    switch (scaling) {
      case mr::fp8_weight_scaling::per_tensor:
        f(mr::fp8_tensor_quant_info{w13.view, s13.view, w2.view, s2.view});
        break;
      case mr::fp8_weight_scaling::per_channel:
        f(mr::fp8_channel_quant_info{w13.view, s13.view, w2.view, s2.view});
        break;
      case mr::fp8_weight_scaling::block128: f(quant(w13, s13, w2, s2)); break;
    }
  }

  template <class Tensor>
  mr::DispatchOutput dispatch_of(const Tensor& x, const Tensor& xq, const Tensor& xs, const Tensor& weights,
                                 const Tensor& ids) const {
    if (prequantized) return {xq.view, xs.view, base.topk(weights.view, ids.view)};
    return {x.view, {}, base.topk(weights.view, ids.view)};
  }
};

using runner_t = mr::MoeRunner<mr::reference_policy, mr::cuda_fused_fp8_policy>;

// Device copies of an fp8 problem and a runner with exactly the workspace it asks for; `forced`
// forces the stream GEMMs, the narrow tiles, the pairs or fours of CTAs or the 128-row CTAs on or
// off, the K loop, the raster band, the work items handed out, GEMM2's K splits, its rows against
// its reductions, its A rows by TMA or its store warps (unset: the plan's rules). Subcases of the
// wide tiles' settings force the narrow tiles off, which the plan takes up to 8 rows per expert.
struct fp8_on_device {
  mr::test::device_tensor x, xq, xs, w13, w2, s13, s2, weights, ids;
  mr::test::device_buffer out_buf, ws_buf;
  mr::tensor_view out;
  runner_t runner;
  mr::workspace_view ws;
  mr::moe_status* status = nullptr;

  explicit fp8_on_device(const fp8_problem& p, const mr::gpu::fp8_settings& forced = {})
      : x(p.base.x), w13(p.w13), w2(p.w2), s13(p.s13), s2(p.s2), weights(p.base.weights), ids(p.base.ids),
        runner("cuda_fused_fp8", p.base.cfg) {
    runner.visit([&](auto& core) {
      if constexpr (requires { core.set_settings(forced); }) core.set_settings(forced);
    });
    if (p.prequantized) {
      xq = mr::test::device_tensor(p.xq);
      xs = mr::test::device_tensor(p.xs);
    }
    if (p.base.opt.inplace) {
      out = x.view;
    } else {
      out_buf = mr::test::device_buffer(p.ref.view.bytes());
      out = p.ref.view;
      out.data = out_buf.get();
      out.space = mr::memory_space::device;
    }
    const std::size_t need = runner.workspace_bytes(p.base.s.m);
    ws_buf = mr::test::device_buffer(need);
    ws = {ws_buf.get(), need};
  }

  void launch(const fp8_problem& p, cudaStream_t stream) {
    mr::DispatchOutput d = p.dispatch_of(x, xq, xs, weights, ids);
    d.status = status;
    p.with_quant(w13, s13, w2, s2, [&](const auto& q) { runner.run(d, q, out, ws, cuda::stream_ref(stream)); });
  }

  host_tensor result(const fp8_problem& p) const {
    host_tensor h = p.ref;
    if (out.bytes()) MOE_CUDA_CHECK(cudaMemcpy(h.view.data, out.data, out.bytes(), cudaMemcpyDeviceToHost));
    return h;
  }

  // One run into an output poisoned with NaN (left as it is in place).
  host_tensor run_once(const fp8_problem& p) {
    if (!p.base.opt.inplace && out.bytes()) MOE_CUDA_CHECK(cudaMemset(out.data, 0xff, out.bytes()));
    launch(p, nullptr);
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    return result(p);
  }
};

// The largest normwise relative error of one token's rows (rows of NaN in both count as equal).
double worst_token_error(const host_tensor& got, const host_tensor& want, std::int64_t tokens) {
  if (tokens == 0) return 0.0;
  const std::int64_t per = want.view.numel() / tokens;
  double worst = 0.0;
  for (std::int64_t t = 0; t < tokens; ++t) {
    double num = 0.0, den = 0.0;
    for (std::int64_t i = t * per; i < (t + 1) * per; ++i) {
      const double a = mr::test::element(got.view, i), b = mr::test::element(want.view, i);
      if (std::isnan(a) != std::isnan(b) || std::isinf(a)) return INFINITY;
      if (std::isnan(b)) continue;
      num += (a - b) * (a - b);
      den += b * b;
    }
    worst = std::max(worst, den > 0.0 ? std::sqrt(num / den) : std::sqrt(num));
  }
  return worst;
}

double check_case(const shape& s, mr::dtype t, const options& o, std::mt19937& rng, bool preq = false,
                  mr::fp8_weight_scaling scaling = mr::fp8_weight_scaling::block128,
                  const mr::gpu::fp8_settings& forced = {}) {
  CAPTURE(mr::test::describe(s, t, o));
  CAPTURE(preq);
  CAPTURE(static_cast<int>(scaling));
  fp8_problem p(s, t, o, rng, preq, std::nullopt, scaling);
  fp8_on_device g(p, forced);
  if (forced.stream && s.m > 0)
    CHECK(g.runner.describe(s.m).find(*forced.stream ? "stream e4m3" : "wgmma e4m3") != std::string::npos);
  if (forced.quads.value_or(false) && s.m > 0)
    CHECK(g.runner.describe(s.m).find("wgmma e4m3 m64x4") != std::string::npos);
  else if (forced.pairs.value_or(false) && s.m > 0)
    CHECK(g.runner.describe(s.m).find("wgmma e4m3 m64x2") != std::string::npos);
  if (forced.narrow.value_or(false) && !forced.stream.value_or(false) && s.m > 0)
    CHECK(g.runner.describe(s.m).find("wgmma e4m3 narrow") != std::string::npos);
  if (forced.schedule_in_gemms.value_or(false) && s.m > 0 && s.m * s.k <= 64)
    CHECK(g.runner.describe(s.m).find("built in the GEMMs") != std::string::npos);
  if (forced.tall.value_or(false) && !forced.pairs.value_or(false) && s.m > 0)
    CHECK(g.runner.describe(s.m).find("wgmma e4m3 m128") != std::string::npos);
  if (forced.expert_bands.value_or(false) && !forced.stream.value_or(false) && s.m > 0)
    CHECK(g.runner.describe(s.m).find("expert bands of") != std::string::npos);
  // GEMM2's K splits where the plan may split (combined output), at most its K tiles.
  if (forced.down_k_splits.value_or(1) > 1 && !o.no_combine && s.m > 0) {
    const int down_k_tiles = s.i / mr::fp8_block_quant_info::group;
    CHECK(g.runner.describe(s.m).find("in " + std::to_string(std::min(*forced.down_k_splits, down_k_tiles)) +
                                      " K splits") != std::string::npos);
  }
  // GEMM2's rows (their f32 parts where its K is split) or reductions where forced and the run
  // may take either.
  if (forced.down_rows && !o.no_combine && !o.deterministic && !forced.stream.value_or(false) && s.m > 0) {
    const std::string d = g.runner.describe(s.m);
    const bool split = d.find(" K splits") != std::string::npos;
    CHECK(d.find(*forced.down_rows ? (split ? "GEMM2 partials" : "GEMM2 rows") : "GEMM2 accumulate") !=
          std::string::npos);
  }
  // GEMM2's store warps where forced and allowed (not into K-split parts, as deterministic runs
  // at these sizes may store), never where forced off.
  if (forced.staged_down && !forced.stream.value_or(false) && s.m > 0) {
    const bool staged = g.runner.describe(s.m).find("GEMM2 stored by store warps") != std::string::npos;
    if (!*forced.staged_down) CHECK_FALSE(staged);
    else if (!o.deterministic && !forced.tall.value_or(false) && !forced.quads.value_or(false) &&
             !forced.hand_out.value_or(false) && forced.down_a_tma.value_or(true))
      CHECK(staged);
  }
  // GEMM1's K splits where forced on single 64-row CTAs (at most its K tiles).
  if (forced.up_k_splits.value_or(1) > 1 && !forced.stream.value_or(false) && s.m > 0 &&
      !forced.pairs.value_or(true) && !forced.tall.value_or(false) && !forced.hand_out.value_or(false))
    CHECK(g.runner.describe(s.m).find("GEMM1 in " + std::to_string(std::min(*forced.up_k_splits, s.h / 128)) +
                                      " K splits") != std::string::npos);
  // GEMM1's store warps where forced on the gated GEMM1's 64-row CTAs, alone or in pairs.
  if (forced.staged_up.value_or(false) && !forced.stream.value_or(false) && s.m > 0 && o.gated &&
      !forced.tall.value_or(false) && !forced.quads.value_or(false) && !forced.hand_out.value_or(false) &&
      forced.up_k_splits.value_or(1) == 1)
    CHECK(g.runner.describe(s.m).find("GEMM1's act quantized by store warps") != std::string::npos);
  if (forced.dependent_gemms && !forced.stream.value_or(false) && s.m > 0)
    CHECK((g.runner.describe(s.m).find("dependent launches") != std::string::npos) == *forced.dependent_gemms);
  if (forced.down_a_tma && !forced.stream.value_or(false) && s.m > 0)
    CHECK((g.runner.describe(s.m).find("GEMM2's A by TMA") != std::string::npos) == *forced.down_a_tma);
  const host_tensor got = g.run_once(p);
  const double err = mr::test::rel_error(got.view, p.ref.view);
  CHECK_MESSAGE(err <= normwise_bound(s), "rel err ", err, " bound ", normwise_bound(s));
  const double tok = worst_token_error(got, p.ref, s.m);
  if (s.i >= fp8_token_bound_min_i) CHECK_MESSAGE(tok <= fp8_token_bound, "worst token rel err ", tok);
  return err;
}

// The cases each wide tile (pairs or fours of CTAs, 128-row CTAs) runs, at 75-150 rows per expert
// unless named: run(shape, dtype, options[, prequantized]).
template <class Run>
void wide_tile_cases(const Run& run) {
  const auto bf16 = mr::dtype::bf16;
  const shape sh{600, 8, 2, 256, 256};
  run(sh, bf16, {});
  run(sh, bf16, {.ids = ids_kind::skewed});  // tiles with few rows: a CTA of a pair, or a warpgroup, with none
  run(sh, bf16, {.interleaved = true});
  run({600, 8, 2, 384, 384}, bf16, {.gated = false});  // H, I % 256 = 128
  run({600, 8, 2, 384, 256}, bf16, {.act = mr::activation_kind::swiglu_clamped});
  run(sh, bf16, {.ids = ids_kind::random_filtered, .no_combine = true});
  run(sh, bf16, {.deterministic = true});
  run({600, 8, 1, 256, 256}, bf16, {.weight_on_input = true});
  run(sh, mr::dtype::f16, {.inplace = true});
  run(sh, bf16, {}, true);
  run({700, 8, 2, 1024, 1536}, bf16, {});  // per-token bound applies
}

}  // namespace

TEST_CASE("fp8 against the reference's fp8 path") {
  if (!fp8_gpu()) return;
  const unsigned seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  const auto bf16 = mr::dtype::bf16;
  double worst = 0.0;
  SUBCASE("edge token counts") {
    for (int m : {0, 1, 7, 300}) worst = std::max(worst, check_case({m, 8, 2, 256, 384}, bf16, {}, rng));
  }
  SUBCASE("top-k, experts, and sizes not multiple of the 256-row tile") {
    worst = std::max(worst, check_case({64, 16, 4, 384, 256}, bf16, {}, rng));   // H % 256 = 128
    worst = std::max(worst, check_case({50, 64, 8, 128, 128}, bf16, {}, rng));
    worst = std::max(worst, check_case({40, 128, 6, 256, 128}, bf16, {}, rng));  // most experts get no rows
    worst = std::max(worst, check_case({130, 8, 1, 640, 640}, mr::dtype::f16, {}, rng));
    worst = std::max(worst, check_case({96, 8, 2, 1024, 1536}, bf16, {}, rng));  // per-token bound applies
  }
  SUBCASE("routing shapes") {
    for (ids_kind ids : {ids_kind::skewed, ids_kind::one_expert, ids_kind::filtered, ids_kind::random_filtered,
                         ids_kind::few_experts, ids_kind::all_filtered})
      worst = std::max(worst, check_case({97, 8, 2, 256, 256}, bf16, {.ids = ids}, rng));
    worst = std::max(worst, check_case({200, 8, 1, 256, 256}, bf16, {.ids = ids_kind::one_expert}, rng));
  }
  SUBCASE("activations, layouts and combine modes") {
    const shape sh{33, 8, 2, 256, 256};
    worst = std::max(worst, check_case(sh, bf16, {.act = mr::activation_kind::gelu}, rng));
    worst = std::max(worst, check_case(sh, bf16, {.act = mr::activation_kind::swiglu_clamped}, rng));
    worst = std::max(worst, check_case(sh, bf16, {.act = mr::activation_kind::gelu, .gated = false}, rng));
    worst = std::max(worst, check_case({33, 8, 2, 256, 384}, bf16, {.gated = false}, rng));  // I % 256 = 128
    worst = std::max(worst, check_case(sh, bf16, {.interleaved = true}, rng));
    worst = std::max(worst, check_case(sh, bf16, {.ids = ids_kind::filtered, .no_combine = true}, rng));
    worst = std::max(worst, check_case({33, 8, 1, 256, 256}, bf16, {.weight_on_input = true}, rng));  // needs k = 1
    worst = std::max(worst, check_case(sh, bf16, {.inplace = true}, rng));
    worst = std::max(worst, check_case(sh, bf16, {.scaling = 2.5f}, rng));
    worst = std::max(worst, check_case(sh, bf16, {.scaling = 2.5f, .scaling_in_weights = true}, rng));
    worst = std::max(worst, check_case(sh, bf16, {.deterministic = true}, rng));
    worst = std::max(worst, check_case(sh, bf16, {.inplace = true, .deterministic = true}, rng));
  }
  SUBCASE("pairs of CTAs on 128-row tiles") {
    // Forced on at 75-150 rows per expert (the plan pairs from an average of 96), and once by the rule.
    const mr::gpu::fp8_settings pairs{.stream = std::nullopt, .pairs = true};
    const auto pair_case = [&](const shape& c, mr::dtype t, const options& o, bool preq = false) {
      worst = std::max(worst, check_case(c, t, o, rng, preq, mr::fp8_weight_scaling::block128, pairs));
    };
    wide_tile_cases(pair_case);
    const shape by_rule{4200, 2, 1, 256, 256};  // 2100 rows per expert
    CHECK(mr::gpu::make_fp8_plan(mr::MoeRunnerConfig({.num_experts = 2, .hidden_size = 256, .intermediate_size = 256,
                                                      .top_k = 1}),
                                 by_rule.m, mr::gpu::device_target_of(mr::gpu::current_device_facts()))
              .cluster_m == 2);
    worst = std::max(worst, check_case(by_rule, bf16, {}, rng));
  }
  SUBCASE("fours of CTAs on 256-row tiles") {
    // Forced on (the plan takes them only when asked): at 75-150 rows per expert the last two or
    // three CTAs of a four have no rows; at 750 the third tile is partly filled.
    const mr::gpu::fp8_settings quads{.stream = std::nullopt, .quads = true};
    const auto quad_case = [&](const shape& c, mr::dtype t, const options& o, bool preq = false,
                               mr::fp8_weight_scaling sc = mr::fp8_weight_scaling::block128) {
      worst = std::max(worst, check_case(c, t, o, rng, preq, sc, quads));
    };
    wide_tile_cases(quad_case);
    const shape many{3000, 8, 2, 256, 512};  // 750 rows per expert
    quad_case({50, 8, 2, 256, 256}, bf16, {});  // 12 rows per expert: three CTAs of each four without rows
    quad_case(many, bf16, {});
    quad_case(many, bf16, {.ids = ids_kind::skewed});
    quad_case({600, 8, 2, 256, 256}, bf16, {.ids = ids_kind::one_expert});  // one expert's many tiles
    quad_case({3000, 8, 2, 384, 384}, bf16, {.act = mr::activation_kind::gelu, .gated = false});
    quad_case(many, bf16, {}, false, mr::fp8_weight_scaling::per_tensor);
    quad_case(many, bf16, {}, false, mr::fp8_weight_scaling::per_channel);
    quad_case({64, 8, 2, 640, 1152}, bf16, {});  // GEMM2's K split where items are few
    // The same bits as single CTAs where deterministic (and GEMM2's K not split in either): a
    // CTA's sums do not depend on the tile's other CTAs.
    fp8_problem p(many, bf16, {.deterministic = true}, rng);
    fp8_on_device single(p, {.stream = false, .pairs = false}), four(p, quads);
    for (const fp8_on_device* d : {&single, &four})
      CHECK(d->runner.describe(many.m).find("GEMM2 rows + combine kernel") != std::string::npos);
    const host_tensor want = single.run_once(p), got = four.run_once(p);
    CHECK(std::memcmp(got.view.data, want.view.data, want.view.bytes()) == 0);
  }
  SUBCASE("GEMM2's K split forced") {
    // Where the rule takes none (6 K tiles, items past two waves at Qwen3-30B-A3B's decode):
    // 3 splits into the output by atomics, into f32 parts where deterministic, and a count past
    // the K tiles (one split per K tile).
    const shape sh{8, 16, 4, 256, 768};
    const mr::gpu::fp8_settings split3{.stream = false, .down_k_splits = 3, .narrow = false};
    for (const options& o : {options{}, options{.deterministic = true}})
      worst = std::max(worst, check_case(sh, bf16, o, rng, false, mr::fp8_weight_scaling::block128, split3));
    worst = std::max(worst, check_case({300, 16, 4, 256, 768}, bf16, {}, rng, false,
                                       mr::fp8_weight_scaling::block128,
                                       {.stream = false, .down_k_splits = 40, .narrow = false}));
  }
  SUBCASE("GEMM2's rows or its reductions forced") {
    // Each where the rule takes the other: rows below 4096 slots and past I = 2048, reductions
    // at I = 768 from 4096 slots; alone and in pairs, with weights on the input and in place.
    for (const bool rows : {true, false}) {
      CAPTURE(rows);
      const mr::gpu::fp8_settings single{.stream = false, .pairs = false, .down_rows = rows};
      const mr::gpu::fp8_settings paired{.stream = false, .pairs = true, .down_rows = rows};
      for (const mr::gpu::fp8_settings& f : {single, paired}) {
        const auto run = [&](const shape& c, const options& o) {
          worst = std::max(worst, check_case(c, bf16, o, rng, false, mr::fp8_weight_scaling::block128, f));
        };
        run({97, 8, 2, 256, 256}, {});
        run({300, 8, 2, 256, 2176}, {});  // I past the rule's bound
        run({520, 16, 8, 128, 768}, {.ids = ids_kind::skewed});  // 4160 slots
        run({300, 8, 1, 256, 256}, {.weight_on_input = true});
        run({300, 8, 2, 256, 256}, {.inplace = true});
        run({0, 8, 2, 256, 256}, {});
      }
    }
  }
  SUBCASE("GEMM2's A rows by TMA or by cp.async") {
    // The plan's TMA boxes read the rows that follow a tile (never stored) and zeros past act's
    // end; the cp.async loads zero-fill past the tile. Forced both ways on single CTAs, pairs and
    // 128-row CTAs, with every GEMM2 store, skewed tiles and K splits.
    for (const bool tma : {true, false}) {
      CAPTURE(tma);
      for (const mr::gpu::fp8_settings& f :
           {mr::gpu::fp8_settings{.stream = false, .pairs = false, .down_a_tma = tma},
            mr::gpu::fp8_settings{.stream = false, .pairs = true, .down_a_tma = tma},
            mr::gpu::fp8_settings{.stream = false, .pairs = false, .tall = true, .down_a_tma = tma}}) {
        const auto run = [&](const shape& c, const options& o, mr::gpu::fp8_settings g = {}) {
          g.stream = f.stream, g.pairs = f.pairs, g.tall = f.tall, g.down_a_tma = f.down_a_tma, g.narrow = false;
          worst = std::max(worst, check_case(c, bf16, o, rng, false, mr::fp8_weight_scaling::block128, g));
        };
        run({97, 8, 2, 256, 256}, {});
        run({300, 8, 2, 384, 640}, {.ids = ids_kind::skewed});
        run({600, 8, 2, 256, 256}, {.ids = ids_kind::one_expert});
        run({300, 8, 2, 256, 256}, {.deterministic = true});
        run({300, 8, 2, 256, 256}, {.ids = ids_kind::random_filtered, .no_combine = true});
        run({300, 8, 2, 256, 768}, {}, {.down_k_splits = 3});
        run({1, 8, 2, 256, 256}, {});
        run({0, 8, 2, 256, 256}, {});
      }
    }
  }
  SUBCASE("GEMM2's sums stored by store warps") {
    // Forced (the plan takes them where GEMM2's K loop is short) on single CTAs and pairs, after
    // GEMM1 with either K loop (GEMM2's is the plain one): rows, reductions (with K splits),
    // slots; skewed and one-expert tiles (CTAs of a pair without rows), N not a multiple of the
    // 256-column tile, the router weight on either side, in place, and 0 and 1 tokens.
    for (const auto& way : {std::pair{false, mr::gpu::fp8_k_loop::plain}, std::pair{true, mr::gpu::fp8_k_loop::plain},
                            std::pair{false, mr::gpu::fp8_k_loop::overlap},
                            std::pair{true, mr::gpu::fp8_k_loop::overlap}}) {
      const bool paired = way.first;
      const mr::gpu::fp8_k_loop loop = way.second;
      CAPTURE(paired);
      CAPTURE(static_cast<int>(loop));
      const auto run = [&](const shape& c, const options& o, mr::gpu::fp8_settings f = {}) {
        f.stream = false, f.pairs = paired, f.k_loop = loop, f.staged_down = f.staged_down.value_or(true);
        f.narrow = false;
        worst = std::max(worst, check_case(c, bf16, o, rng, false, mr::fp8_weight_scaling::block128, f));
      };
      run({97, 8, 2, 256, 256}, {});
      run({300, 8, 2, 384, 640}, {.ids = ids_kind::skewed});
      run({600, 8, 2, 256, 256}, {.ids = ids_kind::one_expert});
      run({300, 8, 2, 256, 256}, {}, {.down_rows = true});
      run({300, 8, 2, 256, 256}, {}, {.down_rows = false});
      run({300, 8, 2, 256, 768}, {}, {.down_k_splits = 3, .down_rows = false});
      run({300, 8, 2, 256, 256}, {.ids = ids_kind::random_filtered, .no_combine = true});
      run({300, 8, 1, 256, 256}, {.weight_on_input = true});
      run({300, 8, 2, 256, 256}, {.inplace = true});
      run({1, 8, 2, 256, 256}, {});
      run({0, 8, 2, 256, 256}, {});
      // Forced off where the plan would take them: the consumers' own epilogue, each store.
      run({300, 8, 2, 256, 256}, {}, {.down_rows = true, .staged_down = false});
      run({300, 8, 2, 256, 768}, {}, {.down_k_splits = 3, .down_rows = false, .staged_down = false});
      run({300, 8, 2, 256, 256}, {.ids = ids_kind::random_filtered, .no_combine = true}, {.staged_down = false});
    }
  }
  SUBCASE("GEMM1's act quantized by store warps") {
    // Forced (the plan takes them only when asked) on single CTAs and pairs: each gated
    // activation, interleaved gate/up rows, the router weight on the input, per-channel and
    // per-tensor scales, skewed and one-expert tiles (CTAs of a pair without rows), GEMM2 with
    // and without its own store warps, in place, e4m3 input, deterministic, no_combine, ~50
    // experts at 64 tokens, 0 and 1 token. (A GEMM1 without gate rows keeps its consumers'
    // epilogue: the plan's host test.)
    for (const bool paired : {false, true}) {
      CAPTURE(paired);
      const auto run = [&](const shape& c, const options& o, mr::gpu::fp8_settings f = {}, bool prequantized = false,
                           mr::fp8_weight_scaling scaling = mr::fp8_weight_scaling::block128) {
        f.stream = false, f.pairs = paired, f.staged_up = true, f.narrow = false;
        worst = std::max(worst, check_case(c, bf16, o, rng, prequantized, scaling, f));
      };
      run({97, 8, 2, 512, 256}, {});
      run({300, 8, 2, 384, 640}, {.ids = ids_kind::skewed});
      run({600, 8, 2, 256, 256}, {.ids = ids_kind::one_expert});
      run({97, 8, 2, 512, 256}, {.act = mr::activation_kind::gelu});
      run({97, 8, 2, 512, 256}, {.act = mr::activation_kind::swiglu_clamped});
      run({97, 8, 2, 512, 256}, {.interleaved = true});
      run({97, 8, 1, 512, 256}, {.weight_on_input = true});
      run({97, 8, 2, 512, 256}, {}, {}, false, mr::fp8_weight_scaling::per_channel);
      run({97, 8, 2, 512, 256}, {}, {}, false, mr::fp8_weight_scaling::per_tensor);
      run({300, 8, 2, 256, 256}, {}, {.staged_down = false});
      run({97, 8, 2, 512, 256}, {.inplace = true});
      run({97, 8, 2, 512, 256}, {}, {}, true);
      run({97, 8, 2, 512, 256}, {.deterministic = true});
      run({300, 8, 2, 256, 256}, {.ids = ids_kind::random_filtered, .no_combine = true});
      run({64, 128, 8, 512, 256}, {});
      run({1, 8, 2, 512, 256}, {});
      run({0, 8, 2, 512, 256}, {});
    }
  }
  SUBCASE("the wgmma GEMMs launched as programmatic dependents") {
    // Forced (the plan takes them only when asked): each GEMM loads its first item's first
    // weight tiles before its wait. Single CTAs, pairs and 128-row CTAs, both K loops; GEMM2 in
    // K splits (a CTA's first item a later split); in place (GEMM1, after the input's
    // quantization, clears the output that is its input); e4m3 input (GEMM1 then not a
    // dependent); more items than CTAs at decode sizes; 0 and 1 tokens.
    const auto run = [&](const shape& c, const options& o, mr::gpu::fp8_settings f = {}, bool prequantized = false) {
      f.stream = false, f.dependent_gemms = true, f.narrow = false;
      worst = std::max(worst, check_case(c, bf16, o, rng, prequantized, mr::fp8_weight_scaling::block128, f));
    };
    for (const auto loop : {mr::gpu::fp8_k_loop::plain, mr::gpu::fp8_k_loop::overlap}) {
      CAPTURE(static_cast<int>(loop));
      run({97, 8, 2, 256, 256}, {}, {.pairs = false, .k_loop = loop});
      run({600, 8, 2, 256, 256}, {.ids = ids_kind::skewed}, {.pairs = true, .k_loop = loop});
      run({300, 8, 2, 256, 768}, {}, {.pairs = false, .k_loop = loop, .down_k_splits = 3});
      run({300, 8, 2, 256, 256}, {.inplace = true}, {.pairs = false, .k_loop = loop});
      run({300, 8, 2, 256, 256}, {}, {.pairs = false, .k_loop = loop}, true);
    }
    run({600, 8, 2, 256, 256}, {}, {.pairs = false, .tall = true});
    run({64, 128, 8, 512, 256}, {}, {.pairs = false});  // ~50 active experts: several items per CTA
    run({300, 8, 2, 256, 256}, {.deterministic = true}, {.pairs = false});
    run({300, 8, 2, 256, 256}, {.ids = ids_kind::random_filtered, .no_combine = true}, {.pairs = false});
    run({1, 8, 2, 256, 256}, {}, {.pairs = false});
    run({0, 8, 2, 256, 256}, {}, {.pairs = false});
  }
  SUBCASE("GEMM1 in K splits, finished by the parts kernel") {
    // Forced (the plan splits GEMM1 only when asked) on single 64-row CTAs after either K loop:
    // gated and not, each activation, interleaved gate/up rows, the router weight on the input,
    // per-channel and per-tensor scales, in place, e4m3 input, more splits than K tiles
    // (clamped), deterministic, ~50 experts at 64 tokens, 0 and 1 token.
    const auto run = [&](const shape& c, const options& o, mr::gpu::fp8_settings f, bool prequantized = false,
                         mr::fp8_weight_scaling scaling = mr::fp8_weight_scaling::block128) {
      f.stream = false, f.pairs = false, f.narrow = false;
      worst = std::max(worst, check_case(c, bf16, o, rng, prequantized, scaling, f));
    };
    for (const auto loop : {mr::gpu::fp8_k_loop::plain, mr::gpu::fp8_k_loop::overlap})
      for (const int splits : {2, 3}) {
        CAPTURE(static_cast<int>(loop));
        CAPTURE(splits);
        run({97, 8, 2, 512, 256}, {}, {.k_loop = loop, .up_k_splits = splits});
        run({64, 128, 8, 512, 256}, {}, {.k_loop = loop, .up_k_splits = splits});
      }
    run({97, 8, 2, 512, 384}, {.act = mr::activation_kind::gelu, .gated = false}, {.up_k_splits = 2});
    run({97, 8, 2, 512, 256}, {.act = mr::activation_kind::swiglu_clamped}, {.up_k_splits = 2});
    run({97, 8, 2, 512, 256}, {.interleaved = true}, {.up_k_splits = 2});
    run({97, 8, 1, 512, 256}, {.weight_on_input = true}, {.up_k_splits = 3});
    run({97, 8, 2, 512, 256}, {}, {.up_k_splits = 2}, false, mr::fp8_weight_scaling::per_channel);
    run({97, 8, 2, 512, 256}, {}, {.up_k_splits = 2}, false, mr::fp8_weight_scaling::per_tensor);
    run({97, 8, 2, 512, 256}, {.inplace = true}, {.up_k_splits = 2});
    run({97, 8, 2, 512, 256}, {}, {.up_k_splits = 2}, true);
    run({97, 8, 2, 256, 256}, {}, {.up_k_splits = 5});  // H = 256: 2 K tiles
    run({97, 8, 2, 512, 256}, {.deterministic = true}, {.up_k_splits = 2});
    run({97, 8, 2, 512, 256}, {.ids = ids_kind::random_filtered, .no_combine = true}, {.up_k_splits = 2});
    run({1, 8, 2, 512, 256}, {}, {.up_k_splits = 2});
    run({0, 8, 2, 512, 256}, {}, {.up_k_splits = 2});
  }
  SUBCASE("128-row CTAs") {
    // Forced on (the plan takes them only when asked) at 12-150 rows per expert, where experts'
    // last tiles are partly or wholly past their rows.
    const shape sh{600, 8, 2, 256, 256};
    const mr::gpu::fp8_settings tall{.stream = std::nullopt, .pairs = false, .tall = true};  // pairs come first
    const auto tall_case = [&](const shape& c, mr::dtype t, const options& o, bool preq = false,
                               mr::fp8_weight_scaling sc = mr::fp8_weight_scaling::block128) {
      worst = std::max(worst, check_case(c, t, o, rng, preq, sc, tall));
    };
    wide_tile_cases(tall_case);
    tall_case({50, 8, 2, 256, 256}, bf16, {});           // 12 rows per expert: the second warpgroup idles
    tall_case(sh, bf16, {.ids = ids_kind::one_expert});  // one expert's many tiles
    tall_case({600, 8, 2, 256, 512}, bf16, {.act = mr::activation_kind::gelu, .gated = false});
    tall_case(sh, bf16, {}, false, mr::fp8_weight_scaling::per_tensor);
    tall_case(sh, bf16, {}, false, mr::fp8_weight_scaling::per_channel);
    tall_case({600, 8, 2, 384, 384}, bf16, {.gated = false}, false, mr::fp8_weight_scaling::per_channel);
    tall_case({1200, 8, 1, 256, 256}, bf16, {});  // 150 rows per expert
  }
  SUBCASE("the plain, overlapped and staggered K loops, alone and in pairs; raster bands, expert bands") {
    // Each forced (the plan takes overlap unless asked; the stream GEMMs off): K loops of 1, 2 and
    // 3 tiles and longer (the overlapped loop runs in pairs, with a tail of one or two), GEMM2's
    // K split (ranges of a few tiles), experts without rows, and the weight scale formats.
    for (const mr::gpu::fp8_k_loop loop :
         {mr::gpu::fp8_k_loop::plain, mr::gpu::fp8_k_loop::overlap, mr::gpu::fp8_k_loop::stagger}) {
      CAPTURE(mr::gpu::fp8_k_loop_name(loop));
      // (pairs from 96 rows, narrow tiles up to 8, unless forced off)
      const mr::gpu::fp8_settings single{.stream = false, .pairs = false, .k_loop = loop, .narrow = false};
      const auto loop_case = [&](const shape& c, mr::dtype t, const options& o, bool preq = false,
                                 mr::fp8_weight_scaling sc = mr::fp8_weight_scaling::block128) {
        worst = std::max(worst, check_case(c, t, o, rng, preq, sc, single));
      };
      wide_tile_cases(loop_case);
      loop_case({1, 8, 2, 128, 128}, bf16, {});     // one K tile in each GEMM
      loop_case({7, 8, 2, 384, 256}, bf16, {});     // 3 and 2 K tiles
      loop_case({64, 8, 2, 640, 1152}, bf16, {});   // 5 and 9 K tiles; GEMM2 split where items are few
      loop_case({40, 128, 6, 256, 128}, bf16, {});  // most experts get no rows
      loop_case({600, 8, 2, 256, 256}, bf16, {.ids = ids_kind::one_expert});
      // GEMM1's epilogue is compiled per activation kind in both loops.
      loop_case({300, 8, 2, 256, 256}, bf16, {.act = mr::activation_kind::gelu});
      loop_case({300, 8, 2, 256, 256}, bf16, {.act = mr::activation_kind::swiglu_clamped});
      loop_case({600, 8, 2, 256, 256}, bf16, {}, false, mr::fp8_weight_scaling::per_tensor);
      loop_case({600, 8, 2, 384, 384}, bf16, {.gated = false}, false, mr::fp8_weight_scaling::per_channel);
      const mr::gpu::fp8_settings pairs{.stream = false, .pairs = true, .k_loop = loop, .narrow = false};
      const auto pair_case = [&](const shape& c, const options& o) {
        worst = std::max(worst, check_case(c, bf16, o, rng, false, mr::fp8_weight_scaling::block128, pairs));
      };
      pair_case({600, 8, 2, 256, 256}, {});
      pair_case({600, 8, 2, 384, 640}, {});
      pair_case({50, 8, 2, 256, 256}, {});  // 12 rows per expert: a CTA of each pair without rows
      pair_case({600, 8, 2, 256, 256}, {.ids = ids_kind::skewed});
    }
    for (int band : {1, 3, 16})
      worst = std::max(worst, check_case({600, 8, 2, 256, 384}, bf16, {}, rng, false, mr::fp8_weight_scaling::block128,
                                         {.pairs = false, .raster_band = band}));
    // Bands of one expert's tiles: single CTAs and pairs, experts of one to a dozen tiles.
    for (int band : {1, 3, 8})
      for (bool pairs : {false, true}) {
        CAPTURE(band);
        CAPTURE(pairs);
        const mr::gpu::fp8_settings banded{.stream = false, .pairs = pairs, .raster_band = band, .expert_bands = true};
        for (const shape& sh : {shape{600, 8, 2, 256, 384}, shape{3000, 8, 2, 256, 256}, shape{400, 64, 6, 256, 384}})
          worst = std::max(worst, check_case(sh, bf16, {}, rng, false, mr::fp8_weight_scaling::block128, banded));
        worst = std::max(worst, check_case({700, 8, 2, 256, 256}, bf16, {.ids = ids_kind::skewed}, rng, false,
                                           mr::fp8_weight_scaling::block128, banded));
      }
  }
  SUBCASE("work items handed out at run time: single CTAs and pairs") {
    // Against the reference on every tile, and where deterministic the same bits as in fixed
    // turns (an item's sums do not depend on which cluster runs it or when), twice on one
    // poisoned workspace (the plan zeroes the item counters, each launch leaves them at 0).
    // Fixed turns with the plain K loop, the one the hand-out takes (the plan's default is overlap).
    const mr::gpu::fp8_settings tiles[] = {
        {.stream = false, .pairs = false, .k_loop = mr::gpu::fp8_k_loop::plain, .narrow = false},
        {.stream = false, .pairs = true, .k_loop = mr::gpu::fp8_k_loop::plain, .narrow = false}};
    for (const mr::gpu::fp8_settings& fixed_turns : tiles) {
      mr::gpu::fp8_settings handed = fixed_turns;
      handed.hand_out = true;
      CAPTURE(*fixed_turns.pairs);
      const auto handed_case = [&](const shape& c, mr::dtype t, const options& o, bool preq = false) {
        worst = std::max(worst, check_case(c, t, o, rng, preq, mr::fp8_weight_scaling::block128, handed));
      };
      wide_tile_cases(handed_case);
      handed_case({0, 8, 2, 256, 256}, bf16, {});
      handed_case({1, 8, 2, 128, 128}, bf16, {});
      handed_case({64, 8, 2, 640, 1152}, bf16, {});   // GEMM2's K split where items are few
      handed_case({3000, 8, 2, 256, 512}, bf16, {});  // several items per cluster
      for (const shape& sh : {shape{7, 8, 2, 384, 256}, shape{600, 8, 2, 256, 384}, shape{3000, 8, 2, 256, 512}}) {
        CAPTURE(mr::test::describe(sh, bf16, {}));
        fp8_problem p(sh, bf16, {.deterministic = true}, rng);
        fp8_on_device fixed(p, fixed_turns), out(p, handed);
        CHECK(out.runner.describe(sh.m).find("handed out") != std::string::npos);
        const host_tensor want = fixed.run_once(p);
        MOE_CUDA_CHECK(cudaMemset(out.ws_buf.get(), 0xff, out.ws_buf.bytes()));
        for (int run = 0; run < 2; ++run) {
          CAPTURE(run);
          const host_tensor got = out.run_once(p);
          CHECK(std::memcmp(got.view.data, want.view.data, want.view.bytes()) == 0);
        }
      }
    }
  }
  SUBCASE("wgmma with GEMM2's K split, both combines") {
    // Few items over the SMs (8 experts of 16 rows): the plan splits GEMM2's K (reductions into
    // the output, or f32 parts that combine sums in split order).
    for (bool det : {false, true}) {
      options o{.deterministic = det};
      fp8_problem p({64, 8, 2, 1024, 2048}, bf16, o, rng);
      fp8_on_device g(p);
      const mr::gpu::fp8_plan pl =
          mr::gpu::make_fp8_plan(p.base.cfg, 64, mr::gpu::device_target_of(mr::gpu::current_device_facts()));
      CHECK_FALSE(pl.stream);
      CHECK(pl.down_k_splits > 1);
      const host_tensor got = g.run_once(p);
      const double err = mr::test::rel_error(got.view, p.ref.view);
      CHECK_MESSAGE(err <= fp8_bound, "split-K rel err ", err, det ? " deterministic" : "");
      worst = std::max(worst, err);
    }
  }
  SUBCASE("decode on the stream GEMMs") {
    // At most 4 rows per active expert, the stream GEMMs forced on (the plan takes the narrow
    // tiles there, and with those off the stream GEMMs only where wgmma items are few); the
    // schedule built in the GEMMs up to 64 slots and by the plan kernel above.
    const auto stream_case = [&](const shape& sh, const options& o, bool preq = false,
                                 mr::fp8_weight_scaling sc = mr::fp8_weight_scaling::block128) {
      worst = std::max(worst, check_case(sh, bf16, o, rng, preq, sc, {.stream = true}));
    };
    for (int m : {1, 2, 5}) stream_case({m, 8, 2, 512, 384}, {});  // I % 256 = 128
    stream_case({16, 64, 8, 256, 256}, {});                          // 128 slots: the plan kernel's schedule
    stream_case({4, 16, 4, 384, 256}, {.gated = false});
    stream_case({4, 16, 4, 256, 256}, {.interleaved = true});
    stream_case({6, 16, 1, 256, 256}, {.weight_on_input = true});
    stream_case({4, 16, 4, 256, 256}, {.deterministic = true});
    stream_case({20, 64, 8, 256, 256}, {.deterministic = true});  // plan kernel + combine
    stream_case({4, 16, 4, 256, 256}, {.ids = mr::test::ids_kind::filtered, .no_combine = true});
    stream_case({4, 16, 4, 256, 256}, {.inplace = true});
    stream_case({4, 16, 4, 256, 256}, {.ids = mr::test::ids_kind::all_filtered});
    stream_case({4, 16, 4, 256, 256}, {.scaling = 2.5f});
    stream_case({3, 16, 4, 256, 256}, {}, true);
    stream_case({3, 16, 4, 1024, 2048}, {}, false, mr::fp8_weight_scaling::per_channel);
    stream_case({3, 16, 4, 1024, 2048}, {}, false, mr::fp8_weight_scaling::per_tensor);
  }
  SUBCASE("narrow decode tiles") {
    // Forced on (stream GEMMs off): 8, 16 and 32 tokens per tile by the average rows per active
    // expert, experts with more rows than a tile (several tiles each), every activation, layout,
    // combine mode and weight format, GEMM2's K split into the output and into f32 parts.
    const auto narrow_case = [&](const shape& sh, const options& o, bool preq = false,
                                 mr::fp8_weight_scaling sc = mr::fp8_weight_scaling::block128,
                                 mr::gpu::fp8_settings f = {}) {
      f.stream = false;
      f.narrow = true;
      worst = std::max(worst, check_case(sh, bf16, o, rng, preq, sc, f));
    };
    for (int m : {1, 3, 8, 20, 64, 130}) narrow_case({m, 8, 2, 512, 384}, {});  // I % 256 = 128
    narrow_case({64, 64, 8, 256, 256}, {});
    narrow_case({40, 128, 6, 256, 128}, {});  // most experts get no rows
    narrow_case({24, 8, 2, 384, 256}, {.ids = ids_kind::skewed});
    narrow_case({50, 8, 2, 256, 256}, {.ids = ids_kind::one_expert});  // 50 rows on each of 2 experts: 4 tiles each
    narrow_case({8, 16, 4, 384, 384}, {.gated = false});               // H, I % 256 = 128
    narrow_case({8, 16, 4, 256, 256}, {.act = mr::activation_kind::gelu});
    narrow_case({8, 16, 4, 256, 256}, {.act = mr::activation_kind::swiglu_clamped});
    narrow_case({8, 16, 4, 256, 256}, {.interleaved = true});
    narrow_case({12, 16, 1, 256, 256}, {.weight_on_input = true});
    narrow_case({8, 16, 4, 256, 256}, {.deterministic = true});
    narrow_case({8, 16, 4, 256, 256}, {.ids = ids_kind::filtered, .no_combine = true});
    narrow_case({8, 16, 4, 256, 256}, {.inplace = true});
    narrow_case({8, 16, 4, 256, 256}, {.ids = ids_kind::all_filtered});
    narrow_case({8, 16, 4, 256, 256}, {.scaling = 2.5f});
    narrow_case({5, 16, 4, 256, 256}, {}, true);
    narrow_case({4, 8, 2, 1024, 2048}, {});  // per-token bound applies
    narrow_case({4, 8, 2, 1024, 2048}, {}, false, mr::fp8_weight_scaling::block128, {.down_k_splits = 3});
    narrow_case({4, 8, 2, 1024, 2048}, {.deterministic = true}, false, mr::fp8_weight_scaling::block128,
                {.down_k_splits = 3});  // f32 parts, summed by the combine kernel
    for (mr::fp8_weight_scaling sc : {mr::fp8_weight_scaling::per_tensor, mr::fp8_weight_scaling::per_channel}) {
      narrow_case({6, 8, 2, 1024, 2048}, {}, false, sc);
      narrow_case({8, 16, 4, 256, 384}, {.gated = false}, false, sc);
      narrow_case({8, 16, 4, 256, 256}, {.interleaved = true}, false, sc);
    }
    // Each CTA ordering the rows itself (up to 64 slots, no plan kernel): GEMM1's first CTA
    // reports bad ids and writes slot_to_row for the deterministic combine.
    mr::gpu::fp8_settings local;
    local.schedule_in_gemms = true;
    const auto block = mr::fp8_weight_scaling::block128;
    for (int m : {1, 3, 8, 32}) narrow_case({m, 8, 2, 512, 384}, {}, false, block, local);
    narrow_case({8, 16, 4, 256, 256}, {.deterministic = true}, false, block, local);
    narrow_case({4, 8, 2, 1024, 2048}, {.deterministic = true}, false, block, {.down_k_splits = 3, .schedule_in_gemms = true});
    narrow_case({8, 16, 4, 256, 256}, {.ids = ids_kind::filtered, .no_combine = true}, false, block, local);
    narrow_case({8, 16, 4, 256, 256}, {.ids = ids_kind::all_filtered}, false, block, local);
    narrow_case({12, 16, 1, 256, 256}, {.weight_on_input = true}, false, block, local);
    narrow_case({8, 16, 4, 256, 256}, {.inplace = true}, false, block, local);
  }
  SUBCASE("per-tensor and per-channel weight scales") {
    for (mr::fp8_weight_scaling sc : {mr::fp8_weight_scaling::per_tensor, mr::fp8_weight_scaling::per_channel}) {
      worst = std::max(worst, check_case({64, 16, 4, 384, 256}, bf16, {}, rng, false, sc));  // H % 256 = 128
      worst = std::max(worst, check_case({33, 8, 2, 256, 384}, bf16, {.gated = false}, rng, false, sc));
      worst = std::max(worst, check_case({33, 8, 2, 256, 256}, bf16, {.interleaved = true}, rng, false, sc));
      worst = std::max(worst, check_case({33, 8, 1, 256, 256}, bf16, {.weight_on_input = true}, rng, false, sc));
      worst = std::max(worst, check_case({40, 8, 2, 256, 256}, bf16, {.deterministic = true}, rng, false, sc));
      worst = std::max(worst, check_case({3, 8, 2, 1024, 2048}, bf16, {}, rng, false, sc));   // decode, wgmma
      worst = std::max(worst, check_case({64, 8, 2, 1024, 2048}, bf16, {}, rng, false, sc));  // GEMM2's K split
      worst = std::max(worst, check_case({96, 8, 2, 1024, 1536}, mr::dtype::f16, {}, rng, true, sc));
    }
  }
  SUBCASE("e4m3 hidden_states with their scales") {
    worst = std::max(worst, check_case({65, 8, 2, 256, 256}, bf16, {}, rng, true));
    worst = std::max(worst, check_case({1, 8, 2, 256, 256}, bf16, {.deterministic = true}, rng, true));
  }
  MESSAGE("worst normwise relative error of the subcase: ", worst);
}

TEST_CASE("fp8: tokens of tiny values stay finite and follow the reference") {
  // Token t's x times 2^-(20 t mod 80). At 2^-60 GEMM1's act (near x^2 for small x) is ~2^-120,
  // where a group's amax / 448 is below 2^-126 and the scale floor (kernel_quantize_fp8.cuh)
  // keeps 1 / scale finite.
  if (!fp8_gpu()) return;
  const unsigned seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  const shape s{48, 8, 2, 256, 256};
  const auto exponent = [](std::int64_t t) { return -static_cast<int>((20 * t) % 80); };
  fp8_problem p(s, mr::dtype::bf16, {}, rng, false, std::nullopt, mr::fp8_weight_scaling::block128,
                [&](host_tensor& x) {
                  for (std::int64_t t = 0; t < s.m; ++t)
                    for (std::int64_t c = 0; c < s.h; ++c) {
                      const std::int64_t i = t * s.h + c;
                      mr::test::set_element(x.view, i, std::ldexp(mr::test::element(x.view, i), exponent(t)));
                    }
                });
  fp8_on_device g(p, {});
  const host_tensor got = g.run_once(p);
  for (std::int64_t i = 0; i < got.view.numel(); ++i) {
    const double v = mr::test::element(got.view, i);
    if (!std::isfinite(v)) FAIL_CHECK("output ", i, " is ", v);
  }
  // Tokens at 2^0 and 2^-20 keep their act in f32's normal range: the normwise bound holds over them.
  double num = 0.0, den = 0.0;
  for (std::int64_t t = 0; t < s.m; ++t) {
    if (exponent(t) < -20) continue;
    for (std::int64_t c = 0; c < s.h; ++c) {
      const double a = mr::test::element(got.view, t * s.h + c), b = mr::test::element(p.ref.view, t * s.h + c);
      num += (a - b) * (a - b);
      den += b * b;
    }
  }
  const double err = std::sqrt(num / den);
  CHECK_MESSAGE(err <= fp8_bound, "rel err ", err, " bound ", fp8_bound);
}

TEST_CASE("fp8: NaN stays in its token") {
  if (!fp8_gpu()) return;
  std::mt19937 rng(mr::test::test_seed());
  for (int m : {8, 40})  // the stream GEMMs, the wgmma GEMMs
  for (bool det : {false, true}) {
    CAPTURE(m);
    fp8_problem p({m, 8, 2, 256, 256}, mr::dtype::bf16, {.deterministic = det, .nan_token = 5}, rng);
    fp8_on_device g(p);
    const host_tensor got = g.run_once(p);
    for (std::int64_t t = 0; t < m; ++t) {
      bool nan = false, finite = true;
      for (int c = 0; c < 256; ++c) {
        const float v = mr::test::element(got.view, t * 256 + c);
        nan = nan || std::isnan(v);
        finite = finite && std::isfinite(v);
      }
      if (t == 5) CHECK(nan);
      else CHECK_MESSAGE(finite, "token ", t, " caught the NaN");
    }
    CHECK(mr::test::rel_error(got.view, p.ref.view) <= normwise_bound(p.base.s));
  }
}

TEST_CASE("fp8: deterministic bits across runs and under graph replay") {
  if (!fp8_gpu()) return;
  std::mt19937 rng(mr::test::test_seed());
  // Three graph replays into a poisoned output, each the bits of `first`.
  const auto replays_match = [](fp8_on_device& g, const fp8_problem& p, const host_tensor& first) {
    cudaStream_t s;
    MOE_CUDA_CHECK(cudaStreamCreate(&s));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    MOE_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    g.launch(p, s);
    MOE_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int r = 0; r < 3; ++r) {
      MOE_CUDA_CHECK(cudaMemset(g.out.data, 0xff, g.out.bytes()));
      MOE_CUDA_CHECK(cudaGraphLaunch(exec, s));
      MOE_CUDA_CHECK(cudaStreamSynchronize(s));
      const host_tensor replay = g.result(p);
      CHECK(std::memcmp(first.view.data, replay.view.data, first.view.bytes()) == 0);
    }
    MOE_CUDA_CHECK(cudaGraphExecDestroy(exec));
    MOE_CUDA_CHECK(cudaGraphDestroy(graph));
    MOE_CUDA_CHECK(cudaStreamDestroy(s));
  };
  for (int m : {1, 200}) {
    CAPTURE(m);
    fp8_problem p({m, 16, 4, 512, 256}, mr::dtype::bf16, {.deterministic = true}, rng);
    fp8_on_device g(p);
    const host_tensor first = g.run_once(p);
    const host_tensor second = g.run_once(p);
    CHECK(std::memcmp(first.view.data, second.view.data, first.view.bytes()) == 0);
    replays_match(g, p, first);
    // The wgmma GEMMs launched as programmatic dependents change when the kernels start, not
    // what they add (at one token the plan takes the stream GEMMs unless told otherwise).
    if (m > 1) {
      fp8_on_device dep(p, {.stream = false, .dependent_gemms = true});
      CHECK(std::memcmp(first.view.data, dep.run_once(p).view.data, first.view.bytes()) == 0);
      replays_match(dep, p, first);
      // The narrow tiles: the same bits run after run and replayed.
      fp8_on_device narrow(p, {.stream = false, .narrow = true});
      const host_tensor narrow_first = narrow.run_once(p);
      CHECK(std::memcmp(narrow_first.view.data, narrow.run_once(p).view.data, narrow_first.view.bytes()) == 0);
      replays_match(narrow, p, narrow_first);
      // GEMM1's store warps quantize the values its consumers would have, by the same rule.
      for (const bool paired : {false, true}) {
        CAPTURE(paired);
        fp8_on_device own(p, {.stream = false, .pairs = paired, .k_loop = mr::gpu::fp8_k_loop::plain});
        fp8_on_device staged(p, {.stream = false, .pairs = paired, .staged_up = true});
        const host_tensor expected = own.run_once(p);
        CHECK(std::memcmp(expected.view.data, staged.run_once(p).view.data, expected.view.bytes()) == 0);
        replays_match(staged, p, expected);
      }
    }
  }
}

TEST_CASE("fp8: batch-invariant bits of a token across batches") {
  if (!fp8_gpu()) return;
  std::mt19937 rng(mr::test::test_seed());
  const int h = 256, inter = 512, e = 16, k = 4;
  // The probe token is row 0 of the largest batch; smaller batches take its first rows, the
  // others with fresh companions.
  const int sizes[] = {1, 7, 64, 512};
  fp8_problem big({512, e, k, h, inter}, mr::dtype::bf16, {}, rng);
  mr::MoeRunnerConfig cfg(mr::moe_config_params{.num_experts = e, .hidden_size = h, .intermediate_size = inter,
                                                .top_k = k, .batch_invariant = true});
  std::vector<std::uint16_t> probe;
  for (int m : sizes) {
    fp8_problem p({m, e, k, h, inter}, mr::dtype::bf16, {}, rng, false, cfg);
    // Token 0 is the probe: the big problem's row 0 and its routing.
    std::memcpy(p.base.x.view.data, big.base.x.view.data, h * 2);
    std::memcpy(p.base.ids.view.data, big.base.ids.view.data, k * 4);
    std::memcpy(p.base.weights.view.data, big.base.weights.view.data, k * 4);
    p.w13 = big.w13, p.w2 = big.w2, p.s13 = big.s13, p.s2 = big.s2;
    fp8_on_device g(p);
    const host_tensor got = g.run_once(p);
    std::vector<std::uint16_t> row(h);
    std::memcpy(row.data(), got.view.data, h * 2);
    if (probe.empty()) probe = row;
    CHECK_MESSAGE(row == probe, "token 0's bits differ at M = ", m);
  }
}

TEST_CASE("fp8: bad input is rejected before anything runs") {
  if (!mr::test::have_gpu()) return;
  std::mt19937 rng(mr::test::test_seed());
  fp8_problem p({16, 8, 2, 256, 256}, mr::dtype::bf16, {}, rng);
  fp8_on_device g(p);
  MOE_CUDA_CHECK(cudaMemset(g.out.data, 0x5a, g.out.bytes()));
  const auto untouched = [&] {
    std::vector<unsigned char> h(g.out.bytes());
    MOE_CUDA_CHECK(cudaMemcpy(h.data(), g.out.data, h.size(), cudaMemcpyDeviceToHost));
    return std::all_of(h.begin(), h.end(), [](unsigned char b) { return b == 0x5a; });
  };
  const mr::DispatchOutput d = p.dispatch_of(g.x, g.xq, g.xs, g.weights, g.ids);
  const auto rejects = [&](const mr::fp8_block_quant_info& q, const mr::DispatchOutput& dd, const char* what) {
    CAPTURE(what);
    CHECK_THROWS_AS(g.runner.run(dd, q, g.out, g.ws, {}), mr::moe_error);
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    CHECK(untouched());
  };
  const mr::fp8_block_quant_info good = fp8_problem::quant(g.w13, g.s13, g.w2, g.s2);
  mr::fp8_block_quant_info q = good;
  q.w13_scale.shape[2] = 1;
  rejects(q, d, "w13_scale of the wrong shape");
  q = good;
  q.w2_scale.type = mr::dtype::bf16;
  rejects(q, d, "w2_scale of the wrong dtype");
  q = good;
  q.w2_scale = p.s2.view;  // host memory
  rejects(q, d, "w2_scale in host memory");
  q = good;
  q.w13.type = mr::dtype::bf16;
  rejects(q, d, "w13 not e4m3");
  q = good;
  q.w2_scale.data = static_cast<char*>(q.w2_scale.data) + 2;
  rejects(q, d, "w2_scale not 4-byte aligned");
  mr::DispatchOutput no_scales = d;
  no_scales.hidden_states.type = mr::dtype::f8_e4m3;  // e4m3 activations without their scales
  rejects(good, no_scales, "e4m3 hidden_states without hidden_scales");
  // Per-tensor and per-channel scales of another format's shape, or on the host.
  mr::test::device_tensor t13(host_tensor(mr::dtype::f32, {8})), c13(host_tensor(mr::dtype::f32, {8, 512})),
      c2(host_tensor(mr::dtype::f32, {8, 256}));
  const auto rejects_any = [&](const auto& qq, const char* what) {
    CAPTURE(what);
    CHECK_THROWS_AS(g.runner.run(d, qq, g.out, g.ws, {}), mr::moe_error);
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    CHECK(untouched());
  };
  rejects_any(mr::fp8_tensor_quant_info{g.w13.view, g.s13.view, g.w2.view, t13.view}, "per-tensor with block scales");
  rejects_any(mr::fp8_channel_quant_info{g.w13.view, t13.view, g.w2.view, c2.view}, "per-channel w13_scale [E]");
  mr::tensor_view host_c2 = c2.view;
  host_c2.space = mr::memory_space::host;
  rejects_any(mr::fp8_channel_quant_info{g.w13.view, c13.view, g.w2.view, host_c2}, "per-channel w2_scale on the host");
  // A quant info the backend cannot consume: unquantized weights.
  CHECK_THROWS_AS(g.runner.run(d, mr::unquantized_quant_info{g.w13.view, g.w2.view}, g.out, g.ws, {}),
                  mr::moe_error);
  CHECK(untouched());
  // Sizes off the 128 blocks: the backend refuses (the reference takes them).
  mr::MoeRunnerConfig odd(mr::moe_config_params{.num_experts = 8, .hidden_size = 200, .intermediate_size = 256,
                                                .top_k = 2});
  runner_t r("cuda_fused_fp8", odd);
  mr::test::host_tensor x(mr::dtype::bf16, {4, 200}), w13(mr::dtype::f8_e4m3, {8, 512, 200}),
      s13(mr::dtype::f32, {8, 4, 2}), w2(mr::dtype::f8_e4m3, {8, 200, 256}), s2(mr::dtype::f32, {8, 2, 2});
  mr::test::device_tensor dx(x), dw13(w13), ds13(s13), dw2(w2), ds2(s2);
  mr::test::device_tensor ids(mr::test::host_tensor(mr::dtype::i32, {4, 2})), wts(mr::test::host_tensor(mr::dtype::f32, {4, 2}));
  mr::test::device_buffer out(4 * 200 * 2), ws(r.workspace_bytes(4));
  mr::tensor_view o = dx.view;
  o.data = out.get();
  CHECK_THROWS_WITH_AS(r.run(mr::DispatchOutput{dx.view, {}, {wts.view, ids.view}},
                             mr::fp8_block_quant_info{dw13.view, ds13.view, dw2.view, ds2.view}, o,
                             {ws.get(), r.workspace_bytes(4)}, {}),
                       doctest::Contains("multiples of 128"), mr::unsupported_error);
}

TEST_CASE("fp8: bad ids are counted in the status word") {
  if (!fp8_gpu()) return;
  std::mt19937 rng(mr::test::test_seed());
  // 8 tokens: the narrow tiles after the plan kernel, or building the schedule themselves (16
  // slots); 40: the wide tiles (10 rows per expert) after the plan kernel.
  for (const bool local : {false, true})
    for (int m : {8, 40}) {
      CAPTURE(m);
      CAPTURE(local);
      fp8_problem p({m, 8, 2, 256, 256}, mr::dtype::bf16, {}, rng);
      p.base.ids.view.ptr<std::int32_t>()[3 * 2 + 1] = 1000;
      mr::gpu::fp8_settings f;
      f.schedule_in_gemms = local;
      fp8_on_device g(p, f);
      mr::test::device_status st;
      g.status = st.get();
      g.run_once(p);
      const mr::moe_status s = st.read();
      CHECK(s.bad_slots == 1);
      CHECK(s.first_bad_slot == 3 * 2 + 1);
    }
}

int main(int argc, char** argv) {
  if (!mr::test::have_gpu()) {
    std::puts("no GPU: skipping the cuda_fused_fp8 tests");
    return mr::test::skip_exit_code;
  }
  doctest::Context ctx;
  ctx.applyCommandLine(argc, argv);
  return ctx.run();
}
