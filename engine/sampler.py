"""Next-token sampling: greedy, or temperature with top-k / top-p (nucleus) filtering from a seeded generator.

Each logits row is sampled with its own request's ``SamplingParams`` (``core.request``; re-exported here), or the
engine's default when the request carries none. A request's logit bias and presence / frequency / repetition
penalties adjust its row first (``adjust``); its logprobs, when asked, go to ``RequestState.logprobs``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from core.request import RequestState, SamplingParams
from kernels.cpu_native import argmax_rows

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
        raw = logits
        if any(p.adjusts_logits for p in params):
            logits = logits.float().clone()
            for i, p in enumerate(params):
                if p.adjusts_logits:
                    logits[i] = adjust(logits[i], p, states[i])
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        if greedy:
            rows = torch.tensor(greedy, device=logits.device)
            out[rows] = argmax_rows(logits[rows])
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
        for i, p in enumerate(params):
            if p.logprobs is not None:
                record_logprobs(states[i], raw[i:i + 1], out[i:i + 1].tolist(), p.logprobs)
        return out

    def all_greedy(self, states: Sequence[RequestState] | None = None) -> bool:
        """Whether every row (``states`` as in ``__call__``) takes its argmax."""
        if states is None:
            return self.params.greedy
        return all(_plain_greedy(s.request.sampling or self.params) for s in states)

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

    def verify(self, logits: torch.Tensor, drafts: Sequence[int], state: RequestState) -> list[int]:
        """Speculative decoding: the tokens a decode with ``drafts`` yields, given the target's ``logits`` at its
        1 + d positions (row i follows the decode token and drafts[:i]).

        Greedy: the drafts that equal the target's argmax, then the target's token at the first mismatch (or
        after the last draft): exactly what d + 1 plain greedy decodes give. Random: rejection sampling, which
        keeps the target's distribution for any proposal; drafts here are deterministic (a one-hot proposal q), so
        draft x is accepted with probability p(x), and a rejection draws from p with x removed (max(p - q, 0)).
        """
        p = state.request.sampling or self.params
        d = len(drafts)
        raw = logits
        if p.adjusts_logits:  # row i follows drafts[:i]: its history has them
            logits = torch.stack([adjust(logits[i], p, state, drafts[:i]) for i in range(d + 1)])
        out = self._verify(logits, drafts, state, p)
        if p.logprobs is not None:
            record_logprobs(state, raw[:len(out)], out, p.logprobs)
        return out

    def _verify(self, logits: torch.Tensor, drafts: Sequence[int], state: RequestState,
                p: SamplingParams) -> list[int]:
        d = len(drafts)
        if p.greedy:
            target = argmax_rows(logits).tolist()
            a = 0
            while a < d and drafts[a] == target[a]:
                a += 1
            return [*drafts[:a], target[a]]
        gen = self.generator if p.seed is None else self._generator(state, p.seed)
        probs = self.probabilities(logits, p)
        u = torch.rand(d, generator=gen, device=probs.device).tolist() if d else []
        for i, x in enumerate(drafts):
            if u[i] >= float(probs[i, x]):
                residual = probs[i].clone()
                residual[x] = 0.0
                if float(residual.sum()) <= 0:  # p was one-hot on x (u >= 1 cannot happen); keep x
                    return [*drafts[:i], x]
                return [*drafts[:i], int(torch.multinomial(residual, 1, generator=gen))]
        return [*drafts, int(torch.multinomial(probs[d], 1, generator=gen))]

    @staticmethod
    def sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> torch.Tensor:
        """Every row of ``logits`` with the same params, random draws from ``generator``."""
        if p.greedy:
            return argmax_rows(logits)  # the first maximum, as torch's max(dim=-1).indices
        return torch.multinomial(Sampler.probabilities(logits, p), 1, generator=generator).squeeze(-1)

    @staticmethod
    def probabilities(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        """The distribution random sampling draws from: softmax of logits / temperature, top-k / top-p filtered."""
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
        return logits.softmax(dim=-1)


def _plain_greedy(p: SamplingParams) -> bool:
    """Greedy on the model's own logits with nothing to report: the model may take the argmax without them."""
    return p.greedy and not p.adjusts_logits and p.logprobs is None


def adjust(row: torch.Tensor, p: SamplingParams, state: RequestState, extra: Sequence[int] = ()) -> torch.Tensor:
    """One logits row [V] with ``p``'s logit bias and penalties applied (``SamplingParams``), given the request's
    prompt and its outputs so far (plus ``extra``: drafts ahead of this row); returns a new float32 row."""
    row = row.float().clone()
    vocab, dev = row.shape[-1], row.device
    if p.logit_bias:
        bias = [(t, b) for t, b in p.logit_bias if t < vocab]
        if bias:
            ids = torch.tensor([t for t, _ in bias], device=dev)
            row.index_add_(0, ids, torch.tensor([b for _, b in bias], device=dev, dtype=row.dtype))
    output = [*state.output_token_ids, *extra]
    if p.repetition_penalty != 1:
        seen = {*(state.request.prompt_token_ids or ()), *output}
        if seen:
            ids = torch.tensor(sorted(seen), device=dev)
            vals = row[ids]
            row[ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if output and (p.frequency_penalty or p.presence_penalty):
        ids, counts = torch.tensor(output, device=dev).unique(return_counts=True)
        row.index_add_(0, ids, -(p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty))
    return row


def record_logprobs(state: RequestState, raw: torch.Tensor, tokens: Sequence[int], top: int) -> None:
    """Append to ``state.logprobs``, for token j sampled from row j of ``raw`` (the model's logits), its
    log-probability and the ``top`` most likely tokens with theirs."""
    logp = raw.float().log_softmax(dim=-1)
    best = logp.topk(top, dim=-1) if top else None
    if state.logprobs is None:
        state.logprobs = []
    for j, tok in enumerate(tokens):
        alts = () if best is None else tuple(zip(best.indices[j].tolist(), best.values[j].tolist(), strict=True))
        state.logprobs.append((float(logp[j, tok]), alts))
