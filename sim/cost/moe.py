"""Expert load of one MoE layer under top-k routing: the busiest expert-parallel group's expert-token pairs and the
experts a step's tokens touch.

T tokens each pick ``top_k`` of ``num_experts`` experts: N = T·k expert-token pairs. With the experts split into
``ep`` equal groups, each pair lands in a given group with probability 1/ep (routing taken as uniform and the picks
independent: the multinomial draw), so a group's pairs are Binomial(N, 1/ep) and the busiest of the ep groups,
which every other waits for, expects E[max] = Σ_{x ≥ 0} (1 − F(x)^ep) (the groups treated as independent). A measured
``imbalance`` (max / mean pairs, e.g. from a router trace) replaces the draw: min(N, imbalance · N / ep).

A step streams the weights of the experts it touches: each expert is untouched by all T tokens with probability
(1 − k/E)^T, so a group's E/ep experts are touched E/ep · (1 − (1 − k/E)^T) times in expectation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

SIGMAS = 12  # the busiest group's expectation summed over mean ± 12 standard deviations (the rest is < 1e-30)


@dataclass
class MoELoad:
    """Per-step expert load of an MoE layer; values cached by token count (a run has few distinct ones)."""

    num_experts: int
    top_k: int
    ep: int = 1
    imbalance: float | None = None
    _busiest: dict[int, float] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.imbalance is not None and not self.imbalance >= 1.0:
            raise ValueError(f"cost_model.moe_imbalance={self.imbalance!r}; allowed: a max / mean factor >= 1, or null")

    def busiest_pairs(self, tokens: int) -> float:
        """Expected expert-token pairs of the busiest expert-parallel group for ``tokens`` tokens."""
        n = tokens * self.top_k
        if self.ep == 1 or n == 0:
            return float(n)
        if self.imbalance is not None:
            return min(float(n), self.imbalance * n / self.ep)
        hit = self._busiest.get(n)
        if hit is None:
            hit = self._busiest[n] = expected_max_binomial(n, 1.0 / self.ep, self.ep)
        return hit

    def experts_touched(self, tokens: int) -> float:
        """Expected experts of one group that at least one of ``tokens`` tokens routes to."""
        local = self.num_experts / self.ep
        return local * -math.expm1(tokens * math.log1p(-self.top_k / self.num_experts)) \
            if self.top_k < self.num_experts else local


def expected_max_binomial(n: int, p: float, k: int) -> float:
    """E[max of ``k`` independent Binomial(n, p)] = Σ_x (1 − F(x)^k), summed where F(x)^k is not yet 1."""
    from scipy.stats import binom  # here, not at import: vLLM's python imports sim.cost (our schedulers inside vLLM)

    mean, sd = n * p, math.sqrt(n * p * (1 - p))
    lo, hi = max(0, int(mean - SIGMAS * sd)), min(n, int(math.ceil(mean + SIGMAS * sd)))
    x = np.arange(lo, hi + 1)
    tail = 1.0 - binom.cdf(x, n, p) ** k
    return float(lo + tail.sum())  # P(max > x) = 1 for x < lo (to < 1e-30)
