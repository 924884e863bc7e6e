"""Helpers every workload shares: seeded streams, stop bounds, path resolution, content ids, tenants."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from core.checks import check_choice, check_float, check_int, check_keys
from core.request import RequestState

REPO_ROOT = Path(__file__).resolve().parents[2]  # the directory that contains core/

# Independent random streams: changing one knob (say the arrival rate) leaves the other draws unchanged,
# so a load sweep replays the same requests at different times.
ARRIVALS, PROMPT, OUTPUT, TENANT, GROUP, THINK, SESSION = range(7)


def rng(seed: int, *stream: int) -> np.random.Generator:
    """A generator for one named stream of one seed (numpy SeedSequence: streams are independent)."""
    return np.random.default_rng([seed, *stream])


def check_bound(num_requests: int | None, duration_s: float | None, what: str = "num_requests",
                required: bool = True) -> None:
    """Open-ended generators need a stop: a count, a duration, or both (whichever comes first).
    A finite arrival source (trace timestamps) may leave both unset (``required=False``)."""
    if required and num_requests is None and duration_s is None:
        raise ValueError(f"workload: set {what} or duration_s (or both; whichever is reached first stops it)")
    if num_requests is not None:
        check_int(num_requests, f"workload.{what}", 1)
    if duration_s is not None:
        check_float(duration_s, "workload.duration_s", 0.0, strict=True)


def plain(obj: Any) -> Any:
    """Config containers (dicts, OmegaConf DictConfig/ListConfig) -> plain dicts and lists, interpolations resolved."""
    if isinstance(obj, Mapping):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, Sequence) and not isinstance(obj, str | bytes):
        return [plain(v) for v in obj]
    return obj


def resolve_path(path: str | Path, key: str = "path") -> Path:
    """A relative path is tried against the current directory first, then against the repository root."""
    p = Path(path).expanduser()
    candidates = [p] if p.is_absolute() else [Path.cwd() / p, REPO_ROOT / p]
    for c in candidates:
        if c.is_file():
            return c
    raise FileNotFoundError(f"workload.{key}={str(path)!r}: no such file (tried {', '.join(map(str, candidates))})")


def tenant_name(index: int, num_tenants: int) -> str:
    """One tenant -> the default empty tenant; several -> tenant0, tenant1, ... (each its own cache salt)."""
    return "" if num_tenants == 1 else f"tenant{index}"


def content_block_size(tokens_per_hash_id: int, shared_len: int) -> int:
    """Tokens per content id such that a shared segment of ``shared_len`` tokens is a whole number of ids.

    Sharing through ``hash_ids`` is exact only at id boundaries; gcd keeps a segment ending mid-block from
    either leaking into or losing part of the tokens that follow it.
    """
    return math.gcd(tokens_per_hash_id, shared_len) if shared_len else tokens_per_hash_id


class IdCounter:
    """Fresh content ids in one workload's namespace (never reused, so unshared content gets its own ids)."""

    def __init__(self, start: int = 0) -> None:
        self.next = start

    def take(self, n: int) -> tuple[int, ...]:
        ids = tuple(range(self.next, self.next + n))
        self.next += n
        return ids


def blocks(tokens: int, block: int) -> int:
    return -(-tokens // block)


def bounded(times: Iterator[float], count: int | None, duration_s: float | None) -> Iterator[tuple[int, float]]:
    """(index, arrival time) pairs until ``count`` arrivals or past ``duration_s``, whichever comes first."""
    for i, t in enumerate(times):
        if (count is not None and i >= count) or (duration_s is not None and t > duration_s):
            return
        yield i, t


class OpenLoop:
    """Open-loop workloads: everything arrives from ``initial``; a finished request brings nothing."""

    def on_finish(self, state: RequestState, now: float) -> None:
        return None


THINK_KINDS = ("fixed", "exponential")


def check_think(think_time_s: float, think: str) -> float:
    check_choice(think, "workload.think", THINK_KINDS)
    return check_float(think_time_s, "workload.think_time_s")


def draw_think(g: np.random.Generator, think_time_s: float, think: str) -> float:
    """A client's pause between seeing an answer and sending the next request (mean ``think_time_s``)."""
    if think == "fixed" or think_time_s == 0.0:
        return think_time_s
    return float(g.exponential(think_time_s))


def kind_spec(spec: Any, key: str, kinds: Mapping[str, set[str]], what: str = "a dict") -> tuple[str, dict[str, Any]]:
    """Split a ``{kind: ..., **params}`` config into the kind and its params, checking both."""
    if not isinstance(spec, Mapping):
        raise ValueError(f"workload.{key} must be {what} with 'kind' ({sorted(kinds)}), got {spec!r}")
    spec = plain(spec)
    kind = check_choice(spec.pop("kind", None), f"workload.{key}.kind", sorted(kinds))
    check_keys(f"workload.{key} (kind {kind})", spec, kinds[kind])
    return kind, spec
