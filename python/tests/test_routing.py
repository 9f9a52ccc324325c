"""moerunner.topk on numpy logits (reference::topk) against top-k routing written out in numpy."""

import numpy as np
import pytest

import moe_numpy
import moerunner

M, E = 16, 32


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk(rng, scoring, renormalize):
    logits = rng.standard_normal((M, E)).astype(np.float32)
    weights, ids = moerunner.topk(logits, top_k=4, scoring=scoring, renormalize=renormalize)
    assert weights.dtype == np.float32 and ids.dtype == np.int32 and ids.shape == (M, 4)
    want_w, want_ids = moe_numpy.topk(logits, 4, scoring=scoring, renormalize=renormalize)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_w, rtol=1e-5)


def test_grouped_with_correction_bias(rng):
    logits = rng.standard_normal((M, E)).astype(np.float32)
    bias = rng.standard_normal(E).astype(np.float32)
    weights, ids = moerunner.topk(logits, top_k=4, scoring="sigmoid", correction_bias=bias, num_expert_group=8,
                                  topk_group=2)
    want_w, want_ids = moe_numpy.topk(logits, 4, scoring="sigmoid", correction_bias=bias, num_expert_group=8,
                                      topk_group=2)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_w, rtol=1e-5)


def test_fused_shared_experts_and_scaling(rng):
    logits = rng.standard_normal((M, E)).astype(np.float32)
    weights, ids = moerunner.topk(logits, top_k=4, num_fused_shared_experts=2, routed_scaling_factor=2.5,
                                  apply_routed_scaling_factor_on_weights=True)
    assert ids.shape == (M, 6)
    want_w, want_ids = moe_numpy.topk(logits, 4)
    np.testing.assert_array_equal(ids[:, :4], want_ids)
    np.testing.assert_allclose(weights[:, :4], 2.5 * want_w, rtol=1e-5)
    np.testing.assert_array_equal(ids[:, 4:], [[E, E + 1]] * M)
    np.testing.assert_array_equal(weights[:, 4:], 1.0)


def test_masked_experts_are_never_picked(rng):
    logits = rng.standard_normal((M, E)).astype(np.float32)
    logits[:, ::2] = -np.inf
    logits[0, :] = np.nan
    weights, ids = moerunner.topk(logits, top_k=4)
    assert (ids[1:] % 2 == 1).all()
    np.testing.assert_array_equal(ids[0], -1)
    np.testing.assert_array_equal(weights[0], 0.0)


def test_outputs_given(rng):
    logits = rng.standard_normal((M, E)).astype(np.float16)
    weights, ids = np.empty((M, 2), np.float32), np.empty((M, 2), np.int32)
    got = moerunner.topk(logits, top_k=2, topk_weights=weights, topk_ids=ids)
    assert got[0] is weights and got[1] is ids
    np.testing.assert_array_equal(ids, moe_numpy.topk(logits, 2)[1])


def test_routing_feeds_the_runner(rng):
    h, i = 16, 8
    x = rng.standard_normal((M, h)).astype(np.float32)
    w13 = rng.standard_normal((E, 2 * i, h)).astype(np.float32)
    w2 = rng.standard_normal((E, h, i)).astype(np.float32)
    weights, ids = moerunner.topk(rng.standard_normal((M, E)).astype(np.float32), top_k=2)
    r = moerunner.MoeRunner(num_experts=E, hidden_size=h, intermediate_size=i, top_k=2)
    np.testing.assert_allclose(r.run(x, ids, weights, w13, w2), moe_numpy.moe(x, ids, weights, w13, w2),
                               rtol=1e-5, atol=1e-4)
