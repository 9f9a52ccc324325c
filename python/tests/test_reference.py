"""The reference backend on numpy arrays against the layer written out in numpy (float64)."""

import numpy as np
import pytest

import moe_numpy
import moerunner

E, H, I, K, M = 6, 32, 16, 2, 9


def problem(rng, dtype=np.float32, gated=True, k=K, e=E):
    x = rng.standard_normal((M, H)).astype(dtype)
    ids = np.stack([rng.permutation(e)[:k] for _ in range(M)]).astype(np.int32)
    weights = rng.random((M, k)).astype(np.float32)
    w13 = (rng.standard_normal((e, (2 if gated else 1) * I, H)) / np.sqrt(H)).astype(dtype)
    w2 = (rng.standard_normal((e, H, I)) / np.sqrt(I)).astype(dtype)
    return x, ids, weights, w13, w2


def runner(**kw):
    cfg = dict(num_experts=E, hidden_size=H, intermediate_size=I, top_k=K)
    cfg.update(kw)
    return moerunner.MoeRunner("reference", **cfg)


@pytest.mark.parametrize("kind", ["silu", "gelu", "swiglu_clamped"])
@pytest.mark.parametrize("layout", ["halves", "interleaved"])
def test_activations_and_layouts(rng, kind, layout):
    x, ids, w, w13, w2 = problem(rng)
    out = runner(activation=kind, gate_up_layout=layout).run(x, ids, w, w13, w2)
    assert out.dtype == np.float32 and out.shape == (M, H)
    np.testing.assert_allclose(out, moe_numpy.moe(x, ids, w, w13, w2, kind=kind, layout=layout), rtol=1e-5,
                               atol=1e-5)


def test_biases_scaling_and_filtered_slots(rng):
    x, ids, w, w13, w2 = problem(rng)
    ids[0, 1] = -1
    ids[3, :] = -1
    b13 = rng.standard_normal((E, 2 * I)).astype(np.float32)
    b2 = rng.standard_normal((E, H)).astype(np.float32)
    out = runner(routed_scaling_factor=2.5).run(x, ids, w, w13, w2, b13=b13, b2=b2)
    np.testing.assert_allclose(out, moe_numpy.moe(x, ids, w, w13, w2, b13=b13, b2=b2, scale=2.5), rtol=1e-5,
                               atol=1e-5)
    assert not out[3].any()  # a token routed to nothing stays zero


def test_ungated_no_combine_and_given_out(rng):
    x, ids, w, w13, w2 = problem(rng, gated=False)
    out = np.full((M, K, H), np.nan, np.float32)
    got = runner(is_gated=False, activation="gelu", no_combine=True).run(x, ids, w, w13, w2, out=out)
    assert got is out
    np.testing.assert_allclose(out, moe_numpy.moe(x, ids, w, w13, w2, kind="gelu", gated=False, no_combine=True),
                               rtol=1e-5, atol=1e-5)


def test_router_weight_on_input(rng):
    x, ids, w, w13, w2 = problem(rng, k=1)
    out = runner(top_k=1, apply_router_weight_on_input=True).run(x, ids, w, w13, w2)
    np.testing.assert_allclose(out, moe_numpy.moe(x, ids, w, w13, w2, on_input=True), rtol=1e-5, atol=1e-5)


def test_inplace_writes_over_the_input(rng):
    x, ids, w, w13, w2 = problem(rng)
    want = moe_numpy.moe(x, ids, w, w13, w2)
    got = runner(inplace=True).run(x, ids, w, w13, w2)
    assert got is x
    np.testing.assert_allclose(x, want, rtol=1e-5, atol=1e-5)


def test_float16(rng):
    x, ids, w, w13, w2 = problem(rng, dtype=np.float16)
    out = runner().run(x, ids, w, w13, w2)
    assert out.dtype == np.float16
    np.testing.assert_allclose(out.astype(np.float64), moe_numpy.moe(x, ids, w, w13, w2), rtol=2e-3, atol=2e-3)


def test_zero_tokens(rng):
    x, ids, w, w13, w2 = problem(rng)
    assert runner().run(x[:0], ids[:0], w[:0], w13, w2).shape == (0, H)


def test_config_describe_and_workspace():
    r = runner(batch_invariant=True)
    assert r.backend == "reference" and r.tensor_space == "host"
    assert r.config["deterministic"] and r.config["num_local_experts"] == E  # as MoeRunnerConfig fills them in
    assert r.workspace_bytes(1024) == 0
    assert r.describe(5) == "reference M=5"
    # A device to plan for: nothing to make current for a host backend.
    assert r.workspace_bytes(1024, device=0) == 0 and r.max_workspace_bytes(8, device=3) == 0
    assert r.describe(5, device=1) == "reference M=5"


def test_streams_are_parsed_and_ignored_on_the_host(rng):
    class Protocol:
        def __cuda_stream__(self):
            return (0, 0)

    class Attribute:
        cuda_stream = 0

    x, ids, w, w13, w2 = problem(rng)
    want = runner().run(x, ids, w, w13, w2)
    for stream in (0, Protocol(), Attribute()):
        np.testing.assert_array_equal(runner().run(x, ids, w, w13, w2, stream=stream), want)
    with pytest.raises(TypeError, match="stream must be"):
        runner().run(x, ids, w, w13, w2, stream="default")
    # topk reads its stream as run does, on the host too.
    logits = rng.standard_normal((M, E)).astype(np.float32)
    np.testing.assert_array_equal(moerunner.topk(logits, top_k=K, stream=Protocol())[1],
                                  moerunner.topk(logits, top_k=K)[1])
    with pytest.raises(TypeError, match="stream must be"):
        moerunner.topk(logits, top_k=K, stream="default")


def test_not_an_array_is_named_for_what_it_is(rng):
    """x that is no array at all, with out left to the call: the call names hidden_states, not out."""
    _, ids, w, w13, w2 = problem(rng)
    with pytest.raises(TypeError, match="hidden_states must be an array .*got NoneType"):
        runner().run(None, ids, w, w13, w2)
    with pytest.raises(TypeError, match="hidden_states must be an array .*got list"):
        runner().run([[1.0] * H] * M, ids, w, w13, w2)


def test_one_runner_from_several_threads(rng):
    """A host run releases the GIL: runs of one runner from several threads each get their own
    answer (the binding lets one at a time into a runner whose runs release the GIL, as
    cublas_grouped's, whose state is the runner's; the reference keeps its scratch per call)."""
    import threading

    r = runner()
    problems = [problem(np.random.default_rng(seed)) for seed in range(4)]
    want = [runner().run(*p) for p in problems]
    errors = []

    def work(i):
        try:
            for _ in range(20):
                np.testing.assert_array_equal(r.run(*problems[i]), want[i])
        except Exception as exc:  # reported on the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_runner_handles():
    """Every runner gets its own handle when built (the torch ops take runners by it), found while
    the runner lives and refused once it is gone."""
    import gc

    from moerunner._runner import runner_of_handle

    a = moerunner.MoeRunner("reference", num_experts=4, hidden_size=8, intermediate_size=4, top_k=2)
    b = moerunner.MoeRunner("reference", num_experts=4, hidden_size=8, intermediate_size=4, top_k=2)
    assert isinstance(a.handle, int) and a.handle != b.handle
    assert runner_of_handle(a.handle) is a and runner_of_handle(b.handle) is b
    h = b.handle
    del b
    gc.collect()
    with pytest.raises(LookupError, match=f"no live moerunner.MoeRunner has handle {h}$"):
        runner_of_handle(h)
    assert runner_of_handle(a.handle) is a


def test_time_library_runs_the_library_on_converted_arguments(rng):
    """Runner.time_library (the bench's split of a call's host time): `iters` runs of the library
    on arguments converted once, each writing the output as run does; the seconds they took."""
    x, ids, w, w13, w2 = problem(rng)
    r = runner()
    want = r.run(x, ids, w, w13, w2)
    out = np.full((M, H), np.nan, np.float32)
    seconds = r._core.time_library(3, x, ids, w, w13, w2, out, None, None)
    assert isinstance(seconds, float) and seconds > 0
    np.testing.assert_array_equal(out, want)
    with pytest.raises(moerunner.InvalidArgumentError, match="iters must be positive"):
        r._core.time_library(0, x, ids, w, w13, w2, out, None, None)
    with pytest.raises(moerunner.InvalidArgumentError, match="w13"):  # validated as run validates
        r._core.time_library(1, x, ids, w, w13[:, :, :-1], w2, out, None, None)


def test_max_workspace_bytes():
    """The workspace for every run up to max_tokens (the reference needs none); a negative count
    is refused with the library's message."""
    r = runner()
    assert r.max_workspace_bytes(0) == 0 and r.max_workspace_bytes(4096) == 0
    with pytest.raises(moerunner.InvalidArgumentError, match="max_tokens must not be negative"):
        r.max_workspace_bytes(-1)
