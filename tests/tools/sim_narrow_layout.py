#!/usr/bin/env python3
"""Host model of the narrow decode tiles' data movement on 16-bit operands, checked against numpy.

Simulates what kernels/moerunner/kernels/sm90_kernel_grouped_gemm_wgmma_narrow.cuh does with
shared memory and registers when Fp8 is false, with the layouts sim_wgmma_layout.py models (its
swizzle, descriptors and operand reads are reused):

  * four 64-row weight boxes per stage by TMA from the 4D map (coordinates {k, col, half, e}, or
    {k, half, col, e} for interleaved gate/up rows), zero filled past n and k: for gate_up box b
    holds half b % 2 of act columns n0 + 64 (b / 2), otherwise rows n0 + 64 b;
  * the producer warp's token rows: copy c = lane + 32 i is row c / 8, 16-byte chunk c % 8 at
    chunk (c % 8) ^ (row % 8), zeros past the tile's rows and past k;
  * swap-AB: consumer warpgroup g reads boxes 2g and 2g + 1 as A (64 weight rows) and the N token
    rows as B through the descriptors, four m64nNk16 per box per stage, accumulating over K;
  * the accumulator fragment: register 4j + 2h + q of lane l in warp w holds weight row
    16 w + l / 4 + 8 h and token 8 j + 2 (l % 4) + q;
  * stage_values' f32 staging columns (gated: gate at 64 g + row, up at 128 + 64 g + row;
    otherwise 128 g + 64 b + row), then store_act16's 8-column pieces (router weight, activation)
    and store_rows' 8 columns a lane, GEMM2's bias by its first K range, K splits summed;
  * the persistent work loop over (M tile, N tile, K split) items.

Each case builds a small MoE GEMM with partial tiles of tokens, weight rows and K and compares the
simulated output with a direct numpy computation. Exit status 0 when every case matches.
"""
import os
import sys

try:
    import numpy as np
except ImportError:
    print("numpy is not installed: skipping the narrow-tile layout simulation")
    sys.exit(77)  # Meson: skipped

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sim_wgmma_layout import (encode_desc, routed_problem, silu, swizzle128, tile_schedule,  # noqa: E402
                              wgmma_read)

WEIGHT_ROWS, BOX_ROWS, ROW_BYTES, BK = 256, 64, 128, 64
W_BYTES = WEIGHT_ROWS * ROW_BYTES
X_OFFSET = W_BYTES


def stage_bytes(n_tok):
    return (X_OFFSET + n_tok * ROW_BYTES + 1023) // 1024 * 1024


def box_origin(kind, b, n0):
    if kind == "gate_up":
        return n0 + BOX_ROWS * (b // 2), b % 2
    return n0 + BOX_ROWS * b, 0


def weight_row(kind, interleaved, n, half, col):
    """b_row: the expert's B row holding output column col (gate_up: of half `half`)."""
    if kind == "gate_up":
        return 2 * col + half if interleaved else half * n + col
    return col


def split_range(k_tiles, split, splits):
    return k_tiles * split // splits, k_tiles * (split + 1) // splits


def simulate(kind, x, row_to_slot, top_k, w, n, k, offsets, input_weights, grid, n_tok, interleaved=False,
             k_splits=1, bias=None):
    """The kernel's output [R, n] in f32 (act for GEMM1, GEMM2's rows), NaN where unwritten."""
    halves = 2 if kind == "gate_up" else 1
    out_cols = WEIGHT_ROWS // halves
    rows_total = offsets[-1]
    c = np.full((rows_total, n), np.nan, dtype=np.float32)
    tiles = tile_schedule(offsets, n_tok)
    n_tiles = (n + out_cols - 1) // out_cols
    k_tiles = (k + BK - 1) // BK
    stages = 5
    sbytes = stage_bytes(n_tok)
    ring = np.zeros(stages * sbytes // 2, dtype=np.float32)  # element-addressed shared memory
    work = len(tiles) * n_tiles * k_splits
    for cta in range(grid):
        it = 0
        for wi in range(cta, work, grid):
            # decode_work_item with one raster band: K split fastest, then N tiles, then M tiles.
            split = wi % k_splits
            n_tile = (wi // k_splits) % n_tiles
            m_tile = wi // (k_splits * n_tiles)
            n0 = n_tile * out_cols
            expert, row_begin, row_end = tiles[m_tile]
            rows = row_end - row_begin
            d_acc = np.zeros((2, 2, 64, n_tok), dtype=np.float32)  # [group][box][weight row][token]
            kt0, kt1 = split_range(k_tiles, split, k_splits)
            for kt in range(kt0, kt1):
                sa = (it % stages) * sbytes
                ring[sa // 2:(sa + sbytes) // 2] = np.float32(12345.0)  # stale data must be overwritten
                # Lane 0: four TMA boxes of 64 rows x 64 elements, swizzled, zero filled.
                for b in range(4):
                    col, half = box_origin(kind, b, n0)
                    box = np.zeros((BOX_ROWS, BK), dtype=np.float32)
                    kk_ = min(BK, k - kt * BK)
                    for i in range(BOX_ROWS):
                        if col + i < n:
                            r = weight_row(kind, interleaved, n, half, col + i)
                            box[i, :kk_] = w[expert, r, kt * BK:kt * BK + kk_]
                    base = sa + b * BOX_ROWS * ROW_BYTES
                    i = np.arange(BOX_ROWS)[:, None]
                    e = np.arange(BK)[None, :]
                    ring[swizzle128(base + i * 128 + e * 2) // 2] = box
                # Every lane: the token rows' 16-byte chunks.
                for lane in range(32):
                    for i in range(n_tok * ROW_BYTES // 16 // 32):
                        cc = lane + 32 * i
                        r, chunk = divmod(cc, 8)
                        if r >= rows:
                            src = None
                        elif kind == "down":
                            src = row_begin + r
                        else:
                            src = row_to_slot[row_begin + r] // top_k
                        kcol = kt * BK + chunk * 8
                        ok = src is not None and kcol < k
                        dst = (sa + X_OFFSET + r * ROW_BYTES + (chunk ^ (r & 7)) * 16) // 2
                        ring[dst:dst + 8] = x[src, kcol:kcol + 8] if ok else 0.0
                # Consumers: boxes 2g, 2g + 1 as A, the token rows as B.
                for group in range(2):
                    w_desc = encode_desc(sa + 2 * group * BOX_ROWS * ROW_BYTES)
                    x_desc = encode_desc(sa + X_OFFSET)
                    for b in range(2):
                        for kk in range(4):
                            step = (kk * 32) >> 4
                            a = wgmma_read(ring, w_desc + b * ((BOX_ROWS * ROW_BYTES) >> 4) + step, 64)
                            bt = wgmma_read(ring, x_desc + step, n_tok)
                            d_acc[group, b] += a.astype(np.float64).dot(bt.astype(np.float64).T).astype(np.float32)
                it += 1
            # The fragments, then stage_values' staging rows [token][column].
            staging = np.full((n_tok, WEIGHT_ROWS), np.nan, dtype=np.float32)
            for group in range(2):
                for warp in range(4):
                    for lane in range(32):
                        for b in range(2):
                            for reg in range(n_tok // 2):
                                j, h, q = reg // 4, (reg // 2) % 2, reg % 2
                                wr = 16 * warp + lane // 4 + 8 * h
                                tok = 8 * j + 2 * (lane % 4) + q
                                v = d_acc[group, b, wr, tok]
                                col = 128 * b + 64 * group + wr if halves == 2 else 128 * group + 64 * b + wr
                                staging[tok, col] = v
            if kind == "down":
                # store_rows: warp cw takes tokens cw, cw + 8, ..; lane l columns n0 + 8 l.
                for cw in range(8):
                    for lane in range(32):
                        col = n0 + 8 * lane
                        if col >= n:
                            continue
                        for t in range(cw, rows, 8):
                            v = staging[t, 8 * lane:8 * lane + 8].astype(np.float32)
                            if bias is not None and split == 0:
                                v = v + bias[expert, col:col + 8]
                            row = row_begin + t
                            dst = c[row, col:col + 8]
                            if k_splits == 1:
                                assert np.all(np.isnan(dst)), "an output element written twice"
                                c[row, col:col + 8] = v
                            else:  # the parts meet in the output's reductions
                                c[row, col:col + 8] = np.where(np.isnan(dst), 0.0, dst) + v
            else:
                # store_act16: thread u takes 8-column pieces u, u + 256, ..
                pieces = out_cols // 8
                for u in range(rows * pieces):
                    t, cpos = divmod(u, pieces)
                    cpos *= 8
                    col = n0 + cpos
                    if col >= n:
                        continue
                    row = row_begin + t
                    scale = input_weights[row_to_slot[row]] if input_weights is not None else 1.0
                    g = staging[t, cpos:cpos + 8] * scale
                    if kind == "gate_up":
                        v = silu(g) * (staging[t, 128 + cpos:128 + cpos + 8] * scale)
                    else:
                        v = silu(g)
                    assert np.all(np.isnan(c[row, col:col + 8])), "an output element written twice"
                    c[row, col:col + 8] = v
    return c


def reference(kind, x, row_to_slot, top_k, w, n, offsets, input_weights, interleaved, bias):
    rows_total = offsets[-1]
    out = np.zeros((rows_total, n), dtype=np.float64)
    for e in range(len(offsets) - 1):
        we = w[e].astype(np.float64)
        if kind == "gate_up" and interleaved:
            gate, up = we[0::2], we[1::2]
        elif kind == "gate_up":
            gate, up = we[:n], we[n:]
        for row in range(offsets[e], offsets[e + 1]):
            a = (x[row] if kind == "down" else x[row_to_slot[row] // top_k]).astype(np.float64)
            s = input_weights[row_to_slot[row]] if kind != "down" and input_weights is not None else 1.0
            if kind == "gate_up":
                out[row] = silu(gate @ a * s) * (up @ a * s)
            elif kind == "up_only":
                out[row] = silu(we @ a * s)
            else:
                out[row] = we @ a + (bias[e] if bias is not None else 0.0)
    return out


def run_case(rng, kind, tokens, num_experts, top_k, n, k, grid, n_tok, interleaved=False, k_splits=1,
             with_bias=False, weights_on_input=False, one_expert=False):
    x, row_to_slot, offsets, w, input_weights = routed_problem(rng, kind, tokens, num_experts, top_k, n, k,
                                                               weights_on_input, one_expert)
    bias = (rng.integers(-8, 9, size=(num_experts, n)) / 16.0).astype(np.float32) if with_bias else None
    got = simulate(kind, x, row_to_slot, top_k, w, n, k, offsets, input_weights, grid, n_tok, interleaved,
                   k_splits, bias)
    want = reference(kind, x, row_to_slot, top_k, w, n, offsets, input_weights, interleaved, bias)
    unwritten = int(np.isnan(got).sum())
    err = float(np.max(np.abs(got - want) / (1.0 + np.abs(want)))) if unwritten == 0 else float("inf")
    ok = unwritten == 0 and err < 1e-5
    flags = "".join(f" {f}" for f, on in (("interleaved", interleaved), ("bias", with_bias),
                                          ("weights_on_input", weights_on_input), ("one_expert", one_expert)) if on)
    print(f"{'ok ' if ok else 'BAD'} {kind:8s} tokens={tokens} E={num_experts} k={top_k} n={n} K={k} grid={grid} "
          f"N={n_tok} splits={k_splits}{flags}: unwritten={unwritten} max_err={err:.2e}")
    return ok


def main():
    rng = np.random.default_rng(int(sys.argv[1]) if len(sys.argv) > 1 else 20261208)
    cases = [
        # kind, tokens, E, top_k, n, K, grid, N, [interleaved, k_splits, bias, weights_on_input, one_expert]
        ("gate_up", 6, 3, 2, 200, 136, 2, 8),               # partial act tile (n % 64 = 8), K tail of 8
        ("gate_up", 9, 2, 2, 136, 72, 3, 8, True),          # interleaved gate/up rows, two N tiles
        ("gate_up", 20, 2, 1, 72, 64, 2, 16, False, 1, False, True),  # router weight on the input
        ("up_only", 7, 3, 2, 264, 72, 2, 8),                # two N tiles of 256, the second of 8 columns
        ("down", 10, 3, 2, 200, 200, 1, 8),                 # one CTA walks every item: the ring wraps
        ("down", 12, 2, 2, 264, 520, 3, 16, False, 3, True),  # K split three ways, bias on the first
        ("down", 40, 1, 1, 8, 8, 2, 32, False, 1, False, False, True),  # one expert, two tiles of 32
    ]
    ok = True
    for case in cases:
        ok &= run_case(rng, *case)
    print("all cases match" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
