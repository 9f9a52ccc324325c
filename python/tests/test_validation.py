"""Every rejected argument surfaces as the mapped Python exception with the library's message."""

import re

import numpy as np
import pytest

import moerunner

E, H, I, K, M = 4, 8, 4, 2, 3
BASE = dict(num_experts=E, hidden_size=H, intermediate_size=I, top_k=K)


@pytest.mark.parametrize("change, message", [
    (dict(num_experts=0), "MoeRunnerConfig: num_experts must be in [1, 4096], got 0"),
    (dict(num_experts=4097, top_k=2), "MoeRunnerConfig: num_experts must be in [1, 4096], got 4097"),
    (dict(num_local_experts=5), "MoeRunnerConfig: num_local_experts must be in [1, num_experts=4], got 5"),
    (dict(hidden_size=0), "MoeRunnerConfig: hidden_size must be in [1, 1048576], got 0"),
    (dict(intermediate_size=1 << 21), "MoeRunnerConfig: intermediate_size must be in [1, 1048576], got 2097152"),
    (dict(top_k=5), "MoeRunnerConfig: top_k must be in [1, min(num_experts, 32)], got 5"),
    (dict(routed_scaling_factor=0.0), "MoeRunnerConfig: routed_scaling_factor must be finite and positive"),
    (dict(routed_scaling_factor=float("nan")), "MoeRunnerConfig: routed_scaling_factor must be finite and positive"),
    (dict(activation="relu"), "MoeRunnerConfig: activation must be one of silu, gelu, swiglu_clamped, got 'relu'"),
    (dict(activation="swiglu_clamped", is_gated=False), "MoeRunnerConfig: swiglu_clamped needs is_gated = true"),
    (dict(activation="swiglu_clamped", activation_alpha=-1.0),
     "MoeRunnerConfig: swiglu_clamped alpha must be finite and positive"),
    (dict(activation="swiglu_clamped", activation_limit=float("inf")),
     "MoeRunnerConfig: swiglu_clamped limit must be finite and positive"),
    (dict(gate_up_layout="pairs"), "MoeRunnerConfig: gate_up_layout must be one of halves, interleaved, got 'pairs'"),
    (dict(gate_up_layout="interleaved", is_gated=False),
     "MoeRunnerConfig: gate_up_layout interleaved needs is_gated = true (w13 has no up rows to interleave)"),
    (dict(apply_router_weight_on_input=True),
     "MoeRunnerConfig: apply_router_weight_on_input needs top_k = 1 (the weight scales the shared input row)"),
    (dict(inplace=True, no_combine=True), "MoeRunnerConfig: inplace and no_combine exclude each other"),
])
def test_config(change, message):
    with pytest.raises(ValueError, match=re.escape(message) + "$") as info:
        moerunner.MoeRunner("reference", **{**BASE, **change})
    assert type(info.value) is moerunner.InvalidArgumentError


def test_unknown_backend():
    with pytest.raises(LookupError, match=re.escape(
            "unknown MoE runner backend 'no such': neither built in nor registered; known backends: reference, "
            "cuda_fused, cublas_grouped, cuda_fused_fp8")) as info:
        moerunner.MoeRunner("no such", **BASE)
    assert type(info.value) is moerunner.RegistryError


def test_long_backend_name_is_cut_in_the_message():
    with pytest.raises(moerunner.RegistryError, match=re.escape("... (1000 characters)")):
        moerunner.MoeRunner("x" * 1000, **BASE)


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError):
        moerunner.MoeRunner("reference", **BASE, topk=2)


def args():
    rng = np.random.default_rng(3)
    return dict(
        x=rng.standard_normal((M, H)).astype(np.float32),
        topk_ids=np.array([[0, 1], [2, 3], [1, -1]], np.int32),
        topk_weights=np.full((M, K), 0.5, np.float32),
        w13=rng.standard_normal((E, 2 * I, H)).astype(np.float32),
        w2=rng.standard_normal((E, H, I)).astype(np.float32),
    )


def strided(a):
    return np.repeat(a, 2, axis=-1)[..., ::2]


@pytest.mark.parametrize("change, message", [
    (dict(x=np.zeros((M, H + 1), np.float32)),
     "MoeRunner::run: hidden_states dimension 1 must be 8, got shape [3, 9]"),
    (dict(x=np.zeros(H, np.float32)), "MoeRunner::run: hidden_states must have rank 2, got shape [8]"),
    (dict(x=np.zeros((M, H), np.float64)),
     "MoeRunner::run: hidden_states has dtype float64, which moerunner does not take (f32, f16, bf16, f8_e4m3 or i32)"),
    (dict(x=np.zeros((1, 1, 1, 1, M, H), np.float32)), "MoeRunner::run: hidden_states has rank 6, outside [0, 4]"),
    (dict(x=strided(np.zeros((M, H), np.float32))), "MoeRunner::run: hidden_states must be contiguous (row-major)"),
    (dict(topk_ids=np.zeros((M, K), np.int64)),
     "MoeRunner::run: topk_ids has dtype int64, which moerunner does not take (f32, f16, bf16, f8_e4m3 or i32)"),
    (dict(topk_ids=np.zeros((M, K), np.float32)), "MoeRunner::run: topk_ids must be i32, got f32"),
    (dict(topk_ids=np.array([[0, 1], [2, 1000], [1, -1]], np.int32)),
     "MoeRunner::run: topk_ids[1, 1] = 1000 is outside [-1, num_local_experts=4)"),
    (dict(topk_ids=np.array([[0, 1], [2, 3], [1, -2]], np.int32)),
     "MoeRunner::run: topk_ids[2, 1] = -2 is outside [-1, num_local_experts=4)"),
    (dict(topk_weights=np.zeros((M, K + 1), np.float32)),
     "MoeRunner::run: topk_weights dimension 1 must be 2, got shape [3, 3]"),
    (dict(w13=np.zeros((E, I, H), np.float32)), "MoeRunner::run: w13 dimension 1 must be 8, got shape [4, 4, 8]"),
    (dict(w2=np.zeros((E, H, I), np.float16)), "MoeRunner::run: w2 and w13 must have the same dtype"),
    (dict(w2=strided(np.zeros((E, H, I), np.float32))), "MoeRunner::run: w2 must be contiguous (row-major)"),
    (dict(out=np.zeros((M, H), np.float16)),
     "MoeRunner::run: output must be f32 to match hidden_states, got f16"),
    (dict(out=np.zeros((M + 1, H), np.float32)), "MoeRunner::run: output dimension 0 must be 3, got shape [4, 8]"),
    (dict(b13=np.zeros((E, I), np.float32)), "MoeRunner::run: b13 dimension 1 must be 8, got shape [4, 4]"),
    (dict(b2=np.zeros((E, H), np.int32)),
     "MoeRunner::run: b2 must be f32 or f32 (the weights' dtype), got i32"),
    (dict(w13_scale=np.zeros((E, 1, 1), np.float32), w2_scale=np.zeros((E, 1, 1), np.float32)),
     "MoeRunner::run: w13 must be f8_e4m3, got f32"),
    (dict(w13_scale=np.zeros((E, 1, 1), np.float32), b2=np.zeros((E, H), np.float32)),
     "MoeRunner::run: b13 and b2 go with unquantized weights; fp8 weights take no biases"),
    (dict(w13_scale=np.zeros((E, 1, 1, 1), np.float32), w2_scale=np.zeros((E, 1, 1), np.float32)),
     "MoeRunner::run: w13_scale must have rank 3 (128x128 blocks), 2 (per channel) or 1 (per tensor), got shape "
     "[4, 1, 1, 1]"),
    (dict(w13_scale=np.zeros((E, 2 * I), np.float32), w2_scale=np.zeros((E, 1, 1), np.float32)),
     "MoeRunner::run: w13 must be f8_e4m3, got f32"),
    (dict(w13_scale=np.zeros((E,), np.float32), w2_scale=np.zeros((E, H), np.float32)),
     "MoeRunner::run: w13 must be f8_e4m3, got f32"),
    (dict(workspace=strided(np.zeros(64, np.uint8))), "MoeRunner::run: workspace must be contiguous (row-major)"),
    (dict(workspace=np.zeros((1, 1, 1, 1, 64), np.uint8)), "MoeRunner::run: workspace has rank 5, outside [0, 4]"),
])
def test_run(change, message):
    runner = moerunner.MoeRunner("reference", **BASE)
    out = np.zeros((M, H), np.float32) if "out" not in change else None
    kw = {**args(), **change}
    if out is not None:
        kw["out"] = out
        before = out.copy()
    with pytest.raises(ValueError, match=re.escape(message) + "$") as info:
        runner.run(**kw)
    assert type(info.value) is moerunner.InvalidArgumentError
    if out is not None:
        np.testing.assert_array_equal(out, before)  # a rejected call writes nothing


@pytest.mark.parametrize("workspace", [np.zeros(64, np.uint8), np.zeros((4, 4), np.float64), np.zeros(0, np.int8)])
def test_workspace_is_bytes_of_any_dtype(workspace):
    """The workspace is a byte buffer: uint8 as a rule (what torch.empty(n, dtype=torch.uint8) gives),
    any dense dtype taken by its size in bytes."""
    a = args()
    out = np.zeros((M, H), np.float32)
    moerunner.MoeRunner("reference", **BASE).run(**a, out=out, workspace=workspace)
    expected = np.zeros((M, H), np.float32)
    moerunner.MoeRunner("reference", **BASE).run(**a, out=expected)
    np.testing.assert_array_equal(out, expected)


def frozen(a):
    a = a.copy()
    a.flags.writeable = False
    return a


def test_read_only_inputs_are_taken(tmp_path):
    """Inputs the call only reads may be read-only (memory-mapped weights, frozen arrays)."""
    a = args()
    want = moerunner.MoeRunner("reference", **BASE).run(**a)
    np.save(tmp_path / "w13.npy", a["w13"])
    ro = {k: frozen(v) for k, v in a.items()}
    ro["w13"] = np.load(tmp_path / "w13.npy", mmap_mode="r")
    np.testing.assert_array_equal(moerunner.MoeRunner("reference", **BASE).run(**ro), want)


@pytest.mark.parametrize("what, name", [("out", "output"), ("workspace", "workspace")])
def test_read_only_outputs_are_refused(what, name):
    a = args()
    arg = frozen(np.zeros((M, H), np.float32) if what == "out" else np.zeros(64, np.uint8))
    with pytest.raises(moerunner.InvalidArgumentError,
                       match=re.escape(f"MoeRunner::run: {name} is read-only, and the call writes it") + "$"):
        moerunner.MoeRunner("reference", **BASE).run(**a, **{what: arg})


def test_a_broadcast_input_is_named_for_its_layout():
    a = args()
    a["x"] = np.broadcast_to(a["x"][:1], (M, H))
    with pytest.raises(moerunner.InvalidArgumentError,
                       match=re.escape("MoeRunner::run: hidden_states must be contiguous (row-major)") + "$"):
        moerunner.MoeRunner("reference", **BASE).run(**a)


def test_output_overlapping_the_input():
    a = args()
    with pytest.raises(ValueError, match=re.escape(
            "MoeRunner::run: output overlaps hidden_states; set inplace to write over the input")):
        moerunner.MoeRunner("reference", **BASE).run(**a, out=a["x"])


def test_output_of_an_unknown_framework_must_be_given():
    class Array:
        shape = (M, H)

    with pytest.raises(TypeError, match="out was not given"):
        moerunner.MoeRunner("reference", **BASE).run(Array(), None, None, None, None)


@pytest.mark.parametrize("change, message", [
    (dict(top_k=0), "reference::topk: top_k must be in [1, min(num_experts, 16)], got 0"),
    (dict(top_k=17), "reference::topk: top_k must be in [1, min(num_experts, 16)], got 17"),
    (dict(scoring="tanh"), "reference::topk: scoring must be one of softmax, sigmoid, got 'tanh'"),
    (dict(num_expert_group=3, topk_group=1),
     "reference::topk: num_expert_group must divide num_experts (32), got 3"),
    (dict(topk_group=1), "reference::topk: topk_group is set but num_expert_group is 0"),
    (dict(num_fused_shared_experts=40),
     "reference::topk: num_fused_shared_experts must be in [0, 32 - top_k] (the runner takes at most 32 slots per "
     "token), got 40"),
    (dict(correction_bias=np.zeros(31, np.float32)),
     "reference::topk: correction_bias dimension 0 must be 32, got shape [31]"),
    (dict(routed_scaling_factor=-1.0), "reference::topk: routed_scaling_factor must be finite and positive"),
    (dict(router_logits=np.zeros((2, 513), np.float32)),
     "reference::topk: routing supports at most 512 experts, got 513"),
    (dict(router_logits=np.zeros((2, 32), np.int32)),
     "reference::topk: router_logits must be f32, f16 or bf16, got i32"),
    (dict(topk_ids=np.zeros((2, 4), np.float32)), "reference::topk: topk_ids must be i32, got f32"),
    (dict(topk_weights=frozen(np.zeros((2, 4), np.float32))),
     "reference::topk: topk_weights is read-only, and the call writes it"),
])
def test_topk(change, message):
    kw = {"router_logits": np.zeros((2, 32), np.float32), "top_k": 4, **change}
    with pytest.raises(ValueError, match=re.escape(message) + "$") as info:
        moerunner.topk(**kw)
    assert type(info.value) is moerunner.InvalidArgumentError
