"""The torch and transformers versions this trainer supports, checked when a command starts.

Declared versions are tested versions: pyproject.toml declares the same ranges (a test reads them back),
and a fresh install takes the newest release inside them, so each upper bound is the first release the
suite has not passed on. ``make compat`` runs the whole suite at both ends of the ranges (docs/gpu.md
has the counts); the range is widened only after the suite passed on the new release.

torch: the drafter's attention uses FlexAttention's BlockMask built from tile metadata, its
dynamic-shape compile and GQA support, APIs that changed between releases. 2.11 is the lent GPU
machine's torch and SpecForge's pin. An older torch fails deep inside the first step, or trains through
the SDPA fallback without saying why, so it is refused; a newer one is not (pip keeps an install inside
the range, and a GPU image's vendor build cannot be swapped as easily as a pure-Python package).

transformers: dflash reaches into its cache layers (sliding windows, linear-attention states, past
recording) and its per-family modules, which change from release to release: 5.25 changed how a linear
layer records its past and broke the hybrid targets' rollback the day it came out. A transformers
outside the range, older or newer, is refused in one line; 5.17 is the lent GPU machine's.
"""

from __future__ import annotations

from packaging.version import Version

from dflash.train.config import ConfigError

MIN_TORCH = "2.11"
BELOW_TORCH = "2.14"  # the first release not run yet
MIN_TRANSFORMERS = "5.17"
BELOW_TRANSFORMERS = "5.26"  # the first release not run yet


def _install(package: str, low: str, below: str) -> str:
    return f"{package}>={low},<{below} (pip install '{package}>={low},<{below}')"


def check_torch(version: str) -> None:
    """Refuse, in one line, a torch older than the supported range (``version``: ``torch.__version__``)."""
    if Version(version).release < Version(MIN_TORCH).release:
        raise ConfigError(f"torch {version} is too old: dflash trains with {_install('torch', MIN_TORCH, BELOW_TORCH)}")


def check_transformers(version: str) -> None:
    """Refuse, in one line, a transformers outside the tested range (``transformers.__version__``; a
    pre-release of the first untested version counts as that version)."""
    release = Version(version).release
    if not Version(MIN_TRANSFORMERS).release <= release < Version(BELOW_TRANSFORMERS).release:
        raise ConfigError(f"transformers {version} is outside the range dflash was tested with: "
                          f"{_install('transformers', MIN_TRANSFORMERS, BELOW_TRANSFORMERS)}; "
                          "`make compat` runs the suite under another")


def check_installed() -> None:
    """Both checks on what is installed (imports torch and transformers)."""
    import torch
    import transformers

    check_torch(torch.__version__)
    check_transformers(transformers.__version__)
