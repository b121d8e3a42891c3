#!/usr/bin/env bash
# Build a wheel kit for the GPU machine from one of this folder's pin files, with the shared recipe
# (../shared/gpu-wheels/build.sh and install.sh, which stay untouched: /work/shared is read-only).
#   usage: envs/gpu/build-kit.sh KIT OUT_DIR [PART_MIB]      KIT: verl (the pins in envs/gpu/KIT.txt)
# The recipe, install.sh and KIT.txt are copied into a temporary folder and build.sh runs there, so OUT_DIR gets the
# recipe's p00, p01, ..., SHA256SUMS and install.sh. A pin preceded by a comment line containing "sdist only" has no
# wheel on the index: its pure-Python wheel is built here first and offered to the recipe's `pip download` through
# PIP_FIND_LINKS. On the GPU machine: `bash install.sh verl PARTS_DIR /tmp/site` after the vLLM kit's install.
set -euo pipefail
kit=${1:?usage: build-kit.sh KIT OUT_DIR [PART_MIB]}; out=${2:?usage: build-kit.sh KIT OUT_DIR [PART_MIB]}
part=${3:-60}
here=$(cd "$(dirname "$0")" && pwd)
recipe=${GPU_WHEELS_RECIPE:-$(cd "$here/../../.." && pwd)/shared/gpu-wheels}
[ -f "$here/$kit.txt" ] || { echo "build-kit.sh: no pin file $here/$kit.txt" >&2; exit 2; }
[ -f "$recipe/build.sh" ] && [ -f "$recipe/install.sh" ] || {
  echo "build-kit.sh: no recipe in $recipe (set GPU_WHEELS_RECIPE to the gpu-wheels folder)" >&2; exit 2; }
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
cp "$recipe/build.sh" "$recipe/install.sh" "$work/"
cp "$here/$kit.txt" "$work/$kit.txt"
mkdir "$work/built"
# pins that follow a comment saying "sdist only": build their wheels (no dependencies) before the recipe runs
awk '/^#.*sdist only/ {flag=1; next} /^[[:space:]]*#/ || /^[[:space:]]*$/ {next} flag {print; flag=0}' \
  "$here/$kit.txt" | while read -r pin; do
  python3 -m pip wheel -q --no-deps --no-binary=:all: -w "$work/built" "$pin"
done
export PIP_FIND_LINKS="${PIP_FIND_LINKS:+$PIP_FIND_LINKS }$work/built"
out=$(mkdir -p "$out" && cd "$out" && pwd)
bash "$work/build.sh" "$kit" "$out" "$part"
