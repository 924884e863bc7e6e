"""vLLM v0's default scheduler: prefill-prioritising, never mixing prefills and decodes in one step."""

from __future__ import annotations

from core.batch import Batch, Chunk
from core.interfaces import SchedulerView
from core.request import RequestState
from policies.schedulers.common import admit, fcfs, schedule_running


class VLLMPrefillFirstScheduler:
    """If any waiting request can be admitted (whole prompt within the token budget, a free seat under
    ``max_num_seqs``, KV for the prompt), the step admits as many as fit FCFS and runs only their
    prefills. Otherwise it is a decode-only step of the running requests; KV exhaustion there preempts
    the newest running request (recompute), which re-enters the waiting queue at its head.

    As in vLLM v0 without chunked prefill, a recompute needs prompt + outputs whole in one step; set
    ``max_num_batched_tokens >= max_model_len`` (vLLM enforces this) or such a request is eventually
    rejected by the idle replica."""

    def steady_decode(self, view: SchedulerView) -> list[RequestState] | None:
        """``core.interfaces.SteadyDecodeScheduler``: the decode-only step (running order) repeats while nobody can
        be admitted without even trying: nothing waits, or no seat is left under ``max_num_seqs``."""
        if view.waiting and len(view.running) < view.limits.max_num_seqs:
            return None
        return list(view.running)

    def schedule(self, view: SchedulerView) -> Batch:
        chunks: dict[str, Chunk] = {}
        budget = view.limits.max_num_batched_tokens
        admit(view, fcfs(view), chunks, budget, chunked=False)
        if not chunks:
            schedule_running(view, list(view.running), chunks, budget, chunked=False)
        return Batch(list(chunks.values()))
