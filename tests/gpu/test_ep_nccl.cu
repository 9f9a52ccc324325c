// Expert parallelism through NCCL (ep_nccl_dispatcher) on a world of --world=N ranks, one GPU
// and one thread each, in one process: every mode against the same layer run on one GPU.
//
// The expected output of a rank's tokens is built from single-GPU runs of cuda_fused: for each
// rank d, d's experts over all of the rank's tokens with ids local to d (a part, zeros where
// none of its experts), then each token's parts of the ranks it is sent to summed in f32 in rank
// order and rounded once, as combine does. With batch_invariant a token's part has the same
// bits in any batch, so throughput and low_latency must match it bit for bit (with one rank:
// exactly the runner's own output); allgather's reduce-scatter sums in NCCL's order (bitwise
// too for one rank). Without batch_invariant the parts may differ in the last bit: a bound.
// Exits 77 (skipped) with fewer GPUs than ranks.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <nccl.h>

#include "gpu_test_util.hpp"
#include "moe_problem.hpp"
#include "moerunner/dispatch/ep_nccl_dispatcher.cuh"
#include "moerunner/moerunner.hpp"
#include "moerunner/policies/cuda_fused_policy.cuh"

namespace mr = moerunner;
using mr::test::device_buffer;
using mr::test::device_tensor;
using mr::test::host_tensor;

namespace {

int g_world = 1;  // --world=N

using runner_t = mr::MoeRunner<mr::cuda_fused_policy>;

struct layer {
  int e = 16, k = 4, h = 256, inter = 128;
  mr::dtype type = mr::dtype::bf16;
  host_tensor w13, w2;

  explicit layer(std::mt19937& rng) : w13(type, {e, 2 * inter, h}), w2(type, {e, h, inter}) {
    mr::test::fill_random(w13, rng, 2.0f / std::sqrt(static_cast<float>(h)));
    mr::test::fill_random(w2, rng, 2.0f / std::sqrt(static_cast<float>(inter)));
  }
  mr::MoeRunnerConfig config(int world, bool invariant) const {
    return mr::MoeRunnerConfig({.num_experts = e, .num_local_experts = e / world, .hidden_size = h,
                                .intermediate_size = inter, .top_k = k, .batch_invariant = invariant});
  }
  // Rank d's experts of w13 and w2, on the current device.
  std::pair<device_tensor, device_tensor> slice(int world, int d) const {
    const int n = e / world;
    host_tensor a(type, {n, 2 * inter, h}), b(type, {n, h, inter});
    std::memcpy(a.view.data, static_cast<const char*>(w13.view.data) + d * a.view.bytes(), a.view.bytes());
    std::memcpy(b.view.data, static_cast<const char*>(w2.view.data) + d * b.view.bytes(), b.view.bytes());
    return {device_tensor(a), device_tensor(b)};
  }
};

// One rank's tokens: softmax top-k of random logits, every fifth slot filtered and the middle
// token routed nowhere.
struct tokens {
  host_tensor x, weights, ids;
  tokens(const layer& l, std::int64_t m, std::mt19937& rng)
      : x(l.type, {m, l.h}), weights(mr::dtype::f32, {m, l.k}), ids(mr::dtype::i32, {m, l.k}) {
    mr::test::fill_random(x, rng, 1.0f);
    host_tensor logits(mr::dtype::f32, {m, l.e});
    mr::test::fill_random(logits, rng, 4.0f);
    mr::TopKOutput out{weights.view, ids.view};
    mr::reference::topk(logits.view, nullptr, {.top_k = l.k}, out);
    auto* id = ids.ptr<std::int32_t>();
    for (std::int64_t q = 0; q < m * l.k; ++q)
      if (q % 5 == 3 || q / l.k == m / 2) id[q] = -1;
  }
  std::int64_t m() const { return x.view.shape[0]; }
};

// Rank d's part of every token of `in`: its experts' runner (on the current device) over all
// of in's tokens with ids local to d.
host_tensor part(const layer& l, int world, int d, const tokens& in, bool invariant) {
  const std::int64_t m = in.m();
  host_tensor local = in.ids;
  const mr::ep_topology topo{world, d, l.e};
  for (std::int64_t q = 0; q < m * l.k; ++q) local.ptr<std::int32_t>()[q] = topo.local_on_me(in.ids.ptr<std::int32_t>()[q]);
  host_tensor out(l.type, {m, l.h});
  if (m == 0) return out;
  auto [w13, w2] = l.slice(world, d);
  const device_tensor x(in.x), w(in.weights), ids(local);
  device_tensor dout(out);
  runner_t runner("cuda_fused", l.config(world, invariant));
  device_buffer ws(runner.workspace_bytes(m));
  runner.run(mr::DispatchOutput{x.view, {}, {w.view, ids.view}}, mr::unquantized_quant_info{w13.view, w2.view},
             dout.view, {ws.get(), ws.bytes()}, cuda::stream_ref(cudaStream_t{}));
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  dout.to_host(out);
  return out;
}

// What combine must give for `in`: each token's parts of the ranks its rows reach (the first
// `capacity` of each rank's list where capacity >= 0), summed in f32 in rank order, rounded once.
host_tensor expected(const layer& l, int world, const tokens& in, const std::vector<host_tensor>& parts,
                     std::int64_t capacity = -1) {
  const std::int64_t m = in.m();
  const mr::ep_send_layout s = mr::make_ep_send_layout(in.ids.ptr<std::int32_t>(), m, l.k, {world, 0, l.e});
  std::vector<std::int64_t> pos(static_cast<std::size_t>(m * world), -1);
  for (int d = 0; d < world; ++d)
    for (std::int64_t i = 0; i < s.counts[d]; ++i) pos[s.token[s.offsets[d] + i] * world + d] = i;
  host_tensor out(l.type, {m, l.h});
  for (std::int64_t t = 0; t < m; ++t)
    for (int c = 0; c < l.h; ++c) {
      float acc = 0.0f;
      for (int d = 0; d < world; ++d) {
        const std::int64_t p = pos[t * world + d];
        if (p >= 0 && (capacity < 0 || p < capacity)) acc += mr::test::element(parts[d].view, t * l.h + c);
      }
      mr::test::set_element(out.view, t * l.h + c, acc);
    }
  return out;
}

// Status a low-latency dispatch of `in` must report with `capacity` rows per pair.
mr::ep_status expected_status(const layer& l, int world, const tokens& in, std::int64_t capacity) {
  const mr::ep_send_layout s = mr::make_ep_send_layout(in.ids.ptr<std::int32_t>(), in.m(), l.k, {world, 0, l.e});
  mr::ep_status st;
  for (int d = 0; d < world; ++d) {
    st.dropped_rows += static_cast<std::int32_t>(std::max<std::int64_t>(0, s.counts[d] - capacity));
    st.needed_capacity = std::max(st.needed_capacity, static_cast<std::int32_t>(s.counts[d]));
  }
  return st;
}

// Runs fn(rank, comm) on one thread per rank with that rank's GPU current; returns each rank's
// error message (empty when it finished).
template <class F>
std::vector<std::string> on_ranks(int world, F&& fn) {
  std::vector<ncclComm_t> comms(world);
  std::vector<int> devices(world);
  std::iota(devices.begin(), devices.end(), 0);
  MOE_NCCL_CHECK(ncclCommInitAll(comms.data(), world, devices.data()));
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        MOE_CUDA_CHECK(cudaSetDevice(r));
        fn(r, comms[r]);
        MOE_CUDA_CHECK(cudaDeviceSynchronize());
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (ncclComm_t c : comms) ncclCommDestroy(c);
  MOE_CUDA_CHECK(cudaSetDevice(0));
  return errors;
}

// One rank of an expert-parallel layer on the current device: its inputs, its experts, the
// dispatcher with a poisoned workspace (NaN rows would show in the output), the local runner.
struct ep_rank {
  const layer& l;
  int world;
  mr::ep_buffer_layout lay;
  device_buffer ws_buf;
  std::pair<device_tensor, device_tensor> w;
  device_tensor x, weights, ids;
  device_buffer out_buf, parts_buf, runner_ws;
  device_buffer status_buf{sizeof(mr::ep_status)};
  runner_t runner;
  std::optional<mr::ep_nccl_dispatcher> disp;

  ep_rank(const layer& l_, int world_, int rank, ncclComm_t comm, const tokens& in, const mr::ep_params& p,
          bool invariant)
      : l(l_),
        world(world_),
        lay(mr::ep_nccl_dispatcher::layout_for(world_, l_.config(world_, invariant), l_.type, p)),
        ws_buf(lay.bytes),
        w(l_.slice(world_, rank)),
        x(in.x),
        weights(in.weights),
        ids(in.ids),
        out_buf(in.x.view.bytes()),
        parts_buf(static_cast<std::size_t>(lay.recv_capacity()) * lay.row_bytes),
        runner("cuda_fused", l_.config(world_, invariant)) {
    ws_buf.poison();
    out_buf.poison();
    MOE_CUDA_CHECK(cudaMemset(status_buf.get(), 0, sizeof(mr::ep_status)));
    disp.emplace(comm, l.config(world, invariant), l.type, p, mr::workspace_view{ws_buf.get(), ws_buf.bytes()});
    reserve(lay.recv_capacity());
  }

  void reserve(std::int64_t rows) {
    const std::size_t need = runner.workspace_bytes(rows);
    if (need > runner_ws.bytes()) runner_ws = device_buffer(need);
  }
  mr::ep_status* status() const { return static_cast<mr::ep_status*>(status_buf.get()); }

  // dispatch, the local runner, combine: one layer, on stream s.
  void step(cudaStream_t s) {
    const mr::DispatchOutput d = disp->dispatch(x.view, {weights.view, ids.view}, cuda::stream_ref(s), status());
    reserve(d.num_tokens());  // throughput only: the other modes reserved their fixed rows
    const mr::tensor_view parts =
        mr::tensor_view::contiguous(parts_buf.get(), l.type, {d.num_tokens(), l.h}, mr::memory_space::device);
    const mr::CombineInput c = runner.run(d, mr::unquantized_quant_info{w.first.view, w.second.view}, parts,
                                          {runner_ws.get(), runner_ws.bytes()}, cuda::stream_ref(s));
    mr::tensor_view out = x.view;
    out.data = out_buf.get();
    disp->combine(c, out, cuda::stream_ref(s));
  }

  host_tensor output(const tokens& in) const {
    host_tensor h = in.x;
    if (h.view.bytes()) MOE_CUDA_CHECK(cudaMemcpy(h.view.data, out_buf.get(), h.view.bytes(), cudaMemcpyDeviceToHost));
    return h;
  }
  mr::ep_status read_status() const {
    mr::ep_status st;
    MOE_CUDA_CHECK(cudaMemcpy(&st, status_buf.get(), sizeof st, cudaMemcpyDeviceToHost));
    return st;
  }
};

std::int64_t tokens_of(int rank) { return 37 + 50 * rank; }

struct mode_case {
  mr::ep_params params;
  bool bitwise;  // combine's order is fixed: the expected bits exactly
};

std::vector<mode_case> every_mode(int world) {
  return {{{.mode = mr::ep_mode::throughput, .max_tokens_per_rank = 128}, true},
          {{.mode = mr::ep_mode::low_latency, .max_tokens_per_rank = 128}, true},
          {{.mode = mr::ep_mode::allgather, .max_tokens_per_rank = 128}, world == 1}};
}

bool same_bits(const host_tensor& a, const host_tensor& b) { return a.bytes() == b.bytes(); }

// A test's data: the layer and each rank's tokens, from the run's seed.
struct ep_case {
  int world = g_world;
  unsigned seed = mr::test::test_seed();
  std::mt19937 rng{seed};
  layer l{rng};
  std::vector<tokens> in;
  ep_case() {
    for (int r = 0; r < world; ++r) in.emplace_back(l, tokens_of(r), rng);
  }
};

// Every rank's expected output (the parts of the ranks its rows reach; capacity as in expected()).
std::vector<host_tensor> expected_all(const layer& l, int world, const std::vector<tokens>& in, bool invariant,
                                      std::int64_t capacity = -1) {
  std::vector<host_tensor> want;
  for (int r = 0; r < world; ++r) {
    std::vector<host_tensor> parts;
    for (int d = 0; d < world; ++d) parts.push_back(part(l, world, d, in[r], invariant));
    want.push_back(expected(l, world, in[r], parts, capacity));
    if (world == 1 && invariant && capacity < 0) CHECK(same_bits(want[r], parts[0]));  // the runner's own output
  }
  return want;
}

// What one layer on every rank gave: outputs, statuses, errors.
struct ranks_result {
  std::vector<host_tensor> out;
  std::vector<mr::ep_status> status;
  std::vector<std::string> errors;
};

ranks_result run_layer(const layer& l, int world, const std::vector<tokens>& in, const mr::ep_params& p,
                       bool invariant) {
  ranks_result res{std::vector<host_tensor>(world), std::vector<mr::ep_status>(world), {}};
  res.errors = on_ranks(world, [&](int r, ncclComm_t comm) {
    ep_rank er(l, world, r, comm, in[r], p, invariant);
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    er.step(nullptr);
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    res.out[r] = er.output(in[r]);
    res.status[r] = er.read_status();
  });
  return res;
}

// Every rank's output against its expected one: no error, as many rows, within the dtype's
// bound, the same bits where the combine order is fixed, no row dropped.
void check_ranks(const ranks_result& got, const std::vector<host_tensor>& want, mr::dtype type, bool bitwise) {
  for (std::size_t r = 0; r < want.size(); ++r) {
    CAPTURE(r);
    REQUIRE_MESSAGE(got.errors[r].empty(), got.errors[r]);
    CHECK(got.out[r].view.shape[0] == want[r].view.shape[0]);
    CHECK(mr::test::rel_error(got.out[r].view, want[r].view) <= mr::test::bound_for(type));
    if (bitwise) CHECK(same_bits(got.out[r], want[r]));
    CHECK(got.status[r].dropped_rows == 0);
  }
}

}  // namespace

TEST_CASE("ep send lists on the device: make_ep_send_layout's counts and token order") {
  const unsigned seed = mr::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  const layer l(rng);
  for (int world : {1, 2, 4, 16}) {
    CAPTURE(world);
    for (std::int64_t m : {0, 1, 1000, 2500}) {
      CAPTURE(m);
      tokens in(l, m, rng);
      if (m > 1) in.ids.ptr<std::int32_t>()[1] = 999;  // out of range: sends nothing, as on the host
      const mr::ep_topology topo{world, 0, l.e};
      const std::int64_t stride = 2500;
      const device_tensor ids(in.ids);
      device_buffer pos(static_cast<std::size_t>(stride) * world * 4), tok(static_cast<std::size_t>(stride) * world * 4),
          counts(static_cast<std::size_t>(world) * 8);
      pos.poison();
      tok.poison();
      mr::gpu::ep_send_positions(ids.view.ptr<std::int32_t>(), m, l.k, topo, static_cast<std::int32_t*>(pos.get()),
                                 static_cast<std::int32_t*>(tok.get()), stride, static_cast<std::int64_t*>(counts.get()),
                                 nullptr);
      MOE_CUDA_CHECK(cudaDeviceSynchronize());
      const mr::ep_send_layout s = mr::make_ep_send_layout(in.ids.ptr<std::int32_t>(), m, l.k, topo);
      const auto got_counts = counts.download<std::int64_t>(world);
      const auto got_pos = pos.download<std::int32_t>(static_cast<std::size_t>(m * world));
      const auto got_tok = tok.download<std::int32_t>(static_cast<std::size_t>(stride * world));
      CHECK(got_counts == s.counts);
      std::vector<std::int32_t> want_pos(static_cast<std::size_t>(m * world), -1);
      for (int d = 0; d < world; ++d)
        for (std::int64_t i = 0; i < s.counts[d]; ++i) {
          CHECK(got_tok[d * stride + i] == s.token[s.offsets[d] + i]);
          want_pos[s.token[s.offsets[d] + i] * world + d] = static_cast<std::int32_t>(i);
        }
      CHECK(got_pos == want_pos);
    }
  }
}

TEST_CASE("ep every mode: the same layer as one GPU runs it") {
  const ep_case c;
  const int world = c.world;
  const layer& l = c.l;
  const std::vector<tokens>& in = c.in;
  CAPTURE(c.seed);
  CAPTURE(world);
  for (bool invariant : {true, false}) {
    CAPTURE(invariant);
    const std::vector<host_tensor> want = expected_all(l, world, in, invariant);
    for (const mode_case& mc : every_mode(world)) {
      CAPTURE(std::string(mr::ep_mode_name(mc.params.mode)));
      check_ranks(run_layer(l, world, in, mc.params, invariant), want, l.type, invariant && mc.bitwise);
    }
  }
}

TEST_CASE("ep every mode: a rank without tokens, and every token on rank 0's experts") {
  // Rank 0 dispatches no tokens (its tensors empty, their data null); the others' tokens all
  // go to rank 0's experts, so every other rank receives nothing (zero-count pairs in
  // throughput, empty slots in low_latency).
  ep_case c;
  const int world = c.world;
  const layer& l = c.l;
  CAPTURE(c.seed);
  CAPTURE(world);
  const int local = l.e / world;
  REQUIRE(local >= l.k);  // distinct experts of rank 0 for each token's k slots
  std::vector<tokens> in;
  for (int r = 0; r < world; ++r) {
    in.emplace_back(l, r == 0 ? 0 : tokens_of(r), c.rng);
    auto* id = in[r].ids.ptr<std::int32_t>();
    for (std::int64_t t = 0; t < in[r].m(); ++t)
      for (int j = 0; j < l.k; ++j)
        if (id[t * l.k + j] >= 0) id[t * l.k + j] = static_cast<std::int32_t>((t + j) % local);
  }
  const std::vector<host_tensor> want = expected_all(l, world, in, true);
  for (const mode_case& mc : every_mode(world)) {
    CAPTURE(std::string(mr::ep_mode_name(mc.params.mode)));
    check_ranks(run_layer(l, world, in, mc.params, true), want, l.type, mc.bitwise);
  }
}

TEST_CASE("ep low_latency: a full slot drops rows, reports them, and writes nothing else") {
  const ep_case c;
  const int world = c.world;
  const layer& l = c.l;
  const std::vector<tokens>& in = c.in;
  CAPTURE(c.seed);
  CAPTURE(world);
  constexpr std::int64_t capacity = 8;
  const std::vector<host_tensor> want = expected_all(l, world, in, true, capacity);
  const mr::ep_params p{.mode = mr::ep_mode::low_latency, .max_tokens_per_rank = 128, .capacity = capacity};
  const ranks_result got = run_layer(l, world, in, p, true);
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    REQUIRE_MESSAGE(got.errors[r].empty(), got.errors[r]);
    const mr::ep_status st = expected_status(l, world, in[r], capacity);
    CHECK(st.dropped_rows > 0);
    CHECK(same_bits(got.out[r], want[r]));
    CHECK(got.status[r].dropped_rows == st.dropped_rows);
    CHECK(got.status[r].needed_capacity == st.needed_capacity);
  }
}

TEST_CASE("ep low_latency and allgather: captured once in a CUDA graph, replayed on new inputs") {
  ep_case c;
  const int world = c.world;
  const layer& l = c.l;
  CAPTURE(c.seed);
  CAPTURE(world);
  constexpr int replays = 3;
  std::vector<std::vector<tokens>> in{c.in};  // [replay][rank], the same token counts
  std::vector<std::vector<host_tensor>> want;
  for (int i = 0; i < replays; ++i) {
    if (i > 0) {
      in.emplace_back();
      for (int r = 0; r < world; ++r) in[i].emplace_back(l, tokens_of(r), c.rng);
    }
    want.push_back(expected_all(l, world, in[i], true));
  }
  for (const mode_case& mc : every_mode(world)) {
    if (mc.params.mode == mr::ep_mode::throughput) continue;
    CAPTURE(std::string(mr::ep_mode_name(mc.params.mode)));
    std::vector<std::vector<host_tensor>> got(replays, std::vector<host_tensor>(world));
    const auto errors = on_ranks(world, [&](int r, ncclComm_t comm) {
      ep_rank er(l, world, r, comm, in[0][r], mc.params, true);
      cudaStream_t s = nullptr;
      MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      MOE_CUDA_CHECK(cudaDeviceSynchronize());
      // One eager layer first: NCCL sets up its connections at a pair's first send, which is
      // better done outside a capture.
      er.step(s);
      MOE_CUDA_CHECK(cudaStreamSynchronize(s));
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      MOE_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      try {
        er.step(s);
      } catch (...) {
        cudaStreamEndCapture(s, &graph);
        throw;
      }
      MOE_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
      MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      for (int i = 0; i < replays; ++i) {
        // New inputs in the captured buffers.
        MOE_CUDA_CHECK(cudaMemcpy(er.x.buf.get(), in[i][r].x.view.data, in[i][r].x.view.bytes(), cudaMemcpyHostToDevice));
        MOE_CUDA_CHECK(cudaMemcpy(er.weights.buf.get(), in[i][r].weights.view.data, in[i][r].weights.view.bytes(),
                                  cudaMemcpyHostToDevice));
        MOE_CUDA_CHECK(cudaMemcpy(er.ids.buf.get(), in[i][r].ids.view.data, in[i][r].ids.view.bytes(),
                                  cudaMemcpyHostToDevice));
        er.out_buf.poison();
        MOE_CUDA_CHECK(cudaDeviceSynchronize());  // s does not wait for the legacy stream's copies
        MOE_CUDA_CHECK(cudaGraphLaunch(exec, s));
        MOE_CUDA_CHECK(cudaStreamSynchronize(s));
        got[i][r] = er.output(in[i][r]);
      }
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      cudaStreamDestroy(s);
    });
    for (int r = 0; r < world; ++r) {
      CAPTURE(r);
      REQUIRE_MESSAGE(errors[r].empty(), errors[r]);
      for (int i = 0; i < replays; ++i) {
        CAPTURE(i);
        CHECK(mr::test::rel_error(got[i][r].view, want[i][r].view) <= mr::test::bound_for(l.type));
        if (mc.bitwise) CHECK(same_bits(got[i][r], want[i][r]));
      }
    }
  }
}

TEST_CASE("ep construction: ranks built differently, or one whose checks fail, make every rank throw") {
  const int world = g_world;
  std::mt19937 rng(11);
  const layer l(rng);
  const mr::MoeRunnerConfig cfg = l.config(world, false);
  const auto build = [&](ncclComm_t comm, const mr::ep_params& p, std::size_t shortfall) {
    const mr::ep_buffer_layout lay = mr::ep_nccl_dispatcher::layout_for(world, cfg, l.type, p);
    device_buffer ws(lay.bytes);
    mr::ep_nccl_dispatcher disp(comm, cfg, l.type, p, {ws.get(), lay.bytes - shortfall});
  };
  // Built alike (capacity -1 on some ranks, its value spelled out on others), every rank goes on.
  std::vector<std::string> errors = on_ranks(world, [&](int rank, ncclComm_t comm) {
    build(comm, {.mode = mr::ep_mode::low_latency, .max_tokens_per_rank = 64, .capacity = rank % 2 ? 64 : -1}, 0);
  });
  for (int r = 0; r < world; ++r) CHECK(errors[r].empty());
  if (world < 2) {
    MESSAGE("one rank: no other rank to differ from");
    return;
  }
  // The last rank asks for more tokens per rank than the others: every rank names it.
  const int last = world - 1;
  errors = on_ranks(world, [&](int rank, ncclComm_t comm) {
    build(comm, {.mode = mr::ep_mode::low_latency, .max_tokens_per_rank = rank == last ? 96 : 64}, 0);
  });
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK(errors[r].find("rank " + std::to_string(last) + " was built with max_tokens_per_rank 96, rank 0 with 64") !=
          std::string::npos);
  }
  // The last rank's workspace is a byte short: it throws its own error, the others name it.
  errors = on_ranks(world, [&](int rank, ncclComm_t comm) {
    build(comm, {.mode = mr::ep_mode::throughput, .max_tokens_per_rank = 64}, rank == last ? 1 : 0);
  });
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK(errors[r].find(r == last ? "the workspace has" : "rank " + std::to_string(last) + " failed its own checks") !=
          std::string::npos);
  }
}

TEST_CASE("ep errors: the call and the argument named, nothing run") {
  std::mt19937 rng(7);
  const layer l(rng);
  const mr::ep_params tp{.mode = mr::ep_mode::throughput, .max_tokens_per_rank = 64};
  using mr::ep_nccl_dispatcher;
  // A communicator size that does not divide the experts, and a local runner of another size.
  CHECK_THROWS_WITH_AS(ep_nccl_dispatcher::layout_for(3, l.config(1, false), l.type, tp),
                       doctest::Contains("does not divide the experts (16)"), mr::invalid_argument_error);
  CHECK_THROWS_WITH_AS(ep_nccl_dispatcher::layout_for(2, l.config(1, false), l.type, tp),
                       doctest::Contains("num_local_experts must be num_experts / world size = 8"),
                       mr::invalid_argument_error);
  CHECK_THROWS_WITH_AS(ep_nccl_dispatcher::layout_for(1, l.config(1, false), mr::dtype::i32, tp),
                       doctest::Contains("dtype must be f32, f16 or bf16"), mr::invalid_argument_error);
  CHECK_THROWS_WITH_AS(ep_nccl_dispatcher::layout_for(1, l.config(1, false), l.type,
                                                      {.mode = mr::ep_mode::throughput, .max_tokens_per_rank = 64,
                                                       .capacity = 8}),
                       doctest::Contains("capacity is a low_latency setting"), mr::invalid_argument_error);
  CHECK_THROWS_WITH_AS(ep_nccl_dispatcher::layout_for(1, l.config(1, false), l.type,
                                                      {.mode = mr::ep_mode::low_latency, .max_tokens_per_rank = 64,
                                                       .capacity = 0}),
                       doctest::Contains("capacity must be -1"), mr::invalid_argument_error);

  ncclComm_t comm = nullptr;
  int dev = 0;
  MOE_NCCL_CHECK(ncclCommInitAll(&comm, 1, &dev));
  const mr::ep_buffer_layout lay = ep_nccl_dispatcher::layout_for(1, l.config(1, false), l.type, tp);
  device_buffer ws(lay.bytes);
  CHECK_THROWS_WITH_AS(ep_nccl_dispatcher(comm, l.config(1, false), l.type, tp, {ws.get(), lay.bytes - 1}),
                       doctest::Contains("the workspace has"), mr::invalid_argument_error);
  std::vector<std::uint64_t> host_ws(lay.bytes / 8 + 64);
  void* host_aligned = reinterpret_cast<void*>((reinterpret_cast<std::uintptr_t>(host_ws.data()) + 255) / 256 * 256);
  CHECK_THROWS_WITH_AS(ep_nccl_dispatcher(comm, l.config(1, false), l.type, tp, {host_aligned, lay.bytes}),
                       doctest::Contains("must be device memory"), mr::invalid_argument_error);
  mr::moe_config_params nc = l.config(1, false).params();
  nc.no_combine = true;
  CHECK_THROWS_WITH_AS(ep_nccl_dispatcher(comm, mr::MoeRunnerConfig(nc), l.type, tp, {ws.get(), lay.bytes}),
                       doctest::Contains("no_combine is not taken"), mr::invalid_argument_error);

  ep_nccl_dispatcher disp(comm, l.config(1, false), l.type, tp, {ws.get(), lay.bytes});
  tokens in(l, 10, rng);
  const device_tensor x(in.x), w(in.weights), ids(in.ids);
  const mr::TopKOutput topk{w.view, ids.view};
  const cuda::stream_ref s(cudaStream_t{});
  mr::tensor_view out = x.view;
  CHECK_THROWS_WITH_AS(disp.combine({x.view, true}, out, s), doctest::Contains("no dispatch to combine"),
                       mr::invalid_argument_error);
  mr::tensor_view x16 = x.view;
  x16.type = mr::dtype::f16;
  CHECK_THROWS_WITH_AS(disp.dispatch(x16, topk, s), doctest::Contains("hidden_states must be bf16"),
                       mr::invalid_argument_error);
  CHECK_THROWS_WITH_AS(disp.dispatch(x.view, {ids.view, w.view}, s), doctest::Contains("topk_ids must be i32"),
                       mr::invalid_argument_error);
  mr::tensor_view wide = x.view;
  wide.shape[0] = 65;  // more than max_tokens_per_rank (and than x holds: rejected before any read)
  CHECK_THROWS_WITH_AS(disp.dispatch(wide, topk, s), doctest::Contains("more than max_tokens_per_rank = 64"),
                       mr::invalid_argument_error);
  // Throughput waits for the counts on the host: refused on a capturing stream, before any work.
  cudaStream_t cs = nullptr;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
  MOE_CUDA_CHECK(cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal));
  CHECK_THROWS_AS(disp.dispatch(x.view, topk, cuda::stream_ref(cs)), mr::unsupported_error);
  cudaGraph_t g = nullptr;
  MOE_CUDA_CHECK(cudaStreamEndCapture(cs, &g));
  if (g) cudaGraphDestroy(g);
  cudaStreamDestroy(cs);
  // A real dispatch, then parts of the wrong size.
  const mr::DispatchOutput d = disp.dispatch(x.view, topk, s);
  mr::tensor_view parts = d.hidden_states;
  parts.shape[0] += 1;
  CHECK_THROWS_WITH_AS(disp.combine({parts, true}, out, s), doctest::Contains("parts dimension 0 must be"),
                       mr::invalid_argument_error);
  CHECK_THROWS_WITH_AS(disp.combine({d.hidden_states, false}, out, s), doctest::Contains("must combine its rows"),
                       mr::invalid_argument_error);
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  ncclCommDestroy(comm);
}

int main(int argc, char** argv) {
  std::vector<char*> args;
  for (int a = 0; a < argc; ++a) {
    if (std::strncmp(argv[a], "--world=", 8) == 0) g_world = std::atoi(argv[a] + 8);
    else args.push_back(argv[a]);
  }
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess) gpus = 0;
  if (g_world < 1 || gpus < g_world) {
    std::printf("%d GPU(s) for a world of %d ranks: skipping the expert-parallel tests\n", gpus, g_world);
    return mr::test::skip_exit_code;
  }
  doctest::Context ctx;
  ctx.applyCommandLine(static_cast<int>(args.size()), args.data());
  return ctx.run();
}
