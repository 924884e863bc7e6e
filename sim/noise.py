"""Step-time noise: the variability of measured steps around a cost model, replayed in the simulator.

A cost model predicts a step's mean time; a real machine's steps scatter around it, and not independently: on a
shared CPU (or a GPU with a noisy neighbour) whole stretches of steps run slow together. Per-request means such as
TPOT average independent scatter away, but not slow stretches, so a deterministic simulator predicts their medians
and misses their tails (its TPOT p90 came out 15-27% low against the engine on a 2-vCPU VM).

The record (``record_step_noise``, kept in a calibration file) is a run's steps in their order: r = log(measured /
predicted), and per step kind (prefill, decode, mixed, verify; ``StepFeatures.kind``) its mean and standard
deviation -- short decode steps scatter more, relatively, than long prefills (sd 0.25 vs 0.09 on that VM). Each
step's r standardised within its kind, z, keeps when the machine was slow, whatever ran.

``StepNoise`` replays it: the i-th step of a replica takes the cost model's time times exp(sigma_k * z_i) / c_k for
its kind k, where z_i comes from a circular block bootstrap of the recorded z (blocks of ``block_steps``
consecutive steps keep the slow stretches' length) and c_k makes the factor's mean 1, so the mean step time stays
the cost model's. The draws are seeded, and a factor depends only on the step's index and kind, so reruns are
identical and decode fast-forward prices each step as step-by-step simulation does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from core.batch import StepFeatures

MIN_STEPS = 50  # fewer measured steps than this make no record
MIN_KIND_STEPS = 10  # a kind with fewer steps takes the scale of all steps
MAX_STEPS = 10_000  # steps kept in a record (the first ones, in order)
BLOCKS_PER_DRAW = 256  # blocks drawn at a time: a fixed size makes the draws independent of who asks for how many
DECIMALS = 4  # z is stored to 1e-4 (a relative 1e-5 or so of a step's time)


def auto_block_steps(r: np.ndarray) -> int:
    """The shortest lag at which the autocorrelation of ``r`` falls inside white noise's 95% band (2 / sqrt(n)):
    blocks that long carry the slow stretches whole. Clipped to [1, n // 8], so a sample has at least 8 blocks."""
    n = len(r)
    cap = max(1, n // 8)
    x = r - r.mean()
    var = float(x @ x)
    if n < 3 or var == 0.0:
        return 1
    size = 1 << (2 * n - 1).bit_length()  # zero-padded FFT: the linear (not circular) autocorrelation
    f = np.fft.rfft(x, size)
    acf = np.fft.irfft(f * np.conj(f), size)[:cap + 1] / var
    below = np.flatnonzero(acf[1:] < 2.0 / math.sqrt(n))
    return int(min(cap, below[0] + 1)) if len(below) else cap


def record_step_noise(features: Sequence[StepFeatures], measured: Sequence[float] | np.ndarray,
                      predicted: Sequence[float] | np.ndarray, block_steps: int | None = None,
                      source: str = "") -> dict[str, Any] | None:
    """A calibration file's ``step_noise`` section from a run's steps in order (their features, measured and
    predicted times); None with fewer than ``MIN_STEPS`` usable steps (positive, finite times). ``block_steps``
    None: ``auto_block_steps``."""
    y, p = np.asarray(measured, dtype=float), np.asarray(predicted, dtype=float)
    if not len(features) == len(y) == len(p):
        raise ValueError(f"step noise: {len(features)} steps, {len(y)} measured and {len(p)} predicted times")
    ok = np.flatnonzero(np.isfinite(y) & np.isfinite(p) & (y > 0) & (p > 0))[:MAX_STEPS]
    if len(ok) < MIN_STEPS:
        return None
    r = np.log(y[ok] / p[ok])
    kinds = np.array([features[i].kind for i in ok], dtype=object)
    sigma_all = float(r.std())
    z = (r - r.mean()) / sigma_all if sigma_all > 0 else np.zeros_like(r)
    sigma = {}
    for kind in sorted(set(kinds)):
        m = kinds == kind
        if m.sum() >= MIN_KIND_STEPS:
            sigma[str(kind)] = float(r[m].std())
            z[m] = (r[m] - r[m].mean()) / sigma[str(kind)] if sigma[str(kind)] > 0 else 0.0
    block = auto_block_steps(z) if block_steps is None else block_steps
    if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= len(r):
        raise ValueError(f"calibrate.noise_block_steps={block_steps!r}; allowed: null (auto) or an integer in "
                         f"[1, {len(r)}] (the run steps measured)")
    return {"block_steps": block, "num_steps": int(len(r)), "source": source,
            "sigma_all": round(sigma_all, 5), "sigma": {k: round(v, 5) for k, v in sigma.items()},
            "z": [round(float(x), DECIMALS) for x in z]}


class StepNoise:
    """Factors for a replica's steps 0, 1, 2, ... (see the module docstring), seeded by ``seed``: an int or a
    sequence of ints, e.g. [noise seed, replica index]."""

    def __init__(self, z: Sequence[float] | np.ndarray, sigma: Mapping[str, float], sigma_all: float,
                 block_steps: int, seed: int | Sequence[int] = 0) -> None:
        pool = np.asarray(z, dtype=float).ravel()
        if len(pool) == 0 or not np.all(np.isfinite(pool)):
            raise ValueError("step noise: z must be a non-empty list of finite numbers")
        scales = {**sigma, "": sigma_all}
        if not all(isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < math.inf
                   for v in scales.values()):
            raise ValueError(f"step noise: sigma and sigma_all must be finite numbers >= 0, got {dict(sigma)!r}, "
                             f"{sigma_all!r}")
        if isinstance(block_steps, bool) or not isinstance(block_steps, int) or not 1 <= block_steps <= len(pool):
            raise ValueError(f"step noise: block_steps={block_steps!r}; allowed: an integer in [1, {len(pool)}] "
                             "(the number of z)")
        self.pool, self.scales, self.block_steps = pool, {k: float(v) for k, v in scales.items()}, block_steps
        self._rng = np.random.default_rng(seed)
        # chunks of BLOCKS_PER_DRAW blocks: z drawn (chunk index -> z), per kind its factors; chunks before _first
        # are forgotten (a run of millions of steps keeps a few chunks)
        self._z: dict[int, np.ndarray] = {}
        self._drawn = 0  # z chunks drawn so far
        self._factors: dict[str, dict[int, np.ndarray]] = {}
        self._norm: dict[str, float] = {}  # per kind: mean of exp(sigma * z) over the recorded z
        self._first = 0

    @classmethod
    def from_mapping(cls, record: Mapping[str, Any], seed: int | Sequence[int] = 0) -> StepNoise:
        """From a calibration file's ``step_noise`` section (``record_step_noise``)."""
        keys = ("z", "sigma", "sigma_all", "block_steps")
        if not isinstance(record, Mapping) or any(k not in record for k in keys):
            raise ValueError(f"step_noise: expected a mapping with {', '.join(keys)} (sim.noise.record_step_noise)")
        return cls(record["z"], record["sigma"], record["sigma_all"], record["block_steps"], seed)

    def factors(self, start: int, n: int, kind: str = "decode") -> np.ndarray:
        """The factors of steps start .. start + n - 1, each of ``kind`` (a ``StepFeatures.kind``). Steps before
        the lowest ``start`` asked for so far are forgotten: an executor's steps only move forward."""
        key = kind if kind in self.scales else ""
        size = BLOCKS_PER_DRAW * self.block_steps
        first, last = start // size, (start + n - 1) // size
        if first < self._first:
            raise ValueError(f"step noise: step {start} was forgotten (steps from {self._first * size} are kept)")
        self._forget(first)
        parts = [self._chunk(key, i) for i in range(first, last + 1)]
        f = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return f[start - first * size:start - first * size + n]

    def factor(self, step: int, kind: str) -> float:
        return float(self.factors(step, 1, kind)[0])

    def _chunk(self, key: str, i: int) -> np.ndarray:
        """Chunk i of a kind's factors: BLOCKS_PER_DRAW blocks, the same arithmetic however steps are asked for."""
        f = self._factors.setdefault(key, {}).get(i)
        if f is None:
            while self._drawn <= i:  # z chunks are drawn in order, so chunk i is the same whoever asks first
                starts = self._rng.integers(0, len(self.pool), size=BLOCKS_PER_DRAW)[:, None]
                if self._drawn >= self._first:  # a skipped chunk is drawn all the same: the next ones stay put
                    self._z[self._drawn] = self.pool[(starts + np.arange(self.block_steps)) % len(self.pool)].ravel()
                self._drawn += 1
            s = self.scales[key]
            if key not in self._norm:  # the mean factor over the recorded z is 1
                self._norm[key] = float(np.mean(np.exp(s * self.pool)))
            f = self._factors[key][i] = np.exp(s * self._z[i]) / self._norm[key]
        return f

    def _forget(self, first: int) -> None:
        while self._first < first:
            self._z.pop(self._first, None)
            for chunks in self._factors.values():
                chunks.pop(self._first, None)
            self._first += 1
