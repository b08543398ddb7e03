#!/usr/bin/env bash
# On the lent GPU machine: install the carried wheels (.device-bundle/, from scripts/device_bundle.sh;
# no registry is reachable there) into a target directory, put it and this checkout on PYTHONPATH, run
# scripts/gpu_check.py with its report under $OUT, then start `dflash train` for 3 steps under the same
# software. scripts/device_bundle.sh prints the call; scripts/device_dryrun.sh runs this same script on
# CPU in a copy of the machine's software.
#
#   bash scripts/device_run.sh [gpu_check options: --only a,b --budget S --cpu-smoke --isolate]
#
# PYTHON (default python3: the machine's, which holds torch), DEVICE_SITE (default /tmp/dflash-site) and
# TRAIN_TIMEOUT (default 45 s) are for the dry run; DEVICE_TRAIN=0 skips the train start. Exit status:
# gpu_check's.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ -z "${OUT:-}" ]; then
    echo "device_run: OUT must name the folder the report goes to (the lent machine sets it)" >&2
    exit 2
fi
PY=${PYTHON:-python3}
SITE=${DEVICE_SITE:-/tmp/dflash-site}
CACHE=${SITE%/*}/dflash-inductor  # the check's compiled kernels, which the train start then loads
export PYTHONUNBUFFERED=1 PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        .device-bundle/*.whl; then
    echo "device_run: the bundle did not install: run scripts/device_bundle.sh and carry .device-bundle" >&2
    exit 3
fi
{
    "$PY" -c 'import sys, torch, transformers, triton, msgspec
print(f"python {sys.version.split()[0]} ({sys.executable}), torch {torch.__version__}, "
      f"transformers {transformers.__version__}, triton {triton.__version__}, msgspec {msgspec.__version__}")'
    du -sk .device-bundle | cut -f1 | sed 's/$/ KiB of wheels carried/'
    if command -v nvidia-smi > /dev/null; then nvidia-smi -L; else echo "no nvidia-smi here"; fi
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

"$PY" scripts/gpu_check.py --jsonl "$OUT/gpu_check.jsonl" --json "$OUT/gpu_check.json" \
    --cache-dir "$CACHE" "$@" 2>&1 | tee "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}

# The trainer's own start under this software (its torch version gate, the CLI, a few real steps); the
# built-in tiny target and demo data, no evaluation. DEVICE_TRAIN=0 leaves it out (a rerun of checks).
if [ "${DEVICE_TRAIN:-1}" != 0 ]; then
    SECONDS=0
    TORCHINDUCTOR_CACHE_DIR=$CACHE timeout "${TRAIN_TIMEOUT:-45}" "$PY" -m dflash.cli train --target tiny \
        --data demo --max-steps 3 --eval-prompts 0 --run-dir "$(mktemp -d)/train" > "$OUT/train.log" 2>&1
    train_rc=$?
    echo "device_run: dflash train --max-steps 3: exit $train_rc in $SECONDS s;" \
         "$(grep -E '^done:|error' "$OUT/train.log" | tail -n 1)"
fi
exit "$rc"
