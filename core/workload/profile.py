"""A profiling workload for calibrating a cost model against any server from request-level timings.

A server seen from outside shows no steps, only when each request's tokens arrive. This workload makes those
times easy to read as steps (``experiments.calibration.samples.request_samples`` reads them):

- **Isolated prefills** (``concurrency: [1]``): one request at a time, each sent when the previous one has ended,
  over a range of prompt lengths. An isolated request's TTFT is one prefill of its prompt (a few steps when the
  server chunks it) plus a fixed per-request overhead (HTTP, tokenisation).
- **Decode at known batch and context** (``concurrency: [N, ...]``): N clients in a closed loop whose k-th requests
  all have the same prompt length L and output length M, so they start together, decode in lockstep and end
  together: between the last first token and the first finish of such a wave, every inter-token gap is one decode
  step of batch N at contexts ~L + tokens so far.

Phases run in **decreasing** concurrency: client c takes part in every phase with N > c and retires after, so
each client's k-th request belongs to the same phase and prompt length as every other client's (no client ever
has to wake another). Within a phase, each of ``repeats`` rounds visits every prompt length once, in a seeded
random order (machine drift then does not line up with length). A client's next request is due ``gap_s`` after
its previous one ended.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from core.checks import check_float, check_int
from core.request import Request, RequestState

KEY = "workload"


def auto_lengths(lo: int, hi: int, num: int) -> list[int]:
    """``num`` prompt lengths from ``lo`` to ``hi``, geometrically spaced, rounded, duplicates dropped."""
    if hi < lo:
        return [hi] if hi >= 1 else []
    return sorted({int(round(x)) for x in np.geomspace(lo, hi, num)})


class ProfileWorkload:
    """Waves of equal requests at fixed concurrency levels x prompt lengths (see the module docstring).

    ``prompt_lens``: a list, or ``auto``: ``num_prompt_lens`` lengths from ``min_prompt_len`` to
    ``max_model_len - output_len`` (geometric). ``max_kv_tokens``: a (concurrency, length) pair whose wave needs
    more KV tokens than this (N x (L + output_len)) is skipped, so a server never preempts during a profile;
    null: no limit. ``warmup_waves``: the first waves are flagged warmup (first-call costs of a server).
    Request ids are ``<id_prefix><k>``; the prompt content follows from the id and the run's seed, so a second
    profile against a server with a prefix cache should use another ``id_prefix`` or seed.
    """

    def __init__(self, output_len: int, concurrency: Sequence[int] | int = (1,), prompt_lens: Any = "auto",
                 repeats: int = 1, max_model_len: int | None = None, min_prompt_len: int = 16,
                 num_prompt_lens: int = 8, max_kv_tokens: int | None = None, gap_s: float = 0.0,
                 warmup_waves: int = 0, id_prefix: str = "p", seed: int = 0) -> None:
        self.output_len = check_int(output_len, f"{KEY}.output_len", 1)
        conc = [concurrency] if isinstance(concurrency, int) else list(concurrency or [])
        if not conc:
            raise ValueError(f"{KEY}.concurrency: give at least one level, e.g. [16, 4, 1]")
        self.concurrency = sorted({check_int(n, f"{KEY}.concurrency", 1) for n in conc}, reverse=True)
        self.repeats = check_int(repeats, f"{KEY}.repeats", 1)
        self.max_model_len = None if max_model_len is None else check_int(max_model_len, f"{KEY}.max_model_len", 2)
        self.gap_s = check_float(gap_s, f"{KEY}.gap_s")
        self.warmup_waves = check_int(warmup_waves, f"{KEY}.warmup_waves", 0)
        self.max_kv_tokens = None if max_kv_tokens is None else check_int(max_kv_tokens, f"{KEY}.max_kv_tokens", 1)
        self.seed = check_int(seed, f"{KEY}.seed", 0)
        if not isinstance(id_prefix, str) or not id_prefix:
            raise ValueError(f"{KEY}.id_prefix={id_prefix!r}; allowed: a non-empty string")
        self.id_prefix = id_prefix
        if prompt_lens == "auto":
            if self.max_model_len is None:
                raise ValueError(f"{KEY}.prompt_lens=auto needs {KEY}.max_model_len (e.g. ${{model.max_model_len}})")
            lo = check_int(min_prompt_len, f"{KEY}.min_prompt_len", 1)
            lens = auto_lengths(lo, self.max_model_len - self.output_len,
                                check_int(num_prompt_lens, f"{KEY}.num_prompt_lens", 1))
        else:
            lens = [prompt_lens] if isinstance(prompt_lens, int) else list(prompt_lens or [])
            lens = sorted({check_int(n, f"{KEY}.prompt_lens", 1) for n in lens})
            if self.max_model_len is not None:
                too_long = [n for n in lens if n + self.output_len > self.max_model_len]
                if too_long:
                    raise ValueError(f"{KEY}.prompt_lens {too_long} + output_len {self.output_len} exceed "
                                     f"max_model_len {self.max_model_len}")
        if not lens:
            raise ValueError(f"{KEY}.prompt_lens: no length fits max_model_len {self.max_model_len} with "
                             f"output_len {self.output_len}")
        self.prompt_lens = lens
        self.waves = self._plan()
        if not self.waves:
            raise ValueError(f"{KEY}: every (concurrency, prompt length) wave needs more than max_kv_tokens="
                             f"{self.max_kv_tokens} KV tokens")
        self.skipped = [(n, L) for n in self.concurrency for L in self.prompt_lens if not self._fits(n, L)]
        self._reset()

    def _fits(self, n: int, length: int) -> bool:
        return self.max_kv_tokens is None or n * (length + self.output_len) <= self.max_kv_tokens

    def _plan(self) -> list[tuple[int, int]]:
        """(concurrency, prompt length) of each wave, in order: phases by decreasing concurrency."""
        g = np.random.default_rng([self.seed, 0x9F0F])
        waves = []
        for n in self.concurrency:
            lens = [L for L in self.prompt_lens if self._fits(n, L)]
            for _ in range(self.repeats):
                waves += [(n, lens[i]) for i in g.permutation(len(lens)).tolist()]
        return waves

    @property
    def num_requests(self) -> int:
        return sum(n for n, _ in self.waves)

    def _reset(self) -> None:
        self._next_wave = [0] * self.concurrency[0]  # per client: index of its next wave
        self._client_of: dict[str, int] = {}
        self._issued = 0

    def _issue(self, client: int, t: float) -> Request | None:
        w = self._next_wave[client]
        while w < len(self.waves) and self.waves[w][0] <= client:
            w += 1  # concurrency only decreases: this client has retired
        if w >= len(self.waves):
            return None
        self._next_wave[client] = w + 1
        n, length = self.waves[w]
        req = Request(id=f"{self.id_prefix}{self._issued}", arrival_s=t, prompt_len=length,
                      max_new_tokens=self.output_len, warmup=w < self.warmup_waves)
        self._issued += 1
        self._client_of[req.id] = client
        return req

    def initial(self) -> Iterator[Request]:
        self._reset()
        for c in range(self.concurrency[0]):
            req = self._issue(c, 0.0)
            if req is not None:
                yield req

    def on_finish(self, state: RequestState, now: float) -> Request | None:
        c = self._client_of.pop(state.id, None)
        if c is None:
            raise ValueError(f"profile workload: request {state.id!r} was not issued by it (or ended twice)")
        return self._issue(c, now + self.gap_s)
