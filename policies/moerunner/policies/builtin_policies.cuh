// The built-in policy types, in the order of MOERUNNER_BUILTIN_BACKENDS, checked
// against that list at compile time so the two can never drift apart.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/policies/builtin_policies.cuh needs nvcc: include it from a .cu file"
#endif

#include <string_view>

#include "moerunner/core/backend_id.hpp"
#include "moerunner/policies/cublas_grouped_policy.cuh"
#include "moerunner/policies/cuda_fused_fp8_policy.cuh"
#include "moerunner/policies/cuda_fused_policy.cuh"
#include "moerunner/policies/reference_policy.hpp"
#include "moerunner/runner/moe_runner.hpp"

namespace moerunner {

namespace detail {
template <class... P>
consteval bool names_match_builtin_list() {
  constexpr std::string_view names[] = {std::string_view(P::name)...};
  if (sizeof...(P) != builtin::all.size()) return false;
  for (std::size_t i = 0; i < sizeof...(P); ++i)
    if (names[i] != builtin::all[i].id.name()) return false;
  return true;
}
}  // namespace detail

// Every built-in backend plus any extra (registered) policies an engine adds.
template <class... Extra>
using builtin_moe_runner = MoeRunner<reference_policy, cuda_fused_policy, cublas_grouped_policy, cuda_fused_fp8_policy, Extra...>;

static_assert(detail::names_match_builtin_list<reference_policy, cuda_fused_policy, cublas_grouped_policy,
                                                  cuda_fused_fp8_policy>(),
              "builtin_moe_runner must list exactly the policies of MOERUNNER_BUILTIN_BACKENDS, in that order.");
static_assert(!std::is_polymorphic_v<builtin_moe_runner<>>);

}  // namespace moerunner
