// Replacing a built-in on purpose: MOE_REPLACE_BUILTIN_BACKEND in this translation unit
// makes "reference" mean the policy below for every runner that lists it.
#include <doctest/doctest.h>

#include <random>
#include <type_traits>

#include "moerunner/moerunner.hpp"
#include "test_support.hpp"

namespace mr = moerunner;
using mr::cpu_test::host_tensor;

namespace {

// An engine's own "reference": the same math, negated, so the outputs tell which one ran.
class negated_reference {
 public:
  static constexpr std::string_view name = "reference";
  static constexpr mr::memory_space tensor_space = mr::memory_space::host;
  using quant_infos = mr::quant_info_list<mr::unquantized_quant_info>;

  explicit negated_reference(const mr::MoeRunnerConfig& cfg) : ref_(cfg) {}
  std::size_t workspace_bytes(std::int64_t) const { return 0; }
  mr::CombineInput run_from_dispatch(const mr::DispatchOutput& d, const mr::unquantized_quant_info& q,
                                     const mr::tensor_view& out, mr::workspace_view ws, cuda::stream_ref s) {
    mr::CombineInput c = ref_.run_from_dispatch(d, q, out, ws, s);
    for (std::int64_t i = 0; i < out.numel(); ++i) out.ptr<float>()[i] = -out.ptr<float>()[i];
    return c;
  }

 private:
  mr::reference_policy ref_;
};

}  // namespace

constexpr int replacement_line = __LINE__ + 1;
MOE_REPLACE_BUILTIN_BACKEND(negated_reference);

static_assert(!std::is_polymorphic_v<negated_reference>);
static_assert(!std::is_polymorphic_v<mr::MoeRunner<mr::reference_policy, negated_reference>>);

namespace {

const mr::MoeRunnerConfig cfg({.num_experts = 4, .hidden_size = 24, .intermediate_size = 40, .top_k = 2});

void run(auto& runner, const host_tensor& x, const host_tensor& w, const host_tensor& ids, const host_tensor& w13,
         const host_tensor& w2, host_tensor& out) {
  mr::standard_dispatcher dispatcher(runner.config());
  const auto d = dispatcher.dispatch(x.view, {w.view, ids.view});
  dispatcher.combine(runner.run(d, mr::unquantized_quant_info{w13.view, w2.view}, out.view, {},
                                mr::cpu_test::host_stream()));
}

}  // namespace

TEST_CASE("the replacement is registered as such, at this file and line") {
  auto& reg = mr::backend_registry::global();
  CHECK(reg.deferred_errors().empty());
  CHECK(reg.resolve("reference") == mr::builtin::reference);
  const auto rec = reg.lookup(mr::builtin::reference);
  REQUIRE(rec.has_value());
  CHECK(rec->kind == mr::registration_kind::replace_builtin);
  CHECK(rec->type_key == &mr::policy_type_key<negated_reference>);
  CHECK(std::string_view(rec->site.file) == __FILE__);
  CHECK(rec->site.line == replacement_line);
  // Still one name: the list of known backends does not grow.
  CHECK(reg.known_names() == "reference, cuda_fused, cublas_grouped, cuda_fused_fp8");
}

TEST_CASE("a runner that lists the replacement runs it for \"reference\"") {
  constexpr int m = 5, h = 24, inter = 40, e = 4, k = 2;
  std::mt19937 rng(77);
  host_tensor x(mr::dtype::f32, {m, h}), logits(mr::dtype::f32, {m, e});
  host_tensor w13(mr::dtype::f32, {e, 2 * inter, h}), w2(mr::dtype::f32, {e, h, inter});
  host_tensor wts(mr::dtype::f32, {m, k}), ids(mr::dtype::i32, {m, k});
  mr::cpu_test::fill_uniform(x, rng, -1, 1);
  mr::cpu_test::fill_uniform(logits, rng, -2, 2);
  mr::cpu_test::fill_uniform(w13, rng, -0.3f, 0.3f);
  mr::cpu_test::fill_uniform(w2, rng, -0.3f, 0.3f);
  mr::TopKOutput topk{wts.view, ids.view};
  mr::reference::topk(logits.view, nullptr, {.top_k = k}, topk);

  mr::MoeRunner<mr::reference_policy, negated_reference> runner("reference", cfg);
  CHECK(runner.runner_backend().is_reference());
  CHECK(runner.policy_index() == 1);
  host_tensor out(mr::dtype::f32, {m, h});
  mr::cpu_test::fill_sentinel(out);
  run(runner, x, wts, ids, w13, w2, out);

  // The original built-in, called directly, gives the negation of what the runner produced.
  mr::reference_policy original(cfg);
  host_tensor expect(mr::dtype::f32, {m, h});
  original.run_from_dispatch(mr::DispatchOutput{x.view, {}, {wts.view, ids.view}},
                             mr::unquantized_quant_info{w13.view, w2.view}, expect.view, {}, mr::cpu_test::host_stream());
  int nonzero = 0;
  for (std::int64_t i = 0; i < out.numel(); ++i) {
    REQUIRE(std::isfinite(expect.ptr<float>()[i]));
    CHECK(out.ptr<float>()[i] == -expect.ptr<float>()[i]);
    nonzero += expect.ptr<float>()[i] != 0.0f;
  }
  CHECK(nonzero > 0);
}

TEST_CASE("a runner that does not list the replacement refuses \"reference\" instead of running the original") {
  const std::string msg = "backend 'reference' is registered at " + std::string(__FILE__) + ":" +
                          std::to_string(replacement_line) +
                          " but that policy is not in this runner's policy list (reference); add it to MoeRunner<...>";
  CHECK_THROWS_WITH_AS(mr::MoeRunner<mr::reference_policy>("reference", cfg), msg.c_str(), mr::registry_error);
}

TEST_CASE("a second replacement is a duplicate; a built-in a runner resolved can no longer be replaced") {
  auto& reg = mr::backend_registry::global();
  mr::MoeRunner<mr::reference_policy, negated_reference> runner("reference", cfg);
  using another = mr::cpu_test::echo_policy<"reference">;
  // A second replacement is a duplicate, reported with both sites.
  CHECK_THROWS_WITH_AS(
      reg.add<another>({"other.cpp", 5}, mr::registration_kind::replace_builtin),
      ("duplicate registration of backend 'reference': first at " + std::string(__FILE__) + ":" +
       std::to_string(replacement_line) + ", again at other.cpp:5")
          .c_str(),
      mr::registry_error);
  CHECK(reg.lookup(mr::builtin::reference)->type_key == &mr::policy_type_key<negated_reference>);

  // A stand-in listed under a built-in name is that built-in when nothing replaced it.
  using fused_stand_in = mr::cpu_test::echo_policy<"cuda_fused">;
  mr::MoeRunner<mr::reference_policy, negated_reference, fused_stand_in> fused("cuda_fused", cfg);
  CHECK(fused.policy_index() == 2);
  CHECK_THROWS_WITH_AS((reg.add<mr::cpu_test::echo_policy<"cuda_fused", 8>>({"late.cpp", 9},
                                                                            mr::registration_kind::replace_builtin)),
                       "cannot replace built-in backend 'cuda_fused' at late.cpp:9: a runner has already resolved it; "
                       "replace built-ins before constructing runners",
                       mr::registry_error);
  CHECK_FALSE(reg.lookup(mr::builtin::cuda_fused).has_value());
}
