#!/usr/bin/env python3
"""scripts/sass_descriptor_check.py on hand-written cuobjdump output: a descriptor loaded by a
64-bit uniform load passes (both halves written), one never written is flagged."""

import importlib.util
import pathlib
import sys

path = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "sass_descriptor_check.py"
spec = importlib.util.spec_from_file_location("sass_descriptor_check", path)
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)

GOOD = """
        /*0000*/                   ULDC.64 UR4, c[0x0][0x208] ;
        /*0010*/                   LDG.E R2, desc[UR4][R2.64] ;
        /*0020*/                   LDGSTS.E.BYPASS.128 [R7], desc[UR5][R4.64], P1 ;
"""
BAD = """
        /*0000*/                   ULDC.64 UR4, c[0x0][0x208] ;
        /*0010*/              @!P4 LDGSTS.E.BYPASS.128 [R21+UR0], desc[UR1][R16.64], P3 ;
        /*0020*/                   LDG.E R2, desc[UR4][R2.64] ;
"""

assert check.unwritten(GOOD) == [], check.unwritten(GOOD)
assert check.unwritten(BAD) == ["UR1"], check.unwritten(BAD)
print("sass_descriptor_check: ok")
sys.exit(0)
