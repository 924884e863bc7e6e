"""Requests: the immutable input and the mutable per-request state both backends advance."""

from __future__ import annotations

import enum
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field


class Status(enum.Enum):
    WAITING = "WAITING"
    RUNNING = "RUNNING"
    PREEMPTED = "PREEMPTED"  # back in the waiting queue; its KV was dropped and is recomputed
    FINISHED = "FINISHED"
    REJECTED = "REJECTED"
    TIMED_OUT = "TIMED_OUT"
    CANCELLED = "CANCELLED"  # the client went away or the server cancelled it (Replica.abort)

    @property
    def terminal(self) -> bool:
        return self in (Status.FINISHED, Status.REJECTED, Status.TIMED_OUT, Status.CANCELLED)


SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts
MIN_TEMPERATURE = 1e-2  # below it (but above 0) logits / temperature overflows; vLLM's floor too. 0 = greedy
MAX_LOGPROBS = 20  # most alternatives a request may ask for per token (OpenAI's limit)
PENALTY_RANGE = (-2.0, 2.0)  # presence / frequency penalties (OpenAI's range)
BIAS_RANGE = (-100.0, 100.0)  # logit_bias values (OpenAI's range)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the next token is drawn from the logits: greedy, or temperature with top-k / top-p (nucleus) filtering.

    An engine has a default (``conf/backend/engine.yaml``: temperature, top_p, top_k); a request may carry its own
    (``Request.sampling``). ``seed`` (requests only): the request draws from its own generator seeded with it, so
    its tokens do not depend on what else is batched with it; None: the engine's shared generator.

    Logit adjustments (requests only, as OpenAI / vLLM define them), applied before greedy or random choice:
    ``logit_bias`` ((token id, bias) pairs) is added first; then ``repetition_penalty`` divides positive (multiplies
    negative) logits of every token in the prompt or output so far; ``frequency_penalty`` x (times in the output)
    and ``presence_penalty`` (once in the output) are subtracted. ``logprobs`` (None: off): each output token's
    log-probability under the model's raw distribution and the ``logprobs`` most likely alternatives.
    Every float must be finite; temperature is 0 or at least ``MIN_TEMPERATURE``.
    """

    temperature: float = 0.0  # 0: greedy (argmax)
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0: no limit
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if not math.isfinite(t) or t < 0 or 0 < t < MIN_TEMPERATURE:
            raise ValueError(f"sampling.temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, "
                             f"got {t}")
        if not 0 < self.top_p <= 1:  # NaN fails this too
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]):
            raise ValueError(f"sampling.seed must be null or an int in [-2**63, 2**64), got {self.seed!r}")
        for key in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, key)
            if not PENALTY_RANGE[0] <= v <= PENALTY_RANGE[1]:
                raise ValueError(f"sampling.{key} must be in [{PENALTY_RANGE[0]}, {PENALTY_RANGE[1]}], got {v}")
        if not 0 < self.repetition_penalty <= 1e3:  # a finite positive factor
            raise ValueError(f"sampling.repetition_penalty must be in (0, 1000] (1 = off), got "
                             f"{self.repetition_penalty}")
        for tok, bias in self.logit_bias:
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0 \
                    or not BIAS_RANGE[0] <= bias <= BIAS_RANGE[1]:
                raise ValueError(f"sampling.logit_bias must map token ids >= 0 to biases in [{BIAS_RANGE[0]}, "
                                 f"{BIAS_RANGE[1]}], got {tok!r}: {bias!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"sampling.logprobs must be null or in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts_logits(self) -> bool:
        """Whether logits change before the choice (bias or a penalty): a greedy row then needs the full logits."""
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0 \
            or self.repetition_penalty != 1


@dataclass(frozen=True, slots=True)
class Request:
    """One request as a workload describes it.

    The prompt's *content* decides prefix sharing and comes in one of three forms:
    ``prompt_token_ids`` (real tokens), ``hash_ids`` (Mooncake-style content ids, each standing for
    ``tokens_per_hash_id`` fixed pseudo-random tokens, see ``core.prompt``) or neither (content unique to
    this request: it shares nothing). ``prompt_len`` is always set.

    Stop conditions: a request ends after ``max_new_tokens`` outputs, or at a stop token (the model's EOS ids
    unless ``ignore_eos``, plus ``stop_token_ids``) sampled after at least ``min_tokens`` other outputs; the stop
    token is kept as the last output token. An earlier stop token is an ordinary output token.
    """

    id: str
    arrival_s: float
    prompt_len: int
    max_new_tokens: int
    prompt_token_ids: tuple[int, ...] | None = None
    hash_ids: tuple[int, ...] | None = None
    tokens_per_hash_id: int = 512
    tenant: str = ""  # also the cache salt: different tenants never share KV blocks
    priority: int = 0  # lower value = more important (as in vLLM)
    slo_class: str = "default"
    ttft_deadline_s: float | None = None  # relative to arrival; used by SLO-aware schedulers
    warmup: bool = False  # run, but excluded from every metric
    # Request-level options (an API server sets them; workloads leave the defaults)
    sampling: SamplingParams | None = None  # None: the engine's default (the simulator ignores sampling)
    ignore_eos: bool | None = None  # None: the replica's default (SchedulerLimits.ignore_eos)
    min_tokens: int = 0  # a stop token (EOS or stop_token_ids) ends the request only after this many other tokens
    stop_token_ids: tuple[int, ...] = ()  # extra token ids that end the request (as vLLM's), even with ignore_eos

    def __post_init__(self) -> None:
        if self.prompt_len < 1:
            raise ValueError(f"request {self.id}: prompt_len must be >= 1, got {self.prompt_len}")
        if self.max_new_tokens < 1:
            raise ValueError(f"request {self.id}: max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.arrival_s < 0:
            raise ValueError(f"request {self.id}: arrival_s must be >= 0, got {self.arrival_s}")
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) != self.prompt_len:
            raise ValueError(f"request {self.id}: prompt_token_ids has {len(self.prompt_token_ids)} tokens, "
                             f"prompt_len says {self.prompt_len}")
        if self.hash_ids is not None and len(self.hash_ids) * self.tokens_per_hash_id < self.prompt_len:
            raise ValueError(f"request {self.id}: {len(self.hash_ids)} hash_ids x {self.tokens_per_hash_id} tokens "
                             f"cannot cover prompt_len {self.prompt_len}")
        if self.sampling is not None and not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"request {self.id}: sampling must be a SamplingParams or None, got {self.sampling!r}")
        if self.ignore_eos is not None and not isinstance(self.ignore_eos, bool):
            raise ValueError(f"request {self.id}: ignore_eos must be true, false or None, got {self.ignore_eos!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) \
                or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"request {self.id}: min_tokens must be an int in [0, max_new_tokens="
                             f"{self.max_new_tokens}], got {self.min_tokens!r}")
        if self.stop_token_ids:
            if not isinstance(self.stop_token_ids, tuple):  # a list from JSON: keep the request hashable
                object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
            if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
                raise ValueError(f"request {self.id}: stop_token_ids must be non-negative ints, "
                                 f"got {list(self.stop_token_ids)}")


class RepeatedTokens(Sequence[int]):
    """``n`` copies of one token id in O(1) memory: a finished simulated response (every output is the executor's
    placeholder token) as ``RequestState.compact`` leaves it. Equal to a list of the same ids; a slice is a list."""

    __slots__ = ("token", "n")

    def __init__(self, token: int, n: int) -> None:
        self.token, self.n = token, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.token] * len(range(*i.indices(self.n)))
        if not -self.n <= i < self.n:
            raise IndexError(f"token {i} of {self.n}")
        return self.token

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(other) == self.n and all(t == self.token for t in other)

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which are unhashable

    def __repr__(self) -> str:
        return f"[{self.token}] * {self.n}"


@dataclass(frozen=True, slots=True)
class FoldedTimes:
    """What an ended request keeps of its token times once a run's ITL pool took its ITL samples
    (``core.metrics.ITLPool``, ``output.tokens=none``): O(1) memory instead of 8 bytes a token."""

    max_stall_s: float | None  # as core.metrics defines it; None without tokens
    last_token_s: float | None


@dataclass(slots=True, eq=False)
class RequestState:
    """Mutable progress of one request on one replica.

    Token accounting follows vLLM v1: ``num_tokens`` = prompt + outputs so far; ``num_computed_tokens``
    of them have KV in the cache. A step that brings ``num_computed_tokens`` up to ``num_tokens`` samples
    one new output token. Recompute preemption sets ``num_computed_tokens`` back to 0.
    """

    request: Request
    id: str = field(init=False)  # = request.id, copied: read on every hot path
    status: Status = Status.WAITING
    replica: int = -1
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)  # RepeatedTokens once compacted
    num_cached_tokens: int = 0  # prefix-cache hit when first scheduled (tokens)
    num_preemptions: int = 0
    first_scheduled_s: float | None = None
    # when the serving loop took the request in: its first schedule() at or after arrival, i.e. the end of the step
    # in flight when it arrived (vLLM's queued_ts). Stamped only by a replica told to (``metrics.latency_from=
    # receipt``); when set, TTFT, E2E and queueing count from it instead of the arrival.
    received_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    # time of each output token (equal times: one multi-token event); a flat array of doubles (8 bytes a token,
    # no Python object per token), which is what the metrics need: TTFT, TPOT, every ITL sample, max stall.
    # Whole-response writers (loadgen) may assign any sequence of floats. A run without a tokens file folds them
    # when the request ends (``fold``).
    token_times: Sequence[float] = field(default_factory=lambda: array("d"))
    folded: FoldedTimes | None = None  # set when the times went into an ITL pool (token_times is then empty)
    reason: str = ""  # why REJECTED / TIMED_OUT / CANCELLED
    block_hashes: Sequence[int] = field(default_factory=list)  # chained hashes of the prompt's full blocks
    # token ids that end this request (EOS unless ignored, plus its stop_token_ids); set once by Replica.add
    stop_token_ids: frozenset[int] = frozenset()
    num_draft_proposed: int = 0  # speculative decoding: draft tokens verified for this request so far
    num_draft_accepted: int = 0  # ... and how many of them the target accepted
    num_draft_rejections: int = 0  # verify steps that ended at a rejected draft (the rest accepted all)
    # per sampled token when the request's sampling asks for logprobs (the engine's sampler appends them): the
    # token's log-probability and its alternatives, (logprob, ((token id, logprob), ...)); None otherwise
    logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] | None = None

    def __post_init__(self) -> None:
        self.id = self.request.id

    def add_token(self, token_id: int, time_s: float) -> None:
        """One sampled output token at ``time_s`` (the replica's one way to append outputs)."""
        self.output_token_ids.append(token_id)
        self.token_times.append(time_s)
        if self.first_token_s is None:
            self.first_token_s = time_s

    def add_tokens(self, token_ids: Sequence[int], times_s: float | Sequence[float]) -> None:
        """Several output tokens at once: all at one time (``times_s`` a float: one multi-token event) or one time
        each (a sequence as long as ``token_ids``, e.g. a fast-forwarded run of decode steps)."""
        n = len(token_ids)
        if isinstance(times_s, int | float):
            times = [times_s] * n
        else:
            times = times_s
            if len(times) != n:
                raise ValueError(f"request {self.id}: {n} tokens but {len(times)} times")
        if not n:
            return
        self.output_token_ids.extend(token_ids)
        self.token_times.extend(times)
        if self.first_token_s is None:
            self.first_token_s = times[0]

    def compact(self) -> None:
        """Once the request has ended: output ids that are all one token (the simulator's) as ``RepeatedTokens``,
        so a run that keeps every request of a long trace holds 8 bytes a token (its times), not 16; the block
        hashes as a flat array (8 bytes a block, not a Python int each once the cache has let go of them)."""
        out = self.output_token_ids
        if len(out) > 1 and not isinstance(out, RepeatedTokens) and out.count(out[0]) == len(out):
            self.output_token_ids = RepeatedTokens(out[0], len(out))
        if isinstance(self.block_hashes, list) and self.block_hashes:
            self.block_hashes = array("q", self.block_hashes)
        self.logprobs = None  # handed out while it ran; no run file keeps them

    def fold(self, max_stall_s: float | None) -> None:
        """Drop the token times (their ITL samples are pooled elsewhere), keeping what the metrics still need."""
        self.folded = FoldedTimes(max_stall_s, self.last_token_s)
        self.token_times = array("d")

    @property
    def last_token_s(self) -> float | None:
        """Time of the latest output token (None before the first)."""
        if self.token_times:
            return self.token_times[-1]
        return self.folded.last_token_s if self.folded is not None else None

    @property
    def num_tokens(self) -> int:
        return self.request.prompt_len + len(self.output_token_ids)

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens still to compute before the next token can be sampled."""
        return self.request.prompt_len + len(self.output_token_ids) - self.num_computed_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def in_prefill(self) -> bool:
        """True until the prompt (plus any outputs to recompute) is in the cache."""
        out = self.output_token_ids
        return not out or self.request.prompt_len + len(out) - self.num_computed_tokens > 1
