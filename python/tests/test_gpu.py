"""The GPU backends on torch CUDA tensors: against torch in float32, graph capture and replay,
torch.compile, the status word and the tensors' import path. Skipped without CUDA, torch or a GPU build."""

import time

import pytest

torch = pytest.importorskip("torch")
import moerunner  # noqa: E402
from torch_moe import MoeModule, moe_f32  # noqa: E402

if not torch.cuda.is_available() or not moerunner.build_info()["cuda"]:
    pytest.skip("needs a CUDA device and the GPU build of moerunner", allow_module_level=True)

E, H, I, K = 16, 512, 256, 4


def problem(m, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, H, device="cuda", generator=g).bfloat16()
    logits = torch.randn(m, E, device="cuda", generator=g)
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) / I**0.5).bfloat16()
    weights, ids = moerunner.topk(logits, top_k=K)
    return x, ids, weights, w13, w2


def runner(backend, **kw):
    return moerunner.MoeRunner(backend, num_experts=E, hidden_size=H, intermediate_size=I, top_k=K, **kw)


@pytest.mark.parametrize("backend", ["cuda_fused", "cublas_grouped"])
@pytest.mark.parametrize("m", [1, 7, 256])
def test_against_torch_f32(backend, m):
    x, ids, weights, w13, w2 = problem(m)
    out = runner(backend).run(x, ids, weights, w13, w2)
    assert out.dtype == torch.bfloat16 and out.device == x.device
    torch.testing.assert_close(out.float(), moe_f32(x, ids, weights, w13, w2), rtol=2e-2, atol=2e-2)


def quantize_blocks(w):
    """[E, R, C] -> e4m3 and one f32 scale per 128 x 128 block (amax / 448), as fp8 checkpoints."""
    e, r, c = w.shape
    blocks = w.float().view(e, r // 128, 128, c // 128, 128)
    amax = blocks.abs().amax(dim=(2, 4))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (blocks / scale[:, :, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(e, r, c), scale.contiguous()


def quantize_rows(w, per_tensor):
    """[E, R, C] -> e4m3 and one f32 scale per row ([E, R]) or per expert matrix ([E])."""
    amax = w.float().abs().amax(dim=(1, 2) if per_tensor else 2)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    wide = scale[:, None, None] if per_tensor else scale[:, :, None]
    return (w.float() / wide).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale.contiguous()


QUANTIZERS = {"block": quantize_blocks, "channel": lambda w: quantize_rows(w, False),
              "tensor": lambda w: quantize_rows(w, True)}


@pytest.mark.parametrize("fmt", ["block", "channel", "tensor"])
@pytest.mark.parametrize("m", [1, 37, 300])
def test_fp8_against_the_reference(m, fmt):
    """cuda_fused_fp8 on torch e4m3 weights (each scale layout, named by the scales' rank) against the
    reference's fp8 path on the host (the same quantization points), normwise."""
    x, ids, weights, w13, w2 = problem(m)
    q13, s13 = QUANTIZERS[fmt](w13)
    q2, s2 = QUANTIZERS[fmt](w2)
    out = runner("cuda_fused_fp8").run(x, ids, weights, q13, q2, w13_scale=s13, w2_scale=s2)
    assert out.dtype == torch.bfloat16 and out.device == x.device
    ref = runner("reference").run(x.cpu(), ids.cpu(), weights.cpu(), q13.cpu(), q2.cpu(), w13_scale=s13.cpu(),
                                  w2_scale=s2.cpu())
    err = (out.cpu().float() - ref.float()).norm() / ref.float().norm()
    assert err <= 1e-2, f"normwise relative error {err:.3e}"


def test_device_topk_is_the_host_ones_bit_for_bit():
    logits = torch.randn(64, E, device="cuda")
    bias = torch.randn(E, device="cuda")
    kw = dict(top_k=K, scoring="sigmoid", num_expert_group=4, topk_group=2, num_fused_shared_experts=1)
    dw, di = moerunner.topk(logits, correction_bias=bias, **kw)
    hw, hi = moerunner.topk(logits.cpu(), correction_bias=bias.cpu(), **kw)
    assert torch.equal(di.cpu(), hi) and torch.equal(dw.cpu(), hw)


def test_graph_capture_and_replay_deterministic():
    x, ids, weights, w13, w2 = problem(64)
    r = runner("cuda_fused", deterministic=True)
    out = torch.empty_like(x)
    workspace = torch.empty(r.workspace_bytes(64), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        r.run(x, ids, weights, w13, w2, out=out, workspace=workspace)  # warm-up outside the capture
    torch.cuda.synchronize()
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        r.run(x, ids, weights, w13, w2, out=out, workspace=workspace)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), eager.view(torch.int16))


@pytest.mark.parametrize("backend", ["cuda_fused", "cuda_fused_fp8"])
def test_one_workspace_for_every_batch(backend):
    """A workspace of max_workspace_bytes(n) serves a deterministic run of every M up to n, though
    a run's need is not monotone in M (decode's K splits keep f32 parts a larger batch does not)."""
    n = 96
    r = runner(backend, deterministic=True)
    most = r.max_workspace_bytes(n)
    needs = [r.workspace_bytes(m) for m in range(n + 1)]
    assert most == max(needs)
    workspace = torch.empty(most, dtype=torch.uint8, device="cuda")
    for m in (1, 3, 17, 64, n):
        x, ids, weights, w13, w2 = problem(m, seed=m)
        scales = {}
        if backend == "cuda_fused_fp8":
            w13, scales["w13_scale"] = QUANTIZERS["block"](w13)
            w2, scales["w2_scale"] = QUANTIZERS["block"](w2)
        out = r.run(x, ids, weights, w13, w2, workspace=workspace, **scales)
        want = r.run(x, ids, weights, w13, w2, **scales)  # its own workspace of workspace_bytes(m)
        torch.cuda.synchronize()
        assert torch.isfinite(out.float()).all()
        assert torch.equal(out.view(torch.int16), want.view(torch.int16))


def test_a_run_on_a_stream_of_its_own():
    """out and workspace left to the call, the run on a stream that is not torch's current one:
    torch's allocator is told they are used there (record_stream), so allocations on the current
    stream meanwhile do not take them; the bits are the current-stream run's (deterministic)."""
    x, ids, weights, w13, w2 = problem(64)
    r = runner("cuda_fused", deterministic=True)
    assert r.workspace_bytes(64, device=x.device) == r.workspace_bytes(64)  # x is on the current device
    want = r.run(x, ids, weights, w13, w2)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    out = r.run(x, ids, weights, w13, w2, stream=s)
    scribbles = [torch.full((r.workspace_bytes(64) + 1024,), 255, dtype=torch.uint8, device="cuda") for _ in range(8)]
    s.synchronize()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    del scribbles


def test_status_counts_bad_ids():
    x, ids, weights, w13, w2 = problem(8)
    ids[3, 1] = 1000
    status = torch.zeros(2, dtype=torch.int32, device="cuda")
    runner("cuda_fused").run(x, ids, weights, w13, w2, status=status)
    assert status.tolist() == [1, 3 * K + 1]


@pytest.mark.parametrize("mode", ["eager", "compile", "graph"])
def test_status_through_the_torch_op(mode):
    """moerunner::fused_moe's status, eager, under torch.compile(fullgraph=True) and replayed from
    a CUDA graph: the bad slot is counted and left out like -1, and runs add to the word."""
    import moerunner.torch as mt

    x, ids, weights, w13, w2 = problem(8)
    ids[3, 1] = 1000
    status = torch.zeros(2, dtype=torch.int32, device="cuda")
    r = runner("cuda_fused")

    def step(x, ids, weights, status):
        return mt.fused_moe(r, x, ids, weights, w13, w2, status=status)

    if mode == "compile":
        call = torch.compile(step, fullgraph=True)
    elif mode == "graph":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step(x, ids, weights, status)  # warm-up outside the capture
        torch.cuda.synchronize()
        status.zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = step(x, ids, weights, status)
        torch.cuda.synchronize()
        assert status.tolist() == [0, 0]  # captured, not run

        def call(*args):
            graph.replay()
            return captured
    else:
        call = step
    out = call(x, ids, weights, status)
    torch.cuda.synchronize()
    assert status.tolist() == [1, 3 * K + 1]
    good = ids.clone()
    good[3, 1] = -1
    torch.testing.assert_close(out.float(), moe_f32(x, good, weights, w13, w2), rtol=2e-2, atol=2e-2)
    call(x, ids, weights, status)
    torch.cuda.synchronize()
    assert status.tolist() == [2, 3 * K + 1]


def test_torch_compile_fullgraph():
    x, ids, weights, w13, w2 = problem(16)
    router = torch.randn(E, H, device="cuda").bfloat16()
    module = MoeModule(runner("cuda_fused", deterministic=True), router, w13, w2, K)
    compiled = torch.compile(module, fullgraph=True)
    torch.testing.assert_close(compiled(x), module(x), rtol=0, atol=0)


def test_a_failed_cuda_call_is_reported_once():
    """A CUDA call that fails raises there, and leaves no last error behind for the next run's
    launch checks to report as theirs (here: arrays on a device that does not exist, which the
    call tries to make current)."""
    from exchange_api import array_type

    x, ids, weights, w13, w2 = problem(7)
    r = runner("cuda_fused")
    missing = array_type(device=(2, torch.cuda.device_count()))  # kDLCUDA, past the last device
    fake = [missing(t.cpu().float().numpy()) for t in (x, ids, weights, w13, w2)]
    with pytest.raises(moerunner.CudaError, match="cudaErrorInvalidDevice"):
        r.run(*fake, out=missing(x.cpu().float().numpy()))
    out = r.run(x, ids, weights, w13, w2)
    torch.testing.assert_close(out.float(), moe_f32(x, ids, weights, w13, w2), rtol=2e-2, atol=2e-2)


def test_call_reads_tensors_without_python_calls(monkeypatch):
    """A run on torch CUDA tensors, its stream left to torch, reads tensors and stream through
    DLPack's C exchange API: no __dlpack__ call, whose microseconds per tensor were most of the
    binding's host cost. The cost itself is the bench's to hold (binding_us_m1); printed here."""
    if not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
        pytest.skip("this torch has no DLPack C exchange API")
    x, ids, weights, w13, w2 = problem(1)
    r = runner("cuda_fused", deterministic=True)  # the two runs' bits are compared
    out = torch.empty_like(x)
    workspace = torch.empty(r.workspace_bytes(1), dtype=torch.uint8, device="cuda")
    r.run(x, ids, weights, w13, w2, out=out, workspace=workspace)
    want = out.clone()

    def refuse(*args, **kwargs):
        raise AssertionError("__dlpack__ called")

    monkeypatch.setattr(torch.Tensor, "__dlpack__", refuse)
    out.zero_()
    r.run(x, ids, weights, w13, w2, out=out, workspace=workspace)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    empty = x[:0], ids[:0], weights[:0], w13, w2
    out0 = out[:0]
    n = 2000
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        r.run(*empty, out=out0, workspace=workspace)
    print(f"host time per run call at M=0: {(time.perf_counter() - start) / n * 1e6:.2f} us")
