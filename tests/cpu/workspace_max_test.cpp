// MoeRunner::max_workspace_bytes: the workspace that serves every run of at most max_tokens
// tokens, for backends whose need falls with M (as cuda_fused's may at decode); the largest
// need over the token counts, or the policy's own answer.
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "moerunner/moerunner.hpp"
#include "test_support.hpp"

namespace mr = moerunner;
using mr::cpu_test::host_tensor;

namespace {

// Host policies whose workspace need falls with M (as cuda_fused's may at decode): one leaves the
// maximum to the runner, the other answers it itself.
template <bool OwnMaximum>
class stepped_need_policy {
 public:
  static constexpr std::string_view name = OwnMaximum ? "test_stepped_own" : "test_stepped";
  static constexpr mr::memory_space tensor_space = mr::memory_space::host;
  using quant_infos = mr::quant_info_list<mr::unquantized_quant_info>;
  static constexpr std::size_t own_answer = 123456;

  explicit stepped_need_policy(const mr::MoeRunnerConfig& cfg) : ref_(cfg) {}
  // 1000 bytes below 8 tokens, 4 per token from 8: a 7-token run needs more than a 200-token one.
  std::size_t workspace_bytes(std::int64_t m) const { return m < 8 ? 1000 : 4 * static_cast<std::size_t>(m); }
  std::size_t max_workspace_bytes(std::int64_t) const
    requires OwnMaximum
  {
    return own_answer;
  }
  mr::CombineInput run_from_dispatch(const mr::DispatchOutput& d, const mr::unquantized_quant_info& q,
                                     const mr::tensor_view& out, mr::workspace_view ws, cuda::stream_ref s) {
    return ref_.run_from_dispatch(d, q, out, ws, s);
  }

 private:
  mr::reference_policy ref_;
};
using stepped_policy = stepped_need_policy<false>;
using stepped_own_policy = stepped_need_policy<true>;
static_assert(mr::DispatchRunnerCore<stepped_policy>);
static_assert(mr::DispatchRunnerCore<stepped_own_policy>);

}  // namespace

TEST_CASE("max_workspace_bytes serves every run up to max_tokens where the need falls with M") {
  constexpr int m = 7, e = 4, h = 24, inter = 40, k = 2;
  const mr::MoeRunnerConfig cfg{{.num_experts = e, .hidden_size = h, .intermediate_size = inter, .top_k = k}};
  host_tensor x{mr::dtype::f32, {m, h}}, w13{mr::dtype::f32, {e, 2 * inter, h}}, w2{mr::dtype::f32, {e, h, inter}};
  host_tensor weights{mr::dtype::f32, {m, k}}, ids{mr::dtype::i32, {m, k}}, out{mr::dtype::f32, {m, h}};
  std::mt19937 rng(mr::test::test_seed());
  for (host_tensor* t : {&x, &w13, &w2, &weights}) mr::cpu_test::fill_uniform(*t, rng, -1.0f, 1.0f);
  for (int i = 0; i < m * k; ++i) ids.view.ptr<std::int32_t>()[i] = (i + i / k) % e;  // distinct per token
  mr::DispatchOutput d;
  d.hidden_states = x.view;
  d.topk = {weights.view, ids.view};
  const mr::unquantized_quant_info q{w13.view, w2.view};
  mr::backend_registry reg;
  reg.add<stepped_policy>({"workspace_max_test.cpp", 1}, mr::registration_kind::new_backend);
  reg.add<stepped_own_policy>({"workspace_max_test.cpp", 2}, mr::registration_kind::new_backend);
  using runner_t = mr::MoeRunner<stepped_policy, stepped_own_policy, mr::reference_policy>;
  runner_t r("test_stepped", cfg, reg);
  CHECK(r.workspace_bytes(200) == 800);
  CHECK(r.max_workspace_bytes(200) == 1000);  // a 7-token run needs 1000
  CHECK(r.max_workspace_bytes(300) == 1200);
  CHECK(r.max_workspace_bytes(0) == 1000);
  CHECK_THROWS_WITH_AS(r.max_workspace_bytes(-1), "MoeRunner::max_workspace_bytes: max_tokens must not be negative, got -1",
                       mr::invalid_argument_error);
  // A workspace of workspace_bytes(200) is refused by a 7-token run before anything runs; one of
  // max_workspace_bytes(200) serves it.
  std::vector<unsigned char> small(r.workspace_bytes(200)), enough(r.max_workspace_bytes(200));
  CHECK_THROWS_WITH_AS(r.run(d, q, out.view, {small.data(), small.size()}, cuda::stream_ref(cudaStream_t{})),
                       "MoeRunner::run: workspace too small: 800 bytes given, 1000 needed (ask workspace_bytes)",
                       mr::invalid_argument_error);
  CHECK_NOTHROW(r.run(d, q, out.view, {enough.data(), enough.size()}, cuda::stream_ref(cudaStream_t{})));
  // A policy's own answer is the runner's, and the layer's.
  runner_t own("test_stepped_own", cfg, reg);
  CHECK(own.max_workspace_bytes(200) == stepped_own_policy::own_answer);
  mr::moe_weights wts;
  wts.w13 = w13.view;
  wts.w2 = w2.view;
  mr::FusedMoE<runner_t, mr::unquantized_method> layer(mr::unquantized_method{}, wts, runner_t("test_stepped_own", cfg, reg));
  CHECK(layer.max_workspace_bytes(200) == stepped_own_policy::own_answer);
  CHECK(runner_t("reference", cfg, reg).max_workspace_bytes(1 << 16) == 0);
}
