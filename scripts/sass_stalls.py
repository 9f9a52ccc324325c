#!/usr/bin/env python3
"""Summarizes a warp-stall sample table written by `device_run.sh --profile-source`
(logs/profile-*-sass.csv.gz: Nsight Compute's source page, one row per SASS instruction).

    scripts/sass_stalls.py logs/profile-Mixtral-8x7B-4096-sass.csv.gz [--top 25] [--blocks 0.3]

Prints the share of all samples per stall reason, then the instructions holding the most
samples, each with its index (the row), its execution count and its three main reasons.
A branch right after a SYNCS...TRYWAIT is a thread spinning on an mbarrier. With --blocks P,
first the runs of consecutive instructions that executed equally often (a loop body, a
straight stretch of code) holding at least P% of the samples: where a kernel's warps spend
their time (the consumers' K loop against the producer's, the epilogue), and, with the
execution count, how often each stretch ran.
"""
import argparse
import collections
import csv
import gzip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("table")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--blocks", type=float, metavar="P", help="runs of equally executed instructions with >= P%% of samples")
    args = ap.parse_args()
    opener = gzip.open if args.table.endswith(".gz") else open
    with opener(args.table, "rt") as f:
        rows = list(csv.reader(f))
    header = next(i for i, r in enumerate(rows) if "Address" in r and "Source" in r)
    names, data = rows[header], rows[header + 1:]
    col = {n: i for i, n in enumerate(names)}
    samples = "Warp Stall Sampling (All Samples)"
    reasons = [n for n in names if n.startswith("stall_") and "Not Issued" not in n]

    def count(row, name):
        v = row[col[name]] if name in col else ""
        return int(v.replace(",", "")) if v.strip() else 0

    total = sum(count(r, samples) for r in data) or 1
    by_reason = collections.Counter()
    for r in data:
        for n in reasons:
            by_reason[n] += count(r, n)
    print(f"{len(data)} instructions, {total} samples")
    print("  ".join(f"{n[6:]} {100 * v / total:.1f}%" for n, v in by_reason.most_common(10)))
    if args.blocks is not None:
        runs = []  # [first row, last row, executions, samples]
        for i, r in enumerate(data):
            ex = count(r, "Instructions Executed")
            if runs and runs[-1][2] == ex:
                runs[-1][1] = i
                runs[-1][3] += count(r, samples)
            else:
                runs.append([i, i, ex, count(r, samples)])
        for first, last, ex, n in runs:
            if 100 * n / total >= args.blocks:
                print(f"rows {first:5d}-{last:5d} ({last - first + 1:4d} instructions)  exec {ex:>10}  "
                      f"{100 * n / total:5.1f}%")
    top = sorted(range(len(data)), key=lambda i: -count(data[i], samples))[: args.top]
    for i in top:
        r = data[i]
        main_reasons = sorted(((count(r, n), n[6:]) for n in reasons), reverse=True)[:3]
        why = ", ".join(f"{n} {v}" for v, n in main_reasons if v)
        print(f"{i:6d} {100 * count(r, samples) / total:5.1f}%  exec {count(r, 'Instructions Executed'):>10}  "
              f"{r[col['Source']].strip()[:64]:64s}  {why}")


if __name__ == "__main__":
    main()
