#!/usr/bin/env python3
"""Host model of one stage of the stream GEMMs (kernel_stream_gemm.cuh), 16-bit and e4m3.

Simulates, byte for byte, what a warp does with one K tile of its ring, following the layouts
the PTX ISA documents, and checks the products against numpy:

  * the cp.async copies: lane l copies 16-byte piece l % 8 of stage rows 4 i + l / 8 (32 weight
    rows, then the tokens), stored at chunk (l % 8) ^ (row % 8) of a 128-byte row;
  * ldmatrix (.x4 and .x2, not transposed): lanes 8 j .. 8 j + 7 name the rows of matrix j, and
    thread t receives, per matrix, the 32-bit word 4 (t % 4) of row t / 4;
  * the addresses compute_stage gives: weights (A) rows m * 16 + l % 16 at chunk
    2 kk + l / 16; tokens (B) rows j * 8 + l % 8 (+ 8 for lanes 16-31 of .x4) at chunk
    2 kk + (l / 8) % 2;
  * mma.sync m16n8k16 (bf16) and m16n8k32 (e4m3) fragments: A register r of thread t holds
    row t / 4 (+ 8 for r odd) and K elements (t % 4) * e .. + e - 1 (+ 16 bytes for r >= 2), where
    e is 2 (16-bit) or 4 (8-bit) values per register; B register r holds K elements
    (t % 4) * e .. of column t / 4 (+ 16 bytes for r = 1); D holds row t / 4 (+ 8 for d2, d3),
    column 2 (t % 4) + (0, 1);
  * the epilogue's reading of the accumulators: acc[m][b][q] is weight row m * 16 + l / 4
    (+ 8 for q >= 2) and token b * 8 + 2 (l % 4) + q % 2, the token whose scale promotes it.

So the claim the fp8 path rests on (the 16-bit kernel's copies and ldmatrix calls give the e4m3
mma its fragments unchanged) is checked here, without a GPU. Values are small integers, so every
sum is exact in float64 whatever the order.
"""
import sys

try:
    import numpy as np
except ImportError:
    print("numpy is not installed: skipping the stream GEMM layout simulation")
    sys.exit(77)

BN, ROW_BYTES = 32, 128


def swizzled_chunk(row, chunk):
    return chunk ^ (row % 8)


def write_stage(rows_bytes):
    """The stage as the warp's cp.async copies leave it: rows_bytes [R, 128] uint8."""
    r_count = rows_bytes.shape[0]
    smem = np.zeros(r_count * ROW_BYTES, np.uint8)
    for i in range(r_count // 4):
        for lane in range(32):
            r, piece = i * 4 + lane // 8, lane % 8
            dst = r * ROW_BYTES + swizzled_chunk(r, piece) * 16
            smem[dst:dst + 16] = rows_bytes[r, piece * 16:piece * 16 + 16]
    return smem


def ldmatrix(smem, addrs, count):
    """ldmatrix .x{count}: addrs[lane] is the row address lane gives; returns [32][count] words
    as 4-byte arrays."""
    out = [[None] * count for _ in range(32)]
    for j in range(count):
        rows = [addrs[8 * j + i] for i in range(8)]
        for t in range(32):
            a = rows[t // 4] + 4 * (t % 4)
            out[t][j] = smem[a:a + 4]
    return out


# The e4m3 values the fp8 check uses, small powers of two and their negatives, by code:
# 0x38 + 8 e is 2^e (exponent bias 7, no mantissa bits), 0x80 the sign.
E4M3 = {0x00: 0.0, 0x38: 1.0, 0x40: 2.0, 0x48: 4.0, 0x50: 8.0, 0xB8: -1.0, 0xC0: -2.0, 0xC8: -4.0}


def decode_f16(word):
    """The two 16-bit values of a register, lowest address first."""
    return np.frombuffer(word.tobytes(), dtype="<f2").astype(np.float64)


def decode_e4m3(word):
    """The four e4m3 values of a register, lowest address first."""
    return np.array([E4M3[b] for b in word.tobytes()], np.float64)


def mma(a_regs, b_regs, per_word, decode):
    """D [16, 8] (float64) of one mma.sync from the threads' A [4] and B [2] registers."""
    k = 4 * per_word * 2  # 16 (16-bit) or 32 (8-bit) values
    a = np.zeros((16, k))
    b = np.zeros((k, 8))
    for t in range(32):
        g, tig = t // 4, t % 4
        for r in range(4):
            row = g + 8 * (r % 2)
            col = tig * per_word + (r // 2) * (k // 2)
            a[row, col:col + per_word] = decode(a_regs[t][r])
        for r in range(2):
            col = tig * per_word + r * (k // 2)
            b[col:col + per_word, g] = decode(b_regs[t][r])
    return a @ b


def d_fragment(d, t):
    """The four D registers of thread t."""
    g, tig = t // 4, t % 4
    return [d[g, 2 * tig], d[g, 2 * tig + 1], d[g + 8, 2 * tig], d[g + 8, 2 * tig + 1]]


def compute_stage(smem, bm, per_word, decode):
    """acc[t][m][b][q] as compute_stage leaves it after one stage."""
    token_blocks = bm // 8
    acc = np.zeros((32, 2, token_blocks, 4))
    sx = BN * ROW_BYTES
    for kk in range(4):
        a_words = []
        for m in range(2):
            addrs = [(m * 16 + (l % 16)) * ROW_BYTES + swizzled_chunk(m * 16 + (l % 16), kk * 2 + l // 16) * 16
                     for l in range(32)]
            a_words.append(ldmatrix(smem, addrs, 4))
        for j in range(0, token_blocks, 2):
            c = [kk * 2 + (l // 8) % 2 for l in range(32)]
            if token_blocks % 2 == 0:
                rows = [j * 8 + (l % 8) + ((l // 16) << 3) for l in range(32)]
                x = ldmatrix(smem, [sx + rows[l] * ROW_BYTES + swizzled_chunk(rows[l], c[l]) * 16
                                    for l in range(32)], 4)
                b0 = [[x[t][0], x[t][1]] for t in range(32)]
                b1 = [[x[t][2], x[t][3]] for t in range(32)]
            else:
                rows = [j * 8 + (l % 8) for l in range(32)]
                b0 = ldmatrix(smem, [sx + rows[l] * ROW_BYTES + swizzled_chunk(rows[l], c[l]) * 16
                                     for l in range(32)], 2)
                b1 = None
            for m in range(2):
                d = mma(a_words[m], b0, per_word, decode)
                for t in range(32):
                    acc[t, m, j] += d_fragment(d, t)
                if b1 is not None and j + 1 < token_blocks:
                    d = mma(a_words[m], b1, per_word, decode)
                    for t in range(32):
                        acc[t, m, j + 1] += d_fragment(d, t)
    return acc


def check(rng, bm, fp8):
    """One stage of random weight and token rows: the accumulators against W X^T."""
    if fp8:
        codes = np.array(list(E4M3), np.uint8)
        idx = rng.integers(0, len(codes), size=(BN + bm, ROW_BYTES))
        rows_bytes = codes[idx]
        vals = np.array(list(E4M3.values()))[idx]
        per_word, decode = 4, decode_e4m3
    else:
        vals = rng.integers(-8, 9, size=(BN + bm, ROW_BYTES // 2)).astype(np.float64)
        rows_bytes = vals.astype("<f2").view(np.uint8).reshape(BN + bm, ROW_BYTES)
        per_word, decode = 2, decode_f16
    acc = compute_stage(write_stage(rows_bytes), bm, per_word, decode)
    w, x = vals[:BN], vals[BN:]
    want = w @ x.T  # [32 weight rows, bm tokens]
    bad = 0
    for t in range(32):
        for m in range(2):
            for b in range(bm // 8):
                for q in range(4):
                    row = m * 16 + t // 4 + 8 * (q // 2)
                    token = b * 8 + 2 * (t % 4) + q % 2
                    if acc[t, m, b, q] != want[row, token]:
                        bad += 1
    name = f"{'e4m3' if fp8 else '16-bit'} stage, {bm} tokens"
    print(f"{name}: {'ok' if bad == 0 else f'{bad} accumulators wrong'}")
    return bad == 0


def main():
    rng = np.random.default_rng(7)
    ok = True
    for fp8 in (False, True):
        for bm in (8, 16, 32):
            ok &= check(rng, bm, fp8)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
