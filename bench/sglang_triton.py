#!/usr/bin/env python3
"""SGLang's Triton fused MoE (what SGLang and vLLM run by default for an unquantized MoE layer,
with its tuned H200 configs) on the shapes of bench/moe_bench.cu, appended to the same
JSON-lines results so one table shows moerunner beside the engines' own kernel.

    python3 bench/sglang_triton.py --jsonl results.jsonl --peer DIR [--modes sglang,nearest]
                                   [--shapes ...] [--tokens ...]

The peer is other people's code and is not part of moerunner: DIR is a folder holding its
module (peer_fused_moe.py and its configs/), imported from there at run time.

Rows, one per config mode (the peer's PEER_MOE_CONFIG_MODE):
  sglang_triton          SGLang's own selection: the tuned file for (E, N = I) where one exists,
                         else its built-in default config;
  sglang_triton_nearest  the tuned file of the nearest (E, N) where SGLang has none, what a user
                         who tunes would come close to.
The stronger of the two is the bar. Each record names the mode and the config files it read.

What is timed: the peer's fused_experts_prepared (both GEMMs, activation, combine) from topk
ids/weights to the [M, H] output, replayed from a CUDA graph per routing set, as engines replay
it. Its align step (moe_align_block_size, plain torch in the peer's module where SGLang runs one
CUDA kernel) runs before capture, outside the timed call, which favours the peer slightly.
Routing sets, weights, the f32 check and the floor are bench_common's, as for torch_grouped_mm.
"""

import argparse
import importlib
import os
import sys
import time

import torch

from bench_common import add_common_args, read_ceilings, run_cells

MODES = {"sglang": "sglang_triton", "nearest": "sglang_triton_nearest"}


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
    args = ap.parse_args()
    read_ceilings(args.jsonl, "sglang_triton")  # fail before touching the GPU
    folder = os.path.abspath(args.peer)
    if not os.path.isfile(os.path.join(folder, "peer_fused_moe.py")):
        sys.exit(f"sglang_triton: {folder} holds no peer_fused_moe.py")
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            sys.exit(f"sglang_triton: unknown mode '{m}' (modes: {', '.join(MODES)})")
    if not torch.cuda.is_available():
        sys.exit("sglang_triton: no CUDA device")
    import triton

    print(f"PyTorch {torch.__version__}, Triton {triton.__version__} on {torch.cuda.get_device_name()}; "
          f"peer from {folder}")
    failures = 0
    for mode in modes:
        peer = load_peer(folder, mode)

        def make_call(x, ids, w, w13, w2):
            prep = peer.prepare_for(x, w13, w2, ids)  # the align step, outside the timed call
            return lambda: peer.fused_experts_prepared(x, w13, w2, w, ids, prep)

        def config_of(e, inter):
            up, down = peer.config_source(e, inter)
            name = lambda f: os.path.basename(f) if f else None
            return {"peer": "sglang_triton_moe", "config_mode": mode, "config_up": name(up) or "default",
                    "config_down": name(down) or "same as up"}

        failures += run_cells(args, MODES[mode], make_call, extra=config_of)
    print(f"sglang_triton: appended to {args.jsonl}; {failures} failed cell(s)")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    start = time.time()
    rc = main()
    print(f"sglang_triton: {time.time() - start:.0f} s")
    sys.exit(rc)
