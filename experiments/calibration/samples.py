"""Calibration data from a server seen as a black box: the step durations its request-level timings imply.

A load test (``experiments.loadgen``) records when each request was sent and when each output chunk arrived;
``request_samples`` turns that into ``sim.fit.RequestSample`` s (an isolated request's TTFT = its prefill steps, an
inter-token gap = one decode step of a known batch), which ``sim.fit.fit_linear_requests`` fits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from core.batch import StepFeatures
from sim.fit import RequestSample

DEFAULT_TOLERANCE = 0.25  # client-side timing jitter allowed, as a fraction of one step


def prefill_steps(prompt_len: int, cached: int = 0, chunk: int | None = None) -> tuple[StepFeatures, ...]:
    """The steps of one request's prefill alone on a server: chunks of at most ``chunk`` tokens (None: one step)
    after ``cached`` prefix-cache hits (a fully cached prompt still computes its last token)."""
    c = min(max(0, int(cached)), prompt_len - 1)
    steps, left = [], prompt_len - c
    while left > 0:
        n = left if chunk is None else min(left, chunk)
        steps.append(StepFeatures(num_seqs=1, num_batched_tokens=n, num_prefill_seqs=1, num_prefill_tokens=n,
                                  attention_pairs=n * c + n * (n + 1) // 2, prefill_kv_tokens=c + n,
                                  max_context_len=c + n))
        c, left = c + n, left - n
    return tuple(steps)


def _decode_step(contexts: Sequence[int]) -> StepFeatures:
    b = len(contexts)
    return StepFeatures(num_seqs=b, num_batched_tokens=b, num_decode_seqs=b, kv_tokens_read=int(sum(contexts)),
                        max_context_len=int(max(contexts)), max_decode_context=int(max(contexts)),
                        min_decode_context=int(min(contexts)))


def _col(cols: Mapping[str, np.ndarray], name: str, n: int, default: float) -> np.ndarray:
    v = cols.get(name)
    if v is None:
        return np.full(n, default, dtype=float)
    v = np.asarray(v, dtype=float)
    return np.where(np.isnan(v), default, v)


def request_samples(requests: Mapping[str, np.ndarray], tokens: Mapping[str, np.ndarray],
                    prefill_chunk: int | None = None, tolerance: float = DEFAULT_TOLERANCE,
                    source: str = "") -> list[RequestSample]:
    """The step durations a run's request-level timings imply (requests.csv and tokens.csv columns, as read by
    ``core.output.read_requests_csv`` / ``read_tokens_csv``): the calibration data of a server without steps.csv.

    Assumptions (a server this does not describe gives wrong samples, not an error):

    - the server serves only these requests (no other client), one replica (or the ``replica`` column says which);
    - it runs in steps; a decode step gives every running request exactly one token (no speculative decoding, no
      multi-token steps), and a token reaches the client at the end of its step; a streamed event carrying k
      tokens spans k steps;
    - a request alone on the server is prefilled right away, in chunks of ``prefill_chunk`` tokens (the server's
      token budget per step; None: one step), after the ``cached_tokens`` the server reported;
    - no batching across requests the client sees as isolated; no preemption (rows with ``num_preemptions`` > 0,
      and requests that did not finish, make every sample they overlap unusable).

    Samples:

    - ``ttft``: a request whose [arrival, first token] no other request overlaps: TTFT = its prefill steps + a fixed
      per-request overhead (HTTP, tokenisation, client; fitted as its own term).
    - ``itl``: a gap between two output events of a request while the set of requests on the server is fixed and
      every one of them is decoding (first token before the gap, finish after it): one decode step per token of
      the later event, of batch = those requests, each attending to its prompt + the tokens it had so far. The
      gaps of one step seen by b requests weigh 1/b each.

    ``tolerance``: the client-side jitter allowed when telling which events belong to the same step, as a fraction
    of one step (a request whose first token or finish lies that close to a gap's ends counts as in the same step).
    """
    if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                      or prefill_chunk < 1):
        raise ValueError(f"calibrate.prefill_chunk={prefill_chunk!r}; allowed: an integer >= 1 or null")
    if isinstance(tolerance, bool) or not isinstance(tolerance, int | float) or not 0 <= tolerance < 0.5:
        raise ValueError(f"calibrate.tolerance={tolerance!r}; allowed: a number in [0, 0.5)")
    missing = sorted({"id", "arrival_s", "first_token_s", "finish_s", "prompt_tokens", "status"} - set(requests))
    missing += sorted({"request_id", "index", "time_s", "num_tokens"} - set(tokens))
    if missing:
        raise ValueError(f"{source or 'run'}: requests.csv / tokens.csv lack columns {missing}")
    ids = [str(x) for x in requests["id"]]
    n = len(ids)
    arrival = np.asarray(requests["arrival_s"], dtype=float)
    first = np.asarray(requests["first_token_s"], dtype=float)
    finish = np.asarray(requests["finish_s"], dtype=float)
    prompt = np.asarray(requests["prompt_tokens"], dtype=np.int64)
    cached = _col(requests, "cached_tokens", n, 0.0).astype(np.int64)
    preempted = _col(requests, "num_preemptions", n, 0.0) > 0
    replica = _col(requests, "replica", n, 0.0).astype(np.int64)
    warmup = _col(requests, "warmup", n, 0.0) > 0
    finished = np.array([str(s) == "FINISHED" for s in requests["status"]], dtype=bool)
    end = np.where(np.isfinite(finish), finish, np.inf)  # a request still open at the end overlaps all after it

    # output events per request: times and token counts, in order
    pos = {rid: i for i, rid in enumerate(ids)}
    ev_rows: list[list[tuple[int, float, int]]] = [[] for _ in range(n)]
    for rid, idx, t, k in zip(tokens["request_id"], tokens["index"], tokens["time_s"], tokens["num_tokens"],
                              strict=True):
        i = pos.get(str(rid))
        if i is not None:
            ev_rows[i].append((int(idx), float(t), int(k)))
    ev_times, ev_cum = [], []  # per request: event times, tokens received up to and including each event
    for rows in ev_rows:
        rows.sort()
        ev_times.append(np.array([t for _, t, _ in rows], dtype=float))
        ev_cum.append(np.cumsum([k for _, _, k in rows], dtype=np.int64))
    good = finished & ~preempted & np.isfinite(first) & np.isfinite(finish) & \
        np.array([len(t) > 0 for t in ev_times], dtype=bool)

    samples: list[RequestSample] = []
    for r in np.unique(replica):
        members = np.flatnonzero(replica == r)
        members = members[np.argsort(arrival[members], kind="stable")]
        arr_m, end_m = arrival[members], end[members]
        for pos_i, i in enumerate(members):
            if not good[i] or warmup[i]:
                continue
            # every other request on this replica whose [arrival, end] meets i's
            hi = np.searchsorted(arr_m, end[i], side="right")
            near = np.flatnonzero(end_m[:hi] >= arrival[i])
            cand = members[near[near != pos_i]]
            c_arr, c_end, c_first = arrival[cand], end[cand], first[cand]
            c_good = good[cand]
            label = f"{source}:{ids[i]}" if source else ids[i]
            # -- isolated TTFT: nothing else on the server from its arrival to its first token
            if np.all((c_end <= arrival[i]) | (c_arr >= first[i])):
                steps = prefill_steps(int(prompt[i]), int(cached[i]), prefill_chunk)
                ttft = first[i] - arrival[i]
                if ttft > 0:
                    samples.append(RequestSample(steps, float(ttft), "ttft", 1.0, label))
            # -- inter-token gaps while the batch is fixed and all of it decodes
            t, cum = ev_times[i], ev_cum[i]
            if len(t) < 2:
                continue
            ta, tb = t[:-1], t[1:]
            k = np.diff(cum)  # steps spanned by each gap = tokens of its later event
            q = cum[:-1]  # tokens i had before the gap's first step
            with np.errstate(divide="ignore", invalid="ignore"):
                delta = tolerance * (tb - ta) / k
            usable = (tb > ta) & (k >= 1)
            if len(cand):
                lo, hi_t = (ta + delta)[:, None], (tb - delta)[:, None]
                disjoint = (c_end[None, :] <= lo) | (c_arr[None, :] >= hi_t)
                through = c_good[None, :] & (c_first[None, :] <= lo) & (c_end[None, :] >= hi_t)
                usable &= np.all(disjoint | through, axis=1)
                # tokens each co-running request had received by the gap's start (+ jitter)
                had = np.stack([_tokens_by(ev_times[j], ev_cum[j], ta + delta) for j in cand], axis=1)
            for g in np.flatnonzero(usable):
                others = [] if not len(cand) else [int(prompt[j] + had[g, m]) for m, j in enumerate(cand)
                                                   if through[g, m]]
                base = [int(prompt[i] + q[g])] + others
                steps = tuple(_decode_step([x + s for x in base]) for s in range(int(k[g])))
                samples.append(RequestSample(steps, float(tb[g] - ta[g]), "itl", 1.0 / len(base), label))
    return samples


def _tokens_by(times: np.ndarray, cum: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Tokens received by each time in ``t`` (events at ``times`` carrying ``cum`` tokens in all so far)."""
    idx = np.searchsorted(times, t, side="right")
    return np.where(idx > 0, cum[np.maximum(idx - 1, 0)] if len(cum) else 0, 0)


def request_samples_from_run(run_dir: str | Path, prefill_chunk: int | None = None,
                             tolerance: float = DEFAULT_TOLERANCE) -> list[RequestSample]:
    """``request_samples`` of a run directory (its requests.csv and tokens.csv; steps.csv is not needed)."""
    from core.output import has_table, read_requests, read_tokens

    d = Path(run_dir)
    for name in ("requests", "tokens"):
        if not has_table(d, name):
            raise ValueError(f"calibrate.runs: no {name}.csv (or .parquet) in {d} (a run directory: "
                             "experiments.serving.loadgen, .run, .serve; tokens need output.tokens=all)")
    return request_samples(read_requests(d), read_tokens(d), prefill_chunk, tolerance, source=d.name)
