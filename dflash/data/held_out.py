"""Rows held out of training for evaluation, and the record that keeps them out across resumes.

Evaluating on rows the drafter trained on measures memory, not drafting: the held-out rows are the eligible
ones of smallest hash of (row index, seed). Each row's hash is its own, the same on every machine and
whatever the other rows are: rows appended later may take some of the places, but never put back into
training an earlier row that was held out while pulling out another earlier one. A held-out
row's prompt is its tokens before its first supervised token: no re-tokenizing, the template as trained.
Rows with nothing before their first supervised token (a text row: all supervised) have no prompt and
are not eligible.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dflash.data.formats import DataError, Sample

#: the run directory's record of the rows held out (read back on --resume)
HELD_OUT_FILE = "held_out.json"
#: a record is a few KB; anything far larger is not one (the file is read back, so it is bounded)
_MAX_RECORD_BYTES = 1 << 22


def row_hashes(count: int, seed: int) -> np.ndarray:
    """A 64-bit mix (splitmix64's finaliser) of each row index 0..count-1 with ``seed``: uniform,
    independent per row, the same on every machine."""
    with np.errstate(over="ignore"):  # the mix wraps around 2^64 on purpose
        z = np.arange(count, dtype=np.uint64) + np.uint64((seed * 0x9E3779B97F4A7C15) % (1 << 64))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def first_supervised(sample: Sample) -> int:
    """The position of a sample's first supervised token (its length when none is)."""
    mask = np.asarray(sample.loss_mask)
    hits = np.flatnonzero(mask)
    return int(hits[0]) if len(hits) else len(mask)


def prompt_of_sample(sample: Sample) -> list[int] | None:
    """The tokens before a sample's first supervised token (None: it has none, so no prompt)."""
    first = first_supervised(sample)
    if first == 0:
        return None
    return [int(t) for t in np.asarray(sample.input_ids[:first])]


def choose_rows(samples: Sequence[Sample], seed: int, count: int) -> list[int]:
    """``count`` rows to hold out: the eligible ones (with a prompt) of smallest hash, in row order. Walks
    the rows in hash order and reads only as many as it takes, so a large token store is barely touched."""
    chosen: list[int] = []
    for i in np.argsort(row_hashes(len(samples), seed), kind="stable"):
        if len(chosen) == count:
            break
        if first_supervised(samples[int(i)]) > 0:
            chosen.append(int(i))
    return sorted(chosen)


def save_record(run_dir: Path, rows: list[int], source: str, seed: int) -> None:
    """Write the held-out rows into the run directory (what a resume reads back)."""
    record = {"rows": rows, "source": source, "seed": seed}
    path = run_dir / HELD_OUT_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record) + "\n")
    tmp.replace(path)


def read_record(run_dir: Path, samples: int) -> list[int] | None:
    """The held-out rows a run recorded (None: it recorded none, a run from before held-out rows). A
    record that does not read, or names a row the data does not have, is one line of error."""
    path = run_dir / HELD_OUT_FILE
    if not path.is_file():
        return None
    where = f"{path}"
    if path.stat().st_size > _MAX_RECORD_BYTES:
        raise DataError(f"{where}: larger than any record of held-out rows; remove it only if the run should "
                        "hold out other rows")
    try:
        rows = json.loads(path.read_text())["rows"]
    except (ValueError, KeyError, TypeError):
        raise DataError(f"{where}: not a record of held-out rows (a JSON object with a list of row numbers in "
                        "'rows')") from None
    if not isinstance(rows, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in rows):
        raise DataError(f"{where}: 'rows' must be a list of row numbers")
    if any(not 0 <= r < samples for r in rows):
        raise DataError(f"{where}: names rows outside the data's {samples} samples: is --data the run's own?")
    return sorted(set(rows))
