"""The durable output of `dflash data regenerate`: finished rows appended and fsync'd as they complete,
keyed by their input line, so a job killed at any moment resumes without losing or repeating a row.

Files, beside `<out>`:

* `<out>` — one JSON row per line, in the shapes `dflash data prepare` reads, each with a `regen` object
  (`line`: the input line it answers; `finish`: each regenerated turn's finish reason; `cut`: whether
  --max-tokens cut one; `token_ids`: each turn's answer ids where the server returned them and the row's
  text is the whole answer, which `dflash data prepare` trains on in place of re-tokenizing). Appended in
  the order rows finish; sorted by input line once the job is complete.
* `<out>.errors.jsonl` — rows that failed (after their retries) or were malformed: `{"line", "reason"}`.
  They are not done: a `--resume` tries them again.
* `<out>.settings.json` — what produced the rows (data, shard, model, sampling, ...): `--resume` refuses
  to mix rows made under other settings.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from dflash.data.formats import REGEN_KEY, DataError

#: the key of the object each output row carries about how it was made (`dflash data prepare` reads its
#: token_ids)
META = REGEN_KEY


def errors_path(out: Path) -> Path:
    return out.with_name(out.name + ".errors.jsonl")


def settings_path(out: Path) -> Path:
    return out.with_name(out.name + ".settings.json")


def _fsync_append(path: Path, lines: Iterable[str]) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write("".join(lines))
        f.flush()
        os.fsync(f.fileno())


def read_done(out: Path) -> dict[int, str]:
    """Input line -> its finished output line, from an output file that a kill may have cut anywhere: a
    last line without its newline (a torn append) is cut off the file, as it was never finished."""
    done: dict[int, str] = {}
    if not out.exists():
        return done
    data = out.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep < len(data):
        with out.open("r+b") as f:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
    for n, raw in enumerate(data[:keep].decode("utf-8").splitlines(), 1):
        try:
            line = json.loads(raw)[META]["line"]
        except (ValueError, KeyError, TypeError):
            raise DataError(f"{out}:{n}: not a row `dflash data regenerate` wrote (no {META}.line); "
                            "choose another --out") from None
        done[int(line)] = raw
    return done


class RegenOutput:
    """Where finished rows go. Without `resume` an existing output is refused (nothing is overwritten);
    with it the rows already there are done, and those in the errors file get another try."""

    def __init__(self, out: Path, settings: dict, resume: bool) -> None:
        self.out, self.errors = out, errors_path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        old = settings_path(out)
        if not resume and (out.exists() or old.exists()):
            raise DataError(f"{out} exists: --resume to finish that job, or choose another --out")
        if resume and old.exists():
            before = json.loads(old.read_text(encoding="utf-8"))
            diff = sorted(k for k in set(before) | set(settings) if before.get(k) != settings.get(k))
            if diff:
                raise DataError(f"{out} was made with other settings ({', '.join(diff)} differ); resume with "
                                "the same ones or choose another --out")
        self.done = read_done(out) if resume else {}
        #: errors a previous run recorded (their rows are tried again now)
        self.earlier_errors = 0
        if self.errors.exists():
            self.earlier_errors = sum(1 for ln in self.errors.read_text(encoding="utf-8").splitlines() if ln.strip())
            self.errors.unlink()
        old.write_text(json.dumps(settings, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        self.written = 0
        self.failed = 0

    def append(self, rows: list[dict]) -> None:
        """Append finished rows and make them durable before returning: from now on they are done."""
        lines = [json.dumps(r, ensure_ascii=False) + "\n" for r in rows]
        _fsync_append(self.out, lines)
        for r, line in zip(rows, lines, strict=True):
            self.done[r[META]["line"]] = line.rstrip("\n")
        self.written += len(rows)

    def error(self, line: int, reason: str) -> None:
        _fsync_append(self.errors, [json.dumps({"line": line, "reason": reason}, ensure_ascii=False) + "\n"])
        self.failed += 1

    def finish(self) -> None:
        """Rewrite the output in input order (a complete job's file does not depend on which request
        answered first); atomic, so a kill during it leaves the appended file, which resumes."""
        _write_sorted(self.out, self.done)


def _write_sorted(out: Path, rows: dict[int, str]) -> None:
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write("".join(rows[k] + "\n" for k in sorted(rows)))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(out)


def merge(parts: list[Path], out: Path) -> int:
    """Join the outputs of `--shard K/N` jobs into one file in input order; refuses parts made from other
    data or settings, rows answered twice, and a part whose job did not finish (errors left)."""
    if out.exists():
        raise DataError(f"{out} exists: choose another output for the merge")
    rows: dict[int, str] = {}
    common: dict | None = None
    for part in parts:
        if not part.is_file():
            raise DataError(f"{part}: no such regenerated file")
        s = settings_path(part)
        if not s.exists():
            raise DataError(f"{part}: no {s.name} beside it: not the output of `dflash data regenerate`")
        settings = {k: v for k, v in json.loads(s.read_text(encoding="utf-8")).items() if k != "shard"}
        if common is not None and settings != common:
            diff = sorted(k for k in set(common) | set(settings) if common.get(k) != settings.get(k))
            raise DataError(f"{part}: made with other settings than {parts[0]} ({', '.join(diff)} differ)")
        common = settings
        if errors_path(part).exists() and errors_path(part).stat().st_size:
            raise DataError(f"{part}: its job left failed rows in {errors_path(part).name}; --resume it first")
        for line, raw in read_done(part).items():
            if line in rows:
                raise DataError(f"{part}: input line {line} is in another part too (overlapping shards)")
            rows[line] = raw
    _write_sorted(out, rows)
    return len(rows)
