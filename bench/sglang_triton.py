#!/usr/bin/env python3
"""SGLang's Triton fused MoE (what SGLang and vLLM run by default for an unquantized MoE layer,
with its tuned H200 configs) on the shapes of bench/moe_bench.cu, appended to the same
JSON-lines results so one table shows moerunner beside the engines' own kernel.

    python3 bench/sglang_triton.py --jsonl results.jsonl --peer DIR [--modes sglang,nearest]
                                   [--formats bf16,fp8] [--shapes ...] [--tokens ...]

The peer is other people's code and is not part of moerunner: DIR is a folder holding its
module (peer_fused_moe.py and its configs/), imported from there at run time.

Rows, one per weight format and config mode (the peer's PEER_MOE_CONFIG_MODE):
  sglang_triton          bf16, SGLang's own selection: the tuned file for (E, N = I) where one
                         exists, else its built-in default config;
  sglang_triton_nearest  bf16, the tuned file of the nearest (E, N) where SGLang has none, what
                         a user who tunes would come close to;
  sglang_triton_fp8, sglang_triton_fp8_nearest
                         (--formats fp8) the same for SGLang's fp8 w8a8 block-scaled path: e4m3
                         weights with one f32 scale per 128x128 block (quantized here from the
                         bf16 weights), activations quantized per token in groups of 128 inside
                         the timed call, as SGLang runs it.
The stronger mode is the bar. Each record names the mode and the config files it read. fp8
cells are checked against an f32 computation on the dequantized weights with the activations
quantized at the same two points, and their floor counts 1-byte weights (plus the block
scales) and the fp8 GEMM rate (fp8_TFLOPs: the ceilings line's, or torch._scaled_mm on e4m3 at
8192^3 measured here when moe_bench wrote none).

What is timed: the peer's fused_experts_prepared (both GEMMs, activation, combine) from topk
ids/weights to the [M, H] output, replayed from a CUDA graph per routing set, as engines replay
it. Its align step (moe_align_block_size, plain torch in the peer's module where SGLang runs one
CUDA kernel) runs before capture, outside the timed call, which favours the peer slightly.
Routing sets, weights, the f32 check and the floor are bench_common's, as for torch_grouped_mm.
"""

import argparse
import importlib
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from bench_common import add_common_args, median_launch_ms, read_ceilings, run_cells

MODES = {"sglang": "sglang_triton", "nearest": "sglang_triton_nearest"}
FORMATS = ("bf16", "fp8")
FP8_MAX = 448.0
BLOCK = 128


def backend_name(fmt, mode):
    base = MODES[mode]
    return base if fmt == "bf16" else base.replace("sglang_triton", "sglang_triton_fp8", 1)


def fp8_rate(jsonl):
    """fp8 e4m3 GEMM flop/s: the ceilings line's fp8_TFLOPs, else torch._scaled_mm at 8192^3."""
    with open(jsonl) as f:
        head = json.loads(f.readline())
    if head.get("fp8_TFLOPs"):
        return float(head["fp8_TFLOPs"]) * 1e12
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
    one = torch.ones((), device="cuda")
    ms = median_launch_ms(lambda j: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    return 2.0 * n ** 3 / (ms * 1e-3)


def quantize_groups(v):
    """v [..., L] f32 quantized per 128 values to e4m3 (scale = amax / 448) and back."""
    length = v.shape[-1]
    pad = (-length) % BLOCK
    g = F.pad(v, (0, pad)).view(*v.shape[:-1], -1, BLOCK)
    scale = g.abs().amax(dim=-1, keepdim=True).clamp_min(1e-10) / FP8_MAX
    q = (g / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale
    return q.view(*v.shape[:-1], -1)[..., :length]


def dequantize(wq, scale):
    n, k = wq.shape
    s = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]
    return wq.float() * s


class Fp8BlockFormat:
    """The peer's fp8 block-scaled weights, for bench_common.run_cells."""

    weight_bytes = 1.0 + 4.0 / (BLOCK * BLOCK)

    def __init__(self, peer, flops_per_s):
        self.peer = peer
        self.flops_per_s = flops_per_s

    def prepare(self, w13, w2):
        return self.peer.quantize_weights_fp8_block(w13), self.peer.quantize_weights_fp8_block(w2)

    @staticmethod
    def reference(x, topk_ids, topk_weights, w13, w2, tokens):
        """f32 rows on the dequantized weights, x and the activation quantized per 128 values."""
        (w13q, s13), (w2q, s2) = w13, w2
        inter = w13q.shape[1] // 2
        rows = []
        for t in tokens:
            acc = torch.zeros(x.shape[1], device=x.device, dtype=torch.float32)
            xt = quantize_groups(x[t].float())
            for j in range(topk_ids.shape[1]):
                e = int(topk_ids[t, j])
                if e < 0:
                    continue
                gu = dequantize(w13q[e], s13[e]) @ xt
                a = quantize_groups(F.silu(gu[:inter]) * gu[inter:])
                acc += float(topk_weights[t, j]) * (dequantize(w2q[e], s2[e]) @ a)
            rows.append(acc)
        return torch.stack(rows)


def load_peer(folder, mode):
    """The peer's module with PEER_MOE_CONFIG_MODE = mode (its config lookup is cached per
    process, so a new mode reloads the module)."""
    os.environ["PEER_MOE_CONFIG_MODE"] = mode
    if folder not in sys.path:
        sys.path.insert(0, folder)
    if "peer_fused_moe" in sys.modules:
        return importlib.reload(sys.modules["peer_fused_moe"])
    return importlib.import_module("peer_fused_moe")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--peer", required=True, help="folder holding the peer's peer_fused_moe.py and configs/")
    ap.add_argument("--modes", default=",".join(MODES), help="config modes to run, of: " + ", ".join(MODES))
    ap.add_argument("--formats", default="bf16", help="weight formats to run, of: " + ", ".join(FORMATS))
    args = ap.parse_args()
    read_ceilings(args.jsonl, "sglang_triton")  # fail before touching the GPU
    folder = os.path.abspath(args.peer)
    if not os.path.isfile(os.path.join(folder, "peer_fused_moe.py")):
        sys.exit(f"sglang_triton: {folder} holds no peer_fused_moe.py")
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            sys.exit(f"sglang_triton: unknown mode '{m}' (modes: {', '.join(MODES)})")
    formats = [f for f in args.formats.split(",") if f]
    for f in formats:
        if f not in FORMATS:
            sys.exit(f"sglang_triton: unknown format '{f}' (formats: {', '.join(FORMATS)})")
    if not torch.cuda.is_available():
        sys.exit("sglang_triton: no CUDA device")
    import triton

    print(f"PyTorch {torch.__version__}, Triton {triton.__version__} on {torch.cuda.get_device_name()}; "
          f"peer from {folder}")
    failures = 0
    rate = fp8_rate(args.jsonl) if "fp8" in formats else None
    for fmt in formats:
        for mode in modes:
            peer = load_peer(folder, mode)
            fp8 = fmt == "fp8"

            def make_call(x, ids, w, w13, w2):
                if fp8:
                    (w13q, s13), (w2q, s2) = w13, w2
                    prep = peer.prepare_for(x, w13q, w2q, ids)  # the fp8 weights pick the fp8 config
                    return lambda: peer.fused_experts_fp8_prepared(x, w13q, w2q, s13, s2, w, ids, prep)
                prep = peer.prepare_for(x, w13, w2, ids)  # the align step, outside the timed call
                return lambda: peer.fused_experts_prepared(x, w13, w2, w, ids, prep)

            def config_of(e, inter):
                up, down = peer.config_source(e, inter, "fp8_w8a8" if fp8 else None, (BLOCK, BLOCK) if fp8 else None)
                name = lambda f: os.path.basename(f) if f else None
                record = {"peer": "sglang_triton_moe", "config_mode": mode, "weights": fmt,
                          "config_up": name(up) or "default", "config_down": name(down) or "same as up"}
                if fp8:
                    record["fp8_TFLOPs"] = rate / 1e12
                return record

            failures += run_cells(args, backend_name(fmt, mode), make_call, extra=config_of,
                                  weight_format=Fp8BlockFormat(peer, rate) if fp8 else None)
    print(f"sglang_triton: appended to {args.jsonl}; {failures} failed cell(s)")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    start = time.time()
    rc = main()
    print(f"sglang_triton: {time.time() - start:.0f} s")
    sys.exit(rc)
