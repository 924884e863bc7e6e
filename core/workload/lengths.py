"""Token-length distributions (prompt, output, suffix, user-turn lengths).

Config: a small dict with ``kind`` (or a bare int, meaning fixed)::

    {kind: fixed, value: 128}
    {kind: uniform, low: 64, high: 256}                         # inclusive
    {kind: lognormal, mean: 128, sigma: 0.5, min: 1, max: 1024}  # or median: instead of mean
    {kind: empirical, path: ../shared/data/traces/sharegpt_8k_filtered_stats_llama2_tokenizer.csv,
     column: num_prefill_tokens, min: 1, max: 2048}              # resample a column of a CSV file

Draws are rounded to integers and clipped to [min, max].
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from core.checks import check_float, check_int
from core.workload.base import kind_spec, resolve_path

_CHUNK = 1024  # draws per numpy call when streaming


@dataclass(frozen=True)
class LengthDist:
    """Integer lengths in [lo, hi]. ``values`` holds the empirical sample (kind empirical only)."""

    kind: str
    lo: int
    hi: int | None
    value: int = 0  # fixed
    mu: float = 0.0  # lognormal: log-space mean
    sigma: float = 0.0
    values: np.ndarray | None = None

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            x = np.full(n, self.value, dtype=np.int64)
        elif self.kind == "uniform":
            x = rng.integers(self.lo, self.hi + 1, n)
        elif self.kind == "lognormal":
            x = np.rint(np.minimum(rng.lognormal(self.mu, self.sigma, n), 2.0**62)).astype(np.int64)
        else:
            x = self.values[rng.integers(0, len(self.values), n)]
        return np.clip(x, self.lo, self.hi if self.hi is not None else np.iinfo(np.int64).max).astype(np.int64)

    def stream(self, rng: np.random.Generator) -> Iterator[int]:
        """An endless lazy sequence of draws (chunked, so it is fast and deterministic for a given rng)."""
        while True:
            yield from self.sample(rng, _CHUNK).tolist()


_KEYS = {
    "fixed": {"value"},
    "uniform": {"low", "high"},
    "lognormal": {"mean", "median", "sigma", "min", "max"},
    "empirical": {"path", "column", "min", "max"},
}


def make_length(spec: Mapping[str, Any] | int, key: str, minimum: int = 1) -> LengthDist:
    """Build a length distribution from its config; ``key`` names it in error messages (e.g. ``prompt_len``)."""
    if isinstance(spec, int | np.integer) and not isinstance(spec, bool):
        spec = {"kind": "fixed", "value": int(spec)}
    kind, spec = kind_spec(spec, key, _KEYS, "an int or a dict")
    if kind == "fixed":
        v = check_int(spec.get("value"), f"workload.{key}.value", minimum)
        return LengthDist(kind, v, v, value=v)
    if kind == "uniform":
        lo = check_int(spec.get("low"), f"workload.{key}.low", minimum)
        hi = check_int(spec.get("high"), f"workload.{key}.high", lo)
        return LengthDist(kind, lo, hi)
    lo = check_int(spec.get("min", minimum), f"workload.{key}.min", minimum)
    hi = spec.get("max")
    hi = None if hi is None else check_int(hi, f"workload.{key}.max", lo)
    if kind == "lognormal":
        sigma = check_float(spec.get("sigma"), f"workload.{key}.sigma")
        if ("mean" in spec) == ("median" in spec):
            raise ValueError(f"workload.{key}: lognormal takes exactly one of 'mean' or 'median'")
        centre = "mean" if "mean" in spec else "median"
        c = check_float(spec[centre], f"workload.{key}.{centre}", 0.0, strict=True)
        # E[X] = exp(mu + sigma^2 / 2); median = exp(mu)
        mu = math.log(c) - (sigma * sigma / 2 if centre == "mean" else 0.0)
        return LengthDist(kind, lo, hi, mu=mu, sigma=sigma)
    return LengthDist(kind, lo, hi, values=read_column(spec.get("path"), spec.get("column"), f"{key}"))


def read_column(path: Any, column: Any, key: str) -> np.ndarray:
    """One integer column of a CSV file with a header row (e.g. the Vidur/Sarathi token-count traces)."""
    if not isinstance(path, str) or not isinstance(column, str):
        raise ValueError(f"workload.{key}: empirical needs 'path' and 'column' strings, got {path!r}, {column!r}")
    file = resolve_path(path, f"{key}.path")
    with open(file, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        header = next(reader, [])
        if column not in header:
            raise ValueError(f"{file}: no column {column!r}; columns: {header}")
        j = header.index(column)
        out = []
        for line, row in enumerate(reader, start=2):
            try:
                x = float(row[j])
                v = int(x)  # inf: OverflowError, nan: ValueError
            except (IndexError, ValueError, OverflowError):
                raise ValueError(f"{file}:{line}: field {column!r}: not a finite number: {row[j:j + 1]}") from None
            if v != x:
                raise ValueError(f"{file}:{line}: field {column!r}: not a whole number of tokens: {row[j]!r}")
            if v < 0:
                raise ValueError(f"{file}:{line}: field {column!r}: negative length {v}")
            out.append(v)
    if not out:
        raise ValueError(f"{file}: column {column!r} has no rows")
    return np.asarray(out, dtype=np.int64)
