// Must not compile: MOE_REPLACE_BUILTIN_BACKEND with a name that is not built in.
#include "named_policy.hpp"

struct my_replacement : cf::unnamed_policy {
  using unnamed_policy::unnamed_policy;
#ifdef MOERUNNER_CONTROL
  static constexpr std::string_view name = "reference";
#else
  static constexpr std::string_view name = "my_replacement";
#endif
};

MOE_REPLACE_BUILTIN_BACKEND(my_replacement);
