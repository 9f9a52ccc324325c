// ep_bench: expert parallelism through NCCL (ep_nccl_dispatcher) on the GPUs of one host, one
// rank per GPU on a thread each, for every mode, with cuda_fused as the local runner.
//
//   ep_bench --out results.jsonl --commit $(git rev-parse --short HEAD) [--world 2] [--tokens 128,4096]
//            [--modes throughput,low_latency,allgather]
//
// Shape: DeepSeek-V3's MoE layer (E = 256, k = 8, H = 7168, I = 2048, bf16), E/R experts per
// rank, `tokens` tokens per rank routed by softmax top-k of random logits (max_tokens_per_rank =
// tokens; low_latency's capacity is the same, so nothing is dropped).
//
// What is timed, per rank, all on one stream: dispatch_ms (dispatch alone), combine_ms (combine
// alone, of the last dispatch), runner_ms (the local runner alone on the dispatched rows) and
// layer_ms (dispatch, runner, combine). low_latency and allgather replay CUDA graphs of each;
// throughput (which waits for the exchanged counts inside dispatch) calls them directly, and
// its times include that wait. Each sample is a batch of launches after a barrier (an
// all-reduce of one int and a stream synchronization on every rank), so that the ranks start
// together; every rank runs the same fixed number of launches (their collectives must match).
// The median over the batches is reported, rank 0's and the slowest rank's (`_max`).
//
// Bytes: dispatch_bytes = the rows this rank's tokens send to other ranks (each token once per
// rank owning one of its experts, H * 2 bytes) plus their routing (8 bytes per slot), which is
// what the tokens need; dispatch_wire_bytes = what NCCL moves to other ranks (low_latency sends
// whole slots of `capacity` rows; allgather sends every row to every rank). combine_bytes and
// combine_wire_bytes likewise for the parts coming back. dispatch_GBps = dispatch_bytes /
// dispatch_ms, per GPU (as DeepEP reports its NVLink bandwidth); wire_GBps over the wire bytes.
// finite: no NaN or inf anywhere in rank 0's output.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "bench_util.hpp"
#include "moerunner/dispatch/ep_nccl_dispatcher.cuh"
#include "moerunner/moerunner.hpp"
#include "moerunner/policies/cuda_fused_policy.cuh"

namespace mr = moerunner;

namespace {

using namespace bench_util;
using runner_t = mr::MoeRunner<mr::cuda_fused_policy>;

struct shape {
  const char* name = "DeepSeek-V3";
  int e = 256, k = 8, h = 7168, i = 2048;
};

constexpr int warmup_launches = 10;
constexpr int batches = 11;
constexpr int launches_per_batch = 8;

// Uniform values in [-scale, scale) from a hash of the index: weights of several GB without a
// host round trip.
__global__ void fill_bf16_kernel(__nv_bfloat16* p, std::size_t n, float scale, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    std::uint32_t x = static_cast<std::uint32_t>(i) * 2654435761u ^ static_cast<std::uint32_t>(i >> 32) ^ seed;
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    p[i] = __float2bfloat16((static_cast<float>(x >> 8) / 8388608.0f - 1.0f) * scale);
  }
}

struct device_mem {
  void* p = nullptr;
  std::size_t bytes = 0;
  explicit device_mem(std::size_t n = 0) : bytes(n) {
    if (n) MOE_CUDA_CHECK(cudaMalloc(&p, n));
  }
  device_mem(const device_mem&) = delete;
  device_mem& operator=(const device_mem&) = delete;
  ~device_mem() {
    if (p) cudaFree(p);
  }
};

void fill(device_mem& m, float scale, std::uint32_t seed) {
  fill_bf16_kernel<<<1024, 256>>>(static_cast<__nv_bfloat16*>(m.p), m.bytes / 2, scale, seed);
  MOE_CUDA_CHECK_LAUNCH("fill_bf16_kernel");
}

struct options {
  std::string out_path = "ep_bench.jsonl";
  std::string commit = "unknown";
  int world = 2;
  std::vector<std::int64_t> tokens = {128, 4096};
  std::vector<mr::ep_mode> modes = {mr::ep_mode::throughput, mr::ep_mode::low_latency, mr::ep_mode::allgather};
};

struct cell {
  mr::ep_mode mode;
  std::int64_t tokens;
};

// One rank's measurements of a cell.
struct measured {
  double dispatch_ms = NAN, combine_ms = NAN, runner_ms = NAN, layer_ms = NAN;
  double dispatch_bytes = 0, dispatch_wire_bytes = 0, combine_bytes = 0, combine_wire_bytes = 0;
  std::int64_t local_rows = 0;
  std::size_t workspace_bytes = 0, runner_workspace_bytes = 0;
  bool finite = true;
  std::string plan;
};

// Every rank at the same point: a one-int all-reduce, then the stream drained.
void barrier(ncclComm_t comm, int* word, cudaStream_t s) {
  MOE_NCCL_CHECK(ncclAllReduce(word, word, 1, ncclInt32, ncclSum, comm, s));
  MOE_CUDA_CHECK(cudaStreamSynchronize(s));
}

// Median per-launch time over the batches; every rank makes the same calls.
template <class F>
double timed(ncclComm_t comm, int* word, cudaStream_t s, F&& launch) {
  for (int j = 0; j < warmup_launches; ++j) launch();
  event_pair ev;
  std::vector<double> samples;
  for (int b = 0; b < batches; ++b) {
    barrier(comm, word, s);
    ev.start(s);
    for (int j = 0; j < launches_per_batch; ++j) launch();
    samples.push_back(ev.stop_ms(s) / launches_per_batch);
  }
  return median(samples);
}

// The rank's layer state for one cell, and its measurements.
measured run_cell(const shape& sh, int world, int rank, ncclComm_t comm, const cell& c, device_mem& w13, device_mem& w2,
                  cudaStream_t s, int* word) {
  measured r;
  const std::int64_t m = c.tokens;
  const mr::MoeRunnerConfig cfg({.num_experts = sh.e, .num_local_experts = sh.e / world, .hidden_size = sh.h,
                                 .intermediate_size = sh.i, .top_k = sh.k});
  const mr::ep_params p{.mode = c.mode, .max_tokens_per_rank = m};
  const mr::ep_buffer_layout lay = mr::ep_nccl_dispatcher::layout_for(world, cfg, mr::dtype::bf16, p);
  r.workspace_bytes = lay.bytes;
  device_mem ws(lay.bytes), x(static_cast<std::size_t>(m) * sh.h * 2), out(static_cast<std::size_t>(m) * sh.h * 2);
  device_mem ids(static_cast<std::size_t>(m) * sh.k * 4), weights(static_cast<std::size_t>(m) * sh.k * 4);
  fill(x, 1.0f, 77u + static_cast<std::uint32_t>(rank));
  // Routing: softmax top-k of random logits, different on every rank.
  std::vector<float> logits(static_cast<std::size_t>(m) * sh.e), wh(static_cast<std::size_t>(m) * sh.k);
  std::vector<std::int32_t> ih(static_cast<std::size_t>(m) * sh.k);
  std::mt19937 rng(1234u + static_cast<unsigned>(rank));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& v : logits) v = normal(rng);
  const auto host = mr::memory_space::host;
  mr::TopKOutput th{mr::tensor_view::contiguous(wh.data(), mr::dtype::f32, {m, sh.k}, host),
                    mr::tensor_view::contiguous(ih.data(), mr::dtype::i32, {m, sh.k}, host)};
  mr::reference::topk(mr::tensor_view::contiguous(logits.data(), mr::dtype::f32, {m, sh.e}, host), nullptr,
                      {.top_k = sh.k, .renormalize = true}, th);
  MOE_CUDA_CHECK(cudaMemcpy(ids.p, ih.data(), ids.bytes, cudaMemcpyHostToDevice));
  MOE_CUDA_CHECK(cudaMemcpy(weights.p, wh.data(), weights.bytes, cudaMemcpyHostToDevice));
  // The fills and copies ran on the legacy stream, which `s` (non-blocking) does not wait for.
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  // The bytes the tokens need, and the bytes NCCL moves, to and from the other ranks.
  const mr::ep_send_layout sl = mr::make_ep_send_layout(ih.data(), m, sh.k, {world, rank, sh.e});
  std::int64_t remote_rows = 0;
  for (int d = 0; d < world; ++d)
    if (d != rank) remote_rows += sl.counts[d];
  const double meta = 8.0 * sh.k, rb = static_cast<double>(lay.row_bytes);
  r.dispatch_bytes = remote_rows * (rb + meta);
  r.combine_bytes = remote_rows * rb;
  switch (c.mode) {
    case mr::ep_mode::throughput:
      r.dispatch_wire_bytes = r.dispatch_bytes;
      r.combine_wire_bytes = r.combine_bytes;
      break;
    case mr::ep_mode::low_latency:
      r.dispatch_wire_bytes = (world - 1) * lay.slots * (rb + meta);
      r.combine_wire_bytes = (world - 1) * lay.slots * rb;
      break;
    case mr::ep_mode::allgather:
      r.dispatch_wire_bytes = (world - 1) * lay.max_tokens * (rb + meta);
      r.combine_wire_bytes = (world - 1) * lay.max_tokens * rb;
      break;
  }

  mr::ep_nccl_dispatcher disp(comm, cfg, mr::dtype::bf16, p, {ws.p, ws.bytes});
  runner_t runner("cuda_fused", cfg);
  const auto dev = mr::memory_space::device;
  const mr::tensor_view xv = mr::tensor_view::contiguous(x.p, mr::dtype::bf16, {m, sh.h}, dev);
  const mr::tensor_view outv = mr::tensor_view::contiguous(out.p, mr::dtype::bf16, {m, sh.h}, dev);
  const mr::TopKOutput topk{mr::tensor_view::contiguous(weights.p, mr::dtype::f32, {m, sh.k}, dev),
                            mr::tensor_view::contiguous(ids.p, mr::dtype::i32, {m, sh.k}, dev)};
  const mr::unquantized_quant_info q{
      mr::tensor_view::contiguous(w13.p, mr::dtype::bf16, {sh.e / world, 2 * sh.i, sh.h}, dev),
      mr::tensor_view::contiguous(w2.p, mr::dtype::bf16, {sh.e / world, sh.h, sh.i}, dev)};
  const cuda::stream_ref sr(s);

  // One untimed layer sizes the runner's workspace and the parts (throughput: from the rows it got).
  mr::DispatchOutput d = disp.dispatch(xv, topk, sr);
  r.local_rows = d.num_tokens();
  r.plan = runner.describe(d.num_tokens());
  r.runner_workspace_bytes = runner.workspace_bytes(d.num_tokens());
  device_mem rws(r.runner_workspace_bytes), parts(static_cast<std::size_t>(std::max<std::int64_t>(d.num_tokens(), 1)) *
                                                   static_cast<std::size_t>(lay.row_bytes));
  const mr::tensor_view pv = mr::tensor_view::contiguous(parts.p, mr::dtype::bf16, {d.num_tokens(), sh.h}, dev);
  const auto run = [&](cudaStream_t cs) {
    return runner.run(d, q, pv, {rws.p, rws.bytes}, cuda::stream_ref(cs));
  };
  mr::CombineInput ci = run(s);
  disp.combine(ci, outv, sr);
  MOE_CUDA_CHECK(cudaStreamSynchronize(s));
  if (rank == 0) {
    std::vector<std::uint16_t> o(static_cast<std::size_t>(m) * sh.h);
    MOE_CUDA_CHECK(cudaMemcpy(o.data(), out.p, o.size() * 2, cudaMemcpyDeviceToHost));
    for (std::uint16_t v : o) r.finite = r.finite && (v & 0x7f80u) != 0x7f80u;
  }

  const graph_exec g_runner = graph_exec::capture(s, [&](cudaStream_t cs) { run(cs); });
  r.runner_ms = timed(comm, word, s, [&] { g_runner.launch(s); });
  if (c.mode == mr::ep_mode::throughput) {
    // dispatch returns the same rows every time (the same routing): d stays valid.
    r.dispatch_ms = timed(comm, word, s, [&] { d = disp.dispatch(xv, topk, sr); });
    r.combine_ms = timed(comm, word, s, [&] { disp.combine(ci, outv, sr); });
    r.layer_ms = timed(comm, word, s, [&] {
      d = disp.dispatch(xv, topk, sr);
      disp.combine(run(s), outv, sr);
    });
  } else {
    const graph_exec g_dispatch = graph_exec::capture(s, [&](cudaStream_t cs) { disp.dispatch(xv, topk, cuda::stream_ref(cs)); });
    const graph_exec g_combine = graph_exec::capture(s, [&](cudaStream_t cs) { disp.combine(ci, outv, cuda::stream_ref(cs)); });
    const graph_exec g_layer = graph_exec::capture(s, [&](cudaStream_t cs) {
      disp.dispatch(xv, topk, cuda::stream_ref(cs));
      disp.combine(run(cs), outv, cuda::stream_ref(cs));
    });
    r.dispatch_ms = timed(comm, word, s, [&] { g_dispatch.launch(s); });
    r.combine_ms = timed(comm, word, s, [&] { g_combine.launch(s); });
    r.layer_ms = timed(comm, word, s, [&] { g_layer.launch(s); });
  }
  MOE_CUDA_CHECK(cudaStreamSynchronize(s));
  return r;
}

options parse_args(int argc, char** argv) {
  options o;
  for (int a = 1; a < argc; ++a) {
    const std::string arg = argv[a];
    const auto value = [&] { return option_value(a, argc, argv, "ep_bench"); };
    if (arg == "--out") o.out_path = value();
    else if (arg == "--commit") o.commit = value();
    else if (arg == "--world") o.world = std::atoi(value().c_str());
    else if (arg == "--tokens") {
      o.tokens.clear();
      for (const std::string& t : split(value())) o.tokens.push_back(std::atoll(t.c_str()));
    } else if (arg == "--modes") {
      o.modes.clear();
      for (const std::string& name : split(value())) {
        bool known = false;
        for (mr::ep_mode m : {mr::ep_mode::throughput, mr::ep_mode::low_latency, mr::ep_mode::allgather})
          if (name == mr::ep_mode_name(m)) o.modes.push_back(m), known = true;
        if (!known) {
          std::fprintf(stderr, "ep_bench: unknown mode %s\n", name.c_str());
          std::exit(2);
        }
      }
    } else {
      std::fprintf(stderr,
                   "usage: ep_bench [--out FILE.jsonl] [--commit SHA] [--world N] [--tokens 128,4096] "
                   "[--modes throughput,low_latency,allgather]\n");
      std::exit(2);
    }
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const options opt = parse_args(argc, argv);
  const shape sh;
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess) gpus = 0;
  if (opt.world < 1 || gpus < opt.world || sh.e % opt.world != 0) {
    std::fprintf(stderr, "ep_bench: a world of %d ranks needs as many GPUs (%d here) dividing E = %d\n", opt.world,
                 gpus, sh.e);
    return 2;
  }
  std::ofstream jsonl(opt.out_path);
  if (!jsonl) {
    std::fprintf(stderr, "ep_bench: cannot write %s\n", opt.out_path.c_str());
    return 2;
  }
  cudaDeviceProp prop{};
  MOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  int nccl_version = 0;
  MOE_NCCL_CHECK(ncclGetVersion(&nccl_version));
  jsonl << "{\"gpu\":" << json_string(prop.name) << ",\"commit\":" << json_string(opt.commit)
        << ",\"date\":" << json_string(utc_now()) << ",\"bench\":\"ep\",\"world\":" << opt.world
        << ",\"nccl_version\":" << nccl_version << "}\n";
  jsonl.flush();

  std::vector<cell> cells;
  for (std::int64_t t : opt.tokens)
    for (mr::ep_mode m : opt.modes) cells.push_back({m, t});
  std::vector<ncclComm_t> comms(opt.world);
  std::vector<int> devices(opt.world);
  std::iota(devices.begin(), devices.end(), 0);
  MOE_NCCL_CHECK(ncclCommInitAll(comms.data(), opt.world, devices.data()));
  // [rank][cell]
  std::vector<std::vector<measured>> res(opt.world, std::vector<measured>(cells.size()));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < opt.world; ++rank)
    threads.emplace_back([&, rank] {
      try {
        MOE_CUDA_CHECK(cudaSetDevice(rank));
        const int local = sh.e / opt.world;
        device_mem w13(static_cast<std::size_t>(local) * 2 * sh.i * sh.h * 2),
            w2(static_cast<std::size_t>(local) * sh.h * sh.i * 2), word(sizeof(int));
        fill(w13, 2.0f / std::sqrt(static_cast<float>(sh.h)), 11u + static_cast<std::uint32_t>(rank));
        fill(w2, 2.0f / std::sqrt(static_cast<float>(sh.i)), 13u + static_cast<std::uint32_t>(rank));
        MOE_CUDA_CHECK(cudaMemset(word.p, 0, sizeof(int)));
        cudaStream_t s = nullptr;
        MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        MOE_CUDA_CHECK(cudaDeviceSynchronize());
        for (std::size_t j = 0; j < cells.size(); ++j)
          res[rank][j] = run_cell(sh, opt.world, rank, comms[rank], cells[j], w13, w2, s, static_cast<int*>(word.p));
        cudaStreamDestroy(s);
      } catch (const std::exception& e) {
        // A rank that fails leaves the others waiting in a collective: report and stop the process.
        std::fprintf(stderr, "ep_bench: rank %d: %s\n", rank, e.what());
        std::fflush(stderr);
        std::_Exit(1);
      }
    });
  for (auto& t : threads) t.join();
  for (ncclComm_t c : comms) ncclCommDestroy(c);

  for (std::size_t j = 0; j < cells.size(); ++j) {
    const measured& r0 = res[0][j];
    double dmax = 0, cmax = 0, lmax = 0;
    for (int rank = 0; rank < opt.world; ++rank) {
      dmax = std::max(dmax, res[rank][j].dispatch_ms);
      cmax = std::max(cmax, res[rank][j].combine_ms);
      lmax = std::max(lmax, res[rank][j].layer_ms);
    }
    const double gbps = r0.dispatch_bytes / (r0.dispatch_ms * 1e6), cgbps = r0.combine_bytes / (r0.combine_ms * 1e6);
    const bool graphs = cells[j].mode != mr::ep_mode::throughput;
    jsonl << "{\"bench\":\"ep\",\"mode\":" << json_string(mr::ep_mode_name(cells[j].mode))
          << ",\"shape\":" << json_string(sh.name) << ",\"world\":" << opt.world << ",\"tokens\":" << cells[j].tokens
          << ",\"E\":" << sh.e << ",\"k\":" << sh.k << ",\"H\":" << sh.h << ",\"I\":" << sh.i
          << ",\"dtype\":\"bf16\",\"local_runner\":\"cuda_fused\",\"timing\":" << json_string(graphs ? "cuda_graph" : "direct")
          << ",\"dispatch_ms\":" << json_number(r0.dispatch_ms) << ",\"combine_ms\":" << json_number(r0.combine_ms)
          << ",\"runner_ms\":" << json_number(r0.runner_ms) << ",\"layer_ms\":" << json_number(r0.layer_ms)
          << ",\"dispatch_ms_max\":" << json_number(dmax) << ",\"combine_ms_max\":" << json_number(cmax)
          << ",\"layer_ms_max\":" << json_number(lmax) << ",\"dispatch_bytes\":" << json_number(r0.dispatch_bytes)
          << ",\"dispatch_wire_bytes\":" << json_number(r0.dispatch_wire_bytes)
          << ",\"dispatch_GBps\":" << json_number(gbps)
          << ",\"dispatch_wire_GBps\":" << json_number(r0.dispatch_wire_bytes / (r0.dispatch_ms * 1e6))
          << ",\"combine_bytes\":" << json_number(r0.combine_bytes)
          << ",\"combine_wire_bytes\":" << json_number(r0.combine_wire_bytes)
          << ",\"combine_GBps\":" << json_number(cgbps)
          << ",\"combine_wire_GBps\":" << json_number(r0.combine_wire_bytes / (r0.combine_ms * 1e6))
          << ",\"local_rows\":" << r0.local_rows << ",\"workspace_bytes\":" << r0.workspace_bytes
          << ",\"runner_workspace_bytes\":" << r0.runner_workspace_bytes << ",\"plan\":" << json_string(r0.plan)
          << ",\"finite\":" << (r0.finite ? "true" : "false") << "}\n";
    std::printf("%-12s tokens %5lld  dispatch %8.3f ms (%6.1f GB/s)  combine %8.3f ms (%6.1f GB/s)  runner %8.3f ms  "
                "layer %8.3f ms%s\n",
                std::string(mr::ep_mode_name(cells[j].mode)).c_str(), static_cast<long long>(cells[j].tokens),
                r0.dispatch_ms, gbps, r0.combine_ms, cgbps, r0.runner_ms, r0.layer_ms, r0.finite ? "" : "  NON-FINITE");
  }
  jsonl.flush();
  return 0;
}
