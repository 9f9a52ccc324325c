"""moerunner.torch on CPU tensors with the reference backend: the ops, their fake
implementations and torch.compile(fullgraph=True). Skipped where torch is not installed."""

import pytest

torch = pytest.importorskip("torch")
import moerunner  # noqa: E402
import moerunner.torch as mt  # noqa: E402
from torch_moe import MoeModule, moe_f32  # noqa: E402

E, H, I, K, M = 8, 64, 32, 2, 5


def weights(device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(5)
    router = torch.randn(E, H, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    return (t.to(device=device, dtype=dtype) for t in (router, w13, w2))


def test_ops_on_cpu_match_torch():
    router, w13, w2 = weights()
    x = torch.randn(M, H)
    runner = moerunner.MoeRunner("reference", num_experts=E, hidden_size=H, intermediate_size=I, top_k=K)
    topk_weights, ids = mt.topk(x @ router.T, top_k=K)
    assert ids.dtype == torch.int32 and topk_weights.dtype == torch.float32
    out = mt.fused_moe(runner, x, ids, topk_weights, w13, w2)
    torch.testing.assert_close(out, moe_f32(x, ids, topk_weights, w13, w2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(runner.run(x, ids, topk_weights, w13, w2), out, rtol=0, atol=0)


def test_opcheck():
    router, w13, w2 = weights()
    x = torch.randn(M, H)
    runner = moerunner.MoeRunner("reference", num_experts=E, hidden_size=H, intermediate_size=I, top_k=K)
    topk_weights, ids = mt.topk(x @ router.T, top_k=K)
    torch.library.opcheck(torch.ops.moerunner.fused_moe.default,
                          (mt.handle(runner), x, ids, topk_weights, w13, w2, None, None, None, None, None, None))
    status = torch.zeros(2, dtype=torch.int32)  # declared mutated: opcheck runs it through functionalization
    torch.library.opcheck(torch.ops.moerunner.fused_moe.default,
                          (mt.handle(runner), x, ids, topk_weights, w13, w2, None, None, None, None, None, status))


def test_status_through_the_op():
    """The op hands status to the run: checked there (int32 [2], the runner's memory space), and
    left alone by the reference backend, which rejects bad ids itself (cuda_fused counts them:
    test_gpu.py)."""
    router, w13, w2 = weights()
    x = torch.randn(M, H)
    runner = moerunner.MoeRunner("reference", num_experts=E, hidden_size=H, intermediate_size=I, top_k=K)
    topk_weights, ids = mt.topk(x @ router.T, top_k=K)
    status = torch.zeros(2, dtype=torch.int32)
    out = mt.fused_moe(runner, x, ids, topk_weights, w13, w2, status=status)
    torch.testing.assert_close(out, runner.run(x, ids, topk_weights, w13, w2), rtol=0, atol=0)
    assert status.tolist() == [0, 0]
    with pytest.raises(ValueError, match="status"):
        mt.fused_moe(runner, x, ids, topk_weights, w13, w2, status=torch.zeros(2, dtype=torch.float32))
    with pytest.raises(ValueError, match="status"):
        mt.fused_moe(runner, x, ids, topk_weights, w13, w2, status=torch.zeros(3, dtype=torch.int32))
    bad = ids.clone()
    bad[1, 0] = E
    with pytest.raises(ValueError):
        mt.fused_moe(runner, x, bad, topk_weights, w13, w2, status=status)
    assert status.tolist() == [0, 0]


def test_compile_fullgraph_on_cpu():
    router, w13, w2 = weights()
    runner = moerunner.MoeRunner("reference", num_experts=E, hidden_size=H, intermediate_size=I, top_k=K)
    module = MoeModule(runner, router, w13, w2, K)
    x = torch.randn(M, H)
    compiled = torch.compile(module, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), module(x), rtol=0, atol=0)


def test_compile_fullgraph_with_status_on_cpu():
    """A status tensor through torch.compile: aot_eager functionalizes the op (the mutated
    argument), as inductor does."""
    router, w13, w2 = weights()
    runner = moerunner.MoeRunner("reference", num_experts=E, hidden_size=H, intermediate_size=I, top_k=K)
    status = torch.zeros(2, dtype=torch.int32)

    def layer(x, status):
        topk_weights, ids = mt.topk(x @ router.T, top_k=K)
        return mt.fused_moe(runner, x, ids, topk_weights, w13, w2, status=status)

    x = torch.randn(M, H)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, status), layer(x, status), rtol=0, atol=0)
    assert status.tolist() == [0, 0]
