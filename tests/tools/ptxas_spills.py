#!/usr/bin/env python3
"""Compiles device code with ptxas's report on and fails where a kernel spills registers or
ptxas serializes its wgmma.

  ptxas_spills.py [--min-kernels N] -- CMD...

CMD is an nvcc command that passes -Xptxas -v (@TMP@ becomes a temporary folder). Every
"Compiling entry function" report must show 0 bytes of spill stores and loads, and at least N
kernels must have been reported (so that a command compiling nothing does not pass), and no
kernel may draw ptxas's notes that it serialized wgmma or injected a wait for their registers
(C7514, C7517, C7518...: the accumulators then wait at every wgmma, which costs more than a
spill, and the build still succeeds). Exit status: 0 when all hold, 1 otherwise.
"""
import argparse
import re
import subprocess
import sys
import tempfile


def main():
    if "--" not in sys.argv:
        sys.exit("ptxas_spills.py: missing '--' before the command")
    split = sys.argv.index("--")
    parser = argparse.ArgumentParser()
    parser.add_argument("--min-kernels", type=int, default=1)
    opts = parser.parse_args(sys.argv[1:split])
    cmd = sys.argv[split + 1:]
    if not cmd:
        sys.exit("ptxas_spills.py: empty command")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [a.replace("@TMP@", tmp) for a in cmd]
        print("$ " + " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    out = proc.stdout
    if proc.returncode != 0:
        print(out)
        print("ptxas_spills.py: the command failed with exit status {}".format(proc.returncode))
        return 1
    kernels, spilling, serialized = 0, [], []
    current = None
    for line in out.splitlines():
        note = re.search(r"\((C75\d\d)\).*(wgmma|warpgroup\.wait).*function '([^']+)'", line)
        if note:
            serialized.append("{}: {}".format(note.group(3), line.split(":", 1)[-1].strip()))
            continue
        entry = re.search(r"Compiling entry function '([^']+)'", line)
        if entry:
            current = entry.group(1)
            kernels += 1
            continue
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if spill and current is not None:
            stores, loads = int(spill.group(1)), int(spill.group(2))
            if stores or loads:
                spilling.append("{}: {} bytes spill stores, {} bytes spill loads".format(current, stores, loads))
            current = None
    print("{} kernels reported, {} spilling, {} notes of serialized wgmma".format(kernels, len(spilling),
                                                                            len(serialized)))
    for s in spilling + serialized:
        print("  " + s)
    if kernels < opts.min_kernels:
        print("ptxas_spills.py: expected at least {} kernels".format(opts.min_kernels))
        return 1
    return 1 if spilling or serialized else 0


if __name__ == "__main__":
    sys.exit(main())
