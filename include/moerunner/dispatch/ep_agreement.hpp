// What every rank of an expert-parallel group must build its dispatcher with alike, as a few
// words each rank contributes once (ep_nccl_dispatcher's constructor gathers them from every
// rank): whether the rank's own checks passed, the layer's shape and the exchange's layout.
// Ranks built differently would size NCCL's transfers differently and hang or garble them; with
// every rank's words at hand, every rank reaches the same verdict, so they all throw together
// instead. Host arithmetic only.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "moerunner/core/dtype.hpp"
#include "moerunner/core/error.hpp"
#include "moerunner/dispatch/ep_buffers.hpp"

namespace moerunner {

// The words, in order: the rank's own verdict, then what it was built with.
enum ep_agreement_word : int {
  ep_word_checks,
  ep_word_experts,
  ep_word_top_k,
  ep_word_hidden,
  ep_word_dtype,
  ep_word_mode,
  ep_word_max_tokens,
  ep_word_capacity,
  ep_agreement_words
};
using ep_agreement = std::array<std::int64_t, ep_agreement_words>;

namespace ep_agreement_detail {
// Each word's name in the message, by ep_agreement_word.
inline constexpr std::array<const char*, ep_agreement_words> fields = {
    "checks", "num_experts", "top_k", "hidden_size", "dtype", "mode", "max_tokens_per_rank", "capacity (rows per slot)"};
inline constexpr std::int64_t passed = 1, failed = 0;

// Word w's value as the message shows it (the dtype and the mode by name).
inline std::string shown(int w, std::int64_t v) {
  if (w == ep_word_dtype && v >= 0 && v < 256) {
    const std::string_view n = dtype_name(static_cast<dtype>(v));
    if (n != "?") return std::string(n);
  }
  if (w == ep_word_mode && v >= 0 && v < 256) {
    const std::string_view n = ep_mode_name(static_cast<ep_mode>(v));
    if (!n.empty()) return std::string(n);
  }
  return std::to_string(v);
}
}  // namespace ep_agreement_detail

// The words of a rank whose own checks passed, built with num_experts experts in all and `l`.
inline ep_agreement make_ep_agreement(int num_experts, dtype type, const ep_buffer_layout& l) {
  ep_agreement a{};
  a[ep_word_checks] = ep_agreement_detail::passed;
  a[ep_word_experts] = num_experts;
  a[ep_word_top_k] = l.top_k;
  a[ep_word_hidden] = l.hidden;
  a[ep_word_dtype] = static_cast<std::int64_t>(type);
  a[ep_word_mode] = static_cast<std::int64_t>(l.mode);
  a[ep_word_max_tokens] = l.max_tokens;
  a[ep_word_capacity] = l.slots;
  return a;
}

// The words of a rank whose own checks failed (it throws its own error).
inline ep_agreement failed_ep_agreement() {
  ep_agreement a{};
  a[ep_word_checks] = ep_agreement_detail::failed;
  return a;
}

// Throws invalid_argument_error naming `where` unless every rank's checks passed and every rank's
// words are rank 0's; `all` holds world_size agreements, rank by rank. The first rank that failed
// or differs is named (with the field and both values), as every rank sees it.
inline void check_ep_agreement(std::span<const ep_agreement> all, const char* where) {
  using namespace ep_agreement_detail;
  for (std::size_t r = 0; r < all.size(); ++r)
    MOE_EXPECT(all[r][ep_word_checks] == passed, where,
               "rank " + std::to_string(r) + " failed its own checks when building its dispatcher (its error says why); "
               "the dispatcher is built on every rank alike or on none");
  for (std::size_t r = 1; r < all.size(); ++r)
    for (int w = ep_word_checks + 1; w < ep_agreement_words; ++w)
      MOE_EXPECT(all[r][w] == all[0][w], where,
                 std::string("rank ") + std::to_string(r) + " was built with " + fields[w] + " " +
                     shown(w, all[r][w]) + ", rank 0 with " + shown(w, all[0][w]) +
                     ": every rank builds its dispatcher with the same config, dtype and ep_params");
}

}  // namespace moerunner
