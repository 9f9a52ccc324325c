// The only object of a static archive: it registers a backend and exports nothing
// else, so no linker pulls it in unless told to link the archive whole.
#include "moerunner/registry/register_backend.hpp"
#include "test_support.hpp"

namespace {
using archived_policy = moerunner::cpu_test::echo_policy<"archived">;
}  // namespace

MOE_REGISTER_BACKEND(archived_policy);
