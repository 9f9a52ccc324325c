// The conformance suite every GPU policy must pass against the CPU reference:
// random shapes and edge cases, poisoned outputs, per-dtype error bounds, NaN
// isolation, CUDA-graph replay and run-to-run bitwise determinism.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.hpp"
#include "moerunner/moerunner.hpp"
#include "moerunner/policies/cublas_grouped_policy.cuh"
#include "moerunner/policies/cuda_fused_policy.cuh"

namespace mr = moerunner;
using mr::test::device_buffer;
using mr::test::device_tensor;
using mr::test::host_tensor;

namespace {

// Normwise relative error bounds per activation dtype (bf16 has 8 mantissa bits, fp16 11);
// both are a few units of the dtype's rounding times the sqrt(H) growth seen in practice.
double bound_for(mr::dtype t) { return t == mr::dtype::bf16 ? 1e-2 : 2e-3; }

enum class routing_case { random, one_expert, with_filtered, skewed };

struct case_desc {
  int m, e, k, h, i;
  mr::dtype type;
  mr::activation_kind act = mr::activation_kind::silu;
  routing_case routing = routing_case::random;
  bool no_combine = false;
  bool gated = true;
  float scaling = 1.0f;
  bool deterministic = false;
  std::string str() const {
    return "M=" + std::to_string(m) + " E=" + std::to_string(e) + " k=" + std::to_string(k) + " H=" +
           std::to_string(h) + " I=" + std::to_string(i) + " " + std::string(mr::dtype_name(type)) + " " +
           std::string(mr::activation_name(act)) + (no_combine ? " no_combine" : "") + (gated ? "" : " ungated") +
           " routing=" + std::to_string(static_cast<int>(routing)) + (deterministic ? " deterministic" : "");
  }
};

// One problem on the host, routed by the reference, with its reference output.
struct problem {
  mr::MoeRunnerConfig cfg;
  host_tensor x, w13, w2, weights, ids, ref;

  problem(const case_desc& c, std::mt19937& rng)
      : cfg(mr::moe_config_params{.num_experts = c.e,
                                  .hidden_size = c.h,
                                  .intermediate_size = c.i,
                                  .top_k = c.k,
                                  .act = {.kind = c.act},
                                  .is_gated = c.gated,
                                  .routed_scaling_factor = c.scaling,
                                  .no_combine = c.no_combine,
                                  .deterministic = c.deterministic}),
        x(c.type, {c.m, c.h}),
        w13(c.type, {c.e, cfg.w13_rows(), c.h}),
        w2(c.type, {c.e, c.h, c.i}),
        weights(mr::dtype::f32, {c.m, c.k}),
        ids(mr::dtype::i32, {c.m, c.k}) {
    mr::test::fill_random(x, rng, 1.0f);
    // Weight scale keeps every stage O(1) so relative errors mean the same at any H, I.
    mr::test::fill_random(w13, rng, 2.0f / std::sqrt(static_cast<float>(c.h)));
    mr::test::fill_random(w2, rng, 2.0f / std::sqrt(static_cast<float>(c.i)));
    route(c, rng);
    ref = c.no_combine ? host_tensor(c.type, {c.m, c.k, c.h}) : host_tensor(c.type, {c.m, c.h});
    mr::MoeRunner<mr::reference_policy> runner("reference", cfg);
    mr::DispatchOutput d{x.view, {}, {weights.view, ids.view, false}};
    runner.run(d, mr::unquantized_quant_info{w13.view, w2.view}, ref.view, {}, {});
  }

  void route(const case_desc& c, std::mt19937& rng) {
    host_tensor logits(mr::dtype::f32, {c.m, c.e});
    mr::test::fill_random(logits, rng, 4.0f);
    if (c.routing == routing_case::skewed)  // most tokens prefer the first two experts
      for (std::int64_t t = 0; t < c.m; ++t)
        for (int j = 0; j < std::min(2, c.e); ++j) logits.view.ptr<float>()[t * c.e + j] += 6.0f;
    mr::topk_config tc{.top_k = c.k};
    mr::TopKOutput out{weights.view, ids.view};
    mr::reference::topk(logits.view, nullptr, tc, out);
    auto* id = ids.view.ptr<std::int32_t>();
    if (c.routing == routing_case::one_expert) {
      const int target = c.e / 2;
      for (std::int64_t t = 0; t < c.m; ++t)
        for (int j = 0; j < c.k; ++j) id[t * c.k + j] = j == 0 ? target : (target + j) % c.e;
    }
    if (c.routing == routing_case::with_filtered)  // every third slot filtered, one token fully filtered
      for (std::int64_t s = 0; s < c.m * c.k; ++s)
        if (s % 3 == 1 || s / c.k == c.m / 2) id[s] = -1;
  }
};

template <class P>
using runner_of = mr::MoeRunner<mr::reference_policy, P>;

// Runs policy P on the problem's device copies and returns the host output.
template <class P>
struct gpu_run {
  device_tensor x, w13, w2, weights, ids;
  device_buffer out_buf, ws;
  mr::tensor_view out;
  std::optional<runner_of<P>> runner;

  explicit gpu_run(const problem& p) : x(p.x), w13(p.w13), w2(p.w2), weights(p.weights), ids(p.ids) {
    runner.emplace(std::string(P::name), p.cfg);
    out_buf = device_buffer(p.ref.view.bytes());
    out = p.ref.view;
    out.data = out_buf.get();
    out.space = mr::memory_space::device;
    ws = device_buffer(runner->workspace_bytes(p.x.view.shape[0]));
  }

  void launch(cudaStream_t stream) {
    mr::DispatchOutput d{x.view, {}, {weights.view, ids.view, false}};
    runner->run(d, mr::unquantized_quant_info{w13.view, w2.view}, out, {ws.get(), ws.bytes()}, cuda::stream_ref(stream));
  }

  host_tensor run_once(const problem& p) {
    out_buf.poison();
    launch(nullptr);
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    host_tensor h = p.ref;
    MOE_CUDA_CHECK(cudaMemcpy(h.view.data, out.data, out.bytes(), cudaMemcpyDeviceToHost));
    return h;
  }
};

template <class P>
void check_case(const case_desc& c, std::mt19937& rng) {
  CAPTURE(c.str());
  problem p(c, rng);
  gpu_run<P> g(p);
  host_tensor got = g.run_once(p);
  // Poisoned with NaN: an unwritten element fails the NaN-ness comparison inside rel_error.
  const double err = mr::test::rel_error(got.view, p.ref.view);
  CHECK_MESSAGE(err <= bound_for(c.type), P::name, " rel err ", err, " bound ", bound_for(c.type));
}

template <class P>
void conformance_cases() {
  std::mt19937 rng(std::random_device{}());
  const mr::dtype types[] = {mr::dtype::bf16, mr::dtype::f16};
  for (mr::dtype t : types) {
    SUBCASE("edge token counts") {
      for (int m : {0, 1, 7, 1000}) check_case<P>({m, 8, 2, 256, 128, t}, rng);
    }
    SUBCASE("top-k and expert counts") {
      check_case<P>({64, 8, 1, 128, 64, t}, rng);
      check_case<P>({64, 16, 2, 128, 64, t}, rng);
      check_case<P>({50, 64, 8, 128, 64, t}, rng);
      check_case<P>({40, 256, 8, 64, 32, t}, rng);  // most experts get no tokens
    }
    SUBCASE("sizes not multiple of a tile") {
      check_case<P>({37, 8, 2, 200, 72, t}, rng);
      check_case<P>({129, 4, 2, 136, 40, t}, rng);
    }
    SUBCASE("routing shapes") {
      check_case<P>({96, 8, 2, 128, 64, t, mr::activation_kind::silu, routing_case::one_expert}, rng);
      check_case<P>({96, 8, 2, 128, 64, t, mr::activation_kind::silu, routing_case::with_filtered}, rng);
      check_case<P>({300, 32, 4, 128, 64, t, mr::activation_kind::silu, routing_case::skewed}, rng);
    }
    SUBCASE("activations and combine modes") {
      check_case<P>({33, 8, 2, 128, 64, t, mr::activation_kind::gelu}, rng);
      check_case<P>({33, 8, 2, 128, 64, t, mr::activation_kind::swiglu_clamped}, rng);
      check_case<P>({33, 8, 2, 128, 64, t, mr::activation_kind::silu, routing_case::random, true}, rng);
      check_case<P>({33, 8, 2, 128, 64, t, mr::activation_kind::gelu, routing_case::random, false, false}, rng);
      check_case<P>({33, 8, 2, 128, 64, t, mr::activation_kind::silu, routing_case::random, false, true, 2.5f}, rng);
    }
    SUBCASE("deterministic mode") {
      const auto silu = mr::activation_kind::silu;
      check_case<P>({1, 8, 2, 256, 128, t, silu, routing_case::random, false, true, 1.0f, true}, rng);
      check_case<P>({300, 32, 4, 128, 64, t, silu, routing_case::skewed, false, true, 1.0f, true}, rng);
      check_case<P>({96, 8, 2, 128, 64, t, silu, routing_case::with_filtered, false, true, 2.5f, true}, rng);
      check_case<P>({33, 8, 2, 128, 64, t, silu, routing_case::random, true, true, 1.0f, true}, rng);
    }
  }
}

// A NaN in one token's input must reach that token's output and no other.
template <class P>
void nan_isolation() {
  std::mt19937 rng(std::random_device{}());
  problem p({16, 8, 2, 128, 64, mr::dtype::bf16}, rng);
  const int bad = 5;
  mr::test::set_element(p.x.view, bad * 128 + 3, NAN);
  gpu_run<P> g(p);
  host_tensor got = g.run_once(p);
  for (std::int64_t t = 0; t < 16; ++t) {
    bool any_nan = false;
    for (int c = 0; c < 128; ++c) any_nan |= std::isnan(mr::test::element(got.view, t * 128 + c));
    CHECK_MESSAGE(any_nan == (t == bad), "token ", t);
  }
}

// With deterministic set: bitwise identical outputs across 100 runs, and from a replayed CUDA graph.
template <class P>
void determinism_and_graphs() {
  std::mt19937 rng(std::random_device{}());
  problem p({257, 16, 4, 256, 128, mr::dtype::bf16, mr::activation_kind::silu, routing_case::random, false, true, 1.0f,
             true},
            rng);
  gpu_run<P> g(p);
  const host_tensor first = g.run_once(p);
  for (int r = 0; r < 100; ++r) {
    const host_tensor again = g.run_once(p);
    REQUIRE(std::memcmp(first.view.data, again.view.data, first.view.bytes()) == 0);
  }
  constexpr bool capturable = [] {
    if constexpr (requires { P::graph_capturable; }) return P::graph_capturable;
    else return true;
  }();
  if constexpr (capturable) {
    cudaStream_t s;
    MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    MOE_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    g.launch(s);
    MOE_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int r = 0; r < 3; ++r) {
      g.out_buf.poison();
      MOE_CUDA_CHECK(cudaGraphLaunch(exec, s));
      MOE_CUDA_CHECK(cudaStreamSynchronize(s));
      host_tensor h = p.ref;
      MOE_CUDA_CHECK(cudaMemcpy(h.view.data, g.out.data, g.out.bytes(), cudaMemcpyDeviceToHost));
      CHECK(std::memcmp(first.view.data, h.view.data, h.view.bytes()) == 0);
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(s);
  }
}

}  // namespace

TEST_CASE_TEMPLATE("conformance against the reference", P, mr::cuda_fused_policy, mr::cublas_grouped_policy) {
  conformance_cases<P>();
}

TEST_CASE_TEMPLATE("NaN stays in its token", P, mr::cuda_fused_policy, mr::cublas_grouped_policy) {
  nan_isolation<P>();
}

TEST_CASE_TEMPLATE("deterministic and graph-replayable", P, mr::cuda_fused_policy, mr::cublas_grouped_policy) {
  determinism_and_graphs<P>();
}

TEST_CASE_TEMPLATE("rejected calls write nothing", P, mr::cuda_fused_policy, mr::cublas_grouped_policy) {
  std::mt19937 rng(1234);
  problem p({16, 8, 2, 128, 64, mr::dtype::bf16}, rng);
  gpu_run<P> g(p);
  g.out_buf.poison(0x5a);
  mr::DispatchOutput d{g.x.view, {}, {g.weights.view, g.ids.view, false}};
  mr::tensor_view bad_w2 = g.w2.view;
  bad_w2.shape[2] = 65;
  CHECK_THROWS_AS(g.runner->run(d, mr::unquantized_quant_info{g.w13.view, bad_w2}, g.out, {g.ws.get(), g.ws.bytes()}, {}),
                  mr::invalid_argument_error);
  CHECK_THROWS_AS(g.runner->run(d, mr::unquantized_quant_info{g.w13.view, g.w2.view}, g.out, {g.ws.get(), 16}, {}),
                  mr::invalid_argument_error);
  mr::DispatchOutput host_d{p.x.view, {}, {p.weights.view, p.ids.view, false}};
  CHECK_THROWS_AS(g.runner->run(host_d, mr::unquantized_quant_info{g.w13.view, g.w2.view}, g.out, {g.ws.get(), g.ws.bytes()}, {}),
                  mr::invalid_argument_error);
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  const auto bytes = g.out_buf.template download<unsigned char>(g.out_buf.bytes());
  for (unsigned char b : bytes) REQUIRE(b == 0x5a);
}

int main(int argc, char** argv) {
  if (!mr::test::have_gpu()) {
    std::puts("no GPU: skipping the GPU conformance suite");
    return mr::test::skip_exit_code;
  }
  doctest::Context ctx;
  ctx.applyCommandLine(argc, argv);
  return ctx.run();
}
