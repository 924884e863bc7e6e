"""Adaptive draft length: the k that maximises expected tokens per unit of step cost, per request and step.

A verify step of k drafts yields E(k) = (1 - a^(k+1)) / (1 - a) tokens at acceptance a (the request's measured
acceptance, starting from a prior). It costs, relative to a plain decode step at the same batch size,
1 + k * draft_cost + k * num_running / saturation_batch: ``draft_cost`` is the proposer's cost per draft token
(about 0 for n-gram lookup, the draft/target size ratio for a draft model) and the last term grows as the extra
verify tokens push a memory-bound decode towards compute-bound (``saturation_batch``: the batch at which one more
token per sequence costs about as much as the whole plain step; the roofline's ridge point over the context).
k = 0 (plain decoding) wins at low acceptance and large batches.
"""

from __future__ import annotations

from core.checks import check_float, check_fraction, check_int
from core.request import RequestState


class AdaptiveDraftLength:
    def __init__(self, max_k: int = 8, prior_acceptance: float = 0.6, prior_weight: int = 8,
                 draft_cost: float = 0.0, saturation_batch: float = 128.0) -> None:
        self.max_k = check_int(max_k, "spec.policy.max_k", 0, whole_float=True)
        self.prior = check_fraction(prior_acceptance, "spec.policy.prior_acceptance")
        self.prior_weight = check_int(prior_weight, "spec.policy.prior_weight", 0, whole_float=True)
        self.draft_cost = check_float(draft_cost, "spec.policy.draft_cost", 0.0)
        self.saturation_batch = check_float(saturation_batch, "spec.policy.saturation_batch", 0.0, strict=True)

    def acceptance(self, state: RequestState) -> float:
        """The request's acceptance so far, shrunk towards the prior while it has few drafts."""
        n = state.num_draft_proposed + self.prior_weight
        return (state.num_draft_accepted + self.prior * self.prior_weight) / n if n else self.prior

    def num_draft_tokens(self, state: RequestState, num_running: int) -> int:
        a = min(self.acceptance(state), 1 - 1e-9)
        per_draft = self.draft_cost + num_running / self.saturation_batch
        best_k, best = 0, 1.0  # plain decoding: one token per unit cost
        for k in range(1, self.max_k + 1):
            value = (1 - a ** (k + 1)) / (1 - a) / (1 + k * per_draft)
            if value > best:
                best_k, best = k, value
        return best_k
