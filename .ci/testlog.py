#!/usr/bin/env python3
"""Helpers for .ci/run over Meson's test introspection and test logs.

  testlog.py select BUILD_DIR REGEX     tests whose name matches: "name<TAB>ninja target" lines
  testlog.py missing BUILD_DIR          tests whose program was not built: one name a line
  testlog.py runnable BUILD_DIR         tests whose program exists: one name a line
  testlog.py count LABEL TESTLOG_JSON   "passed failed skipped" for one log, failures listed on stderr
"""
import json
import os
import re
import subprocess
import sys

PASSED = {"OK", "EXPECTEDFAIL"}
FAILED = {"FAIL", "TIMEOUT", "UNEXPECTEDPASS", "ERROR"}
SKIPPED = {"SKIP"}


def tests(build):
    out = subprocess.run(["meson", "introspect", "--tests", build], check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(out.stdout)


def program(test):
    return test["cmd"][0] if test["cmd"] else ""


def built(build, test):
    """True when the test's program and every build output in its command line exist."""
    root = os.path.realpath(build)
    for arg in test["cmd"]:
        if os.path.isabs(arg) and os.path.realpath(arg).startswith(root + os.sep) and not os.path.exists(arg):
            return False
    return os.path.exists(program(test)) or not os.path.isabs(program(test))


def main():
    cmd = sys.argv[1]
    if cmd == "select":
        build, pattern = sys.argv[2], re.compile(sys.argv[3])
        root = os.path.realpath(build)
        for t in tests(build):
            if pattern.search(t["name"]):
                target = os.path.relpath(os.path.realpath(program(t)), root)
                print("{}\t{}".format(t["name"], target))
    elif cmd in ("missing", "runnable"):
        build = sys.argv[2]
        for t in tests(build):
            if built(build, t) == (cmd == "runnable"):
                print(t["name"])
    elif cmd == "count":
        label, path = sys.argv[2], sys.argv[3]
        passed = failed = skipped = 0
        with open(path) as f:
            for line in f:
                if not line.strip():
                    continue
                r = json.loads(line)
                result = r.get("result", "ERROR")
                if result in PASSED:
                    passed += 1
                elif result in SKIPPED:
                    skipped += 1
                else:
                    failed += 1
                    sys.stderr.write("  {}: {} {}\n".format(label, result, r.get("name", "?")))
        print(passed, failed, skipped)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
