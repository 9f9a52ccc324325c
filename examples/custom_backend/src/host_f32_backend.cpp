// The host_f32 backend's run, and its registration under the name "host_f32".
#include "host_f32_policy.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "moerunner/core/host_float.hpp"
#include "moerunner/registry/register_backend.hpp"

namespace custom_backend {

namespace {

namespace mr = moerunner;

float load(const mr::tensor_view& t, std::int64_t i) {
  switch (t.type) {
    case mr::dtype::f32: return t.ptr<const float>()[i];
    case mr::dtype::bf16: return mr::host_float::bf16_to_float(t.ptr<const std::uint16_t>()[i]);
    case mr::dtype::f16: return mr::host_float::half_to_float(t.ptr<const std::uint16_t>()[i]);
    default: return NAN;  // rejected before any load
  }
}

void store(const mr::tensor_view& t, std::int64_t i, float v) {
  switch (t.type) {
    case mr::dtype::f32: t.ptr<float>()[i] = v; break;
    case mr::dtype::bf16: t.ptr<std::uint16_t>()[i] = mr::host_float::float_to_bf16(v); break;
    case mr::dtype::f16: t.ptr<std::uint16_t>()[i] = mr::host_float::float_to_half(v); break;
    default: break;  // rejected before any store
  }
}

float activate(const mr::activation& a, bool gated, float gate, float up) {
  switch (a.kind) {
    case mr::activation_kind::silu: {
      const float s = gate / (1.0f + std::exp(-gate));
      return gated ? s * up : s;
    }
    case mr::activation_kind::gelu: {
      const float g = 0.5f * gate * (1.0f + std::erf(gate * 0.70710678f));
      return gated ? g * up : g;
    }
    case mr::activation_kind::swiglu_clamped: {
      const float g = std::min(gate, a.limit);
      const float u = std::clamp(up, -a.limit, a.limit);
      return (u + 1.0f) * g / (1.0f + std::exp(-a.alpha * g));
    }
  }
  return NAN;
}

}  // namespace

std::size_t host_f32_policy::workspace_bytes(std::int64_t num_tokens) const {
  const std::int64_t rows = cfg_.no_combine() ? num_tokens * cfg_.top_k() : num_tokens;
  return static_cast<std::size_t>(rows * cfg_.hidden_size() + cfg_.intermediate_size()) * sizeof(float);
}

mr::CombineInput host_f32_policy::run_from_dispatch(const mr::DispatchOutput& d, const mr::unquantized_quant_info& q,
                                                    const mr::tensor_view& out, mr::workspace_view ws,
                                                    cuda::stream_ref) {
  constexpr const char* where = "host_f32_policy";
  const std::int64_t m = d.num_tokens();
  const int k = cfg_.top_k(), h = cfg_.hidden_size(), inter = cfg_.intermediate_size();
  // Everything is checked before the first store, so a rejected call writes nothing.
  if (d.hidden_states.type == mr::dtype::f8_e4m3)
    throw mr::unsupported_error(std::string(where) + ": fp8 activations need the fp8_block format");
  const auto* ids = d.topk.topk_ids.ptr<const std::int32_t>();
  const auto* weights = d.topk.topk_weights.ptr<const float>();
  for (std::int64_t s = 0; s < m * k; ++s)
    MOE_EXPECT(ids[s] >= -1 && ids[s] < cfg_.num_local_experts(), where,
               "topk_ids holds " + std::to_string(ids[s]) + ", outside [-1, num_local_experts)");
  MOE_EXPECT(ws.bytes >= workspace_bytes(m), where, "workspace too small (ask workspace_bytes)");

  const std::int64_t out_rows = cfg_.no_combine() ? m * k : m;
  float* acc = static_cast<float*>(ws.data);
  float* act = acc + out_rows * h;
  std::fill(acc, acc + out_rows * h, 0.0f);
  const float scaling = d.topk.routed_scaling_applied ? 1.0f : cfg_.routed_scaling_factor();
  const std::int64_t w13_rows = cfg_.w13_rows();

  std::vector<std::int64_t> slots;
  for (int e = 0; e < cfg_.num_local_experts(); ++e) {
    slots.clear();
    for (std::int64_t s = 0; s < m * k; ++s)
      if (ids[s] == e) slots.push_back(s);
    const std::int64_t w13_base = e * w13_rows * h, w2_base = std::int64_t{e} * h * inter;
    for (const std::int64_t s : slots) {
      const std::int64_t t = s / k;
      const float router_weight = weights[s];
      const float in_scale = cfg_.apply_router_weight_on_input() ? router_weight : 1.0f;
      for (int i = 0; i < inter; ++i) {
        float gate = 0.0f, up = 0.0f;
        for (int c = 0; c < h; ++c) {
          const float x = in_scale * load(d.hidden_states, t * h + c);
          gate += load(q.w13, w13_base + std::int64_t{i} * h + c) * x;
          if (cfg_.is_gated()) up += load(q.w13, w13_base + std::int64_t{inter + i} * h + c) * x;
        }
        act[i] = activate(cfg_.act(), cfg_.is_gated(), gate, up);
      }
      const float row_scale = (cfg_.apply_router_weight_on_input() ? 1.0f : router_weight) * scaling;
      float* dst = acc + (cfg_.no_combine() ? s : t) * h;
      for (int r = 0; r < h; ++r) {
        float y = 0.0f;
        for (int i = 0; i < inter; ++i) y += load(q.w2, w2_base + std::int64_t{r} * inter + i) * act[i];
        dst[r] += y * row_scale;
      }
    }
  }
  // Written last and from the accumulators, so an output that aliases the input (inplace) is safe.
  for (std::int64_t i = 0; i < out_rows * h; ++i) store(out, i, acc[i]);
  return {out, !cfg_.no_combine()};
}

}  // namespace custom_backend

// One line makes the backend selectable by name in every MoeRunner that lists the policy.
MOE_REGISTER_BACKEND(custom_backend::host_f32_policy);
