#!/usr/bin/env bash
# The wheels scripts/gpu_check.py needs on the lent GPU machine beyond its image (scripts/device_bundle.txt),
# for that machine's Python (CPython 3.12, manylinux x86_64), into .device-bundle/ (ignored; no registry
# is reachable there); then the call to make on that machine: its command, what to carry, its time limit.
#
#   bash scripts/device_bundle.sh      # or: make device-bundle
#
# The command is scripts/device_run.sh, which travels with the working tree: it installs the wheels
# into a target directory there (pip --no-index), sets PYTHONPATH and runs the check with its report
# under $OUT (docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."

BUNDLE=.device-bundle
PY=${PYTHON:-python3}
# The full run's limit: gpu_check's 420 s (its imports, each check and its start allowance), the wheels'
# install and the 3-step train start, with a margin. A 15-minute lease then holds the machine's start
# (1-2 min), this call, and a fresh machine for one rerun of what failed (docs/gpu.md, "Time").
TIMEOUT_S=480

rm -rf "$BUNDLE"
mkdir -p "$BUNDLE"
mapfile -t wheels < <(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' scripts/device_bundle.txt)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$BUNDLE" "${wheels[@]}"
found=$(find "$BUNDLE" -name '*.whl' | wc -l)
if [ "$found" -ne "${#wheels[@]}" ]; then
    echo "device_bundle: ${#wheels[@]} wheels asked for, $found downloaded into $BUNDLE" >&2
    exit 1
fi

bundle_kib=$(du -sk "$BUNDLE" | cut -f1)
# what travels: tracked and untracked-not-ignored files, and the carried bundle (the limit is 64 MiB)
tree_kib=$(git ls-files -z --cached --others --exclude-standard | du -ck --files0-from=- 2>/dev/null \
    | tail -n 1 | cut -f1)
echo "device_bundle: ${#wheels[@]} wheel(s) in $BUNDLE: $(cd "$BUNDLE" && ls -- *.whl | tr '\n' ' ')"
mib=$((bundle_kib / 1024)).$(( (bundle_kib % 1024) * 10 / 1024 ))
echo "device_bundle: bundle $mib MiB ($bundle_kib KiB);" \
     "working tree with it $(( (tree_kib + bundle_kib) / 1024 )) MiB of 64"
cat <<EOF

The call to make on the lent GPU machine (the device tool's run):
  {"command": "bash scripts/device_run.sh", "carry": ["$BUNDLE"], "timeout_s": $TIMEOUT_S}
Its report comes back under \$OUT: gpu_check.jsonl (a line per check as it finished), gpu_check.json (the
summary, when the run finished), gpu_check.log, train.log, env.txt. A run cut short: python
scripts/gpu_check.py --summarize <files_at>/gpu_check.jsonl. Then one rerun of what failed (the log's last
line names it), at once while the machine is still warm (30 s), else on a fresh one (4 minutes must be left):
  {"command": "DEVICE_TRAIN=0 bash scripts/device_run.sh --only NAMES --budget 100", "carry": ["$BUNDLE"],
   "timeout_s": 130}
EOF
