// The `reference` backend: the whole runner core on the host, in double.
// It is the oracle for every other backend and the default where no GPU exists.
// Each token's output is computed alone, in a fixed order: deterministic and batch-invariant.
// It allocates host scratch internally (its workspace query is 0).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "moerunner/core/concepts.hpp"
#include "moerunner/core/host_float.hpp"
#include "moerunner/reference/activation.hpp"
#include "moerunner/reference/routing.hpp"
#include "moerunner/runner/validate.hpp"

namespace moerunner {

namespace reference {

// Quantizes `v` (length n) in groups of 128 to e4m3 and returns the dequantized values: the
// activation path of every fp8 format, by the GPU's rule (kernel_quantize_fp8.cuh): scale =
// amax / 448 in f32 (at least 2^-126; 1 where amax is 0), each value as an f32 times the f32
// reciprocal of the scale, rounded to e4m3.
inline void fp8_group_roundtrip(std::vector<double>& v) {
  for (std::size_t g = 0; g < v.size(); g += 128) {
    const std::size_t end = std::min(v.size(), g + 128);
    double amax = 0.0;
    for (std::size_t i = g; i < end; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float scale =
        amax > 0.0 ? std::max(static_cast<float>(amax / 448.0), std::numeric_limits<float>::min()) : 1.0f;
    const float inverse = 1.0f / scale;
    for (std::size_t i = g; i < end; ++i)
      v[i] = static_cast<double>(host_float::e4m3_to_float(
                 host_float::float_to_e4m3(static_cast<float>(v[i]) * inverse))) *
             scale;
  }
}

inline void store_from_double(const tensor_view& t, std::int64_t i, double v) {
  const float f = static_cast<float>(v);
  switch (t.type) {
    case dtype::f32: t.ptr<float>()[i] = f; break;
    case dtype::bf16: t.ptr<std::uint16_t>()[i] = host_float::float_to_bf16(f); break;
    case dtype::f16: t.ptr<std::uint16_t>()[i] = host_float::float_to_half(f); break;
    default: break;  // output dtypes are checked before any store
  }
}

// One expert's weight matrix [rows, cols] as doubles, times its fp8 scale where there is one,
// a row at a time.
class expert_matrix {
 public:
  expert_matrix(const tensor_view& w, const tensor_view* scale, fp8_weight_scaling scaling, int expert)
      : w_(w), scale_(scale), scaling_(scaling), e_(expert) {}

  // Row r into dst[0, cols): element c is the weight as a double times its scale (a float).
  void row(std::int64_t r, std::vector<float>& staged, std::vector<double>& dst) const {
    const std::int64_t rows = w_.shape[1], cols = w_.shape[2];
    staged.resize(static_cast<std::size_t>(cols));
    dst.resize(static_cast<std::size_t>(cols));
    detail::load_run_as_float(w_, (e_ * rows + r) * cols, cols, staged.data());
    for (std::int64_t c = 0; c < cols; ++c) {
      double v = staged[c];
      if (scale_) v *= scale_->ptr<const float>()[fp8_weight_scale_index(scaling_, e_, r, c, rows, cols)];
      dst[c] = v;
    }
  }

 private:
  const tensor_view& w_;
  const tensor_view* scale_;
  fp8_weight_scaling scaling_;
  std::int64_t e_;
};

}  // namespace reference

class reference_policy {
 public:
  static constexpr std::string_view name = "reference";
  static constexpr memory_space tensor_space = memory_space::host;
  using quant_infos =
      quant_info_list<unquantized_quant_info, fp8_block_quant_info, fp8_tensor_quant_info, fp8_channel_quant_info>;

  explicit reference_policy(const MoeRunnerConfig& cfg) : cfg_(cfg) {}
  std::size_t workspace_bytes(std::int64_t) const { return 0; }

  CombineInput run_from_dispatch(const DispatchOutput& d, const unquantized_quant_info& q, const tensor_view& out,
                                 workspace_view, cuda::stream_ref) const {
    run(d, q.w13, nullptr, q.w2, nullptr, {}, q.b13, q.b2, out);
    return {out, !cfg_.no_combine()};
  }

  template <fp8_weight_format Q>
  CombineInput run_from_dispatch(const DispatchOutput& d, const Q& q, const tensor_view& out, workspace_view,
                                 cuda::stream_ref) const {
    run(d, q.w13, &q.w13_scale, q.w2, &q.w2_scale, Q::scaling, {}, {}, out);
    return {out, !cfg_.no_combine()};
  }

 private:
  // Element i of an optional bias, 0 where there is none.
  static double bias(const tensor_view& b, std::int64_t i) {
    return b.empty_view() ? 0.0 : reference::detail::load_as_float(b, i);
  }

  // Loads token t's input row as doubles (dequantizing fp8 activations by their group scales).
  std::vector<double> load_row(const DispatchOutput& d, std::int64_t t) const {
    const int h = cfg_.hidden_size();
    std::vector<double> x(h);
    for (int c = 0; c < h; ++c) {
      x[c] = reference::detail::load_as_float(d.hidden_states, t * h + c);
      if (d.hidden_states.type == dtype::f8_e4m3)
        x[c] *= d.hidden_scales.ptr<const float>()[t * d.hidden_scales.shape[1] + c / 128];
    }
    return x;
  }

  // s13, s2: fp8 weight scales of granularity `weight_scaling`, or null for unquantized weights;
  // b13, b2: per-expert biases, or empty views for none.
  void run(const DispatchOutput& d, const tensor_view& w13, const tensor_view* s13, const tensor_view& w2,
           const tensor_view* s2, fp8_weight_scaling weight_scaling, const tensor_view& b13, const tensor_view& b2,
           const tensor_view& out) const {
    const bool fp8 = s13 != nullptr;
    // Again here, for a caller that runs the policy without a runner: before any store.
    detail::validate_host_ids(cfg_, d.topk.topk_ids, "reference_policy");
    const std::int64_t m = d.num_tokens();
    const int k = cfg_.top_k(), h = cfg_.hidden_size(), inter = cfg_.intermediate_size();
    const double scaling = d.topk.routed_scaling_applied ? 1.0 : cfg_.routed_scaling_factor();
    const auto* ids = d.topk.topk_ids.ptr<const std::int32_t>();
    const auto* wts = d.topk.topk_weights.ptr<const float>();
    // A token's rows are computed into a buffer and stored after its input row is read, so that
    // inplace (out aliases x, row for row) is safe; its size is bounded by the config's limits.
    const int rows_per_token = cfg_.no_combine() ? k : 1;
    std::vector<double> result(static_cast<std::size_t>(rows_per_token) * h);
    std::vector<double> act(inter);
    std::vector<float> staged;  // one weight row as floats (expert_matrix::row's scratch)
    std::vector<double> wrow;   // the same row as doubles times its scales
    for (std::int64_t t = 0; t < m; ++t) {
      std::vector<double> x0 = load_row(d, t);
      // fp8: the token's row is quantized once (per 128 values), whatever its slots; a router
      // weight applied on the input then scales GEMM1's sums (act(W (w x)) = act(w (W x))), as
      // the GPU backends do, so that the quantized row is the same for every slot.
      if (fp8 && d.hidden_states.type != dtype::f8_e4m3) reference::fp8_group_roundtrip(x0);
      std::fill(result.begin(), result.end(), 0.0);
      for (int j = 0; j < k; ++j) {
        const int e = ids[t * k + j];
        if (e < 0) continue;  // filtered slot: contributes nothing
        const double wgt = wts[t * k + j];
        std::vector<double> x = x0;
        const double sum_scale = fp8 && cfg_.apply_router_weight_on_input() ? wgt : 1.0;
        if (!fp8 && cfg_.apply_router_weight_on_input())
          for (double& v : x) v *= wgt;
        const reference::expert_matrix a(w13, s13, weight_scaling, e), b(w2, s2, weight_scaling, e);
        const std::int64_t rows13 = cfg_.w13_rows();
        for (int i = 0; i < inter; ++i) {
          const std::int64_t gate_row = w13_row(cfg_.gate_up_layout(), 0, i, inter);
          const std::int64_t up_row = w13_row(cfg_.gate_up_layout(), 1, i, inter);
          double gate = bias(b13, e * rows13 + gate_row), up = 0.0;
          a.row(gate_row, staged, wrow);
          for (int c = 0; c < h; ++c) gate += wrow[c] * x[c];
          gate *= sum_scale;
          if (cfg_.is_gated()) {
            up = bias(b13, e * rows13 + up_row);
            a.row(up_row, staged, wrow);
            for (int c = 0; c < h; ++c) up += wrow[c] * x[c];
            up *= sum_scale;
          }
          act[i] = reference::apply_activation(cfg_.act(), cfg_.is_gated(), gate, up);
        }
        if (fp8) reference::fp8_group_roundtrip(act);
        const double row_scale = (cfg_.apply_router_weight_on_input() ? 1.0 : wgt) * scaling;
        double* dst = result.data() + (cfg_.no_combine() ? j : 0) * h;
        for (int r = 0; r < h; ++r) {
          double acc = bias(b2, static_cast<std::int64_t>(e) * h + r);
          b.row(r, staged, wrow);
          for (int i = 0; i < inter; ++i) acc += wrow[i] * act[i];
          dst[r] += acc * row_scale;
        }
      }
      const std::int64_t first = t * rows_per_token * h;
      for (std::size_t i = 0; i < result.size(); ++i)
        reference::store_from_double(out, first + static_cast<std::int64_t>(i), result[i]);
    }
  }

  MoeRunnerConfig cfg_;
};

static_assert(explain_dispatch_runner_core<reference_policy>());
static_assert(!std::is_polymorphic_v<reference_policy>);

}  // namespace moerunner
