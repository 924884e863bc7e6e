"""Speculative decoding in the simulator: how many drafts the target accepts, and what drafting costs.

Acceptance model: each draft token is accepted with probability ``alpha`` independently, up to the first
rejection. A decode verifying k drafts then yields a + 1 tokens, a ~ min(Geometric, k):
P(a = i) = alpha^i (1 - alpha) for i < k, P(a = k) = alpha^k, so the expected tokens per verify step are
(1 - alpha^(k+1)) / (1 - alpha) (k + 1 at alpha = 1). Draws come from a seeded generator, so runs repeat.

Draft cost: n-gram drafting is free; a draft model runs, per step, one pass over the step's chunks (prefill chunks
and decode tokens, as the target does, which also yields the first draft) and then one decode pass per further
draft token over the decodes still drafting. Its step times come from the draft model's own cost model (e.g. its
roofline on the same hardware).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from core.batch import Batch, StepFeatures
from sim.cost.base import CostModel, decode_features


def expected_tokens(alpha: float, k: int) -> float:
    """Mean tokens one verify step of k drafts yields at per-token acceptance ``alpha``."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"acceptance rate must be in [0, 1], got {alpha}")
    return float(k + 1) if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


class SpeculativeModel:
    """Accepted drafts and drafting time of the simulator's speculative decodes (see the module docstring)."""

    def __init__(self, acceptance_rate: float, seed: int | tuple[int, ...] = 0,
                 draft_cost: CostModel | None = None) -> None:
        if not (isinstance(acceptance_rate, int | float) and 0 <= acceptance_rate <= 1) or \
                isinstance(acceptance_rate, bool):
            raise ValueError(f"spec.acceptance_rate must be a number in [0, 1], got {acceptance_rate!r}")
        self.alpha = float(acceptance_rate)
        self.rng = np.random.default_rng(seed)
        self.draft_cost = draft_cost

    def accepted(self, num_drafts: int) -> int:
        """Drafts accepted out of ``num_drafts`` (a draw)."""
        a = 0
        while a < num_drafts and self.rng.random() < self.alpha:
            a += 1
        return a

    def draft_time(self, batch: Batch) -> float:
        """Seconds the draft model adds to the step (0 without one)."""
        if self.draft_cost is None or not batch.features.num_draft_tokens:
            return 0.0
        plain = [dataclasses.replace(ch, num_draft_tokens=0) for ch in batch.chunks]
        total = self.draft_cost.step_time(StepFeatures.of(plain))
        drafting = [ch for ch in batch.chunks if ch.num_draft_tokens]
        for j in range(2, max(ch.num_draft_tokens for ch in drafting) + 1):
            still = [ch for ch in drafting if ch.num_draft_tokens >= j]
            context = math.ceil(sum(ch.end + j - 1 for ch in still) / len(still))
            total += self.draft_cost.step_time(decode_features(len(still), context))
        return total
