#!/usr/bin/env python3
"""The MoE layer as a PyTorch user would write it with torch._grouped_mm, on the shapes of
bench/moe_bench.cu, appended to the same JSON-lines results so one table shows both.

    python3 bench/torch_grouped_mm.py --jsonl results.jsonl [--shapes ...] [--tokens ...]

The first line of the JSONL (written by moe_bench) gives the ceilings (read_TBps, gemm_TFLOPs)
that the floor is computed from, with the same byte and flop formulas as moe_bench:
flops = 6*M*k*H*I, bytes = weights of the experts touched + x in + out + topk ids and weights,
floor_ms = max(bytes / read bandwidth, flops / GEMM rate).

Pipeline (timed from topk ids/weights to the output, bf16 in, like moe_bench):
sort the token slots by expert, gather x, cumulative int32 offsets, torch._grouped_mm for
gate/up, silu(gate) * up, torch._grouped_mm for down, then a weighted index_add_ into an f32
output cast to bf16. It needs no host synchronization, so it is timed by replaying CUDA graphs
(torch.cuda.CUDAGraph), median over batches of replays measured with CUDA events. Where
torch._grouped_mm is missing or refuses the problem, a per-expert loop of torch.mm runs instead
(backend "torch_expert_loop", timed by direct calls since it reads the counts on the host).

max_rel_err: the largest per-token ||out_t - ref_t|| / ||ref_t|| over up to 8 tokens, ref an
f32 per-token computation on the GPU ("check": "torch_f32_subsample").
"""

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from bench_common import add_common_args, read_ceilings, run_cells


def grouped_moe(x, topk_ids, topk_weights, w13, w2):
    """x [M, H] bf16, topk_ids [M, k] int, topk_weights [M, k] f32, w13 [E, 2I, H], w2 [E, H, I]."""
    m, h = x.shape
    k = topk_ids.shape[1]
    e, two_i, _ = w13.shape
    inter = two_i // 2
    flat = topk_ids.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)
    token_of_row = order // k
    xs = x.index_select(0, token_of_row)
    experts = torch.arange(e, device=x.device, dtype=sorted_ids.dtype)
    offs = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)
    gate_up = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
    act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    down = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)
    weights = topk_weights.reshape(-1).index_select(0, order)
    out = torch.zeros((m, h), device=x.device, dtype=torch.float32)
    out.index_add_(0, token_of_row, down.float() * weights.unsqueeze(1))
    return out.to(x.dtype)


def loop_moe(x, topk_ids, topk_weights, w13, w2):
    """The same layer as a per-expert loop; reads the per-expert counts on the host."""
    m, h = x.shape
    k = topk_ids.shape[1]
    inter = w13.shape[1] // 2
    flat = topk_ids.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)
    token_of_row = order // k
    counts = torch.bincount(sorted_ids, minlength=w13.shape[0]).tolist()
    xs = x.index_select(0, token_of_row)
    down = torch.empty((xs.shape[0], h), device=x.device, dtype=x.dtype)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        gu = xs[start:start + n] @ w13[e].t()
        down[start:start + n] = (F.silu(gu[:, :inter]) * gu[:, inter:]) @ w2[e].t()
        start += n
    weights = topk_weights.reshape(-1).index_select(0, order)
    out = torch.zeros((m, h), device=x.device, dtype=torch.float32)
    out.index_add_(0, token_of_row, down.float() * weights.unsqueeze(1))
    return out.to(x.dtype)


def grouped_mm_usable(device):
    """True when torch._grouped_mm exists and matches a loop on a small problem."""
    if not hasattr(torch, "_grouped_mm"):
        return False, "torch._grouped_mm is not in this PyTorch"
    try:
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(37, 64, device=device, generator=g).bfloat16()
        w13 = (torch.randn(6, 64, 64, device=device, generator=g) / 8).bfloat16()
        w2 = (torch.randn(6, 64, 32, device=device, generator=g) / 8).bfloat16()
        # Experts 0, 2 and 4 of 6: empty groups in the middle and at the end, as real routing gives.
        first = torch.randint(0, 3, (37,), device=device, generator=g, dtype=torch.int32)
        ids = torch.stack([first * 2, ((first + 1) % 3) * 2], dim=1)
        w = torch.rand(37, 2, device=device, generator=g)
        a = grouped_moe(x, ids, w, w13, w2).float()
        b = loop_moe(x, ids, w, w13, w2).float()
        err = float((a - b).norm() / b.norm())
        if not err < 2e-2:
            return False, f"torch._grouped_mm disagrees with a per-expert loop (rel err {err:.3g})"
        return True, ""
    except Exception as exc:  # an unsupported GPU or build raises here
        return False, f"torch._grouped_mm failed: {exc}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    args = ap.parse_args()
    read_ceilings(args.jsonl, "torch_grouped_mm")  # fail before touching the GPU
    if not torch.cuda.is_available():
        sys.exit("torch_grouped_mm: no CUDA device")
    usable, why = grouped_mm_usable(torch.device("cuda"))
    backend = "torch_grouped_mm" if usable else "torch_expert_loop"
    if not usable:
        print(f"torch_grouped_mm: falling back to a per-expert loop: {why}")
    print(f"PyTorch {torch.__version__} on {torch.cuda.get_device_name()}: backend {backend}")
    fn = grouped_moe if usable else loop_moe
    failures = run_cells(args, backend, lambda x, ids, w, w13, w2: (lambda: fn(x, ids, w, w13, w2)),
                         captured=usable, time_routing=True)
    print(f"torch_grouped_mm: appended to {args.jsonl}; {failures} failed cell(s)")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    start = time.time()
    rc = main()
    print(f"torch_grouped_mm: {time.time() - start:.0f} s")
    sys.exit(rc)
