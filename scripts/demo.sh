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
    # already inside tmux: a window of this session rather than a nested session. A second `make demo`
    # goes to the window the first one opened (its trainer may still run) instead of starting another.
    # windows by id: a bare name would pick a session of that name first
    win=""
    while read -r name id; do
        if [ "$name" = "$SESSION" ]; then win=$id; fi
    done < <(tmux list-windows -F '#{window_name} #{window_id}')
    if [ -n "$win" ]; then
        echo "a $SESSION window is already open in this tmux session; switching to it (close it, then make demo, to start a new run)"
        tmux select-window -t "$win"
        exit 0
    fi
    win=$(tmux new-window -P -F '#{window_id}' -n "$SESSION" "$TRAIN_PANE")
    tmux split-window "${split[@]}" -t "$win" "$TOP_PANE"
    echo "demo started in tmux window $SESSION: the trainer (run dir $RUN_DIR) and dflash-top"
    exit 0
fi

if tmux has-session -t "$SESSION" 2>/dev/null; then
    # one demo at a time: its trainer may still run, and a second would share the machine with it
    if [ "${DEMO_DETACHED:-0}" = 1 ]; then
        echo "a $SESSION tmux session is already open; not starting another (tmux attach -t $SESSION to watch it; tmux kill-session -t $SESSION, then make demo, to start a new run)"
        exit 0
    fi
    echo "a $SESSION tmux session is already open; attaching to it (tmux kill-session -t $SESSION, then make demo, starts a new run)"
    exec tmux attach -t "$SESSION"
fi
tmux new-session -d -s "$SESSION" -x "$cols" -y "$(tput lines 2>/dev/null || echo 24)" "$TRAIN_PANE"
tmux split-window "${split[@]}" -t "$SESSION" "$TOP_PANE"
tmux select-pane -t "$SESSION" -D 2>/dev/null || true
if [ "${DEMO_DETACHED:-0}" = 1 ]; then
    echo "tmux session $SESSION started: the trainer (run dir $RUN_DIR) and dflash-top (tmux attach -t $SESSION)"
else
    exec tmux attach -t "$SESSION"
fi
