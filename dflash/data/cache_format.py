"""The offline hidden-states cache on disk, in the layout vLLM and speculators write (docs/cache.md).

``DIR/`` is a ``datasets`` ``save_to_disk`` data set (``input_ids``, ``loss_mask``, ``seq_len``) and
``DIR/hidden_states/hs_{i}.safetensors`` holds row ``i``'s ``hidden_states`` ``[seq, L + 1, H]`` (the
aux layers in order, the final pre-norm layer last) and ``token_ids`` int64 ``[seq]``. dflash adds a
sidecar, ``DIR/dflash_cache.json``, with what the engines' layout leaves out (which target, tokenizer,
layers and dtype).

An FP8 file (the layout of speculators' FP8 hidden-states backend, hs-connectors' ``fp8_utils``) holds
``hidden_states`` as ``float8_e4m3fn`` beside ``hidden_states_scales``, float32 ``[seq, 1, 1]``: one
scale per token over all its slots and hidden units. The scales tensor is how a reader tells such a
file; the states are ``fp8 * scale`` in the dtype training uses.

Files come from outside (an engine, another machine), so a sample is read with a bounded header parse
and every problem is a ``CacheError`` whose message is one line naming the file and what to do.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash.data.formats import Sample

HIDDEN_DIR = "hidden_states"
SIDECAR = "dflash_cache.json"
FORMAT = "speculators-offline"
#: the engines' aux layer ids are the reference's tap ids + 1 (their id k is the input of layer k)
AUX_ID_OFFSET = 1
CONVENTION = ("aux_hidden_state_layer_ids = target_layer_ids + 1 (vLLM id k = input of decoder layer k); "
              "the final layer (id num_hidden_layers, before the norm) is the last slot")
# A safetensors header is a few hundred bytes for two tensors; anything near this is not our file.
MAX_HEADER = 1 << 20

FP8 = torch.float8_e4m3fn
#: the FP8 backend's key for the per-token scales: its presence marks an FP8 file
SCALES = "hidden_states_scales"
_FP8_MAX = torch.finfo(FP8).max  # 448
_SCALE_FLOOR = 1e-12  # an all-zero token still gets a usable (positive) scale
_SIGN_EXP_MANTISSA = 0x87F00000 - (1 << 32)  # fp32 bit 31 and bits 20-26, as a signed int32
_BIAS_GAP = 2.0 ** (127 - 7)  # fp32's exponent bias minus float8_e4m3fn's

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "F8_E4M3": FP8, "I64": torch.int64, "I32": torch.int32}


#: what to do about a bad sample file, said at the end of its error line
REWRITE = "delete it and rerun `dflash data cache` (or the engine) to rewrite it"


class CacheError(ValueError):
    """A cache that cannot be used as it is; the message is one line naming the file and the fix."""


class MixedCache(CacheError):
    """Sample files that disagree on what the cache is (one in FP8 beside bf16 ones): no single file is at
    fault, so a run never skips such a file as a bad sample; the cache is rewritten in one dtype."""


def sample_path(root: Path, index: int) -> Path:
    return Path(root) / HIDDEN_DIR / f"hs_{index}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (how the sidecar spells it)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CacheError(f"unknown dtype {name!r} in {SIDECAR}")
    return dtype


# --- one sample -----------------------------------------------------------------------------------

def quantize_fp8(hidden: torch.Tensor, per_tap: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden [..., slots, H]`` -> ``(float8_e4m3fn, float32 scales [..., 1, 1])``, one scale per token
    (its largest magnitude over every slot maps to FP8's largest value, 448), the arithmetic of the FP8
    backend's writer, so either tool's file of the same states holds the same bytes. Tokens are
    independent: a padded batch quantises to the same values as its samples one by one.

    ``per_tap``: one scale per token and slot instead (scales ``[..., slots, 1]``, dflash's own option):
    the shared scale is set by the slot with the largest magnitudes (the deepest layers' outliers), which
    leaves an early tap's values few of FP8's codes (docs/cache.md has the figures). The FP8 backend's
    reader multiplies by the scales as they broadcast, so it reads such a file right too."""
    x = hidden.float()
    over = (-1,) if per_tap else (-2, -1)
    scales = (x.abs().amax(dim=over, keepdim=True) / _FP8_MAX).clamp(min=_SCALE_FLOOR)
    return (x / scales).to(FP8), scales


def dequantize_fp8(fp8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
    """``fp8 * scales`` in ``dtype``, to the bit what the FP8 backend's reader computes (both cast to
    ``dtype``, then multiplied), into a new buffer, page-locked when ``pin``.

    The codes are widened with integer arithmetic, several times faster on a CPU than torch's
    element-by-element float8 conversion: each byte, sign-extended, is shifted so that its 4 exponent
    and 3 mantissa bits land on fp32's, and the result scaled by 2^120 (the difference of the two
    exponent biases), exact for every code, subnormals included. The product with a scale cast to
    ``dtype`` has at most 12 significant bits, so computing it in fp32 and rounding once gives the
    ``dtype`` product."""
    wide = torch.empty(fp8.shape, dtype=torch.int32, pin_memory=pin and dtype == torch.float32)
    wide.copy_(fp8.view(torch.int8)).bitwise_left_shift_(20).bitwise_and_(_SIGN_EXP_MANTISSA)
    values = wide.view(torch.float32).mul_(_BIAS_GAP)
    magnitude = values.abs()
    if bool(magnitude.amax() > _FP8_MAX):  # only the NaN codes (s.1111.111) land above 448, on 480
        values[magnitude > _FP8_MAX] = float("nan")
    values.mul_(scales.to(dtype))
    if dtype == torch.float32:
        return values
    return torch.empty(fp8.shape, dtype=dtype, pin_memory=pin).copy_(values)


def write_sample(path: Path, hidden: torch.Tensor, token_ids: torch.Tensor, scales: torch.Tensor | None = None) -> int:
    """Write one sample atomically: a hidden temporary in the same directory, then a rename, so a
    reader (``--follow``, speculators) sees the whole file or none; ``scales``: an FP8 sample's
    ``[seq, 1, 1]`` per-token (or ``[seq, slots, 1]`` per-tap) scales. Returns the bytes written."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tensors = {"hidden_states": hidden.contiguous(), "token_ids": token_ids.to(torch.int64).contiguous()}
    if scales is not None:
        tensors[SCALES] = scales.float().contiguous()
    try:
        save_file(tensors, str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path.stat().st_size


def is_ready(path: Path) -> bool:
    """Whether ``path`` is complete: present, and not held by a writer. vLLM's connector keeps an
    exclusive ``flock`` on ``<file>.lock`` until its write ends; a shared lock we can take means it has."""
    if not path.is_file():
        return False
    lock = path.with_name(path.name + ".lock")
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@dataclass
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def read_header(path: Path) -> tuple[dict[str, TensorInfo], int]:
    """The tensors a safetensors file declares and where its data starts, checked against the file's
    size (a truncated file is caught here, before any data is read)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CacheError(f"{path}: truncated ({size} bytes, no safetensors header); {REWRITE}")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise CacheError(f"{path}: truncated or not a safetensors file (header of {n} bytes in a "
                                 f"{size}-byte file); {REWRITE}")
            raw = json.loads(f.read(n))
    except FileNotFoundError:
        raise CacheError(f"{path}: missing; rerun `dflash data cache` with the same --out to write it") from None
    except (OSError, ValueError) as e:
        if isinstance(e, CacheError):
            raise
        raise CacheError(f"{path}: unreadable safetensors header ({e}); {REWRITE}") from None
    if not isinstance(raw, dict):
        raise CacheError(f"{path}: safetensors header is not an object; {REWRITE}")
    tensors, end = {}, 0
    for name, spec in raw.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[spec["dtype"]]
            shape = tuple(int(d) for d in spec["shape"])
            start, stop = (int(o) for o in spec["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CacheError(f"{path}: tensor {name!r} has an unsupported dtype or a malformed entry") from None
        count = 1
        for d in shape:
            count *= d
        if stop - start != count * dtype.itemsize or start < 0:
            raise CacheError(f"{path}: tensor {name!r} declares {stop - start} bytes for shape {list(shape)}")
        tensors[name] = TensorInfo(dtype, shape, start, stop)
        end = max(end, stop)
    if 8 + n + end != size:
        raise CacheError(f"{path}: truncated ({size} bytes, its header promises {8 + n + end}); {REWRITE}")
    return tensors, 8 + n


def read_stored(path: Path, pin: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(hidden_states [seq, slots, H], token_ids [seq], scales [seq, 1 or slots, 1] or None)`` as the file holds
    them, read straight into one buffer (page-locked when ``pin``, so the copy to a GPU can be
    asynchronous), shapes checked against each other; ``scales`` only in an FP8 file."""
    tensors, data_start = read_header(path)
    for name in ("hidden_states", "token_ids"):
        if name not in tensors:
            raise CacheError(f"{path}: no {name!r} tensor (has {sorted(tensors)}): not a hidden-states cache file")
    hs, tok, sc = tensors["hidden_states"], tensors["token_ids"], tensors.get(SCALES)
    if len(hs.shape) != 3:
        raise CacheError(f"{path}: hidden_states has shape {list(hs.shape)}, expected [seq, layers, hidden]")
    if len(tok.shape) != 1 or tok.shape[0] != hs.shape[0] or tok.dtype.is_floating_point:
        raise CacheError(f"{path}: token_ids {list(tok.shape)} ({dtype_name(tok.dtype)}) does not match "
                         f"hidden_states' {hs.shape[0]} positions")
    if hs.dtype == FP8 and sc is None:
        raise CacheError(f"{path}: hidden_states is {dtype_name(FP8)} but the file has no {SCALES!r} (FP8 states "
                         f"are meaningless without their per-token scales); {REWRITE}")
    if sc is not None and hs.dtype != FP8:
        raise CacheError(f"{path}: has {SCALES!r} but hidden_states is {dtype_name(hs.dtype)}, not "
                         f"{dtype_name(FP8)}: not a file either writer makes; {REWRITE}")
    if sc is not None and (sc.shape not in ((hs.shape[0], 1, 1), (hs.shape[0], hs.shape[1], 1))
                           or not sc.dtype.is_floating_point):
        raise CacheError(f"{path}: {SCALES} is {dtype_name(sc.dtype)} {list(sc.shape)}, expected a float "
                         f"[{hs.shape[0]}, 1, 1] (one scale per token) or [{hs.shape[0]}, {hs.shape[1]}, 1] (per "
                         f"token and tap); {REWRITE}")
    total = os.path.getsize(path) - data_start
    buf = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
    with path.open("rb") as f:
        f.seek(data_start)
        got = f.readinto(memoryview(buf.numpy()))
    if got != total:
        raise CacheError(f"{path}: truncated while reading ({got} of {total} bytes); {REWRITE}")

    def view(t: TensorInfo) -> torch.Tensor:
        return buf[t.start:t.end].view(t.dtype).view(t.shape)

    return view(hs), view(tok).to(torch.int64), (view(sc) if sc is not None else None)


def read_sample(path: Path, pin: bool = False,
                fp8_as: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden_states [seq, slots, H], token_ids [seq])``: the states in the file's dtype, or an FP8
    file's dequantised into ``fp8_as``."""
    hs, ids, scales = read_stored(path, pin)
    return (hs if scales is None else dequantize_fp8(hs, scales, fp8_as, pin)), ids


def check_finite(hidden: torch.Tensor, path: Path) -> None:
    """Refuse non-finite states, naming the layer slots they are in (a NaN would poison the drafter)."""
    # the largest magnitude is NaN or inf exactly when some value is: one fast reduction in the usual case
    if hidden.numel() == 0 or bool(torch.isfinite(hidden.abs().amax())):
        return
    finite = torch.isfinite(hidden)
    slots = (~finite).any(dim=2).any(dim=0).nonzero().flatten().tolist()
    raise CacheError(f"{path}: {int((~finite).sum())} non-finite values (NaN/inf) in layer slots {slots}; "
                     f"{REWRITE}")


# --- the sidecar ----------------------------------------------------------------------------------

def dflash_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dflash-trainer")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def tokenizer_digest(tokenizer: Any) -> str:
    """sha256 of the vocabulary (token -> id), independent of how the tokenizer files are formatted."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


# fields that change with how a config was saved, not with the model
_VOLATILE = ("transformers_version", "_name_or_path", "dtype", "torch_dtype", "use_cache", "architectures")


def config_digest(target: Any) -> str:
    """sha256 of the target's config.json as saved (a loaded model adds fields of its own to its config),
    minus the fields that say how it was saved rather than what it is; ``target``: anything with a
    ``path`` (its model directory) and a ``config``."""
    path = getattr(target, "path", None)
    if path is not None and (Path(path) / "config.json").is_file():
        d = json.loads((Path(path) / "config.json").read_text())
    else:
        d = target.config.to_dict()
    d = {k: v for k, v in d.items() if k not in _VOLATILE}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()


@dataclass
class CacheMeta:
    """What dflash records beside the engines' layout (``dflash_cache.json``)."""

    target: str
    num_hidden_layers: int
    hidden_size: int
    config_sha256: str
    tokenizer_sha256: str
    target_layer_ids: list[int]  # the reference's convention: layer i = output of decoder layer i
    dtype: str
    rows: int
    final_layer: bool = True  # the last slot is the final (pre-norm) layer
    aux_hidden_state_layer_ids: list[int] = field(default_factory=list)  # the engines' ids (+1)
    layer_id_convention: str = CONVENTION
    format: str = FORMAT
    dflash_version: str = ""

    def __post_init__(self) -> None:
        self.aux_hidden_state_layer_ids = [i + AUX_ID_OFFSET for i in self.target_layer_ids]
        if not self.dflash_version:
            self.dflash_version = dflash_version()

    @property
    def slots(self) -> int:
        return len(self.target_layer_ids) + int(self.final_layer)

    def write(self, root: Path) -> None:
        path = Path(root) / SIDECAR
        tmp = path.with_name(f".{SIDECAR}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, path)

    @classmethod
    def read(cls, root: Path) -> CacheMeta | None:
        """The sidecar, or None when the cache has none (vLLM / speculators wrote it)."""
        path = Path(root) / SIDECAR
        if not path.is_file():
            return None
        try:
            raw = json.loads(path.read_text())
            if raw.get("format") != FORMAT:
                raise CacheError(f"{path}: format {raw.get('format')!r}, expected {FORMAT!r}")
            known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
            known.pop("aux_hidden_state_layer_ids", None)  # derived from target_layer_ids
            return cls(**known)
        except CacheError:
            raise
        except (OSError, ValueError, TypeError, AttributeError) as e:
            raise CacheError(f"{path}: unreadable sidecar ({e}); delete it to use the cache as vLLM wrote it") from None


# --- the token rows -------------------------------------------------------------------------------

def write_rows(root: Path, samples: list[Sample]) -> None:
    """The data set half of the layout, as speculators' prepare_data saves it; atomic (a temporary
    directory renamed into place, file by file: ``save_to_disk`` refuses a non-empty target)."""
    from datasets import Dataset, Features, Sequence, Value, disable_progress_bars

    disable_progress_bars()  # the cache prints its own progress
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    features = Features({"input_ids": Sequence(Value("int64")), "loss_mask": Sequence(Value("int64")),
                         "seq_len": Value("int64")})
    ds = Dataset.from_dict({"input_ids": [s.input_ids for s in samples], "loss_mask": [s.loss_mask for s in samples],
                            "seq_len": [len(s.input_ids) for s in samples]}, features=features)
    # speculators' preprocessing saves its rows in torch format (state.json ``_format_type: torch``), and
    # its loader compares them with torch.equal: rows saved as plain lists crash it.
    ds.set_format(type="torch")
    tmp = root / f".rows.{os.getpid()}.tmp"
    ds.save_to_disk(str(tmp))
    for f in sorted(tmp.iterdir(), key=lambda p: p.name == "state.json"):  # state.json last: it names the rest
        os.replace(f, root / f.name)
    tmp.rmdir()


def rows_ready(root: Path) -> bool:
    return (Path(root) / "state.json").is_file()


def read_rows(root: Path) -> list[Sample]:
    """The cache's token rows (``input_ids``, ``loss_mask``), in file order: row ``i`` is ``hs_i``."""
    root = Path(root)
    if not root.is_dir():
        raise CacheError(f"--hidden-states {root}: no such directory (write one with `dflash data cache`)")
    if not rows_ready(root):
        raise CacheError(f"--hidden-states {root}: no data set (state.json) here: give the directory "
                         "`dflash data cache --out` or speculators' prepare_data wrote")
    from datasets import load_from_disk

    try:
        ds = load_from_disk(str(root))
    except Exception as e:  # datasets raises many types; the user needs the one line
        raise CacheError(
            f"--hidden-states {root}: the data set does not load ({str(e).splitlines()[0][:200]})"
        ) from None
    missing = {"input_ids", "loss_mask"} - set(getattr(ds, "column_names", []))
    if missing:
        raise CacheError(f"--hidden-states {root}: the data set lacks columns {sorted(missing)} "
                         f"(has {getattr(ds, 'column_names', '?')})")
    plain = ds.with_format(None)  # plain lists whichever format the writer saved (ours and speculators': torch)
    ids, masks = plain["input_ids"], plain["loss_mask"]
    samples = []
    for i, (a, m) in enumerate(zip(ids, masks, strict=True)):
        if len(a) != len(m):
            raise CacheError(f"--hidden-states {root}: row {i} has {len(a)} input_ids but {len(m)} loss_mask entries")
        samples.append(Sample([int(t) for t in a], [int(x) for x in m]))
    return samples


def cache_bytes(seq_lens: list[int], slots: int, hidden: int, dtype: torch.dtype, per_tap_scales: bool = False) -> int:
    """Disk the sample files take: tokens x (L + 1) x H x bytes, plus 8 bytes of token id per token
    (and 4 of scale in an FP8 cache, per slot with ``per_tap_scales``)."""
    tokens = sum(seq_lens)
    scales = 4 * (slots if per_tap_scales else 1) * (dtype == FP8)
    return tokens * slots * hidden * dtype.itemsize + tokens * (8 + scales)
