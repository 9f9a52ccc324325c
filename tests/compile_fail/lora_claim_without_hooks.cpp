// Must not compile: a policy that claims LoRA support but has no run overload taking hooks.
#include "named_policy.hpp"

struct claims_lora : cf::unnamed_policy {
  using unnamed_policy::unnamed_policy;
  static constexpr std::string_view name = "claims_lora";
#ifdef MOERUNNER_CONTROL
  static constexpr bool supports_lora = false;
#else
  static constexpr bool supports_lora = true;
#endif
};

using runner = moerunner::MoeRunner<moerunner::reference_policy, claims_lora>;

std::size_t runner_size() { return sizeof(runner); }
