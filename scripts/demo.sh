#!/usr/bin/env bash
# `make demo`: a tiny DFlash training run and dflash-top watching it, side by side in tmux.
#
# dflash-top is started with --wait on the run directory, so it attaches as soon as the trainer's
# socket appears (and never replays an old recording of the same directory by mistake).
# Without tmux it prints the two commands to run in two terminals.
#
# Environment: RUN_DIR (default a fresh runs/demo-<date>-<time>), TRAIN_ARGS (extra `dflash train` arguments),
# DEMO_DETACHED=1 (create the tmux session without attaching: for scripts and checks).
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=.venv/bin
# a fresh run directory each time: a second demo must not find the first one's checkpoints (the
# trainer would refuse them and dflash-top would wait for it forever)
if [ -z "${RUN_DIR:-}" ]; then
    RUN_DIR=runs/demo-$(date +%Y%m%d-%H%M%S)
    n=1
    while [ -e "$RUN_DIR" ]; do n=$((n + 1)); RUN_DIR=runs/demo-$(date +%Y%m%d-%H%M%S)-$n; done
fi
SESSION=dflash-demo
TRAIN="$BIN/dflash train --config configs/tiny-cpu.toml --run-dir $RUN_DIR ${TRAIN_ARGS:-}"
TOP="$BIN/dflash-top --wait $RUN_DIR"

if ! command -v tmux >/dev/null 2>&1; then
    cat <<EOF
tmux is not installed, so the demo cannot open its two panes for you.
Run these in two terminals (or two ssh sessions) from $(pwd):

  1) the trainer:   $TRAIN
  2) the live view: $TOP

(install tmux with: sudo apt-get install -y tmux, then run make demo again)
EOF
    exit 0
fi

# the trainer pane stays open after training ends, so its last log lines can be read
TRAIN_PANE="$TRAIN; echo; echo '[trainer exited: press enter to close this pane]'; read -r _"
TOP_PANE="$TOP"

# side by side when there is room for dflash-top's wide layout, else one above the other
cols=$(tput cols 2>/dev/null || echo 80)
if [ "$cols" -ge 200 ]; then split=(-h -p 60); else split=(-v -p 65); fi

if [ -n "${TMUX:-}" ]; then
    # already inside tmux: open a new window rather than nesting a session
    tmux new-window -n "$SESSION" "$TRAIN_PANE"
    tmux split-window "${split[@]}" -t "$SESSION" "$TOP_PANE"
    exit 0
fi

if tmux has-session -t "$SESSION" 2>/dev/null; then
    echo "a $SESSION tmux session is already open; attaching to it (tmux kill-session -t $SESSION, then make demo, starts a new run)"
else
    tmux new-session -d -s "$SESSION" -x "$cols" -y "$(tput lines 2>/dev/null || echo 24)" "$TRAIN_PANE"
    tmux split-window "${split[@]}" -t "$SESSION" "$TOP_PANE"
    tmux select-pane -t "$SESSION" -D 2>/dev/null || true
fi
if [ "${DEMO_DETACHED:-0}" = 1 ]; then
    echo "tmux session $SESSION started (tmux attach -t $SESSION)"
else
    exec tmux attach -t "$SESSION"
fi
