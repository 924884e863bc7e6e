"""Open-loop arrival processes. Every process starts at t = 0 (the first request is sent at once).

Config: a small dict with ``kind``::

    {kind: poisson, rate_rps: 4.0}             # exponential gaps
    {kind: gamma, rate_rps: 4.0, cv: 2.0}      # gamma gaps; cv = std/mean of a gap (1: Poisson, >1: bursty)
    {kind: fixed, rate_rps: 4.0}               # t_i = i / rate
    {kind: trace, path: ..., time_scale: 1.0}  # the timestamps of a trace file (any format in traces.py)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from core.checks import check_float, check_int
from core.workload.base import kind_spec
from core.workload.traces import read_trace

_CHUNK = 1024


@dataclass(frozen=True)
class RenewalArrivals:
    """Independent gaps with mean 1 / rate_rps (Poisson, gamma) or a fixed period."""

    kind: str
    rate_rps: float
    cv: float = 1.0

    def gaps(self, rng: np.random.Generator, n: int) -> np.ndarray:
        mean = 1.0 / self.rate_rps
        if self.kind == "poisson":
            return rng.exponential(mean, n)
        shape = 1.0 / (self.cv * self.cv)  # gamma(k, theta): mean k*theta, cv 1/sqrt(k)
        return rng.gamma(shape, mean / shape, n)

    def times(self, rng: np.random.Generator) -> Iterator[float]:
        if self.kind == "fixed":
            i = 0
            while True:
                yield i / self.rate_rps
                i += 1
        t = 0.0
        yield t
        while True:
            for g in self.gaps(rng, _CHUNK).tolist():
                t += g
                yield t


@dataclass(frozen=True)
class TraceArrivals:
    """A trace's timestamps, sorted, rebased to 0 and multiplied by ``time_scale``."""

    times_s: tuple[float, ...]

    def times(self, rng: np.random.Generator) -> Iterator[float]:
        return iter(self.times_s)


Arrivals = RenewalArrivals | TraceArrivals

_KEYS = {"poisson": {"rate_rps"}, "gamma": {"rate_rps", "cv"}, "fixed": {"rate_rps"},
         "trace": {"path", "time_scale", "limit"}}


def make_arrivals(spec: Mapping[str, Any], key: str = "arrival") -> Arrivals:
    kind, spec = kind_spec(spec, key, _KEYS)
    if kind == "trace":
        if "path" not in spec:
            raise ValueError(f"workload.{key}.path is required for kind trace")
        scale = check_float(spec.get("time_scale", 1.0), f"workload.{key}.time_scale", 0.0, strict=True)
        limit = spec.get("limit")
        limit = None if limit is None else check_int(limit, f"workload.{key}.limit", 1)
        ts = sorted(r.arrival_s for r in read_trace(spec["path"], limit))
        if not ts:
            raise ValueError(f"workload.{key}.path={spec['path']!r}: no rows")
        return TraceArrivals(tuple((t - ts[0]) * scale for t in ts))
    rate = check_float(spec.get("rate_rps"), f"workload.{key}.rate_rps", 0.0, strict=True)
    cv = check_float(spec.get("cv", 1.0), f"workload.{key}.cv", 0.0, strict=True)
    return RenewalArrivals(kind, rate, cv)
