#!/usr/bin/env python3
"""Runs a command and checks how it ended and what it printed.

  run_check.py [--exit N | --exit nonzero] [--contains TEXT]... [--include HEADER --suffix .cpp] -- CMD...

--exit nonzero    the command must fail (a compile-fail test); default: it must exit 0.
--contains TEXT   TEXT must appear in stdout+stderr (whitespace runs compare equal).
--include HEADER  writes a translation unit that includes HEADER twice (so a missing
                  include guard shows) and replaces @SRC@ in CMD with its path.
--snippet FILE:N  writes the N-th ```cpp block of the Markdown FILE as the translation
                  unit instead (documentation that must keep compiling).
Exit status: 0 when every expectation holds, 1 otherwise.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile


def squash(text):
    return re.sub(r"\s+", " ", text)


def main():
    if "--" not in sys.argv:
        sys.exit("run_check.py: missing '--' before the command")
    split = sys.argv.index("--")
    parser = argparse.ArgumentParser()
    parser.add_argument("--exit", default="0")
    parser.add_argument("--contains", action="append", default=[])
    parser.add_argument("--include")
    parser.add_argument("--snippet")
    parser.add_argument("--suffix", default=".cpp")
    opts = parser.parse_args(sys.argv[1:split])
    cmd = sys.argv[split + 1:]
    if not cmd:
        sys.exit("run_check.py: empty command")

    with tempfile.TemporaryDirectory() as tmp:
        if opts.include:
            src = os.path.join(tmp, "header_alone" + opts.suffix)
            with open(src, "w") as f:
                f.write('#include "{0}"\n#include "{0}"\n'.format(opts.include))
            cmd = [a.replace("@SRC@", src) for a in cmd]
        elif opts.snippet:
            path, index = opts.snippet.rsplit(":", 1)
            with open(path) as f:
                blocks = re.findall(r"^```cpp\n(.*?)^```", f.read(), re.S | re.M)
            if int(index) >= len(blocks):
                sys.exit("run_check.py: {} has no ```cpp block {}".format(path, index))
            src = os.path.join(tmp, "snippet" + opts.suffix)
            with open(src, "w") as f:
                f.write(blocks[int(index)])
            cmd = [a.replace("@SRC@", src) for a in cmd]
        cmd = [a.replace("@TMP@", tmp) for a in cmd]
        print("$ " + " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    out = proc.stdout
    sys.stdout.write(out)

    problems = []
    if opts.exit == "nonzero":
        if proc.returncode == 0:
            problems.append("expected the command to fail, but it succeeded")
    elif proc.returncode != int(opts.exit):
        problems.append("expected exit status {}, got {}".format(opts.exit, proc.returncode))
    for text in opts.contains:
        if squash(text) not in squash(out):
            problems.append("expected the output to contain: " + text)
    for p in problems:
        print("run_check: " + p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
