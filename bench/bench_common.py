"""What the Python comparisons in bench/ share with moe_bench: the shapes, the routing sets a
cell rotates through, the timing loop, the f32 check and the floor, so that every row of one
results file is measured and scored the same way.

A comparison calls run_cells() with a backend name and a function that, given one routing set
and the weights, returns a no-argument call to capture in a CUDA graph (or, for a call that
cannot be captured, to time directly). The first line of the JSONL (written by moe_bench) gives
the ceilings the floor is computed from: flops = 6*M*k*H*I, bytes = weights of the experts
touched + x in + out + topk ids and weights, floor_ms = max(bytes / read bandwidth, flops /
GEMM rate).
"""

import json
import math
import statistics
import sys

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
MAX_REL_ERR = 2e-2  # moe_bench's bound: a cell above it is reported as failed


def route(logits, k):
    probs = torch.softmax(logits, dim=-1)
    w, ids = torch.topk(probs, k, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    return w, ids.to(torch.int32)


def uniform_(t, scale, gen):
    return t.uniform_(-scale, scale, generator=gen)


def reference_rows(x, topk_ids, topk_weights, w13, w2, tokens):
    """f32 per-token MoE output (silu, gate rows then up rows) for the given token indices."""
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


def read_ceilings(jsonl, who):
    """(read bytes/s, GEMM flop/s) from the results file's first line (moe_bench's ceilings)."""
    with open(jsonl) as f:
        first = f.readline()
    try:
        ceil = json.loads(first)
        return float(ceil["read_TBps"]) * 1e12, float(ceil["gemm_TFLOPs"]) * 1e12
    except (ValueError, KeyError, TypeError) as exc:
        sys.exit(f"{who}: {jsonl} does not start with moe_bench's ceilings line ({exc})")


def add_common_args(ap):
    ap.add_argument("--jsonl", required=True, help="results file from moe_bench; its first line holds the ceilings")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES),
                    help="named shapes, and shapes the bench does not name as NAME:E:K:H:I (as moe_bench takes)")
    ap.add_argument("--tokens", default=",".join(str(t) for t in TOKENS))


def wanted_shapes(spec):
    """The (name, E, k, H, I) shapes a --shapes value asks for: the named ones in SHAPES' order,
    then each NAME:E:K:H:I in the order given."""
    items = [s for s in spec.split(",") if s]
    shapes = [s for s in SHAPES if s[0] in items]
    for item in items:
        if ":" not in item:
            continue
        fields = item.split(":")
        try:
            name, (e, k, h, inter) = fields[0], map(int, fields[1:])
        except ValueError:
            sys.exit(f"a shape is NAME:E:K:H:I with integers, got {item}")
        if not name or e <= 0 or not 0 < k <= e or h <= 0 or inter <= 0:
            sys.exit(f"a shape needs E, H, I > 0 and 0 < K <= E, got {item}")
        shapes.append((name, e, k, h, inter))
    return shapes


def run_cells(args, backend, make_call, *, captured=True, time_routing=False, extra=None, stream=None,
              weight_format=None):
    """Times backend on every wanted (shape, tokens) cell and appends one JSON line per cell.

    make_call(x, topk_ids, topk_weights, w13, w2) returns a no-argument call that computes the
    layer's [M, H] output; it runs once outside capture first (warm-up, compiles), then is
    captured in one CUDA graph per routing set (captured=True) or called directly.
    extra(e, inter), when given, returns fields merged into each record of a shape (the peer's
    config files, say). weight_format, when given, is how the layer reads its weights:
    prepare(w13, w2) -> (w13, w2) as make_call and the check receive them, reference(x, ids,
    weights, w13, w2, tokens) the f32 rows to check against, weight_bytes per element and
    flops_per_s (the floor's rate). Returns the count of failed cells."""
    read_bps, gemm_fps = read_ceilings(args.jsonl, backend)
    weight_bytes = 2.0
    reference = reference_rows
    if weight_format is not None:
        weight_bytes = weight_format.weight_bytes
        gemm_fps = weight_format.flops_per_s
        reference = weight_format.reference
    dev = torch.device("cuda")
    tokens_list = [int(t) for t in args.tokens.split(",") if t]
    gen = torch.Generator(device=dev).manual_seed(1234)
    stream = stream or torch.cuda.Stream()
    failures = 0
    print(f"{'backend':<24} {'shape':<15} {'tokens':>6} {'ms':>10} {'floor_ms':>10} {'floor%':>7} "
          f"{'TFLOP/s':>9} {'GB/s':>9} {'max_rel_err':>11} {'routing_ms':>10} timing")
    with open(args.jsonl, "a") as out_file:
        for name, e, k, h, inter in wanted_shapes(args.shapes):
            w13 = uniform_(torch.empty((e, 2 * inter, h), device=dev, dtype=torch.bfloat16), 2.0 / math.sqrt(h), gen)
            w2 = uniform_(torch.empty((e, h, inter), device=dev, dtype=torch.bfloat16), 2.0 / math.sqrt(inter), gen)
            if weight_format is not None:
                w13, w2 = weight_format.prepare(w13, w2)
            for m in tokens_list:
                record = {"backend": backend, "shape": name, "tokens": m, "E": e, "k": k, "H": h, "I": inter}
                record.update(extra(e, inter) if extra else {})
                graphs = []
                try:
                    sets = []
                    for _ in range(ROUTING_SETS):
                        x = uniform_(torch.empty((m, h), device=dev, dtype=torch.bfloat16), 1.0, gen)
                        logits = uniform_(torch.empty((m, e), device=dev, dtype=torch.float32), 4.0, gen)
                        w, ids = route(logits, k)
                        sets.append((x, logits, w, ids))
                    touched = statistics.mean(len(torch.unique(s[3])) for s in sets)

                    routing_ms = None
                    if time_routing:  # torch's own routing, from one graph
                        logits0 = sets[0][1]
                        with torch.cuda.stream(stream):
                            route(logits0, k)
                        torch.cuda.synchronize()
                        rg = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(rg, stream=stream):
                            route(logits0, k)
                        routing_ms = median_launch_ms(lambda j: rg.replay())

                    calls = [make_call(s[0], s[3], s[2], w13, w2) for s in sets]
                    with torch.cuda.stream(stream):  # warm-up outside capture, as CUDA graphs require
                        for c in calls:
                            c()
                    torch.cuda.synchronize()
                    if captured:
                        outs = []
                        for c in calls:
                            g = torch.cuda.CUDAGraph()
                            with torch.cuda.graph(g, stream=stream):
                                outs.append(c())
                            graphs.append(g)
                        ms = median_launch_ms(lambda j: graphs[j % len(graphs)].replay())
                        graphs[0].replay()
                        result = outs[0]
                        timing = "cuda_graph"
                    else:
                        ms = median_launch_ms(lambda j: calls[j % len(calls)]())
                        result = calls[0]()
                        timing = "direct"
                    torch.cuda.synchronize()

                    x0, _, wt0, ids0 = sets[0]
                    check = sorted({int(t) for t in torch.linspace(0, m - 1, min(m, CHECK_TOKENS)).round().tolist()})
                    ref = reference(x0, ids0, wt0, w13, w2, check)
                    err = max_token_rel_err(result, ref, check)
                    if not bool(torch.isfinite(result).all()):  # a NaN or inf outside the checked tokens
                        err = math.inf

                    flops = 6.0 * m * k * h * inter
                    bytes_ = touched * weight_bytes * (3.0 * h * inter) + 2.0 * 2.0 * m * h + 8.0 * m * k
                    floor_ms = max(bytes_ / read_bps, flops / gemm_fps) * 1e3
                    record.update({
                        "ms": ms, "floor_ms": floor_ms, "fraction_of_floor": floor_ms / ms,
                        "tflops": flops / (ms * 1e-3) / 1e12, "gbps": bytes_ / (ms * 1e-3) / 1e9,
                        "max_rel_err": err if math.isfinite(err) else None, "check": "torch_f32_subsample",
                        "routing_ms": routing_ms, "timing": timing, "experts_touched": touched,
                        "bytes": bytes_, "flops": flops,
                    })
                    ok = math.isfinite(err) and err <= MAX_REL_ERR
                    failures += 0 if ok else 1
                    rms = f"{routing_ms:>10.4f}" if routing_ms is not None else f"{'-':>10}"
                    print(f"{backend:<24} {name:<15} {m:>6} {ms:>10.4f} {floor_ms:>10.4f} "
                          f"{100 * floor_ms / ms:>6.1f}% {record['tflops']:>9.1f} {record['gbps']:>9.1f} "
                          f"{err:>11.2e} {rms} {timing}{'' if ok else '  CHECK FAILED'}", flush=True)
                except Exception as exc:  # report the cell and go on with the rest
                    failures += 1
                    record.update({"ms": None, "error": f"{type(exc).__name__}: {exc}"})
                    print(f"{backend:<24} {name:<15} {m:>6}  FAILED: {record['error']}", flush=True)
                out_file.write(json.dumps(record) + "\n")
                out_file.flush()
                del graphs
                torch.cuda.empty_cache()
            del w13, w2
            torch.cuda.empty_cache()
    return failures
