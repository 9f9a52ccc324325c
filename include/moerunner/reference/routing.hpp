// Reference top-k routing on the host: the oracle the GPU routing kernel matches
// id for id (see routing/topk_rules.hpp for the exact arithmetic).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "moerunner/core/config.hpp"
#include "moerunner/core/host_float.hpp"
#include "moerunner/core/types.hpp"
#include "moerunner/routing/topk_rules.hpp"

namespace moerunner::reference {

namespace detail {

inline float load_as_float(const tensor_view& t, std::int64_t i) {
  switch (t.type) {
    case dtype::f32: return t.ptr<const float>()[i];
    case dtype::bf16: return host_float::bf16_to_float(t.ptr<const std::uint16_t>()[i]);
    case dtype::f16: return host_float::half_to_float(t.ptr<const std::uint16_t>()[i]);
    case dtype::f8_e4m3: return host_float::e4m3_to_float(t.ptr<const std::uint8_t>()[i]);
    case dtype::i32: return static_cast<float>(t.ptr<const std::int32_t>()[i]);
  }
  return 0.0f;
}

// Elements [first, first + n) of t as floats, load_as_float's values with one dtype switch for
// the whole run.
inline void load_run_as_float(const tensor_view& t, std::int64_t first, std::int64_t n, float* dst) {
  switch (t.type) {
    case dtype::f32: std::copy_n(t.ptr<const float>() + first, n, dst); return;
    case dtype::bf16: {
      const std::uint16_t* src = t.ptr<const std::uint16_t>() + first;
      for (std::int64_t i = 0; i < n; ++i) dst[i] = host_float::bf16_to_float(src[i]);
      return;
    }
    case dtype::f8_e4m3: {
      const std::uint8_t* src = t.ptr<const std::uint8_t>() + first;
      const std::array<float, 256>& table = host_float::e4m3_table();
      for (std::int64_t i = 0; i < n; ++i) dst[i] = table[src[i]];
      return;
    }
    default:
      for (std::int64_t i = 0; i < n; ++i) dst[i] = load_as_float(t, first + i);
  }
}

// The warp-order sum of routing/topk_rules.hpp over the eligible experts, emulated lane by lane.
inline float warp_order_sum(const float* v, const std::vector<char>& eligible, int n) {
  std::array<float, routing::warp_lanes> lane{};
  for (int e = 0; e < n; ++e)
    if (eligible[e]) lane[e % routing::warp_lanes] = portable::add_rn(lane[e % routing::warp_lanes], v[e]);
  for (int off = routing::warp_lanes / 2; off > 0; off /= 2) {
    std::array<float, routing::warp_lanes> next{};
    for (int l = 0; l < routing::warp_lanes; ++l) next[l] = portable::add_rn(lane[l], lane[l ^ off]);
    lane = next;
  }
  return lane[0];
}

}  // namespace detail

// Slots per token in the outputs: the routed ones, then the fused shared experts.
inline int topk_slots(const topk_config& cfg) { return cfg.top_k + cfg.num_fused_shared_experts; }

inline void validate_topk_args(const topk_config& cfg, int num_experts, const char* where) {
  MOE_EXPECT(cfg.top_k >= 1 && cfg.top_k <= std::min(num_experts, routing::max_routing_top_k), where,
             "top_k must be in [1, min(num_experts, " + std::to_string(routing::max_routing_top_k) + ")], got " +
                 std::to_string(cfg.top_k));
  MOE_EXPECT(num_experts <= routing::max_routing_experts, where,
             "routing supports at most " + std::to_string(routing::max_routing_experts) + " experts, got " +
                 std::to_string(num_experts));
  MOE_EXPECT(std::isfinite(cfg.routed_scaling_factor) && cfg.routed_scaling_factor > 0.0f, where,
             "routed_scaling_factor must be finite and positive");
  MOE_EXPECT(!scoring_name(cfg.scoring).empty(), where,
             "scoring must be softmax or sigmoid, got the value " + std::to_string(static_cast<int>(cfg.scoring)));
  MOE_EXPECT(cfg.num_fused_shared_experts >= 0 && cfg.num_fused_shared_experts <= max_top_k - cfg.top_k, where,
             "num_fused_shared_experts must be in [0, " + std::to_string(max_top_k) +
                 " - top_k] (the runner takes at most " + std::to_string(max_top_k) + " slots per token), got " +
                 std::to_string(cfg.num_fused_shared_experts));
  if (cfg.num_fused_shared_experts > 0)
    MOE_EXPECT(std::isfinite(routing::shared_slot_weight(cfg.fused_shared_expert_weight,
                                                         cfg.apply_routed_scaling_factor_on_weights,
                                                         cfg.routed_scaling_factor)),
               where, "fused_shared_expert_weight must be finite (also over routed_scaling_factor)");
  MOE_EXPECT(cfg.num_expert_group >= 0, where,
             "num_expert_group must be at least 0 (0: no grouping), got " + std::to_string(cfg.num_expert_group));
  if (cfg.num_expert_group > 0) {
    MOE_EXPECT(num_experts % cfg.num_expert_group == 0, where,
               "num_expert_group must divide num_experts (" + std::to_string(num_experts) + "), got " +
                   std::to_string(cfg.num_expert_group));
    MOE_EXPECT(cfg.num_expert_group <= routing::max_expert_groups, where,
               "num_expert_group must be at most " + std::to_string(routing::max_expert_groups));
    MOE_EXPECT(cfg.topk_group >= 1 && cfg.topk_group <= cfg.num_expert_group, where,
               "topk_group must be in [1, num_expert_group], got " + std::to_string(cfg.topk_group));
    MOE_EXPECT(cfg.topk_group * (num_experts / cfg.num_expert_group) >= cfg.top_k, where,
               "the kept groups hold fewer experts than top_k");
  } else {
    MOE_EXPECT(cfg.topk_group == 0, where, "topk_group is set but num_expert_group is 0");
  }
}

// Checks shared by the host and GPU entry points; `space` is where tensors must be.
inline void validate_topk(const tensor_view& logits, const tensor_view* bias, const topk_config& cfg,
                          const TopKOutput& out, memory_space space, const char* where) {
  check::rank(logits, 2, where, "router_logits");
  check::space(logits, space, where, "router_logits");
  check::contiguous(logits, where, "router_logits");
  check::non_null(logits, where, "router_logits");
  MOE_EXPECT(is_activation_dtype(logits.type), where,
             "router_logits must be f32, f16 or bf16, got " + std::string(dtype_name(logits.type)));
  const auto m = logits.shape[0];
  const int e = static_cast<int>(logits.shape[1]);
  MOE_EXPECT(e >= 1, where, "router_logits must have at least one expert column");
  validate_topk_args(cfg, e, where);
  if (bias) {
    check::dense(*bias, 1, dtype::f32, space, where, "correction_bias");
    check::dim(*bias, 0, e, where, "correction_bias");
  }
  check::dense(out.topk_weights, 2, dtype::f32, space, where, "topk_weights");
  check::dense(out.topk_ids, 2, dtype::i32, space, where, "topk_ids");
  const int slots = topk_slots(cfg);
  check::dim(out.topk_weights, 0, m, where, "topk_weights");
  check::dim(out.topk_weights, 1, slots, where, "topk_weights");
  check::dim(out.topk_ids, 0, m, where, "topk_ids");
  check::dim(out.topk_ids, 1, slots, where, "topk_ids");
}

// Routes one token; `scores` receives the unbiased scores (0 where ineligible), ids/weights
// the token's topk_slots(cfg) results.
inline void route_token(const float* logits, const float* bias, int num_experts, const topk_config& cfg,
                        float* scores, std::int32_t* ids, float* weights) {
  using routing::ranks_before;
  const int E = num_experts;
  std::vector<char> eligible(E);
  float mx = routing::minus_inf;
  for (int i = 0; i < E; ++i) {
    const float logit = routing::routing_logit(logits[i]);
    eligible[i] = routing::eligible(logit);
    scores[i] = eligible[i] ? routing::score(logit, cfg.scoring) : 0.0f;
    if (eligible[i]) mx = std::max(mx, scores[i]);
  }
  if (cfg.scoring == scoring_func::softmax) {
    for (int i = 0; i < E; ++i)
      if (eligible[i]) scores[i] = routing::softmax_term(scores[i], mx);
    const float sum = detail::warp_order_sum(scores, eligible, E);
    for (int i = 0; i < E; ++i)
      if (eligible[i]) scores[i] = portable::div_rn(scores[i], sum);
  }
  std::vector<float> key(E);
  for (int i = 0; i < E; ++i) key[i] = routing::selection_key(eligible[i], scores[i], bias != nullptr, bias ? bias[i] : 0.0f);

  std::vector<char> allowed(E, 1);
  if (cfg.num_expert_group > 0) {
    const int G = cfg.num_expert_group, per = E / G;
    std::vector<float> gscore(G);
    for (int g = 0; g < G; ++g) {
      // Group score: the best key, or with a bias the sum of the best two keys.
      int b1 = -1, b2 = -1;
      for (int i = g * per; i < (g + 1) * per; ++i) {
        if (b1 < 0 || ranks_before(key[i], i, key[b1], b1)) { b2 = b1; b1 = i; }
        else if (b2 < 0 || ranks_before(key[i], i, key[b2], b2)) b2 = i;
      }
      gscore[g] = (bias && per >= 2) ? portable::add_rn(key[b1], key[b2]) : key[b1];
    }
    std::vector<char> keep(G, 0);
    for (int r = 0; r < cfg.topk_group; ++r) {
      int best = -1;
      for (int g = 0; g < G; ++g)
        if (!keep[g] && (best < 0 || ranks_before(gscore[g], g, gscore[best], best))) best = g;
      keep[best] = 1;
    }
    for (int i = 0; i < E; ++i) allowed[i] = keep[i / per];
  }

  std::vector<char> taken(E, 0);
  float selected_sum = 0.0f;
  for (int j = 0; j < cfg.top_k; ++j) {
    int best = -1;
    for (int i = 0; i < E; ++i)
      if (allowed[i] && eligible[i] && !taken[i] && (best < 0 || ranks_before(key[i], i, key[best], best))) best = i;
    if (best >= 0) taken[best] = 1;
    ids[j] = best;
    weights[j] = best >= 0 ? scores[best] : 0.0f;
    selected_sum = portable::add_rn(selected_sum, weights[j]);
  }
  for (int j = 0; j < cfg.top_k; ++j)
    weights[j] = routing::routed_weight(weights[j], selected_sum, cfg.renormalize,
                                        cfg.apply_routed_scaling_factor_on_weights, cfg.routed_scaling_factor);
  const float shared = routing::shared_slot_weight(cfg.fused_shared_expert_weight,
                                                   cfg.apply_routed_scaling_factor_on_weights, cfg.routed_scaling_factor);
  for (int s = 0; s < cfg.num_fused_shared_experts; ++s) {
    ids[cfg.top_k + s] = E + s;
    weights[cfg.top_k + s] = shared;
  }
}

// router_logits [M, E] -> out.topk_weights [M, k + n] f32, out.topk_ids [M, k + n] i32 (n fused
// shared experts), on the host.
inline void topk(const tensor_view& router_logits, const tensor_view* correction_bias, const topk_config& cfg,
                 TopKOutput& out) {
  validate_topk(router_logits, correction_bias, cfg, out, memory_space::host, "reference::topk");
  const auto m = router_logits.shape[0];
  const int e = static_cast<int>(router_logits.shape[1]);
  const int slots = topk_slots(cfg);
  std::vector<float> row(e), scores(e);
  for (std::int64_t t = 0; t < m; ++t) {
    for (int i = 0; i < e; ++i) row[i] = detail::load_as_float(router_logits, t * e + i);
    route_token(row.data(), correction_bias ? correction_bias->ptr<const float>() : nullptr, e, cfg, scores.data(),
                out.topk_ids.ptr<std::int32_t>() + t * slots, out.topk_weights.ptr<float>() + t * slots);
  }
  out.routed_scaling_applied = cfg.apply_routed_scaling_factor_on_weights;
}

}  // namespace moerunner::reference
