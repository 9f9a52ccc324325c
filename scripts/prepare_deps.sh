#!/usr/bin/env bash
# Copies the header-only dependencies of the build (Boost.Hana and doctest) from this
# machine into .deps/ (git-ignored), with the files Meson needs to find them there, so
# that a GPU machine without those packages and without internet can build the project.
# Run it where the packages are installed (Debian: libboost-dev doctest-dev), then take
# .deps/ along with the working tree. See CONTRIBUTING.md, "Running on a GPU machine".
#
#   scripts/prepare_deps.sh            # headers from /usr/include
#   BOOST_INCLUDE=/opt/boost/include DOCTEST_INCLUDE=/opt/doctest/include scripts/prepare_deps.sh
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
deps="$root/.deps"
boost_src=${BOOST_INCLUDE:-/usr/include}
doctest_src=${DOCTEST_INCLUDE:-/usr/include}
cxx=${CXX:-c++}

[[ -f "$boost_src/boost/hana.hpp" && -f "$boost_src/boost/version.hpp" ]] ||
  { echo "prepare_deps: no Boost.Hana under $boost_src (install libboost-dev or set BOOST_INCLUDE)" >&2; exit 1; }
[[ -f "$doctest_src/doctest/doctest.h" ]] ||
  { echo "prepare_deps: no doctest under $doctest_src (install doctest-dev or set DOCTEST_INCLUDE)" >&2; exit 1; }

rm -rf "$deps"
mkdir -p "$deps/include/boost" "$deps/include/doctest" "$deps/lib/pkgconfig" "$deps/lib/cmake/doctest"

# All of Hana, and boost/version.hpp, which Meson's boost finder reads for the version.
cp -r "$boost_src/boost/hana" "$boost_src/boost/hana.hpp" "$boost_src/boost/version.hpp" "$deps/include/boost/"

# Plus every other Boost header that the project's own Boost includes reach (none today:
# Hana's core is self-contained), found by the preprocessor rather than guessed.
tu=$(grep -rhoE '#include[[:space:]]*<boost/[^>]+>' "$root/include" "$root/kernels" "$root/policies" \
       "$root/tests" "$root/bench" "$root/examples" 2>/dev/null | sort -u || true)
if [[ -n "$tu" ]]; then
  reached=$(printf '%s\n' "$tu" | "$cxx" -std=c++20 -M -I"$boost_src" -x c++ - -o - |
              tr ' \\' '\n\n' | grep -E '/boost/' | grep -vE '/boost/hana(/|\.hpp)' | sort -u || true)
  for f in $reached; do
    rel=${f#"$boost_src"/}
    [[ "$rel" == boost/* ]] || continue
    mkdir -p "$deps/include/$(dirname "$rel")"
    cp "$f" "$deps/include/$rel"
  done
fi

cp "$doctest_src/doctest/doctest.h" "$deps/include/doctest/"
doctest_part() { sed -nE "s/^#define DOCTEST_VERSION_$1 ([0-9]+).*/\\1/p" "$doctest_src/doctest/doctest.h" | head -n1; }
doctest_version="$(doctest_part MAJOR).$(doctest_part MINOR).$(doctest_part PATCH)"
[[ "$doctest_version" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || doctest_version=2.4.0

# doctest for Meson's pkg-config lookup (relocatable through ${pcfiledir}) ...
cat > "$deps/lib/pkgconfig/doctest.pc" <<PC
prefix=\${pcfiledir}/../..
includedir=\${prefix}/include

Name: doctest
Description: single-header C++ testing framework (carried in .deps)
Version: $doctest_version
Cflags: -I\${includedir}
PC

# ... and for its CMake lookup, used where pkg-config is not installed.
cat > "$deps/lib/cmake/doctest/doctestConfig.cmake" <<'CMAKE'
get_filename_component(_doctest_prefix "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
if(NOT TARGET doctest::doctest)
  add_library(doctest::doctest INTERFACE IMPORTED)
  set_target_properties(doctest::doctest PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${_doctest_prefix}/include")
endif()
set(doctest_INCLUDE_DIRS "${_doctest_prefix}/include")
set(doctest_FOUND TRUE)
CMAKE
cat > "$deps/lib/cmake/doctest/doctestConfigVersion.cmake" <<CMAKE
set(PACKAGE_VERSION "$doctest_version")
if(PACKAGE_FIND_VERSION VERSION_GREATER PACKAGE_VERSION)
  set(PACKAGE_VERSION_COMPATIBLE FALSE)
else()
  set(PACKAGE_VERSION_COMPATIBLE TRUE)
endif()
CMAKE

boost_version=$(sed -nE 's/^#define BOOST_LIB_VERSION "([0-9_]+)".*/\1/p' "$deps/include/boost/version.hpp")
echo "prepare_deps: .deps/ holds Boost ${boost_version//_/.} (Hana, $(find "$deps/include/boost" -type f | wc -l) files)" \
     "and doctest $doctest_version, $(du -sh "$deps" | cut -f1)"
