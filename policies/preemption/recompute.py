"""Recompute preemption (vLLM's default): the victim's KV is dropped and computed again on readmission."""

from __future__ import annotations

from core.interfaces import RECOMPUTE, SchedulerView
from core.request import RequestState


class RecomputePreemption:
    """Always recompute; needs no host tier."""

    def mode(self, state: RequestState, view: SchedulerView) -> str:
        return RECOMPUTE
