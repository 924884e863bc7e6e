"""Run metrics, as docs/outputs.md defines them (the definitions are part of the product).

Per request (``request_metrics``):
- TTFT = first token - arrival; E2E = finish - arrival (FINISHED requests only);
  TPOT = (E2E - TTFT) / (n_out - 1), undefined (None) for n_out == 1 and left out of TPOT stats;
- output events: consecutive entries of ``token_times`` with the same time are one event of k tokens;
  ITL: each later event contributes its gap to the previous event divided by k, k times (the first
  event's tokens belong to TTFT); max stall = largest gap between consecutive events, 0.0 for a
  single-event response (nothing stalled: an SLO on stalls is met);
- queue delay = first scheduled - arrival; prefill span = first token - first scheduled (TTFT = both).

Summary (``summarize``): warmup requests are excluded everywhere. Latency stats (ttft/tpot/itl/e2e/
max_stall/queue/prefill_span), throughput and ``stall_share_over_threshold`` use completed (FINISHED)
requests; ITL stats pool every ITL sample (token-weighted). Counts, SLO attainment, goodput and the
prefix metrics use every non-warmup request, so rejected, timed-out and cancelled requests stay in the denominators.
``duration_s`` runs from the first arrival to the last terminal event. Group stats are computed from each
group's own samples, never from other percentiles. Empty populations give ``count`` 0 and None values (null in JSON).
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from core import arithmetic
from core.checks import check_choice, check_keys
from core.request import RequestState, Status
from core.specs import ModelSpec

PERCENTILE_METHODS = ("nearest_rank", "linear")
LATENCY_ORIGINS = ("arrival", "receipt")  # what TTFT / E2E / queueing count from (RequestState.received_s)
DEFAULT_PERCENTILES = (50, 90, 99)
DEFAULT_PROMPT_LEN_EDGES = (256, 1024, 4096)
LATENCY_KEYS = ("ttft_s", "tpot_s", "itl_s", "e2e_s", "max_stall_s", "queue_s", "prefill_span_s")


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    max_stall_s: float | None
    queue_s: float | None
    prefill_span_s: float | None


def output_events(token_times: Sequence[float]) -> list[tuple[float, int]]:
    """(time, number of tokens) per output event: equal consecutive times are one multi-token event."""
    events: list[tuple[float, int]] = []
    for t in token_times:
        if events and events[-1][0] == t:
            events[-1] = (t, events[-1][1] + 1)
        else:
            events.append((t, 1))
    return events


def itl_samples(events: Sequence[tuple[float, int]]) -> list[float]:
    out: list[float] = []
    for (t0, _), (t1, k) in zip(events, events[1:], strict=False):
        out.extend([(t1 - t0) / k] * k)
    return out


def float_times(times: Sequence[float]) -> np.ndarray | None:
    """Token times as a float64 array when that loses nothing (an array('d'), or Python floats only: an int time
    keeps its type on the exact path); None otherwise."""
    if isinstance(times, array) and times.typecode == "d":
        return np.frombuffer(times, dtype=np.float64) if len(times) else np.empty(0)
    if all(type(t) is float for t in times):
        return np.fromiter(times, dtype=np.float64, count=len(times))
    return None


@dataclass(frozen=True)
class TokenStats:
    """The per-token metrics of many requests: each one's max stall (None without tokens), and every ITL sample,
    request after request, in one float64 array with how many belong to each request."""

    max_stall_s: list[float | None]
    itl_s: np.ndarray
    itl_counts: np.ndarray


_CHUNK_TOKENS = 1 << 16  # token times handled at once: scratch memory stays bounded


def token_chunks(states: Sequence[RequestState], itl_of: Sequence[bool] | None = None
                 ) -> Iterator[tuple[int, TokenStats]]:
    """(index of its first state, ``TokenStats``) of consecutive slices of ``states`` of about ``_CHUNK_TOKENS``
    token times each: ITL samples only of those ``itl_of`` marks (all without it). Numpy over many requests at a
    time, with the same IEEE operations as the definition (``output_events``, ``itl_samples``), which decides for
    times that are not plain finite floats. A folded state (``RequestState.fold``) gives its kept max stall and no
    samples (they are in an ``ITLPool``)."""
    lo = 0
    while lo < len(states):
        hi, n = lo, 0
        while hi < len(states) and (n == 0 or n + len(states[hi].token_times) <= _CHUNK_TOKENS):
            n += len(states[hi].token_times)
            hi += 1
        part = states[lo:hi]
        keep = np.ones(hi - lo, dtype=bool) if itl_of is None else np.array(itl_of[lo:hi], dtype=bool)
        chunk = _chunk_stats(part, keep)
        if chunk is None:  # a time that is not a plain finite float: the definition, request by request
            stalls, itls, counts = [], [], np.zeros(len(part), dtype=np.int64)
            for i, s in enumerate(part):
                events = output_events(s.token_times)
                gaps = [t1 - t0 for (t0, _), (t1, _) in zip(events, events[1:], strict=False)]
                stalls.append(max(gaps, default=0.0) if events else None)
                if keep[i]:
                    itl = itl_samples(events)
                    itls.append(np.array(itl, dtype=np.float64))
                    counts[i] = len(itl)
            chunk = stalls, np.concatenate(itls) if itls else np.empty(0), counts
        stalls = chunk[0]
        for i, s in enumerate(part):
            if s.folded is not None:
                stalls[i] = s.folded.max_stall_s
        yield lo, TokenStats(stalls, chunk[1], chunk[2])
        lo = hi


def token_stats(states: Sequence[RequestState], itl_of: Sequence[bool] | None = None) -> TokenStats:
    """``token_chunks`` of ``states`` as one ``TokenStats`` (8 bytes an ITL sample: for a few requests; a run's
    metrics pool theirs in an ``ITLPool``)."""
    parts = [t for _, t in token_chunks(states, itl_of)]
    return TokenStats([m for t in parts for m in t.max_stall_s],
                      np.concatenate([t.itl_s for t in parts]) if parts else np.empty(0),
                      np.concatenate([t.itl_counts for t in parts]) if parts else np.zeros(0, dtype=np.int64))


def _chunk_stats(states: Sequence[RequestState], keep: np.ndarray) -> tuple[list, np.ndarray, np.ndarray] | None:
    """(max stalls, ITL samples of the ``keep`` requests, their counts) of a few requests at once; None when a
    time is not a plain finite float."""
    arrays = [float_times(s.token_times) for s in states]
    if any(a is None for a in arrays):
        return None
    lens = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
    t = np.concatenate(arrays) if arrays else np.empty(0)
    if not np.isfinite(t).all():
        return None
    owner = np.repeat(np.arange(len(arrays)), lens)
    new = np.ones(len(t), dtype=bool)  # an event starts at each request's first token and at each new time
    new[1:] = (t[1:] != t[:-1]) | (owner[1:] != owner[:-1])
    first = np.flatnonzero(new)
    k = np.diff(np.append(first, len(t)))  # tokens per event
    ev_owner = owner[first]
    later = np.flatnonzero(ev_owner[1:] == ev_owner[:-1]) + 1  # events after the first of their request
    gaps = t[first[later]] - t[first[later - 1]]
    gap_owner = ev_owner[later]
    stall = np.zeros(len(arrays))  # a request with one event: 0.0
    if len(gaps):
        seg = np.flatnonzero(np.r_[True, gap_owner[1:] != gap_owner[:-1]])  # each request's first gap
        stall[gap_owner[seg]] = np.maximum.reduceat(gaps, seg)
    stalls = [None if n == 0 else v for n, v in zip(lens.tolist(), stall.tolist(), strict=True)]
    kept = keep[gap_owner]
    itl = np.repeat(gaps[kept] / k[later][kept], k[later][kept])
    counts = np.bincount(gap_owner[kept], weights=k[later][kept], minlength=len(arrays)).astype(np.int64)
    return stalls, itl, counts


def request_metrics(state: RequestState, max_stall_s: float | None = None, stall_known: bool = False
                    ) -> RequestMetrics:
    """One request's metrics (``max_stall_s`` from ``token_stats`` when ``stall_known``)."""
    st = state
    a = st.request.arrival_s if st.received_s is None else st.received_s  # the engine's receipt, when stamped
    ttft = None if st.first_token_s is None else st.first_token_s - a
    done = st.status is Status.FINISHED and st.finish_s is not None
    e2e = st.finish_s - a if done else None
    n = st.num_output_tokens
    tpot = (e2e - ttft) / (n - 1) if done and ttft is not None and n > 1 else None
    if not stall_known:
        max_stall_s = token_stats([state], [False]).max_stall_s[0]
    queue = None if st.first_scheduled_s is None else st.first_scheduled_s - a
    span = None if st.first_token_s is None or st.first_scheduled_s is None else st.first_token_s - st.first_scheduled_s
    return RequestMetrics(ttft, tpot, e2e, max_stall_s, queue, span)


def many_request_metrics(states: Sequence[RequestState], pool: ITLPool | None = None) -> list[RequestMetrics]:
    """``request_metrics`` of each state; with ``pool``, the ITL samples of the completed non-warmup ones go
    into it (by its groups)."""
    stalls: list[float | None] = []
    itl_of = [pool is not None and s.status is Status.FINISHED and not s.request.warmup for s in states]
    for lo, chunk in token_chunks(states, itl_of):
        stalls += chunk.max_stall_s
        if pool is not None:
            pool.add(states[lo:lo + len(chunk.max_stall_s)], chunk)
    return [request_metrics(s, m, True) for s, m in zip(states, stalls, strict=True)]


def _order_pick(at: Callable[[int], float], n: int, p: float, method: str) -> float:
    """The p-th percentile of n sorted values, ``at(i)`` the i-th (0-based): nearest rank (the smallest value with
    at least p% of the sample at or below it) or numpy's ``linear`` interpolation, with numpy's own operations."""
    if method == "linear":
        v = (n - 1) * (p / 100)
        if v >= n - 1:
            return float(at(n - 1))
        lo = math.floor(v)
        t = v - lo
        a, b = float(at(lo)), float(at(lo + 1))
        d = b - a
        return b - d * (1 - t) if t >= 0.5 else a + d * t  # numpy's _lerp: exact at both ends
    # numpy's method="inverted_cdf" is this definition, but rounds q * n in floating point: at p = 99.9, n = 1000 it
    # picks rank 1000 where 999 values (99.9%) already reach p. The epsilon absorbs that; tests compare the two.
    return float(at(max(1, math.ceil(p * n / 100 - 1e-9)) - 1))


def _check_percentile(p: float, method: str) -> None:
    check_choice(method, "percentile_method", PERCENTILE_METHODS)
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")


def percentile(values: Iterable[float], p: float, method: str = "nearest_rank", is_sorted: bool = False
               ) -> float | None:
    """Nearest-rank or linear-interpolation percentile (``_order_pick``); None when empty. ``is_sorted``:
    ``values`` is an ascending float64 array (not sorted again)."""
    _check_percentile(p, method)
    x = values if is_sorted else np.sort(values if isinstance(values, np.ndarray) and values.dtype == np.float64
                                         else np.asarray(list(values), dtype=np.float64))
    return _order_pick(x.__getitem__, x.size, p, method) if x.size else None


def stats(values: Iterable[float], method: str = "nearest_rank",
          percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, Any]:
    """count, mean, min, max and the requested percentiles (``p50``...) of the values that are not None; None
    values when empty."""
    x = values if isinstance(values, np.ndarray) and values.dtype == np.float64 \
        else np.asarray([v for v in values if v is not None], dtype=np.float64)
    out: dict[str, Any] = {"count": int(x.size), "mean": float(x.mean()) if x.size else None,
                           "min": float(x.min()) if x.size else None, "max": float(x.max()) if x.size else None}
    x = np.sort(x)  # after the mean: its summation order is the values' own
    for p in percentiles:
        out[f"p{p:g}"] = percentile(x, p, method, is_sorted=True)
    return out


_MERGE_SAMPLES = 1 << 20  # samples a SampleSet buffers before merging them into its distinct values


class SampleSet:
    """A multiset of float samples as its sorted distinct values and their counts, for exact stats in memory per
    distinct value: a run's ITL samples are mostly the durations of steps that every request decoding in the step
    shares, so this holds about a value a step, not one a token. Added samples are buffered, then merged."""

    def __init__(self) -> None:
        self._values = np.empty(0)
        self._counts = np.zeros(0, dtype=np.int64)
        self._pending: list[np.ndarray] = []
        self._num_pending = 0

    def add(self, samples: np.ndarray) -> None:
        if len(samples):
            self._pending.append(np.asarray(samples, dtype=np.float64))
            self._num_pending += len(samples)
            if self._num_pending >= _MERGE_SAMPLES:
                self._merge()

    def _merge(self) -> None:
        if self._pending:
            v, c = np.unique(np.concatenate(self._pending), return_counts=True)
            self._pending, self._num_pending = [], 0
            self._values, self._counts = _union([(self._values, self._counts), (v, c)])

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(sorted distinct values, their counts)."""
        self._merge()
        return self._values, self._counts

    @classmethod
    def union(cls, sets: Iterable[SampleSet]) -> SampleSet:
        out = cls()
        out._values, out._counts = _union([s.items() for s in sets])
        return out

    def __len__(self) -> int:
        return int(self.items()[1].sum())

    def stats(self, method: str = "nearest_rank", percentiles: Sequence[float] = DEFAULT_PERCENTILES
              ) -> dict[str, Any]:
        """``stats`` of the samples. The mean sums value x count over the distinct values, so it does not depend on
        the order samples came in (it may differ from a running sum in the last bits)."""
        v, c = self.items()
        n = int(c.sum())
        out: dict[str, Any] = {"count": n, "mean": float(np.sum(v * c) / n) if n else None,
                               "min": float(v[0]) if n else None, "max": float(v[-1]) if n else None}
        ends = np.cumsum(c)  # the i-th sample (0-based) is v[first k with ends[k] > i]
        for p in percentiles:
            _check_percentile(p, method)
            out[f"p{p:g}"] = _order_pick(lambda i: v[np.searchsorted(ends, i, side="right")], n, p, method) \
                if n else None
        return out


def _union(parts: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Merge (sorted distinct values, counts) pairs: one stable sort of the sorted runs (timsort merges them)."""
    v = np.concatenate([p[0] for p in parts]) if parts else np.empty(0)
    c = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, dtype=np.int64)
    order = np.argsort(v, kind="stable")
    v, c = v[order], c[order]
    if not len(v):
        return v, c
    first = np.flatnonzero(np.r_[True, v[1:] != v[:-1]])
    return v[first], np.add.reduceat(c, first)


class ITLPool:
    """The ITL samples of a run's completed non-warmup requests, one ``SampleSet`` per metrics group (prompt-length
    bucket x prefix hit or miss): what ``summarize`` needs of the token times, in memory per distinct value.

    A loop that does not write per-token rows (``output.tokens=none``) ``fold``s each request as it ends: its
    samples go into the pool and its token times give way to a ``FoldedTimes``, so a run's memory does not grow per
    token. Requests are folded in batches of about ``_CHUNK_TOKENS`` token times (``flush`` ends a batch)."""

    def __init__(self, prompt_len_edges: Sequence[int] = DEFAULT_PROMPT_LEN_EDGES) -> None:
        self.edges = check_edges(prompt_len_edges)
        self.sets = [SampleSet() for _ in range(2 * (len(self.edges) + 1))]  # 2 x bucket + hit
        self._pending: list[RequestState] = []
        self._pending_tokens = 0

    def group(self, state: RequestState) -> int:
        return 2 * bisect_right(self.edges, state.request.prompt_len) + (state.num_cached_tokens > 0)

    def add(self, states: Sequence[RequestState], chunk: TokenStats) -> None:
        """The ITL samples of ``chunk`` (``token_chunks`` of ``states``), each into its request's group."""
        groups = np.repeat(np.fromiter(map(self.group, states), dtype=np.int64, count=len(states)), chunk.itl_counts)
        for g in np.unique(groups).tolist():
            self.sets[g].add(chunk.itl_s[groups == g])

    def fold(self, state: RequestState) -> None:
        """An ended request: its ITL samples (if it completed and is not warmup) into the pool, its times folded."""
        self._pending.append(state)
        self._pending_tokens += len(state.token_times)
        if self._pending_tokens >= _CHUNK_TOKENS:
            self.flush()

    def flush(self) -> None:
        pending, self._pending, self._pending_tokens = self._pending, [], 0
        for state, m in zip(pending, many_request_metrics(pending, self), strict=True):
            state.fold(m.max_stall_s)

    def samples(self, groups: Iterable[int] | None = None) -> SampleSet:
        """The samples of ``groups`` (indices into ``sets``; all without it) as one set."""
        self.flush()
        return SampleSet.union(self.sets if groups is None else [self.sets[g] for g in groups])


def check_edges(prompt_len_edges: Sequence[int]) -> tuple[int, ...]:
    edges = tuple(int(e) for e in prompt_len_edges)
    if any(e <= 0 for e in edges) or any(b <= a for a, b in zip(edges, edges[1:], strict=False)):
        raise ValueError(f"prompt_len_edges must be increasing positive ints, got {list(prompt_len_edges)}")
    return edges


def prefix_work(n: Any, a: float, b: float) -> Any:
    """Prefill cost of n tokens: a per token (weights) + b per causal attention pair (n(n+1)/2 pairs)."""
    n = np.asarray(n, dtype=np.float64)
    return a * n + b * n * (n + 1) / 2


def prefix_cost_coeffs(model: ModelSpec) -> tuple[float, float]:
    """(a, b) for ``prefix_work`` in FLOPs: linear layers per token, and QK^T + PV per attention pair
    (``core.arithmetic``'s linear_flops_per_token and attention_flops_per_pair)."""
    return arithmetic.linear_flops_per_token(model), arithmetic.attention_flops_per_pair(model)


@dataclass(frozen=True)
class SLO:
    """Per-request targets; None = not checked. A request's own ``ttft_deadline_s`` overrides ``ttft_s``."""

    ttft_s: float | None = None
    max_stall_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or not v > 0):
                raise ValueError(f"slo.{f.name} must be a number > 0 or null, got {v!r}")

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any] | None) -> SLO:
        cfg = dict(cfg or {})
        check_keys("slo", cfg, [f.name for f in fields(cls)])
        return cls(**cfg)

    def met(self, state: RequestState, m: RequestMetrics) -> bool:
        """Completed and within every target (TPOT is not checked for single-token answers)."""
        if state.status is not Status.FINISHED:
            return False
        ttft = state.request.ttft_deadline_s if state.request.ttft_deadline_s is not None else self.ttft_s
        checks = ((ttft, m.ttft_s), (self.max_stall_s, m.max_stall_s), (self.tpot_s, m.tpot_s), (self.e2e_s, m.e2e_s))
        return all(limit is None or value is None or value <= limit for limit, value in checks)


Pairs = list[tuple[RequestState, RequestMetrics]]


def _latency(pairs: Pairs, itl: SampleSet, method: str, percentiles: Sequence[float]) -> dict[str, Any]:
    """Latency stats of the completed requests of ``pairs``; ``itl``: their ITL samples."""
    done = [m for s, m in pairs if s.status is Status.FINISHED]
    out = {k: stats((getattr(m, k) for m in done), method, percentiles) for k in LATENCY_KEYS if k != "itl_s"}
    out["itl_s"] = itl.stats(method, percentiles)
    return out


def _group(pairs: Pairs, itl: SampleSet, method: str, percentiles: Sequence[float]) -> dict[str, Any]:
    return {"num_requests": len(pairs), "num_completed": sum(s.status is Status.FINISHED for s, _ in pairs),
            **_latency(pairs, itl, method, percentiles)}


def _ratio(num: float, den: float) -> float | None:
    return float(num / den) if den > 0 else None


def bucket_labels(edges: Sequence[int]) -> list[str]:
    bounds = [0, *edges, math.inf]
    return [f"[{lo},{'inf' if hi == math.inf else hi})" for lo, hi in zip(bounds, bounds[1:], strict=False)]


def summarize(states: Iterable[RequestState], slo: SLO | Mapping[str, Any] | None = None,
              percentile_method: str = "nearest_rank", percentiles: Sequence[float] = DEFAULT_PERCENTILES,
              prefix_cost: tuple[float, float] = (1.0, 0.0), prompt_len_edges: Sequence[int] = DEFAULT_PROMPT_LEN_EDGES,
              stall_threshold_s: float | None = None, itl_pool: ITLPool | None = None) -> dict[str, Any]:
    """The metrics.json summary of one run (see the module docstring for populations and definitions).

    ``prefix_cost`` = (a, b) of ``prefix_work``; (1, 0) makes work saved equal token reuse, and
    ``prefix_cost_coeffs(model)`` gives FLOP-based ones. ``stall_threshold_s`` defaults to ``slo.max_stall_s``.
    ``itl_pool``: the ITL samples of the states folded during the run (``ITLPool.fold``); required when any is.
    """
    check_choice(percentile_method, "percentile_method", PERCENTILE_METHODS)
    edges = list(check_edges(prompt_len_edges))
    slo = slo if isinstance(slo, SLO) else SLO.from_mapping(slo)
    a, b = (float(c) for c in prefix_cost)
    threshold = stall_threshold_s if stall_threshold_s is not None else slo.max_stall_s

    all_states = list(states)
    measured = [s for s in all_states if not s.request.warmup]
    if itl_pool is not None:
        if list(itl_pool.edges) != edges:
            raise ValueError(f"the ITL pool groups prompts by {list(itl_pool.edges)}, the metrics by {edges}")
        itl_pool.flush()
    elif any(s.folded is not None for s in measured):
        raise ValueError("these requests' token times were folded into an ITL pool (output.tokens=none); "
                         "pass it as itl_pool")
    pool = ITLPool(edges)  # the samples of the states not folded (all of them, without a loop's pool)
    per_request = many_request_metrics(measured, pool)
    pairs = list(zip(measured, per_request, strict=True))
    done = [(s, m) for s, m in pairs if s.status is Status.FINISHED]

    def itl(groups: Iterable[int] | None = None) -> SampleSet:
        """The ITL samples of the pools' ``groups`` (all without it)."""
        return SampleSet.union(p.samples(groups) for p in (pool, itl_pool) if p is not None)

    def group(members: np.ndarray, groups: Iterable[int]) -> dict[str, Any]:
        """Stats of the requests ``members`` marks, with the ITL samples of pool ``groups`` (theirs)."""
        return _group([p for p, k in zip(pairs, members.tolist(), strict=True) if k], itl(groups), percentile_method,
                      percentiles)

    counts = {st.value: 0 for st in Status}
    for s in measured:
        counts[s.status.value] += 1

    ends = [max(t for t in (s.request.arrival_s, s.first_token_s, s.finish_s, s.last_token_s) if t is not None)
            for s in measured]
    duration = max(ends) - min(s.request.arrival_s for s in measured) if measured else 0.0
    n_met = sum(slo.met(s, m) for s, m in pairs)
    out_tokens = sum(s.num_output_tokens for s, _ in done)
    stalls = [m.max_stall_s for _, m in done if m.max_stall_s is not None]

    n = np.array([s.request.prompt_len for s in measured], dtype=np.float64)
    h = np.array([s.num_cached_tokens for s in measured], dtype=np.float64)
    key = np.fromiter(map(pool.group, measured), dtype=np.int64, count=len(measured))  # the pool's group of each
    bucket, hit = key // 2, key % 2 == 1
    prompt_groups = {label: group(bucket == i, (2 * i, 2 * i + 1)) for i, label in enumerate(bucket_labels(edges))}
    keys = range(len(pool.sets))
    prefix_groups = {"hit": group(hit, keys[1::2]), "miss": group(~hit, keys[::2])}

    return {
        "num_requests": len(measured),
        "num_warmup": len(all_states) - len(measured),
        "num_completed": counts[Status.FINISHED.value],
        "num_rejected": counts[Status.REJECTED.value],
        "num_timed_out": counts[Status.TIMED_OUT.value],
        "num_cancelled": counts[Status.CANCELLED.value],
        "counts_by_status": counts,
        "duration_s": float(duration) if measured else None,
        "percentile_method": percentile_method,
        **_latency(pairs, itl(), percentile_method, percentiles),
        "slo": asdict(slo),
        "num_slo_met": int(n_met),
        "slo_attainment": _ratio(n_met, len(measured)),
        "goodput_rps": _ratio(n_met, duration),
        "throughput_rps": _ratio(len(done), duration),
        "throughput_tok_s": _ratio(out_tokens, duration),
        "output_tokens": int(out_tokens),
        "prompt_tokens": int(n.sum()),
        "cached_tokens": int(h.sum()),
        "request_hit_rate": _ratio(float((h > 0).sum()), len(measured)),
        "token_reuse_rate": _ratio(float(h.sum()), float(n.sum())),
        "prefill_work_saved": _ratio(float(prefix_work(h, a, b).sum()), float(prefix_work(n, a, b).sum())),
        "prefix_cost_a": a,
        "prefix_cost_b": b,
        "stall_threshold_s": threshold,
        "stall_share_over_threshold": None if threshold is None else _ratio(sum(x > threshold for x in stalls),
                                                                             len(stalls)),
        "groups": {
            "prefix": prefix_groups,
            "prompt_len": prompt_groups,
        },
        "prompt_len_edges": edges,
        # speculative decoding (null without drafts): draft tokens verified and accepted; the acceptance rate
        # accepted / proposed; alpha, the chance a draft is accepted given the ones before it were (the
        # simulator's spec.acceptance_rate): accepted / (accepted + verify steps that hit a rejection)
        "draft_tokens_proposed": int(proposed := sum(s.num_draft_proposed for s in measured)),
        "draft_tokens_accepted": int(accepted := sum(s.num_draft_accepted for s in measured)),
        "draft_acceptance_rate": _ratio(accepted, proposed),
        "draft_acceptance_alpha": _ratio(accepted, accepted + sum(s.num_draft_rejections for s in measured)),
    }
