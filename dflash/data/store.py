"""The token store: a data set tokenized once, memory-mapped by every run that trains on it.

Layout of a store directory (``dflash data prepare`` writes it, dflash/data/prepare.py)::

    manifest.json          written last, by an atomic rename: a store without it is not complete
    shard-00000.ids        int32 token ids of the shard's rows, back to back
    shard-00000.mask       uint8 loss mask, one per token
    shard-00000.rows       int64 [rows, 6]: offset, length, supervised, full_length, full_supervised, line
    shard-00000.json       the shard's marker (its sizes and counts), renamed into place after its files

Rows are stored cut at the store's length limit (``max_seq_len`` in the stamp); ``full_length`` and
``full_supervised`` are what the row had before the cut, so a run can say what its own limit (at most the
store's) cuts without reading a token. The stamp names what the ids depend on: the tokenizer (a hash of
its content, not a path), the chat template, the thinking mode, the length limit and the source file.

A store is a file from outside: the manifest is read with a size bound and checked field by field, and
each shard's files are checked against its marker's sizes and its row table before anything is mapped,
so a truncated or garbled store is refused in one line instead of read past its end.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dflash.data.formats import DataError, Sample

FORMAT = "dflash-token-store"
VERSION = 1
MANIFEST = "manifest.json"
#: a manifest lists shards and skip reasons: a few hundred KB for millions of rows; more is not ours
MAX_MANIFEST_BYTES = 16 << 20
#: columns of a shard's row table
ROW_COLUMNS = ("offset", "length", "supervised", "full_length", "full_supervised", "line")
ID_DTYPE, MASK_DTYPE, ROW_DTYPE = np.dtype("<i4"), np.dtype("u1"), np.dtype("<i8")
THINKING = ("on", "off", "auto")
#: bytes hashed at each end of a source file: enough to tell an edited file, bounded for a 50 GB one
SOURCE_HASH_BYTES = 1 << 20


class StoreError(DataError):
    """A store that cannot be used as it is; the message is one line naming the store and what to do."""


# --- the stamp -------------------------------------------------------------------------------------


def _sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of what the tokenizer does: a fast tokenizer's whole serialized definition (vocabulary,
    merges, normalizer, added tokens), else its vocabulary and special tokens. Two copies of one tokenizer
    in different directories agree; a path never enters it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return _sha(backend.to_str())
    vocab = sorted(tokenizer.get_vocab().items())
    special = sorted(map(str, getattr(tokenizer, "all_special_tokens", [])))
    return _sha(json.dumps([vocab, special], ensure_ascii=False))


def template_fingerprint(tokenizer: Any) -> str:
    """A hash of the chat template (``none`` without one): the text 'messages' rows are rendered with."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return "none"
    return _sha(json.dumps(template, sort_keys=True) if not isinstance(template, str) else template)


def source_fingerprint(path: Path) -> dict[str, Any]:
    """The data file as it is now: path, size, modification time and a hash of its first and last MiB
    (an edit in the middle that keeps size and mtime is not seen; hashing all of a 50 GB file at every
    start would cost more than the store saves)."""
    st = path.stat()
    h = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        h.update(f.read(SOURCE_HASH_BYTES))
        if st.st_size > 2 * SOURCE_HASH_BYTES:
            f.seek(st.st_size - SOURCE_HASH_BYTES)
            h.update(f.read(SOURCE_HASH_BYTES))
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ends": h.hexdigest()}


@dataclass(frozen=True)
class Stamp:
    """What a store's token ids depend on."""

    tokenizer: str
    chat_template: str
    thinking: str
    max_seq_len: int
    source: dict

    #: the parts a run's own tokenizer and settings must match (the source and limit are checked apart)
    RENDERING = ("tokenizer", "chat_template", "thinking")

    @classmethod
    def of(cls, tokenizer: Any, thinking: str, max_seq_len: int, source: Path) -> Stamp:
        return cls(tokenizer_fingerprint(tokenizer), template_fingerprint(tokenizer), thinking, max_seq_len,
                   source_fingerprint(source))

    def digest(self) -> str:
        """The store directory's name for this stamp: a different tokenizer, template, thinking mode,
        limit or source file gets its own store."""
        return _sha(json.dumps([VERSION, asdict(self)], sort_keys=True))[:16]

    def rendering_differences(self, other: Stamp) -> list[str]:
        """The rendering parts that differ, each as `name (store X, run Y)`."""
        out = []
        for name in self.RENDERING:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                short = (lambda v: v[:12]) if name != "thinking" else str
                out.append(f"{name.replace('_', ' ')} (store {short(mine)}, run {short(theirs)})")
        return out

    @classmethod
    def from_json(cls, raw: Any, where: str) -> Stamp:
        if not isinstance(raw, dict):
            raise StoreError(f"{where}: the manifest has no stamp; prepare the store again")
        try:
            stamp = cls(str(raw["tokenizer"]), str(raw["chat_template"]), str(raw["thinking"]),
                        int(raw["max_seq_len"]), dict(raw["source"]))
        except (KeyError, TypeError, ValueError):
            raise StoreError(f"{where}: the manifest's stamp is incomplete; prepare the store again") from None
        if stamp.thinking not in THINKING or stamp.max_seq_len < 1:
            raise StoreError(f"{where}: the manifest's stamp is garbled; prepare the store again")
        return stamp


# --- files -----------------------------------------------------------------------------------------


def shard_paths(root: Path, index: int) -> dict[str, Path]:
    base = root / f"shard-{index:05d}"
    return {k: base.with_suffix(f".{k}") for k in ("ids", "mask", "rows", "json")}


def write_atomic(path: Path, text: str) -> None:
    """Write then rename: a reader sees the old file, or none, or the whole new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json_bounded(path: Path, limit: int, what: str) -> Any:
    """A JSON file from outside, read only if it is at most `limit` bytes; StoreError otherwise."""
    try:
        size = path.stat().st_size
        if size > limit:
            raise StoreError(f"{path}: {what} is {size:,} bytes, more than {limit:,}: not a dflash store file")
        return json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StoreError(f"{path}: {what} does not read ({type(e).__name__}); prepare the store again") from None


def is_store(path: Path) -> bool:
    """A directory that is (or is being made into) a token store."""
    return path.is_dir() and ((path / MANIFEST).exists() or any(path.glob("shard-*.json")))


# --- reading ----------------------------------------------------------------------------------------


@dataclass
class Truncation:
    """What a length limit cuts from a store's rows, and what the supervised-token floor then drops."""

    limit: int
    rows: int  # rows encoded
    cut_rows: int  # rows longer than the limit
    supervised: int  # supervised tokens before any cut
    cut_supervised: int  # supervised tokens beyond the limit
    too_few: int  # rows left with fewer than min_loss_tokens supervised tokens (dropped)
    min_loss_tokens: int

    @property
    def cut_share(self) -> float:
        return self.cut_supervised / self.supervised if self.supervised else 0.0

    def line(self) -> str:
        """`length: limit 512 cuts 340 of 1,936 samples (17.6%) and 22.1% of supervised tokens; 12 ...`"""
        share = self.cut_rows / self.rows if self.rows else 0.0
        text = (f"length: limit {self.limit:,} cuts {self.cut_rows:,} of {self.rows:,} samples ({share:.1%}) and "
                f"{self.cut_share:.1%} of supervised tokens")
        if self.cut_rows:
            text += " (raise --max-seq-len to keep them)"
        if self.too_few:
            text += (f"; {self.too_few:,} sample{'s' if self.too_few != 1 else ''} with fewer than "
                     f"{self.min_loss_tokens} supervised tokens dropped")
        return text


class TokenStore(Sequence):
    """A complete store, memory-mapped: sample ``i`` is two numpy views into the shard files (nothing is
    read until a batch touches it), cut at ``max_len`` (at most the store's own limit). Rows with fewer
    than ``min_loss_tokens`` supervised tokens within the limit are left out, as load_samples leaves them.
    ``lengths``: each sample's token count, for batching by length."""

    def __init__(self, root: Path, max_len: int | None = None, min_loss_tokens: int = 1):
        self.root = Path(root)
        self.manifest = read_manifest(self.root)
        self.stamp = Stamp.from_json(self.manifest.get("stamp"), str(self.root / MANIFEST))
        limit = self.stamp.max_seq_len
        if max_len is not None and max_len > limit:
            raise StoreError(f"{self.root}: the store keeps rows up to {limit:,} tokens, the run asks for "
                             f"--max-seq-len {max_len:,}: prepare it again with --max-seq-len {max_len}")
        self.max_len = limit if max_len is None else max_len
        self._ids: list[np.ndarray] = []
        self._mask: list[np.ndarray] = []
        tables = []
        for i, entry in enumerate(self.manifest["shards"]):
            ids, mask, rows = open_shard(self.root, i, entry)
            self._ids.append(ids)
            self._mask.append(mask)
            tables.append(rows)
        table = np.concatenate(tables) if tables else np.zeros((0, len(ROW_COLUMNS)), ROW_DTYPE)
        shard_of = np.concatenate([np.full(len(t), k, np.int32) for k, t in enumerate(tables)]) if tables else \
            np.zeros(0, np.int32)
        supervised = table[:, 2] if self.max_len == limit else self._supervised_within(tables, self.max_len)
        keep = supervised >= min_loss_tokens
        self.truncation = Truncation(
            self.max_len, len(table), int((table[:, 3] > self.max_len).sum()), int(table[:, 4].sum()),
            int(table[:, 4].sum() - supervised.sum()), int((~keep).sum()), min_loss_tokens)
        self._shard = shard_of[keep]
        self._offset = table[keep, 0]
        self.lengths = np.minimum(table[keep, 1], self.max_len)
        self.lines = table[keep, 5]  # each sample's line in the source file

    def _supervised_within(self, tables: list[np.ndarray], limit: int) -> np.ndarray:
        """Each row's supervised tokens within a limit below the store's: one pass over the masks (only a
        run that cuts shorter than its store pays it)."""
        out = []
        for mask, t in zip(self._mask, tables, strict=True):
            # a running count per shard: row r's share is a difference of two entries (int64: a shard's
            # tokens may pass 2**31)
            running = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
            out.append(running[t[:, 0] + np.minimum(t[:, 1], limit)] - running[t[:, 0]])
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def __len__(self) -> int:
        return len(self._offset)

    def __getitem__(self, i: int) -> Sample:  # type: ignore[override] - slices are not needed
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        k, off, n = self._shard[i], int(self._offset[i]), int(self.lengths[i])
        return Sample(self._ids[k][off:off + n], self._mask[k][off:off + n])

    def check_rendering(self, stamp: Stamp) -> None:
        """Refuse, in one line, a store whose ids another tokenizer, template or thinking mode made."""
        diff = self.stamp.rendering_differences(stamp)
        if diff:
            raise StoreError(f"{self.root}: built with another {', '.join(diff)}; prepare it again for this "
                             f"run (dflash data prepare) or train with the settings it was built for")

    def describe(self) -> str:
        c = self.manifest["counts"]
        return (f"token store {self.root} ({len(self):,} samples of {c['rows']:,} rows, limit "
                f"{self.stamp.max_seq_len:,}, thinking {self.stamp.thinking})")


def read_manifest(root: Path) -> dict:
    """The manifest, checked for the fields a reader relies on; StoreError names what is wrong."""
    path = root / MANIFEST
    if not path.is_file():
        where = "is being prepared or was stopped" if any(root.glob("shard-*")) else "is not a token store"
        raise StoreError(f"{root}: {where} (no {MANIFEST}); run `dflash data prepare` to complete it")
    m = read_json_bounded(path, MAX_MANIFEST_BYTES, "the manifest")
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise StoreError(f"{path}: not a dflash token store manifest")
    if m.get("version") != VERSION:
        raise StoreError(f"{path}: store version {m.get('version')!r}, this dflash reads {VERSION}; "
                         "prepare it again")
    shards, counts = m.get("shards"), m.get("counts")
    if not isinstance(shards, list) or not isinstance(counts, dict) or not isinstance(counts.get("rows"), int):
        raise StoreError(f"{path}: the manifest's shard list or counts are garbled; prepare the store again")
    for i, s in enumerate(shards):
        if not isinstance(s, dict) or not all(isinstance(s.get(k), int) and s[k] >= 0 for k in ("rows", "tokens")):
            raise StoreError(f"{path}: shard {i}'s entry is garbled; prepare the store again")
    return m


def open_shard(root: Path, index: int, entry: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A shard's ids and mask (memory-mapped) and row table (read), after checking the files' sizes
    against the manifest and the table against itself: offsets that tile the ids exactly, lengths within
    the full lengths, supervised counts within the lengths."""
    p = shard_paths(root, index)
    rows, tokens = entry["rows"], entry["tokens"]
    want = {"ids": tokens * ID_DTYPE.itemsize, "mask": tokens * MASK_DTYPE.itemsize,
            "rows": rows * len(ROW_COLUMNS) * ROW_DTYPE.itemsize}
    for kind, size in want.items():
        try:
            have = p[kind].stat().st_size
        except OSError:
            raise StoreError(f"{p[kind]}: missing; the store is incomplete, prepare it again") from None
        if have != size:
            raise StoreError(f"{p[kind]}: {have:,} bytes where the manifest says {size:,} (truncated or "
                             "overwritten); prepare the store again")
    table = np.fromfile(p["rows"], dtype=ROW_DTYPE).reshape(rows, len(ROW_COLUMNS))
    off, n, sup, full, full_sup = (table[:, c] for c in range(5))
    ends = off + n
    tiled = rows == 0 or (off[0] == 0 and ends[-1] == tokens and bool((off[1:] == ends[:-1]).all()))
    sane = bool(((n >= 0) & (n <= full) & (sup >= 0) & (sup <= n) & (sup <= full_sup)).all())
    if not (tiled and sane):
        raise StoreError(f"{p['rows']}: the row table is garbled (rows do not tile the ids); prepare the store again")

    def mapped(path: Path, dtype: np.dtype) -> np.ndarray:
        if tokens == 0:  # numpy cannot map an empty file
            return np.zeros(0, dtype)
        return np.memmap(path, dtype=dtype, mode="r", shape=(tokens,))

    return mapped(p["ids"], ID_DTYPE), mapped(p["mask"], MASK_DTYPE), table
