// A registration in a static archive linked whole (Meson link_whole) is present at run time.
#include <doctest/doctest.h>

#include "moerunner/moerunner.hpp"
#include "test_support.hpp"

namespace mr = moerunner;

TEST_CASE("a backend registered in a whole-linked static archive resolves") {
  auto& reg = mr::backend_registry::global();
  CHECK(reg.deferred_errors().empty());
  CHECK(reg.resolve("archived").name() == "archived");
  const auto rec = reg.lookup(mr::backend_id(std::string_view("archived")));
  REQUIRE(rec.has_value());
  CHECK(std::string_view(rec->site.file).ends_with("archive_backend.cpp"));
  CHECK(rec->type_key == &mr::policy_type_key<mr::cpu_test::echo_policy<"archived">>);
  const mr::MoeRunnerConfig cfg({.num_experts = 2, .hidden_size = 8, .intermediate_size = 8, .top_k = 1});
  mr::MoeRunner<mr::reference_policy, mr::cpu_test::echo_policy<"archived">> runner("archived", cfg);
  CHECK(runner.policy_index() == 1);
}
