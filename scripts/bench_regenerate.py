"""Benchmark: `dflash data regenerate` through a server at concurrency 1, 8 and 32, against the in-process path.

The first ``--rows`` demo prompts are regenerated (``--max-tokens`` each, greedy) four ways in one run,
each a fresh `dflash data regenerate` process with one intra-op thread: in this process (the tiny target
from dflash/targets/tiny/, batched by length), and through `transformers serve` on the same target
(started here on 127.0.0.1, one thread, float32) at each concurrency. Reported: rows/s and tok/s of each,
the verdict dflash-top would show for the server runs (server-bound or client-bound, from the job's own
telemetry), and the foreign CPU load (another job on a 2-core machine halves every rate here).

On this CPU the server answers one request at a time (`transformers serve` without continuous
batching), so concurrency buys nothing here: the figures show the client's overhead against the
in-process path, not what vLLM or SGLang on a GPU give (docs/data.md has their commands).

With ``--endpoint URL`` the server runs elsewhere (already serving the tiny target, as the test suite's
does); ``--server_pid PID`` names its process, whose CPU is then not counted as foreign load.

    python scripts/bench_regenerate.py [--json] [--quick] [--rows 64] [--max-tokens 32] [--endpoint URL]
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from _bench import ForeignLoad, bench_args, print_report

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash.targets.tiny import TINY_DIR  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(tmp: Path) -> tuple[subprocess.Popen, str]:
    exe = shutil.which("transformers", path=str(Path(sys.executable).parent))
    if exe is None:
        raise SystemExit("transformers' CLI is not installed beside this interpreter")
    port = _port()
    proc = subprocess.Popen([exe, "serve", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype",
                             "float32", "--log-level", "warning", str(TINY_DIR)], env=ENV,
                            stdout=(tmp / "serve.log").open("w"), stderr=subprocess.STDOUT)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 180
    while True:
        try:
            if httpx.get(f"{url}/v1/models", timeout=1.0).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"transformers serve did not start: {(tmp / 'serve.log').read_text()[-1000:]}")
        time.sleep(0.2)


def _verdict(socket_dir: Path, proc: subprocess.Popen) -> str | None:
    """The verdict the job publishes, read off its telemetry socket near its end (None: none seen)."""
    from dflash.telemetry.wire.protocol import Snapshot, decode

    seen = None
    while proc.poll() is None:
        socks = list(socket_dir.glob("*.sock"))
        if not socks:
            time.sleep(0.05)
            continue
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(2.0)
                s.connect(str(socks[0]))
                buf = b""
                while proc.poll() is None:
                    chunk = s.recv(1 << 16)
                    if not chunk:
                        break
                    buf += chunk
                    *lines, buf = buf.split(b"\n")
                    for line in lines:
                        frame = decode(line)
                        if isinstance(frame, Snapshot) and frame.bottleneck is not None:
                            seen = frame.bottleneck.verdict
        except (OSError, ValueError):
            time.sleep(0.05)
    return seen


def _run(data: Path, out: Path, max_tokens: int, extra: list[str], tmp: Path) -> dict:
    sock = Path(tempfile.mkdtemp(prefix="rgb-"))
    cmd = [sys.executable, "-m", "dflash", "data", "regenerate", "--target", "tiny", "--data", str(data), "--out",
           str(out), "--max-tokens", str(max_tokens), "--log-every", "3600", "--socket-dir", str(sock), *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    verdict = _verdict(sock, proc) if "--endpoint" in extra else None
    _, err = proc.communicate()
    wall = time.perf_counter() - t0
    shutil.rmtree(sock, ignore_errors=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {err[-2000:]}")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TINY_DIR))
    tokens = sum(len(tok(r["response"], add_special_tokens=False)["input_ids"]) for r in rows)
    return {"rows_per_s": round(len(rows) / wall, 2), "tok_per_s": round(tokens / wall, 1), "wall_s": round(wall, 2),
            **({"verdict": verdict} if verdict else {})}


def main() -> None:
    args = bench_args(__doc__, {"rows": (64, "demo prompts regenerated"), "max_tokens": (32, "tokens per answer"),
                                "endpoint": ("", "a server already serving the tiny target ('': start one here)"),
                                "server_pid": (0, "that server's process id (0: unknown)")},
                      ("8 rows of 8 tokens: proves the script runs", {"rows": 8, "max_tokens": 8}))
    tmp = Path(tempfile.mkdtemp(prefix="bench-regen-"))
    demo = (ROOT / "dflash" / "data" / "demo.jsonl").read_text().splitlines()[:args.rows]
    data = tmp / "in.jsonl"
    data.write_text("\n".join(demo) + "\n")
    report: dict = {"rows": args.rows, "max_tokens": args.max_tokens}
    import psutil

    server, url = _serve(tmp) if not args.endpoint else (None, args.endpoint)
    pid = server.pid if server is not None else args.server_pid
    try:
        with ForeignLoad(*([psutil.Process(pid)] if pid else [])) as load:
            report["in_process"] = _run(data, tmp / "here.jsonl", args.max_tokens, ["--no-telemetry"], tmp)
            for c in (1, 8, 32):
                report[f"server_c{c}"] = _run(data, tmp / f"c{c}.jsonl", args.max_tokens,
                                              ["--endpoint", url, "--concurrency", str(c)], tmp)
    finally:
        if server is not None:
            server.kill()
            server.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    report["foreign_load_cores"] = round(load.cores, 2)
    report["busy_machine"] = load.cores > 0.3
    print_report(report, args.json)


if __name__ == "__main__":
    main()
