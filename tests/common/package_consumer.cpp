// A program that runs one small layer on the reference backend, built by each way an engine
// takes moerunner: installed with pkg-config or CMake, and as a Meson subproject. Each build
// names itself in MOERUNNER_CONSUMER ("pkg-config", "cmake", "subproject").
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "moerunner/moerunner.hpp"

#ifndef MOERUNNER_CONSUMER
#error "define MOERUNNER_CONSUMER as the way this build found moerunner"
#endif

int main() {
  using namespace moerunner;
  constexpr int m = 3, e = 4, h = 8, inter = 4, k = 2;
  const MoeRunnerConfig cfg({.num_experts = e, .hidden_size = h, .intermediate_size = inter, .top_k = k});
  MoeRunner<reference_policy> runner("reference", cfg);

  std::vector<float> x(m * h), w13(e * 2 * inter * h), w2(e * h * inter), logits(m * e), out(m * h), weights(m * k);
  std::vector<std::int32_t> ids(m * k);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37f * static_cast<float>(i + 1));
  for (std::size_t i = 0; i < w13.size(); ++i) w13[i] = 0.1f * std::cos(0.11f * static_cast<float>(i + 1));
  for (std::size_t i = 0; i < w2.size(); ++i) w2[i] = 0.1f * std::sin(0.13f * static_cast<float>(i + 1));
  for (std::size_t i = 0; i < logits.size(); ++i) logits[i] = std::cos(0.7f * static_cast<float>(i + 1));

  const auto host = memory_space::host;
  TopKOutput topk{tensor_view::contiguous(weights.data(), dtype::f32, {m, k}, host),
                  tensor_view::contiguous(ids.data(), dtype::i32, {m, k}, host)};
  reference::topk(tensor_view::contiguous(logits.data(), dtype::f32, {m, e}, host), nullptr, {.top_k = k}, topk);
  const DispatchOutput d{tensor_view::contiguous(x.data(), dtype::f32, {m, h}, host), {}, topk};
  const unquantized_quant_info q{tensor_view::contiguous(w13.data(), dtype::f32, {e, 2 * inter, h}, host),
                                 tensor_view::contiguous(w2.data(), dtype::f32, {e, h, inter}, host)};
  runner.run(d, q, tensor_view::contiguous(out.data(), dtype::f32, {m, h}, host), {}, cuda::stream_ref(cudaStream_t{}));

  double norm = 0.0;
  for (float v : out) {
    if (!std::isfinite(v)) return 1;
    norm += static_cast<double>(v) * v;
  }
  std::printf(MOERUNNER_CONSUMER " consumer: backend %s, |out|^2 = %g\n", std::string(runner.runner_backend().name()).c_str(), norm);
  return norm > 0.0 ? 0 : 1;
}
