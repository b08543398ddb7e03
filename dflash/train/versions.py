"""The torch versions this trainer supports, checked when a run starts.

The drafter's attention uses FlexAttention's BlockMask built from tile metadata, its dynamic-shape
compile and GQA support, APIs that changed between releases. The whole suite has run under torch 2.13
and 2.11 (2.11 is the lent GPU machine's torch and SpecForge's pin; ``make compat TORCH=<version>``
repeats the check for another, docs/gpu.md has the counts); 2.12, inside the range, has not run. An
older torch fails deep inside the first step, or trains through the SDPA fallback without saying why:
refusing it at start in one line is kinder. pyproject.toml declares the same range (a test reads it
back); pip keeps an install inside it.
"""

from __future__ import annotations

from packaging.version import Version

from dflash.train.config import ConfigError

MIN_TORCH = "2.11"
BELOW_TORCH = "2.14"  # the first release not run yet: pip keeps to the range, a newer torch is not refused


def check_torch(version: str) -> None:
    """Refuse, in one line, a torch older than the supported range (``version``: ``torch.__version__``)."""
    if Version(version).release < Version(MIN_TORCH).release:
        raise ConfigError(f"torch {version} is too old: dflash trains with torch>={MIN_TORCH},<{BELOW_TORCH} "
                          f"(pip install 'torch>={MIN_TORCH},<{BELOW_TORCH}')")
