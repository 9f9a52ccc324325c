#!/usr/bin/env python3
"""Flags kernels whose SASS reads a memory descriptor register (`desc[URn]`) that no instruction
of the kernel writes, in `cuobjdump -sass` output (a file, or stdin). nvcc 13.0's ptxas emitted
such copies in the e4m3 stream GEMMs when they carried an L2 cache policy (an illegal instruction
at run time; bench/NOTES.md, round 12); check a new toolchain with it before giving them the
policy back:

    cuobjdump -sass build/tests/gpu/test_cuda_fused_fp8 | scripts/sass_descriptor_check.py

Exit status 1 when some kernel is flagged."""

import re
import sys

INSN = r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?"


def unwritten(body):
    used = set(re.findall(r"desc\[(UR\d+)\]", body))
    written = set(re.findall(INSN + r"\S+\s+(UR\d+)", body, re.M))
    # A 64-bit uniform write (ULDC.64, UMOV.64, ...) also writes the register after its first.
    written |= {f"UR{int(n) + 1}" for n in re.findall(INSN + r"\S+\.64\s+UR(\d+)", body, re.M)}
    return sorted(used - written, key=lambda r: int(r[2:]))


def main():
    text = open(sys.argv[1]).read() if len(sys.argv) > 1 else sys.stdin.read()
    functions = re.split(r"\n\s*Function : ", text)[1:]
    flagged = 0
    for f in functions:
        missing = unwritten(f)
        if missing:
            flagged += 1
            print(f"{f.split(chr(10), 1)[0]}: reads {', '.join(missing)} unwritten")
    print(f"{len(functions)} kernels, {flagged} with unwritten descriptor registers")
    return 1 if flagged else 0


if __name__ == "__main__":
    sys.exit(main())
