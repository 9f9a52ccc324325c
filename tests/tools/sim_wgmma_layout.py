#!/usr/bin/env python3
"""Host model of the sm90_wgmma grouped GEMM's data movement, checked against numpy.

Simulates, byte for byte, what kernels/moerunner/kernels/sm90_kernel_grouped_gemm_wgmma.cuh
does with shared memory and registers, following the layouts the PTX ISA documents:

  * the producer's gathered A copies: 16-byte chunks, thread t copies chunk t % 8 of rows
    t / 8 + 16 i, stored at chunk (t % 8) ^ (row % 8) of a 128-byte row (zero fill past the
    tile's rows and past k);
  * the weights' TMA boxes: a [E * halves, n, k] tensor map, boxes of 128 rows x 64 elements,
    CU_TENSOR_MAP_SWIZZLE_128B (16-byte chunk index XOR row % 8 inside each 1024-byte block),
    zero fill outside the tensor;
  * the wgmma matrix descriptors (start address >> 4 in bits 0-13, leading byte offset in
    16-29, stride byte offset in 32-45, swizzle mode in 62-63) decoded and turned into element
    addresses as the K-major 128-byte-swizzle canonical layout defines them: row m at
    (m / 8) * SBO + (m % 8) * 128, element k at 2 k bytes, then address bits 4-6 XOR bits 7-9;
    K steps of 16 advance the start address by 32 bytes;
  * the m64nNk16 f32 accumulator fragment: register i of lane l in warp w holds row
    16 w + l / 4 + 8 ((i / 2) % 2), column 8 (i / 4) + 2 (l % 4) + i % 2;
  * the epilogues (gate_up pairs gate register 4j + 2h + q with up register 4(j + 16) + 2h + q;
    up_only and down store every column), with the row and column masks;
  * the persistent work loop over the device-built M-tile schedule and N tiles.

Each case builds a small MoE GEMM with partial M, N and K tiles and compares the simulated
output with a direct numpy computation. Exit status 0 when every case matches.
"""
import sys

try:
    import numpy as np
except ImportError:
    print("numpy is not installed: skipping the wgmma layout simulation")
    sys.exit(77)  # Meson: skipped

BM, BN, BK = 128, 256, 64
BOX_ROWS = 128
A_BYTES, B_BYTES = BM * BK * 2, BN * BK * 2
STAGE_BYTES = A_BYTES + B_BYTES
PRODUCER_THREADS = 128


def swizzle128(addr):
    """The 128-byte swizzle as a function of the byte address (1024-byte-aligned atoms)."""
    return addr ^ (((addr >> 7) & 7) << 4)


def encode_desc(smem_addr):
    """sw128_kmajor_desc of the kernel."""
    return ((smem_addr & 0x3FFFF) >> 4) | ((16 >> 4) << 16) | ((1024 >> 4) << 32) | (1 << 62)


def decode_desc(desc):
    start = (desc & 0x3FFF) << 4
    lbo = ((desc >> 16) & 0x3FFF) << 4
    sbo = ((desc >> 32) & 0x3FFF) << 4
    base_offset = (desc >> 49) & 7
    mode = (desc >> 62) & 3
    return start, lbo, sbo, base_offset, mode


def wgmma_read(smem, desc, rows):
    """The rows x 16 K-major operand one wgmma reads through a descriptor (16-bit elements)."""
    start, _lbo, sbo, base_offset, mode = decode_desc(desc)
    assert mode == 1, "the kernel uses the 128-byte swizzle"
    assert base_offset == 0, "tiles start on 1024-byte boundaries"
    m = np.arange(rows)[:, None]
    k = np.arange(16)[None, :]
    # K 16 elements = 32 bytes always stay inside one 128-byte row: the leading byte offset is unused.
    logical = start + (m // 8) * sbo + (m % 8) * 128 + k * 2
    phys = swizzle128(logical)
    assert np.all(phys % 2 == 0)
    return smem[phys // 2]


def tile_schedule(offsets, block_m):
    """moe_tile_schedule_kernel: (expert, row_begin, row_end) per M tile, empty experts skipped."""
    tiles = []
    for e in range(len(offsets) - 1):
        for b in range(offsets[e], offsets[e + 1], block_m):
            tiles.append((e, b, min(b + block_m, offsets[e + 1])))
    return tiles


def silu(g):
    return g / (1.0 + np.exp(-g))


def simulate(kind, x, row_to_slot, top_k, w, n, k, offsets, input_weights, grid):
    """The kernel's output c [R, n] (f32, before the bf16 rounding of the store), or NaN where unwritten."""
    halves = 2 if kind == "gate_up" else 1
    out_cols = BN // halves
    rows_total = offsets[-1]
    c = np.full((rows_total, n), np.nan, dtype=np.float32)
    tiles = tile_schedule(offsets, BM)
    n_tiles = (n + out_cols - 1) // out_cols
    k_tiles = (k + BK - 1) // BK
    # The [E * halves, n, k] view of the weights that the tensor map describes.
    w3 = w.reshape(-1, n, k)
    stages = 4
    ring = np.zeros(stages * STAGE_BYTES // 2, dtype=np.float32)  # element-addressed smem
    for cta in range(grid):
        it = 0
        for work in range(cta, len(tiles) * n_tiles, grid):
            m_tile, n_tile = divmod(work, n_tiles)
            n0 = n_tile * out_cols
            expert, row_begin, row_end = tiles[m_tile]
            rows = row_end - row_begin
            acc = np.zeros((2, 4, 32, 128), dtype=np.float32)  # [group][warp][lane][register]
            d_acc = np.zeros((2, 64, 256), dtype=np.float32)   # each warpgroup's D = A B^T
            for kt in range(k_tiles):
                stage = it % stages
                sa = stage * STAGE_BYTES
                sb = sa + A_BYTES
                ring[sa // 2:(sa + STAGE_BYTES) // 2] = np.float32(12345.0)  # stale data must be overwritten
                # Producer: gathered A rows by cp.async into the swizzled layout.
                for tid in range(PRODUCER_THREADS):
                    ld_row, ld_chunk = divmod(tid, 8)
                    st_chunk = ld_chunk ^ (ld_row & 7)
                    kcol = kt * BK + ld_chunk * 8
                    for i in range(BM // 16):
                        r = ld_row + 16 * i
                        if r >= rows:
                            src = None
                        elif kind == "down":
                            src = row_begin + r
                        else:
                            src = row_to_slot[row_begin + r] // top_k
                        dst = (sa + r * 128 + st_chunk * 16) // 2
                        ok = kcol < k and src is not None
                        ring[dst:dst + 8] = x[src, kcol:kcol + 8] if ok else 0.0
                # Producer thread 0: two TMA boxes, 128 rows x 64 elements, swizzled, zero filled.
                for j in range(2):
                    row0 = n0 if halves == 2 else n0 + j * BOX_ROWS
                    z = 2 * expert + j if halves == 2 else expert
                    box = np.zeros((BOX_ROWS, BK), dtype=np.float32)
                    rr = min(BOX_ROWS, max(0, n - row0))
                    kk_ = min(BK, k - kt * BK)
                    box[:rr, :kk_] = w3[z, row0:row0 + rr, kt * BK:kt * BK + kk_]
                    base = sb + j * BOX_ROWS * BK * 2
                    i = np.arange(BOX_ROWS)[:, None]
                    e = np.arange(BK)[None, :]
                    phys = swizzle128(base + i * 128 + e * 2)
                    ring[phys // 2] = box
                # Consumers: four m64n256k16 per K tile from the descriptors.
                for group in range(2):
                    if not 64 * group < rows:
                        continue
                    da = encode_desc(sa + group * 64 * 128)
                    db = encode_desc(sb)
                    d = d_acc[group]
                    for kk in range(BK // 16):
                        step = (kk * 32) >> 4
                        assert ((da & 0x3FFF) + step) < (1 << 14) and ((db & 0x3FFF) + step) < (1 << 14)
                        a = wgmma_read(ring, da + step, 64)
                        b = wgmma_read(ring, db + step, 256)
                        d += a.astype(np.float64).dot(b.astype(np.float64).T).astype(np.float32)
                it += 1
            # The D tile of each warpgroup as the accumulator fragments of its 4 warps x 32 lanes.
            warp = np.arange(4)[:, None, None]
            lane = np.arange(32)[None, :, None]
            reg = np.arange(128)[None, None, :]
            frag_row = 16 * warp + lane // 4 + 8 * ((reg // 2) % 2)
            frag_col = 8 * (reg // 4) + 2 * (lane % 4) + reg % 2
            for group in range(2):
                acc[group] = d_acc[group][frag_row, frag_col]
            # Epilogue from the registers, with the kernel's index arithmetic.
            for group in range(2):
                if not 64 * group < rows:
                    continue
                for warp in range(4):
                    for lane in range(32):
                        col0 = n0 + 2 * (lane % 4)
                        for h in range(2):
                            r = 64 * group + 16 * warp + lane // 4 + 8 * h
                            if r >= rows:
                                continue
                            row = row_begin + r
                            blocks = 32 if kind != "gate_up" else 16
                            scale = 1.0
                            if kind != "down" and input_weights is not None:
                                scale = input_weights[row_to_slot[row]]
                            for jb in range(blocks):
                                col = col0 + 8 * jb
                                if col >= n:
                                    continue
                                for q in range(2):
                                    g = acc[group, warp, lane, 4 * jb + 2 * h + q]
                                    if kind == "gate_up":
                                        u = acc[group, warp, lane, 4 * (jb + 16) + 2 * h + q]
                                        v = silu(g * scale) * (u * scale)
                                    elif kind == "up_only":
                                        v = silu(g * scale)
                                    else:
                                        v = g
                                    assert np.isnan(c[row, col + q]), "an output element written twice"
                                    c[row, col + q] = v
    return c


def reference(kind, x, row_to_slot, top_k, w, n, k, offsets, input_weights):
    rows_total = offsets[-1]
    out = np.zeros((rows_total, n), dtype=np.float64)
    for e in range(len(offsets) - 1):
        for row in range(offsets[e], offsets[e + 1]):
            a = x[row] if kind == "down" else x[row_to_slot[row] // top_k]
            a = a.astype(np.float64)
            s = input_weights[row_to_slot[row]] if kind != "down" and input_weights is not None else 1.0
            if kind == "gate_up":
                g = w[e, :n].astype(np.float64) @ a * s
                u = w[e, n:].astype(np.float64) @ a * s
                out[row] = silu(g) * u
            elif kind == "up_only":
                out[row] = silu(w[e].astype(np.float64) @ a * s)
            else:
                out[row] = w[e].astype(np.float64) @ a
    return out


def routed_problem(rng, kind, tokens, num_experts, top_k, n, k, weights_on_input, one_expert):
    """Random routing sorted by expert (row_to_slot, offsets), x (GEMM2: the act rows), weights
    [E, halves * n, k] and the router weights where applied on the input."""
    slots = tokens * top_k
    ids = rng.integers(0, num_experts, size=slots)
    if one_expert:
        ids[:] = num_experts // 2
    row_to_slot = np.argsort(ids, kind="stable").astype(np.int64)
    counts = np.bincount(ids, minlength=num_experts)
    offsets = np.concatenate([[0], np.cumsum(counts)]).tolist()
    halves = 2 if kind == "gate_up" else 1
    # Values exactly representable in bf16 so that float32 sums match the float64 reference closely.
    x_rows = slots if kind == "down" else tokens
    x = (rng.integers(-8, 9, size=(x_rows, k)) / 8.0).astype(np.float32)
    w = (rng.integers(-8, 9, size=(num_experts, halves * n, k)) / 64.0).astype(np.float32)
    input_weights = rng.random(slots).astype(np.float32) if weights_on_input else None
    return x, row_to_slot, offsets, w, input_weights


def run_case(rng, kind, tokens, num_experts, top_k, n, k, grid, weights_on_input=False, one_expert=False):
    x, row_to_slot, offsets, w, input_weights = routed_problem(rng, kind, tokens, num_experts, top_k, n, k,
                                                               weights_on_input, one_expert)
    got = simulate(kind, x, row_to_slot, top_k, w, n, k, offsets, input_weights, grid)
    want = reference(kind, x, row_to_slot, top_k, w, n, k, offsets, input_weights)
    unwritten = int(np.isnan(got).sum())
    err = float(np.max(np.abs(got - want) / (1.0 + np.abs(want)))) if unwritten == 0 else float("inf")
    ok = unwritten == 0 and err < 1e-5
    print(f"{'ok ' if ok else 'BAD'} {kind:8s} tokens={tokens} E={num_experts} k={top_k} n={n} K={k} grid={grid}"
          f"{' weights_on_input' if weights_on_input else ''}{' one_expert' if one_expert else ''}: "
          f"unwritten={unwritten} max_err={err:.2e}")
    return ok


def main():
    rng = np.random.default_rng(int(sys.argv[1]) if len(sys.argv) > 1 else 20240611)
    # A descriptor round trip on every field the kernel sets.
    start, lbo, sbo, base, mode = decode_desc(encode_desc(0x1f400))
    assert (start, lbo, sbo, base, mode) == (0x1f400, 16, 1024, 0, 1)
    cases = [
        # kind, tokens, E, top_k, n, K, grid: partial M tiles, K tails (K % 64 = 8), partial N tiles
        ("gate_up", 70, 3, 2, 72, 200, 2),
        ("gate_up", 150, 2, 1, 136, 72, 3, True),   # two N tiles, the second of 8 columns
        ("up_only", 40, 3, 2, 264, 136, 2),         # two N tiles of 256, the second of 8 columns
        ("down", 90, 3, 2, 200, 72, 1),             # one CTA walks every work item: the ring wraps
        ("down", 130, 1, 1, 8, 8, 2, False, True),  # one expert, two M tiles, K = 8, n = 8
        ("gate_up", 5, 4, 2, 24, 64, 4),            # tiles of 1-4 rows: consumer warpgroup 1 idle
    ]
    ok = True
    for case in cases:
        kind, tokens, e, top_k, n, k, grid = case[:7]
        rest = case[7:]
        ok &= run_case(rng, kind, tokens, e, top_k, n, k, grid, *rest)
    print("all cases match" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
