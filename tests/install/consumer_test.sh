#!/usr/bin/env bash
# Installs the build tree with `cmake --install` into a temporary prefix, builds
# tests/install/consumer against it (find_package(ampdiag CONFIG REQUIRED)), trains with
# it, and reads the run.db it wrote with the installed `ampdiag` CLI.
#   consumer_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build="${1:?usage: consumer_test.sh BUILD_DIR SOURCE_DIR}"
source="${2:?usage: consumer_test.sh BUILD_DIR SOURCE_DIR}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" > "$work/install.log"
[ -f "$work/prefix/lib/cmake/ampdiag/ampdiagConfig.cmake" ] || { echo "no ampdiagConfig.cmake installed"; exit 1; }
cmake -S "$source/consumer" -B "$work/consumer" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$work/prefix" \
  > "$work/configure.log" 2>&1 || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/consumer" > "$work/build.log" 2>&1 || { tail -40 "$work/build.log"; exit 1; }
"$work/consumer/train" "$work/run.db"
"$work/prefix/bin/ampdiag" report "$work/run.db" --fail-on error
