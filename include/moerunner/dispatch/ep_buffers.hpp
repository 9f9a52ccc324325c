// The device workspace of expert-parallel dispatch over NCCL (dispatch/ep_nccl_dispatcher.cuh),
// laid out on the host from the config alone: the caller allocates it once, and no dispatch
// allocates. Each piece starts on a 256-byte boundary; the sizes are the worst case of the mode.
//
//   piece        type   shape                       modes
//   send_pos     i32    [Mmax, R]                   throughput, low_latency: token t's position in d's list, or -1
//   send_token   i32    [R, Mmax]                   throughput, low_latency: d's list of tokens, in token order
//   counts       i64    [2R]                        throughput, low_latency: rows sent to each rank, then received
//   send_rows    dtype  [send_slots, H]             throughput, low_latency: rows packed by destination
//   send_meta    i32    [send_slots, 2k]            throughput, low_latency: each row's k global ids, k weights' bits
//   recv_rows    dtype  [R * slots, H]              every mode: the rows the local runner gets
//   recv_meta    i32    [R * slots, 2k]             every mode
//   ids, weights i32/f32 [R * slots, k]             every mode: the local runner's routing (local ids)
//   back         dtype  [back_rows, H]              every mode: the parts coming back in combine
//
// slots (rows per source in the receive buffers): capacity C in low_latency, Mmax otherwise.
// send_slots: Mmax * min(R, k) in throughput (a token goes to each destination at most once,
// to at most k of them), R * C in low_latency, none in allgather (it gathers in place).
// back_rows: send_slots, except allgather: Mmax (its reduce-scatter's output).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "moerunner/core/dtype.hpp"
#include "moerunner/core/error.hpp"
#include "moerunner/core/limits.hpp"
#include "moerunner/dispatch/ep_layout.hpp"

namespace moerunner {

enum class ep_mode : std::uint8_t {
  throughput,   // prefill: counts exchanged first, then exactly the rows each rank needs
  low_latency,  // decode: fixed-capacity buffers, no host synchronization, graph capturable
  allgather,    // every rank gathers every token, the parts meet in a reduce-scatter
};

// Empty for a value outside the enumerators (made by a cast), which validation rejects.
constexpr std::string_view ep_mode_name(ep_mode m) {
  switch (m) {
    case ep_mode::throughput: return "throughput";
    case ep_mode::low_latency: return "low_latency";
    case ep_mode::allgather: return "allgather";
  }
  return {};
}

// What sizes the buffers besides the layer's config.
struct ep_params {
  ep_mode mode = ep_mode::throughput;
  // The most tokens any rank dispatches in one call (every rank uses the same value).
  std::int64_t max_tokens_per_rank = 0;
  // low_latency: rows per (source, destination) pair; -1 is max_tokens_per_rank, which never
  // overflows (a token goes to a destination at most once).
  std::int64_t capacity = -1;
};

struct ep_buffer_layout {
  ep_mode mode = ep_mode::throughput;
  int world_size = 1;
  int top_k = 1;
  std::int64_t hidden = 0;
  std::int64_t row_bytes = 0;
  std::int64_t max_tokens = 0;  // Mmax
  std::int64_t slots = 0;       // rows per source in the receive buffers
  std::int64_t send_slots = 0;
  std::int64_t back_rows = 0;
  // Byte offsets into the workspace (0 and unused where the mode has no such piece).
  std::size_t send_pos = 0, send_token = 0, counts = 0, send_rows = 0, send_meta = 0;
  std::size_t recv_rows = 0, recv_meta = 0, ids = 0, weights = 0, back = 0;
  std::size_t bytes = 0;  // the whole workspace

  int meta_words() const { return 2 * top_k; }
  std::int64_t recv_capacity() const { return static_cast<std::int64_t>(world_size) * slots; }
};

// Throws invalid_argument_error naming `where` for a topology, mode or size the buffers cannot
// serve; hidden and top_k come from a validated MoeRunnerConfig.
inline ep_buffer_layout make_ep_buffer_layout(const ep_topology& topo, int top_k, int hidden, dtype type,
                                              const ep_params& p, const char* where) {
  topo.validate(where);
  MOE_EXPECT(topo.world_size <= max_ep_world_size, where,
             "world_size must be at most " + std::to_string(max_ep_world_size) + ", got " +
                 std::to_string(topo.world_size));
  MOE_EXPECT(!ep_mode_name(p.mode).empty(), where,
             "mode must be throughput, low_latency or allgather, got the value " +
                 std::to_string(static_cast<int>(p.mode)));
  MOE_EXPECT(is_activation_dtype(type), where, "dtype must be f32, f16 or bf16, got " + std::string(dtype_name(type)));
  MOE_EXPECT(top_k >= 1 && top_k <= max_top_k, where, "top_k out of range");
  MOE_EXPECT(p.max_tokens_per_rank >= 1, where,
             "max_tokens_per_rank must be at least 1, got " + std::to_string(p.max_tokens_per_rank));
  MOE_EXPECT(p.mode == ep_mode::low_latency || p.capacity == -1, where,
             "capacity is a low_latency setting; leave it -1 in mode " + std::string(ep_mode_name(p.mode)));
  const int r = topo.world_size;
  const ep_low_latency_size ll = make_ep_low_latency_size(p.max_tokens_per_rank, hidden, dtype_size(type), topo,
                                                          p.mode == ep_mode::low_latency ? p.capacity : -1);
  MOE_EXPECT(p.mode != ep_mode::low_latency || ll.capacity >= 1, where,
             "capacity must be -1 (max_tokens_per_rank) or at least 1, got " + std::to_string(p.capacity));
  // Positions are 32-bit on the device, and the local runner takes fewer than 2^31 slots.
  constexpr std::int64_t int32_limit = std::int64_t{1} << 31;
  const std::int64_t slots = p.mode == ep_mode::low_latency ? ll.capacity : p.max_tokens_per_rank;
  MOE_EXPECT(p.max_tokens_per_rank < int32_limit / r && slots < int32_limit / r / top_k, where,
             "max_tokens_per_rank (and capacity) times world_size times top_k must stay below 2^31");

  ep_buffer_layout l;
  l.mode = p.mode;
  l.world_size = r;
  l.top_k = top_k;
  l.hidden = hidden;
  l.row_bytes = ll.row_bytes;
  l.max_tokens = p.max_tokens_per_rank;
  l.slots = slots;
  switch (p.mode) {
    case ep_mode::throughput: l.send_slots = p.max_tokens_per_rank * std::min(r, top_k); break;
    case ep_mode::low_latency: l.send_slots = r * ll.capacity; break;
    case ep_mode::allgather: l.send_slots = 0; break;
  }
  l.back_rows = p.mode == ep_mode::allgather ? p.max_tokens_per_rank : l.send_slots;

  std::size_t at = 0;
  const auto piece = [&at](std::int64_t count, std::size_t elem) {
    const std::size_t start = at;
    at += (static_cast<std::size_t>(count) * elem + 255) / 256 * 256;
    return start;
  };
  const std::int64_t recv = l.recv_capacity(), meta = l.meta_words();
  if (p.mode != ep_mode::allgather) {
    l.send_pos = piece(p.max_tokens_per_rank * r, 4);
    l.send_token = piece(p.max_tokens_per_rank * r, 4);
    l.counts = piece(2 * r, 8);
    l.send_rows = piece(l.send_slots, static_cast<std::size_t>(l.row_bytes));
    l.send_meta = piece(l.send_slots * meta, 4);
  }
  l.recv_rows = piece(recv, static_cast<std::size_t>(l.row_bytes));
  l.recv_meta = piece(recv * meta, 4);
  l.ids = piece(recv * top_k, 4);
  l.weights = piece(recv * top_k, 4);
  l.back = piece(l.back_rows, static_cast<std::size_t>(l.row_bytes));
  l.bytes = at;
  return l;
}

}  // namespace moerunner
