#!/usr/bin/env bash
# The suite's claim that it passes on a slow or busy machine, tested: run pytest (whatever arguments
# follow) ROUNDS times beside HOGS processes that each keep a core busy, and say how many rounds failed.
#
#   ROUNDS=10 HOGS=2 bash scripts/under_load.sh tests/test_tui_*.py   # the TUI tests, ten times
#   ROUNDS=1 HOGS=2 bash scripts/under_load.sh                        # the whole suite, once
#
# The hogs are plain busy loops (no I/O, no memory): they take CPU from the tests the way a second job on
# a 2-core machine does. A round's pytest output goes to $LOG_DIR/round-N.txt; the summary line of each
# is printed as it ends. Exit status: the number of failed rounds (0: all passed).
set -uo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-10}
HOGS=${HOGS:-2}
LOG_DIR=${LOG_DIR:-$(mktemp -d -t dflash-under-load-XXXX)}
mkdir -p "$LOG_DIR"

hogs=()
for _ in $(seq "$HOGS"); do
    python3 -c 'while True: pass' &
    hogs+=($!)
done
trap 'kill "${hogs[@]}" 2>/dev/null' EXIT

failed=0
for r in $(seq "$ROUNDS"); do
    start=$(date +%s)
    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -p no:cacheprovider "$@" > "$LOG_DIR/round-$r.txt" 2>&1
    rc=$?
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
    echo "round $r/$ROUNDS beside $HOGS hogs: rc $rc in $(( $(date +%s) - start )) s, load $(cut -d' ' -f1-3 /proc/loadavg): $(tail -n 1 "$LOG_DIR/round-$r.txt")"
done
echo "$failed of $ROUNDS rounds failed beside $HOGS hogs; logs in $LOG_DIR"
exit "$failed"
