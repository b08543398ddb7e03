"""`dflash-top --once` on a finished run summarises the whole run, as `dflash stats` does, with the
final evaluation's time apart from the training shares (it would otherwise dilute every share)."""

from __future__ import annotations

import io
import json
from pathlib import Path

from dflash.telemetry.wire import protocol
from dflash.telemetry.wire.protocol import Bottleneck, Bye, CategoryStats, Event, Hello, Snapshot
from dflash_tui.headless import run_once

T0 = 1_800_000_000.0


def cat(total: float, share: float) -> CategoryStats:
    return CategoryStats(n=10, total=total, mean=total / 10, p50=total / 10, p95=total / 10, max=total / 10,
                         share=share)


def recording(path: Path) -> Path:
    """100 s of training (drafter-0 60 % forward, target-0 50 % waiting on the full queue), then a
    100 s final evaluation on the drafter's thread: whole-life shares are halved for drafter-0."""
    train = Bottleneck(verdict="drafter-bound", reason="targets block", evidence={"target.hs_queue_put": 0.5})
    paused = Bottleneck(verdict="unknown", reason="too little timed work")
    window = {"drafter-0": {"drafter_forward": cat(0.6, 0.6)}, "target-0": {"hs_queue_put": cat(0.5, 0.5)}}
    frames = [Hello(proto=protocol.PROTO, run="r", pid=1, host="h", started=T0)]
    frames.append(Snapshot(seq=1, t=T0 + 100, interval_s=1.0, workers=window, bottleneck=train,
                           counters={"tokens": 250_000.0},
                           gauges={"step": 100.0, "max_steps": 100.0, "progress": 1.0},
                           cumulative={"drafter-0": {"drafter_forward": cat(60.0, 0.6)},
                                       "target-0": {"hs_queue_put": cat(50.0, 0.5)}}))
    frames.append(Event(t=T0 + 100, kind="phase", message="final evaluation: 2 prompts"))
    frames.append(Snapshot(seq=2, t=T0 + 200, interval_s=1.0, workers={"drafter-0": {"eval": cat(1.0, 1.0)}},
                           bottleneck=paused, gauges={"step": 100.0, "eval_done": 2.0, "eval_total": 2.0},
                           counters={"tokens": 250_000.0},
                           cumulative={"drafter-0": {"drafter_forward": cat(60.0, 0.3), "eval": cat(100.0, 0.5)},
                                       "target-0": {"hs_queue_put": cat(50.0, 0.25)}}))
    frames.append(Bye(t=T0 + 200, reason="exit"))
    path.write_bytes(b"".join(protocol.encode(f) for f in frames))
    return path


def test_once_on_a_finished_run_summarises_it_whole_with_evaluation_apart(tmp_path):
    rec = recording(tmp_path / "telemetry.jsonl")
    out = io.StringIO()
    assert run_once(str(rec), as_json=True, out=out) == 0
    s = json.loads(out.getvalue())
    assert s["scope"] == "whole run" and s["evaluation_s"] == 100.0
    assert s["workers"]["drafter-0"]["drafter_forward"]["share"] == 0.6  # of the 100 s of training
    assert s["workers"]["target-0"]["hs_queue_put"]["share"] == 0.5
    assert "eval" not in s["workers"]["drafter-0"]
    assert s["bottleneck"]["verdict"] == "drafter-bound"  # judged on training, not on the eval pause
    text = io.StringIO()
    assert run_once(str(rec), as_json=False, out=text) == 0
    assert "whole run; evaluation 1:40 (training paused, not in the shares)" in text.getvalue()


def test_dflash_stats_agrees(tmp_path, capsys):
    from dflash.cli import main

    rec = recording(tmp_path / "telemetry.jsonl")
    assert main(["stats", str(rec), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["evaluation_s"] == 100.0 and "eval" not in s["workers"]["drafter-0"]
    assert s["workers"]["drafter-0"]["drafter_forward"]["share"] == 0.6
    # 250,000 tokens in 100 s of training: the 100 s evaluation is not in the rate either
    assert s["rates"]["tokens"] == 2500.0
    assert main(["stats", str(rec)]) == 0
    assert "evaluation: " in capsys.readouterr().out
