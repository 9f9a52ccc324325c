// The index arithmetic of expert-parallel dispatch and combine, on the host (the reference
// every device implementation is checked against) with the per-slot rules usable in device code.
//
// A world of R ranks splits the E experts in R contiguous ranges of E/R (the communicator size
// must divide E). Each rank routes its own M tokens. Dispatch sends a token once to every rank
// that owns at least one of its slots' experts (not once per slot: the row is what costs), in
// the sender's token order, grouped by destination. The receiver runs its local runner on the
// rows it got, from every source in rank order, with the token's slots mapped to local expert
// ids (-1 where another rank owns the expert) and the token's weights as they are, so the local
// runner's combine gives that rank's weighted part of the token's output. Combine sends each
// part back to the token's rank, which adds the parts of every destination in rank order (a
// fixed order: the same bits on every run where the local runner is deterministic).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "moerunner/core/error.hpp"
#include "moerunner/core/limits.hpp"
#include "moerunner/core/portable_math.hpp"

namespace moerunner {

// Which rank owns which experts.
struct ep_topology {
  int world_size = 1;
  int rank = 0;
  int num_experts = 0;

  // Throws invalid_argument_error unless 0 <= rank < world_size and world_size divides num_experts.
  void validate(const char* where) const {
    MOE_EXPECT(world_size >= 1, where, "world_size must be at least 1, got " + std::to_string(world_size));
    MOE_EXPECT(rank >= 0 && rank < world_size, where,
               "rank " + std::to_string(rank) + " is outside [0, world_size=" + std::to_string(world_size) + ")");
    MOE_EXPECT(num_experts >= 1 && num_experts <= max_num_experts, where,
               "num_experts must be in [1, " + std::to_string(max_num_experts) + "], got " +
                   std::to_string(num_experts));
    MOE_EXPECT(num_experts % world_size == 0, where,
               "the communicator's size (" + std::to_string(world_size) + ") does not divide the experts (" +
                   std::to_string(num_experts) + "): every rank must own as many");
  }
  MOERUNNER_HD int experts_per_rank() const { return num_experts / world_size; }
  // The rank owning expert e (0 <= e < num_experts).
  MOERUNNER_HD int owner(int e) const { return e / experts_per_rank(); }
  // Expert e's id on its owner.
  MOERUNNER_HD int local_id(int e) const { return e % experts_per_rank(); }
  // Expert e's id on this rank, or -1 where another rank owns it (or e is -1 or out of range).
  MOERUNNER_HD int local_on_me(int e) const {
    return e >= 0 && e < num_experts && owner(e) == rank ? local_id(e) : -1;
  }
};

// What one rank sends: for each destination rank d, the tokens (in token order) with at least
// one slot on d, at send positions [offsets[d], offsets[d + 1]).
struct ep_send_layout {
  std::vector<std::int64_t> counts;   // [R]
  std::vector<std::int64_t> offsets;  // [R + 1]
  std::vector<std::int64_t> token;    // [offsets[R]]: the source token of each send position
  std::int64_t total() const { return offsets.empty() ? 0 : offsets.back(); }
};

// ids: the rank's topk_ids [m, k] (global expert ids; -1 and out-of-range ids send nothing,
// as a runner leaves them out).
inline ep_send_layout make_ep_send_layout(const std::int32_t* ids, std::int64_t m, int k, const ep_topology& t) {
  constexpr const char* where = "make_ep_send_layout";
  t.validate(where);
  MOE_EXPECT(m >= 0 && k >= 1 && k <= max_top_k, where, "needs m >= 0 and k in [1, " + std::to_string(max_top_k) + "]");
  const int r = t.world_size;
  ep_send_layout s;
  s.counts.assign(r, 0);
  std::vector<char> goes(static_cast<std::size_t>(r));
  const auto destinations = [&](std::int64_t tok) {
    std::fill(goes.begin(), goes.end(), 0);
    for (int j = 0; j < k; ++j) {
      const int e = ids[tok * k + j];
      if (e >= 0 && e < t.num_experts) goes[t.owner(e)] = 1;
    }
  };
  for (std::int64_t tok = 0; tok < m; ++tok) {
    destinations(tok);
    for (int d = 0; d < r; ++d) s.counts[d] += goes[d];
  }
  s.offsets.assign(r + 1, 0);
  for (int d = 0; d < r; ++d) s.offsets[d + 1] = s.offsets[d] + s.counts[d];
  s.token.assign(static_cast<std::size_t>(s.total()), 0);
  std::vector<std::int64_t> next(s.offsets.begin(), s.offsets.end() - 1);
  for (std::int64_t tok = 0; tok < m; ++tok) {
    destinations(tok);
    for (int d = 0; d < r; ++d)
      if (goes[d]) s.token[next[d]++] = tok;
  }
  return s;
}

// What one rank receives: rows from every source rank in rank order, source s's at receive
// positions [offsets[s], offsets[s + 1]) in the order s sent them. recv_counts[s] is what s's
// layout counts for this rank (exchanged first).
struct ep_recv_layout {
  std::vector<std::int64_t> offsets;  // [R + 1]
  std::int64_t total() const { return offsets.empty() ? 0 : offsets.back(); }
};

inline ep_recv_layout make_ep_recv_layout(const std::vector<std::int64_t>& recv_counts) {
  ep_recv_layout l;
  l.offsets.assign(recv_counts.size() + 1, 0);
  for (std::size_t s = 0; s < recv_counts.size(); ++s) {
    MOE_EXPECT(recv_counts[s] >= 0, "make_ep_recv_layout", "a receive count is negative");
    l.offsets[s + 1] = l.offsets[s] + recv_counts[s];
  }
  return l;
}

// The low-latency mode's buffers, sized from the config alone (no count reaches the host): a
// token goes to a destination at most once, so `capacity` rows per (source, destination) pair
// never overflow when capacity >= the most tokens a rank routes; a smaller capacity saves memory
// and overflow is reported on the device instead of written past the buffer.
struct ep_low_latency_size {
  std::int64_t capacity = 0;  // rows per (source, destination) pair
  std::int64_t row_bytes = 0;
  int world_size = 1;
  // One rank's receive buffer: R sources x capacity rows (its send buffer is the same size).
  std::int64_t buffer_bytes() const { return static_cast<std::int64_t>(world_size) * capacity * row_bytes; }
};

inline ep_low_latency_size make_ep_low_latency_size(std::int64_t max_tokens_per_rank, int hidden_size,
                                                    std::size_t element_bytes, const ep_topology& t,
                                                    std::int64_t capacity = -1) {
  constexpr const char* where = "make_ep_low_latency_size";
  t.validate(where);
  MOE_EXPECT(max_tokens_per_rank >= 0, where, "max_tokens_per_rank must not be negative");
  MOE_EXPECT(hidden_size >= 1 && hidden_size <= max_feature_size, where, "hidden_size out of range");
  MOE_EXPECT(capacity >= -1, where, "capacity must be -1 (max_tokens_per_rank) or a row count");
  ep_low_latency_size s;
  s.capacity = capacity < 0 ? max_tokens_per_rank : capacity;
  s.row_bytes = static_cast<std::int64_t>(hidden_size) * static_cast<std::int64_t>(element_bytes);
  s.world_size = t.world_size;
  return s;
}

}  // namespace moerunner
