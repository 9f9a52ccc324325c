// The LoRA contract (nothing LoRA-related is read when LoRA is off; hooks only for
// LoRA-capable policies, carrying the base layer's resolved backend) and the FusedMoE
// layer (explicit quant method, the "no runner" state, quant methods chosen by name).
#include <doctest/doctest.h>

#include <cstdint>
#include <optional>
#include <random>
#include <string>

#include "moerunner/moerunner.hpp"
#include "test_support.hpp"

namespace mr = moerunner;
using mr::cpu_test::host_tensor;

namespace {

using lora_policy = mr::cpu_test::echo_policy<"lora_capable", 0, true>;
using plain_policy = mr::cpu_test::echo_policy<"plain">;

// Says it supports LoRA but has no run overload taking hooks: not LoRA-capable.
class claims_lora_policy {
 public:
  static constexpr std::string_view name = "claims_lora";
  static constexpr mr::memory_space tensor_space = mr::memory_space::host;
  static constexpr bool supports_lora = true;
  using quant_infos = mr::quant_info_list<mr::unquantized_quant_info>;
  explicit claims_lora_policy(const mr::MoeRunnerConfig& cfg) : ref_(cfg) {}
  std::size_t workspace_bytes(std::int64_t) const { return 0; }
  mr::CombineInput run_from_dispatch(const mr::DispatchOutput& d, const mr::unquantized_quant_info& q,
                                     const mr::tensor_view& out, mr::workspace_view ws, cuda::stream_ref s) const {
    return ref_.run_from_dispatch(d, q, out, ws, s);
  }

 private:
  mr::reference_policy ref_;
};

static_assert(mr::LoraCapable<lora_policy>);
static_assert(!mr::LoraCapable<plain_policy>);
static_assert(!mr::LoraCapable<mr::reference_policy>);
static_assert(!mr::LoraCapable<claims_lora_policy>);
static_assert(mr::DispatchRunnerCore<claims_lora_policy>);

// Adapter views that must never be looked at: a wild pointer, an impossible rank and shape.
mr::lora_weights garbage_lora() {
  mr::tensor_view bad;
  bad.data = reinterpret_cast<void*>(std::uintptr_t{0xdeadbeef});
  bad.type = static_cast<mr::dtype>(0xff);
  bad.rank = 0x7fffffff;
  bad.shape = {-1, -1, -1, -1};
  bad.strides = {-7, -7, -7, -7};
  bad.space = static_cast<mr::memory_space>(0xff);
  return {bad, bad, bad, bad, -1.0f};
}

constexpr int m = 5, e = 4, h = 24, inter = 40, k = 2, r = 3;

struct layer_data {
  mr::MoeRunnerConfig cfg{{.num_experts = e, .hidden_size = h, .intermediate_size = inter, .top_k = k}};
  host_tensor x{mr::dtype::f32, {m, h}}, logits{mr::dtype::f32, {m, e}};
  host_tensor w13{mr::dtype::f32, {e, 2 * inter, h}}, w2{mr::dtype::f32, {e, h, inter}};
  host_tensor q13{mr::dtype::f8_e4m3, {e, 2 * inter, h}}, q2{mr::dtype::f8_e4m3, {e, h, inter}};
  host_tensor s13{mr::dtype::f32, {e, 1, 1}}, s2{mr::dtype::f32, {e, 1, 1}};
  host_tensor wts{mr::dtype::f32, {m, k}}, ids{mr::dtype::i32, {m, k}};
  host_tensor la13{mr::dtype::f32, {e, r, h}}, lb13{mr::dtype::f32, {e, 2 * inter, r}};
  host_tensor la2{mr::dtype::f32, {e, r, inter}}, lb2{mr::dtype::f32, {e, h, r}};

  layer_data() {
    std::mt19937 rng(606);
    for (host_tensor* t : {&x, &logits, &la13, &lb13, &la2, &lb2}) mr::cpu_test::fill_uniform(*t, rng, -1, 1);
    for (host_tensor* t : {&w13, &w2}) mr::cpu_test::fill_uniform(*t, rng, -0.2f, 0.2f);
    for (host_tensor* t : {&q13, &q2}) mr::cpu_test::fill_uniform(*t, rng, -4.0f, 4.0f);
    for (host_tensor* t : {&s13, &s2}) mr::cpu_test::fill_uniform(*t, rng, 0.01f, 0.05f);
    mr::TopKOutput topk{wts.view, ids.view};
    mr::reference::topk(logits.view, nullptr, {.top_k = k}, topk);
  }
  mr::moe_weights unquantized() const { return {w13.view, w2.view, {}, {}}; }
  mr::moe_weights fp8() const { return {q13.view, q2.view, s13.view, s2.view}; }
  mr::lora_weights lora(float scaling = 0.5f) const { return {la13.view, lb13.view, la2.view, lb2.view, scaling}; }
  mr::DispatchOutput dispatch() const { return mr::standard_dispatcher(cfg).dispatch(x.view, {wts.view, ids.view}); }
};

// A quant method of the engine's own, injected into the layer: counts how often it is asked.
struct counting_method {
  static constexpr std::string_view name = "counting";
  int* calls = nullptr;
  template <class P>
    requires mr::concept_parts::runs_with<P, mr::unquantized_quant_info>
  mr::unquantized_quant_info get_moe_quant_info(const mr::moe_weights& w, mr::backend_tag<P>) const {
    ++*calls;
    return {w.w13, w.w2};
  }
};

static_assert(mr::QuantInfoProvider<counting_method, mr::reference_policy>);
static_assert(mr::QuantInfoProvider<mr::fp8_block_method, mr::reference_policy>);
static_assert(!mr::QuantInfoProvider<mr::fp8_block_method, plain_policy>);
static_assert(mr::QuantInfoProvider<mr::fp8_tensor_method, mr::reference_policy>);
static_assert(mr::QuantInfoProvider<mr::fp8_channel_method, mr::reference_policy>);
static_assert(!mr::QuantInfoProvider<mr::fp8_channel_method, plain_policy>);
static_assert(mr::fp8_weight_format<mr::fp8_channel_quant_info> && !mr::fp8_weight_format<mr::unquantized_quant_info>);

host_tensor run_reference_directly(const layer_data& d, bool fp8) {
  host_tensor out(mr::dtype::f32, {m, h});
  mr::reference_policy ref(d.cfg);
  if (fp8)
    ref.run_from_dispatch(d.dispatch(), mr::fp8_block_quant_info{d.q13.view, d.s13.view, d.q2.view, d.s2.view},
                          out.view, {}, mr::cpu_test::host_stream());
  else
    ref.run_from_dispatch(d.dispatch(), mr::unquantized_quant_info{d.w13.view, d.w2.view}, out.view, {},
                          mr::cpu_test::host_stream());
  return out;
}

}  // namespace

TEST_CASE("LoRA off: no hooks, and the adapter views are never looked at, whatever the policy") {
  const mr::lora_weights garbage = garbage_lora();
  CHECK_FALSE(mr::maybe_build_lora_hooks<mr::reference_policy>(false, mr::builtin::reference, garbage).has_value());
  CHECK_FALSE(mr::maybe_build_lora_hooks<plain_policy>(false, mr::backend_id(std::string_view("plain")), garbage));
  CHECK_FALSE(mr::maybe_build_lora_hooks<claims_lora_policy>(false, mr::builtin::reference, garbage));
  CHECK_FALSE(mr::maybe_build_lora_hooks<lora_policy>(false, mr::backend_id(std::string_view("lora_capable")), garbage));
  // Not even the base backend matters when LoRA is off.
  CHECK_FALSE(mr::maybe_build_lora_hooks<lora_policy>(false, mr::backend_id(), garbage));
}

TEST_CASE("LoRA on with a policy that cannot do LoRA is an error naming the backend") {
  const mr::lora_weights garbage = garbage_lora();
  CHECK_THROWS_WITH_AS(mr::maybe_build_lora_hooks<mr::reference_policy>(true, mr::builtin::reference, garbage),
                       "LoRA is enabled but backend 'reference' is not LoRA-capable (its policy does not set "
                       "supports_lora)",
                       mr::unsupported_error);
  CHECK_THROWS_WITH_AS(mr::maybe_build_lora_hooks<plain_policy>(true, mr::backend_id(std::string_view("plain")), garbage),
                       "LoRA is enabled but backend 'plain' is not LoRA-capable (its policy does not set "
                       "supports_lora)",
                       mr::unsupported_error);
  CHECK_THROWS_AS(mr::maybe_build_lora_hooks<claims_lora_policy>(true, mr::builtin::reference, garbage),
                  mr::unsupported_error);
}

TEST_CASE("LoRA on with a capable policy: hooks carry the given backend and the adapters, which are checked") {
  layer_data d;
  const mr::backend_id base(std::string_view("lora_capable"));
  const auto hooks = mr::maybe_build_lora_hooks<lora_policy>(true, base, d.lora(0.25f));
  REQUIRE(hooks.has_value());
  CHECK(hooks->backend == base);
  CHECK(hooks->weights.w13_a.data == d.la13.view.data);
  CHECK(hooks->weights.w2_b.data == d.lb2.view.data);
  CHECK(hooks->weights.scaling == 0.25f);

  mr::lora_weights missing = d.lora();
  missing.w2_a = {};
  CHECK_THROWS_WITH_AS(mr::maybe_build_lora_hooks<lora_policy>(true, base, missing),
                       "maybe_build_lora_hooks: LoRA is on but an adapter weight is missing or not [E, ., .]",
                       mr::invalid_argument_error);
  mr::lora_weights null_data = d.lora();
  null_data.w13_b.data = nullptr;
  CHECK_THROWS_WITH_AS(mr::maybe_build_lora_hooks<lora_policy>(true, base, null_data),
                       "maybe_build_lora_hooks: LoRA is on but an adapter weight is missing or not [E, ., .]",
                       mr::invalid_argument_error);
  host_tensor other_rank(mr::dtype::f32, {e, h, r + 1});
  mr::lora_weights ranks = d.lora();
  ranks.w2_b = other_rank.view;
  CHECK_THROWS_WITH_AS(mr::maybe_build_lora_hooks<lora_policy>(true, base, ranks),
                       "maybe_build_lora_hooks: LoRA adapter ranks disagree: w13_a [4, 3, 24], w13_b [4, 80, 3], "
                       "w2_a [4, 3, 40], w2_b [4, 24, 4]",
                       mr::invalid_argument_error);
}

TEST_CASE("FusedMoE: the LoRA hooks come from the base layer's resolved backend and reach the policy") {
  layer_data d;
  // A registry of the layer's own: the LoRA path must not look the name up anywhere else.
  mr::backend_registry reg;
  reg.add<lora_policy>({"layer.cpp", 1}, mr::registration_kind::new_backend);
  using runner_t = mr::MoeRunner<mr::reference_policy, lora_policy>;
  mr::FusedMoE<runner_t, mr::unquantized_method> layer(mr::unquantized_method{}, d.unquantized(),
                                                       runner_t("lora_capable", d.cfg, reg), true, d.lora(0.75f));
  CHECK(layer.has_runner());
  CHECK(layer.lora_enabled());
  CHECK(layer.runner().lora_capable());
  REQUIRE(layer.hooks().has_value());
  CHECK(layer.hooks()->backend == layer.runner().runner_backend());
  CHECK(layer.hooks()->backend.name() == "lora_capable");
  CHECK_THROWS_AS(mr::backend_registry::global().resolve("lora_capable"), mr::registry_error);

  auto& stats = lora_policy::stats();
  const int lora_runs = stats.lora_runs, runs = stats.runs;
  host_tensor out(mr::dtype::f32, {m, h});
  mr::cpu_test::fill_sentinel(out);
  const mr::CombineInput ci = layer.forward(d.dispatch(), out.view, {}, mr::cpu_test::host_stream());
  CHECK(ci.hidden_states.data == out.view.data);
  CHECK(stats.lora_runs == lora_runs + 1);
  CHECK(stats.runs == runs + 1);
  CHECK(stats.last_lora_backend == "lora_capable");
  CHECK(stats.last_lora_scaling == 0.75f);
  // The test policy's base math is the reference's.
  CHECK(out.bytes() == run_reference_directly(d, false).bytes());
}

TEST_CASE("FusedMoE: LoRA off builds no hooks and never reads the adapters, even for a LoRA-capable backend") {
  layer_data d;
  mr::backend_registry reg;
  reg.add<lora_policy>({"layer.cpp", 2}, mr::registration_kind::new_backend);
  using runner_t = mr::MoeRunner<mr::reference_policy, lora_policy>;
  for (const char* backend : {"reference", "lora_capable"}) {
    CAPTURE(backend);
    mr::FusedMoE<runner_t, mr::unquantized_method> layer(mr::unquantized_method{}, d.unquantized(),
                                                         runner_t(backend, d.cfg, reg), false, garbage_lora());
    CHECK_FALSE(layer.lora_enabled());
    CHECK_FALSE(layer.hooks().has_value());
    const int lora_runs = lora_policy::stats().lora_runs;
    host_tensor out(mr::dtype::f32, {m, h});
    layer.forward(d.dispatch(), out.view, {}, mr::cpu_test::host_stream());
    CHECK(lora_policy::stats().lora_runs == lora_runs);
    CHECK(out.bytes() == run_reference_directly(d, false).bytes());
  }
}

TEST_CASE("FusedMoE: LoRA on over a backend that cannot do LoRA fails when the layer is built") {
  layer_data d;
  mr::backend_registry reg;
  using runner_t = mr::MoeRunner<mr::reference_policy, lora_policy>;
  CHECK_THROWS_WITH_AS((mr::FusedMoE<runner_t, mr::unquantized_method>(mr::unquantized_method{}, d.unquantized(),
                                                                       runner_t("reference", d.cfg, reg), true,
                                                                       d.lora())),
                       "LoRA is enabled but backend 'reference' is not LoRA-capable (its policy does not set "
                       "supports_lora)",
                       mr::unsupported_error);
}

TEST_CASE("FusedMoE: the quant method is the one injected") {
  layer_data d;
  int calls = 0;
  using runner_t = mr::MoeRunner<mr::reference_policy>;
  mr::FusedMoE<runner_t, counting_method> layer(counting_method{&calls}, d.unquantized(), runner_t("reference", d.cfg));
  CHECK(layer.quant_method().calls == &calls);
  CHECK(calls == 0);
  host_tensor out(mr::dtype::f32, {m, h});
  layer.forward(d.dispatch(), out.view, {}, mr::cpu_test::host_stream());
  CHECK(calls == 1);
  layer.forward(d.dispatch(), out.view, {}, mr::cpu_test::host_stream());
  CHECK(calls == 2);
  CHECK(out.bytes() == run_reference_directly(d, false).bytes());
  CHECK(layer.workspace_bytes(m) == 0);

  // The same runner list fed fp8 weights through the fp8 method.
  mr::FusedMoE<runner_t, mr::fp8_block_method> fp8_layer(mr::fp8_block_method{}, d.fp8(), runner_t("reference", d.cfg));
  host_tensor out8(mr::dtype::f32, {m, h});
  mr::cpu_test::fill_sentinel(out8);
  fp8_layer.forward(d.dispatch(), out8.view, {}, mr::cpu_test::host_stream());
  CHECK(out8.bytes() == run_reference_directly(d, true).bytes());
  CHECK(out8.bytes() != out.bytes());
}

TEST_CASE("FusedMoE without a runner is a valid, checked state") {
  layer_data d;
  using runner_t = mr::MoeRunner<mr::reference_policy>;
  mr::FusedMoE<runner_t, mr::unquantized_method> layer(mr::unquantized_method{}, d.unquantized(), std::nullopt);
  CHECK_FALSE(layer.has_runner());
  CHECK_FALSE(layer.hooks().has_value());
  host_tensor out(mr::dtype::f32, {m, h});
  mr::cpu_test::fill_sentinel(out);
  const auto before = out.bytes();
  CHECK_THROWS_WITH_AS(layer.forward(d.dispatch(), out.view, {}, mr::cpu_test::host_stream()),
                       "FusedMoE: the layer was built without a runner", mr::invalid_argument_error);
  CHECK_THROWS_WITH_AS(layer.workspace_bytes(m), "FusedMoE: the layer was built without a runner",
                       mr::invalid_argument_error);
  CHECK_THROWS_WITH_AS(layer.runner(), "FusedMoE: the layer was built without a runner", mr::invalid_argument_error);
  CHECK(out.bytes() == before);
  // LoRA needs a backend to come from: asking for it with no runner fails at once.
  CHECK_THROWS_WITH_AS((mr::FusedMoE<runner_t, mr::unquantized_method>(mr::unquantized_method{}, d.unquantized(),
                                                                       std::nullopt, true, garbage_lora())),
                       "FusedMoE: LoRA is enabled but the layer has no runner", mr::invalid_argument_error);
}

TEST_CASE("FusedMoE: a quant method that cannot feed the backend the name picked is a clear error") {
  layer_data d;
  mr::backend_registry reg;
  reg.add<plain_policy>({"layer.cpp", 3}, mr::registration_kind::new_backend);
  using runner_t = mr::MoeRunner<mr::reference_policy, plain_policy>;
  CHECK_FALSE(runner_t("plain", d.cfg, reg).accepts_method<mr::fp8_block_method>());
  CHECK_THROWS_WITH_AS((mr::FusedMoE<runner_t, mr::fp8_block_method>(mr::fp8_block_method{}, d.fp8(),
                                                                     runner_t("plain", d.cfg, reg))),
                       "quant method 'fp8_block' does not expose quant info for backend 'plain'", mr::unsupported_error);
  // The same layer type over the backend that can be fed works.
  mr::FusedMoE<runner_t, mr::fp8_block_method> ok(mr::fp8_block_method{}, d.fp8(), runner_t("reference", d.cfg, reg));
  host_tensor out(mr::dtype::f32, {m, h});
  ok.forward(d.dispatch(), out.view, {}, mr::cpu_test::host_stream());
  CHECK(out.bytes() == run_reference_directly(d, true).bytes());
  CHECK(mr::no_quant_info_message("m", "b") == "quant method 'm' does not expose quant info for backend 'b'");
}
