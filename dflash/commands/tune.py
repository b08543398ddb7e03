"""`dflash tune [train flags]`: short `dflash train` trials of the same run, each changing only settings that
leave the training math alone, the next chosen by the last one's bottleneck verdict (docs/tune.md)."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from dflash.commands import CliError
from dflash.telemetry.wire.sockets import pid_alive

#: the table's name in the tune directory, and the best settings' file beside it
BEST_NAME = "best.toml"


def add_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--config", type=Path, help="TOML file with the run's training settings, as `dflash train --config`")
    a("--tune-dir", type=Path, help="where the table (tune.json), each trial's run directory and best.toml go "
                                    "(default: runs/tune-<date>-<time>)")
    a("--trials", type=int, default=8, metavar="N", help="trials at most, the starting point included (default 8)")
    a("--budget", type=float, metavar="S", help="seconds the whole tune may take; no trial starts that would "
                                                 "end past it (default: no limit)")
    a("--trial-time", type=float, default=30.0, metavar="S",
      help="seconds each trial trains (its --max-time; default 30): long enough for a steady verdict")
    a("--patience", type=int, default=1, metavar="N",
      help="trials in a row that gain less than their noise before the tune stops (default 1)")
    a("--resume", action="store_true", help="continue the tune in --tune-dir from its table")
    from dflash.train.config.schema import add_flags

    add_flags(p)  # the run's own settings, as `dflash train` takes them


def _check(args: argparse.Namespace) -> None:
    if args.trials < 1:
        raise CliError(f"--trials must be at least 1, got {args.trials}")
    if args.trial_time <= 0:
        raise CliError(f"--trial-time must be positive seconds, got {args.trial_time:g}")
    if args.budget is not None and args.budget <= 0:
        raise CliError(f"--budget must be positive seconds, got {args.budget:g}")
    if args.patience < 1:
        raise CliError(f"--patience must be at least 1, got {args.patience}")
    if args.run_dir is not None:
        raise CliError("--run-dir: each trial gets its own run directory under --tune-dir; give --tune-dir")
    if args.resume and args.tune_dir is None:
        raise CliError("--resume needs --tune-dir: the tune directory to continue")


def _user_values(args: argparse.Namespace) -> dict[str, Any]:
    """The run as the user gave it, as flat settings: the recipe this machine runs without --config, the
    file, then the flags (what `dflash train` with the same flags would train)."""
    from dflash.train.config import ConfigError
    from dflash.train.config.recipes import hardware_recipe
    from dflash.train.config.schema import flag_values, load_toml

    try:
        values = {} if args.config else hardware_recipe(args.target)[0]
        if args.config is None and args.hidden_states is not None:
            values.pop("target_layer_ids", None)  # as `dflash train` does: a cache's taps are its own
        values.update(load_toml(args.config) if args.config else {})
    except ConfigError as e:
        raise CliError(str(e)) from None
    flags = {k: v for k, v in flag_values(args).items() if v is not None}
    from dflash.train.config.schema import LIMITS

    if flags.keys() & set(LIMITS):  # a limit given replaces the file's, as in `dflash train`
        values = {k: v for k, v in values.items() if k not in LIMITS}
    values.update(flags)
    values.pop("run_dir", None)
    return values


def _config(values: dict[str, Any]):
    """The run's checked config (a bad setting is one line here, before any trial starts)."""
    from dflash.train.config import ConfigError
    from dflash.train.config.schema import make_config

    try:
        return make_config(values, {}, None, file="the run's settings")
    except ConfigError as e:
        raise CliError(str(e)) from None


def _settings(values: dict[str, Any]) -> dict[str, Any]:
    from dflash.train.config.schema import SETTINGS
    from dflash.tune.knobs import KNOBS

    cfg = _config({**values, "max_time": 1.0})
    return {k: SETTINGS[k].get(cfg) for k in KNOBS}


def _machine():
    import torch

    from dflash.tune.knobs import Machine

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return Machine(cores=cores, gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0)


def _stop_leftover(table: dict[str, Any], tune_dir: Path) -> None:
    """A tune killed outright (SIGKILL) leaves its trial running until that trial's --max-time: a resumed
    tune ends it first, if that process is still the trial (its command line names the trial's run dir)."""
    running = table.get("running")
    if not running:
        return
    pid, run_dir = int(running["pid"]), str(running["run_dir"])
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return
    if run_dir.encode() in cmdline:
        print(f"dflash tune: ending trial {running['index']} (pid {pid}) left running by the killed tune", flush=True)
        try:
            os.killpg(pid, signal.SIGTERM)
        except OSError:
            return
        for _ in range(400):  # its checkpoint and socket close take a moment; then the group is gone
            if not pid_alive(pid):
                break
            time.sleep(0.05)
        else:
            os.killpg(pid, signal.SIGKILL)


def _terminate(signum: int, frame: Any) -> None:
    """SIGTERM/SIGHUP end the tune as Ctrl-C does: through the `finally` that stops the running trial."""
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    from dflash.train.config.recipes import fresh_run_dir
    from dflash.tune import table as T
    from dflash.tune.knobs import advice, best_of, choose, gained
    from dflash.tune.measure import MeasureError, measure
    from dflash.tune.trial import START_GRACE_S, Trial

    _check(args)
    tune_dir = Path(args.tune_dir or fresh_run_dir().replace("train-", "tune-"))
    path = tune_dir / T.TABLE_NAME
    if args.resume:
        try:
            table = T.load(path)
        except T.TableError as e:
            raise CliError(str(e)) from None
        given = sorted(k for k, v in vars(args).items() if k in table["values"] and v is not None)
        if args.config is not None or given:
            raise CliError("--resume continues with the run settings in the table; drop "
                           + ("--config" if args.config else "--" + given[0].replace("_", "-")))
        _stop_leftover(table, tune_dir)
        table["running"] = None
        table["stopped"] = None
        print(f"dflash tune: resuming {path}: {len(table['trials'])} trials done", flush=True)
    else:
        if path.exists():
            raise CliError(f"{path} exists: continue it with --resume, or give another --tune-dir")
        values = _user_values(args)
        table = {"format": T.FORMAT, "version": T.VERSION, "values": values, "start": _settings(values),
                 "trial_s": args.trial_time, "trials": [], "running": None, "stopped": None}
        tune_dir.mkdir(parents=True, exist_ok=True)
        T.save(path, table)
    values, start, trial_s = table["values"], table["start"], float(table["trial_s"])
    name = tune_dir.name
    machine = _machine()
    print(f"dflash tune: {tune_dir}: trials of {trial_s:g} s, at most {args.trials}; follow them with "
          f"`dflash-top {name}` (every trial runs as run {name!r})", flush=True)
    began = time.monotonic()
    old = {s: signal.signal(s, _terminate) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        while True:
            trials = table["trials"]
            decision = choose(start, trials, machine, patience=args.patience)
            stop = decision.stop
            if stop is None and len(trials) >= args.trials:
                stop = f"--trials {args.trials} reached"
            spent = time.monotonic() - began
            if stop is None and args.budget is not None and spent + trial_s > args.budget:
                stop = f"--budget {args.budget:g} s: {spent:.0f} s spent, a trial takes {trial_s:g} s more"
            if stop is not None:
                table["stopped"] = stop
                T.save(path, table)
                break
            n = len(trials) + 1
            run_dir = tune_dir / f"trial-{n:02d}"
            if run_dir.exists():  # a trial the killed tune did not finish: measured again from the start
                shutil.rmtree(run_dir)
            changes = " ".join(f"{k}={T.shown(v)}" for k, v in decision.changes.items()) or "the starting point"
            phase = f"tune {name}: trial {n} (at most {args.trials}): {changes}" + (
                f" ({decision.why})" if decision.changes else "")
            print(f"trial {n}: {changes}" + (f"  <- {decision.why}" if decision.changes else ""), flush=True)
            config = tune_dir / f"trial-{n:02d}.toml"
            trial_values = {k: v for k, v in {**values, **decision.settings}.items()
                            if k not in ("max_steps", "max_time", "epochs")}
            config.write_text(T.toml_text(trial_values, [f"dflash tune trial {n}: {changes}"]))
            t0 = time.monotonic()
            trial = Trial(config, run_dir, trial_s, name, phase, values.get("socket_dir"))
            table["running"] = {"index": n, "pid": trial.pid, "run_dir": str(run_dir)}
            T.save(path, table)
            try:
                rc = trial.wait(trial_s + START_GRACE_S)
            finally:
                trial.stop()
            record: dict[str, Any] = {"settings": decision.settings, "changes": decision.changes,
                                      "why": decision.why, "run_dir": str(run_dir), "pid": trial.pid,
                                      "wall_s": time.monotonic() - t0}
            try:
                if rc is None:
                    raise MeasureError(f"ran {trial_s + START_GRACE_S:g} s without ending")
                if rc != 0:
                    raise MeasureError(f"exit {rc}: {trial.log_tail()}")
                record.update(measure(run_dir / "telemetry.jsonl").to_dict(), status="ok")
            except MeasureError as e:
                record.update(status="failed", error=str(e))
            record["gained"] = gained(record, trials)
            trials.append(record)
            table["running"] = None
            T.save(path, table)
            if record["status"] == "ok":
                print(f"trial {n}: {record['tokens_per_s']:,.0f} +- {record['spread']:,.0f} tok/s, "
                      f"{record['verdict']}: {record['reason']}", flush=True)
            else:
                print(f"trial {n}: failed: {record['error']}", flush=True)
    except KeyboardInterrupt:
        print(f"dflash tune: stopped; the table keeps {len(table['trials'])} finished trials: "
              f"dflash tune --resume --tune-dir {tune_dir}", flush=True)
        return 130
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    _report(table, tune_dir, T, best_of, advice)
    return 0


def _report(table: dict[str, Any], tune_dir: Path, T: Any, best_of: Any, advice: Any) -> None:
    print()
    print(T.render(table))
    print(f"stopped: {table['stopped']}")
    best = best_of(table["trials"])
    if best is None:
        return
    print()
    print("\n".join(T.gain_lines(table)))
    values = {**table["values"], **best["settings"]}
    n = table["trials"].index(best) + 1
    T.save(tune_dir / T.TABLE_NAME, table)
    (tune_dir / BEST_NAME).write_text(T.toml_text(values, [
        f"dflash tune {tune_dir.name}: trial {n} of {len(table['trials'])}, {best['tokens_per_s']:,.0f} tok/s, "
        f"{best['verdict']}", "train with: dflash train --config <this file>"]))
    print(f"best settings: {tune_dir / BEST_NAME} (dflash train --config {tune_dir / BEST_NAME})")
    said = advice(best)
    if said:
        print(f"would help most, not tuned: {said}")
