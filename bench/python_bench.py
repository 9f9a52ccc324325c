#!/usr/bin/env python3
"""The Python package (moerunner.MoeRunner("cuda_fused", ...)) and SGLang's Triton fused MoE in
one process, on the shapes of bench/moe_bench.cu, appended to the same JSON-lines results.

    python3 bench/python_bench.py --jsonl results.jsonl [--peer DIR] [--modes sglang,nearest]
                                  [--shapes ...] [--tokens ...] [--iters N] [--no-peer]

Rows:
  moerunner_py           the installed package through runner.run(x, topk_ids, topk_weights, w13,
                         w2, out=..., workspace=...), out and workspace allocated once per routing
                         set, on torch's current stream: what an engine calling the package runs.
                         Each row also holds the binding's own host cost, measured on the row's
                         shape: host_us_m0, the host time of one run call at M = 0 (DLPack
                         views, the library's validation, no launch, the stream given as an
                         int), host_us_m0_current_stream (the same with the stream left to
                         torch) and host_us_m1 at M = 1 (stream given, plus the kernels'
                         launches); library_us_m0 and library_us_m1, the library's part of
                         those calls (the same runs on arguments converted once, timed in the
                         extension: Runner.time_library, in batches alternating with the
                         package's); binding_us_m0 and binding_us_m1, the medians of the
                         per-batch differences: what the package adds to a C++ caller's cost,
                         whose target at M = 1 is <= 3 us (binding_us_target).
  sglang_triton          SGLang's Triton fused MoE from DIR (peer_fused_moe.py and its configs/,
  sglang_triton_nearest  default .peers/sglang_triton_moe), as bench/sglang_triton.py times it
                         and with its fields, but in this process, beside the package's rows.
Every row of this script has "bench": "python_bench". Routing sets, weights (the same for every
backend: each run starts the generator from one seed), CUDA-graph replay timing, the f32 check
and the floor are bench_common's, as for the other Python comparisons; the first line of the
results file must be moe_bench's ceilings line.
"""

import argparse
import os
import statistics
import sys
import time

import torch

from bench_common import add_common_args, read_ceilings, run_cells, wanted_shapes
from sglang_triton import MODES, load_peer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BINDING_TARGET_US = 3.0  # the package's own host cost of a run call at M = 1
BATCH = 20  # calls per synchronized batch in the host timing: never enough to fill the launch queue


def batch_us(call):
    """Host microseconds per call of BATCH calls, the device drained after them (so that the
    next batch starts with it idle and a full launch queue never blocks the host)."""
    start = time.perf_counter()
    for _ in range(BATCH):
        call()
    us = (time.perf_counter() - start) / BATCH * 1e6
    torch.cuda.synchronize()
    return us


def host_us_per_call(call, iters):
    """Median host microseconds of one call, over batches of BATCH calls (batch_us)."""
    for _ in range(min(100, iters)):
        call()
    torch.cuda.synchronize()
    return statistics.median(batch_us(call) for _ in range(max(1, iters // BATCH)))


def paired_us_per_call(call, runner, args, iters):
    """(host, library, binding) microseconds of one call: the medians of `call` and of the
    library's run alone (the same arguments converted once, timed in the extension), and the
    median of their per-batch differences. The two are timed in alternating batches of BATCH
    calls, so that a slow stretch of the host (another process, a clock change) weighs on both
    sides of a difference instead of on one median."""
    core = runner._core
    for _ in range(min(100, iters)):
        call()
    core.time_library(min(100, iters), *args)
    torch.cuda.synchronize()
    host, library = [], []
    for _ in range(max(1, iters // BATCH)):
        host.append(batch_us(call))
        library.append(core.time_library(BATCH, *args) / BATCH * 1e6)
        torch.cuda.synchronize()
    binding = [h - lib for h, lib in zip(host, library)]
    return statistics.median(host), statistics.median(library), statistics.median(binding)


def binding_overhead(runner, e, k, h, inter, iters):
    """The host microseconds of runner.run on this shape with everything preallocated, as a dict:
    host_us_m0, host_us_m0_current_stream (the stream left to torch), host_us_m1, the library's
    part of the M = 0 and M = 1 calls (library_us_*) and the binding's (binding_us_*)."""
    dev = torch.device("cuda")
    x = torch.randn(1, h, device=dev).bfloat16()
    ids = torch.arange(k, device=dev, dtype=torch.int32).remainder(e).view(1, k)
    weights = torch.full((1, k), 1.0 / k, device=dev)
    w13 = torch.empty((e, 2 * inter, h), device=dev, dtype=torch.bfloat16)  # values unread by timing
    w2 = torch.empty((e, h, inter), device=dev, dtype=torch.bfloat16)
    w13.zero_()
    w2.zero_()
    out = torch.empty_like(x)
    workspace = torch.empty(max(1, runner.workspace_bytes(1)), dtype=torch.uint8, device=dev)
    stream = torch.cuda.current_stream().cuda_stream
    m0 = (x[:0], ids[:0], weights[:0], w13, w2)
    out0 = out[:0]
    us0, lib0, bind0 = paired_us_per_call(lambda: runner.run(*m0, out=out0, workspace=workspace, stream=stream),
                                          runner, m0 + (out0, workspace, stream), iters)
    us0_current = host_us_per_call(lambda: runner.run(*m0, out=out0, workspace=workspace), iters)
    us1, lib1, bind1 = paired_us_per_call(
        lambda: runner.run(x, ids, weights, w13, w2, out=out, workspace=workspace, stream=stream), runner,
        (x, ids, weights, w13, w2, out, workspace, stream), iters)
    del w13, w2
    torch.cuda.empty_cache()
    return {"host_us_m0": us0, "host_us_m0_current_stream": us0_current, "host_us_m1": us1,
            "library_us_m0": lib0, "library_us_m1": lib1, "binding_us_m0": bind0, "binding_us_m1": bind1}


def run_package(args, moerunner):
    """The moerunner_py rows. Returns the count of failed cells."""
    wanted = wanted_shapes(args.shapes)
    tokens = [int(t) for t in args.tokens.split(",") if t]
    # run_cells asks for a shape's extra fields once per cell, shapes then tokens in order:
    # that order names the cell, for the plan of the run.
    cells = iter([(s, m) for s in wanted for m in tokens])
    runners = {}
    overhead = {}

    def runner_of(e, inter):
        name, _, k, h, _ = next(s for s in wanted if (s[1], s[4]) == (e, inter))
        if name not in runners:
            runners[name] = moerunner.MoeRunner("cuda_fused", num_experts=e, hidden_size=h, intermediate_size=inter,
                                                top_k=k)
        return name, runners[name]

    def make_call(x, ids, weights, w13, w2):
        _, runner = runner_of(w13.shape[0], w2.shape[2])
        out = torch.empty_like(x)
        workspace = torch.empty(max(1, runner.workspace_bytes(x.shape[0])), dtype=torch.uint8, device=x.device)

        def call():  # on torch's current stream: the capture stream inside torch.cuda.graph
            return runner.run(x, ids, weights, w13, w2, out=out, workspace=workspace)
        return call

    def extra(e, inter):
        name, runner = runner_of(e, inter)
        (cell_name, _, k, h, _), m = next(cells)
        if cell_name != name:
            raise RuntimeError(f"python_bench: run_cells visited {name} where {cell_name} was expected")
        if name not in overhead:
            try:
                o = overhead[name] = binding_overhead(runner, e, k, h, inter, args.iters)
                over = "" if o["binding_us_m1"] <= BINDING_TARGET_US else ": OVER"
                print(f"moerunner_py {name}: host time per run call {o['host_us_m0']:.2f} us at M=0 (no launch; "
                      f"library {o['library_us_m0']:.2f} us, binding {o['binding_us_m0']:.2f} us), "
                      f"{o['host_us_m0_current_stream']:.2f} us with torch's current stream, "
                      f"{o['host_us_m1']:.2f} us at M=1 (library with its launches {o['library_us_m1']:.2f} us, "
                      f"binding {o['binding_us_m1']:.2f} us; target <= {BINDING_TARGET_US:g} us{over})", flush=True)
            except Exception as exc:  # run_cells asks outside its per-cell guard: report, go on
                overhead[name] = {}
                print(f"moerunner_py {name}: host time not measured: {type(exc).__name__}: {exc}", flush=True)
        return {"bench": "python_bench", "package": moerunner.__version__, "runner": runner.backend,
                "plan": runner.describe(m), "workspace_bytes": runner.workspace_bytes(m), **overhead[name],
                "binding_us_target": BINDING_TARGET_US}

    return run_cells(args, "moerunner_py", make_call, extra=extra)


def run_peer(args, folder, mode):
    """The peer's rows for one config mode, bf16 weights. Returns the count of failed cells."""
    peer = load_peer(folder, mode)

    def make_call(x, ids, weights, w13, w2):
        prep = peer.prepare_for(x, w13, w2, ids)  # the align step, outside the timed call
        return lambda: peer.fused_experts_prepared(x, w13, w2, weights, ids, prep)

    def extra(e, inter):
        up, down = peer.config_source(e, inter, None, None)
        return {"bench": "python_bench", "peer": "sglang_triton_moe", "config_mode": mode, "weights": "bf16",
                "config_up": os.path.basename(up) if up else "default",
                "config_down": os.path.basename(down) if down else "same as up"}

    return run_cells(args, MODES[mode], make_call, extra=extra)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--peer", default=os.path.join(ROOT, ".peers", "sglang_triton_moe"),
                    help="folder holding the peer's peer_fused_moe.py and configs/ (default: %(default)s)")
    ap.add_argument("--no-peer", action="store_true", help="the package's rows only")
    ap.add_argument("--modes", default=",".join(MODES), help="the peer's config modes, of: " + ", ".join(MODES))
    ap.add_argument("--iters", type=int, default=2000, help="run calls per host-time measurement (default 2000)")
    args = ap.parse_args()
    read_ceilings(args.jsonl, "python_bench")  # fail before touching the GPU
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            sys.exit(f"python_bench: unknown mode '{m}' (modes: {', '.join(MODES)})")
    folder = os.path.abspath(args.peer)
    peer_found = os.path.isfile(os.path.join(folder, "peer_fused_moe.py"))
    if not args.no_peer and not peer_found:
        sys.exit(f"python_bench: {folder} holds no peer_fused_moe.py (--peer DIR, or --no-peer)")
    if not torch.cuda.is_available():
        sys.exit("python_bench: no CUDA device")
    import moerunner

    info = moerunner.build_info()
    if not info["cuda"] or "cuda_fused" not in moerunner.backends():
        sys.exit(f"python_bench: the installed moerunner has no GPU backends ({info}); build it with CUDA")
    print(f"moerunner {moerunner.__version__} from {os.path.dirname(moerunner.__file__)} (GPU archs "
          f"{','.join(info['gpu_archs'])}), PyTorch {torch.__version__} on {torch.cuda.get_device_name()}")
    failures = run_package(args, moerunner)
    if not args.no_peer:
        import triton

        print(f"Triton {triton.__version__}; peer from {folder}")
        for mode in modes:
            failures += run_peer(args, folder, mode)
    print(f"python_bench: appended to {args.jsonl}; {failures} failed cell(s)")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    start = time.time()
    rc = main()
    print(f"python_bench: {time.time() - start:.0f} s")
    sys.exit(rc)
