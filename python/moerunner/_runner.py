"""moerunner.MoeRunner: one MoE layer's runner, over the extension's Runner."""

import itertools
import weakref

from . import _moerunner
from ._arrays import device_index, empty, keep_for_stream, leading_dim, torch_of

# Every runner's handle, given when it is built: the torch ops (moerunner.torch) take runners by
# handle, and a handle given at the first op call would be given inside torch.compile's tracing.
# An int: one compiled function called with runner after runner (a layer each) takes it as a
# symbolic value from the second runner on, instead of compiling again for every runner (as it
# did for a string constant, failing past torch's recompile limit); the ops' fake
# implementations never look a runner up.
_next_handle = itertools.count()  # next() is atomic under the GIL
_live = {}  # handle -> weak reference to its runner, dropped with the runner


def runner_of_handle(handle):
    """The live runner with this handle; LookupError once it is gone."""
    ref = _live.get(handle)
    runner = ref() if ref is not None else None
    if runner is None:
        raise LookupError(f"no live moerunner.MoeRunner has handle {handle}")
    return runner


class MoeRunner:
    """A runner for one MoE layer on one backend (see backends()).

    The keyword arguments mirror moe_config_params (moerunner/core/config.hpp) and are
    validated by MoeRunnerConfig: num_experts, hidden_size, intermediate_size, top_k, and
    optionally num_local_experts (0: all), activation ("silu", "gelu", "swiglu_clamped"),
    activation_alpha, activation_limit (swiglu_clamped), is_gated, gate_up_layout ("halves",
    "interleaved"), apply_router_weight_on_input, routed_scaling_factor, no_combine, inplace,
    deterministic, batch_invariant. A bad value raises InvalidArgumentError (a ValueError), an
    unknown backend RegistryError (a LookupError).
    """

    __slots__ = ("_core", "backend", "config", "tensor_space", "handle", "_out_dims", "_inplace", "_host",
                 "__weakref__")

    def __init__(self, backend="reference", **config):
        self._core = _moerunner.Runner(backend, **config)
        self.backend = self._core.backend
        self.config = self._core.config
        self.tensor_space = self._core.tensor_space  # "host" or "device": where every tensor lives
        c = self.config
        self._out_dims = (c["top_k"], c["hidden_size"]) if c["no_combine"] else (c["hidden_size"],)
        self._inplace = c["inplace"]
        self._host = self.tensor_space == "host"
        self.handle = next(_next_handle)  # unique in the process, never reused
        _live[self.handle] = weakref.ref(self, lambda _, h=self.handle: _live.pop(h, None))

    def workspace_bytes(self, num_tokens, device=None):
        """Scratch bytes one run over num_tokens tokens needs (0 for host backends) on `device`
        (a CUDA ordinal or torch.device; None: the current device): the plan of a device backend
        follows the device's SM count."""
        return self._core.workspace_bytes(num_tokens, device_index(device))

    def max_workspace_bytes(self, max_tokens, device=None):
        """Scratch bytes that serve every run of at most max_tokens tokens: to size one buffer for
        all batches up to the largest (a run's need is not monotone in the token count). Plans
        every token count up to max_tokens: call it at setup, not per run. device as for
        workspace_bytes."""
        return self._core.max_workspace_bytes(max_tokens, device_index(device))

    def describe(self, num_tokens, device=None):
        """One line for a log: what a run over num_tokens tokens does (cuda_fused: its plan);
        device as for workspace_bytes."""
        return self._core.describe(num_tokens, device_index(device))

    def run(self, x, topk_ids, topk_weights, w13, w2, out=None, workspace=None, stream=None, b13=None, b2=None,
            status=None, hidden_scales=None, w13_scale=None, w2_scale=None):
        """Runs the layer: out[t] = sum over slots j of topk_weights[t, j] * expert(topk_ids[t, j], x[t]).

        x [M, H]; topk_ids [M, k] int32 (-1: filtered slot); topk_weights [M, k] float32;
        w13 [E, 2I, H] (gated) or [E, I, H]; w2 [E, H, I]; optional biases b13 [E, 2I] and
        b2 [E, H]. fp8 weights: float8_e4m3fn w13 and w2 with float32 w13_scale and w2_scale,
        whose rank names the format: one per 128x128 block ([E, ceil(rows/128), ceil(cols/128)]),
        per output channel ([E, 2I] and [E, H]) or per expert matrix ([E] each); activations are
        quantized per token in groups of 128 for all three; for fp8 x, its hidden_scales
        [M, ceil(H/128)].
        Any DLPack array (torch, CuPy, JAX, numpy), in the backend's memory space.

        out: [M, H] ([M, k, H] with no_combine), x's dtype (bf16 for fp8 x); None allocates
        it for numpy arrays and torch tensors (x itself with inplace). workspace: at least
        workspace_bytes(M) bytes in the backend's memory space; None allocates it through
        torch for torch tensors. stream: an int cudaStream_t, an object with __cuda_stream__
        or cuda_stream, or None (torch's current stream for CUDA torch tensors, else 0).
        Arrays whose type has DLPack's C exchange API (torch >= 2.11) are read through it,
        without a Python call; others through __dlpack__.
        status: an int32 [2] device array a cuda_fused run adds bad expert ids to
        (bad_slots, first_bad_slot). Nothing synchronizes, but cublas_grouped, which waits on the
        host for its routing (the GIL released meanwhile). Returns out.
        """
        allocated = []  # arrays made here: recorded on the call's own stream if it names one (torch)
        if out is None:
            out = x if self._inplace else empty(x, (leading_dim(x),) + self._out_dims, "output", "out")
            if out is not x and out is not None:
                allocated.append(out)
        if workspace is None and not self._host and torch_of(x) is not None:
            # Sized for the device of x, which the run makes current.
            nbytes = self._core.workspace_bytes(leading_dim(x), device_index(x.device))
            if nbytes:
                workspace = empty(x, (nbytes,), "u8", "workspace")
                allocated.append(workspace)
        # Arrays and the stream are read in the extension (stream_handle resolves what it cannot).
        self._core.run(x, topk_ids, topk_weights, w13, w2, out, workspace, stream, b13, b2, status, hidden_scales,
                       w13_scale, w2_scale)
        if allocated and stream is not None:
            keep_for_stream(allocated, stream, x)
        return out

    def __repr__(self):
        c = self.config
        return (f"MoeRunner({self.backend!r}, num_experts={c['num_experts']}, hidden_size={c['hidden_size']}, "
                f"intermediate_size={c['intermediate_size']}, top_k={c['top_k']})")


__all__ = ["MoeRunner"]
