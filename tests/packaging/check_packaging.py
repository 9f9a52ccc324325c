#!/usr/bin/env python3
"""Checks moerunner as a package, the way other builds consume it.

  check_packaging.py MODE --source-root S --build-root B --prefix P --meson M --cxx C...

install     `meson install --destdir`: every public header and the package files land
            under the prefix; a program built with `pkg-config --cflags --libs moerunner`
            alone (no in-tree paths) compiles and runs.
cmake       a CMake project finds the installed package (find_package) and runs.
subproject  a Meson project takes moerunner as subprojects/moerunner and runs.
standalone  examples/custom_backend builds as its own Meson project against the
            installed tree (found by pkg-config) and its tests pass.
Exit status 77 (skipped) when a tool the mode needs is missing.
"""
import argparse
import glob
import os
import shutil
import subprocess
import sys

SKIP = 77
# The one program the pkg-config, CMake and subproject checks build.
CONSUMER_SOURCE = os.path.join("tests", "common", "package_consumer.cpp")


def run(cmd, **kw):
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def capture(cmd, **kw):
    print("$ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, **kw).stdout.strip()


def fresh_dir(path):
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def staged_install(opts, work):
    """Installs into work/stage; returns the staged prefix."""
    stage = os.path.join(work, "stage")
    run([*opts.meson, "install", "-C", opts.build_root, "--no-rebuild", "--quiet", "--destdir", stage])
    return stage + opts.prefix if os.path.isabs(opts.prefix) else os.path.join(stage, opts.prefix)


def public_headers(source_root):
    found = set()
    for base in ("include", "kernels", "policies"):
        top = os.path.join(source_root, base)
        for dirpath, _, names in os.walk(top):
            for n in names:
                if n.endswith((".hpp", ".cuh", ".h")):
                    found.add(os.path.relpath(os.path.join(dirpath, n), top))
    return found


def pkgconfig_env(prefix):
    pcs = glob.glob(os.path.join(prefix, "**", "pkgconfig", "moerunner.pc"), recursive=True)
    if len(pcs) != 1:
        raise SystemExit("expected one installed moerunner.pc under {}, found {}".format(prefix, pcs))
    env = dict(os.environ)
    env["PKG_CONFIG_PATH"] = os.path.dirname(pcs[0])
    return env


def mode_install(opts, work):
    if not shutil.which("pkg-config"):
        return SKIP
    prefix = staged_install(opts, work)
    missing = []
    installed_inc = glob.glob(os.path.join(prefix, "**", "moerunner", "moerunner.hpp"), recursive=True)
    if len(installed_inc) != 1:
        raise SystemExit("expected one installed moerunner/moerunner.hpp, found {}".format(installed_inc))
    includedir = os.path.dirname(os.path.dirname(installed_inc[0]))
    for h in sorted(public_headers(opts.source_root)):
        if not os.path.isfile(os.path.join(includedir, h)):
            missing.append(h)
    for f in ("lib/cmake/moerunner/moerunnerConfig.cmake", "lib/cmake/moerunner/moerunnerConfigVersion.cmake"):
        if not os.path.isfile(os.path.join(prefix, f)):
            missing.append(f)
    if missing:
        raise SystemExit("not installed: " + ", ".join(missing))

    env = pkgconfig_env(prefix)
    # The .pc file names ${prefix}; pointing it at the staged tree checks it is relocatable.
    define = "--define-variable=prefix=" + prefix
    cflags = capture(["pkg-config", define, "--cflags", "moerunner"], env=env).split()
    libs = capture(["pkg-config", define, "--libs", "moerunner"], env=env).split()
    in_tree = [os.path.join(opts.source_root, d) for d in ("include", "kernels", "policies")]
    for flag in cflags:
        if any(d in flag for d in in_tree):
            raise SystemExit("pkg-config flags point into the source tree: " + flag)
    exe = os.path.join(work, "pkgconfig_consumer")
    src = os.path.join(opts.source_root, CONSUMER_SOURCE)
    run([*opts.cxx, "-std=c++20", '-DMOERUNNER_CONSUMER="pkg-config"', *cflags, src, "-o", exe, *libs])
    run([exe])
    return 0


def mode_cmake(opts, work):
    cmake = shutil.which("cmake")
    if not cmake:
        return SKIP
    prefix = staged_install(opts, work)
    build = os.path.join(work, "cmake-build")
    env = dict(os.environ)
    env["CXX"] = opts.cxx[0]
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    run([cmake, "-S", os.path.join(opts.source_root, "tests", "cmake_consumer"), "-B", build, *gen,
         "-DCMAKE_BUILD_TYPE=Release", "-DCMAKE_PREFIX_PATH=" + prefix], env=env)
    run([cmake, "--build", build], env=env)
    run([os.path.join(build, "consumer")])
    return 0


def mode_subproject(opts, work):
    # The project is copied with the shared program at the same relative place, and gets
    # moerunner as subprojects/moerunner (a link to this tree).
    src = os.path.join(work, "tests", "subproject_consumer")
    shutil.copytree(os.path.join(opts.source_root, "tests", "subproject_consumer"), src)
    os.makedirs(os.path.join(work, "tests", "common"))
    shutil.copy(os.path.join(opts.source_root, CONSUMER_SOURCE), os.path.join(work, CONSUMER_SOURCE))
    os.makedirs(os.path.join(src, "subprojects"))
    os.symlink(opts.source_root, os.path.join(src, "subprojects", "moerunner"))
    build = os.path.join(work, "build")
    run([*opts.meson, "setup", build, src])
    run([*opts.meson, "compile", "-C", build])
    run([os.path.join(build, "consumer")])
    return 0


def mode_standalone(opts, work):
    if not shutil.which("pkg-config"):
        return SKIP
    prefix = staged_install(opts, work)
    env = pkgconfig_env(prefix)
    build = os.path.join(work, "build")
    # The staged .pc file names the final prefix; a copy that names the stage stands in for it.
    relocated = os.path.join(work, "pc")
    os.makedirs(relocated)
    with open(os.path.join(env["PKG_CONFIG_PATH"], "moerunner.pc")) as f:
        lines = f.read().splitlines()
    with open(os.path.join(relocated, "moerunner.pc"), "w") as f:
        f.write("\n".join("prefix=" + prefix if l.startswith("prefix=") else l for l in lines) + "\n")
    env["PKG_CONFIG_PATH"] = relocated
    run([*opts.meson, "setup", build, os.path.join(opts.source_root, "examples", "custom_backend")], env=env)
    run([*opts.meson, "compile", "-C", build], env=env)
    run([*opts.meson, "test", "-C", build, "--print-errorlogs"], env=env)
    return 0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["install", "cmake", "subproject", "standalone"])
    parser.add_argument("--source-root", required=True)
    parser.add_argument("--build-root", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--meson", nargs="+", required=True)
    parser.add_argument("--cxx", nargs="+", required=True)
    opts = parser.parse_args()
    opts.source_root = os.path.realpath(opts.source_root)
    work = fresh_dir(os.path.join(opts.build_root, "packaging-check", opts.mode))
    try:
        return {"install": mode_install, "cmake": mode_cmake, "subproject": mode_subproject,
                "standalone": mode_standalone}[opts.mode](opts, work)
    except subprocess.CalledProcessError as e:
        print("failed ({}): {}".format(e.returncode, " ".join(e.cmd)))
        return 1


if __name__ == "__main__":
    sys.exit(main())
