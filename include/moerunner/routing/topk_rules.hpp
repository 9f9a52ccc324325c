// The routing arithmetic, written once for the host reference and the GPU kernel.
//
// Everything that decides which experts win is specified bit for bit: scores use
// portable::exp, sums follow the order of a 32-lane warp (lane l adds experts
// l, l+32, ... in order, then a butterfly over offsets 16, 8, 4, 2, 1), and ties
// go to the lower expert (or group) index. NaN scores rank below everything and are left
// out of the softmax sum, so a NaN logit never wins and never spoils the other weights.
#pragma once

#include "moerunner/core/config.hpp"
#include "moerunner/core/limits.hpp"
#include "moerunner/core/portable_math.hpp"

namespace moerunner::routing {

inline constexpr int warp_lanes = 32;
static_assert(max_expert_groups <= warp_lanes && max_routing_experts % warp_lanes == 0);

// True when (a, ia) ranks before (b, ib).
MOERUNNER_HD inline bool ranks_before(float a, int ia, float b, int ib) {
  const bool a_nan = a != a, b_nan = b != b;
  if (a_nan || b_nan) return !a_nan && b_nan ? true : (a_nan && b_nan ? ia < ib : false);
  return a > b || (a == b && ia < ib);
}

MOERUNNER_HD inline float score(float logit, scoring_func f) {
  return f == scoring_func::sigmoid ? portable::sigmoid(logit) : logit;  // softmax is finished after the max/sum
}

}  // namespace moerunner::routing
