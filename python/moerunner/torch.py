"""torch.library ops over moerunner, for models that torch.compile (fullgraph=True) traces and
CUDA graphs capture. Import it where torch is installed:

    import moerunner.torch as mt
    runner = moerunner.MoeRunner("cuda_fused", num_experts=..., ...)
    weights, ids = mt.topk(router_logits, top_k=8)
    out = mt.fused_moe(runner, x, ids, weights, w13, w2)

The ops are moerunner::topk, moerunner::fused_moe and moerunner::fused_moe_status (the same run
with a status tensor, declared mutated: inductor cannot lower an op whose mutated argument may be
None, so the status has an op of its own). A runner is not a tensor, so an op takes its handle
(MoeRunner.handle, an int every runner gets when it is built) and its no_combine flag, and
finds the runner by the handle when it runs, while the runner lives: keep the runner (the
model's module does) as long as a compiled function or graph calls the op. The fake
implementations read shapes from the tensors alone, so one compiled function serves runner after
runner (the handle turns symbolic at the second). Compile a model whole, as engines do: a module
compiled on its own keeps its runner's handle a constant of its graph, and torch compiles
such a module again for every runner it meets (up to its recompile limit). The ops have no
autograd formula: run them under torch.no_grad() or inference_mode, or on weights that need no
gradient. The workspace comes from torch's caching allocator on every call (inside a graph
capture, from the graph's pool), the stream is torch's current stream.

fused_moe's optional status is the caller's int32 [2] tensor (bad_slots, first_bad_slot) that a
cuda_fused or cuda_fused_fp8 run adds bad expert ids to, as MoeRunner.run's: fused_moe_status
declares it mutated, so a compiled or graph-captured model reads it after the step, and zeroes it where a
count starts.
"""

from typing import List, Optional, Tuple

import torch

from . import _routing
from ._runner import MoeRunner, runner_of_handle


def handle(runner: MoeRunner) -> int:
    """The op's handle for runner."""
    if runner.config["inplace"]:
        raise ValueError("moerunner.torch.fused_moe returns a new tensor; build the runner with inplace=False")
    return runner.handle


def _out_shape(x: torch.Tensor, topk_ids: torch.Tensor, no_combine: bool) -> List[int]:
    # x [M, H] and topk_ids [M, k] as the run validates them; the runner's config is not read.
    return [x.shape[0], topk_ids.shape[1], x.shape[1]] if no_combine else [x.shape[0], x.shape[1]]


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.bfloat16 if x.dtype == torch.float8_e4m3fn else x.dtype


def _run(runner_handle, no_combine, x, topk_ids, topk_weights, w13, w2, b13, b2, hidden_scales, w13_scale, w2_scale,
         status):
    runner = runner_of_handle(runner_handle)
    if runner.config["no_combine"] != no_combine:
        raise ValueError(f"moerunner::fused_moe: no_combine={no_combine} given for a runner built with "
                         f"no_combine={runner.config['no_combine']}")
    out = torch.empty(_out_shape(x, topk_ids, no_combine), dtype=_out_dtype(x), device=x.device)
    nbytes = runner.workspace_bytes(x.shape[0], x.device)  # planned for the device the run makes current
    workspace = torch.empty(nbytes, dtype=torch.uint8, device=x.device) if nbytes else None
    runner.run(x, topk_ids, topk_weights, w13, w2, out=out, workspace=workspace, stream=None, b13=b13, b2=b2,
               status=status, hidden_scales=hidden_scales, w13_scale=w13_scale, w2_scale=w2_scale)
    return out


def _fake_out(no_combine, x, topk_ids):
    return x.new_empty(_out_shape(x, topk_ids, no_combine), dtype=_out_dtype(x))


@torch.library.custom_op("moerunner::fused_moe", mutates_args=())
def _fused_moe(runner_handle: int, no_combine: bool, x: torch.Tensor, topk_ids: torch.Tensor,
               topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, b13: Optional[torch.Tensor],
               b2: Optional[torch.Tensor], hidden_scales: Optional[torch.Tensor], w13_scale: Optional[torch.Tensor],
               w2_scale: Optional[torch.Tensor]) -> torch.Tensor:
    return _run(runner_handle, no_combine, x, topk_ids, topk_weights, w13, w2, b13, b2, hidden_scales, w13_scale,
                w2_scale, None)


@_fused_moe.register_fake
def _(runner_handle, no_combine, x, topk_ids, topk_weights, w13, w2, b13, b2, hidden_scales, w13_scale, w2_scale):
    return _fake_out(no_combine, x, topk_ids)


@torch.library.custom_op("moerunner::fused_moe_status", mutates_args=("status",))
def _fused_moe_status(runner_handle: int, no_combine: bool, x: torch.Tensor, topk_ids: torch.Tensor,
                      topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, b13: Optional[torch.Tensor],
                      b2: Optional[torch.Tensor], hidden_scales: Optional[torch.Tensor],
                      w13_scale: Optional[torch.Tensor], w2_scale: Optional[torch.Tensor],
                      status: torch.Tensor) -> torch.Tensor:
    return _run(runner_handle, no_combine, x, topk_ids, topk_weights, w13, w2, b13, b2, hidden_scales, w13_scale,
                w2_scale, status)


@_fused_moe_status.register_fake
def _(runner_handle, no_combine, x, topk_ids, topk_weights, w13, w2, b13, b2, hidden_scales, w13_scale, w2_scale,
      status):
    # status is only added to in place: its shape and dtype are the caller's, nothing to build.
    return _fake_out(no_combine, x, topk_ids)


@torch.library.custom_op("moerunner::topk", mutates_args=())
def _topk(router_logits: torch.Tensor, correction_bias: Optional[torch.Tensor], top_k: int, scoring: str,
          renormalize: bool, num_expert_group: int, topk_group: int, routed_scaling_factor: float,
          apply_routed_scaling_factor_on_weights: bool, num_fused_shared_experts: int,
          fused_shared_expert_weight: float) -> Tuple[torch.Tensor, torch.Tensor]:
    return _routing.topk(router_logits, top_k=top_k, num_fused_shared_experts=num_fused_shared_experts,
                         correction_bias=correction_bias, stream=None, scoring=scoring,
                         renormalize=renormalize, num_expert_group=num_expert_group, topk_group=topk_group,
                         routed_scaling_factor=routed_scaling_factor,
                         apply_routed_scaling_factor_on_weights=apply_routed_scaling_factor_on_weights,
                         fused_shared_expert_weight=fused_shared_expert_weight)


@_topk.register_fake
def _(router_logits, correction_bias, top_k, scoring, renormalize, num_expert_group, topk_group,
      routed_scaling_factor, apply_routed_scaling_factor_on_weights, num_fused_shared_experts,
      fused_shared_expert_weight):
    shape = (router_logits.shape[0], top_k + num_fused_shared_experts)
    return (router_logits.new_empty(shape, dtype=torch.float32), router_logits.new_empty(shape, dtype=torch.int32))


def fused_moe(runner: MoeRunner, x, topk_ids, topk_weights, w13, w2, b13=None, b2=None, hidden_scales=None,
              w13_scale=None, w2_scale=None, status=None):
    """runner.run(...) as the op moerunner::fused_moe (moerunner::fused_moe_status with a status):
    a new output tensor, workspace from torch. status: None, or the int32 [2] tensor (bad_slots,
    first_bad_slot) on x's device that a cuda_fused or cuda_fused_fp8 run adds bad expert ids to
    (runs only add; the caller zeroes it)."""
    args = (handle(runner), runner.config["no_combine"], x, topk_ids, topk_weights, w13, w2, b13, b2, hidden_scales,
            w13_scale, w2_scale)
    if status is None:
        return torch.ops.moerunner.fused_moe(*args)
    return torch.ops.moerunner.fused_moe_status(*args, status)


def topk(router_logits, *, top_k, correction_bias=None, scoring="softmax", renormalize=True, num_expert_group=0,
         topk_group=0, routed_scaling_factor=1.0, apply_routed_scaling_factor_on_weights=False,
         num_fused_shared_experts=0, fused_shared_expert_weight=1.0):
    """moerunner.topk as the op moerunner::topk (the defaults are topk_config's)."""
    return torch.ops.moerunner.topk(router_logits, correction_bias, top_k, scoring, renormalize, num_expert_group,
                                    topk_group, routed_scaling_factor, apply_routed_scaling_factor_on_weights,
                                    num_fused_shared_experts, fused_shared_expert_weight)
