#!/usr/bin/env bash
# Make the "before" tree for benchmarks/ab.py: refitkit/ at BASE (default 35ec2da) in ab/before/, as untracked files
# of this checkout (so they travel to the GPU machine with it; do not commit them), and print the device command.
#
#     benchmarks/ab_prepare.sh [BASE]
set -euo pipefail
base=${1:-35ec2da}
root=$(git rev-parse --show-toplevel)
cd "$root"
commit=$(git rev-parse --verify "$base^{commit}")
rm -rf ab/before
mkdir -p ab/before
git archive "$commit" refitkit | tar -x -C ab/before
echo "$commit" > ab/before/COMMIT
if git check-ignore -q ab/before/refitkit/__init__.py; then
    echo "ab/before is ignored by git here: it would not travel to the device (name it in carry, or unignore it)" >&2
    exit 1
fi
before_bytes=$(du -sb ab/before | cut -f1)
# what travels: tracked files and untracked files git does not ignore (shared/ too, where the checkout has one)
tree_bytes=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
echo "ab/before: refitkit at $commit, $before_bytes bytes ($(( before_bytes / 1024 )) KiB)"
echo "the working tree that travels, ab/before included: $tree_bytes bytes ($(( tree_bytes / 1048576 )) MiB of 64 MiB)"
cat <<'EOF'

Device command (one H100 or H200; after installing GPU vLLM 0.25.0 into /tmp/site as usual), first call:

  python3 -m pip install -q --no-deps --no-build-isolation --upgrade --target /tmp/site . && export PYTHONPATH=/tmp/site VLLM_WORKER_MULTIPROC_METHOD=spawn VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 && python3 benchmarks/ab.py --before ab/before --pairs 3 --out "$OUT" --budget-s 540

A later call (the machine still warm keeps /tmp/refitkit-ab-checkpoints) continues where the budget stopped: copy the
first call's ab.json into the checkout (e.g. ab/ab-1.json, untracked) and add --resume ab/ab-1.json. One table from
several calls, here: python3 benchmarks/ab.py --report ab-1.json ab-2.json
EOF
