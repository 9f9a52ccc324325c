// Must not compile: MOE_REGISTER_BACKEND under a built-in name would silently
// replace the built-in; that needs MOE_REPLACE_BUILTIN_BACKEND.
#include "named_policy.hpp"

struct my_reference : cf::unnamed_policy {
  using unnamed_policy::unnamed_policy;
#ifdef MOERUNNER_CONTROL
  static constexpr std::string_view name = "my_reference";
#else
  static constexpr std::string_view name = "reference";
#endif
};

MOE_REGISTER_BACKEND(my_reference);
