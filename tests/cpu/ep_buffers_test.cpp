// Expert parallelism on the GPU, its host side: the workspace layout of each mode
// (dispatch/ep_buffers.hpp), and the per-row rules its kernels use (dispatch/ep_rules.hpp)
// followed step by step on the host, as the kernels and the NCCL calls apply them, for worlds of
// 1-8 ranks: every token's row must reach exactly the ranks make_ep_send_layout names, in the
// order make_ep_recv_layout gives, and its parts must come back to it and nowhere else. Also the
// verdict the dispatcher's constructor reaches from every rank's agreement words
// (dispatch/ep_agreement.hpp).
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "moerunner/dispatch/ep_agreement.hpp"
#include "moerunner/dispatch/ep_buffers.hpp"
#include "moerunner/dispatch/ep_layout.hpp"
#include "moerunner/dispatch/ep_rules.hpp"

namespace mr = moerunner;

TEST_CASE("ep buffers: every piece of each mode aligned, apart and sized for the worst case") {
  // DeepSeek-V3 on two ranks: E = 256, k = 8, H = 7168, bf16.
  const mr::ep_topology t{.world_size = 2, .rank = 1, .num_experts = 256};
  for (mr::ep_mode mode : {mr::ep_mode::throughput, mr::ep_mode::low_latency, mr::ep_mode::allgather}) {
    CAPTURE(std::string(mr::ep_mode_name(mode)));
    const mr::ep_params p{.mode = mode, .max_tokens_per_rank = 4096};
    const mr::ep_buffer_layout l = mr::make_ep_buffer_layout(t, 8, 7168, mr::dtype::bf16, p, "test");
    CHECK(l.row_bytes == 7168 * 2);
    CHECK(l.slots == 4096);  // the default capacity never overflows
    CHECK(l.recv_capacity() == 2 * 4096);
    CHECK(l.send_slots == (mode == mr::ep_mode::allgather ? 0 : 2 * 4096));  // min(R, k) = 2 per token
    CHECK(l.back_rows == (mode == mr::ep_mode::allgather ? 4096 : l.send_slots));
    struct piece {
      std::size_t at, bytes;
    };
    const std::int64_t recv = l.recv_capacity();
    std::vector<piece> pieces = {{l.recv_rows, static_cast<std::size_t>(recv * l.row_bytes)},
                                 {l.recv_meta, static_cast<std::size_t>(recv * 16 * 4)},
                                 {l.ids, static_cast<std::size_t>(recv * 8 * 4)},
                                 {l.weights, static_cast<std::size_t>(recv * 8 * 4)},
                                 {l.back, static_cast<std::size_t>(l.back_rows * l.row_bytes)}};
    if (mode != mr::ep_mode::allgather) {
      pieces.push_back({l.send_pos, 4096 * 2 * 4});
      pieces.push_back({l.send_token, 4096 * 2 * 4});
      pieces.push_back({l.counts, 2 * 2 * 8});
      pieces.push_back({l.send_rows, static_cast<std::size_t>(l.send_slots * l.row_bytes)});
      pieces.push_back({l.send_meta, static_cast<std::size_t>(l.send_slots * 16 * 4)});
    }
    for (std::size_t a = 0; a < pieces.size(); ++a) {
      CAPTURE(a);
      CHECK(pieces[a].at % 256 == 0);
      CHECK(pieces[a].at + pieces[a].bytes <= l.bytes);
      for (std::size_t b = a + 1; b < pieces.size(); ++b)
        CHECK((pieces[a].at + pieces[a].bytes <= pieces[b].at || pieces[b].at + pieces[b].bytes <= pieces[a].at));
    }
  }
  const mr::ep_buffer_layout ll = mr::make_ep_buffer_layout(
      t, 8, 7168, mr::dtype::bf16, {.mode = mr::ep_mode::low_latency, .max_tokens_per_rank = 128, .capacity = 64},
      "test");
  CHECK(ll.slots == 64);
  CHECK(ll.send_slots == 2 * 64);
  CHECK(ll.recv_capacity() == 2 * 64);
}

TEST_CASE("ep buffers: what cannot be served is refused with the call named") {
  const mr::ep_topology t{.world_size = 2, .rank = 0, .num_experts = 16};
  const mr::ep_params p{.mode = mr::ep_mode::throughput, .max_tokens_per_rank = 64};
  const auto make = [](const mr::ep_topology& topo, const mr::ep_params& q, mr::dtype type = mr::dtype::bf16) {
    return mr::make_ep_buffer_layout(topo, 4, 256, type, q, "ep_test");
  };
  CHECK_THROWS_WITH_AS(make({.world_size = 3, .rank = 0, .num_experts = 16}, p),
                       doctest::Contains("ep_test: the communicator's size (3) does not divide the experts (16)"),
                       mr::invalid_argument_error);
  CHECK_THROWS_WITH_AS(make({.world_size = 128, .rank = 0, .num_experts = 256}, p),
                       doctest::Contains("world_size must be at most 64"), mr::invalid_argument_error);
  CHECK_THROWS_WITH_AS(make(t, p, mr::dtype::i32), doctest::Contains("dtype must be f32, f16 or bf16"),
                       mr::invalid_argument_error);
  CHECK_THROWS_WITH_AS(make(t, {.mode = mr::ep_mode::throughput, .max_tokens_per_rank = 0}),
                       doctest::Contains("max_tokens_per_rank must be at least 1"), mr::invalid_argument_error);
  CHECK_THROWS_WITH_AS(make(t, {.mode = mr::ep_mode::allgather, .max_tokens_per_rank = 8, .capacity = 4}),
                       doctest::Contains("capacity is a low_latency setting"), mr::invalid_argument_error);
  CHECK_THROWS_WITH_AS(make(t, {.mode = mr::ep_mode::low_latency, .max_tokens_per_rank = 8, .capacity = 0}),
                       doctest::Contains("capacity must be -1 (max_tokens_per_rank) or at least 1"),
                       mr::invalid_argument_error);
  CHECK_THROWS_WITH_AS(make(t, {.mode = static_cast<mr::ep_mode>(7), .max_tokens_per_rank = 8}),
                       doctest::Contains("mode must be throughput, low_latency or allgather"),
                       mr::invalid_argument_error);
  CHECK_THROWS_WITH_AS(make(t, {.mode = mr::ep_mode::allgather, .max_tokens_per_rank = std::int64_t{1} << 30}),
                       doctest::Contains("must stay below 2^31"), mr::invalid_argument_error);
}

namespace {

// A row as it travels: which rank's token it is.
struct tag {
  int rank = -1;
  std::int64_t token = -1;
  bool operator==(const tag&) const = default;
};

}  // namespace

TEST_CASE("ep agreement: every rank's verdict is the same, naming the first rank that failed or differs") {
  const mr::ep_topology t{.world_size = 4, .rank = 0, .num_experts = 64};
  const mr::ep_params p{.mode = mr::ep_mode::low_latency, .max_tokens_per_rank = 128};
  const mr::ep_buffer_layout l = mr::make_ep_buffer_layout(t, 6, 2048, mr::dtype::bf16, p, "test");
  const mr::ep_agreement same = mr::make_ep_agreement(64, mr::dtype::bf16, l);
  std::vector<mr::ep_agreement> all(4, same);
  CHECK_NOTHROW(mr::check_ep_agreement(all, "where"));
  CHECK_NOTHROW(mr::check_ep_agreement(std::vector<mr::ep_agreement>{same}, "where"));

  // capacity -1 means max_tokens_per_rank: the same layout, so the same words.
  const mr::ep_params explicit_capacity{.mode = mr::ep_mode::low_latency, .max_tokens_per_rank = 128, .capacity = 128};
  all[3] = mr::make_ep_agreement(64, mr::dtype::bf16,
                                 mr::make_ep_buffer_layout(t, 6, 2048, mr::dtype::bf16, explicit_capacity, "test"));
  CHECK_NOTHROW(mr::check_ep_agreement(all, "where"));

  // Each difference is named with its rank and both values.
  const auto differs = [&](int rank, const mr::ep_agreement& a, const std::string& message) {
    std::vector<mr::ep_agreement> v(4, same);
    v[static_cast<std::size_t>(rank)] = a;
    CHECK_THROWS_WITH_AS(mr::check_ep_agreement(v, "where"), ("where: " + message).c_str(),
                         mr::invalid_argument_error);
  };
  const std::string tail = ": every rank builds its dispatcher with the same config, dtype and ep_params";
  const auto layout_with = [&](mr::ep_params q, int top_k, int hidden, mr::dtype type) {
    return mr::make_ep_buffer_layout(t, top_k, hidden, type, q, "test");
  };
  differs(2, mr::make_ep_agreement(128, mr::dtype::bf16, l), "rank 2 was built with num_experts 128, rank 0 with 64" + tail);
  differs(1, mr::make_ep_agreement(64, mr::dtype::bf16, layout_with(p, 8, 2048, mr::dtype::bf16)),
          "rank 1 was built with top_k 8, rank 0 with 6" + tail);
  differs(3, mr::make_ep_agreement(64, mr::dtype::bf16, layout_with(p, 6, 4096, mr::dtype::bf16)),
          "rank 3 was built with hidden_size 4096, rank 0 with 2048" + tail);
  differs(1, mr::make_ep_agreement(64, mr::dtype::f16, layout_with(p, 6, 2048, mr::dtype::f16)),
          "rank 1 was built with dtype f16, rank 0 with bf16" + tail);
  differs(1, mr::make_ep_agreement(64, mr::dtype::bf16, layout_with({.mode = mr::ep_mode::allgather, .max_tokens_per_rank = 128}, 6, 2048, mr::dtype::bf16)),
          "rank 1 was built with mode allgather, rank 0 with low_latency" + tail);
  differs(2, mr::make_ep_agreement(64, mr::dtype::bf16, layout_with({.mode = mr::ep_mode::low_latency, .max_tokens_per_rank = 256}, 6, 2048, mr::dtype::bf16)),
          "rank 2 was built with max_tokens_per_rank 256, rank 0 with 128" + tail);
  differs(2, mr::make_ep_agreement(64, mr::dtype::bf16, layout_with({.mode = mr::ep_mode::low_latency, .max_tokens_per_rank = 128, .capacity = 16}, 6, 2048, mr::dtype::bf16)),
          "rank 2 was built with capacity (rows per slot) 16, rank 0 with 128" + tail);

  // A rank whose own checks failed makes every rank throw, before any comparison: its words
  // are not a layout's.
  const std::string failed =
      "its own checks when building its dispatcher (its error says why); the dispatcher is built on every rank alike "
      "or on none";
  differs(3, mr::failed_ep_agreement(), "rank 3 failed " + failed);
  std::vector<mr::ep_agreement> first_failed(4, same);
  first_failed[0] = mr::failed_ep_agreement();
  CHECK_THROWS_WITH_AS(mr::check_ep_agreement(first_failed, "where"), ("where: rank 0 failed " + failed).c_str(),
                       mr::invalid_argument_error);
}

TEST_CASE("ep device rules: each row reaches the ranks make_ep_send_layout names and comes back to its token") {
  std::mt19937 rng(4321);
  const int e = 24, k = 3;
  for (int world : {1, 2, 3, 4, 8}) {
    for (mr::ep_mode mode : {mr::ep_mode::throughput, mr::ep_mode::low_latency, mr::ep_mode::allgather}) {
      for (std::int64_t capacity : {std::int64_t{-1}, std::int64_t{5}}) {
        if (capacity >= 0 && mode != mr::ep_mode::low_latency) continue;
        CAPTURE(world);
        CAPTURE(std::string(mr::ep_mode_name(mode)));
        CAPTURE(capacity);
        const std::int64_t max_tokens = 40;
        const mr::ep_params p{.mode = mode, .max_tokens_per_rank = max_tokens, .capacity = capacity};
        const mr::ep_buffer_layout lay =
            mr::make_ep_buffer_layout({world, 0, e}, k, 8, mr::dtype::bf16, p, "test");
        // fixed_stride as the dispatcher passes it: 0 in throughput, the slot size otherwise.
        const std::int64_t fixed = mode == mr::ep_mode::throughput ? 0 : lay.slots;
        std::vector<std::vector<std::int32_t>> ids(world);
        std::vector<std::int64_t> m(world);
        std::uniform_int_distribution<int> expert(-1, e);  // e itself is out of range: sends nothing
        for (int r = 0; r < world; ++r) {
          m[r] = (7 * r + 11) % (max_tokens + 1);
          ids[r].resize(static_cast<std::size_t>(m[r] * k));
          for (auto& id : ids[r]) id = expert(rng);
        }
        // Sender side: the scan kernel's lists (token order per destination), the counts.
        std::vector<std::vector<std::int32_t>> send_pos(world), send_token(world);
        std::vector<std::vector<std::int64_t>> counts(world, std::vector<std::int64_t>(world, 0));
        for (int s = 0; s < world; ++s) {
          const mr::ep_topology topo{world, s, e};
          send_pos[s].assign(static_cast<std::size_t>(m[s] * world), -1);
          send_token[s].assign(static_cast<std::size_t>(max_tokens * world), -1);
          for (int d = 0; d < world; ++d)
            for (std::int64_t t = 0; t < m[s]; ++t)
              if (mr::ep_goes_to(ids[s].data() + t * k, k, topo, d)) {
                send_pos[s][t * world + d] = static_cast<std::int32_t>(counts[s][d]);
                send_token[s][d * max_tokens + counts[s][d]++] = static_cast<std::int32_t>(t);
              }
          const mr::ep_send_layout want = mr::make_ep_send_layout(ids[s].data(), m[s], k, topo);
          CHECK(counts[s] == want.counts);
          for (int d = 0; d < world; ++d)
            for (std::int64_t i = 0; i < want.counts[d]; ++i)
              CHECK(send_token[s][d * max_tokens + i] == want.token[want.offsets[d] + i]);
        }
        // Receiver side: what lands in each rank's receive rows, placed by the rules.
        std::vector<std::vector<tag>> recv(world, std::vector<tag>(static_cast<std::size_t>(lay.recv_capacity())));
        std::vector<std::int64_t> rows(world);
        for (int d = 0; d < world; ++d) {
          std::vector<std::int64_t> got(world), base(world);
          for (int s = 0; s < world; ++s) got[s] = mode == mr::ep_mode::allgather ? max_tokens : counts[s][d];
          mr::ep_peer_bases(got.data(), world, fixed, base.data());
          if (mode == mr::ep_mode::throughput) {
            const std::vector<std::int64_t> offsets = mr::make_ep_recv_layout(got).offsets;
            CHECK(std::equal(base.begin(), base.end(), offsets.begin()));
          }
          for (int s = 0; s < world; ++s) {
            const std::int64_t kept = mr::ep_rows_kept(got[s], fixed);
            for (std::int64_t i = 0; i < kept; ++i) {
              const std::int64_t row = base[s] + i;
              REQUIRE(row < lay.recv_capacity());
              const std::int64_t token = mode == mr::ep_mode::allgather ? i : send_token[s][d * max_tokens + i];
              recv[d][row] = {s, mode == mr::ep_mode::allgather && i >= m[s] ? -1 : token};
            }
          }
          rows[d] = mode == mr::ep_mode::throughput ? base[world - 1] + got[world - 1] : lay.recv_capacity();
        }
        // The local runner sees a row's slots on its experts only; combine brings each part back.
        std::int64_t dropped = 0;
        for (int s = 0; s < world; ++s) {
          const mr::ep_send_layout want = mr::make_ep_send_layout(ids[s].data(), m[s], k, {world, s, e});
          std::vector<std::int64_t> base(world);
          mr::ep_peer_bases(counts[s].data(), world, mode == mr::ep_mode::throughput ? 0 : lay.slots, base.data());
          for (std::int64_t t = 0; t < m[s]; ++t)
            for (int d = 0; d < world; ++d) {
              const std::int32_t pos = send_pos[s][t * world + d];
              const bool sent = mr::ep_goes_to(ids[s].data() + t * k, k, {world, s, e}, d);
              CHECK((pos >= 0) == sent);
              if (mode == mr::ep_mode::allgather) {
                // The gathered row of every token sits at the source's slot on every rank.
                CHECK(recv[d][s * max_tokens + t] == tag{s, t});
                continue;
              }
              if (pos < 0) continue;
              if (pos >= mr::ep_rows_kept(counts[s][d], fixed)) {
                ++dropped;
                continue;
              }
              // d's receive rows for s start where the rule puts them; the part that comes back
              // sits at base[d] + pos in s's back buffer and belongs to t.
              std::vector<std::int64_t> got(world), rbase(world);
              for (int q = 0; q < world; ++q) got[q] = counts[q][d];
              mr::ep_peer_bases(got.data(), world, fixed, rbase.data());
              CHECK(recv[d][rbase[s] + pos] == tag{s, t});
              CHECK(want.token[want.offsets[d] + pos] == t);
              CHECK(base[d] + pos < lay.back_rows);
            }
        }
        if (capacity < 0) CHECK(dropped == 0);
        else CHECK(dropped > 0);
        for (int d = 0; d < world; ++d) CHECK(rows[d] <= lay.recv_capacity());
      }
    }
  }
}
