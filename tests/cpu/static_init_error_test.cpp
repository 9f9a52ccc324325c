// A registration that fails during static initialization (here: two policy types under
// one name) must not throw out of a static initializer; the error is kept and every
// later resolve re-raises it, with both sites.
#include <doctest/doctest.h>

#include <string>

#include "moerunner/moerunner.hpp"
#include "test_support.hpp"

namespace mr = moerunner;

namespace {
using first_policy = mr::cpu_test::echo_policy<"same_name">;
using second_policy = mr::cpu_test::echo_policy<"same_name", 16>;
}  // namespace

constexpr int first_line = __LINE__ + 1;
MOE_REGISTER_BACKEND(first_policy);
constexpr int second_line = __LINE__ + 1;
MOE_REGISTER_BACKEND(second_policy);

TEST_CASE("the duplicate found at static initialization is re-raised by every resolve, naming both sites") {
  auto& reg = mr::backend_registry::global();
  const std::string dup = "duplicate registration of backend 'same_name': first at " + std::string(__FILE__) + ":" +
                          std::to_string(first_line) + ", again at " + std::string(__FILE__) + ":" +
                          std::to_string(second_line);
  REQUIRE(reg.deferred_errors().size() == 1);
  CHECK(reg.deferred_errors()[0] == dup);
  const std::string raised = "backend registration failed during static initialization:\n  " + dup;
  for (const char* name : {"reference", "same_name", "cuda_fused", "unknown"}) {
    CAPTURE(name);
    CHECK_THROWS_WITH_AS(reg.resolve(name), raised.c_str(), mr::registry_error);
  }
  const mr::MoeRunnerConfig cfg({.num_experts = 2, .hidden_size = 8, .intermediate_size = 8, .top_k = 1});
  CHECK_THROWS_WITH_AS((mr::MoeRunner<mr::reference_policy, first_policy>("reference", cfg)), raised.c_str(),
                       mr::registry_error);
  // The first registration itself stands.
  const auto rec = reg.lookup(mr::backend_id(std::string_view("same_name")));
  REQUIRE(rec.has_value());
  CHECK(rec->type_key == &mr::policy_type_key<first_policy>);
  CHECK(rec->site.line == first_line);
}
