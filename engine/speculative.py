"""Draft proposers for speculative decoding: where the d draft tokens of a decode come from.

The scheduler decides how many drafts a decode verifies (``Chunk.num_draft_tokens``, from the replica's
``SpeculationPolicy``); a proposer fills them in just before the step, and ``ModelRunner.speculate`` verifies
them with the target in the same forward pass. A proposer always returns exactly d tokens per chunk: padding
tokens are simply rejected by the target, so the batch keeps the shape the scheduler budgeted.

- ``DraftModelProposer``: a smaller model with the same vocabulary drafts greedily, with its own KV pool.
- ``NgramProposer``: prompt-lookup decoding. The last n tokens (n from ``max_n`` down to ``min_n``) are looked
  up earlier in the request's prompt + outputs; the tokens that followed their latest earlier occurrence are the
  drafts. No model; it pays on repetitive text (code edits, extraction, retrieval-grounded answers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from core.batch import Batch, Chunk
from core.request import RequestState

if TYPE_CHECKING:
    from core.kv_cache import KVCacheManager
    from engine.runner import ModelRunner


class Proposer(Protocol):
    def propose(self, chunks: Sequence[Chunk], tokens: Callable[[Chunk], list[int]]) -> dict[str, list[int]]:
        """Draft tokens for each chunk (``chunk.num_draft_tokens`` of them), by request id. ``tokens(chunk)``:
        the request's prompt + outputs so far."""
        ...

    def release(self, request_id: str) -> None:
        """A request ended: drop what the proposer kept for it."""


class NgramProposer:
    """Prompt lookup: drafts copy what followed the latest earlier occurrence of the sequence's last n tokens."""

    def __init__(self, min_n: int = 1, max_n: int = 3) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"spec.ngram: need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n

    def release(self, request_id: str) -> None:
        pass

    def propose(self, chunks: Sequence[Chunk], tokens: Callable[[Chunk], list[int]]) -> dict[str, list[int]]:
        return {ch.state.id: self.lookup(tokens(ch), ch.num_draft_tokens) for ch in chunks if ch.num_draft_tokens}

    def lookup(self, seq: Sequence[int], k: int) -> list[int]:
        """``k`` drafts for ``seq``: the continuation of the longest matching n-gram, padded with the last token."""
        arr = np.asarray(seq, dtype=np.int64)
        L = arr.size
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            # windows that start before the suffix itself and equal it; the latest has the freshest continuation
            windows = np.lib.stride_tricks.sliding_window_view(arr[:L - 1], n)
            hits = np.flatnonzero((windows == arr[L - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                out = arr[start:start + k].tolist()
                return out + [int(arr[-1])] * (k - len(out))
        return [int(arr[-1])] * k


class DraftModelProposer:
    """Drafts from a smaller model with the target's vocabulary, greedily (a one-hot proposal, which
    ``Sampler.verify`` turns into exact rejection sampling for random sampling).

    The draft model has its own KV pool and block tables (its own ``KVCacheManager``, no prefix caching): a
    shadow of each drafting request holds the request's real tokens plus the drafts of the last step. Each call
    first finds how much of the shadow's KV still matches the real sequence (the accepted drafts survive, the
    rest is recomputed), then runs one pass over every request's missing tokens (which yields its first draft)
    and one decode pass per further draft. When the draft pool is full a request gets padding drafts (all
    rejected) until blocks free up. ``release`` drops a finished request's shadow and blocks.
    """

    def __init__(self, runner: ModelRunner, kv: KVCacheManager) -> None:
        self.runner, self.kv = runner, kv
        self._shadows: dict[str, tuple[RequestState, RequestState]] = {}  # id -> (real state, shadow)

    def release(self, request_id: str) -> None:
        entry = self._shadows.pop(request_id, None)
        if entry is not None:
            self.kv.free(entry[1], 0.0)
        self.runner.release(request_id)

    def _sync(self, state: RequestState) -> RequestState:
        """The request's shadow, its outputs set to the real ones and its KV cut to what still matches them."""
        entry = self._shadows.get(state.id)
        if entry is None or entry[0] is not state:
            if entry is not None:
                self.kv.free(entry[1], 0.0)
            shadow = RequestState(state.request, output_token_ids=list(state.output_token_ids))
            self._shadows[state.id] = (state, shadow)
            return shadow
        shadow = entry[1]
        old, real = shadow.output_token_ids, state.output_token_ids
        same = 0
        for a, b in zip(old, real, strict=False):
            if a != b:
                break
            same += 1
        shadow.output_token_ids = list(real)
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, state.request.prompt_len + same)
        return shadow

    def _room(self, shadow: RequestState, n: int) -> bool:
        if self.kv.num_blocks_held(shadow.id):
            return self.kv.allocate(shadow, n, 0.0)
        return self.kv.admit(shadow, n, 0.0)

    def propose(self, chunks: Sequence[Chunk], tokens: Callable[[Chunk], list[int]]) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        want: dict[str, int] = {}
        active: list[RequestState] = []
        for ch in chunks:
            if not ch.num_draft_tokens:
                continue
            shadow = self._sync(ch.state)
            if self._room(shadow, shadow.num_tokens - shadow.num_computed_tokens + ch.num_draft_tokens - 1):
                active.append(shadow)
                want[shadow.id] = ch.num_draft_tokens
                out[shadow.id] = []
            else:  # the draft pool is full: pad (rejected by the target) and retry next step from scratch
                self.release(ch.state.id)
                last = (ch.state.output_token_ids or [0])[-1]
                out[ch.state.id] = [last] * ch.num_draft_tokens
        step = [Chunk.next(s, s.num_tokens - s.num_computed_tokens) for s in active]
        while step:
            drafted = self.runner.execute(Batch(step), self.kv.block_table)
            for ch, tok in zip(step, drafted, strict=True):
                ch.state.num_computed_tokens = ch.end
                ch.state.output_token_ids.append(tok)
                out[ch.state.id].append(tok)
            step = [Chunk.next(ch.state, 1) for ch in step if len(out[ch.state.id]) < want[ch.state.id]]
        return out
