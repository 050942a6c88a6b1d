#!/bin/sh
# Which wheels the thin device install (with its sign and metrics extras) resolves to for a
# Raspberry Pi or Jetson: CPython 3.11 on manylinux aarch64, binary wheels only. Run from a
# checkout with network access to the package index; pip fails naming any package without one.
# Usage: deploy/check-aarch64-wheels.sh [python-version, default 3.11]
set -eu
py=${1:-3.11}
abi="cp$(echo "$py" | tr -d .)"
dest=$(mktemp -d)
trap 'rm -rf "$dest"' EXIT
cd "$(dirname "$0")/.."
pip=${PIP:-pip}
"$pip" download --quiet --only-binary=:all: --dest "$dest" \
    --platform manylinux2014_aarch64 --platform manylinux_2_17_aarch64 --platform manylinux_2_28_aarch64 \
    --python-version "$py" --implementation cp --abi "$abi" --abi abi3 --abi none \
    ".[sign,metrics]"
ls "$dest" | grep -v '^splitedge' | sed 's/^/  /'
echo "every dependency of the thin install resolves to a binary wheel for CPython $py on aarch64"
