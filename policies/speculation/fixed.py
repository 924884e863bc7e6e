"""A fixed draft length: every decode verifies ``k`` drafts (vLLM's ``num_speculative_tokens``)."""

from __future__ import annotations

from core.checks import check_int
from core.request import RequestState


class FixedDraftLength:
    """k drafts for every decode (the replica caps it at the request's remaining outputs)."""

    def __init__(self, k: int = 4) -> None:
        self.k = check_int(k, "spec.policy.k", 0, whole_float=True)

    def num_draft_tokens(self, state: RequestState, num_running: int) -> int:
        return self.k
