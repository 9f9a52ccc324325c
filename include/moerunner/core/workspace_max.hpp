// The workspace that serves every run of at most max_tokens tokens. A backend's need is not
// monotone in the token count where its plan changes with M (cuda_fused's deterministic decode
// keeps f32 K-split parts a larger batch does not; cuda_fused_fp8's decode GEMMs keep act in
// f32), so an engine that sizes one buffer for its largest batch asks for the maximum, not for
// workspace_bytes(max_tokens).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "moerunner/core/error.hpp"

namespace moerunner::detail {

// The largest need(m) over m = 0..max_tokens: one call per token count, a setup-time query.
template <class Need>
std::size_t max_workspace_over_tokens(std::int64_t max_tokens, Need&& need, const char* where) {
  MOE_EXPECT(max_tokens >= 0, where, "max_tokens must not be negative, got " + std::to_string(max_tokens));
  std::size_t most = 0;
  for (std::int64_t m = 0; m <= max_tokens; ++m) most = std::max<std::size_t>(most, need(m));
  return most;
}

}  // namespace moerunner::detail
