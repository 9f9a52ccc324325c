// MoeRunnerConfig: the static description of one MoE layer, validated when built.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>

#include "moerunner/core/error.hpp"
#include "moerunner/core/limits.hpp"

namespace moerunner {

enum class activation_kind : std::uint8_t { silu, gelu, swiglu_clamped };

// Empty for a value outside the enumerators (made by a cast), which validation rejects.
constexpr std::string_view activation_name(activation_kind k) {
  switch (k) {
    case activation_kind::silu: return "silu";
    case activation_kind::gelu: return "gelu";
    case activation_kind::swiglu_clamped: return "swiglu_clamped";
  }
  return {};
}

// The gated activation applied between the two GEMMs. For swiglu_clamped (gpt-oss):
//   g = min(gate, limit); u = clamp(up, -limit, limit); out = (u + 1) * g * sigmoid(alpha * g).
struct activation {
  activation_kind kind = activation_kind::silu;
  float alpha = 1.702f;
  float limit = 7.0f;
};

// How w13[e] ([2I, H]) orders the gate and up rows, and b13[e] its 2I values alike: halves
// (rows 0..I-1 gate, I..2I-1 up) or interleaved (row 2j gate j, row 2j+1 up j, as SGLang and
// vLLM load gpt-oss checkpoints).
enum class w13_layout : std::uint8_t { halves, interleaved };

constexpr std::string_view w13_layout_name(w13_layout l) {
  switch (l) {
    case w13_layout::halves: return "halves";
    case w13_layout::interleaved: return "interleaved";
  }
  return "?";
}

// The row of w13[e] (and the column of b13[e]) holding gate (half 0) or up (half 1) value j
// of an expert with `inter` = I intermediate values.
constexpr std::int64_t w13_row(w13_layout l, int half, std::int64_t j, std::int64_t inter) {
  return l == w13_layout::interleaved ? 2 * j + half : half * inter + j;
}

// Plain aggregate for designated initializers; MoeRunnerConfig validates it.
struct moe_config_params {
  int num_experts = 0;
  int num_local_experts = 0;  // 0 means "all experts are local"
  int hidden_size = 0;
  int intermediate_size = 0;  // per expert, I
  int top_k = 0;
  activation act{};
  bool is_gated = true;  // w13 holds gate and up rows [2I, H]; false means w1 only [I, H]
  w13_layout gate_up_layout = w13_layout::halves;  // interleaved needs is_gated
  bool apply_router_weight_on_input = false;
  float routed_scaling_factor = 1.0f;
  bool no_combine = false;  // leave the [M, k, H] rows uncombined
  bool inplace = false;     // write the output over hidden_states
  // Same bits on every run. Off, a backend may sum a token's expert rows in whatever order
  // they finish (cuda_fused: atomics in GEMM2's epilogue, no [M*k, H] intermediate).
  bool deterministic = false;
  // A token's output bits depend only on its own input and routing, never on how many tokens
  // run with it or which (reproducible serving). Implies deterministic. cuda_fused: one GEMM
  // kernel family and K order for every M, no K split that depends on M, combine in slot order.
  bool batch_invariant = false;
};

class MoeRunnerConfig {
 public:
  explicit MoeRunnerConfig(const moe_config_params& p) : p_(p) {
    if (p_.num_local_experts == 0) p_.num_local_experts = p_.num_experts;
    if (p_.batch_invariant) p_.deterministic = true;
    validate();
  }

  int num_experts() const { return p_.num_experts; }
  int num_local_experts() const { return p_.num_local_experts; }
  int hidden_size() const { return p_.hidden_size; }
  int intermediate_size() const { return p_.intermediate_size; }
  int top_k() const { return p_.top_k; }
  const activation& act() const { return p_.act; }
  bool is_gated() const { return p_.is_gated; }
  w13_layout gate_up_layout() const { return p_.gate_up_layout; }
  bool apply_router_weight_on_input() const { return p_.apply_router_weight_on_input; }
  float routed_scaling_factor() const { return p_.routed_scaling_factor; }
  bool no_combine() const { return p_.no_combine; }
  bool inplace() const { return p_.inplace; }
  bool deterministic() const { return p_.deterministic; }
  bool batch_invariant() const { return p_.batch_invariant; }
  // Rows of w13 per expert: 2I when gated, I otherwise.
  int w13_rows() const { return p_.is_gated ? 2 * p_.intermediate_size : p_.intermediate_size; }
  const moe_config_params& params() const { return p_; }

 private:
  void validate() const {
    constexpr const char* where = "MoeRunnerConfig";
    auto in_range = [](std::int64_t v, std::int64_t lo, std::int64_t hi) { return v >= lo && v <= hi; };
    MOE_EXPECT(in_range(p_.num_experts, 1, max_num_experts), where,
               "num_experts must be in [1, " + std::to_string(max_num_experts) + "], got " +
                   std::to_string(p_.num_experts));
    MOE_EXPECT(in_range(p_.num_local_experts, 1, p_.num_experts), where,
               "num_local_experts must be in [1, num_experts=" + std::to_string(p_.num_experts) + "], got " +
                   std::to_string(p_.num_local_experts));
    MOE_EXPECT(in_range(p_.hidden_size, 1, max_feature_size), where,
               "hidden_size must be in [1, " + std::to_string(max_feature_size) + "], got " +
                   std::to_string(p_.hidden_size));
    MOE_EXPECT(in_range(p_.intermediate_size, 1, max_feature_size), where,
               "intermediate_size must be in [1, " + std::to_string(max_feature_size) + "], got " +
                   std::to_string(p_.intermediate_size));
    MOE_EXPECT(in_range(p_.top_k, 1, std::min(p_.num_experts, max_top_k)), where,
               "top_k must be in [1, min(num_experts, " + std::to_string(max_top_k) + ")], got " +
                   std::to_string(p_.top_k));
    MOE_EXPECT(std::isfinite(p_.routed_scaling_factor) && p_.routed_scaling_factor > 0.0f, where,
               "routed_scaling_factor must be finite and positive");
    MOE_EXPECT(!activation_name(p_.act.kind).empty(), where,
               "act.kind must be silu, gelu or swiglu_clamped, got the value " +
                   std::to_string(static_cast<int>(p_.act.kind)));
    if (p_.act.kind == activation_kind::swiglu_clamped) {
      MOE_EXPECT(p_.is_gated, where, "swiglu_clamped needs is_gated = true");
      MOE_EXPECT(std::isfinite(p_.act.alpha) && p_.act.alpha > 0.0f, where,
                 "swiglu_clamped alpha must be finite and positive");
      MOE_EXPECT(std::isfinite(p_.act.limit) && p_.act.limit > 0.0f, where,
                 "swiglu_clamped limit must be finite and positive");
    }
    MOE_EXPECT(p_.gate_up_layout == w13_layout::halves || p_.gate_up_layout == w13_layout::interleaved, where,
               "gate_up_layout must be halves or interleaved, got " +
                   std::to_string(static_cast<int>(p_.gate_up_layout)));
    MOE_EXPECT(p_.is_gated || p_.gate_up_layout == w13_layout::halves, where,
               "gate_up_layout interleaved needs is_gated = true (w13 has no up rows to interleave)");
    MOE_EXPECT(!p_.apply_router_weight_on_input || p_.top_k == 1, where,
               "apply_router_weight_on_input needs top_k = 1 (the weight scales the shared input row)");
    MOE_EXPECT(!(p_.inplace && p_.no_combine), where, "inplace and no_combine exclude each other");
  }

  moe_config_params p_;
};

enum class scoring_func : std::uint8_t { softmax, sigmoid };

// Empty for a value outside the enumerators (made by a cast), which validation rejects.
constexpr std::string_view scoring_name(scoring_func f) {
  switch (f) {
    case scoring_func::softmax: return "softmax";
    case scoring_func::sigmoid: return "sigmoid";
  }
  return {};
}

// Routing (top-k) settings, kept apart from the runner config as the engines do.
struct topk_config {
  int top_k = 0;
  scoring_func scoring = scoring_func::softmax;
  bool renormalize = true;
  int num_expert_group = 0;  // 0: no grouping
  int topk_group = 0;
  float routed_scaling_factor = 1.0f;
  // Fold routed_scaling_factor into topk_weights; the combine step then does not apply it again.
  bool apply_routed_scaling_factor_on_weights = false;
  // Fused shared experts (SGLang's num_fused_shared_experts): n shared experts appended to every
  // token's routing, so that a runner over E + n experts computes them with the routed ones.
  // The outputs are [M, top_k + n]: slot top_k + s holds id E + s (E: the logits' columns) and
  // the weight below, whatever the logits; renormalization covers the routed slots only.
  int num_fused_shared_experts = 0;
  // The factor each shared expert's output gets in the end, after routed scaling (1: added as
  // it is, as DeepSeek and Qwen do). Where the runner applies routed_scaling_factor (not folded
  // into the weights), the slots hold this over routed_scaling_factor (routing/topk_rules.hpp).
  float fused_shared_expert_weight = 1.0f;
};

}  // namespace moerunner
