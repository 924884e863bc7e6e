"""Config value checks shared by every package: each raises ValueError naming the key and what is allowed.

``key`` is the full config key (``workload.num_requests``, ``backend.top_k``), so a message says what to fix.
Booleans are not numbers here (YAML's ``true`` is not a count); numpy scalars are (``numbers.Integral`` /
``numbers.Real``).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from numbers import Integral, Real
from typing import Any


def _is_int(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def check_int(value: Any, key: str, minimum: int | None = None, *, whole_float: bool = False) -> int:
    """An integer (>= ``minimum`` when given). ``whole_float``: also a float without a fractional part (1024.0,
    as a command line may spell a count). 1.5, "abc" and true fail instead of being truncated or read as 1."""
    ok = _is_int(value) or (whole_float and isinstance(value, float) and value.is_integer())
    if not ok or (minimum is not None and value < minimum):
        allowed = "an integer" if minimum is None else f"an integer >= {minimum}"
        raise ValueError(f"{key}={value!r}; allowed: {allowed}")
    return int(value)


def check_float(value: Any, key: str, minimum: float = 0.0, strict: bool = False) -> float:
    """A finite number >= ``minimum`` (> with ``strict``)."""
    ok = isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < minimum or (strict and value == minimum):
        raise ValueError(f"{key}={value!r}; allowed: a finite number {'>' if strict else '>='} {minimum:g}")
    return float(value)


def check_fraction(value: Any, key: str) -> float:
    """A number in (0, 1]: an efficiency, a share of memory."""
    if not isinstance(value, Real) or isinstance(value, bool) or not 0 < value <= 1:
        raise ValueError(f"{key}={value!r}; allowed: a number in (0, 1]")
    return float(value)


def check_bool(value: Any, key: str) -> bool:
    """true or false (not 0/1, not the string "false")."""
    if not isinstance(value, bool):
        raise ValueError(f"{key}={value!r}; allowed: true or false")
    return value


def check_choice(value: Any, key: str, allowed: Collection[Any]) -> Any:
    """One of ``allowed``."""
    try:
        ok = value in allowed
    except TypeError:  # an unhashable value (a list) against a set or dict of choices
        ok = False
    if not ok:
        raise ValueError(f"{key}={value!r}; allowed: {list(allowed)}")
    return value


def check_keys(section: str, given: Iterable[str], allowed: Iterable[str]) -> None:
    """No key of ``given`` outside ``allowed`` (a typo must not be silently ignored)."""
    allowed = set(allowed)
    unknown = sorted(set(given) - allowed)
    if unknown:
        raise ValueError(f"{section}: unknown keys {unknown}; allowed: {sorted(allowed)}")
