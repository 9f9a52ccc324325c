// Registration macros. Each checks the policy against DispatchRunnerCore and its name
// at compile time, then registers name and policy in one step at static-init time.
//
//   MOE_REGISTER_BACKEND(my_policy);           // a new backend name
//   MOE_REPLACE_BUILTIN_BACKEND(my_reference); // deliberately replaces a built-in
//
// Use them at namespace scope in a .cpp/.cu file. Objects in a static archive are only
// linked when referenced: link such an archive whole (Meson link_whole, CMake
// $<LINK_LIBRARY:WHOLE_ARCHIVE,...>) or its registrations silently vanish.
#pragma once

#include "moerunner/lora/lora.hpp"
#include "moerunner/registry/backend_registry.hpp"

#define MOERUNNER_PP_CAT_(a, b) a##b
#define MOERUNNER_PP_CAT(a, b) MOERUNNER_PP_CAT_(a, b)

#define MOERUNNER_REGISTER_(Policy, kind)                                                                  \
  static_assert(::moerunner::explain_dispatch_runner_core<Policy>());                                     \
  static_assert(::moerunner::explain_lora_capability<Policy>());                                         \
  static_assert(::moerunner::backend_name_problem(Policy::name).empty(),                                  \
                "MOE_REGISTER_BACKEND: Policy::name must be non-empty, at most 63 characters, printable "   \
                "ASCII without spaces.");                                                                  \
  namespace {                                                                                              \
  [[maybe_unused]] const bool MOERUNNER_PP_CAT(moerunner_registration_, __LINE__) =                       \
      ::moerunner::backend_registry::global().add_deferred<Policy>({__FILE__, __LINE__}, kind);           \
  }                                                                                                        \
  static_assert(true, "")

#define MOE_REGISTER_BACKEND(Policy)                                                                       \
  static_assert(!::moerunner::is_builtin_name(Policy::name),                                              \
                "MOE_REGISTER_BACKEND: Policy::name is a built-in backend name; use "                       \
                "MOE_REPLACE_BUILTIN_BACKEND to replace a built-in on purpose.");                           \
  MOERUNNER_REGISTER_(Policy, ::moerunner::registration_kind::new_backend)

#define MOE_REPLACE_BUILTIN_BACKEND(Policy)                                                                \
  static_assert(::moerunner::is_builtin_name(Policy::name),                                               \
                "MOE_REPLACE_BUILTIN_BACKEND: Policy::name is not a built-in backend name; use "            \
                "MOE_REGISTER_BACKEND for a new backend.");                                                  \
  MOERUNNER_REGISTER_(Policy, ::moerunner::registration_kind::replace_builtin)
