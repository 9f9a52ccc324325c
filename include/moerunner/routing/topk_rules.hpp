// The routing arithmetic, written once for the host reference and the GPU kernel.
//
// Everything that decides which experts win is specified bit for bit: scores use
// portable::exp, sums follow the order of a 32-lane warp (lane l adds experts
// l, l+32, ... in order, then a butterfly over offsets 16, 8, 4, 2, 1), and ties
// go to the lower expert (or group) index.
//
// Non-finite logits: NaN counts as -inf and +inf as the largest finite float
// (routing_logit). An expert whose logit is then -inf has probability zero: it is never
// selected (eligible), and enters the group ranking with key -inf. A slot that finds no
// eligible expert left is filtered (id -1, weight 0), so a token with no finite logit is
// routed to nothing. Every weight is finite. A NaN key (a NaN correction bias) ranks below
// every number.
#pragma once

#include <limits>

#include "moerunner/core/config.hpp"
#include "moerunner/core/limits.hpp"
#include "moerunner/core/portable_math.hpp"

namespace moerunner::routing {

inline constexpr int warp_lanes = 32;
static_assert(max_expert_groups <= warp_lanes && max_routing_experts % warp_lanes == 0);

inline constexpr float minus_inf = -std::numeric_limits<float>::infinity();
inline constexpr float largest_finite = std::numeric_limits<float>::max();

// True when (a, ia) ranks before (b, ib).
MOERUNNER_HD inline bool ranks_before(float a, int ia, float b, int ib) {
  const bool a_nan = a != a, b_nan = b != b;
  if (a_nan || b_nan) return !a_nan && b_nan ? true : (a_nan && b_nan ? ia < ib : false);
  return a > b || (a == b && ia < ib);
}

// The logit routing works with: NaN as -inf, +inf as the largest finite float (so that one
// +inf wins with weight 1, two share it, and no inf - inf ever reaches exp).
MOERUNNER_HD inline float routing_logit(float raw) {
  if (raw != raw) return minus_inf;
  return raw > largest_finite ? largest_finite : raw;
}

// Whether an expert with this routing_logit may be selected at all.
MOERUNNER_HD inline bool eligible(float logit) { return logit > minus_inf; }

MOERUNNER_HD inline float score(float logit, scoring_func f) {
  return f == scoring_func::sigmoid ? portable::sigmoid(logit) : logit;  // softmax is finished after the max/sum
}

// exp(score - max) of an eligible expert; the softmax divides it by the warp-order sum of these.
// max is an eligible expert's score, so the sum is at least exp(0) = 1.
MOERUNNER_HD inline float softmax_term(float score, float max) { return portable::exp(portable::add_rn(score, -max)); }

// What selection (and group ranking) compares: -inf for an ineligible expert, else the score
// plus the correction bias.
MOERUNNER_HD inline float selection_key(bool is_eligible, float score, bool has_bias, float bias) {
  if (!is_eligible) return minus_inf;
  return has_bias ? portable::add_rn(score, bias) : score;
}

// The weight written for a routed slot from its score (0 for a filtered slot) and the sum of
// the token's selected scores in selection order. A zero sum (every selected score underflowed,
// or nothing selected) leaves zeros rather than 0/0.
MOERUNNER_HD inline float routed_weight(float score, float selected_sum, bool renormalize, bool apply_scaling,
                                        float routed_scaling) {
  float w = score;
  if (renormalize) w = selected_sum > 0.0f ? portable::div_rn(w, selected_sum) : 0.0f;
  if (apply_scaling) w = portable::mul_rn(w, routed_scaling);
  return w;
}

// The weight written into every fused shared-expert slot. `shared_weight` is the factor the
// shared expert's output gets in the end: where routed_scaling_factor is left to the runner
// (not applied on the weights) the runner multiplies this slot by it too, so it is divided out
// here (SGLang's 1 / routed_scaling_factor for a weight of 1).
MOERUNNER_HD inline float shared_slot_weight(float shared_weight, bool apply_scaling, float routed_scaling) {
  return apply_scaling ? shared_weight : portable::div_rn(shared_weight, routed_scaling);
}

}  // namespace moerunner::routing
