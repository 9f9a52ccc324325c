#!/usr/bin/env bash
# Installs what the build needs (Debian 12, CUDA toolkit at /usr/local/cuda), builds the
# main example and runs it: one MoE layer forward on the default backend, cuda_fused on
# a GPU, else the reference backend on the host. Arguments go to the example
# (try --help); the build lives in build-example/.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export PATH="/usr/local/cuda/bin:$PATH"
export DEBIAN_FRONTEND=noninteractive

packages=(meson ninja-build pkg-config g++ libboost-dev)
sudo=()
[[ "$(id -u)" == 0 ]] || sudo=(sudo)
if ! "${sudo[@]}" apt-get install -y --no-install-recommends "${packages[@]}"; then
  "${sudo[@]}" apt-get update
  "${sudo[@]}" apt-get install -y --no-install-recommends "${packages[@]}"
fi

# tests=auto defines the examples (and the tests only where doctest is installed); only the
# example is built.
if [[ -f build-example/build.ninja ]]; then
  meson configure build-example -Dtests=auto
else
  meson setup build-example -Dtests=auto --buildtype=release
fi
ninja -C build-example examples/moe_forward
exec ./build-example/examples/moe_forward "$@"
