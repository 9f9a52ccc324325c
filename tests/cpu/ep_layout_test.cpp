// Expert-parallel dispatch arithmetic (dispatch/ep_layout.hpp): the topology's checks, the
// send and receive layouts on a worked example, and a world of R ranks simulated on the host
// with the reference backend per rank, whose outputs must equal one rank running every expert.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "moerunner/dispatch/ep_layout.hpp"
#include "moerunner/moerunner.hpp"

namespace mr = moerunner;

TEST_CASE("ep topology: owners, local ids, and a communicator that does not divide the experts") {
  const mr::ep_topology t{.world_size = 4, .rank = 2, .num_experts = 16};
  t.validate("test");
  CHECK(t.experts_per_rank() == 4);
  CHECK(t.owner(0) == 0);
  CHECK(t.owner(9) == 2);
  CHECK(t.local_id(9) == 1);
  CHECK(t.local_on_me(9) == 1);
  CHECK(t.local_on_me(4) == -1);
  CHECK(t.local_on_me(-1) == -1);
  CHECK(t.local_on_me(16) == -1);
  CHECK_THROWS_WITH_AS((mr::ep_topology{.world_size = 3, .rank = 0, .num_experts = 8}.validate("ep")),
                       doctest::Contains("does not divide the experts (8)"), mr::invalid_argument_error);
  CHECK_THROWS_AS((mr::ep_topology{.world_size = 2, .rank = 2, .num_experts = 8}.validate("ep")),
                  mr::invalid_argument_error);
  CHECK_THROWS_AS((mr::ep_topology{.world_size = 0, .rank = 0, .num_experts = 8}.validate("ep")),
                  mr::invalid_argument_error);
}

TEST_CASE("ep send layout: a token goes once to each rank owning one of its experts, in token order") {
  const mr::ep_topology t{.world_size = 2, .rank = 0, .num_experts = 4};
  // Ranks own experts {0, 1} and {2, 3}; id 7 is out of range and sends nothing.
  const std::vector<std::int32_t> ids = {0, 1,   // token 0: rank 0
                                         0, 3,   // token 1: ranks 0 and 1
                                         2, 3,   // token 2: rank 1 (once)
                                         -1, 2,  // token 3: rank 1
                                         -1, 7,  // token 4: nowhere
                                         1, 1};  // token 5: rank 0 (once)
  const mr::ep_send_layout s = mr::make_ep_send_layout(ids.data(), 6, 2, t);
  CHECK(s.counts == std::vector<std::int64_t>{3, 3});
  CHECK(s.offsets == std::vector<std::int64_t>{0, 3, 6});
  CHECK(s.token == std::vector<std::int64_t>{0, 1, 5, 1, 2, 3});
  const mr::ep_recv_layout r = mr::make_ep_recv_layout({3, 5});
  CHECK(r.offsets == std::vector<std::int64_t>{0, 3, 8});
  CHECK(r.total() == 8);
  CHECK(mr::make_ep_send_layout(ids.data(), 0, 2, t).total() == 0);
}

TEST_CASE("ep low-latency buffers are sized from the config") {
  const mr::ep_topology t{.world_size = 8, .rank = 3, .num_experts = 256};
  const mr::ep_low_latency_size s = mr::make_ep_low_latency_size(128, 7168, 2, t);
  CHECK(s.capacity == 128);
  CHECK(s.buffer_bytes() == 8LL * 128 * 7168 * 2);
  CHECK(mr::make_ep_low_latency_size(128, 7168, 2, t, 32).capacity == 32);
  CHECK_THROWS_AS(mr::make_ep_low_latency_size(-1, 7168, 2, t), mr::invalid_argument_error);
}

namespace {

struct layer {
  int e, k, h, inter;
  std::vector<float> w13, w2;  // all experts
};

// One rank's tokens through the reference with experts [first, first + count) of the layer,
// ids already local to that range.
std::vector<float> run_reference(const layer& l, int first, int count, const std::vector<float>& x,
                                 const std::vector<std::int32_t>& ids, const std::vector<float>& weights,
                                 std::int64_t m) {
  const auto host = mr::memory_space::host;
  // The layer's E experts, `count` of them local (ids in [0, count), -1 elsewhere).
  const mr::MoeRunnerConfig cfg({.num_experts = l.e, .num_local_experts = count, .hidden_size = l.h,
                                 .intermediate_size = l.inter, .top_k = l.k, .routed_scaling_factor = 1.5f});
  mr::MoeRunner<mr::reference_policy> runner("reference", cfg);
  std::vector<float> out(static_cast<std::size_t>(m) * l.h, NAN);
  const std::size_t per13 = static_cast<std::size_t>(2) * l.inter * l.h, per2 = static_cast<std::size_t>(l.h) * l.inter;
  const mr::unquantized_quant_info q{
      mr::tensor_view::contiguous(const_cast<float*>(l.w13.data() + first * per13), mr::dtype::f32,
                                  {count, 2 * l.inter, l.h}, host),
      mr::tensor_view::contiguous(const_cast<float*>(l.w2.data() + first * per2), mr::dtype::f32, {count, l.h, l.inter},
                                  host)};
  const mr::DispatchOutput d{
      mr::tensor_view::contiguous(const_cast<float*>(x.data()), mr::dtype::f32, {m, l.h}, host),
      {},
      {mr::tensor_view::contiguous(const_cast<float*>(weights.data()), mr::dtype::f32, {m, l.k}, host),
       mr::tensor_view::contiguous(const_cast<std::int32_t*>(ids.data()), mr::dtype::i32, {m, l.k}, host), false}};
  runner.run(d, q, mr::tensor_view::contiguous(out.data(), mr::dtype::f32, {m, l.h}, host), {}, {});
  return out;
}

}  // namespace

TEST_CASE("a simulated world of R ranks gives each token what one rank running every expert gives") {
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  layer l{.e = 8, .k = 3, .h = 64, .inter = 32, .w13 = {}, .w2 = {}};
  l.w13.resize(static_cast<std::size_t>(l.e) * 2 * l.inter * l.h);
  l.w2.resize(static_cast<std::size_t>(l.e) * l.h * l.inter);
  for (float& v : l.w13) v = u(rng) / 8.0f;
  for (float& v : l.w2) v = u(rng) / 6.0f;
  for (int world : {1, 2, 4, 8}) {
    CAPTURE(world);
    // Each rank's own tokens and routing (some slots -1; duplicates across slots allowed).
    std::vector<std::int64_t> tokens(world);
    std::vector<std::vector<float>> x(world), weights(world);
    std::vector<std::vector<std::int32_t>> ids(world);
    std::uniform_int_distribution<int> expert(-1, l.e - 1);
    for (int r = 0; r < world; ++r) {
      tokens[r] = 5 + 7 * r;
      x[r].resize(static_cast<std::size_t>(tokens[r]) * l.h);
      for (float& v : x[r]) v = u(rng);
      ids[r].resize(static_cast<std::size_t>(tokens[r]) * l.k);
      weights[r].resize(ids[r].size());
      for (auto& id : ids[r]) id = expert(rng);
      for (float& w : weights[r]) w = 0.5f + 0.5f * u(rng);
    }
    // Dispatch: each source's layout; receivers take rows from every source in rank order.
    std::vector<mr::ep_send_layout> sends;
    for (int r = 0; r < world; ++r)
      sends.push_back(mr::make_ep_send_layout(ids[r].data(), tokens[r], l.k,
                                              mr::ep_topology{.world_size = world, .rank = r, .num_experts = l.e}));
    std::vector<std::vector<std::vector<float>>> parts(world);  // parts[source][dest]: rows in send order
    for (int d = 0; d < world; ++d) {
      const mr::ep_topology me{.world_size = world, .rank = d, .num_experts = l.e};
      std::vector<std::int64_t> counts(world);
      for (int s = 0; s < world; ++s) counts[s] = sends[s].counts[d];
      const mr::ep_recv_layout recv = mr::make_ep_recv_layout(counts);
      std::vector<float> rx(static_cast<std::size_t>(recv.total()) * l.h), rw(recv.total() * l.k);
      std::vector<std::int32_t> rid(recv.total() * l.k);
      for (int s = 0; s < world; ++s)
        for (std::int64_t i = 0; i < counts[s]; ++i) {
          const std::int64_t tok = sends[s].token[sends[s].offsets[d] + i], at = recv.offsets[s] + i;
          std::copy_n(x[s].begin() + tok * l.h, l.h, rx.begin() + at * l.h);
          for (int j = 0; j < l.k; ++j) {
            rid[at * l.k + j] = me.local_on_me(ids[s][tok * l.k + j]);
            rw[at * l.k + j] = weights[s][tok * l.k + j];
          }
        }
      const std::vector<float> out =
          run_reference(l, d * me.experts_per_rank(), me.experts_per_rank(), rx, rid, rw, recv.total());
      for (int s = 0; s < world; ++s)
        parts[s].emplace_back(out.begin() + recv.offsets[s] * l.h, out.begin() + recv.offsets[s + 1] * l.h);
    }
    // Combine at each source: the parts of every destination, in rank order.
    for (int s = 0; s < world; ++s) {
      std::vector<double> got(static_cast<std::size_t>(tokens[s]) * l.h, 0.0);
      for (int d = 0; d < world; ++d)
        for (std::int64_t i = 0; i < sends[s].counts[d]; ++i) {
          const std::int64_t tok = sends[s].token[sends[s].offsets[d] + i];
          for (int c = 0; c < l.h; ++c) got[tok * l.h + c] += parts[s][d][i * l.h + c];
        }
      const std::vector<float> want = run_reference(l, 0, l.e, x[s], ids[s], weights[s], tokens[s]);
      double worst = 0.0;
      for (std::size_t i = 0; i < want.size(); ++i) worst = std::max(worst, std::fabs(got[i] - want[i]));
      CHECK_MESSAGE(worst <= 1e-5, "rank ", s, " of ", world, ": max abs diff ", worst);
    }
  }
}
