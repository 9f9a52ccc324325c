// Translation unit B of the two-TU test: includes every public host header, registers
// its own backend and sees the header-registered one.
#include "moerunner/core/backend_id.hpp"
#include "moerunner/core/builtin_backends.hpp"
#include "moerunner/core/concepts.hpp"
#include "moerunner/core/config.hpp"
#include "moerunner/core/dtype.hpp"
#include "moerunner/core/error.hpp"
#include "moerunner/core/host_float.hpp"
#include "moerunner/core/portable_math.hpp"
#include "moerunner/core/tensor_view.hpp"
#include "moerunner/core/types.hpp"
#include "moerunner/dispatch/standard_dispatcher.hpp"
#include "moerunner/layer/fused_moe.hpp"
#include "moerunner/lora/lora.hpp"
#include "moerunner/moerunner.hpp"
#include "moerunner/policies/reference_policy.hpp"
#include "moerunner/quant/quant_info.hpp"
#include "moerunner/quant/quant_methods.hpp"
#include "moerunner/reference/activation.hpp"
#include "moerunner/reference/routing.hpp"
#include "moerunner/registry/backend_registry.hpp"
#include "moerunner/registry/register_backend.hpp"
#include "moerunner/routing/topk_rules.hpp"
#include "moerunner/runner/moe_runner.hpp"
#include "moerunner/runner/validate.hpp"
#include "test_support.hpp"
#include "two_tu_shared.hpp"

namespace {
using tu_b_policy = moerunner::cpu_test::echo_policy<"two_tu_b">;
}  // namespace

MOE_REGISTER_BACKEND(tu_b_policy);

namespace two_tu {

tu_report report_b() {
  namespace mr = moerunner;
  using mr::cpu_test::host_tensor;
  // Both TUs instantiate the same runner and layer templates; the linker keeps one copy.
  const mr::MoeRunnerConfig cfg({.num_experts = 2, .hidden_size = 8, .intermediate_size = 8, .top_k = 1});
  mr::MoeRunner<mr::reference_policy, shared_header_policy, tu_b_policy> runner("two_tu_shared", cfg);
  host_tensor x(mr::dtype::f32, {3, 8}), w13(mr::dtype::f32, {2, 16, 8}), w2(mr::dtype::f32, {2, 8, 8});
  host_tensor wts(mr::dtype::f32, {3, 1}), ids(mr::dtype::i32, {3, 1});
  for (std::int64_t i = 0; i < x.numel(); ++i) x.ptr<float>()[i] = 0.01f * float(i % 17) - 0.05f;
  for (std::int64_t i = 0; i < w13.numel(); ++i) w13.ptr<float>()[i] = 0.02f * float(i % 13) - 0.1f;
  for (std::int64_t i = 0; i < w2.numel(); ++i) w2.ptr<float>()[i] = 0.03f * float(i % 11) - 0.15f;
  for (int t = 0; t < 3; ++t) {
    wts.ptr<float>()[t] = 1.0f;
    ids.ptr<std::int32_t>()[t] = t % 2;
  }
  host_tensor out(mr::dtype::f32, {3, 8}), expect(mr::dtype::f32, {3, 8});
  const mr::DispatchOutput d{x.view, {}, {wts.view, ids.view}};
  runner.run(d, mr::unquantized_quant_info{w13.view, w2.view}, out.view, {}, mr::cpu_test::host_stream());
  mr::reference_policy(cfg).run_from_dispatch(d, mr::unquantized_quant_info{w13.view, w2.view}, expect.view, {},
                                              mr::cpu_test::host_stream());
  return {&mr::backend_registry::global(), &mr::policy_type_key<shared_header_policy>,
          &mr::policy_type_key<tu_b_policy>, tu_b_policy::name, out.bytes() == expect.bytes()};
}

}  // namespace two_tu
