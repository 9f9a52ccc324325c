"""moerunner.topk: top-k routing, reference::topk on the host and gpu::topk on the device."""

from . import _moerunner
from ._arrays import empty, leading_dim


def topk(router_logits, *, top_k, num_fused_shared_experts=0, correction_bias=None, topk_weights=None,
         topk_ids=None, stream=None, **options):
    """Routes router_logits [M, E] (float32, float16 or bfloat16) to (topk_weights [M, k + n]
    float32, topk_ids [M, k + n] int32), n = num_fused_shared_experts, bit for bit the same
    on host and device.

    options mirror topk_config (moerunner/core/config.hpp): scoring ("softmax", "sigmoid"),
    renormalize, num_expert_group, topk_group, routed_scaling_factor,
    apply_routed_scaling_factor_on_weights, fused_shared_expert_weight. correction_bias [E]
    float32 affects selection only. The outputs are allocated where the logits live (numpy
    or torch) unless given; stream as in MoeRunner.run. Nothing synchronizes.
    """
    shape = (leading_dim(router_logits), max(top_k + num_fused_shared_experts, 0))
    if topk_weights is None:
        topk_weights = empty(router_logits, shape, "f32", "topk_weights")
    if topk_ids is None:
        topk_ids = empty(router_logits, shape, "i32", "topk_ids")
    _moerunner.topk(router_logits, topk_weights, topk_ids, correction_bias, stream, top_k=top_k,
                    num_fused_shared_experts=num_fused_shared_experts, **options)
    return topk_weights, topk_ids
