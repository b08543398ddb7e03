"""Config values checked against their field's declared type (``int | None``, ``list[str]``, ...), so
that a TOML's ``batch_size = 8.5`` or ``metrics_port = "9400"`` fails at load in one line, not later
inside a worker with a TypeError."""

from __future__ import annotations

import types
import typing
from typing import Any

from dflash.train.config import ConfigError


def coerce(name: str, hint: Any, value: Any) -> Any:
    """`value` as the setting `name` of type `hint` stores it (an int where a float is declared; a
    comma-separated string where a list is), or a ConfigError saying what was expected."""
    options = _options(hint)
    if isinstance(value, str) and any(typing.get_origin(h) is list for h in options):
        value = split(value)  # comma-separated on the command line
    if value is None:
        if type(None) in options:
            return None
        raise ConfigError(f"{name} must be set, got nothing")
    for option in options:
        ok, converted = _matches(value, option)
        if ok:
            return converted
    raise ConfigError(f"{name} must be {describe(hint)}, got {value!r}")


def split(text: str) -> list[Any]:
    """`cuda:0,cuda:1` or `1,3,5` as a list (whole numbers as ints, so list[int] checks them); `none`: empty."""
    items = [v.strip() for v in text.split(",") if v.strip() and v.strip() != "none"]
    return [int(v) if v.lstrip("-").isdigit() else v for v in items]


def is_bool(hint: Any) -> bool:
    return [h for h in _options(hint) if h is not type(None)] == [bool]


def number_type(hint: Any) -> type | None:
    """int or float where a flag's word must be a number; None where it stays text (a list is split
    by `coerce`)."""
    first = next(h for h in _options(hint) if h is not type(None))
    return first if first in (int, float) else None


def describe(hint: Any) -> str:
    names = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}
    if isinstance(hint, types.UnionType):
        parts = [describe(h) for h in typing.get_args(hint) if h is not type(None)]
        return " or ".join(parts) + (" (or unset)" if type(None) in typing.get_args(hint) else "")
    if typing.get_origin(hint) is list:
        return f"a list of {describe(typing.get_args(hint)[0]).removeprefix('a ')}s"
    return names.get(hint, str(hint))


def _options(hint: Any) -> tuple:
    return typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)


def _matches(value: Any, hint: Any) -> tuple[bool, Any]:
    """Whether `value` fits `hint`, and the value to store (an int where a float is declared)."""
    if hint is type(None):
        return False, None
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return number, float(value) if number else value
    if hint is str:
        return isinstance(value, str), value
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            return False, value
        checked = [_matches(v, item) for v in value]
        return all(ok for ok, _ in checked), [v for _, v in checked]
    raise TypeError(f"config field type {hint!r} has no check")  # a new field type: add it above
