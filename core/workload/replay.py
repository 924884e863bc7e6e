"""Workloads that replay a trace file or an explicit request list (open loop, deterministic)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from core.checks import check_float, check_int
from core.request import Request
from core.workload.base import OpenLoop
from core.workload.traces import MOONCAKE_BLOCK, TraceRow, read_azure, read_mooncake, read_request_list

DEFAULT_MOONCAKE = "../shared/data/traces/conversation_trace.jsonl"
DEFAULT_AZURE = "../shared/data/traces/AzureLLMInferenceTrace_conv.csv"


class _Replay(OpenLoop):
    """Rows are read (and checked) at construction, so bad files fail at start; ``initial`` builds Requests lazily.

    Rows are sorted by time (stable: file order breaks ties); with ``rebase`` the first arrives at 0.
    ``time_scale`` multiplies arrival times (so inter-arrival gaps): < 1 means more load.
    """

    def __init__(self, source: str | Path, rows: Iterable[TraceRow], time_scale: float, warmup_requests: int,
                 seed: int, rebase: bool, tokens_per_hash_id: int) -> None:
        self.time_scale = check_float(time_scale, "workload.time_scale", 0.0, strict=True)
        self.warmup_requests = check_int(warmup_requests, "workload.warmup_requests", 0)
        # traces are deterministic; the seed is accepted so every workload takes the root seed
        self.seed = check_int(seed, "workload.seed", 0)
        self.tokens_per_hash_id = tokens_per_hash_id
        self.rows = sorted(rows, key=lambda r: r.arrival_s)
        if not self.rows:
            raise ValueError(f"workload.path={str(source)!r}: no requests in the file")
        self.t0 = self.rows[0].arrival_s if rebase else 0.0

    def __len__(self) -> int:
        return len(self.rows)

    def _request(self, k: int, r: TraceRow) -> Request:
        return Request(id=r.id if r.id is not None else f"r{r.index}",
                       arrival_s=(r.arrival_s - self.t0) * self.time_scale,
                       prompt_len=r.prompt_len, max_new_tokens=r.output_len, prompt_token_ids=r.prompt_token_ids,
                       hash_ids=r.hash_ids, tokens_per_hash_id=self.tokens_per_hash_id, tenant=r.tenant,
                       priority=r.priority, warmup=r.warmup or k < self.warmup_requests)

    def initial(self) -> Iterator[Request]:
        for k, r in enumerate(self.rows):
            yield self._request(k, r)


def _scaled(rows: Iterable[TraceRow], length_scale: float, keep_ids: bool) -> Iterator[TraceRow]:
    """Shrink/grow lengths by ``length_scale`` (content ids then stand for 512 * length_scale tokens each)."""
    for r in rows:
        n_in = max(1, round(r.prompt_len * length_scale))
        n_out = max(1, round(r.output_len * length_scale))
        yield TraceRow(r.index, r.line, r.arrival_s, n_in, n_out, hash_ids=r.hash_ids if keep_ids else None)


class MooncakeTrace(_Replay):
    """Mooncake FAST'25 trace replay; prefix sharing comes from its ``hash_ids`` (512 tokens each).

    ``length_scale`` (e.g. 1/32 for CPU runs) scales prompt and output lengths and the tokens per hash id
    together, so the sharing structure stays exact; 512 * length_scale must be a whole number.
    """

    def __init__(self, path: str | Path = DEFAULT_MOONCAKE, limit: int | None = None, time_scale: float = 1.0,
                 length_scale: float = 1.0, warmup_requests: int = 0, seed: int = 0) -> None:
        length_scale = check_float(length_scale, "workload.length_scale", 0.0, strict=True)
        block = MOONCAKE_BLOCK * length_scale
        if block < 1 or not block.is_integer():
            raise ValueError(f"workload.length_scale={length_scale}: 512 * length_scale must be a whole number >= 1")
        limit = None if limit is None else check_int(limit, "workload.limit", 1)
        rows = read_mooncake(path, limit)
        if length_scale != 1.0:
            rows = _scaled(rows, length_scale, keep_ids=True)
        super().__init__(path, rows, time_scale, warmup_requests, seed, rebase=True, tokens_per_hash_id=int(block))


class AzureTrace(_Replay):
    """Azure LLM inference trace replay (no content information: every prompt is unique)."""

    def __init__(self, path: str | Path = DEFAULT_AZURE, limit: int | None = None, time_scale: float = 1.0,
                 length_scale: float = 1.0, warmup_requests: int = 0, seed: int = 0) -> None:
        length_scale = check_float(length_scale, "workload.length_scale", 0.0, strict=True)
        limit = None if limit is None else check_int(limit, "workload.limit", 1)
        rows = read_azure(path, limit)
        if length_scale != 1.0:
            rows = _scaled(rows, length_scale, keep_ids=False)
        super().__init__(path, rows, time_scale, warmup_requests, seed, rebase=True, tokens_per_hash_id=MOONCAKE_BLOCK)


class RequestList(_Replay):
    """An explicit request list (JSONL or CSV); arrival times are used as given (times ``time_scale``)."""

    def __init__(self, path: str | Path, limit: int | None = None, time_scale: float = 1.0,
                 tokens_per_hash_id: int = 16, warmup_requests: int = 0, seed: int = 0) -> None:
        tokens_per_hash_id = check_int(tokens_per_hash_id, "workload.tokens_per_hash_id", 1)
        limit = None if limit is None else check_int(limit, "workload.limit", 1)
        rows = list(read_request_list(path, limit, tokens_per_hash_id))
        seen: dict[str, int] = {}
        for r in rows:
            if r.id in seen:
                raise ValueError(f"{path}:{r.line}: field 'id': duplicate id {r.id!r} (first on line {seen[r.id]})")
            seen[r.id] = r.line
        super().__init__(path, rows, time_scale, warmup_requests, seed, rebase=False,
                         tokens_per_hash_id=tokens_per_hash_id)
