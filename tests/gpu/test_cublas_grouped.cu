// The cublas_grouped backend against the CPU reference on fresh random data, plus
// what is particular to it: it refuses CUDA-graph capture, rejects bad expert ids
// before writing, and stays correct when runs alternate between streams.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gpu_test_util.hpp"
#include "moerunner/moerunner.hpp"
#include "moerunner/policies/cublas_grouped_policy.cuh"

namespace mr = moerunner;
using mr::test::device_buffer;
using mr::test::device_tensor;
using mr::test::host_tensor;

namespace {

using runner_t = mr::MoeRunner<mr::reference_policy, mr::cublas_grouped_policy>;

// Normwise bounds: a few units of each dtype's rounding (bf16 8 bits, fp16 11) times the growth over H and I.
double bound_for(mr::dtype t) { return t == mr::dtype::bf16 ? 1e-2 : 2e-3; }

enum class ids_kind { softmax, one_expert, filtered, all_filtered };

struct shape {
  int m, e, k, h, i;
};

struct options {
  mr::activation_kind act = mr::activation_kind::silu;
  ids_kind ids = ids_kind::softmax;
  bool gated = true;
  bool no_combine = false;
  bool weight_on_input = false;
  bool inplace = false;
  float scaling = 1.0f;
  bool scaling_in_weights = false;
};

std::string describe(const shape& s, mr::dtype t, const options& o) {
  return "M=" + std::to_string(s.m) + " E=" + std::to_string(s.e) + " k=" + std::to_string(s.k) +
         " H=" + std::to_string(s.h) + " I=" + std::to_string(s.i) + " " + std::string(mr::dtype_name(t)) + " " +
         std::string(mr::activation_name(o.act)) + " ids=" + std::to_string(static_cast<int>(o.ids)) +
         (o.gated ? "" : " ungated") + (o.no_combine ? " no_combine" : "") +
         (o.weight_on_input ? " weight_on_input" : "") + (o.inplace ? " inplace" : "") +
         " scaling=" + std::to_string(o.scaling) + (o.scaling_in_weights ? " (in weights)" : "");
}

// A random problem on the host with its reference output.
struct problem {
  shape s;
  mr::dtype type;
  options opt;
  mr::MoeRunnerConfig cfg;
  host_tensor x, w13, w2, weights, ids, ref;

  problem(const shape& sh, mr::dtype t, const options& o, std::mt19937& rng)
      : s(sh),
        type(t),
        opt(o),
        cfg(mr::moe_config_params{.num_experts = sh.e,
                                  .hidden_size = sh.h,
                                  .intermediate_size = sh.i,
                                  .top_k = sh.k,
                                  .act = {.kind = o.act},
                                  .is_gated = o.gated,
                                  .apply_router_weight_on_input = o.weight_on_input,
                                  .routed_scaling_factor = o.scaling,
                                  .no_combine = o.no_combine,
                                  .inplace = o.inplace}),
        x(t, {sh.m, sh.h}),
        w13(t, {sh.e, cfg.w13_rows(), sh.h}),
        w2(t, {sh.e, sh.h, sh.i}),
        weights(mr::dtype::f32, {sh.m, sh.k}),
        ids(mr::dtype::i32, {sh.m, sh.k}) {
    mr::test::fill_random(x, rng, 1.0f);
    mr::test::fill_random(w13, rng, 2.0f / std::sqrt(static_cast<float>(sh.h)));
    mr::test::fill_random(w2, rng, 2.0f / std::sqrt(static_cast<float>(sh.i)));
    route(rng);
    ref = o.no_combine ? host_tensor(t, {sh.m, sh.k, sh.h}) : host_tensor(t, {sh.m, sh.h});
    runner_t runner("reference", cfg);
    if (o.inplace) {
      host_tensor xin = x;
      mr::DispatchOutput d{xin.view, {}, topk(weights.view, ids.view)};
      runner.run(d, mr::unquantized_quant_info{w13.view, w2.view}, xin.view, {}, {});
      std::memcpy(ref.view.data, xin.view.data, ref.view.bytes());
    } else {
      mr::DispatchOutput d{x.view, {}, topk(weights.view, ids.view)};
      runner.run(d, mr::unquantized_quant_info{w13.view, w2.view}, ref.view, {}, {});
    }
  }

  mr::TopKOutput topk(const mr::tensor_view& w, const mr::tensor_view& i) const {
    return {w, i, opt.scaling_in_weights};
  }

  void route(std::mt19937& rng) {
    host_tensor logits(mr::dtype::f32, {s.m, s.e});
    mr::test::fill_random(logits, rng, 4.0f);
    mr::topk_config tc{.top_k = s.k,
                       .routed_scaling_factor = opt.scaling,
                       .apply_routed_scaling_factor_on_weights = opt.scaling_in_weights};
    mr::TopKOutput out{weights.view, ids.view};
    mr::reference::topk(logits.view, nullptr, tc, out);
    auto* id = ids.view.ptr<std::int32_t>();
    const std::int64_t slots = static_cast<std::int64_t>(s.m) * s.k;
    switch (opt.ids) {
      case ids_kind::softmax: break;
      case ids_kind::one_expert:  // slot 0 of every token on one expert, the rest on its neighbours
        for (std::int64_t q = 0; q < slots; ++q) id[q] = (s.e / 2 + static_cast<int>(q % s.k)) % s.e;
        break;
      case ids_kind::filtered:  // every third slot and all of the middle token filtered
        for (std::int64_t q = 0; q < slots; ++q)
          if (q % 3 == 1 || q / s.k == s.m / 2) id[q] = -1;
        break;
      case ids_kind::all_filtered:
        for (std::int64_t q = 0; q < slots; ++q) id[q] = -1;
        break;
    }
  }
};

// Device copies of a problem and a cublas_grouped runner with its workspace.
struct on_device {
  device_tensor x, w13, w2, weights, ids;
  device_buffer out_buf, ws;
  mr::tensor_view out;
  std::optional<runner_t> runner;
  bool inplace;

  explicit on_device(const problem& p)
      : x(p.x), w13(p.w13), w2(p.w2), weights(p.weights), ids(p.ids), inplace(p.opt.inplace) {
    runner.emplace("cublas_grouped", p.cfg);
    if (inplace) {
      out = x.view;
    } else {
      out_buf = device_buffer(p.ref.view.bytes());
      out = p.ref.view;
      out.data = out_buf.get();
      out.space = mr::memory_space::device;
    }
    ws = device_buffer(runner->workspace_bytes(p.s.m));
  }

  mr::DispatchOutput dispatch(const problem& p) const { return {x.view, {}, p.topk(weights.view, ids.view)}; }

  void launch(const problem& p, cudaStream_t stream) {
    runner->run(dispatch(p), mr::unquantized_quant_info{w13.view, w2.view}, out, {ws.get(), ws.bytes()},
                cuda::stream_ref(stream));
  }

  void poison_out() {
    if (out.bytes()) MOE_CUDA_CHECK(cudaMemset(out.data, 0xff, out.bytes()));
  }

  host_tensor result(const problem& p) const {
    host_tensor h = p.ref;
    if (out.bytes()) MOE_CUDA_CHECK(cudaMemcpy(h.view.data, out.data, out.bytes(), cudaMemcpyDeviceToHost));
    return h;
  }
};

// Runs once on a poisoned output (NaN everywhere, so an unwritten element fails) and compares.
void check_against_reference(const shape& s, mr::dtype t, const options& o, std::mt19937& rng) {
  CAPTURE(describe(s, t, o));
  problem p(s, t, o, rng);
  on_device g(p);
  if (!o.inplace) g.poison_out();
  g.launch(p, nullptr);
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  const host_tensor got = g.result(p);
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
  std::mt19937 rng(std::random_device{}());
  for (mr::dtype t : both_types)
    for (int m : {0, 1, 7, 1000}) check_against_reference({m, 8, 2, 256, 128}, t, {}, rng);
}

TEST_CASE("cublas_grouped matches the reference: experts and top-k") {
  std::mt19937 rng(std::random_device{}());
  for (mr::dtype t : both_types) {
    check_against_reference({64, 8, 1, 128, 64}, t, {}, rng);
    check_against_reference({5, 64, 2, 128, 64}, t, {}, rng);   // most experts get no tokens
    check_against_reference({40, 256, 8, 64, 32}, t, {}, rng);  // E = 256, k = 8
    check_against_reference({37, 8, 2, 200, 72}, t, {}, rng);   // H, I not multiples of 64
  }
}

TEST_CASE("cublas_grouped matches the reference: routing shapes") {
  std::mt19937 rng(std::random_device{}());
  for (mr::dtype t : both_types) {
    check_against_reference({96, 8, 2, 128, 64}, t, {.ids = ids_kind::one_expert}, rng);
    check_against_reference({96, 8, 2, 128, 64}, t, {.ids = ids_kind::filtered}, rng);
    check_against_reference({9, 8, 2, 128, 64}, t, {.ids = ids_kind::all_filtered}, rng);
  }
}

TEST_CASE("cublas_grouped matches the reference: activations and modes") {
  std::mt19937 rng(std::random_device{}());
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
  g.poison_out();
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
  std::mt19937 rng(std::random_device{}());
  problem a({300, 16, 4, 256, 128}, mr::dtype::bf16, {}, rng);
  problem b({300, 16, 4, 256, 128}, mr::dtype::bf16, {}, rng);
  on_device ga(a), gb(b);
  cudaStream_t s1 = nullptr, s2 = nullptr;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  for (int r = 0; r < 5; ++r) {
    ga.poison_out();
    gb.poison_out();
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    // One runner serves both problems, as an engine serves several layers of one shape.
    ga.runner->run(ga.dispatch(a), mr::unquantized_quant_info{ga.w13.view, ga.w2.view}, ga.out,
                   {ga.ws.get(), ga.ws.bytes()}, cuda::stream_ref(s1));
    ga.runner->run(gb.dispatch(b), mr::unquantized_quant_info{gb.w13.view, gb.w2.view}, gb.out,
                   {gb.ws.get(), gb.ws.bytes()}, cuda::stream_ref(s2));
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    CHECK(mr::test::rel_error(ga.result(a).view, a.ref.view) <= bound_for(mr::dtype::bf16));
    CHECK(mr::test::rel_error(gb.result(b).view, b.ref.view) <= bound_for(mr::dtype::bf16));
  }
  MOE_CUDA_CHECK(cudaStreamDestroy(s1));
  MOE_CUDA_CHECK(cudaStreamDestroy(s2));
}

TEST_CASE("a moved cublas_grouped policy keeps its handle and runs") {
  std::mt19937 rng(std::random_device{}());
  problem p({64, 8, 2, 128, 64}, mr::dtype::f16, {}, rng);
  on_device g(p);
  mr::cublas_grouped_policy first(p.cfg);
  mr::cublas_grouped_policy moved(std::move(first));
  g.poison_out();
  const mr::unquantized_quant_info q{g.w13.view, g.w2.view};
  moved.run_from_dispatch(g.dispatch(p), q, g.out, {g.ws.get(), g.ws.bytes()}, cuda::stream_ref(cudaStream_t{}));
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
