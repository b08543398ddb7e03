"""`dflash data prepare`: tokenize a JSONL data set once, in shards, into a token store (dflash/data/store.py).

The source is cut into shards of ``shard_rows`` lines (by byte ranges, found in one pass over the file);
each shard is encoded by one worker process, which writes the shard's three files and then renames its
marker into place: a shard with a marker is whole, one without is done again. A killed prepare resumes
from its whole shards; the manifest, written last by a rename, is what makes the store complete.

Only one process prepares a store: it holds an exclusive lock on ``.lock`` in the store directory (an
OS lock, released when the process dies, so a killed preparer never blocks the next one). Others — the
other ranks of a torchrun job — wait for the manifest, and take over if the lock frees without one.

Row policy at scale: a row that does not encode (malformed JSON, no assistant turn, a template that fails)
is skipped and counted by reason, with its first few line numbers, in the manifest and in one summary
line; zero usable rows is an error. A regenerated row's answers are stored as the server's token ids where
they match its text; rows whose ids disagree with it are trained from the text and counted, with their first
line numbers, in the same line (never silently: ids that do not decode to a row's text mean the file was
edited or the server's tokenizer is not the target's).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dflash.data.formats import DataError, Sample, carries_reasoning, encode_row, thinking_mismatch
from dflash.data.store import (
    FORMAT,
    ID_DTYPE,
    MANIFEST,
    MASK_DTYPE,
    ROW_COLUMNS,
    ROW_DTYPE,
    VERSION,
    Stamp,
    StoreError,
    TokenStore,
    is_store,
    read_json_bounded,
    shard_paths,
    template_fingerprint,
    tokenizer_fingerprint,
    write_atomic,
)

DEFAULT_SHARD_ROWS = 10_000
#: line numbers kept per skip reason (the count is kept whole)
FIRST_LINES = 5
#: reasons kept per shard: a file with a thousand kinds of broken row needs fixing, not a longer list
MAX_REASONS = 50
#: a source smaller than this is prepared in the calling process: a worker pool's start (each worker
#: imports transformers and loads the tokenizer, seconds) costs more than it saves
IN_PROCESS_BYTES = 4 << 20
#: how long a process waits for another to finish preparing the store it needs
WAIT_TIMEOUT_S = 6 * 3600.0


def default_workers() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


# --- encoding: the one place rows become samples ------------------------------------------------------


def encode(row: dict, tokenizer: Any, where: str, thinking: str) -> Sample:
    """One row as the store keeps it. Every row of every store is encoded here, so how rows are rendered
    (the thinking mode among it) is decided in one place."""
    return encode_row(row, tokenizer, where, thinking)


def _reason(e: BaseException, where: str) -> str:
    """A skip reason without the row's place (so equal faults group), one line, bounded."""
    text = str(e).removeprefix(f"{where}: ").splitlines()[0] if str(e) else type(e).__name__
    if not isinstance(e, DataError):
        text = f"{type(e).__name__}: {text}"
    return text[:120]


@dataclass(frozen=True)
class ShardTask:
    """Shard ``index``: lines ``first_line``.. of the source, bytes ``start``..``end``."""

    index: int
    start: int
    end: int
    first_line: int


def plan_shards(path: Path, shard_rows: int) -> list[ShardTask]:
    """Byte ranges of ``shard_rows`` lines each (blank lines count: line numbers stay the file's)."""
    tasks, start, line, pos = [], 0, 1, 0
    with path.open("rb") as f:
        for n, raw in enumerate(f):
            if n and n % shard_rows == 0:
                tasks.append(ShardTask(len(tasks), start, pos, line))
                start, line = pos, n + 1
            pos += len(raw)
    if pos > start:
        tasks.append(ShardTask(len(tasks), start, pos, line))
    return tasks


def encode_shard(task: ShardTask, source: Path, root: Path, tokenizer: Any, thinking: str,
                 max_seq_len: int) -> dict:
    """Encode one shard and write its files, then its marker (the marker last: it says the files are whole).
    Returns the marker."""
    ids_parts, mask_parts, table = [], [], []
    skipped: dict[str, dict] = {}
    offset = supervised = cut_supervised = cut_rows = reasoning = server_ids = 0
    fallback: dict = {"count": 0, "lines": [], "reason": ""}
    with source.open("rb") as f:
        f.seek(task.start)
        data = f.read(task.end - task.start)
    for k, raw in enumerate(data.splitlines()):
        line = task.first_line + k
        if not raw.strip():
            continue
        where = f"{source}:{line}"
        try:
            try:
                row = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise DataError(f"{where}: not valid JSON") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: not a JSON object")
            s = encode(row, tokenizer, where, thinking)
            reasoning += carries_reasoning(row)
            server_ids += s.server_ids
            if s.ids_fallback is not None:
                _note_fallback(fallback, line, s.ids_fallback)
        except Exception as e:  # noqa: BLE001 - any row that does not encode is skipped and counted
            reason = _reason(e, where)
            if reason in skipped or len(skipped) < MAX_REASONS:
                entry = skipped.setdefault(reason, {"count": 0, "lines": []})
            else:
                entry = skipped.setdefault("other reasons", {"count": 0, "lines": []})
            entry["count"] += 1
            if len(entry["lines"]) < FIRST_LINES:
                entry["lines"].append(line)
            continue
        full_ids = np.asarray(s.input_ids, dtype=ID_DTYPE)
        full_mask = np.asarray(s.loss_mask, dtype=MASK_DTYPE)
        ids, mask = full_ids[:max_seq_len], full_mask[:max_seq_len]
        sup, full_sup = int(mask.sum(dtype=np.int64)), int(full_mask.sum(dtype=np.int64))
        table.append((offset, len(ids), sup, len(full_ids), full_sup, line))
        ids_parts.append(ids)
        mask_parts.append(mask)
        offset += len(ids)
        supervised += full_sup
        cut_supervised += full_sup - sup
        cut_rows += len(full_ids) > max_seq_len
    p = shard_paths(root, task.index)
    arrays = {"ids": np.concatenate(ids_parts) if ids_parts else np.zeros(0, ID_DTYPE),
              "mask": np.concatenate(mask_parts) if mask_parts else np.zeros(0, MASK_DTYPE),
              "rows": np.asarray(table, dtype=ROW_DTYPE).reshape(len(table), len(ROW_COLUMNS))}
    for kind, arr in arrays.items():
        tmp = p[kind].with_name(f".{p[kind].name}.tmp")
        with tmp.open("wb") as out:
            arr.tofile(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, p[kind])
    marker = {"index": task.index, "start": task.start, "end": task.end, "first_line": task.first_line,
              "rows": len(table), "tokens": offset, "supervised": supervised, "cut_rows": cut_rows,
              "cut_supervised": cut_supervised, "reasoning": reasoning, "server_ids": server_ids,
              "ids_fallback": fallback, "skipped": skipped}
    write_atomic(p["json"], json.dumps(marker))
    return marker


def _note_fallback(into: dict, line: int, reason: str) -> None:
    """Count a row whose token ids were not used: its line among the first few, the first reason kept."""
    into["count"] += 1
    if len(into["lines"]) < FIRST_LINES:
        into["lines"].append(line)
    into["reason"] = into["reason"] or reason


def whole_shard(root: Path, task: ShardTask) -> dict | None:
    """The marker of shard ``task`` when it is whole for this plan (None: do it again)."""
    p = shard_paths(root, task.index)
    if not p["json"].is_file():
        return None
    try:
        m = read_json_bounded(p["json"], 1 << 20, "a shard marker")
    except StoreError:
        return None
    if not isinstance(m, dict) or (m.get("start"), m.get("end"), m.get("first_line")) != \
            (task.start, task.end, task.first_line):
        return None
    try:
        sizes = {k: p[k].stat().st_size for k in ("ids", "mask", "rows")}
    except OSError:
        return None
    want = {"ids": m["tokens"] * ID_DTYPE.itemsize, "mask": m["tokens"],
            "rows": m["rows"] * len(ROW_COLUMNS) * ROW_DTYPE.itemsize}
    return m if sizes == want else None


# --- the worker pool ------------------------------------------------------------------------------------

_WORKER: dict[str, Any] = {}


def _worker_init(tokenizer_dir: str, fingerprint: str, source: str, root: str, thinking: str,
                 max_seq_len: int) -> None:
    """Each worker: one tokenizers thread and one torch thread (the pool is the parallelism; N workers
    each spawning a thread per core would oversubscribe the machine N times), then the tokenizer, once."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["OMP_NUM_THREADS"] = "1"
    from transformers import AutoTokenizer

    try:
        import torch  # transformers imports it when installed: its intra-op pool is sized here, not by default

        torch.set_num_threads(1)
    except ImportError:
        pass
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    if tokenizer_fingerprint(tok) != fingerprint:  # the copy must encode exactly as the original would
        raise StoreError(f"{tokenizer_dir}: the tokenizer saved for the workers does not load back the same")
    _WORKER.update(tokenizer=tok, source=Path(source), root=Path(root), thinking=thinking, max_seq_len=max_seq_len)


def _worker_shard(task: ShardTask) -> dict:
    w = _WORKER
    return encode_shard(task, w["source"], w["root"], w["tokenizer"], w["thinking"], w["max_seq_len"])


def _run_pool(todo: list[ShardTask], workers: int, tokenizer: Any, stamp: Stamp, source: Path,
              root: Path) -> Iterator[dict]:
    import multiprocessing

    tok_dir = root / ".tokenizer"
    tokenizer.save_pretrained(str(tok_dir))
    # spawn: a fork of a process that has torch (and maybe CUDA) up is not safe
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, _worker_init, (str(tok_dir), stamp.tokenizer, str(source), str(root), stamp.thinking,
                                           stamp.max_seq_len)) as pool:
        yield from pool.imap_unordered(_worker_shard, todo)


# --- preparing -------------------------------------------------------------------------------------------


@contextmanager
def store_lock(root: Path, wait: bool) -> Iterator[bool]:
    """Hold the store's lock while inside (True), or, when ``wait`` is false and another process holds
    it, do not (False). The OS drops the lock when its holder dies."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # closing drops the lock


def prepare(source: Path, tokenizer: Any, root: Path, *, max_seq_len: int, thinking: str = "auto",
            workers: int | None = None, shard_rows: int = DEFAULT_SHARD_ROWS, log: Callable[[str], None] = print,
            on_shard: Callable[[int], None] | None = None) -> dict:
    """Make ``root`` a complete store of ``source`` (resuming whatever whole shards it holds) and return its
    manifest. ``workers``: processes encoding shards (0: this process; None: min(cores, 8), or this process
    for a small source). ``on_shard(i)``: called after each shard is whole (progress; a test stops here)."""
    stamp = Stamp.of(tokenizer, thinking, max_seq_len, source)
    with store_lock(root, wait=False) as mine:
        if not mine:
            raise StoreError(f"{root}: another process is preparing this store; wait for it or stop it")
        return _prepare_locked(source, tokenizer, root, stamp, workers, shard_rows, log, on_shard)


def _prepare_locked(source: Path, tokenizer: Any, root: Path, stamp: Stamp, workers: int | None, shard_rows: int,
                    log: Callable[[str], None], on_shard: Callable[[int], None] | None) -> dict:
    if (root / MANIFEST).is_file():
        store = TokenStore(root)
        if store.stamp == stamp:
            return store.manifest
        raise StoreError(f"{root} holds a store of other data or settings; choose another directory or delete it")
    if shard_rows < 1:
        raise StoreError(f"--shard-rows must be at least 1, got {shard_rows}")
    started = time.monotonic()
    plan_path = root / "plan.json"
    plan = {"stamp_digest": stamp.digest(), "shard_rows": shard_rows}
    if plan_path.is_file():  # a resumed prepare keeps the plan its shards were cut by
        old = read_json_bounded(plan_path, 1 << 20, "the prepare plan")
        if isinstance(old, dict) and old.get("stamp_digest") == plan["stamp_digest"] and \
                isinstance(old.get("shard_rows"), int) and old["shard_rows"] >= 1:
            plan = old
        else:
            for stale in root.glob("shard-*"):  # shards of another source or plan: not ours to resume
                stale.unlink()
    write_atomic(plan_path, json.dumps(plan))
    tasks = plan_shards(source, plan["shard_rows"])
    markers: dict[int, dict] = {}
    for t in tasks:
        if (m := whole_shard(root, t)) is not None:
            markers[t.index] = m
    todo = [t for t in tasks if t.index not in markers]
    if workers is None:
        workers = 0 if source.stat().st_size < IN_PROCESS_BYTES else default_workers()
    workers = min(workers, len(todo))
    resumed = f", resuming with {len(markers)} whole" if markers else ""
    how = ("in this process" if workers == 0 else
           f"in {workers} worker processes, each with 1 torch thread and 1 tokenizers thread")
    log(f"prepare: {source} -> {root}: {len(tasks)} shards of {plan['shard_rows']:,} lines{resumed}; "
        f"encoding {len(todo)} {how}")
    done_rows, last_log = 0, time.monotonic()
    results = (_run_pool(todo, workers, tokenizer, stamp, source, root) if workers else
               (encode_shard(t, source, root, tokenizer, stamp.thinking, stamp.max_seq_len) for t in todo))
    for m in results:
        markers[m["index"]] = m
        done_rows += m["rows"]
        if on_shard is not None:
            on_shard(m["index"])
        if time.monotonic() - last_log > 10:
            last_log = time.monotonic()
            rate = done_rows / (last_log - started)
            log(f"prepare: {len(markers)}/{len(tasks)} shards, {done_rows:,} rows this run, {rate:,.0f} rows/s")
    manifest = _manifest(stamp, [markers[t.index] for t in tasks], time.monotonic() - started, workers)
    counts = manifest["counts"]
    if counts["rows"] == 0:
        raise StoreError(f"{source}: no usable rows ({_skips_text(counts['skipped'])})")
    write_atomic(root / MANIFEST, json.dumps(manifest, indent=1))  # last: the store is complete from here
    plan_path.unlink(missing_ok=True)
    shutil.rmtree(root / ".tokenizer", ignore_errors=True)
    log(summary_line(manifest))
    if warning := thinking_mismatch(counts["rows"], counts["reasoning"], stamp.thinking):
        log(f"prepare: warning: {warning}")
    return manifest


def _manifest(stamp: Stamp, markers: list[dict], seconds: float, workers: int) -> dict:
    skipped: dict[str, dict] = {}
    for m in markers:
        for reason, e in m["skipped"].items():
            into = skipped.setdefault(reason, {"count": 0, "lines": []})
            into["count"] += e["count"]
            into["lines"] = sorted(into["lines"] + e["lines"])[:FIRST_LINES]
    total = {k: sum(m.get(k, 0) for m in markers)
             for k in ("rows", "tokens", "supervised", "cut_rows", "cut_supervised", "reasoning", "server_ids")}
    fallback: dict = {"count": 0, "lines": [], "reason": ""}
    for m in markers:  # in shard order: the first lines and reason are the file's first
        f = m.get("ids_fallback") or {"count": 0, "lines": [], "reason": ""}
        fallback["count"] += f["count"]
        fallback["lines"] = (fallback["lines"] + f["lines"])[:FIRST_LINES]
        fallback["reason"] = fallback["reason"] or f["reason"]
    return {"format": FORMAT, "version": VERSION, "digest": stamp.digest(), "stamp": stamp.__dict__,
            "shards": [{"rows": m["rows"], "tokens": m["tokens"], "first_line": m["first_line"]} for m in markers],
            "counts": {**total, "ids_fallback": fallback,
                       "skipped": dict(sorted(skipped.items(), key=lambda kv: -kv[1]["count"]))},
            "seconds": round(seconds, 3), "workers": workers}


def _skips_text(skipped: dict) -> str:
    if not skipped:
        return "none skipped"
    parts = [f"{e['count']:,} {reason} (line{'s' if len(e['lines']) > 1 else ''} "
             f"{', '.join(map(str, e['lines']))}{', ...' if e['count'] > len(e['lines']) else ''})"
             for reason, e in list(skipped.items())[:3]]
    more = len(skipped) - 3
    return "skipped " + "; ".join(parts) + (f"; and {more} other reasons (manifest.json)" if more > 0 else "")


def summary_line(manifest: dict) -> str:
    """`prepare: 99,998 rows, 41.2M tokens (limit 3,072 cuts 120 rows, 0.8% of supervised tokens); skipped ...`"""
    c, limit = manifest["counts"], manifest["stamp"]["max_seq_len"]
    share = c["cut_supervised"] / c["supervised"] if c["supervised"] else 0.0
    rate = c["rows"] / manifest["seconds"] if manifest["seconds"] > 0 else 0.0
    return (f"prepare: {c['rows']:,} rows, {c['tokens']:,} tokens in {manifest['seconds']:.1f}s ({rate:,.0f} rows/s); "
            f"limit {limit:,} cuts {c['cut_rows']:,} rows and {share:.1%} of supervised tokens; "
            f"{c.get('reasoning', 0):,} rows carry reasoning (thinking {manifest['stamp']['thinking']}); "
            f"{_ids_text(c)}{_skips_text(c['skipped'])}")


def _ids_text(counts: dict) -> str:
    """What the summary says about regenerated rows' token ids: nothing for data without them."""
    used, f = counts.get("server_ids", 0), counts.get("ids_fallback") or {"count": 0}
    text = f"{used:,} rows take the server's token ids; " if used else ""
    if f["count"]:
        lines = ", ".join(map(str, f["lines"])) + (", ..." if f["count"] > len(f["lines"]) else "")
        text += (f"{f['count']:,} rows' token ids disagree with their text, re-tokenized instead (line"
                 f"{'s' if len(f['lines']) > 1 else ''} {lines}: {f['reason']}); ")
    return text


# --- finding or making the store a run reads -----------------------------------------------------------


def store_dir(source: Path, stamp: Stamp, run_dir: Path | None) -> Path:
    """Where the store of ``source`` under ``stamp`` lives: beside the data when its directory is writable
    (every later run with the same settings finds it there), else in the run directory."""
    if os.access(source.parent, os.W_OK):
        return source.parent / f"{source.name}.dflash-store" / stamp.digest()
    if run_dir is None:
        raise StoreError(f"{source.parent} is not writable and there is no run directory: prepare the store "
                         "with `dflash data prepare --out DIR` and train with --data DIR")
    return run_dir / "data-store" / stamp.digest()


def open_store(spec: str, tokenizer: Any, *, max_seq_len: int, min_loss_tokens: int, thinking: str = "auto",
               run_dir: Path | None = None, workers: int | None = None, log: Callable[[str], None] = print,
               timeout_s: float = WAIT_TIMEOUT_S) -> TokenStore:
    """The store a run trains on: ``spec`` itself when it is a store directory (checked against the run's
    tokenizer, template, thinking mode and length), else the store of the JSONL file (or `demo`) it names,
    prepared on first use by whichever process takes the lock while the others wait for it."""
    from dflash.data import resolve_data

    path = Path(spec)
    if spec != "demo" and is_store(path):
        store = TokenStore(path, max_len=max_seq_len, min_loss_tokens=min_loss_tokens)
        store.check_rendering(Stamp(tokenizer_fingerprint(tokenizer), template_fingerprint(tokenizer), thinking,
                                    max_seq_len, {}))
        return store
    source = resolve_data(spec)
    stamp = Stamp.of(tokenizer, thinking, max_seq_len, source)
    root = store_dir(source, stamp, run_dir)
    deadline, told = time.monotonic() + timeout_s, False
    while not (root / MANIFEST).is_file():
        with store_lock(root, wait=False) as mine:
            if mine:  # ours to prepare (or to finish: the process that held the lock died)
                _prepare_locked(source, tokenizer, root, stamp, 0 if spec == "demo" else workers,
                                DEFAULT_SHARD_ROWS, log, None)
                break
        if not told:
            log(f"data: waiting for another process to prepare {root}")
            told = True
        if time.monotonic() > deadline:
            raise StoreError(f"{root}: still not prepared after {timeout_s:.0f}s of waiting for the process that "
                             "holds its lock; stop it, or prepare the store with `dflash data prepare`")
        time.sleep(0.2)  # a file another process will write: no event crosses processes to wait on instead
    store = TokenStore(root, max_len=max_seq_len, min_loss_tokens=min_loss_tokens)
    store.check_rendering(stamp)
    return store


