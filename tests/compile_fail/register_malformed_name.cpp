// Must not compile: a backend name with a space cannot travel on a command line.
#include "named_policy.hpp"

struct spaced_name_policy : cf::unnamed_policy {
  using unnamed_policy::unnamed_policy;
#ifdef MOERUNNER_CONTROL
  static constexpr std::string_view name = "my_backend";
#else
  static constexpr std::string_view name = "my backend";
#endif
};

MOE_REGISTER_BACKEND(spaced_name_policy);
