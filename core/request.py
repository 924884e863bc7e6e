"""Requests: the immutable input and the mutable per-request state both backends advance."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Status(enum.Enum):
    WAITING = "WAITING"
    RUNNING = "RUNNING"
    PREEMPTED = "PREEMPTED"  # back in the waiting queue; its KV was dropped and is recomputed
    FINISHED = "FINISHED"
    REJECTED = "REJECTED"
    TIMED_OUT = "TIMED_OUT"

    @property
    def terminal(self) -> bool:
        return self in (Status.FINISHED, Status.REJECTED, Status.TIMED_OUT)


@dataclass(frozen=True, slots=True)
class Request:
    """One request as a workload describes it.

    The prompt's *content* decides prefix sharing and comes in one of three forms:
    ``prompt_token_ids`` (real tokens), ``hash_ids`` (Mooncake-style content ids, each standing for
    ``hash_block_size`` fixed pseudo-random tokens, see ``core.prompt``) or neither (content unique to
    this request: it shares nothing). ``prompt_len`` is always set.
    """

    id: str
    arrival_s: float
    prompt_len: int
    max_new_tokens: int
    prompt_token_ids: tuple[int, ...] | None = None
    hash_ids: tuple[int, ...] | None = None
    hash_block_size: int = 512
    tenant: str = ""  # also the cache salt: different tenants never share KV blocks
    priority: int = 0  # lower value = more important (as in vLLM)
    slo_class: str = "default"
    ttft_deadline_s: float | None = None  # relative to arrival; used by SLO-aware schedulers
    warmup: bool = False  # run, but excluded from every metric

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
        if self.hash_ids is not None and len(self.hash_ids) * self.hash_block_size < self.prompt_len:
            raise ValueError(f"request {self.id}: {len(self.hash_ids)} hash_ids x {self.hash_block_size} tokens "
                             f"cannot cover prompt_len {self.prompt_len}")


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
    output_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prefix-cache hit when first scheduled (tokens)
    num_preemptions: int = 0
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    token_times: list[float] = field(default_factory=list)  # one output event per sampled token
    reason: str = ""  # why REJECTED / TIMED_OUT
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the prompt's full blocks

    def __post_init__(self) -> None:
        self.id = self.request.id

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
