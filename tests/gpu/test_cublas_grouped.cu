// The cublas_grouped backend against the CPU reference on fresh random data, plus
// what is particular to it: it refuses CUDA-graph capture, rejects bad expert ids
// before writing, and stays correct when runs alternate between streams.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gpu_test_util.hpp"
#include "moe_problem.hpp"
#include "moerunner/moerunner.hpp"
#include "moerunner/policies/cublas_grouped_policy.cuh"

namespace mr = moerunner;
using mr::test::device_buffer;
using mr::test::host_tensor;

namespace {

using runner_t = mr::MoeRunner<mr::reference_policy, mr::cublas_grouped_policy>;

using mr::test::bound_for;
using mr::test::ids_kind;
using shape = mr::test::moe_shape;
using options = mr::test::moe_options;
using problem = mr::test::moe_problem;
using on_device = mr::test::moe_on_device<mr::cublas_grouped_policy>;

// Runs once on a poisoned output (NaN everywhere, so an unwritten element fails) and compares.
void check_against_reference(const shape& s, mr::dtype t, const options& o, std::mt19937& rng) {
  CAPTURE(mr::test::describe(s, t, o));
  problem p(s, t, o, rng);
  on_device g(p);
  const host_tensor got = g.run_once(p);
  const double err = mr::test::rel_error(got.view, p.ref.view);
  CHECK_MESSAGE(err <= bound_for(t), "relative error ", err, " bound ", bound_for(t));
}

constexpr mr::dtype both_types[] = {mr::dtype::bf16, mr::dtype::f16};

}  // namespace

TEST_CASE("cublas_grouped declares that it synchronizes") {
  static_assert(!mr::cublas_grouped_policy::graph_capturable);
  static_assert(mr::cublas_grouped_policy::tensor_space == mr::memory_space::device);
  static_assert(std::is_nothrow_move_constructible_v<mr::cublas_grouped_policy>);
  CHECK(mr::cublas_grouped_policy::name == "cublas_grouped");
}

TEST_CASE("cublas_grouped matches the reference: token counts") {
  const unsigned seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  for (mr::dtype t : both_types)
    for (int m : {0, 1, 7, 1000}) check_against_reference({m, 8, 2, 256, 128}, t, {}, rng);
}

TEST_CASE("cublas_grouped matches the reference: experts and top-k") {
  const unsigned seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  for (mr::dtype t : both_types) {
    check_against_reference({64, 8, 1, 128, 64}, t, {}, rng);
    check_against_reference({5, 64, 2, 128, 64}, t, {}, rng);   // most experts get no tokens
    check_against_reference({40, 256, 8, 64, 32}, t, {}, rng);  // E = 256, k = 8
    check_against_reference({37, 8, 2, 200, 72}, t, {}, rng);   // H, I not multiples of 64
  }
}

TEST_CASE("cublas_grouped matches the reference: routing shapes") {
  const unsigned seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  for (mr::dtype t : both_types) {
    check_against_reference({96, 8, 2, 128, 64}, t, {.ids = ids_kind::one_expert}, rng);
    check_against_reference({96, 8, 2, 128, 64}, t, {.ids = ids_kind::filtered}, rng);
    check_against_reference({9, 8, 2, 128, 64}, t, {.ids = ids_kind::all_filtered}, rng);
  }
}

TEST_CASE("cublas_grouped matches the reference: activations and modes") {
  const unsigned seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  for (mr::dtype t : both_types) {
    check_against_reference({33, 8, 2, 128, 64}, t, {.act = mr::activation_kind::gelu}, rng);
    check_against_reference({33, 8, 2, 128, 64}, t, {.act = mr::activation_kind::swiglu_clamped}, rng);
    check_against_reference({33, 8, 2, 128, 64}, t, {.act = mr::activation_kind::gelu, .gated = false}, rng);
    check_against_reference({33, 8, 2, 128, 64}, t, {.no_combine = true}, rng);
    check_against_reference({33, 8, 2, 128, 64}, t, {.ids = ids_kind::filtered, .no_combine = true}, rng);
    check_against_reference({33, 8, 1, 128, 64}, t, {.weight_on_input = true}, rng);
    check_against_reference({33, 8, 2, 128, 64}, t, {.inplace = true}, rng);
    check_against_reference({33, 8, 2, 128, 64}, t, {.scaling = 2.5f}, rng);
    check_against_reference({33, 8, 2, 128, 64}, t, {.scaling = 2.5f, .scaling_in_weights = true}, rng);
  }
}

TEST_CASE("cublas_grouped refuses to run inside CUDA-graph capture, and writes nothing") {
  std::mt19937 rng(7);
  problem p({16, 8, 2, 128, 64}, mr::dtype::bf16, {}, rng);
  on_device g(p);
  MOE_CUDA_CHECK(cudaMemset(g.out.data, 0x5a, g.out.bytes()));
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  cudaStream_t s = nullptr;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  MOE_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  CHECK_THROWS_AS(g.launch(p, s), mr::unsupported_error);
  cudaGraph_t graph = nullptr;
  MOE_CUDA_CHECK(cudaStreamEndCapture(s, &graph));  // the refused run left the capture intact
  if (graph) MOE_CUDA_CHECK(cudaGraphDestroy(graph));
  MOE_CUDA_CHECK(cudaStreamDestroy(s));
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  for (unsigned char b : g.out_buf.download<unsigned char>(g.out_buf.bytes())) REQUIRE(b == 0x5a);
}

TEST_CASE("cublas_grouped rejects an out-of-range expert id before writing the output") {
  std::mt19937 rng(11);
  problem p({16, 8, 2, 128, 64}, mr::dtype::bf16, {}, rng);
  on_device g(p);
  for (int bad : {8, 1000, -2}) {
    CAPTURE(bad);
    std::vector<std::int32_t> ids(p.ids.view.ptr<std::int32_t>(), p.ids.view.ptr<std::int32_t>() + 32);
    ids[13] = bad;
    g.ids.buf.upload(ids);
    MOE_CUDA_CHECK(cudaMemset(g.out.data, 0x5a, g.out.bytes()));
    CHECK_THROWS_AS(g.launch(p, nullptr), mr::invalid_argument_error);
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    for (unsigned char b : g.out_buf.download<unsigned char>(g.out_buf.bytes())) REQUIRE(b == 0x5a);
  }
  // The policy is still usable after a rejected call.
  g.ids.buf.upload(std::vector<std::int32_t>(p.ids.view.ptr<std::int32_t>(), p.ids.view.ptr<std::int32_t>() + 32));
  g.fill_out(0xff);
  g.launch(p, nullptr);
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK(mr::test::rel_error(g.result(p).view, p.ref.view) <= bound_for(mr::dtype::bf16));
}

TEST_CASE("cublas_grouped rejects f32 activations with a clear error") {
  mr::MoeRunnerConfig cfg({.num_experts = 4, .hidden_size = 64, .intermediate_size = 32, .top_k = 2});
  runner_t runner("cublas_grouped", cfg);
  device_buffer x(4 * 64 * 4), w13(4 * 64 * 64 * 4), w2(4 * 64 * 32 * 4), wt(4 * 2 * 4), id(4 * 2 * 4),
      out(4 * 64 * 4), ws(runner.workspace_bytes(4));
  const auto dev = mr::memory_space::device;
  mr::DispatchOutput d{mr::tensor_view::contiguous(x.get(), mr::dtype::f32, {4, 64}, dev), {},
                       {mr::tensor_view::contiguous(wt.get(), mr::dtype::f32, {4, 2}, dev),
                        mr::tensor_view::contiguous(id.get(), mr::dtype::i32, {4, 2}, dev)}};
  mr::unquantized_quant_info q{mr::tensor_view::contiguous(w13.get(), mr::dtype::f32, {4, 64, 64}, dev),
                               mr::tensor_view::contiguous(w2.get(), mr::dtype::f32, {4, 64, 32}, dev)};
  const auto o = mr::tensor_view::contiguous(out.get(), mr::dtype::f32, {4, 64}, dev);
  try {
    runner.run(d, q, o, {ws.get(), ws.bytes()}, cuda::stream_ref(cudaStream_t{}));
    FAIL("an f32 run was accepted");
  } catch (const mr::invalid_argument_error& e) {
    CHECK(std::string(e.what()).find("bf16 or f16") != std::string::npos);
  }
}

TEST_CASE("cublas_grouped stays correct when runs alternate between streams") {
  const unsigned seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  problem a({300, 16, 4, 256, 128}, mr::dtype::bf16, {}, rng);
  problem b({300, 16, 4, 256, 128}, mr::dtype::bf16, {}, rng);
  on_device ga(a), gb(b);
  cudaStream_t s1 = nullptr, s2 = nullptr;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  for (int r = 0; r < 5; ++r) {
    ga.fill_out(0xff);
    gb.fill_out(0xff);
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    // One runner serves both problems, as an engine serves several layers of one shape.
    ga.runner->run(ga.dispatch(a), mr::unquantized_quant_info{ga.w13.view, ga.w2.view}, ga.out,
                   ga.ws, cuda::stream_ref(s1));
    ga.runner->run(gb.dispatch(b), mr::unquantized_quant_info{gb.w13.view, gb.w2.view}, gb.out,
                   gb.ws, cuda::stream_ref(s2));
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    CHECK(mr::test::rel_error(ga.result(a).view, a.ref.view) <= bound_for(mr::dtype::bf16));
    CHECK(mr::test::rel_error(gb.result(b).view, b.ref.view) <= bound_for(mr::dtype::bf16));
  }
  MOE_CUDA_CHECK(cudaStreamDestroy(s1));
  MOE_CUDA_CHECK(cudaStreamDestroy(s2));
}

TEST_CASE("a moved cublas_grouped policy keeps its handle and runs") {
  const unsigned seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  problem p({64, 8, 2, 128, 64}, mr::dtype::f16, {}, rng);
  on_device g(p);
  mr::cublas_grouped_policy first(p.cfg);
  mr::cublas_grouped_policy moved(std::move(first));
  g.fill_out(0xff);
  const mr::unquantized_quant_info q{g.w13.view, g.w2.view};
  moved.run_from_dispatch(g.dispatch(p), q, g.out, g.ws, cuda::stream_ref(cudaStream_t{}));
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK(mr::test::rel_error(g.result(p).view, p.ref.view) <= bound_for(mr::dtype::f16));
}

int main(int argc, char** argv) {
  if (!mr::test::have_gpu()) {
    std::puts("no GPU: skipping the cublas_grouped tests");
    return mr::test::skip_exit_code;
  }
  doctest::Context ctx;
  ctx.applyCommandLine(argc, argv);
  return ctx.run();
}
