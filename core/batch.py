"""What one step runs, and the step features every cost model and the calibration use."""

from __future__ import annotations

from dataclasses import dataclass, field

from core.request import RequestState


@dataclass(frozen=True, slots=True)
class Chunk:
    """``num_tokens`` tokens of one request, starting at token index ``start`` (= tokens already cached)."""

    state: RequestState
    start: int
    num_tokens: int
    samples: bool  # the chunk completes the sequence, so the step samples a token for it
    is_decode: bool  # one token at the end of a sequence that already has outputs
    # Speculative decoding: draft tokens verified after the decode token, in the same forward pass (the step
    # computes 1 + num_draft_tokens positions and may sample up to 1 + num_draft_tokens tokens). Only decodes draft.
    num_draft_tokens: int = 0

    @classmethod
    def next(cls, state: RequestState, num_tokens: int, num_draft_tokens: int = 0) -> Chunk:
        """The next ``num_tokens`` uncomputed tokens of ``state`` (flags fixed at build time), plus
        ``num_draft_tokens`` speculative positions when the chunk is a decode."""
        start = state.num_computed_tokens
        total = state.request.prompt_len + len(state.output_token_ids)
        if not 0 < num_tokens <= total - start:
            raise ValueError(f"request {state.id}: chunk of {num_tokens} tokens, {total - start} remain")
        samples = start + num_tokens == total
        is_decode = samples and num_tokens == 1 and total > state.request.prompt_len
        if num_draft_tokens and (num_draft_tokens < 0 or not is_decode):
            raise ValueError(f"request {state.id}: only a decode chunk can carry draft tokens "
                             f"(got {num_draft_tokens} on a {num_tokens}-token chunk at {start}/{total})")
        return cls(state, start, num_tokens, samples, is_decode, num_draft_tokens)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def num_positions(self) -> int:
        """Positions the step computes for this chunk (KV written): its tokens plus its draft tokens."""
        return self.num_tokens + self.num_draft_tokens


@dataclass(frozen=True, slots=True)
class StepFeatures:
    """Shape of one step. Prefill = every chunk that is not a decode (recompute included).

    attention_pairs: sum over prefill chunks of n*c + n*(n+1)/2 (n = chunk length, c = cached context),
        the (query, key) pairs of causal attention including the cached prefix.
    kv_tokens_read: sum over decode chunks of the context each decode attends to (c + 1; c + 1 + d with d draft
        tokens: a speculative decode verifies its d drafts in the same pass).
    prefill_kv_tokens: sum over prefill chunks of c + n (KV a prefill chunk's attention touches).
    num_draft_tokens: draft tokens verified in this step (speculative decoding; 0 otherwise). They are also in
        ``num_batched_tokens``: a decode with d drafts computes 1 + d positions.
    max_decode_context / min_decode_context: the longest / shortest context a decode attends to (c + 1, as in
        ``kv_tokens_read``; 0 without decodes). With ``kv_tokens_read`` (their sum) they say how uneven the decodes'
        contexts are, which an attention kernel pays for beyond the mean (``sim.cost.profiled``: the skew
        correction); ``max_context_len`` also covers prefill chunks, so it cannot tell.
    """

    num_seqs: int = 0
    num_batched_tokens: int = 0
    num_prefill_seqs: int = 0
    num_prefill_tokens: int = 0
    num_decode_seqs: int = 0
    attention_pairs: int = 0
    kv_tokens_read: int = 0
    prefill_kv_tokens: int = 0
    max_context_len: int = 0
    num_draft_tokens: int = 0
    max_decode_context: int = 0
    min_decode_context: int = 0

    @property
    def kind(self) -> str:
        """prefill | decode | mixed (prefill chunks and decodes) | verify (decodes with draft tokens) | empty."""
        pre, dec = self.num_prefill_tokens > 0, self.num_decode_seqs > 0
        return ("mixed" if pre and dec else "prefill" if pre else "empty" if not dec
                else "verify" if self.num_draft_tokens else "decode")

    @classmethod
    def of(cls, chunks: list[Chunk]) -> StepFeatures:
        n_pre = t_pre = n_dec = pairs = kv = pre_kv = max_ctx = tokens = drafts = max_dec = 0
        min_dec = -1
        for ch in chunks:
            n, c = ch.num_tokens + ch.num_draft_tokens, ch.start
            tokens += n
            if c + n > max_ctx:
                max_ctx = c + n
            if ch.is_decode:
                n_dec += 1
                kv += c + n
                drafts += ch.num_draft_tokens
                if c + n > max_dec:
                    max_dec = c + n
                if min_dec < 0 or c + n < min_dec:
                    min_dec = c + n
            else:
                n_pre += 1
                t_pre += n
                pairs += n * c + n * (n + 1) // 2
                pre_kv += c + n
        return cls(len(chunks), tokens, n_pre, t_pre, n_dec, pairs, kv, pre_kv, max_ctx, drafts, max_dec,
                   max(min_dec, 0))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(cls.__dataclass_fields__)


# Features added after the first recordings: a steps.csv or profile.csv written before them lacks their columns,
# read as 0 (no drafts; decode context spread unknown).
LATER_FEATURES = frozenset({"num_draft_tokens", "max_decode_context", "min_decode_context"})


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """One KV block copied between the device pool and the host tier (``core.host_tier``) before the step's forward
    pass. ``kind``: ``swap_out`` / ``spill`` (device -> host: a preempted request's block / an evicted prefix
    block), ``swap_in`` / ``load`` (host -> device: a resumed request's block / a prefix hit on the host)."""

    kind: str
    device_block: int
    host_block: int

    @property
    def to_host(self) -> bool:
        return self.kind in TO_HOST


TO_HOST = frozenset({"swap_out", "spill"})
COPY_KINDS = ("swap_out", "spill", "swap_in", "load")


@dataclass(slots=True)
class Batch:
    """One step: the chunks to run, the ids of requests preempted while building it, and the KV block copies to
    perform first, in order (host tier; empty without one)."""

    chunks: list[Chunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    features: StepFeatures = field(init=False)
    copies: tuple[BlockCopy, ...] = ()

    def __post_init__(self) -> None:
        self.features = StepFeatures.of(self.chunks)

    def __len__(self) -> int:
        return len(self.chunks)

    @property
    def empty(self) -> bool:
        return not self.chunks
