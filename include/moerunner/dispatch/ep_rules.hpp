// The per-row rules of expert-parallel dispatch on the GPU, shared by its kernels
// (kernels/kernel_ep.cuh) and the host tests that check them against dispatch/ep_layout.hpp.
//
// Buffers are laid out by peer: peer p's rows start at base[p] and are kept up to
// ep_rows_kept(count[p], fixed_stride). With fixed_stride > 0 (low_latency: the capacity;
// allgather: max_tokens_per_rank) every peer has a slot of fixed_stride rows, base[p] =
// p * fixed_stride, and rows past it are left out; with fixed_stride == 0 (throughput) the peers'
// rows follow each other, base[p] = count[0] + ... + count[p - 1], as make_ep_recv_layout says.
#pragma once

#include <cstdint>

#include "moerunner/core/portable_math.hpp"
#include "moerunner/dispatch/ep_layout.hpp"

namespace moerunner {

// Whether a token with slots ids[0..k) goes to rank d: one of its ids is a valid expert of d
// (as make_ep_send_layout counts it: -1 and out-of-range ids send nothing).
MOERUNNER_HD inline bool ep_goes_to(const std::int32_t* ids, int k, const ep_topology& t, int d) {
  bool goes = false;
  for (int j = 0; j < k; ++j) {
    const int e = ids[j];
    goes = goes || (e >= 0 && e < t.num_experts && t.owner(e) == d);
  }
  return goes;
}

// Rows of a peer's `count` that travel.
MOERUNNER_HD inline std::int64_t ep_rows_kept(std::int64_t count, std::int64_t fixed_stride) {
  return fixed_stride > 0 && count > fixed_stride ? fixed_stride : count;
}

// base[p] for p in [0, peers); counts may be null where fixed_stride > 0.
MOERUNNER_HD inline void ep_peer_bases(const std::int64_t* counts, int peers, std::int64_t fixed_stride,
                                       std::int64_t* base) {
  std::int64_t sum = 0;
  for (int p = 0; p < peers; ++p) {
    base[p] = fixed_stride > 0 ? p * fixed_stride : sum;
    if (fixed_stride == 0) sum += counts[p];
  }
}

}  // namespace moerunner
