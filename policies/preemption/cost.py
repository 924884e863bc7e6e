"""Swap or recompute, whichever costs the victim less time: the copy out and back in over the host link against
a prefill of its computed tokens."""

from __future__ import annotations

from core.checks import check_float
from core.interfaces import RECOMPUTE, SWAP, SchedulerView
from core.request import RequestState


class CostPreemption:
    """Swap when ``2 * (latency + blocks * block_size * kv_bytes_per_token / host_link_bw)`` (out, then back in,
    whole blocks) is below ``computed_tokens / prefill_tokens_per_s`` and the host tier has room; else recompute.

    The copy grows with the bytes of the context, the recompute with its tokens times the per-token prefill cost
    (and attention, which this linear estimate ignores: it favours recompute for long contexts a little). The
    build fills null arguments from the model and hardware (``experiments.build.preemption_policy``)."""

    def __init__(self, kv_bytes_per_token: float, host_link_bw: float, prefill_tokens_per_s: float,
                 host_link_latency_s: float = 0.0) -> None:
        self.kv_bytes_per_token = check_float(kv_bytes_per_token, "preemption.kv_bytes_per_token", strict=True)
        self.host_link_bw = check_float(host_link_bw, "preemption.host_link_bw", strict=True)
        self.prefill_tokens_per_s = check_float(prefill_tokens_per_s, "preemption.prefill_tokens_per_s", strict=True)
        self.host_link_latency_s = check_float(host_link_latency_s, "preemption.host_link_latency_s")

    def swap_time(self, num_tokens: int, block_size: int) -> float:
        """Seconds to copy ``num_tokens`` tokens' blocks to the host and back."""
        blocks = -(-num_tokens // block_size)
        return 2 * (self.host_link_latency_s + blocks * block_size * self.kv_bytes_per_token / self.host_link_bw)

    def recompute_time(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

    def mode(self, state: RequestState, view: SchedulerView) -> str:
        n, bs = state.num_computed_tokens, view.block_size
        if n == 0 or -(-n // bs) > view.num_free_host_blocks:
            return RECOMPUTE
        return SWAP if self.swap_time(n, bs) < self.recompute_time(n) else RECOMPUTE
