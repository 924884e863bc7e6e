"""Swap preemption whenever the host tier can hold the victim's blocks."""

from __future__ import annotations

from core.interfaces import RECOMPUTE, SWAP, SchedulerView
from core.request import RequestState


class SwapPreemption:
    """Swap the victim's computed blocks to the host tier when it has room for all of them, else recompute
    (also when nothing is computed yet: there is nothing to save)."""

    def mode(self, state: RequestState, view: SchedulerView) -> str:
        blocks = -(-state.num_computed_tokens // view.block_size)
        return SWAP if 0 < blocks <= view.num_free_host_blocks else RECOMPUTE
