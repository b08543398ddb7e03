"""The objective the drafter trains on, and its optimizer: a registry of loss terms and position
weights, and ``build`` picking them by the run's settings.

A term is one file here (ce.py, kl.py, selector.py; each found by itself) whose class is decorated
with ``@register``: its ``name`` is what ``--loss`` (or an extra term) says, its ``needs`` what the
batch or the pass must carry (LABELS, VERIFIER, CANDIDATES; see base.py). A position weighting is a
PositionWeight in positions.py. The optimizers are optim.py.

Extra terms (beside the token term ``--loss`` names) come from the drafter: a drafter whose forward
returns more than its states (a mapping with ``"hidden"`` and other outputs) names the terms that read
them in its ``objective_terms`` (``{name: weight}``); ``build`` adds them, each logged apart.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from typing import Any

from dflash.objectives.base import (
    CANDIDATES,
    LABELS,
    VERIFIER,
    Forward,
    Objective,
    PositionWeight,
    Term,
    TermValue,
    TokenTerm,
)

#: registered terms by name (filled by @register as the term files are imported below)
TERMS: dict[str, type[Term]] = {}


def register(cls: type[Term]) -> type[Term]:
    """Class decorator: make a term available by its ``name``."""
    if cls.name in TERMS and TERMS[cls.name] is not cls:
        raise ValueError(f"two objective terms are called {cls.name!r}")
    TERMS[cls.name] = cls
    return cls


#: the package's modules that hold no term: every other module here is a term file, imported below so
#: that its @register runs (a new objective is one new file, nothing to add here)
_SUPPORT = frozenset({"base", "dspark_pass", "head", "optim", "positions"})
for _module in pkgutil.iter_modules(__path__):
    if _module.name not in _SUPPORT:
        importlib.import_module(f"{__name__}.{_module.name}")
from dflash.objectives.positions import DPace, ExpDecay  # noqa: E402

#: position weightings by name
POSITION_WEIGHTS: dict[str, type[PositionWeight]] = {c.name: c for c in (ExpDecay, DPace)}


def losses() -> list[str]:
    """The names ``--loss`` takes: the registered terms that predict the block's tokens."""
    return sorted(n for n, c in TERMS.items() if c.predicts_tokens)


def weighting_for(loss: str, position_weight: str | None) -> str:
    """The position weighting a run uses: the one asked for, else D-PACE where the loss computes the
    confidence it needs (ce), exp otherwise (the default recipe, docs/objectives.md)."""
    if position_weight is not None:
        return position_weight
    return "dpace" if loss == "ce" else "exp"


def check(loss: str, position_weight: str | None, extra: Mapping[str, float] | None = None) -> None:
    """One line (ValueError) for names that are not registered, or a weighting the loss cannot feed."""
    position_weight = weighting_for(loss, position_weight)
    if loss not in losses():
        raise ValueError(f"loss: unknown objective {loss!r}; choose from {', '.join(losses())}")
    if position_weight not in POSITION_WEIGHTS:
        raise ValueError(f"position_weight: unknown weighting {position_weight!r}; choose from "
                         f"{', '.join(sorted(POSITION_WEIGHTS))}")
    if POSITION_WEIGHTS[position_weight].needs_confidence and loss != "ce":
        raise ValueError(f"--position-weight {position_weight} weighs slots by the drafter's probability of the "
                         f"label, which only --loss ce computes: use --loss ce or --position-weight exp")
    for name in extra or {}:
        if name not in TERMS or TERMS[name].predicts_tokens:
            raise ValueError(f"the drafter asks for objective term {name!r}, which is not an extra term here; "
                             f"known: {', '.join(sorted(n for n, c in TERMS.items() if not c.predicts_tokens))}")


def build(settings: Any, gamma: float, extra: Mapping[str, float] | None = None,
          token_weight: float = 1.0) -> Objective:
    """The objective ``settings`` (an ObjectiveSettings: loss, position_weight, dpace_alpha) name, with
    the drafter's ``gamma`` for the exponential weighting, the drafter's ``extra`` terms and the token
    term's weight."""
    check(settings.loss, settings.position_weight, extra)
    if "tv" in (extra or {}) and settings.loss != "ce":
        raise ValueError(f"a DSpark drafter trains its token term as cross-entropy (beside total variation to "
                         f"the target): use --loss ce, not {settings.loss}")
    exp = weighting_for(settings.loss, settings.position_weight) == "exp"
    weighting = ExpDecay(gamma) if exp else DPace(settings.dpace_alpha)
    token = TERMS[settings.loss](weighting, token_weight)  # type: ignore[call-arg]
    return Objective([token, *(TERMS[n].made(w, settings) for n, w in (extra or {}).items())])


def for_drafter(settings: Any, drafter: Any) -> Objective:
    """``build`` for a drafter: its gamma, the extra terms it names (``objective_terms``) and its token
    term's weight (``token_term_weight``; 1 unless the drafter says)."""
    drafter = getattr(drafter, "module", drafter)
    return build(settings, drafter.config.gamma, getattr(drafter, "objective_terms", None),
                 getattr(drafter, "token_term_weight", 1.0))


__all__ = ["CANDIDATES", "LABELS", "POSITION_WEIGHTS", "TERMS", "VERIFIER", "Forward", "Objective", "PositionWeight",
           "Term", "TermValue", "TokenTerm", "build", "check", "for_drafter", "losses", "register"]
