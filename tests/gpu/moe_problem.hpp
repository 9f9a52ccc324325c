// A random MoE problem on the host with its reference output, and its device copies run by
// one GPU backend: what the backend tests and the conformance suite share.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>

#include "gpu_test_util.hpp"
#include "moerunner/moerunner.hpp"

namespace moerunner::test {

// Normwise relative error bounds per activation dtype (bf16 has 8 mantissa bits, fp16 11): a
// few units of the dtype's rounding (act, the rows and the output, or the k atomic additions,
// are each rounded once).
inline double bound_for(dtype t) { return t == dtype::bf16 ? 1e-2 : 2e-3; }

// How the problem's top-k ids are made.
enum class ids_kind {
  softmax,          // the reference top-k of random logits
  skewed,           // as softmax, the first two experts' logits raised by 6: most tokens pick them
  one_expert,       // slot j of every token on expert (E/2 + j) % E (k = 1: all tokens on one expert)
  filtered,         // every third slot -1, and all of the middle token
  random_filtered,  // about a quarter of the slots -1 at random, and all of the middle token
  few_experts,      // only every fourth expert receives tokens
  all_filtered,     // every slot -1
};

struct moe_shape {
  int m, e, k, h, i;
};

struct moe_options {
  activation_kind act = activation_kind::silu;
  float limit = 7.0f;  // swiglu_clamped
  ids_kind ids = ids_kind::softmax;
  bool gated = true;
  bool no_combine = false;
  bool weight_on_input = false;
  bool inplace = false;
  float scaling = 1.0f;
  bool scaling_in_weights = false;
  bool deterministic = false;
  int nan_token = -1;  // puts a NaN into this token's input (the reference sees it too)
  bool interleaved = false;     // gpt-oss: w13 and b13 rows as gate/up pairs (gate_up_layout interleaved)
  std::optional<dtype> bias{};  // gpt-oss: b13 and b2 of this dtype (f32 or the activation dtype); unset: none
};

inline std::string describe(const moe_shape& s, dtype t, const moe_options& o) {
  return "M=" + std::to_string(s.m) + " E=" + std::to_string(s.e) + " k=" + std::to_string(s.k) +
         " H=" + std::to_string(s.h) + " I=" + std::to_string(s.i) + " " + std::string(dtype_name(t)) + " " +
         std::string(activation_name(o.act)) + " ids=" + std::to_string(static_cast<int>(o.ids)) +
         (o.gated ? "" : " ungated") + (o.no_combine ? " no_combine" : "") +
         (o.weight_on_input ? " weight_on_input" : "") + (o.inplace ? " inplace" : "") +
         " scaling=" + std::to_string(o.scaling) + (o.scaling_in_weights ? " (in weights)" : "") +
         (o.deterministic ? " deterministic" : "") +
         (o.nan_token >= 0 ? " nan_token=" + std::to_string(o.nan_token) : "") +
         (o.interleaved ? " interleaved" : "") + (o.bias ? " bias=" + std::string(dtype_name(*o.bias)) : "");
}

// Rows [begin, end) of a view's first dimension.
inline tensor_view rows_of(const tensor_view& v, std::int64_t begin, std::int64_t end) {
  tensor_view r = v;
  r.data = static_cast<char*>(v.data) + begin * v.strides[0] * static_cast<std::int64_t>(dtype_size(v.type));
  r.shape[0] = end - begin;
  return r;
}

// The reference backend's run of `d` into `out` with its tokens split over host threads, a
// runner each. The reference computes every token alone in a fixed order, so the bits are those
// of one call; the split only divides the minutes a large case costs on one core.
template <class QuantInfo>
void run_reference(const MoeRunnerConfig& cfg, const DispatchOutput& d, const QuantInfo& q, const tensor_view& out) {
  const std::int64_t m = d.num_tokens();
  const std::int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  const int parts = static_cast<int>(std::clamp<std::int64_t>(m / 8, 1, std::min<std::int64_t>(cores, 16)));
  const auto run_part = [&](std::int64_t begin, std::int64_t end) {
    DispatchOutput part = d;
    part.hidden_states = rows_of(d.hidden_states, begin, end);
    if (!d.hidden_scales.empty_view()) part.hidden_scales = rows_of(d.hidden_scales, begin, end);
    part.topk.topk_ids = rows_of(d.topk.topk_ids, begin, end);
    part.topk.topk_weights = rows_of(d.topk.topk_weights, begin, end);
    MoeRunner<reference_policy>("reference", cfg).run(part, q, rows_of(out, begin, end), {}, {});
  };
  if (parts == 1) return run_part(0, m);
  std::vector<std::exception_ptr> errors(parts);
  std::vector<std::thread> threads;
  for (int i = 0; i < parts; ++i)
    threads.emplace_back([&, i] {
      try {
        run_part(m * i / parts, m * (i + 1) / parts);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    });
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
}

// A random problem on the host with its reference output.
struct moe_problem {
  moe_shape s;
  dtype type;
  moe_options opt;
  MoeRunnerConfig cfg;
  host_tensor x, w13, w2, weights, ids, ref;
  host_tensor b13, b2;  // empty without biases

  // with_reference = false leaves ref uncomputed, for a caller that computes its own.
  moe_problem(const moe_shape& sh, dtype t, const moe_options& o, std::mt19937& rng, bool with_reference = true)
      : s(sh),
        type(t),
        opt(o),
        cfg(moe_config_params{.num_experts = sh.e,
                              .hidden_size = sh.h,
                              .intermediate_size = sh.i,
                              .top_k = sh.k,
                              .act = {.kind = o.act, .limit = o.limit},
                              .is_gated = o.gated,
                              .gate_up_layout = o.interleaved ? w13_layout::interleaved : w13_layout::halves,
                              .apply_router_weight_on_input = o.weight_on_input,
                              .routed_scaling_factor = o.scaling,
                              .no_combine = o.no_combine,
                              .inplace = o.inplace,
                              .deterministic = o.deterministic}),
        x(t, {sh.m, sh.h}),
        w13(t, {sh.e, cfg.w13_rows(), sh.h}),
        w2(t, {sh.e, sh.h, sh.i}),
        weights(dtype::f32, {sh.m, sh.k}),
        ids(dtype::i32, {sh.m, sh.k}) {
    // Scales keep every stage O(1), so relative errors mean the same at any H and I.
    fill_random(x, rng, 1.0f);
    fill_random(w13, rng, 2.0f / std::sqrt(static_cast<float>(sh.h)));
    fill_random(w2, rng, 2.0f / std::sqrt(static_cast<float>(sh.i)));
    if (o.bias) {
      // Of the order of the GEMM sums, so that a missing, doubled or misplaced bias shows.
      b13 = host_tensor(*o.bias, {sh.e, cfg.w13_rows()});
      b2 = host_tensor(*o.bias, {sh.e, sh.h});
      fill_random(b13, rng, 1.0f);
      fill_random(b2, rng, 1.0f);
    }
    if (o.nan_token >= 0) set_element(x.view, static_cast<std::int64_t>(o.nan_token) * sh.h + sh.h / 3, NAN);
    route(rng);
    ref = o.no_combine ? host_tensor(t, {sh.m, sh.k, sh.h}) : host_tensor(t, {sh.m, sh.h});
    if (!with_reference) return;
    if (o.inplace) {
      host_tensor xin = x;
      run_reference(cfg, DispatchOutput{xin.view, {}, topk(weights.view, ids.view)}, quant_info(w13, w2, b13, b2),
                    xin.view);
      std::memcpy(ref.view.data, xin.view.data, ref.view.bytes());
    } else {
      run_reference(cfg, DispatchOutput{x.view, {}, topk(weights.view, ids.view)}, quant_info(w13, w2, b13, b2),
                    ref.view);
    }
  }

  TopKOutput topk(const tensor_view& w, const tensor_view& i) const { return {w, i, opt.scaling_in_weights}; }

  // The weights (host or device copies) as the runner takes them; a bias left empty is none.
  template <class Tensor>
  static unquantized_quant_info quant_info(const Tensor& w13, const Tensor& w2, const Tensor& b13, const Tensor& b2) {
    return {w13.view, w2.view, b13.view, b2.view};
  }

  void route(std::mt19937& rng) {
    host_tensor logits(dtype::f32, {s.m, s.e});
    fill_random(logits, rng, 4.0f);
    if (opt.ids == ids_kind::skewed)
      for (std::int64_t t = 0; t < s.m; ++t)
        for (int j = 0; j < std::min(2, s.e); ++j) logits.view.ptr<float>()[t * s.e + j] += 6.0f;
    topk_config tc{.top_k = s.k,
                   .routed_scaling_factor = opt.scaling,
                   .apply_routed_scaling_factor_on_weights = opt.scaling_in_weights};
    TopKOutput out{weights.view, ids.view};
    reference::topk(logits.view, nullptr, tc, out);
    auto* id = ids.view.ptr<std::int32_t>();
    const std::int64_t slots = static_cast<std::int64_t>(s.m) * s.k;
    std::uniform_int_distribution<int> quarter(0, 3);
    for (std::int64_t q = 0; q < slots; ++q) {
      const bool middle_token = q / s.k == s.m / 2;
      switch (opt.ids) {
        case ids_kind::softmax:
        case ids_kind::skewed: break;
        case ids_kind::one_expert: id[q] = (s.e / 2 + static_cast<int>(q % s.k)) % s.e; break;
        case ids_kind::filtered:
          if (q % 3 == 1 || middle_token) id[q] = -1;
          break;
        case ids_kind::random_filtered:
          if (quarter(rng) == 0 || middle_token) id[q] = -1;
          break;
        case ids_kind::few_experts: id[q] = id[q] / 4 * 4; break;
        case ids_kind::all_filtered: id[q] = -1; break;
      }
    }
  }
};

// Device copies of a problem and a MoeRunner<reference_policy, Policy> that picked Policy, with
// exactly the workspace it asks for, starting ws_misalign bytes past an allocation boundary.
template <class Policy>
struct moe_on_device {
  using runner_t = MoeRunner<reference_policy, Policy>;
  device_tensor x, w13, w2, weights, ids;
  device_tensor b13, b2;  // empty views without biases
  device_buffer out_buf, ws_buf;
  tensor_view out;  // out_buf, or x's copy when the problem runs in place
  std::optional<runner_t> runner;
  workspace_view ws;

  explicit moe_on_device(const moe_problem& p, std::size_t ws_misalign = 0) : moe_on_device(p, p.cfg, ws_misalign) {}

  // With another config for the same problem (e.g. the combine mode switched).
  moe_on_device(const moe_problem& p, const MoeRunnerConfig& cfg, std::size_t ws_misalign)
      : x(p.x), w13(p.w13), w2(p.w2), weights(p.weights), ids(p.ids) {
    if (p.opt.bias) {
      b13 = device_tensor(p.b13);
      b2 = device_tensor(p.b2);
    }
    runner.emplace(std::string(Policy::name), cfg);
    if (p.opt.inplace) {
      out = x.view;
    } else {
      out_buf = device_buffer(p.ref.view.bytes());
      out = p.ref.view;
      out.data = out_buf.get();
      out.space = memory_space::device;
    }
    size_workspace(p, ws_misalign);
  }

  // A workspace of exactly what the runner asks for, `misalign` bytes past an allocation's
  // start. Again after changing a policy setting that the size depends on (the GEMM tuning).
  void size_workspace(const moe_problem& p, std::size_t misalign) {
    const std::size_t need = runner->workspace_bytes(p.s.m);
    ws_buf = device_buffer(need + misalign);
    ws = {static_cast<char*>(ws_buf.get()) + misalign, need};
  }

  DispatchOutput dispatch(const moe_problem& p) const { return {x.view, {}, p.topk(weights.view, ids.view)}; }

  void launch(const moe_problem& p, cudaStream_t stream) {
    runner->run(dispatch(p), moe_problem::quant_info(w13, w2, b13, b2), out, ws, cuda::stream_ref(stream));
  }

  // Every byte of the output set to `byte` (0xff: NaN in bf16 and f16, so an unwritten element fails).
  void fill_out(unsigned char byte) {
    if (out.bytes()) MOE_CUDA_CHECK(cudaMemset(out.data, byte, out.bytes()));
  }

  host_tensor result(const moe_problem& p) const {
    host_tensor h = p.ref;
    if (out.bytes()) MOE_CUDA_CHECK(cudaMemcpy(h.view.data, out.data, out.bytes(), cudaMemcpyDeviceToHost));
    return h;
  }

  // One run on a poisoned output (left as it is in place, where the output is the input).
  host_tensor run_once(const moe_problem& p) {
    if (!p.opt.inplace) fill_out(0xff);
    launch(p, nullptr);
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    return result(p);
  }
};

}  // namespace moerunner::test
