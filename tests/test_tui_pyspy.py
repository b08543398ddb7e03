"""Hot-thread snapshots with the real py-spy against a real child Python process.

CI runs as root, so py-spy may attach; the refused path is produced for real by running py-spy as
`nobody` (setpriv), and where even that is impossible the test is skipped rather than faked.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from dflash.telemetry.wire.protocol import Reply, stacks_of
from dflash_tui.pyspy import (
    PySpyError,
    find_pyspy,
    format_report,
    hot_thread_snapshot,
    pid_is_local,
    record,
    run_pyspy,
    save_report,
    trainer_threads,
)

CHILD = """
import threading, time
def hot_loop():
    x = 0
    while True:
        x += 1
def idle_loop():
    while True:
        time.sleep(0.05)
threading.Thread(target=hot_loop, name="hot-worker", daemon=True).start()
threading.Thread(target=idle_loop, name="idle-worker", daemon=True).start()
print("ready", flush=True)
time.sleep(120)
"""

PYSPY = find_pyspy()
pytestmark = pytest.mark.skipif(PYSPY is None, reason="py-spy is not installed")


@pytest.fixture
def child() -> Iterator[subprocess.Popen]:
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
    yield p
    p.kill()
    p.wait()


def thread_cpu(pid: int, dt: float = 0.4) -> tuple[dict[int, float], dict[int, str]]:
    """Per-thread CPU% measured like the trainer's sampler does (psutil, two samples)."""
    proc = psutil.Process(pid)
    a = {t.id: t.user_time + t.system_time for t in proc.threads()}
    time.sleep(dt)
    b = {t.id: t.user_time + t.system_time for t in proc.threads()}
    return {tid: 100 * (b[tid] - a.get(tid, 0.0)) / dt for tid in b}, {}


def script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def test_dump_joins_thread_cpu_hottest_first_and_saves(child: subprocess.Popen, tmp_path: Path) -> None:
    cpu, names = thread_cpu(child.pid)
    asked: list[str] = []

    def ask(op: str, args: dict) -> Reply:
        asked.append(op)
        return Reply(id=1, op=op, ok=True)

    report = hot_thread_snapshot(child.pid, local=True, ask=ask, cpu=cpu, names=names, exe=PYSPY, timeout=30)
    assert asked == ["ptrace_allow"], "the trainer is asked to allow ptrace before py-spy runs"
    assert report.source in ("py-spy --native", "py-spy")
    hottest = report.threads[0]
    assert hottest.name == "hot-worker", [(t.name, t.cpu_percent) for t in report.threads]
    assert hottest.cpu_percent is not None and hottest.cpu_percent > 10
    assert hottest.tid in cpu
    names_in_order = [f.name for f in hottest.frames]
    assert "hot_loop" in names_in_order
    # innermost last: the thread's entry point comes before the function that is running
    run = next(i for i, n in enumerate(names_in_order) if n.endswith("run"))
    assert run < names_in_order.index("hot_loop")
    cpus = [t.cpu_percent or 0.0 for t in report.threads]
    assert cpus == sorted(cpus, reverse=True)

    js, txt = save_report(report, str(tmp_path))
    assert js.parent == tmp_path / "pyspy" and js.suffix == ".json" and txt.suffix == ".txt"
    data = json.loads(js.read_text())
    assert data["threads"][0]["name"] == "hot-worker"
    text = txt.read_text()
    assert text.index("hot-worker") < text.index("idle-worker")
    assert "hot_loop" in format_report(report)


def test_native_failure_falls_back_to_a_python_only_dump(child: subprocess.Popen, tmp_path: Path) -> None:
    # py-spy whose native unwinder fails (as it does on some kernels/containers); the rest is real
    exe = script(tmp_path / "py-spy", 'for a in "$@"; do [ "$a" = --native ] && '
                 '{ echo "Error: Failed to get native stack traces: unsupported" >&2; exit 1; }; done\n'
                 f'exec {PYSPY} "$@"')
    cpu, names = thread_cpu(child.pid, 0.2)
    report = hot_thread_snapshot(child.pid, local=True, ask=None, cpu=cpu, names=names, exe=exe, timeout=30)
    assert report.source == "py-spy"
    assert any("native unwinding failed" in n for n in report.notes)
    assert report.threads[0].name == "hot-worker"


def test_refused_ptrace_is_explained_with_the_fix(child: subprocess.Popen, tmp_path: Path) -> None:
    setpriv = shutil.which("setpriv")
    if os.geteuid() == 0 and setpriv:
        # root may always attach; py-spy running as nobody is refused by the kernel, for real
        exe = script(tmp_path / "py-spy", f'exec {setpriv} --reuid=65534 --regid=65534 --clear-groups {PYSPY} "$@"')
    else:
        exe = PYSPY
        rc, _, _ = run_pyspy(exe, ["dump", "--pid", str(child.pid)], timeout=20)
        if rc == 0:
            pytest.skip("ptrace is permitted here and we cannot drop privileges")
    with pytest.raises(PySpyError) as err:
        hot_thread_snapshot(child.pid, local=True, ask=lambda op, a: Reply(id=1, op=op, ok=True), cpu={},
                            names={}, exe=exe, timeout=30)
    f = err.value.failure
    assert f.permission and f.can_ask_trainer
    assert "ptrace" in f.reason and "not permitted" in f.reason
    fixes = "\n".join(f.fix)
    assert "ptrace_scope" in fixes and "sudo" in fixes and "SYS_PTRACE" in fixes and "press t" in fixes


def test_stuck_pyspy_is_killed_on_timeout(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    exe = script(tmp_path / "stuck-py-spy", f"echo $$ > {pidfile}\nexec sleep 60")
    t0 = time.monotonic()
    with pytest.raises(PySpyError) as err:
        hot_thread_snapshot(os.getpid(), local=True, ask=None, cpu={}, names={}, exe=exe, timeout=1.0)
    assert time.monotonic() - t0 < 6
    assert "did not finish within 1 s and was killed" in err.value.failure.reason
    with pytest.raises(ProcessLookupError):
        os.kill(int(pidfile.read_text()), 0)


def test_remote_pid_uses_the_trainers_own_stacks() -> None:
    assert not pid_is_local(os.getpid(), "some-other-host")
    data = {"pid": 7, "threads": [{"tid": 11, "ident": 1, "name": "target-0", "frames": [
        {"file": "/x/pipeline.py", "line": 40, "function": "target_forward"},
        {"file": "/usr/lib/threading.py", "line": 982, "function": "run"}]},
        {"tid": 0, "name": "unknown-native", "frames": []}]}
    report = hot_thread_snapshot(7, local=False, ask=lambda op, a: Reply(id=1, op=op, ok=True, data=data),
                                 cpu={11: 97.0}, names={}, exe=None)
    assert report.source == "trainer stacks" and "not on this host" in report.notes[0]
    t = report.threads[0]
    assert t.cpu_percent == 97.0 and t.frames[-1].name == "target_forward"  # innermost last
    assert trainer_threads(stacks_of(Reply(id=1, op="stacks", ok=True, data=data)))[1].tid is None
    with pytest.raises(PySpyError, match="invalid stacks reply"):  # a malformed reply is one line
        hot_thread_snapshot(7, local=False, ask=lambda op, a: Reply(id=1, op=op, ok=True, data={"threads": 3}),
                            cpu={}, names={}, exe=None)


def test_record_saves_speedscope_and_ranks_functions(child: subprocess.Popen, tmp_path: Path) -> None:
    r = record(child.pid, 1.0, gil=False, native=False, exe=PYSPY, run_dir=str(tmp_path))
    assert Path(r.path).parent == tmp_path / "pyspy" and Path(r.path).exists()
    assert r.samples > 20
    assert r.top[0].name == "hot_loop", r.top[:3]
    assert r.top[0].self_samples <= r.top[0].total_samples <= r.samples
    assert any("hot-worker" in name for name in r.threads)


def test_record_summary_is_readable_python_first_natives_short_addresses_grouped(tmp_path: Path) -> None:
    """A speedscope file as `py-spy record --native` writes it: Python frames, C++ symbols with
    template and parameter lists, and raw addresses of libraries without symbols."""
    from dflash_tui.pyspy import RecordReport, parse_speedscope, short_native_name
    from dflash_tui.widgets.record import record_text

    frames = [
        {"name": "train_step", "file": "/app/dflash/train/run/stages.py", "line": 120},
        {"name": "at::native::(anonymous namespace)::cpu_kernel_vec<at::native::AddFunctor<float>, "
                 "at::vec::Vectorized<float> >(at::TensorIteratorBase&, float, float)", "file": "/x/libtorch_cpu.so"},
        {"name": "0x7f3a2b001234", "file": "/usr/lib/libcuda.so.1"},
        {"name": "0x7f3a2b009999", "file": "/usr/lib/libcuda.so.1"},
        {"name": "forward", "file": "/app/dflash/model/drafter.py", "line": 88},
    ]
    # root first: train_step -> forward -> kernel (self), and train_step -> two raw libcuda addresses
    samples = [[0, 4, 1]] * 5 + [[0, 2]] * 3 + [[0, 3]] * 2 + [[0, 4]] * 1
    path = tmp_path / "r.speedscope.json"
    path.write_text(json.dumps({"shared": {"frames": frames},
                                "profiles": [{"name": "drafter-0", "samples": samples}]}))
    top, n, threads = parse_speedscope(path)
    assert n == 11 and threads == {"drafter-0": 11}
    assert [f.python for f in top] == [True, True, False, False]  # Python first
    assert top[0].name == "forward" and top[0].where == "drafter.py:88" and top[0].self_samples == 1
    natives = {f.name: f for f in top if not f.python}
    assert natives["[libcuda.so.1] (no symbols)"].self_samples == 5  # two addresses, one library
    assert natives["native::cpu_kernel_vec<…>(…)"].where == "libtorch_cpu.so"
    assert short_native_name("std::vector<int, std::allocator<int> >::push_back(int const&)") == \
        "vector<…>::push_back(…)"
    text = record_text(RecordReport(pid=1, seconds=1, gil=False, native=True, path=str(path), samples=n,
                                    top=top, threads=threads)).plain
    assert text.index("Python functions") < text.index("native frames")
