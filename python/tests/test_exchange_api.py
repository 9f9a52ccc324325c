"""Arrays whose type offers DLPack's C exchange API (torch's path): read without a Python call,
the same results as numpy's path, the framework's stream for device arrays, and the fallback
to __dlpack__ for a table this package cannot use. A ctypes producer stands in for torch here;
torch itself follows where it is installed."""

import re

import numpy as np
import pytest

import moerunner
from exchange_api import array_type

E, H, I, K, M = 6, 32, 16, 2, 5


def problem(rng):
    x = rng.standard_normal((M, H)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(M)]).astype(np.int32)
    weights = rng.random((M, K)).astype(np.float32)
    w13 = (rng.standard_normal((E, 2 * I, H)) / np.sqrt(H)).astype(np.float32)
    w2 = (rng.standard_normal((E, H, I)) / np.sqrt(I)).astype(np.float32)
    return x, ids, weights, w13, w2


def runner():
    return moerunner.MoeRunner("reference", num_experts=E, hidden_size=H, intermediate_size=I, top_k=K)


def test_run_reads_arrays_through_the_table(rng):
    arrays = problem(rng)
    want = runner().run(*arrays)
    Array = array_type()
    out = Array(np.full((M, H), np.nan, np.float32))
    got = runner().run(*(Array(a) for a in arrays), out=out)
    assert got is out
    np.testing.assert_array_equal(out.a, want)
    # One export per array, no __dlpack__, and no stream asked for host arrays.
    assert Array.calls == [("export",)] * 6


def test_topk_reads_logits_through_the_table(rng):
    logits = rng.standard_normal((M, E)).astype(np.float32)
    want_weights, want_ids = moerunner.topk(logits, top_k=K)
    Array = array_type()
    weights, ids = Array(np.empty((M, K), np.float32)), Array(np.empty((M, K), np.int32))
    moerunner.topk(Array(logits), top_k=K, topk_weights=weights, topk_ids=ids)
    np.testing.assert_array_equal(weights.a, want_weights)
    np.testing.assert_array_equal(ids.a, want_ids)


def test_strides_reach_the_library(rng):
    x, ids, weights, w13, w2 = problem(rng)
    Array = array_type()
    wide = np.zeros((M, 2 * H), np.float32)
    with pytest.raises(moerunner.InvalidArgumentError,
                       match=re.escape("MoeRunner::run: hidden_states must be contiguous (row-major)")):
        runner().run(Array(wide[:, ::2]), ids, weights, w13, w2, out=np.empty((M, H), np.float32))


def test_another_major_version_goes_through_dlpack(rng):
    arrays = problem(rng)
    want = runner().run(*arrays)
    Array = array_type(major=2, with_dlpack=True)
    got = runner().run(*(Array(a) for a in arrays), out=np.empty((M, H), np.float32))
    np.testing.assert_array_equal(got, want)
    assert Array.calls == [("__dlpack__",)] * 5


def test_a_refused_export_is_a_buffer_error_naming_the_argument(rng):
    x, ids, weights, w13, w2 = problem(rng)
    Array = array_type(fail=True)
    with pytest.raises(BufferError, match=re.escape(
            "MoeRunner::run: topk_ids could not be exported through DLPack: no reason given")):
        runner().run(x, Array(ids), weights, w13, w2)


def test_device_arrays_run_on_the_frameworks_stream(rng):
    """The framework is asked for its current stream of the arrays' CUDA device when no stream
    is given, and not otherwise. (The reference backend then refuses device memory: no GPU is
    needed to see which stream the call would have taken.)"""
    x, ids, weights, w13, w2 = problem(rng)
    Array = array_type(device=(2, 3))  # kDLCUDA, device 3
    refused = re.escape("MoeRunner::run: hidden_states must live in host memory, got device")
    with pytest.raises(moerunner.InvalidArgumentError, match=refused):
        runner().run(Array(x), ids, weights, w13, w2, out=np.empty((M, H), np.float32))
    assert Array.calls == [("export",), ("stream", 2, 3)]
    Array.calls.clear()
    with pytest.raises(moerunner.InvalidArgumentError, match=refused):
        runner().run(Array(x), ids, weights, w13, w2, out=np.empty((M, H), np.float32), stream=7)
    assert Array.calls == [("export",)]


def test_device_arrays_on_two_devices_are_refused(rng):
    x, ids, weights, w13, w2 = problem(rng)
    on3, on4 = array_type(device=(2, 3)), array_type(device=(2, 4))
    with pytest.raises(moerunner.InvalidArgumentError, match=re.escape(
            "MoeRunner::run: topk_ids is on CUDA device 4, the call's other device tensors on device 3")):
        runner().run(on3(x), on4(ids), weights, w13, w2, out=np.empty((M, H), np.float32))


def test_torch_tensors_never_call_dlpack(rng, monkeypatch):
    """torch >= 2.11 carries the table: a run on its tensors makes no __dlpack__ call, the
    microseconds per tensor that the table saves."""
    torch = pytest.importorskip("torch")
    if not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
        pytest.skip("this torch has no DLPack C exchange API")
    arrays = problem(rng)
    want = runner().run(*arrays)

    def refuse(*args, **kwargs):
        raise AssertionError("__dlpack__ called")

    monkeypatch.setattr(torch.Tensor, "__dlpack__", refuse)
    got = runner().run(*(torch.from_numpy(a) for a in arrays))
    np.testing.assert_array_equal(got.numpy(), want)
    # A parameter (a Tensor subclass, requiring grad) is read the same way.
    w13 = torch.nn.Parameter(torch.from_numpy(arrays[3]))
    got = runner().run(*(torch.from_numpy(a) for a in arrays[:3]), w13, torch.from_numpy(arrays[4]))
    np.testing.assert_array_equal(got.numpy(), want)
