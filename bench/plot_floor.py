#!/usr/bin/env python3
"""Fraction of the floor per cell and backend, from one results file, as a picture and a table.

    python3 bench/plot_floor.py RESULTS.jsonl [--png OUT.png] [--table OUT.md] [--backends a,b,...]
                                [--subject cuda_fused]

The table gives, per shape and token count, each backend's median ms and fraction of the
floor, and the subject backend's speed-up over the best peer of the same cell (the fastest
of the rows whose backend starts with sglang_triton or torch_, in the subject's weight
format: fp8 rows are the bar for fp8 backends only; the bench's variants of the subject are
not peers), with the geometric mean over the cells where both ran. The picture
(matplotlib, where installed) draws fraction_of_floor against tokens, one panel per shape.
Rows of another tree built for comparison (BACKEND@baseline) are left out unless named.
"""

import argparse
import json
import math
import sys
from collections import OrderedDict

PEER_PREFIXES = ("sglang_triton", "torch_")


def load(path):
    with open(path) as f:
        lines = [json.loads(l) for l in f if l.strip()]
    if not lines or "backend" in lines[0]:
        sys.exit(f"plot_floor: {path} does not start with moe_bench's ceilings line")
    return lines[0], [l for l in lines[1:] if "backend" in l]


def is_peer(backend):
    return backend.startswith(PEER_PREFIXES) and "@" not in backend


def best_peer(by, backends, shape, tokens, subject):
    """(backend, ms) of the fastest peer row of the cell in the subject's weight format (an
    fp8 row is no bar for a bf16 backend, nor the reverse), or (None, None)."""
    best = (None, None)
    for b in backends:
        row = by.get((b, shape, tokens))
        if is_peer(b) and ("fp8" in b) == ("fp8" in subject) and row and row.get("ms"):
            if best[1] is None or row["ms"] < best[1]:
                best = (b, row["ms"])
    return best


def table(head, cells, backends, subject):
    by = {(c["backend"], c["shape"], c["tokens"]): c for c in cells}
    keys = list(OrderedDict.fromkeys((c["shape"], c["tokens"]) for c in cells))
    out = [f"# {head.get('gpu', '?')}, commit {head.get('commit', '?')}, {head.get('date', '')}",
           "",
           f"Ceilings measured in the same run: HBM read {head.get('read_TBps', 0):.2f} TB/s, "
           f"bf16 GEMM {head.get('gemm_TFLOPs', 0):.0f} TFLOP/s"
           + (f", e4m3 GEMM {head['fp8_TFLOPs']:.0f} TFLOP/s (the floor of fp8 rows)" if head.get("fp8_TFLOPs") else "")
           + ". Cells: median ms (fraction of the floor).",
           "",
           "| shape | M | " + " | ".join(backends) + f" | {subject} vs best peer |",
           "|---|---|" + "---|" * len(backends) + "---|"]
    ratios = []
    for shape, tokens in keys:
        row = [shape, str(tokens)]
        for b in backends:
            c = by.get((b, shape, tokens))
            if not c:
                row.append("")
            elif c.get("ms") is None:
                row.append("failed")
            else:
                row.append(f"{c['ms']:.4g} ({c.get('fraction_of_floor', 0):.2f})")
        peer, peer_ms = best_peer(by, backends, shape, tokens, subject)
        mine = by.get((subject, shape, tokens))
        if peer and mine and mine.get("ms"):
            r = peer_ms / mine["ms"]
            ratios.append(r)
            row.append(f"{r:.2f}x ({peer})")
        else:
            row.append("")
        out.append("| " + " | ".join(row) + " |")
    if ratios:
        geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        slower = sum(1 for r in ratios if r < 1.0)
        out += ["", f"{subject} against the best peer: geometric mean {geo:.2f}x over {len(ratios)} cells, "
                    f"slower on {slower}."]
    return "\n".join(out) + "\n"


def plot(head, cells, backends, png):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_floor: matplotlib is not installed; no picture", file=sys.stderr)
        return False
    shapes = list(OrderedDict.fromkeys(c["shape"] for c in cells))
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 4.5), squeeze=False, sharey=True)
    for ax, shape in zip(axes[0], shapes):
        for b in backends:
            pts = sorted((c["tokens"], c["fraction_of_floor"]) for c in cells
                         if c["backend"] == b and c["shape"] == shape and c.get("ms"))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=b,
                        linestyle="--" if is_peer(b) else "-")
        ax.set_xscale("log", base=2)
        ax.set_title(shape)
        ax.set_xlabel("tokens (M)")
        ax.grid(True, alpha=0.3)
        ax.set_ylim(0, 1.05)
    axes[0][0].set_ylabel("fraction of the floor")
    axes[0][-1].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"{head.get('gpu', '?')}, commit {head.get('commit', '?')}: floor = max(bytes / HBM read, "
                 f"flops / bf16 GEMM rate)", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results")
    ap.add_argument("--png", help="picture to write")
    ap.add_argument("--table", help="markdown table to write (else printed)")
    ap.add_argument("--backends", help="backends to show, in order (default: every backend but @baseline rows)")
    ap.add_argument("--subject", default="cuda_fused", help="the backend measured against the best peer")
    args = ap.parse_args()
    head, cells = load(args.results)
    if args.backends:
        backends = [b for b in args.backends.split(",") if b]
    else:
        backends = list(OrderedDict.fromkeys(c["backend"] for c in cells if "@" not in c["backend"]))
    text = table(head, cells, backends, args.subject)
    if args.table:
        with open(args.table, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    if args.png:
        plot(head, [c for c in cells if c["backend"] in backends], backends, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
