// Host launch for top-k routing on the device: validates like the reference, then one
// launch of kernel_routing.cuh whose ids and weights are bit-identical to reference::topk.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/gpu/routing.cuh needs nvcc: include it from a .cu file"
#endif

#include <algorithm>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "moerunner/core/config.hpp"
#include "moerunner/core/types.hpp"
#include "moerunner/gpu/cuda_check.hpp"
#include "moerunner/kernels/kernel_routing.cuh"
#include "moerunner/reference/routing.hpp"

namespace moerunner::gpu {

namespace routing_launch {

inline constexpr std::int64_t max_blocks = 1 << 20;  // the kernel strides over tokens beyond this

template <class T, int EPL>
void launch(const kernels::topk_params& p, cudaStream_t stream) {
  const std::int64_t blocks =
      std::min((p.num_tokens + kernels::topk_warps_per_block - 1) / kernels::topk_warps_per_block, max_blocks);
  kernels::topk_kernel<T, EPL><<<static_cast<unsigned>(blocks), kernels::topk_warps_per_block * routing::warp_lanes,
                                 0, stream>>>(p);
}

template <class T>
void launch_for_experts(const kernels::topk_params& p, cudaStream_t stream) {
  const int per_lane = (p.num_experts + routing::warp_lanes - 1) / routing::warp_lanes;
  if (per_lane <= 1) launch<T, 1>(p, stream);
  else if (per_lane <= 2) launch<T, 2>(p, stream);
  else if (per_lane <= 4) launch<T, 4>(p, stream);
  else if (per_lane <= 8) launch<T, 8>(p, stream);
  else launch<T, 16>(p, stream);
}

}  // namespace routing_launch

// router_logits [M, E] (f32, f16 or bf16) -> out.topk_weights [M, k + n] f32, out.topk_ids
// [M, k + n] i32 (n fused shared experts), all on the device. E <= 512, k <= 16. One launch;
// M = 0 launches nothing. Capturable.
inline void topk(const tensor_view& router_logits, const tensor_view* correction_bias, const topk_config& cfg,
                 TopKOutput& out, cudaStream_t stream) {
  reference::validate_topk(router_logits, correction_bias, cfg, out, memory_space::device, "gpu::topk");
  kernels::topk_params p;
  p.logits = router_logits.data;
  p.bias = correction_bias != nullptr ? correction_bias->ptr<const float>() : nullptr;
  p.weights = out.topk_weights.ptr<float>();
  p.ids = out.topk_ids.ptr<std::int32_t>();
  p.num_tokens = router_logits.shape[0];
  p.num_experts = static_cast<int>(router_logits.shape[1]);
  p.top_k = cfg.top_k;
  p.num_shared = cfg.num_fused_shared_experts;
  p.shared_weight = routing::shared_slot_weight(cfg.fused_shared_expert_weight,
                                                cfg.apply_routed_scaling_factor_on_weights, cfg.routed_scaling_factor);
  // Keeping every group drops nothing, so the group ranking is skipped (same result).
  p.num_groups = cfg.num_expert_group > 0 && cfg.topk_group < cfg.num_expert_group ? cfg.num_expert_group : 0;
  p.topk_group = cfg.topk_group;
  if (p.num_groups > 0) {
    const std::uint64_t per = static_cast<std::uint64_t>(p.num_experts / p.num_groups);
    p.group_magic = ((std::uint64_t{1} << 32) + per - 1) / per;  // exact e / per while e * per < 2^32
  }
  p.routed_scaling = cfg.routed_scaling_factor;
  p.scoring = cfg.scoring;
  p.renormalize = cfg.renormalize;
  p.apply_scaling = cfg.apply_routed_scaling_factor_on_weights;
  if (p.num_tokens > 0) {
    switch (router_logits.type) {
      case dtype::f32: routing_launch::launch_for_experts<float>(p, stream); break;
      case dtype::f16: routing_launch::launch_for_experts<__half>(p, stream); break;
      default: routing_launch::launch_for_experts<__nv_bfloat16>(p, stream); break;  // validated: bf16
    }
    MOE_CUDA_CHECK_LAUNCH("gpu::topk");
  }
  out.routed_scaling_applied = cfg.apply_routed_scaling_factor_on_weights;
}

}  // namespace moerunner::gpu
