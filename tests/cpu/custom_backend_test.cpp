// A custom host backend registered by macro, chosen by name, run through the standard
// dispatcher and combine; the runner reaches it with no virtual call.
#include <doctest/doctest.h>

#include <cstring>
#include <random>
#include <type_traits>

#include "moerunner/moerunner.hpp"
#include "test_support.hpp"

namespace mr = moerunner;
using mr::cpu_test::host_tensor;

namespace {

// Adds a marker to every output element after computing the reference math, so a
// test can tell from the numbers alone which backend ran.
class marker_policy {
 public:
  static constexpr std::string_view name = "test_marker";
  static constexpr mr::memory_space tensor_space = mr::memory_space::host;
  using quant_infos = mr::quant_info_list<mr::unquantized_quant_info>;
  static constexpr float marker = 1000.0f;

  explicit marker_policy(const mr::MoeRunnerConfig& cfg) : ref_(cfg) {}
  std::size_t workspace_bytes(std::int64_t num_tokens) const { return 4 * static_cast<std::size_t>(num_tokens); }

  mr::CombineInput run_from_dispatch(const mr::DispatchOutput& d, const mr::unquantized_quant_info& q,
                                     const mr::tensor_view& out, mr::workspace_view ws, cuda::stream_ref s) {
    // The workspace is the caller's: use it, to show it arrives sized and writable.
    std::memset(ws.data, 0x3c, ws.bytes);
    mr::CombineInput c = ref_.run_from_dispatch(d, q, out, ws, s);
    for (std::int64_t i = 0; i < out.numel(); ++i) out.ptr<float>()[i] += marker;
    return c;
  }

 private:
  mr::reference_policy ref_;
};

}  // namespace

constexpr int marker_registration_line = __LINE__ + 1;
MOE_REGISTER_BACKEND(marker_policy);

static_assert(!std::is_polymorphic_v<marker_policy>);
static_assert(!std::is_polymorphic_v<mr::reference_policy>);
static_assert(!std::is_polymorphic_v<mr::MoeRunner<mr::reference_policy>>);
static_assert(!std::is_polymorphic_v<mr::MoeRunner<mr::reference_policy, marker_policy>>);
static_assert(!std::is_polymorphic_v<mr::MoeRunner<marker_policy, mr::reference_policy>>);
static_assert(!std::is_polymorphic_v<mr::FusedMoE<mr::MoeRunner<mr::reference_policy, marker_policy>, mr::unquantized_method>>);
static_assert(!std::is_polymorphic_v<mr::standard_dispatcher>);
static_assert(!std::is_polymorphic_v<mr::backend_registry>);
static_assert(mr::DispatchRunnerCore<marker_policy>);
static_assert(mr::QuantInfoProvider<mr::unquantized_method, marker_policy>);
static_assert(!mr::QuantInfoProvider<mr::fp8_block_method, marker_policy>);
static_assert(mr::QuantInfoProvider<mr::fp8_block_method, mr::reference_policy>);

namespace {

struct problem {
  static constexpr int m = 7, e = 4, h = 24, inter = 40, k = 2;
  mr::MoeRunnerConfig cfg{{.num_experts = e, .hidden_size = h, .intermediate_size = inter, .top_k = k}};
  host_tensor x{mr::dtype::f32, {m, h}};
  host_tensor logits{mr::dtype::f32, {m, e}};
  host_tensor w13{mr::dtype::f32, {e, 2 * inter, h}};
  host_tensor w2{mr::dtype::f32, {e, h, inter}};
  host_tensor weights{mr::dtype::f32, {m, k}};
  host_tensor ids{mr::dtype::i32, {m, k}};

  problem() {
    std::mt19937 rng(1234);
    mr::cpu_test::fill_uniform(x, rng, -1.0f, 1.0f);
    mr::cpu_test::fill_uniform(logits, rng, -3.0f, 3.0f);
    mr::cpu_test::fill_uniform(w13, rng, -0.2f, 0.2f);
    mr::cpu_test::fill_uniform(w2, rng, -0.2f, 0.2f);
    mr::TopKOutput topk{weights.view, ids.view};
    mr::reference::topk(logits.view, nullptr, {.top_k = k}, topk);
  }
  mr::TopKOutput topk() const { return {weights.view, ids.view}; }
  mr::unquantized_quant_info quant() const { return {w13.view, w2.view}; }
};

}  // namespace

TEST_CASE("the macro registered the custom backend in the global registry, at this file and line") {
  auto& reg = mr::backend_registry::global();
  CHECK(reg.deferred_errors().empty());
  const mr::backend_id id = reg.resolve("test_marker");
  CHECK(id.name() == "test_marker");
  CHECK_FALSE(id.is_builtin());
  const auto rec = reg.lookup(id);
  REQUIRE(rec.has_value());
  CHECK(rec->kind == mr::registration_kind::new_backend);
  CHECK(rec->type_key == &mr::policy_type_key<marker_policy>);
  CHECK(std::string_view(rec->site.file) == __FILE__);
  CHECK(rec->site.line == marker_registration_line);
  CHECK(reg.registered().size() == 1);
  CHECK(reg.known_names() == "reference, cuda_fused, cublas_grouped, cuda_fused_fp8, test_marker");
}

TEST_CASE("a custom backend chosen by name runs through standard dispatch and combine") {
  problem p;
  mr::standard_dispatcher dispatcher(p.cfg);
  const mr::DispatchOutput d = dispatcher.dispatch(p.x.view, p.topk());
  CHECK(d.num_tokens() == problem::m);
  CHECK(d.hidden_states.data == p.x.view.data);

  mr::MoeRunner<mr::reference_policy, marker_policy> custom("test_marker", p.cfg);
  CHECK(custom.runner_backend().name() == "test_marker");
  CHECK(custom.policy_index() == 1);
  CHECK(custom.workspace_bytes(problem::m) == 4 * problem::m);
  CHECK(custom.tensor_space() == mr::memory_space::host);
  CHECK(custom.accepts<mr::unquantized_quant_info>());
  CHECK_FALSE(custom.accepts<mr::fp8_block_quant_info>());
  CHECK(custom.accepts_method<mr::unquantized_method>());
  CHECK_FALSE(custom.accepts_method<mr::fp8_block_method>());
  CHECK_FALSE(custom.lora_capable());

  mr::MoeRunner<mr::reference_policy, marker_policy> reference("reference", p.cfg);
  CHECK(reference.runner_backend().is_reference());
  CHECK(reference.policy_index() == 0);
  CHECK(reference.workspace_bytes(problem::m) == 0);
  CHECK(reference.accepts<mr::fp8_block_quant_info>());

  host_tensor out_custom(mr::dtype::f32, {problem::m, problem::h});
  host_tensor out_ref(mr::dtype::f32, {problem::m, problem::h});
  mr::cpu_test::fill_sentinel(out_custom);
  mr::cpu_test::fill_sentinel(out_ref);
  std::vector<unsigned char> ws(custom.workspace_bytes(problem::m));

  const mr::CombineInput ci =
      custom.run(d, p.quant(), out_custom.view, {ws.data(), ws.size()}, mr::cpu_test::host_stream());
  CHECK(ci.combined);
  CHECK(ci.hidden_states.data == out_custom.view.data);
  const mr::tensor_view combined = dispatcher.combine(ci);
  CHECK(combined.data == out_custom.view.data);
  CHECK(combined.shape_string() == "[7, 24]");
  CHECK(ws[0] == 0x3c);
  CHECK(ws.back() == 0x3c);

  const mr::CombineInput cr = reference.run(d, p.quant(), out_ref.view, {}, mr::cpu_test::host_stream());
  CHECK(dispatcher.combine(cr).data == out_ref.view.data);

  // The custom output is exactly the reference output plus the marker, element for element.
  for (std::int64_t i = 0; i < out_ref.numel(); ++i) {
    const float r = out_ref.ptr<float>()[i];
    REQUIRE(std::isfinite(r));
    CHECK(out_custom.ptr<float>()[i] == r + marker_policy::marker);
  }
}

TEST_CASE("the runner reaches whichever listed policy the name picks, in any list order") {
  problem p;
  mr::MoeRunner<marker_policy, mr::reference_policy> r1("test_marker", p.cfg);
  mr::MoeRunner<marker_policy, mr::reference_policy> r2("reference", p.cfg);
  CHECK(r1.policy_index() == 0);
  CHECK(r2.policy_index() == 1);
  const std::size_t idx = r1.visit([](auto& core) -> std::size_t {
    return std::is_same_v<std::decay_t<decltype(core)>, marker_policy> ? 0 : 1;
  });
  CHECK(idx == 0);
  const std::size_t idx2 = r2.visit([](const auto& core) -> std::size_t {
    return std::is_same_v<std::decay_t<decltype(core)>, mr::reference_policy> ? 1 : 0;
  });
  CHECK(idx2 == 1);
}

TEST_CASE("standard_dispatcher validates the hidden states it is handed") {
  problem p;
  mr::standard_dispatcher dispatcher(p.cfg);
  host_tensor wrong_h(mr::dtype::f32, {problem::m, problem::h + 1});
  CHECK_THROWS_WITH_AS(dispatcher.dispatch(wrong_h.view, p.topk()),
                       "standard_dispatcher::dispatch: hidden_states dimension 1 must be 24, got shape [7, 25]",
                       mr::invalid_argument_error);
  host_tensor flat(mr::dtype::f32, {problem::m * problem::h});
  CHECK_THROWS_WITH_AS(dispatcher.dispatch(flat.view, p.topk()),
                       "standard_dispatcher::dispatch: hidden_states must have rank 2, got shape [168]",
                       mr::invalid_argument_error);
}
