#!/usr/bin/env bash
# The lent GPU machine's call, dry, on CPU: scripts/device_run.sh (the command the call makes there)
# in a simulated device environment -- a Python 3.12 venv holding only the image's versions of what
# dflash imports (the first block of scripts/device_image.txt; no msgspec), the bundle made by
# scripts/device_bundle.sh and installed the way the command installs it, $OUT a fresh folder -- with
# gpu_check's --cpu-smoke and its forked children (--isolate), as on CUDA. Anyone can repeat it before
# a GPU is lent:
#
#   bash scripts/device_dryrun.sh      # or: make device-dryrun (~10 min on 2 busy cores; first run
#                                      # also installs torch 2.11, ~1 GB with its CUDA libraries)
#
# The venv is .compat/device-sim/ (ignored, reused); the returned files land in .compat/device-dryrun/.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_python312.sh

VENV=.compat/device-sim
if [ ! -f "$VENV/.installed" ]; then
    test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"  # (a venv left half-made is completed)
    "$VENV/bin/pip" install -q --upgrade pip
    sed -e '/^# the rest of the image/q' scripts/device_image.txt | grep -v '^#' > "$VENV/image.txt"
    "$VENV/bin/pip" install -q -r "$VENV/image.txt"
    touch "$VENV/.installed"
fi
if "$VENV/bin/python" -c 'import msgspec' 2>/dev/null; then
    echo "device_dryrun: $VENV has msgspec, which the image lacks: remove $VENV and run again" >&2
    exit 1
fi

bash scripts/device_bundle.sh

OUT_DIR=.compat/device-dryrun
rm -rf "$OUT_DIR"
mkdir -p "$OUT_DIR"
site=$(mktemp -d)
echo
echo "device_dryrun: bash scripts/device_run.sh --cpu-smoke --isolate --budget 1800, in $VENV"
# --budget: the CPU smoke's time limits are the GPU's times SMOKE_SLACK; TRAIN_TIMEOUT: CPU steps
set +e
OUT=$OUT_DIR PYTHON=$VENV/bin/python DEVICE_SITE=$site/site TRAIN_TIMEOUT=600 OMP_NUM_THREADS=1 \
    nice -n 10 bash scripts/device_run.sh --cpu-smoke --isolate --budget 1800
rc=$?
set -e
rm -rf "$site"
"$VENV/bin/python" - "$OUT_DIR" <<'EOF'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
report = json.loads((out / "gpu_check.json").read_text())
versions = f"torch {report['torch']}, transformers {report['transformers']}, Python {report['python']}"
print(f"device_dryrun: {report['mode']} under {versions}; imports once: {report['warmup_s']} s")
for name, r in report["checks"].items():
    print(f"  {name:<17} {r['status']}")
counts = ", ".join(f"{n} {status}" for status, n in report["counts"].items())
print(f"device_dryrun: {counts} in {report['wall_s']} s")
EOF
echo "device_dryrun: gpu_check exit $rc; files in $OUT_DIR: $(ls "$OUT_DIR" | tr '\n' ' ')"
exit "$rc"
