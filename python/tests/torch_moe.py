"""The MoE layer written out in torch (float32), and a small module that calls moerunner.torch."""

import torch
import torch.nn.functional as F

import moerunner.torch as mt


def moe_f32(x, ids, weights, w13, w2):
    """silu-gated experts in float32: out[t] = sum_j weights[t, j] * w2[e] (silu(gate) * up), e = ids[t, j]."""
    x, w13, w2 = x.float(), w13.float(), w2.float()
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for j in range(ids.shape[1]):
        for e in ids[:, j].unique().tolist():
            if e < 0:
                continue
            rows = (ids[:, j] == e).nonzero().squeeze(1)
            h = x[rows] @ w13[e].T
            y = (F.silu(h[:, :inter]) * h[:, inter:]) @ w2[e].T
            out[rows] += weights[rows, j, None] * y
    return out


class MoeModule(torch.nn.Module):
    """Router, top-k and experts through the moerunner ops, as a model would call them."""

    def __init__(self, runner, router, w13, w2, top_k):
        super().__init__()
        self.runner, self.top_k = runner, top_k
        self.router, self.w13, self.w2 = router, w13, w2

    def forward(self, x):
        weights, ids = mt.topk((x @ self.router.T).float(), top_k=self.top_k)
        return mt.fused_moe(self.runner, x, ids, weights, self.w13, self.w2)
