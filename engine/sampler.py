"""Next-token sampling: greedy, or temperature with top-k / top-p (nucleus) filtering from a seeded generator.

Each logits row is sampled with its own request's ``SamplingParams`` (``core.request``; re-exported here), or the
engine's default when the request carries none.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from core.request import RequestState, SamplingParams

__all__ = ["Sampler", "SamplingParams"]

SEEDED_PRUNE_MIN = 1024  # per-request generators kept before those of ended requests are swept out


class Sampler:
    """Turns logits [n, V] into token ids [n] (int64).

    ``params`` is the engine's default. Called with the sampled rows' request states, each row uses its request's
    ``Request.sampling`` when set: greedy rows are taken by max together, random rows with temperature / top-k /
    top-p, drawing from the engine's generator (seeded with ``seed``), or from the request's own generator when
    its params carry a ``seed`` (kept per request until ``release``; its tokens then do not depend on what else
    is batched with it).
    """

    def __init__(self, params: SamplingParams | None = None, seed: int = 0,
                 device: torch.device | str = "cpu") -> None:
        self.params = params or SamplingParams()
        if self.params.seed is not None:
            raise ValueError("the engine's default sampling params take no seed: its generator is seeded with the "
                             "run's seed (a seed belongs to one request's params)")
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._seeded: dict[str, tuple[RequestState, torch.Generator]] = {}
        self._prune_at = SEEDED_PRUNE_MIN

    def __call__(self, logits: torch.Tensor, states: Sequence[RequestState] | None = None) -> torch.Tensor:
        """``states``: the request of each row (None, or no request with its own params: the default for all)."""
        if states is None:
            return self.sample(logits, self.params, self.generator)
        if len(states) != logits.shape[0]:
            raise ValueError(f"{logits.shape[0]} logits rows but {len(states)} request states")
        default = self.params
        params = [s.request.sampling or default for s in states]
        if all(p is default for p in params):
            return self.sample(logits, default, self.generator)
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        if greedy:
            rows = torch.tensor(greedy, device=logits.device)
            out[rows] = logits[rows].max(dim=-1).indices
        groups: dict[SamplingParams, list[int]] = {}  # rows on the engine's generator, by params, in row order
        for i, p in enumerate(params):
            if p.greedy:
                continue
            if p.seed is None:
                groups.setdefault(p, []).append(i)
            else:  # always alone: the same computation whatever shares the step
                out[i] = self.sample(logits[i:i + 1], p, self._generator(states[i], p.seed))[0]
        for p, idx in groups.items():
            rows = torch.tensor(idx, device=logits.device)
            out[rows] = self.sample(logits[rows], p, self.generator)
        return out

    def release(self, request_id: str) -> None:
        """Forget an ended request's own generator."""
        self._seeded.pop(request_id, None)

    def _generator(self, state: RequestState, seed: int) -> torch.Generator:
        entry = self._seeded.get(state.id)
        if entry is not None and entry[0] is state:
            return entry[1]
        if len(self._seeded) >= self._prune_at:  # safety net for drivers that never call release()
            for rid in [k for k, e in self._seeded.items() if e[0].status.terminal]:
                del self._seeded[rid]
            self._prune_at = max(SEEDED_PRUNE_MIN, 2 * len(self._seeded))
        gen = torch.Generator(device=self.device).manual_seed(seed)
        self._seeded[state.id] = (state, gen)
        return gen

    @staticmethod
    def sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> torch.Tensor:
        """Every row of ``logits`` with the same params, random draws from ``generator``."""
        if p.greedy:
            return logits.max(dim=-1).indices  # faster than argmax on CPU; same first-maximum rule
        logits = logits.float() / p.temperature
        if 0 < p.top_k < logits.shape[-1]:
            kth = logits.topk(p.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            probs = sorted_logits.softmax(dim=-1)
            # drop a token once the more likely ones already hold top_p of the mass (the first always stays)
            drop = probs.cumsum(dim=-1) - probs >= p.top_p
            drop[:, 0] = False
            logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = logits.softmax(dim=-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
