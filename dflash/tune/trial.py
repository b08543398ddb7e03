"""One trial: a real `dflash train` run in a subprocess of its own session, stopped and cleaned up whatever
happens to the tune.

The child gets its own process group so that a signal meant for the tune (Ctrl-C in the terminal) does not
reach it twice, and so that the tune can end it and every thread or process it started with one signal.
It is asked to stop with SIGTERM (the trainer checkpoints, closes its socket and exits), then killed; a
socket file a killed trainer leaves behind is removed here, so no trial outlives the tune in any form.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from dflash.telemetry.wire.sockets import default_socket_dir, parse_socket_filename, pid_alive, private_socket_dir
from dflash.train.reporting import PHASE_ENV

#: seconds a trial may take beyond its --max-time (start-up: loading the target, the token store) before
#: it counts as hung
START_GRACE_S = 180.0
#: seconds SIGTERM gets before SIGKILL (the trainer finishes its checkpoint and closes its socket)
TERM_GRACE_S = 20.0


class Trial:
    """A running `dflash train` child; `stop()` ends it (idempotent), `wait()` lets it finish."""

    def __init__(self, config: Path, run_dir: Path, trial_s: float, run_name: str, phase: str,
                 socket_dir: str | None) -> None:
        self.run_dir, self.run_name = run_dir, run_name
        self.socket_dir = private_socket_dir(Path(socket_dir) if socket_dir else default_socket_dir())
        cmd = [sys.executable, "-m", "dflash", "train", "--config", str(config), "--run-dir", str(run_dir),
               "--max-time", f"{trial_s:g}", "--run-name", run_name,
               # a trial measures training: no evaluation pauses it, and none runs at its end
               "--eval-prompts", "0", "--eval-every", "0"]
        run_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = run_dir.parent / f"{run_dir.name}.log"
        self._log = self.log_path.open("ab")
        # the trial's thread counts are its own settings (threads_per_worker); OMP_NUM_THREADS, where the
        # user set it, passes through as for any `dflash train`
        env = {**os.environ, PHASE_ENV: phase}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait(self, timeout: float) -> int | None:
        """The exit code, or None when it ran past `timeout` seconds (then it is still running)."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        """End the trial's whole process group (SIGTERM, then SIGKILL) and remove its socket file."""
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            if self.wait(TERM_GRACE_S) is None:
                self._signal(signal.SIGKILL)
                self.proc.wait()
        # anything else in its group (a torchrun child) goes with it
        self._signal(signal.SIGKILL)
        self._log.close()
        for sock in self.sockets():
            sock.unlink(missing_ok=True)

    def sockets(self) -> list[Path]:
        """The trial's socket files still on disk once its process is gone."""
        try:
            entries = list(self.socket_dir.iterdir())
        except OSError:
            return []
        out = []
        for p in entries:
            info = parse_socket_filename(p.name)
            if info is not None and info.pid == self.pid and not pid_alive(self.pid):
                out.append(p)
        return out

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def log_tail(self, lines: int = 3) -> str:
        """The last lines the trial wrote (why it failed), one line."""
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(text[-lines:])
