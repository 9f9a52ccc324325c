#!/usr/bin/env python3
"""L2 hit rate of a persistent grouped GEMM's weight and activation tiles, by simulation.

Replays the fp8 wgmma GEMM's work order (decode_work_item: bands of M tiles walking the N
tiles) on `--ctas` persistent CTAs, each item one K loop of 128-wide K tiles, through an LRU
cache of `--l2-mb` megabytes, and prints the share of bytes that hit. Items take 1 + N(0, sigma)
item durations; CTAs take them in fixed turns or handed out (whichever CTA is free next), as
schedule_drift.item_times models them. A coarse model: one cache entry per tile and K tile (the
weight tile's 256 rows, the A tile's 64 or 128 rows, 128 bytes of K each), no sectors, no set
associativity, no L2 partitions.

  bench/l2_reuse_model.py --experts 256 --topk 8 --tokens 16384 --n 4096 --k 7168   # DeepSeek-V3 GEMM1
  bench/l2_reuse_model.py --experts 8 --topk 2 --tokens 4096 --n 28672 --k 4096     # Mixtral-8x7B GEMM1
"""
import argparse
import random
from collections import OrderedDict

from schedule_drift import item_times


def tiles_of(experts, topk, tokens, block_m, rnd):
    counts = [0] * experts
    for _ in range(tokens):
        for e in rnd.sample(range(experts), topk):
            counts[e] += 1
    tiles = []
    for e, c in enumerate(counts):
        tiles += [e] * ((c + block_m - 1) // block_m)
    return tiles


def decode(w, tile_count, n_tiles, band):
    per_band = band * n_tiles
    first = (w // per_band) * band
    within = w % per_band
    width = min(band, tile_count - first)
    return first + within % width, within // width  # m tile, n tile


def simulate(order, tiles, n_tiles, k_tiles, ctas, band, sigma, l2_bytes, b_bytes, a_bytes, seed):
    work = len(tiles) * n_tiles
    events = []
    for w, (t, d) in enumerate(item_times(order, ctas, work, sigma, random.Random(seed))):
        m, n = decode(w, len(tiles), n_tiles, band)
        for kt in range(k_tiles):
            events.append((t + d * (kt + 0.5) / k_tiles, m, n, kt))
    events.sort()
    cache, size = OrderedDict(), 0
    hit = {"B": 0, "A": 0}
    total = {"B": 0, "A": 0}

    def touch(key, nbytes, kind):
        nonlocal size
        total[kind] += nbytes
        if key in cache:
            cache.move_to_end(key)
            hit[kind] += nbytes
            return
        cache[key] = nbytes
        size += nbytes
        while size > l2_bytes:
            _, b = cache.popitem(last=False)
            size -= b

    for _, m, n, kt in events:
        touch(("B", tiles[m], n, kt), b_bytes, "B")
        touch(("A", m, kt), a_bytes, "A")
    return hit, total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, required=True)
    ap.add_argument("--topk", type=int, required=True)
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--n", type=int, required=True, help="weight rows of the GEMM (GEMM1: 2 I)")
    ap.add_argument("--k", type=int, required=True)
    ap.add_argument("--block-m", type=int, default=64)
    ap.add_argument("--block-n", type=int, default=256, help="weight rows per item")
    ap.add_argument("--ctas", type=int, default=132)
    ap.add_argument("--band", type=int, default=8)
    ap.add_argument("--l2-mb", type=float, default=50.0)
    ap.add_argument("--sigma", type=float, nargs="+", default=[0.0, 0.02, 0.05])
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    rnd = random.Random(a.seed)
    tiles = tiles_of(a.experts, a.topk, a.tokens, a.block_m, rnd)
    n_tiles = (a.n + a.block_n - 1) // a.block_n
    k_tiles = a.k // 128
    print(f"{len(tiles)} M tiles x {n_tiles} N tiles = {len(tiles) * n_tiles} items on {a.ctas} CTAs, "
          f"{k_tiles} K tiles each, L2 {a.l2_mb:g} MB")
    print(f"{'sigma':>6} {'order':>10} {'weight hits':>12} {'A hits':>8} {'all':>6}")
    for sigma in a.sigma:
        for order in ("fixed", "handed out"):
            hit, total = simulate(order, tiles, n_tiles, k_tiles, a.ctas, a.band, sigma, a.l2_mb * 1e6,
                                  a.block_n * 128, a.block_m * 128, a.seed)
            all_hit = (hit["A"] + hit["B"]) / (total["A"] + total["B"])
            print(f"{sigma:>6.2f} {order:>10} {hit['B'] / total['B']:>12.2f} {hit['A'] / total['A']:>8.2f} {all_hit:>6.2f}")


if __name__ == "__main__":
    main()
