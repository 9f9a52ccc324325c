// The documented pitfall: the same static archive linked the ordinary way. Nothing in
// it is referenced, so the linker drops its only object and the registration vanishes
// without any error. Link registration archives whole (Meson link_whole, CMake
// $<LINK_LIBRARY:WHOLE_ARCHIVE,...>, or -Wl,--whole-archive).
#include <doctest/doctest.h>

#include "moerunner/moerunner.hpp"

namespace mr = moerunner;

TEST_CASE("a backend registered in a static archive linked the ordinary way is not there") {
  auto& reg = mr::backend_registry::global();
  CHECK(reg.registered().empty());
  CHECK(reg.deferred_errors().empty());
  CHECK_THROWS_WITH_AS(reg.resolve("archived"),
                       "unknown MoE runner backend 'archived': neither built in nor registered; known backends: "
                       "reference, cuda_fused, cublas_grouped, cuda_fused_fp8",
                       mr::registry_error);
}
