// custom_backend_example: runs one MoE layer on a backend chosen by name and checks
// the result against the reference backend.
//
//   custom_backend_example [--backend NAME] [--tokens M] [--seed S]
//
// NAME is any backend this program's runner lists: "host_f32" (this folder's backend,
// registered by host_f32_backend.cpp) or the built-in "reference". An unknown name
// prints the registry's error, which lists the known names, and exits 2; a result
// that disagrees with the reference exits 1.
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "host_f32_policy.hpp"
#include "moerunner/moerunner.hpp"

namespace mr = moerunner;

namespace {

using runner_type = mr::MoeRunner<mr::reference_policy, custom_backend::host_f32_policy>;

mr::tensor_view host_view(const void* p, mr::dtype t, std::initializer_list<std::int64_t> dims) {
  return mr::tensor_view::contiguous(p, t, dims, mr::memory_space::host);
}

// Runs `runner` on the layer and returns its output as floats.
std::vector<float> forward(runner_type& runner, const mr::DispatchOutput& d, const mr::unquantized_quant_info& q,
                           std::int64_t m, int h) {
  // NaN everywhere first: an element the backend forgot to write cannot pass the check.
  std::vector<std::uint16_t> out(static_cast<std::size_t>(m) * h, 0x7fc0);
  std::vector<std::byte> workspace(runner.workspace_bytes(m));
  runner.run(d, q, host_view(out.data(), mr::dtype::bf16, {m, h}), {workspace.data(), workspace.size()},
             cuda::stream_ref(cudaStream_t{}));
  std::vector<float> f(out.size());
  for (std::size_t i = 0; i < out.size(); ++i) f[i] = mr::host_float::bf16_to_float(out[i]);
  return f;
}

}  // namespace

// The whole of `text` as a decimal integer in [lo, hi], or nothing (atoi would read "abc" as 0).
std::optional<std::int64_t> parse_int(std::string_view text, std::int64_t lo, std::int64_t hi) {
  std::int64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size() || v < lo || v > hi) return std::nullopt;
  return v;
}

int main(int argc, char** argv) {
  std::string backend = "host_f32";
  std::int64_t m = 7;
  unsigned seed = 1;
  for (int i = 1; i < argc; i += 2) {
    const std::string_view a = i + 1 < argc ? argv[i] : "";
    std::optional<std::int64_t> n;
    if (a == "--backend") backend = argv[i + 1];
    else if (a == "--tokens" && (n = parse_int(argv[i + 1], 0, 1 << 20))) m = *n;
    else if (a == "--seed" && (n = parse_int(argv[i + 1], 0, 0xffffffff))) seed = static_cast<unsigned>(*n);
    else {
      std::fprintf(stderr, "usage: %s [--backend NAME] [--tokens M (0 to 1048576)] [--seed S (0 to 4294967295)]\n",
                   argv[0]);
      return 2;
    }
  }

  // A small gated layer with sizes that are not multiples of anything in particular.
  const int e = 6, k = 2, h = 40, inter = 24;
  const mr::MoeRunnerConfig cfg({.num_experts = e, .hidden_size = h, .intermediate_size = inter, .top_k = k,
                                 .routed_scaling_factor = 1.5f});

  std::optional<runner_type> chosen;
  try {
    chosen.emplace(backend, cfg);
  } catch (const mr::registry_error& err) {
    std::fprintf(stderr, "custom_backend_example: %s\n", err.what());
    return 2;
  }
  runner_type reference("reference", cfg);

  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  auto bf16_values = [&](std::size_t n, float scale) {
    std::vector<std::uint16_t> v(n);
    for (auto& x : v) x = mr::host_float::float_to_bf16(scale * uni(rng));
    return v;
  };
  const auto x = bf16_values(static_cast<std::size_t>(m) * h, 1.0f);
  const auto w13 = bf16_values(static_cast<std::size_t>(e) * 2 * inter * h, 0.3f);
  const auto w2 = bf16_values(static_cast<std::size_t>(e) * h * inter, 0.3f);
  std::vector<float> logits(static_cast<std::size_t>(m) * e);
  for (auto& v : logits) v = 3.0f * uni(rng);

  std::vector<float> topk_weights(static_cast<std::size_t>(m) * k);
  std::vector<std::int32_t> topk_ids(static_cast<std::size_t>(m) * k);
  mr::TopKOutput topk{host_view(topk_weights.data(), mr::dtype::f32, {m, k}),
                      host_view(topk_ids.data(), mr::dtype::i32, {m, k})};
  mr::reference::topk(host_view(logits.data(), mr::dtype::f32, {m, e}), nullptr, {.top_k = k}, topk);
  const mr::standard_dispatcher dispatcher(cfg);
  const mr::DispatchOutput d = dispatcher.dispatch(host_view(x.data(), mr::dtype::bf16, {m, h}), topk);
  const mr::unquantized_quant_info q{host_view(w13.data(), mr::dtype::bf16, {e, 2 * inter, h}),
                                     host_view(w2.data(), mr::dtype::bf16, {e, h, inter})};

  try {
    const std::vector<float> got = forward(*chosen, d, q, m, h);
    const std::vector<float> want = forward(reference, d, q, m, h);
    // bf16 output and f32 sums in another order: agree to a few bf16 ulps of the largest value.
    double max_ref = 0.0, max_diff = 0.0;
    bool finite = true;
    for (std::size_t i = 0; i < want.size(); ++i) {
      finite = finite && std::isfinite(got[i]) && std::isfinite(want[i]);
      max_ref = std::max(max_ref, std::fabs(static_cast<double>(want[i])));
      max_diff = std::max(max_diff, std::fabs(static_cast<double>(got[i]) - want[i]));
    }
    const bool ok = finite && max_diff <= 1e-2 * max_ref + 1e-6;
    std::printf("backend %s vs reference on %lld tokens: max |diff| %.3g, max |ref| %.3g: %s\n",
                std::string(chosen->runner_backend().name()).c_str(), static_cast<long long>(m), max_diff, max_ref,
                ok ? "match" : "MISMATCH");
    return ok ? 0 : 1;
  } catch (const mr::moe_error& err) {
    std::fprintf(stderr, "custom_backend_example: %s\n", err.what());
    return 1;
  }
}
