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
    args = (mt.handle(runner), False, x, ids, topk_weights, w13, w2, None, None, None, None, None)
    torch.library.opcheck(torch.ops.moerunner.fused_moe.default, args)
    status = torch.zeros(2, dtype=torch.int32)  # declared mutated: opcheck runs it through functionalization
    torch.library.opcheck(torch.ops.moerunner.fused_moe_status.default, args + (status,))


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


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compile_fullgraph_on_cpu(backend):
    """Traced (eager), and lowered by inductor, which failed on an op whose mutated argument was
    None (status: now an op of its own)."""
    router, w13, w2 = weights()
    runner = moerunner.MoeRunner("reference", num_experts=E, hidden_size=H, intermediate_size=I, top_k=K)
    module = MoeModule(runner, router, w13, w2, K)
    x = torch.randn(M, H)
    compiled = torch.compile(module, fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(x), module(x), rtol=0, atol=0)


def test_compile_one_function_over_many_runners():
    """One compiled function called with runner after runner (as a model's layers share their
    code, a runner each), past torch's recompile limit (8): the handle, an int, turns symbolic at
    the second runner, and the fake implementations never look a runner up (a string handle was
    a constant of each graph, compiled again for every runner until the limit failed the call)."""
    router, w13, w2 = weights()
    x = torch.randn(M, H)

    def layer(runner, x):
        topk_weights, ids = mt.topk(x @ router.T, top_k=K)
        return mt.fused_moe(runner, x, ids, topk_weights, w13, w2)

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    runners = [moerunner.MoeRunner("reference", num_experts=E, hidden_size=H, intermediate_size=I, top_k=K)
               for _ in range(12)]
    for runner in runners:
        torch.testing.assert_close(compiled(runner, x), layer(runner, x), rtol=0, atol=0)


def test_compile_a_model_of_many_layers():
    """A model of 10 MoE layers compiled whole, as engines compile: one graph over every layer's
    runner."""
    router, w13, w2 = weights()
    layers = [MoeModule(moerunner.MoeRunner("reference", num_experts=E, hidden_size=H, intermediate_size=I,
                                            top_k=K), router, w13, w2, K) for _ in range(10)]
    model = torch.nn.Sequential(*layers)
    x = torch.randn(M, H)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)


def test_no_combine_through_the_op():
    """no_combine: [M, k, H] out of the op, eagerly and compiled (the fake implementation reads the
    flag the op is given); a flag that does not match the runner's is refused."""
    router, w13, w2 = weights()
    x = torch.randn(M, H)
    runner = moerunner.MoeRunner("reference", num_experts=E, hidden_size=H, intermediate_size=I, top_k=K,
                                 no_combine=True)
    topk_weights, ids = mt.topk(x @ router.T, top_k=K)
    out = mt.fused_moe(runner, x, ids, topk_weights, w13, w2)
    assert out.shape == (M, K, H)
    torch.testing.assert_close(out, runner.run(x, ids, topk_weights, w13, w2), rtol=0, atol=0)
    compiled = torch.compile(lambda x: mt.fused_moe(runner, x, ids, topk_weights, w13, w2), fullgraph=True)
    torch.testing.assert_close(compiled(x), out, rtol=0, atol=0)
    args = (mt.handle(runner), True, x, ids, topk_weights, w13, w2, None, None, None, None, None)
    torch.library.opcheck(torch.ops.moerunner.fused_moe.default, args)
    with pytest.raises(ValueError, match="no_combine=False given for a runner built with no_combine=True"):
        torch.ops.moerunner.fused_moe(mt.handle(runner), False, x, ids, topk_weights, w13, w2, None, None, None,
                                      None, None)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_with_status_on_cpu(backend):
    """A status tensor through torch.compile: the op functionalized for its mutated argument
    (aot_eager), and lowered by inductor."""
    router, w13, w2 = weights()
    runner = moerunner.MoeRunner("reference", num_experts=E, hidden_size=H, intermediate_size=I, top_k=K)
    status = torch.zeros(2, dtype=torch.int32)

    def layer(x, status):
        topk_weights, ids = mt.topk(x @ router.T, top_k=K)
        return mt.fused_moe(runner, x, ids, topk_weights, w13, w2, status=status)

    x = torch.randn(M, H)
    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(x, status), layer(x, status), rtol=0, atol=0)
    assert status.tolist() == [0, 0]
