"""The MoE layer and top-k routing written out in numpy (float64): what the tests compare to."""

import math

import numpy as np

_erf = np.vectorize(math.erf)


def activation(gate, up, kind, gated=True, alpha=1.702, limit=7.0):
    if kind == "silu":
        a = gate / (1.0 + np.exp(-gate))
    elif kind == "gelu":
        a = 0.5 * gate * (1.0 + _erf(gate / math.sqrt(2.0)))
    else:  # swiglu_clamped (gpt-oss)
        g = np.minimum(gate, limit)
        u = np.clip(up, -limit, limit)
        return (u + 1.0) * g / (1.0 + np.exp(-alpha * g))
    return a * up if gated else a


def moe(x, ids, weights, w13, w2, *, kind="silu", gated=True, layout="halves", b13=None, b2=None, scale=1.0,
        on_input=False, no_combine=False):
    """out[t] = scale * sum_j weights[t, j] * (w2[e] act(w13[e] x[t] + b13[e]) + b2[e]), e = ids[t, j]."""
    x, w13, w2 = (np.asarray(a, np.float64) for a in (x, w13, w2))
    m, k = ids.shape
    inter = w2.shape[2]
    rows = np.zeros((m, k, x.shape[1]))
    for t in range(m):
        for j in range(k):
            e = ids[t, j]
            if e < 0:
                continue
            w = float(weights[t, j])
            xi = x[t] * (w if on_input else 1.0)
            h = w13[e] @ xi + (b13[e] if b13 is not None else 0.0)
            if not gated:
                gate, up = h, None
            elif layout == "halves":
                gate, up = h[:inter], h[inter:]
            else:
                gate, up = h[0::2], h[1::2]
            y = w2[e] @ activation(gate, up, kind, gated) + (b2[e] if b2 is not None else 0.0)
            rows[t, j] = scale * (1.0 if on_input else w) * y
    return rows if no_combine else rows.sum(axis=1)


def topk(logits, top_k, *, scoring="softmax", renormalize=True, correction_bias=None, num_expert_group=0,
         topk_group=0):
    """Ids and weights of the top_k experts per token (ties to the lower index), float64."""
    logits = np.asarray(logits, np.float64)
    if scoring == "softmax":
        z = np.exp(logits - logits.max(axis=1, keepdims=True))
        scores = z / z.sum(axis=1, keepdims=True)
    else:
        scores = 1.0 / (1.0 + np.exp(-logits))
    keys = scores + (correction_bias if correction_bias is not None else 0.0)
    m, e = scores.shape
    ids = np.zeros((m, top_k), np.int32)
    weights = np.zeros((m, top_k))
    for t in range(m):
        allowed = np.ones(e, bool)
        if num_expert_group:
            per = e // num_expert_group
            groups = keys[t].reshape(num_expert_group, per)
            gscore = np.sort(groups, axis=1)[:, ::-1][:, :2].sum(axis=1) if correction_bias is not None \
                else groups.max(axis=1)
            kept = np.argsort(-gscore, kind="stable")[:topk_group]
            allowed = np.repeat(np.isin(np.arange(num_expert_group), kept), per)
        order = np.argsort(-np.where(allowed, keys[t], -np.inf), kind="stable")[:top_k]
        ids[t] = order
        weights[t] = scores[t, order]
    if renormalize:
        weights /= weights.sum(axis=1, keepdims=True)
    return weights, ids
