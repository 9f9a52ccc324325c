// The conformance suite every GPU policy must pass against the CPU reference:
// random shapes and edge cases, poisoned outputs, per-dtype error bounds, NaN
// isolation, CUDA-graph replay and run-to-run bitwise determinism, and gpt-oss checkpoints
// (biases on both GEMMs, interleaved gate/up rows).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <random>

#include "gpu_test_util.hpp"
#include "moe_problem.hpp"
#include "moerunner/moerunner.hpp"
#include "moerunner/policies/cublas_grouped_policy.cuh"
#include "moerunner/policies/cuda_fused_policy.cuh"

namespace mr = moerunner;
using mr::test::host_tensor;

namespace {

using mr::test::bound_for;
using mr::test::ids_kind;
using shape = mr::test::moe_shape;
using options = mr::test::moe_options;
using problem = mr::test::moe_problem;
template <class P>
using gpu_run = mr::test::moe_on_device<P>;

template <class P>
void check_case(const shape& s, mr::dtype t, const options& o, std::mt19937& rng) {
  CAPTURE(mr::test::describe(s, t, o));
  problem p(s, t, o, rng);
  gpu_run<P> g(p);
  host_tensor got = g.run_once(p);
  // Poisoned with NaN: an unwritten element fails the NaN-ness comparison inside rel_error.
  const double err = mr::test::rel_error(got.view, p.ref.view);
  CHECK_MESSAGE(err <= bound_for(t), P::name, " rel err ", err, " bound ", bound_for(t));
}

template <class P>
void conformance_cases() {
  const unsigned seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  const mr::dtype types[] = {mr::dtype::bf16, mr::dtype::f16};
  const auto gelu = mr::activation_kind::gelu;
  for (mr::dtype t : types) {
    SUBCASE("edge token counts") {
      for (int m : {0, 1, 7, 1000}) check_case<P>({m, 8, 2, 256, 128}, t, {}, rng);
    }
    SUBCASE("top-k and expert counts") {
      check_case<P>({64, 8, 1, 128, 64}, t, {}, rng);
      check_case<P>({64, 16, 2, 128, 64}, t, {}, rng);
      check_case<P>({50, 64, 8, 128, 64}, t, {}, rng);
      check_case<P>({40, 256, 8, 64, 32}, t, {}, rng);  // most experts get no tokens
    }
    SUBCASE("sizes not multiple of a tile") {
      check_case<P>({37, 8, 2, 200, 72}, t, {}, rng);
      check_case<P>({129, 4, 2, 136, 40}, t, {}, rng);
    }
    SUBCASE("routing shapes") {
      check_case<P>({96, 8, 2, 128, 64}, t, {.ids = ids_kind::one_expert}, rng);
      check_case<P>({96, 8, 2, 128, 64}, t, {.ids = ids_kind::filtered}, rng);
      check_case<P>({300, 32, 4, 128, 64}, t, {.ids = ids_kind::skewed}, rng);
    }
    SUBCASE("activations and combine modes") {
      check_case<P>({33, 8, 2, 128, 64}, t, {.act = gelu}, rng);
      check_case<P>({33, 8, 2, 128, 64}, t, {.act = mr::activation_kind::swiglu_clamped}, rng);
      check_case<P>({33, 8, 2, 128, 64}, t, {.no_combine = true}, rng);
      check_case<P>({33, 8, 2, 128, 64}, t, {.act = gelu, .gated = false}, rng);
      check_case<P>({33, 8, 2, 128, 64}, t, {.scaling = 2.5f}, rng);
    }
    SUBCASE("deterministic mode") {
      check_case<P>({1, 8, 2, 256, 128}, t, {.deterministic = true}, rng);
      check_case<P>({300, 32, 4, 128, 64}, t, {.ids = ids_kind::skewed, .deterministic = true}, rng);
      check_case<P>({96, 8, 2, 128, 64}, t, {.ids = ids_kind::filtered, .scaling = 2.5f, .deterministic = true}, rng);
      check_case<P>({33, 8, 2, 128, 64}, t, {.no_combine = true, .deterministic = true}, rng);
    }
  }
}

// gpt-oss checkpoints: biases on both GEMMs (f32 or the activation dtype, or none) and gate/up
// rows interleaved or in halves, with the clamped swiglu (a limit the sums reach), at odd sizes
// and token counts that run each of cuda_fused's automatic GEMM families on an H200 (the stream
// GEMMs at 1 and 8 tokens, the wgmma tiles from 64 up), then the decode K split and the modes.
template <class P>
void gpt_oss_cases() {
  const unsigned seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  const mr::dtype types[] = {mr::dtype::bf16, mr::dtype::f16};
  const auto swiglu = mr::activation_kind::swiglu_clamped;
  for (mr::dtype t : types) {
    const std::optional<mr::dtype> biases[] = {std::nullopt, mr::dtype::f32, t};
    SUBCASE("gpt-oss layouts and biases over the token counts") {
      for (bool interleaved : {false, true})
        for (const std::optional<mr::dtype>& bias : biases)
          for (int m : {1, 8, 64, 512, 1024})
            check_case<P>({m, 8, 4, 200, 72}, t, {.act = swiglu, .limit = 1.5f, .interleaved = interleaved, .bias = bias},
                          rng);
    }
    SUBCASE("gpt-oss at decode with K split, and the combine modes") {
      for (bool interleaved : {false, true}) {
        check_case<P>({1, 8, 2, 520, 2048}, t, {.act = swiglu, .interleaved = interleaved, .bias = mr::dtype::f32}, rng);
        check_case<P>({3, 16, 4, 264, 1032}, t, {.act = swiglu, .interleaved = interleaved, .bias = t}, rng);
        check_case<P>({2, 8, 2, 520, 2048}, t,
                      {.act = swiglu, .ids = ids_kind::random_filtered, .deterministic = true,
                       .interleaved = interleaved, .bias = t},
                      rng);
        check_case<P>({33, 8, 2, 128, 64}, t,
                      {.act = swiglu, .no_combine = true, .scaling = 2.5f, .interleaved = interleaved,
                       .bias = mr::dtype::f32},
                      rng);
        check_case<P>({33, 8, 1, 128, 64}, t,
                      {.act = swiglu, .weight_on_input = true, .interleaved = interleaved, .bias = t}, rng);
        check_case<P>({96, 8, 2, 128, 64}, t,
                      {.ids = ids_kind::filtered, .deterministic = true, .interleaved = interleaved,
                       .bias = mr::dtype::f32},
                      rng);
      }
    }
  }
}

// A NaN in one token's input must reach that token's output and no other.
template <class P>
void nan_isolation() {
  const unsigned seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  problem p({16, 8, 2, 128, 64}, mr::dtype::bf16, {}, rng);
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
  const unsigned seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  problem p({257, 16, 4, 256, 128}, mr::dtype::bf16, {.deterministic = true}, rng);
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
    g.launch(p, s);
    MOE_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int r = 0; r < 3; ++r) {
      g.fill_out(0xff);
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

TEST_CASE_TEMPLATE("gpt-oss checkpoints against the reference", P, mr::cuda_fused_policy, mr::cublas_grouped_policy) {
  gpt_oss_cases<P>();
}

TEST_CASE_TEMPLATE("NaN stays in its token", P, mr::cuda_fused_policy, mr::cublas_grouped_policy) {
  nan_isolation<P>();
}

TEST_CASE_TEMPLATE("deterministic and graph-replayable", P, mr::cuda_fused_policy, mr::cublas_grouped_policy) {
  determinism_and_graphs<P>();
}

TEST_CASE_TEMPLATE("rejected calls write nothing", P, mr::cuda_fused_policy, mr::cublas_grouped_policy) {
  std::mt19937 rng(1234);
  problem p({16, 8, 2, 128, 64}, mr::dtype::bf16, {}, rng);
  gpu_run<P> g(p);
  g.fill_out(0x5a);
  mr::DispatchOutput d{g.x.view, {}, {g.weights.view, g.ids.view, false}};
  mr::tensor_view bad_w2 = g.w2.view;
  bad_w2.shape[2] = 65;
  CHECK_THROWS_AS(g.runner->run(d, mr::unquantized_quant_info{g.w13.view, bad_w2}, g.out, g.ws, {}),
                  mr::invalid_argument_error);
  CHECK_THROWS_AS(g.runner->run(d, mr::unquantized_quant_info{g.w13.view, g.w2.view}, g.out, {g.ws.data, 16}, {}),
                  mr::invalid_argument_error);
  mr::DispatchOutput host_d{p.x.view, {}, {p.weights.view, p.ids.view, false}};
  CHECK_THROWS_AS(g.runner->run(host_d, mr::unquantized_quant_info{g.w13.view, g.w2.view}, g.out, g.ws, {}),
                  mr::invalid_argument_error);
  // Biases of the wrong shape, dtype or memory space.
  mr::test::device_tensor b13(host_tensor(mr::dtype::f32, {8, 128})), b2(host_tensor(mr::dtype::f32, {8, 128}));
  mr::test::device_tensor b13_f16(host_tensor(mr::dtype::f16, {8, 128}));
  host_tensor b2_host(mr::dtype::f32, {8, 128});
  const auto with_bias = [&](const mr::tensor_view& b13v, const mr::tensor_view& b2v) {
    return g.runner->run(d, mr::unquantized_quant_info{g.w13.view, g.w2.view, b13v, b2v}, g.out, g.ws, {});
  };
  mr::tensor_view b13_short = b13.view;
  b13_short.shape[1] = 64;  // [E, I] where the gated w13 has 2I rows
  b13_short.strides[0] = 64;
  CHECK_THROWS_AS(with_bias(b13_short, b2.view), mr::invalid_argument_error);
  CHECK_THROWS_AS(with_bias(b13_f16.view, b2.view), mr::invalid_argument_error);
  CHECK_THROWS_AS(with_bias(b13.view, b2_host.view), mr::invalid_argument_error);
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
