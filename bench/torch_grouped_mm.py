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
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = [
    ("Mixtral-8x7B", 8, 2, 4096, 14336),
    ("DeepSeek-V3", 256, 8, 7168, 2048),
    ("Qwen3-30B-A3B", 128, 8, 2048, 768),
]
TOKENS = [1, 8, 64, 512, 4096, 16384]
ROUTING_SETS = 4  # rotated within a cell, as in moe_bench, so small cells are not timed out of L2
CHECK_TOKENS = 8


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


def reference_rows(x, topk_ids, topk_weights, w13, w2, tokens):
    """f32 per-token MoE output for the given token indices."""
    inter = w13.shape[1] // 2
    rows = []
    for t in tokens:
        acc = torch.zeros(x.shape[1], device=x.device, dtype=torch.float32)
        xt = x[t].float()
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if e < 0:
                continue
            gu = w13[e].float() @ xt
            a = F.silu(gu[:inter]) * gu[inter:]
            acc += float(topk_weights[t, j]) * (w2[e].float() @ a)
        rows.append(acc)
    return torch.stack(rows)


def max_token_rel_err(out, ref, tokens):
    got = out[tokens].float()
    if not torch.isfinite(got).all() or not torch.isfinite(ref).all():
        return math.inf
    num = (got - ref).norm(dim=1)
    den = ref.norm(dim=1).clamp_min(1e-30)
    return float((num / den).max())


def median_launch_ms(launch):
    """Median per-launch time over batches of launches of >= ~1 ms, ~0.2 s per call."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    j = 0
    for _ in range(3):
        launch(j)
        j += 1
    torch.cuda.synchronize()
    start.record()
    launch(j)
    j += 1
    stop.record()
    stop.synchronize()
    estimate = max(1e-3, start.elapsed_time(stop))
    per_batch = min(64, max(1, math.ceil(1.0 / estimate)))
    batches = min(15, max(5, int(200.0 / (estimate * per_batch))))
    samples = []
    for _ in range(batches):
        start.record()
        for _ in range(per_batch):
            launch(j)
            j += 1
        stop.record()
        stop.synchronize()
        samples.append(start.elapsed_time(stop) / per_batch)
    return statistics.median(samples)


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


def route(logits, k):
    probs = torch.softmax(logits, dim=-1)
    w, ids = torch.topk(probs, k, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    return w, ids.to(torch.int32)


def uniform_(t, scale, gen):
    return t.uniform_(-scale, scale, generator=gen)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jsonl", required=True, help="results file from moe_bench; its first line holds the ceilings")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--tokens", default=",".join(str(t) for t in TOKENS))
    args = ap.parse_args()

    with open(args.jsonl) as f:
        first = f.readline()
    try:
        ceil = json.loads(first)
        read_bps = float(ceil["read_TBps"]) * 1e12
        gemm_fps = float(ceil["gemm_TFLOPs"]) * 1e12
    except (ValueError, KeyError, TypeError) as exc:
        sys.exit(f"torch_grouped_mm: {args.jsonl} does not start with moe_bench's ceilings line ({exc})")

    if not torch.cuda.is_available():
        sys.exit("torch_grouped_mm: no CUDA device")
    dev = torch.device("cuda")
    usable, why = grouped_mm_usable(dev)
    backend = "torch_grouped_mm" if usable else "torch_expert_loop"
    if not usable:
        print(f"torch_grouped_mm: falling back to a per-expert loop: {why}")
    print(f"PyTorch {torch.__version__} on {torch.cuda.get_device_name()}: backend {backend}")

    wanted = set(args.shapes.split(","))
    tokens_list = [int(t) for t in args.tokens.split(",") if t]
    gen = torch.Generator(device=dev).manual_seed(1234)
    stream = torch.cuda.Stream()
    failures = 0
    header = f"{'backend':<18} {'shape':<15} {'tokens':>6} {'ms':>10} {'floor_ms':>10} {'floor%':>7} " \
             f"{'TFLOP/s':>9} {'GB/s':>9} {'max_rel_err':>11} {'routing_ms':>10} timing"
    print(header)
    with open(args.jsonl, "a") as out_file:
        for name, e, k, h, inter in SHAPES:
            if name not in wanted:
                continue
            w13 = uniform_(torch.empty((e, 2 * inter, h), device=dev, dtype=torch.bfloat16), 2.0 / math.sqrt(h), gen)
            w2 = uniform_(torch.empty((e, h, inter), device=dev, dtype=torch.bfloat16), 2.0 / math.sqrt(inter), gen)
            for m in tokens_list:
                record = {"backend": backend, "shape": name, "tokens": m, "E": e, "k": k, "H": h, "I": inter}
                graphs = []
                try:
                    sets = []
                    for _ in range(ROUTING_SETS):
                        x = uniform_(torch.empty((m, h), device=dev, dtype=torch.bfloat16), 1.0, gen)
                        logits = uniform_(torch.empty((m, e), device=dev, dtype=torch.float32), 4.0, gen)
                        w, ids = route(logits, k)
                        sets.append((x, logits, w, ids))
                    touched = statistics.mean(len(torch.unique(s[3])) for s in sets)

                    # Routing alone, from one graph.
                    logits0 = sets[0][1]
                    with torch.cuda.stream(stream):
                        route(logits0, k)
                    torch.cuda.synchronize()
                    rg = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(rg, stream=stream):
                        route(logits0, k)
                    routing_ms = median_launch_ms(lambda j: rg.replay())

                    fn = grouped_moe if usable else loop_moe
                    outs = []
                    if usable:
                        with torch.cuda.stream(stream):  # warm-up outside capture, as CUDA graphs require
                            for s in sets:
                                fn(s[0], s[3], s[2], w13, w2)
                        torch.cuda.synchronize()
                        for s in sets:
                            g = torch.cuda.CUDAGraph()
                            with torch.cuda.graph(g, stream=stream):
                                outs.append(fn(s[0], s[3], s[2], w13, w2))
                            graphs.append(g)
                        ms = median_launch_ms(lambda j: graphs[j % len(graphs)].replay())
                        graphs[0].replay()
                        result = outs[0]
                        timing = "cuda_graph"
                    else:
                        ms = median_launch_ms(lambda j: fn(sets[j % len(sets)][0], sets[j % len(sets)][3],
                                                           sets[j % len(sets)][2], w13, w2))
                        result = fn(sets[0][0], sets[0][3], sets[0][2], w13, w2)
                        timing = "direct"
                    torch.cuda.synchronize()

                    x0, _, wt0, ids0 = sets[0]
                    check = sorted({int(t) for t in torch.linspace(0, m - 1, min(m, CHECK_TOKENS)).round().tolist()})
                    ref = reference_rows(x0, ids0, wt0, w13, w2, check)
                    err = max_token_rel_err(result, ref, check)
                    if not bool(torch.isfinite(result).all()):  # a NaN or inf outside the checked tokens
                        err = math.inf

                    flops = 6.0 * m * k * h * inter
                    bytes_ = touched * 2.0 * (3.0 * h * inter) + 2.0 * 2.0 * m * h + 8.0 * m * k
                    floor_ms = max(bytes_ / read_bps, flops / gemm_fps) * 1e3
                    record.update({
                        "ms": ms, "floor_ms": floor_ms, "fraction_of_floor": floor_ms / ms,
                        "tflops": flops / (ms * 1e-3) / 1e12, "gbps": bytes_ / (ms * 1e-3) / 1e9,
                        "max_rel_err": err if math.isfinite(err) else None, "check": "torch_f32_subsample",
                        "routing_ms": routing_ms, "timing": timing, "experts_touched": touched,
                        "bytes": bytes_, "flops": flops,
                    })
                    ok = math.isfinite(err) and err <= 2e-2
                    failures += 0 if ok else 1
                    print(f"{backend:<18} {name:<15} {m:>6} {ms:>10.4f} {floor_ms:>10.4f} "
                          f"{100 * floor_ms / ms:>6.1f}% {record['tflops']:>9.1f} {record['gbps']:>9.1f} "
                          f"{err:>11.2e} {routing_ms:>10.4f} {timing}{'' if ok else '  CHECK FAILED'}", flush=True)
                except Exception as exc:  # report the cell and go on with the rest
                    failures += 1
                    record.update({"ms": None, "error": f"{type(exc).__name__}: {exc}"})
                    print(f"{backend:<18} {name:<15} {m:>6}  FAILED: {record['error']}", flush=True)
                out_file.write(json.dumps(record) + "\n")
                out_file.flush()
                del graphs
                torch.cuda.empty_cache()
            del w13, w2
            torch.cuda.empty_cache()
    print(f"torch_grouped_mm: appended to {args.jsonl}; {failures} failed cell(s)")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    start = time.time()
    rc = main()
    print(f"torch_grouped_mm: {time.time() - start:.0f} s")
    sys.exit(rc)
