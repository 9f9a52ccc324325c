#!/usr/bin/env python3
"""How far apart the CTAs that share a weight tile start it, under two work orders.

A persistent grouped GEMM's CTAs take work items in order w = 0, 1, 2, ...; consecutive items of
a raster band (`--group` of them) read the same weight tile, which L2 keeps only for a fraction
of an item's duration while every CTA streams its own tiles. This models each item's duration
as 1 + N(0, sigma) (in item durations T) and prints the spread of the group's start times:

  fixed       CTA c takes items c, c + ctas, c + 2 ctas, ... (each CTA's phase drifts as a random
              walk over its items)
  handed out  each item goes to whichever CTA finishes its previous one first (a counter)

Example (DeepSeek-V3 16384 tokens' fp8 GEMM1: 4096 M tiles x 16 N tiles on 132 CTAs, bands of 8):
  bench/schedule_drift.py --ctas 132 --items 32768 --group 8 --sigma 0.02 0.05 0.1
"""
import argparse
import heapq
import random
import statistics


def item_times(order, ctas, items, sigma, rnd):
    """(start, duration) of each item under `order` ("fixed" or "handed out"), in item durations."""
    times = [None] * items
    if order == "fixed":
        for c in range(ctas):
            t = 0.0
            for w in range(c, items, ctas):
                d = max(0.05, 1.0 + rnd.gauss(0.0, sigma))
                times[w] = (t, d)
                t += d
    else:
        free = [(0.0, c) for c in range(ctas)]
        heapq.heapify(free)
        for w in range(items):
            t, c = heapq.heappop(free)
            d = max(0.05, 1.0 + rnd.gauss(0.0, sigma))
            times[w] = (t, d)
            heapq.heappush(free, (t + d, c))
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctas", type=int, default=132)
    ap.add_argument("--items", type=int, default=32768)
    ap.add_argument("--group", type=int, default=8, help="consecutive items that share a weight tile")
    ap.add_argument("--sigma", type=float, nargs="+", default=[0.02, 0.05, 0.1],
                    help="relative spread of one item's duration")
    ap.add_argument("--window", type=float, default=1 / 6,
                    help="how long L2 keeps a tile, in item durations (for the share of groups beyond it)")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    print(f"{a.ctas} CTAs, {a.items} items, groups of {a.group}; spread of a group's start times, in item durations")
    print(f"{'sigma':>6} {'order':>10} {'mean':>7} {'median':>7} {'p90':>7} {'> window':>9}")
    for sigma in a.sigma:
        for order in ("fixed", "handed out"):
            s = [t for t, _ in item_times(order, a.ctas, a.items, sigma, random.Random(a.seed))]
            spread = sorted(max(s[g:g + a.group]) - min(s[g:g + a.group]) for g in range(0, a.items, a.group))
            n = len(spread)
            beyond = sum(1 for x in spread if x > a.window) / n
            print(f"{sigma:>6.2f} {order:>10} {statistics.mean(spread):>7.3f} {spread[n // 2]:>7.3f} "
                  f"{spread[int(0.9 * n)]:>7.3f} {beyond:>9.2f}")


if __name__ == "__main__":
    main()
