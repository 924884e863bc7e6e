"""Batches of chosen shapes, placed in a KV pool the way a replica places them (profiling, benchmarks, warm-up).

A shape is a list of prefill chunks, each ``(cached, n)``: ``n`` new tokens after ``cached`` tokens already in the
cache, and a list of decodes, each the context it attends to (its new token included). ``ShapedBatch`` makes one
request per chunk and per decode and admits them with ``admit_chunk``: ``KVCacheManager.admit`` then
``KVCacheManager.allocate``, the calls a scheduler makes through its view, so block tables, refcounts and pool
accounting are the real ones. Nothing is computed: the ``cached`` tokens (and a decode's context) count as done,
as if earlier steps had run them. The requests carry no prefix-cache hashes, so they neither hit nor fill the
prefix cache.
"""

from __future__ import annotations

from collections.abc import Sequence

from core.batch import Batch, Chunk
from core.kv_cache import KVCacheManager
from core.request import Request, RequestState, Status


def admit_chunk(kv: KVCacheManager, state: RequestState, computed: int, num_tokens: int, now: float = 0.0,
                num_draft_tokens: int = 0) -> Chunk:
    """Room in ``kv`` for tokens ``[computed, computed + num_tokens)`` of ``state`` (plus ``num_draft_tokens``
    speculative positions after a decode), and that chunk.

    A request that is not RUNNING is admitted first (``KVCacheManager.admit`` with its first ``computed`` tokens,
    as if earlier steps had computed them) and becomes RUNNING; a RUNNING one (it holds blocks) is only grown.
    Then ``KVCacheManager.allocate`` makes room for the chunk. ``num_computed_tokens`` is set to ``computed``.
    Raises RuntimeError if the pool cannot hold the tokens."""
    if state.status is not Status.RUNNING:
        if not kv.admit(state, computed, now):
            raise RuntimeError(f"KV pool too small to admit {state.id} with {computed} tokens")
        state.status = Status.RUNNING
    state.num_computed_tokens = computed
    if not kv.allocate(state, num_tokens + num_draft_tokens, now):
        raise RuntimeError(f"KV pool too small for {num_tokens + num_draft_tokens} more tokens of {state.id}")
    return Chunk.next(state, num_tokens, num_draft_tokens)


def shape_blocks(prefills: Sequence[tuple[int, int]], decodes: Sequence[int], block_size: int) -> int:
    """KV blocks a shape holds while admitted."""
    lens = [c + n for c, n in prefills] + list(decodes)
    return sum(-(-t // block_size) for t in lens)


class ShapedBatch:
    """The requests of one step shape, admitted to a KV pool for each run of it and released after.

    ``prefills``: ``(cached, n)`` per chunk; its request has a prompt of ``cached + n`` tokens and one output to
    generate, so the chunk completes the prompt and samples. ``decodes``: context per decode (>= 2); its request
    has a prompt of ``context - 1`` tokens and one output token already (id 0), so its chunk is the decode of that
    token; with ``num_draft_tokens`` each decode also verifies that many drafts (speculative decoding). Requests are
    named ``{name}-p{i}`` and ``{name}-d{i}``, chunks come prefills first, in the given order.

    The same states serve every run (an engine executor materialises each prompt once): ``admit`` -> execute the
    batch -> ``release``, again. Prompt content is left to the executor (``core.prompt.materialize``)."""

    def __init__(self, prefills: Sequence[tuple[int, int]] = (), decodes: Sequence[int] = (),
                 name: str = "shape", num_draft_tokens: int = 0) -> None:
        self.prefills = tuple((int(c), int(n)) for c, n in prefills)
        self.decodes = tuple(int(t) for t in decodes)
        self.num_draft_tokens = int(num_draft_tokens)
        if any(c < 0 or n < 1 for c, n in self.prefills) or any(t < 2 for t in self.decodes):
            raise ValueError(f"shape {name}: prefills need cached >= 0 and n >= 1, decodes a context >= 2; got "
                             f"prefills={self.prefills}, decodes={self.decodes}")
        self.states: list[RequestState] = [RequestState(Request(f"{name}-p{i}", 0.0, c + n, 1))
                                           for i, (c, n) in enumerate(self.prefills)]
        for i, t in enumerate(self.decodes):
            st = RequestState(Request(f"{name}-d{i}", 0.0, t - 1, 2 + self.num_draft_tokens))
            st.output_token_ids.append(0)
            self.states.append(st)
        # (computed, chunk tokens) of each state, in batch order
        self._chunks = [*self.prefills, *((t - 1, 1) for t in self.decodes)]

    def num_blocks(self, block_size: int) -> int:
        """KV blocks the shape holds while admitted."""
        return shape_blocks(self.prefills, [t + self.num_draft_tokens for t in self.decodes], block_size)

    def admit(self, kv: KVCacheManager, now: float = 0.0) -> Batch:
        """Admit every request to ``kv`` (``admit_chunk``) and return the step's Batch. Raises RuntimeError,
        leaving nothing held, if the pool is too small."""
        chunks = []
        try:
            for i, (st, (computed, n)) in enumerate(zip(self.states, self._chunks, strict=True)):
                drafts = self.num_draft_tokens if i >= len(self.prefills) else 0
                chunks.append(admit_chunk(kv, st, computed, n, now, drafts))
        except RuntimeError:
            self.release(kv, now)
            raise
        return Batch(chunks)

    def release(self, kv: KVCacheManager, now: float = 0.0) -> None:
        """Free the requests' blocks (tail blocks first, as a finished request's) so the shape can run again."""
        for st in self.states:
            kv.free(st, now)
            st.status = Status.WAITING
