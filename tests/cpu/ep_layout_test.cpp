// Expert-parallel dispatch (dispatch/ep_layout.hpp, ep_host_dispatcher.hpp): the topology's
// checks, the send and receive layouts on a worked example, and worlds of R ranks on threads,
// each running the reference backend on its experts between dispatch and combine, whose outputs
// must equal one rank running every expert.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "moerunner/dispatch/ep_host_dispatcher.hpp"
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

TEST_CASE("ep host dispatcher: R ranks on threads give each token what one rank running every expert gives") {
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  layer l{.e = 8, .k = 3, .h = 64, .inter = 32, .w13 = {}, .w2 = {}};
  l.w13.resize(static_cast<std::size_t>(l.e) * 2 * l.inter * l.h);
  l.w2.resize(static_cast<std::size_t>(l.e) * l.h * l.inter);
  for (float& v : l.w13) v = u(rng) / 8.0f;
  for (float& v : l.w2) v = u(rng) / 6.0f;
  for (int world : {1, 2, 4, 8}) {
    CAPTURE(world);
    // Each rank's own tokens and routing (some slots -1, repeated experts allowed).
    std::vector<std::int64_t> tokens(world);
    std::vector<std::vector<float>> x(world), weights(world), got(world);
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
      got[r].assign(x[r].size(), NAN);
    }
    mr::ep_host_world comm(world);
    std::vector<std::string> errors(world);
    std::vector<std::thread> ranks;
    for (int r = 0; r < world; ++r)
      ranks.emplace_back([&, r] {
        try {
          const auto host = mr::memory_space::host;
          const int local = l.e / world;
          const mr::MoeRunnerConfig cfg({.num_experts = l.e, .num_local_experts = local, .hidden_size = l.h,
                                         .intermediate_size = l.inter, .top_k = l.k, .routed_scaling_factor = 1.5f});
          mr::ep_host_dispatcher disp(comm, r, cfg);
          const mr::DispatchOutput d = disp.dispatch(
              mr::tensor_view::contiguous(x[r].data(), mr::dtype::f32, {tokens[r], l.h}, host),
              {mr::tensor_view::contiguous(weights[r].data(), mr::dtype::f32, {tokens[r], l.k}, host),
               mr::tensor_view::contiguous(ids[r].data(), mr::dtype::i32, {tokens[r], l.k}, host), false});
          const std::int64_t rows = d.num_tokens();
          std::vector<float> parts(static_cast<std::size_t>(rows) * l.h, NAN);
          const std::size_t per13 = static_cast<std::size_t>(2) * l.inter * l.h, per2 = std::size_t(l.h) * l.inter;
          const mr::unquantized_quant_info q{
              mr::tensor_view::contiguous(l.w13.data() + r * local * per13, mr::dtype::f32, {local, 2 * l.inter, l.h},
                                          host),
              mr::tensor_view::contiguous(l.w2.data() + r * local * per2, mr::dtype::f32, {local, l.h, l.inter}, host)};
          mr::MoeRunner<mr::reference_policy> runner("reference", cfg);
          const mr::CombineInput c =
              runner.run(d, q, mr::tensor_view::contiguous(parts.data(), mr::dtype::f32, {rows, l.h}, host), {}, {});
          disp.combine(c, mr::tensor_view::contiguous(got[r].data(), mr::dtype::f32, {tokens[r], l.h}, host));
        } catch (const std::exception& e) {
          errors[r] = e.what();
        }
      });
    for (auto& t : ranks) t.join();
    for (int r = 0; r < world; ++r) {
      CHECK_MESSAGE(errors[r].empty(), "rank ", r, ": ", errors[r]);
      const std::vector<float> want = run_reference(l, 0, l.e, x[r], ids[r], weights[r], tokens[r]);
      double worst = 0.0;
      for (std::size_t i = 0; i < want.size(); ++i) worst = std::max(worst, double(std::fabs(got[r][i] - want[i])));
      CHECK_MESSAGE(worst <= 1e-5, "rank ", r, " of ", world, ": max abs diff ", worst);
    }
  }
}

TEST_CASE("ep host dispatcher: a config whose local experts are not E / R is refused") {
  mr::ep_host_world comm(2);
  const mr::MoeRunnerConfig cfg({.num_experts = 8, .hidden_size = 64, .intermediate_size = 32, .top_k = 2});
  CHECK_THROWS_WITH_AS(mr::ep_host_dispatcher(comm, 0, cfg), doctest::Contains("num_local_experts must be"),
                       mr::invalid_argument_error);
  mr::ep_host_world three(3);
  const mr::MoeRunnerConfig cfg8({.num_experts = 8, .num_local_experts = 2, .hidden_size = 64,
                                  .intermediate_size = 32, .top_k = 2});
  CHECK_THROWS_WITH_AS(mr::ep_host_dispatcher(three, 0, cfg8), doctest::Contains("does not divide"),
                       mr::invalid_argument_error);
}
