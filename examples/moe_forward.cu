// moe_forward: one MoE layer forward on the default backend, timed.
//
// Where a GPU is present the layer runs on `cuda_fused` (bf16 on the device) and is
// checked against the `reference` backend on a few tokens; elsewhere, or when the
// project is built without nvcc, it runs on `reference` on the host.
//
//   moe_forward [--backend NAME] [--tokens M] [--experts E] [--top-k K]
//               [--hidden H] [--intermediate I] [--iters N] [--seed S]
//
// The pipeline an engine runs: routing (top-k of the router logits) -> dispatch ->
// FusedMoE::forward (quant method -> quant info -> the runner's chosen policy) -> combine.
// One source for both builds: nvcc compiles it as CUDA; a host-only build compiles a
// copy as C++, which keeps the reference path only.
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <new>
#include <optional>
#include <system_error>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "moerunner/moerunner.hpp"

#if defined(__CUDACC__)
#include <cuda_runtime_api.h>

#include "moerunner/gpu/cuda_check.hpp"
#include "moerunner/gpu/routing.cuh"
#include "moerunner/policies/builtin_policies.cuh"
#endif

namespace mr = moerunner;

namespace {

#if defined(__CUDACC__)
using runner_type = mr::builtin_moe_runner<>;
#else
using runner_type = mr::MoeRunner<mr::reference_policy>;
#endif
using layer_type = mr::FusedMoE<runner_type, mr::unquantized_method>;

struct options {
  std::string backend;  // empty: the default for this machine
  std::int64_t tokens = -1;  // -1: a default that suits the backend
  int experts = 8;
  int top_k = 2;
  int hidden = 1024;
  int intermediate = 2048;
  int iters = 20;
  unsigned seed = 1;
};

[[noreturn]] void usage(const char* argv0, int status) {
  std::fprintf(status ? stderr : stdout,
               "usage: %s [--backend NAME] [--tokens M] [--experts E] [--top-k K] [--hidden H]\n"
               "          [--intermediate I] [--iters N] [--seed S]\n"
               "backends: %s\n",
               argv0, mr::backend_registry::global().known_names().c_str());
  std::exit(status);
}

// The whole of `text` as a decimal integer in [lo, hi]; anything else ends the program with
// a message that names the option (atoi would read "abc" as 0 and "-3" as -3).
std::int64_t parse_int(const char* option, const char* text, std::int64_t lo, std::int64_t hi) {
  std::int64_t v = 0;
  const std::string_view t = text;
  const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
  if (t.empty() || ec != std::errc() || end != t.data() + t.size() || v < lo || v > hi) {
    std::fprintf(stderr, "moe_forward: %s takes an integer in [%lld, %lld], got '%s'\n", option,
                 static_cast<long long>(lo), static_cast<long long>(hi), mr::detail::echo(t).c_str());
    std::exit(2);
  }
  return v;
}

options parse(int argc, char** argv) {
  constexpr std::int64_t int_max = std::numeric_limits<int>::max();
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--help" || a == "-h") usage(argv[0], 0);
    if (i + 1 >= argc) usage(argv[0], 2);
    const char* v = argv[++i];
    // Sizes the config itself bounds (experts, top-k, hidden, intermediate) are checked there.
    if (a == "--backend") o.backend = v;
    else if (a == "--tokens") o.tokens = parse_int(argv[i - 1], v, 0, int_max);
    else if (a == "--experts") o.experts = static_cast<int>(parse_int(argv[i - 1], v, 1, int_max));
    else if (a == "--top-k") o.top_k = static_cast<int>(parse_int(argv[i - 1], v, 1, int_max));
    else if (a == "--hidden") o.hidden = static_cast<int>(parse_int(argv[i - 1], v, 1, int_max));
    else if (a == "--intermediate") o.intermediate = static_cast<int>(parse_int(argv[i - 1], v, 1, int_max));
    else if (a == "--iters") o.iters = static_cast<int>(parse_int(argv[i - 1], v, 1, int_max));
    else if (a == "--seed") o.seed = static_cast<unsigned>(parse_int(argv[i - 1], v, 0, 0xffffffff));
    else usage(argv[0], 2);
  }
  return o;
}

int gpu_count() {
#if defined(__CUDACC__)
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
#else
  return 0;
#endif
}

// The layer's host-side data: bf16 activations and weights, f32 router logits.
struct layer_data {
  std::vector<std::uint16_t> x, w13, w2;
  std::vector<float> logits;
};

// Weights ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) keep activations at a sane scale.
std::vector<std::uint16_t> random_bf16(std::size_t n, float bound, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-bound, bound);
  std::vector<std::uint16_t> v(n);
  for (auto& e : v) e = mr::host_float::float_to_bf16(dist(rng));
  return v;
}

layer_data make_data(const mr::MoeRunnerConfig& cfg, std::int64_t m, unsigned seed) {
  std::mt19937 rng(seed);
  const auto e = static_cast<std::size_t>(cfg.num_experts());
  const auto h = static_cast<std::size_t>(cfg.hidden_size());
  const auto i = static_cast<std::size_t>(cfg.intermediate_size());
  layer_data d;
  d.x = random_bf16(static_cast<std::size_t>(m) * h, 1.0f, rng);
  d.w13 = random_bf16(e * cfg.w13_rows() * h, 1.0f / std::sqrt(static_cast<float>(h)), rng);
  d.w2 = random_bf16(e * h * i, 1.0f / std::sqrt(static_cast<float>(i)), rng);
  std::normal_distribution<float> logit(0.0f, 2.0f);
  d.logits.resize(static_cast<std::size_t>(m) * e);
  for (auto& v : d.logits) v = logit(rng);
  return d;
}

mr::tensor_view view(const void* p, mr::dtype t, std::initializer_list<std::int64_t> dims, mr::memory_space s) {
  return mr::tensor_view::contiguous(p, t, dims, s);
}

void print_shape(const mr::MoeRunnerConfig& cfg, std::int64_t m) {
  std::printf("shape:   tokens=%lld experts=%d top_k=%d hidden=%d intermediate=%d, bf16 -> out [%lld, %d]\n",
              static_cast<long long>(m), cfg.num_experts(), cfg.top_k(), cfg.hidden_size(),
              cfg.intermediate_size(), static_cast<long long>(m), cfg.hidden_size());
}

// Runs the layer on host tensors: the path of the reference backend.
std::vector<std::uint16_t> forward_on_host(layer_type& layer, const mr::MoeRunnerConfig& cfg, const layer_data& d,
                                           std::int64_t m, double* ms) {
  const auto host = mr::memory_space::host;
  const int k = cfg.top_k();
  std::vector<float> topk_weights(static_cast<std::size_t>(m) * k);
  std::vector<std::int32_t> topk_ids(static_cast<std::size_t>(m) * k);
  std::vector<std::uint16_t> out(static_cast<std::size_t>(m) * cfg.hidden_size());
  std::vector<std::byte> workspace(layer.workspace_bytes(m));

  const auto start = std::chrono::steady_clock::now();
  mr::TopKOutput topk{view(topk_weights.data(), mr::dtype::f32, {m, k}, host),
                      view(topk_ids.data(), mr::dtype::i32, {m, k}, host)};
  mr::reference::topk(view(d.logits.data(), mr::dtype::f32, {m, cfg.num_experts()}, host), nullptr,
                      {.top_k = k, .renormalize = true}, topk);
  const mr::standard_dispatcher dispatcher(cfg);
  const mr::DispatchOutput dispatched =
      dispatcher.dispatch(view(d.x.data(), mr::dtype::bf16, {m, cfg.hidden_size()}, host), topk);
  const mr::CombineInput combined =
      layer.forward(dispatched, view(out.data(), mr::dtype::bf16, {m, cfg.hidden_size()}, host),
                    {workspace.data(), workspace.size()}, cuda::stream_ref(cudaStream_t{}));
  dispatcher.combine(combined);
  *ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  return out;
}

#if defined(__CUDACC__)

// Device memory owned for the example's lifetime.
struct device_buffer {
  void* ptr = nullptr;
  explicit device_buffer(std::size_t bytes) {
    if (bytes) MOE_CUDA_CHECK(cudaMalloc(&ptr, bytes));
  }
  device_buffer(device_buffer&& other) noexcept : ptr(std::exchange(other.ptr, nullptr)) {}
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() { cudaFree(ptr); }
};

template <class T>
device_buffer upload(const std::vector<T>& h) {
  device_buffer b(h.size() * sizeof(T));
  if (!h.empty()) MOE_CUDA_CHECK(cudaMemcpy(b.ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return b;
}

template <class T>
std::vector<T> download(const device_buffer& b, std::size_t n) {
  std::vector<T> h(n);
  if (n) MOE_CUDA_CHECK(cudaMemcpy(h.data(), b.ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

// Runs the layer on device tensors; checks the first tokens against the reference backend.
int run_on_device(std::optional<runner_type> runner, const mr::MoeRunnerConfig& cfg, const layer_data& d,
                  std::int64_t m, int iters) {
  const auto dev = mr::memory_space::device;
  const int k = cfg.top_k(), h = cfg.hidden_size(), e = cfg.num_experts(), inter = cfg.intermediate_size();
  const device_buffer x = upload(d.x), logits = upload(d.logits);
  const device_buffer w13 = upload(d.w13), w2 = upload(d.w2);
  const device_buffer topk_weights(static_cast<std::size_t>(m) * k * sizeof(float));
  const device_buffer topk_ids(static_cast<std::size_t>(m) * k * sizeof(std::int32_t));
  const device_buffer out(static_cast<std::size_t>(m) * h * sizeof(std::uint16_t));
  layer_type layer(mr::unquantized_method{},
                   {view(w13.ptr, mr::dtype::bf16, {e, cfg.w13_rows(), h}, dev),
                    view(w2.ptr, mr::dtype::bf16, {e, h, inter}, dev), {}, {}},
                   std::move(runner));
  // The caller owns the scratch memory; the runner says how much one run needs.
  const std::size_t ws_bytes = layer.workspace_bytes(m);
  const device_buffer workspace(ws_bytes);

  cudaStream_t stream;
  MOE_CUDA_CHECK(cudaStreamCreate(&stream));
  const mr::topk_config routing{.top_k = k, .renormalize = true};
  const mr::standard_dispatcher dispatcher(cfg);
  auto forward = [&] {
    mr::TopKOutput topk{view(topk_weights.ptr, mr::dtype::f32, {m, k}, dev),
                        view(topk_ids.ptr, mr::dtype::i32, {m, k}, dev)};
    mr::gpu::topk(view(logits.ptr, mr::dtype::f32, {m, e}, dev), nullptr, routing, topk, stream);
    const mr::DispatchOutput dispatched = dispatcher.dispatch(view(x.ptr, mr::dtype::bf16, {m, h}, dev), topk);
    dispatcher.combine(layer.forward(dispatched, view(out.ptr, mr::dtype::bf16, {m, h}, dev),
                                            {workspace.ptr, ws_bytes}, cuda::stream_ref(stream)));
  };

  forward();  // warm-up: first launches load the kernels
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaEvent_t start, stop;
  MOE_CUDA_CHECK(cudaEventCreate(&start));
  MOE_CUDA_CHECK(cudaEventCreate(&stop));
  MOE_CUDA_CHECK(cudaEventRecord(start, stream));
  for (int it = 0; it < iters; ++it) forward();
  MOE_CUDA_CHECK(cudaEventRecord(stop, stream));
  MOE_CUDA_CHECK(cudaEventSynchronize(stop));
  float total_ms = 0.0f;
  MOE_CUDA_CHECK(cudaEventElapsedTime(&total_ms, start, stop));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaStreamDestroy(stream);

  cudaDeviceProp prop{};
  int device = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&device));
  MOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  std::printf("backend: %s on %s (sm_%d%d)\n", std::string(layer.runner().runner_backend().name()).c_str(),
              prop.name, prop.major, prop.minor);
  print_shape(cfg, m);
  std::printf("time:    %.3f ms per forward (routing + runner + combine), mean of %d runs after a warm-up\n",
              total_ms / iters, iters);

  // The reference backend is the oracle: recompute the first tokens on the host and compare.
  const std::int64_t checked = std::min<std::int64_t>(m, 4);
  if (checked == 0) return 0;
  const auto gpu_out = download<std::uint16_t>(out, static_cast<std::size_t>(checked) * h);
  auto ids = download<std::int32_t>(topk_ids, static_cast<std::size_t>(checked) * k);
  auto weights = download<float>(topk_weights, static_cast<std::size_t>(checked) * k);
  std::vector<std::uint16_t> ref_out(static_cast<std::size_t>(checked) * h);
  const auto host = mr::memory_space::host;
  mr::MoeRunner<mr::reference_policy> reference("reference", cfg);
  reference.run(mr::DispatchOutput{view(d.x.data(), mr::dtype::bf16, {checked, h}, host),
                                   {},
                                   {view(weights.data(), mr::dtype::f32, {checked, k}, host),
                                    view(ids.data(), mr::dtype::i32, {checked, k}, host)}},
                mr::unquantized_quant_info{view(d.w13.data(), mr::dtype::bf16, {e, cfg.w13_rows(), h}, host),
                                           view(d.w2.data(), mr::dtype::bf16, {e, h, inter}, host)},
                view(ref_out.data(), mr::dtype::bf16, {checked, h}, host), {}, cuda::stream_ref(cudaStream_t{}));
  double max_diff = 0.0, max_ref = 0.0;
  bool finite = true;
  for (std::size_t i = 0; i < ref_out.size(); ++i) {
    const double a = mr::host_float::bf16_to_float(gpu_out[i]), b = mr::host_float::bf16_to_float(ref_out[i]);
    finite = finite && std::isfinite(a);
    max_diff = std::max(max_diff, std::fabs(a - b));
    max_ref = std::max(max_ref, std::fabs(b));
  }
  const bool ok = finite && max_diff <= 2e-2 * std::max(max_ref, 1e-3);
  std::printf("check:   first %lld tokens vs reference: max |diff| %.3g (max |ref| %.3g): %s\n",
              static_cast<long long>(checked), max_diff, max_ref, ok ? "ok" : "MISMATCH");
  return ok ? 0 : 1;
}

#endif

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  const int gpus = gpu_count();
  const std::string backend = !o.backend.empty() ? o.backend : gpus > 0 ? "cuda_fused" : "reference";
  try {
    const mr::MoeRunnerConfig cfg({.num_experts = o.experts,
                                   .hidden_size = o.hidden,
                                   .intermediate_size = o.intermediate,
                                   .top_k = o.top_k,
                                   .act = {.kind = mr::activation_kind::silu}});
    // Picking the backend by name: an unknown name lists the known ones.
    std::optional<runner_type> runner;
    try {
      runner.emplace(backend, cfg);
    } catch (const mr::registry_error& err) {
      std::fprintf(stderr, "moe_forward: %s\n", err.what());
      return 2;
    }
    const bool on_device = runner->tensor_space() == mr::memory_space::device;
    if (on_device && gpus == 0) {
      std::fprintf(stderr, "moe_forward: backend '%s' needs a GPU and none is present\n", backend.c_str());
      return 2;
    }
    // The reference backend computes in double on the host: keep its default small.
    const std::int64_t m = o.tokens >= 0 ? o.tokens : on_device ? 256 : 16;
    const layer_data data = make_data(cfg, m, o.seed);
#if defined(__CUDACC__)
    if (on_device) return run_on_device(std::move(runner), cfg, data, m, o.iters);
#endif
    const auto host = mr::memory_space::host;
    layer_type layer(mr::unquantized_method{},
                     {view(data.w13.data(), mr::dtype::bf16, {cfg.num_experts(), cfg.w13_rows(), cfg.hidden_size()}, host),
                      view(data.w2.data(), mr::dtype::bf16, {cfg.num_experts(), cfg.hidden_size(), cfg.intermediate_size()}, host),
                      {}, {}},
                     std::move(runner));
    double ms = 0.0;
    const std::vector<std::uint16_t> out = forward_on_host(layer, cfg, data, m, &ms);
    double norm = 0.0;
    for (std::uint16_t v : out) norm += std::pow(mr::host_float::bf16_to_float(v), 2.0);
    std::printf("backend: %s on the host (%s)\n", std::string(layer.runner().runner_backend().name()).c_str(),
                gpus > 0 ? "chosen by name" : "no GPU present");
    print_shape(cfg, m);
    std::printf("time:    %.3f ms for one forward (routing + runner + combine)\n", ms);
    std::printf("output:  rms %.4g\n", m > 0 ? std::sqrt(norm / static_cast<double>(out.size())) : 0.0);
    return std::isfinite(norm) ? 0 : 1;
  } catch (const mr::moe_error& err) {
    std::fprintf(stderr, "moe_forward: %s\n", err.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "moe_forward: not enough host memory for the layer's data (--tokens %lld)\n",
                 static_cast<long long>(o.tokens));
    return 1;
  }
}
