#!/usr/bin/env python3
"""Prints every public header as it is included ("moerunner/..."), one a line.

Walks the three include roots, so a header added anywhere is tested without
editing a list (re-run meson setup, or any reconfigure, to pick it up)."""
import os
import sys

root = sys.argv[1]
found = []
for base in ("include", "kernels", "policies"):
    top = os.path.join(root, base)
    for dirpath, _, names in os.walk(top):
        for name in names:
            if name.endswith((".hpp", ".cuh", ".h")):
                found.append(os.path.relpath(os.path.join(dirpath, name), top))
for h in sorted(set(found)):
    print(h)
