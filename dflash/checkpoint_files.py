"""Checkpoints that survive crashes, corruption and full disks, and never run code when loaded.

* **Atomic.** A checkpoint is written to a temporary file in the same directory, fsynced, renamed into
  place (rename is atomic on POSIX), and the directory is fsynced so the rename itself survives a power
  loss. Readers only look at ``step-*.pt`` names, so leftovers of an interrupted write are ignored and
  cleaned up.
* **Verified.** ``manifest.json`` beside the checkpoints records each one's size and sha256, hashed
  while it is written. The entry is written *before* the rename, so every complete ``step-*.pt`` has
  one; on resume a checkpoint whose size or checksum disagrees (truncated, bit rot, overwritten) is
  skipped, with the reason, for the newest one that verifies.
* **Safe to load.** Only ``torch.load(weights_only=True)``: tensors and plain types, never an
  arbitrary pickled object. Training state is stored that way (RNG states as tensors); a file that
  needs anything else is refused in one line.
* **Disk full.** Any failed write removes its temporary file and raises ``CheckpointError`` naming the
  directory and the free space; the checkpoints already on disk are untouched. When the free space is
  short of the next write, the oldest checkpoints beyond ``keep - 1`` go first, never the newest.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

_NAME = re.compile(r"^step-(\d+)\.pt$")
MANIFEST = "manifest.json"
#: the format tag every training checkpoint carries (what the resume code knows how to read)
FORMAT_PREFIX = "dflash-train-checkpoint/"
FORMAT = FORMAT_PREFIX + "1"  # what this version writes
#: a manifest is a few hundred bytes per checkpoint; anything far larger is not one of ours
_MAX_MANIFEST_BYTES = 1 << 20
#: slack on top of the previous checkpoint's size when judging whether the next one fits
_ROOM_MARGIN = 1.05
_HASH_CHUNK = 1 << 22


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or loaded; the message is one line for the user."""


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


# --- the manifest ------------------------------------------------------------------------------------


def read_manifest(run_dir: Path) -> tuple[dict[str, dict[str, Any]], str | None]:
    """Checkpoint name -> {size, sha256}, and why the manifest could not be read (None when it could,
    or when there is none yet)."""
    path = checkpoint_dir(run_dir) / MANIFEST
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        return {}, None
    except OSError as e:
        return {}, f"{path}: {e.strerror or e}"
    if len(raw) > _MAX_MANIFEST_BYTES:
        return {}, f"{path}: larger than {_MAX_MANIFEST_BYTES} bytes, not a checkpoint manifest"
    try:
        entries = json.loads(raw).get("checkpoints", {})
        return {str(k): {"size": int(v["size"]), "sha256": str(v["sha256"])} for k, v in entries.items()}, None
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        return {}, f"{path}: unreadable ({e})"


def _write_manifest(d: Path, entries: dict[str, dict[str, Any]]) -> None:
    """Replace the manifest atomically (same temp-fsync-rename as a checkpoint)."""
    data = json.dumps({"format": "dflash-checkpoint-manifest/1", "checkpoints": entries}, indent=1).encode()
    _atomic_write(d / MANIFEST, lambda f: f.write(data))


def _atomic_write(final: Path, write: Callable[[Any], Any]) -> None:
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        _discard(tmp)
        raise
    _fsync_dir(final.parent)


def _discard(tmp: Path) -> None:
    """Remove a failed write's temporary file, if it got as far as existing: the cleanup must not raise
    an error of its own over the write's (a path whose directory is a file fails again here)."""
    try:
        tmp.unlink(missing_ok=True)
    except OSError:
        pass


def _fsync_dir(d: Path) -> None:
    dir_fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class _HashingWriter:
    """A write-only file wrapper that hashes what it writes, so verifying costs no second read."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        n = self.f.write(data)
        self.sha.update(memoryview(data)[:n])  # hashlib releases the GIL on large buffers
        self.size += n
        return n

    def flush(self) -> None:
        self.f.flush()


# --- writing -----------------------------------------------------------------------------------------


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def _free_bytes(d: Path) -> int:
    try:
        return shutil.disk_usage(d).free
    except OSError:
        return -1


def _tensor_bytes(obj: Any) -> int:
    """What the tensors in a (nested) state take on disk, roughly: torch.save stores them as they are."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _no_space(e: BaseException) -> bool:
    """Whether an error (or one it was raised from: torch's writer reports a failed write as
    'unexpected pos') is the disk being full."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (28, 122):  # ENOSPC, EDQUOT
            return True
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return False


def _make_room(run_dir: Path, existing: list[Path], need: int, keep: int) -> list[Path]:
    """Delete the oldest checkpoints beyond ``keep - 1`` while the next write would not fit (they would
    be pruned after it anyway). The newest checkpoint whose size matches its manifest entry (else the
    newest) always stays: if the write fails, resume still has it. Returns what was removed."""
    d = checkpoint_dir(run_dir)
    manifest, _ = read_manifest(run_dir)

    def intact(p: Path) -> bool:
        try:
            return manifest.get(p.name, {}).get("size") == p.stat().st_size
        except OSError:
            return False

    keeper = next((p for p in reversed(existing) if intact(p)), existing[-1] if existing else None)
    removed: list[Path] = []
    for old in existing[: max(0, len(existing) - max(1, keep - 1))]:
        if _free_bytes(d) >= need:
            break
        if old != keeper:
            old.unlink(missing_ok=True)
            removed.append(old)
    return removed


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], keep: int,
                    note: Callable[[str], None] | None = None) -> Path:
    """Write ``state`` as ``step-<step>.pt`` atomically, record it in the manifest, keep the newest
    ``keep``. Raises CheckpointError (one line) when it cannot; nothing already on disk is lost then."""
    import torch

    d = checkpoint_dir(run_dir)
    final = d / f"step-{step:08d}.pt"
    tmp = d / f".tmp-{final.name}-{os.getpid()}"
    existing = [p for p in list_checkpoints(run_dir) if p != final]
    need = 0
    try:
        d.mkdir(parents=True, exist_ok=True)
        previous = existing[-1].stat().st_size if existing else 0
        need = int(max(previous, _tensor_bytes(state)) * _ROOM_MARGIN) + (1 << 16)
        if _free_bytes(d) < need:
            for p in _make_room(run_dir, existing, need, keep):
                existing.remove(p)
                if note is not None:
                    note(f"low on disk space in {d}: removed the oldest checkpoint {p.name} to make room")
        with open(tmp, "wb") as f:
            w = _HashingWriter(f)
            torch.save(state, w)
            f.flush()
            os.fsync(f.fileno())
        manifest, _ = read_manifest(run_dir)
        live = {p.name for p in existing}
        entries = {k: v for k, v in manifest.items() if k in live}
        entries[final.name] = {"size": w.size, "sha256": w.sha.hexdigest()}
        _write_manifest(d, entries)  # before the rename: every complete step-*.pt has its entry
        os.replace(tmp, final)
        _fsync_dir(d)
    except Exception as e:
        _discard(tmp)
        free = _free_bytes(d)
        where = f"in {run_dir} ({_mb(free)} free, this checkpoint needs ~{_mb(need)})" if free >= 0 else f"in {run_dir}"
        if _no_space(e):
            raise CheckpointError(f"{final.name} not saved: no space left on device {where}; "
                                  "the partial file was removed") from None
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"{final.name} not saved {where}: {first}; the partial file was removed") from None
    old = existing[: max(0, len(existing) + 1 - keep)]
    for p in old:
        p.unlink(missing_ok=True)
    if old:
        try:
            _write_manifest(d, {k: v for k, v in entries.items() if k not in {p.name for p in old}})
        except OSError:
            pass  # entries of deleted files are harmless: only files that exist are ever looked up
    return final


def clean_partial(run_dir: Path) -> int:
    """Remove temporary files left by a write that was killed; returns how many."""
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return 0
    stale = [p for p in d.iterdir() if p.name.startswith(".tmp-")]
    for p in stale:
        p.unlink(missing_ok=True)
    return len(stale)


# --- loading -----------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def verify(path: Path, entry: dict[str, Any] | None) -> str | None:
    """Why ``path`` does not match its manifest entry, or None when it does (or has no entry)."""
    if entry is None:
        return None
    try:
        size = path.stat().st_size
        if size != entry["size"]:
            what = "truncated" if size < entry["size"] else "larger than written"
            return f"{what}: {size} bytes, the manifest recorded {entry['size']}"
        if _sha256(path) != entry["sha256"]:
            return "checksum mismatch: the file changed after it was written"
    except OSError as e:
        return f"unreadable: {e.strerror or e}"
    return None


def safe_load(path: Path) -> Any:
    """``torch.load`` with ``weights_only=True``, turning every failure into one CheckpointError line.

    A file that needs a global beyond tensors and plain types (a pickled object, a function call) is
    refused; dflash's own checkpoints never need one.
    """
    import pickle

    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        text = str(e)
        m = re.search(r"GLOBAL (\S+)", text)
        if m:
            raise CheckpointError(f"{path}: refused: loading it would run code (it calls or builds "
                                  f"{m.group(1)}); dflash only loads tensors and plain types") from None
        detail = text.split("WeightsUnpickler error:", 1)[-1].strip().splitlines()
        raise CheckpointError(f"{path}: not a readable checkpoint ({(detail or ['?'])[0][:120]})") from None
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise CheckpointError(f"{path}: not a readable checkpoint ({first})") from None


def load_checkpoint(path: Path, entry: dict[str, Any] | None = None) -> dict[str, Any]:
    """A training checkpoint, verified against its manifest entry and loaded safely."""
    why = verify(path, entry)
    if why is not None:
        raise CheckpointError(f"{path}: {why}")
    state = safe_load(path)
    fmt = state.get("format") if isinstance(state, dict) else None
    if not (isinstance(fmt, str) and fmt.startswith(FORMAT_PREFIX)):
        raise CheckpointError(f"{path}: not a dflash training checkpoint (no '{FORMAT_PREFIX}*' format tag)")
    return state


def load_latest(run_dir: Path, note: Callable[[str], None] | None = None) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that verifies and loads, and its path; None when there is none at all.

    Each one skipped is reported to ``note`` with the reason. Raises CheckpointError when checkpoints
    exist but none is usable: starting afresh beside them would hide the problem.
    """
    ckpts = list_checkpoints(run_dir)
    if not ckpts:
        return None
    say = note or (lambda s: None)
    manifest, problem = read_manifest(run_dir)
    if problem:
        say(f"checkpoint manifest ignored: {problem}")
    for path in reversed(ckpts):
        entry = manifest.get(path.name)
        try:
            state = load_checkpoint(path, entry)
        except CheckpointError as e:
            say(f"skipping checkpoint {path.name}: {str(e).removeprefix(f'{path}: ')}")
            continue
        if entry is None:
            say(f"checkpoint {path.name} has no manifest entry (written by an older dflash?): "
                "loaded without a checksum")
        return path, state
    raise CheckpointError(f"none of the {len(ckpts)} checkpoint(s) in {checkpoint_dir(run_dir)} is usable "
                          "(reasons above)")
