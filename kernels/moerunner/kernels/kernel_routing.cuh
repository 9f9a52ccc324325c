// Device code for top-k routing: one warp per token, lane l holding experts l, l+32, ...
//
// The arithmetic follows routing/topk_rules.hpp step for step (the non-finite logit rule,
// portable exp and sigmoid, the warp-order softmax sum over eligible experts, the ranks_before
// order for every comparison, the weight rules), so ids and weights are bit-identical to
// reference::route_token.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/kernels/kernel_routing.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstdint>

#include "moerunner/core/config.hpp"
#include "moerunner/core/portable_math.hpp"
#include "moerunner/kernels/pdl.cuh"
#include "moerunner/kernels/vector_io.cuh"
#include "moerunner/routing/topk_rules.hpp"

namespace moerunner::kernels {

inline constexpr int topk_warps_per_block = 4;

struct topk_params {
  const void* logits = nullptr;  // [M, E] of the kernel's element type
  const float* bias = nullptr;   // [E] or nullptr
  float* weights = nullptr;      // [M, k + num_shared]
  std::int32_t* ids = nullptr;   // [M, k + num_shared]
  std::int64_t num_tokens = 0;
  int num_experts = 0;
  int top_k = 0;
  int num_shared = 0;        // fused shared experts: ids E .. E + num_shared - 1 after the k routed slots
  float shared_weight = 0;   // their slots' weight (routing::shared_slot_weight)
  int num_groups = 0;  // 0 when grouping cannot drop any expert
  int topk_group = 0;
  std::uint64_t group_magic = 0;  // ceil(2^32 / (E / num_groups)): expert e's group is (e * magic) >> 32
  float routed_scaling = 1.0f;
  scoring_func scoring = scoring_func::softmax;
  bool renormalize = false;
  bool apply_scaling = false;
};

namespace routing_detail {

inline constexpr unsigned full_mask = 0xffffffffu;

// An order-preserving u32 image of a key: (a, i) ranks before (b, j) in routing::ranks_before
// exactly when rank_key(a) > rank_key(b), or they are equal and i < j. -0 and +0 map together
// (they compare equal), NaN maps to 1 below every number, and 0 is left for "no candidate".
// Comparing integers lets the warp use redux.sync instead of a shuffle tree per selection.
__device__ __forceinline__ unsigned rank_key(float x) {
  if (x != x) return 1u;
  const unsigned u = __float_as_uint(__fadd_rn(x, 0.0f));  // -0 + 0 = +0
  return (u & 0x80000000u) != 0u ? ~u : (u | 0x80000000u);
}

// The inverse of rank_key for numbers.
__device__ __forceinline__ float from_rank_key(unsigned r) {
  return __uint_as_float((r & 0x80000000u) != 0u ? (r & 0x7fffffffu) : ~r);
}

// (ra, ia) ranks before (rb, ib); rank key 0 (no candidate) never does.
__device__ __forceinline__ bool ranks_before(unsigned ra, int ia, unsigned rb, int ib) {
  return ra != 0u && (ra > rb || (ra == rb && ia < ib));
}

// Bits (one per register slot) of this lane's experts that lie in the topk_group best groups.
// A group is ranked by its best key, or with a bias by the sum of its best two keys. Each
// group is scanned by `sub` lanes through shared memory (experts of a group are spread over
// lanes in registers), their top-2 pairs merged by a butterfly.
template <int EPL>
__device__ __forceinline__ unsigned kept_group_experts(const float (&key)[EPL], unsigned avail, const topk_params& p,
                                                       float* s_key, int lane) {
  const int E = p.num_experts, G = p.num_groups, per = E / G;
#pragma unroll
  for (int i = 0; i < EPL; ++i)
    if ((avail >> i) & 1u) s_key[lane + routing::warp_lanes * i] = key[i];
  __syncwarp();

  int sub_log = 0;  // each group is scanned by sub = 2^sub_log lanes
  while ((2 << sub_log) * G <= routing::warp_lanes) ++sub_log;
  const int sub = 1 << sub_log, g = lane >> sub_log, part = lane & (sub - 1);
  unsigned r1 = 0, r2 = 0;
  int b1 = -1, b2 = -1;
  if (g < G) {
    // Indices rise along the scan, so an equal key never displaces an earlier one.
    for (int e = g * per + part; e < (g + 1) * per; e += sub) {
      const unsigned r = rank_key(s_key[e]);
      if (r > r1) {
        r2 = r1;
        b2 = b1;
        r1 = r;
        b1 = e;
      } else if (r > r2) {
        r2 = r;
        b2 = e;
      }
    }
  }
  for (int off = sub / 2; off > 0; off /= 2) {  // lanes l and l^off (off < sub) share a group
    const unsigned o1 = __shfl_xor_sync(full_mask, r1, off), o2 = __shfl_xor_sync(full_mask, r2, off);
    const int j1 = __shfl_xor_sync(full_mask, b1, off), j2 = __shfl_xor_sync(full_mask, b2, off);
    if (ranks_before(o1, j1, r1, b1)) {
      if (!ranks_before(r1, b1, o2, j2)) {
        r1 = o2;
        b1 = j2;
      }
      r2 = r1;
      b2 = b1;
      r1 = o1;
      b1 = j1;
    } else if (ranks_before(o1, j1, r2, b2)) {
      r2 = o1;
      b2 = j1;
    }
  }
  float gscore = 0.0f;
  if (g < G) gscore = (p.bias != nullptr && per >= 2) ? portable::add_rn(s_key[b1], s_key[b2]) : s_key[b1];

  // Keep group g when fewer than topk_group groups rank before it.
  const unsigned gr = rank_key(gscore);
  int rank = 0;
  for (int h = 0; h < G; ++h) {
    const unsigned other = __shfl_sync(full_mask, gr, h * sub);
    rank += (other > gr || (other == gr && h < g)) ? 1 : 0;
  }
  const unsigned kept_lanes = __ballot_sync(full_mask, g < G && part == 0 && rank < p.topk_group);
  __syncwarp();  // s_key is rewritten for the next token

  unsigned kept = 0;
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    const int e = lane + routing::warp_lanes * i;
    const auto group = static_cast<int>((static_cast<std::uint64_t>(e) * p.group_magic) >> 32);  // e / per
    if (((avail >> i) & 1u) && ((kept_lanes >> (group << sub_log)) & 1u)) kept |= 1u << i;
  }
  return kept;
}

}  // namespace routing_detail

// EPL = experts per lane (a power of two, 32 * EPL >= E). Tokens are spread one per warp.
template <class T, int EPL>
__global__ void __launch_bounds__(topk_warps_per_block * routing::warp_lanes) topk_kernel(topk_params p) {
  static_assert(EPL >= 1 && EPL * routing::warp_lanes <= routing::max_routing_experts);
  constexpr int lanes = routing::warp_lanes;
  constexpr unsigned full = routing_detail::full_mask;
  __shared__ float s_key[topk_warps_per_block][EPL * lanes];
  __shared__ float s_score[topk_warps_per_block][EPL * lanes];
  const int lane = static_cast<int>(threadIdx.x) % lanes, warp = static_cast<int>(threadIdx.x) / lanes;
  const int E = p.num_experts, k = p.top_k, width = k + p.num_shared;
  const T* logits = static_cast<const T*>(p.logits);
  // The routing plan, launched as our programmatic dependent, may start while this runs.
  allow_dependent_grids();

  // The loop bound is the same on every lane of a warp, so the warp collectives never diverge.
  for (std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * topk_warps_per_block + warp; t < p.num_tokens;
       t += static_cast<std::int64_t>(gridDim.x) * topk_warps_per_block) {
    const T* row = logits + t * E;
    float score[EPL], key[EPL], bias[EPL];
    unsigned avail = 0, eligible = 0;  // bit i: expert lane + 32 i exists / may be selected
#pragma unroll
    for (int i = 0; i < EPL; ++i) {  // logits and bias loaded together, ahead of any arithmetic
      const int e = lane + lanes * i;
      score[i] = 0.0f;
      bias[i] = 0.0f;
      if (e < E) {
        score[i] = to_f32(row[e]);
        if (p.bias != nullptr) bias[i] = p.bias[e];
        avail |= 1u << i;
      }
    }
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      score[i] = routing::routing_logit(score[i]);
      if (((avail >> i) & 1u) && routing::eligible(score[i])) eligible |= 1u << i;
    }
#pragma unroll
    for (int i = 0; i < EPL; ++i) score[i] = ((eligible >> i) & 1u) ? routing::score(score[i], p.scoring) : 0.0f;

    if (p.scoring == scoring_func::softmax) {
      float mx = routing::minus_inf;  // stays -inf only when no expert is eligible (then nothing below runs)
#pragma unroll
      for (int i = 0; i < EPL; ++i)
        if ((eligible >> i) & 1u) mx = fmaxf(mx, score[i]);
      // The max is order-free (a -0/+0 choice cannot change exp(s - max)), so a redux does.
      mx = routing_detail::from_rank_key(__reduce_max_sync(full, routing_detail::rank_key(mx)));
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < EPL; ++i)
        if ((eligible >> i) & 1u) {
          score[i] = routing::softmax_term(score[i], mx);
          sum = portable::add_rn(sum, score[i]);
        }
      for (int off = lanes / 2; off > 0; off /= 2) sum = portable::add_rn(sum, __shfl_xor_sync(full, sum, off));
      sum = __shfl_sync(full, sum, 0);
#pragma unroll
      for (int i = 0; i < EPL; ++i)
        if ((eligible >> i) & 1u) score[i] = portable::div_rn(score[i], sum);
    }

#pragma unroll
    for (int i = 0; i < EPL; ++i)
      key[i] = routing::selection_key(((eligible >> i) & 1u) != 0u, score[i], p.bias != nullptr, bias[i]);
    // The winners' unbiased scores are read back from shared memory by every lane.
#pragma unroll
    for (int i = 0; i < EPL; ++i)
      if ((avail >> i) & 1u) s_score[warp][lane + lanes * i] = score[i];
    __syncwarp();
    if (p.num_groups > 0) avail &= routing_detail::kept_group_experts<EPL>(key, avail, p, s_key[warp], lane);

    // k rounds: the best rank key in the warp, then the lowest expert holding it.
    unsigned rk[EPL];
#pragma unroll
    for (int i = 0; i < EPL; ++i) rk[i] = ((avail & eligible) >> i) & 1u ? routing_detail::rank_key(key[i]) : 0u;
    unsigned taken = 0;  // a bit mask, not writes into rk[], keeps rk[] in registers
    float sum = 0.0f, my_weight = 0.0f;
    int my_id = -1;
    for (int j = 0; j < k; ++j) {
      unsigned lane_max = 0;
#pragma unroll
      for (int i = 0; i < EPL; ++i) lane_max = max(lane_max, ((taken >> i) & 1u) ? 0u : rk[i]);
      const unsigned best = __reduce_max_sync(full, lane_max);
      int mine = 0x7fffffff;
#pragma unroll
      for (int i = EPL - 1; i >= 0; --i)
        if (!((taken >> i) & 1u) && rk[i] == best) mine = lane + lanes * i;
      // No eligible candidate left (best == 0): the slot is filtered.
      const int wi = best != 0u ? __reduce_min_sync(full, mine) : -1;
      if (wi >= 0 && lane == wi % lanes) taken |= 1u << (wi / lanes);
      const float w = wi >= 0 ? s_score[warp][wi] : 0.0f;
      sum = portable::add_rn(sum, w);  // selection order, as the reference renormalizes
      if (lane == j) {
        my_weight = w;
        my_id = wi;
      }
    }
    if (lane < k) {
      p.weights[t * width + lane] = routing::routed_weight(my_weight, sum, p.renormalize, p.apply_scaling,
                                                           p.routed_scaling);
      p.ids[t * width + lane] = my_id;
    }
    for (int s = lane; s < p.num_shared; s += lanes) {
      p.weights[t * width + k + s] = p.shared_weight;
      p.ids[t * width + k + s] = E + s;
    }
    __syncwarp();  // s_score is rewritten for the next token
  }
}

}  // namespace moerunner::kernels
