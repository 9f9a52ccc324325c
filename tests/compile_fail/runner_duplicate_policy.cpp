// Must not compile: a runner that lists the same policy type twice.
#include "named_policy.hpp"

struct extra_policy : cf::unnamed_policy {
  using unnamed_policy::unnamed_policy;
  static constexpr std::string_view name = "extra";
};

#ifdef MOERUNNER_CONTROL
using runner = moerunner::MoeRunner<moerunner::reference_policy, extra_policy>;
#else
using runner = moerunner::MoeRunner<moerunner::reference_policy, extra_policy, moerunner::reference_policy>;
#endif

std::size_t runner_size() { return sizeof(runner); }
