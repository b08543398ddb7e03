"""The tune's table of trials: kept as JSON beside the trials (rewritten whole after each one, so a killed
tune resumes from the last trial that finished), printed as a table, and its best settings written as the
TOML file `dflash train --config` reads."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dflash.data.store import write_atomic
from dflash.tune.knobs import KNOBS, best_of

FORMAT, VERSION = "dflash-tune", 1
TABLE_NAME = "tune.json"
#: a tune's table is a few KB a trial; anything far larger is not one
MAX_TABLE_BYTES = 8 << 20


class TableError(ValueError):
    """A tune table that does not read back; the message names the file."""


def save(path: Path, table: Mapping[str, Any]) -> None:
    write_atomic(path, json.dumps(table, indent=1) + "\n")


def load(path: Path) -> dict[str, Any]:
    """A table written by `save`, checked for the fields resuming relies on."""
    try:
        size = path.stat().st_size
        if size > MAX_TABLE_BYTES:
            raise TableError(f"{path}: {size:,} bytes, far more than a tune table")
        table = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise TableError(f"{path}: no tune table here to resume (start the tune without --resume)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TableError(f"{path}: the tune table does not read ({type(e).__name__})") from None
    if not isinstance(table, dict) or table.get("format") != FORMAT:
        raise TableError(f"{path}: not a dflash tune table")
    if table.get("version") != VERSION:
        raise TableError(f"{path}: tune table version {table.get('version')!r}, this dflash reads {VERSION}")
    if not isinstance(table.get("trials"), list) or not isinstance(table.get("values"), dict):
        raise TableError(f"{path}: the table has no trials list or settings")
    return table


def shown(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value))
    if isinstance(value, bool):
        return "on" if value else "off"
    return "default" if value is None else str(value)


def _settings_cell(trial: Mapping[str, Any], start: Mapping[str, Any]) -> str:
    changed = {k: v for k, v in trial["settings"].items() if start.get(k) != v}
    return "start" if not changed else " ".join(f"{k}={shown(v)}" for k, v in changed.items())


def render(table: Mapping[str, Any]) -> str:
    """Every trial: what it changed from the start, tokens/s +- spread, verdict, the bounding stage's share."""
    start, trials = table["start"], table["trials"]
    rows = [("#", "settings (vs start)", "tok/s", "+-", "verdict", "stage busy", "")]
    best = best_of(trials)
    for i, t in enumerate(trials, 1):
        if t.get("status") != "ok":
            rows.append((str(i), _settings_cell(t, start), "-", "-", "failed", "-", t.get("error", "")[:60]))
            continue
        share = "-" if t.get("share") is None else f"{t['share']:.0%}"
        rows.append((str(i), _settings_cell(t, start), f"{t['tokens_per_s']:,.0f}", f"{t['spread']:,.0f}",
                     t["verdict"], share, "best" if t is best else ""))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def gain_lines(table: Mapping[str, Any]) -> list[str]:
    """The start and the best side by side: each knob, then tokens/s."""
    trials = table["trials"]
    first, best = (trials[0] if trials else None), best_of(trials)
    if first is None or best is None or first.get("status") != "ok":
        return []
    rows = [("", "start (trial 1)", f"best (trial {trials.index(best) + 1})")]
    for k in KNOBS:
        a, b = first["settings"].get(k), best["settings"].get(k)
        rows.append((k, shown(a), shown(b) + ("" if a == b else "  *")))
    gain = best["tokens_per_s"] / first["tokens_per_s"] - 1 if first["tokens_per_s"] > 0 else math.nan
    rows.append(("tokens/s", f"{first['tokens_per_s']:,.0f} +- {first['spread']:,.0f}",
                 f"{best['tokens_per_s']:,.0f} +- {best['spread']:,.0f}  ({gain:+.0%})"))
    rows.append(("verdict", first["verdict"], best["verdict"]))
    widths = [max(len(r[c]) for r in rows) for c in range(3)]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a TOML basic string (same escapes)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {v!r}")


def toml_text(values: Mapping[str, Any], header: Sequence[str] = ()) -> str:
    """Flat settings as a TOML file `dflash train --config` reads (a setting left unset is left out)."""
    lines = [f"# {h}" for h in header] + ["[train]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None]
    return "\n".join(lines) + "\n"
