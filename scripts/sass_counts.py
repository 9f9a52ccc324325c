#!/usr/bin/env python3
"""Instruction counts per kernel of a cubin, for comparing two builds of the same kernels.

  scripts/sass_counts.py FILE.cubin [--nvdisasm PATH] [--kernel SUBSTRING] [--ops OP,OP,...]

Disassembles FILE.cubin with nvdisasm (the CUDA toolkit's, or the one the pip wheel
nvidia-cuda-nvdisasm ships) and prints, per kernel whose mangled name contains SUBSTRING, its
instruction count and how many instructions start with each OP (default: the loads, stores,
tensor-core, branch and local-memory ones). A cubin of the sm_90a wgmma GEMMs:

  nvcc -std=c++20 -cubin -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \\
    -Iinclude -Ikernels -Ipolicies tests/gpu/wgmma_registers.cu -o /tmp/wgmma.cubin

An epilogue that grew, a load that moved into the K loop or a spill (STL/LDL) shows here
without a GPU; whether it costs time is for the benchmark to say.
"""
import argparse
import collections
import re
import shutil
import subprocess
import sys

DEFAULT_OPS = "LDG,STG,REDG,LDS,STS,LDGSTS,UTMALDG,HGMMA,QGMMA,FFMA,MUFU,BRA,STL,LDL"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("cubin")
    parser.add_argument("--nvdisasm", default=shutil.which("nvdisasm") or "nvdisasm")
    parser.add_argument("--kernel", default="")
    parser.add_argument("--ops", default=DEFAULT_OPS)
    opts = parser.parse_args()
    try:
        sass = subprocess.run([opts.nvdisasm, opts.cubin], stdout=subprocess.PIPE, check=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        sys.exit("sass_counts.py: nvdisasm failed ({}); pass --nvdisasm PATH".format(e))
    ops = opts.ops.split(",")
    counts = collections.OrderedDict()
    kernel = None
    for line in sass.splitlines():
        section = re.match(r"^\.text\.(\S+):", line)
        if section:
            kernel = section.group(1) if opts.kernel in section.group(1) else None
            if kernel is not None:
                counts[kernel] = collections.Counter()
            continue
        if kernel is None:
            continue
        insn = re.match(r"^\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if insn:
            name = insn.group(2)
            counts[kernel]["total"] += 1
            for op in ops:
                if name == op or name.startswith(op + "."):
                    counts[kernel][op] += 1
    if not counts:
        sys.exit("sass_counts.py: no kernel matches '{}'".format(opts.kernel))
    print("\t".join(["total"] + ops + ["kernel"]))
    for name, c in counts.items():
        print("\t".join([str(c["total"])] + [str(c[op]) for op in ops] + [name]))


if __name__ == "__main__":
    main()
