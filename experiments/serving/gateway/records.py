"""The gateway's run files: one RequestState per request it answered, written with ``core.output.write_run``
(files staged, then renamed into place, metrics.json last) so that compare, sweep_report and every plot read them.

Times are seconds since the gateway started. A request's ``arrival_s`` is when its body arrived, its
``first_scheduled_s`` when it was sent to a backend, its token times when the chunks carrying its tokens came back
through the gateway (one network read = one output event, as loadgen counts them; the usage block's
``completion_tokens`` wins when it disagrees). ``replica`` is the backend's index in ``gateway.backends`` and the
``backend`` column its name (-1 and "" for a request the gateway answered itself). A non-streaming answer is one
event of all its tokens when it arrives. ``num_cached_tokens`` is the backend's ``usage.prompt_tokens_details``
``cached_tokens`` when it reports one, else 0.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.metrics import summarize
from core.output import COMPLETE, RUNNING, write_run
from core.request import Request, RequestState, Status
from experiments.serving.bench_result import apportion


@dataclass(slots=True)
class Outcome:
    """What happened to one request, as the gateway saw it."""

    id: str
    arrival_s: float
    prompt_len: int
    max_tokens: int
    backend: int = -1
    backend_name: str = ""
    sent_s: float | None = None
    events: list[tuple[float, int]] | None = None  # (time, tokens) per network read that carried tokens
    status: Status = Status.REJECTED
    reason: str = ""
    usage_prompt_tokens: int | None = None
    usage_output_tokens: int | None = None
    usage_cached_tokens: int | None = None
    finish_s: float | None = None

    def state(self) -> RequestState:
        prompt_len = self.usage_prompt_tokens or self.prompt_len
        state = RequestState(Request(self.id, self.arrival_s, max(prompt_len, 1), max(self.max_tokens, 1)))
        state.replica, state.status, state.reason = self.backend, self.status, self.reason
        state.first_scheduled_s = self.sent_s
        events = list(self.events or ())
        n = self.usage_output_tokens
        if isinstance(n, int) and n >= 0 and events and n != sum(k for _, k in events):
            events = [(t, k) for (t, _), k in zip(events, apportion(n, len(events)), strict=True)]
        times = [t for t, k in events for _ in range(k)]
        state.token_times = times
        state.output_token_ids = [-1] * len(times)  # text came back; the count is kept
        state.first_token_s = times[0] if times else None
        if state.status is Status.FINISHED and not times:
            state.status, state.reason = Status.REJECTED, "no output token"
        state.finish_s = times[-1] if state.status is Status.FINISHED else self.finish_s
        state.num_cached_tokens = int(self.usage_cached_tokens or 0)
        return state


class Recorder:
    """Collects outcomes (from the event loop) and writes them (from a worker thread), one writer at a time."""

    def __init__(self, out_dir: str | Path, backend_names: Sequence[str], extra: Mapping[str, Any]) -> None:
        self.out_dir, self.names, self.extra = Path(out_dir), list(backend_names), dict(extra)
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self.finished = False

    def add(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)

    def write(self, final: bool, summary_options: Mapping[str, Any], extra_metrics: Mapping[str, Any],
              extra_files: Mapping[str, str] | None = None) -> None:
        with self._lock:
            if self.finished:
                return
            outcomes = list(self.outcomes)
            states = [o.state() for o in outcomes]
            names = {o.id: o.backend_name for o in outcomes}
            metrics = summarize(states, **summary_options)
            per = {n: sum(o.backend_name == n for o in outcomes) for n in self.names}
            metrics.update(backend="gateway", backends=self.names, requests_per_backend=per, **self.extra,
                           **extra_metrics)
            write_run(self.out_dir, states, None, metrics, extra_files, run_status=COMPLETE if final else RUNNING,
                      extra_request_columns={"backend": lambda s: names[s.id]})
            self.finished = final
