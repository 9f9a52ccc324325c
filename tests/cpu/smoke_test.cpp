#include <doctest/doctest.h>
#include "moerunner/moerunner.hpp"
TEST_CASE("smoke") {
  moerunner::MoeRunnerConfig cfg({.num_experts = 4, .hidden_size = 8, .intermediate_size = 4, .top_k = 2});
  moerunner::MoeRunner<moerunner::reference_policy> r("reference", cfg);
  CHECK(r.runner_backend().is_reference());
}
