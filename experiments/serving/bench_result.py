"""Measured runs of black-box servers: vLLM ``bench serve`` result JSON in and out, and the run directory writer.

- ``bench_serve_result(states, duration_s, ...)``: the result dict of ``vllm bench serve --save-result
  --save-detailed`` (same field names and definitions, vllm/benchmarks/serve.py) computed from RequestState
  records; ``experiments.serving.loadgen`` writes it as ``bench_serve.json``.
- ``read_bench_serve(path)``: the other direction, a vLLM result JSON with per-request details (``input_lens``,
  ``output_lens``, ``ttfts``, ``itls``, ``errors``; ``start_times`` and ``latencies`` when present) as
  RequestState records; ``bench_serve_to_run(path, out_dir)`` writes them as a measured run directory
  (requests.csv, tokens.csv, metrics.json; no steps.csv), so a vLLM measurement is analysed like any run.
- ``write_measured_run``: ``core.output.write_run`` for runs without step records: no steps.csv at all (a black
  box has no steps), files moved into place by rename, metrics.json last.

vLLM's definitions, kept here for its field names (they differ from metrics.json's, docs/outputs.md):
TTFT = first token chunk - request start; E2EL ("latency") = last token chunk - start; TPOT = (E2EL - TTFT) /
(output_len - 1) over successful requests with more than one output token; ITL = the gaps between consecutive
token *chunks* (not divided by the tokens a chunk carries); statistics are numpy's mean / median / std
(population) / percentile (linear interpolation) in ms, 0 for an empty sample; throughputs divide by ``duration``;
the token totals count successful requests only; ``request_goodput`` is null unless SLOs are set.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from core.metrics import SLO, output_events, request_metrics, summarize
from core.output import jsonable, write_run
from core.request import Request, RequestState, Status

BENCH_PERCENTILES = (50, 90, 95, 99)
BENCH_METRICS = ("ttft", "tpot", "itl", "e2el")
DETAIL_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "errors")  # what --save-detailed adds (needed here)
MEASURED_FILES = ("requests.csv", "tokens.csv", "metrics.json")


# ---- the run directory of a measured (black-box) run -------------------------------------------------------------
def write_measured_run(out_dir: str | Path, states: Iterable[RequestState], metrics: Mapping[str, Any],
                       extra_files: Mapping[str, str | bytes] | None = None,
                       timing: Mapping[str, Any] | None = None) -> dict[str, Path]:
    """requests.csv, tokens.csv, metrics.json (+ ``extra_files``, timing.json) into ``out_dir``, without steps.csv:
    ``core.output.write_run``, which renames every file into place (metrics.json last) and removes the run files
    an earlier run left (a stale steps.csv would be read as this run's steps)."""
    return write_run(out_dir, states, None, metrics, extra_files, timing=timing)


def apportion(total: int, num_events: int) -> list[int]:
    """Spread ``total`` output tokens over ``num_events`` chunks whose own token counts are unknown: as evenly as
    possible, the remainder on the last chunks; with fewer tokens than chunks, one token for each of the first
    ``total`` chunks and 0 for the rest."""
    if num_events <= 0:
        return []
    if total < num_events:
        return [1] * max(total, 0) + [0] * (num_events - max(total, 0))
    base, rem = divmod(total, num_events)
    return [base] * (num_events - rem) + [base + 1] * rem


# ---- RequestStates -> vLLM bench serve result ----------------------------------------------------------------------
def _p_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def _chunk_gaps(state: RequestState) -> list[float]:
    times = [t for t, _ in output_events(state.token_times)]
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def bench_serve_result(states: Iterable[RequestState], duration_s: float | None, slo: SLO | Mapping | None = None,
                       percentiles: Sequence[float] = BENCH_PERCENTILES, detailed: bool = True) -> dict[str, Any]:
    """vLLM ``bench serve``'s result dict from RequestState records (warmup requests excluded).

    A request's start is its ``arrival_s``; successful = FINISHED. ``duration_s`` divides the throughputs (a
    loadgen run passes metrics.json's ``duration_s``: first arrival to last terminal event). ``request_goodput``
    counts FINISHED requests meeting every target of ``slo`` (TTFT, TPOT, E2E and max stall, ``core.metrics.SLO``),
    null when ``slo`` sets none. With ``detailed`` the per-request lists of ``--save-detailed`` are included, in
    arrival order, with vLLM's values for failed requests (output_len 0, ttft 0.0, no itls, latency 0.0)."""
    slo = slo if isinstance(slo, SLO) else SLO.from_mapping(slo)
    measured = sorted((s for s in states if not s.request.warmup), key=lambda s: s.request.arrival_s)
    ok = [s for s in measured if s.status is Status.FINISHED]
    dur = float(duration_s) if duration_s else 0.0
    ttfts = [s.first_token_s - s.request.arrival_s for s in ok]
    e2els = [s.finish_s - s.request.arrival_s for s in ok]
    tpots = [(e - t) / (s.num_output_tokens - 1) for s, t, e in zip(ok, ttfts, e2els, strict=True)
             if s.num_output_tokens > 1]
    itls = [g for s in ok for g in _chunk_gaps(s)]
    total_in = sum(s.request.prompt_len for s in ok)
    total_out = sum(s.num_output_tokens for s in ok)
    has_slo = any(v is not None for v in (slo.ttft_s, slo.tpot_s, slo.e2e_s, slo.max_stall_s))
    good = sum(slo.met(s, request_metrics(s)) for s in ok) if has_slo else 0

    def rate(x: float) -> float:
        return x / dur if dur > 0 else 0.0

    result: dict[str, Any] = {
        "duration": dur, "completed": len(ok), "failed": len(measured) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": rate(len(ok)), "request_goodput": rate(good) if has_slo else None,
        "output_throughput": rate(total_out), "total_token_throughput": rate(total_in + total_out),
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        v = np.asarray(values or [0.0], dtype=np.float64) * 1000.0
        result[f"mean_{name}_ms"] = float(np.mean(v))
        result[f"median_{name}_ms"] = float(np.median(v))
        result[f"std_{name}_ms"] = float(np.std(v))
        for p in percentiles:
            result[f"p{_p_word(p)}_{name}_ms"] = float(np.percentile(v, p))
    if detailed:
        done = [s.status is Status.FINISHED for s in measured]
        result.update(
            input_lens=[s.request.prompt_len for s in measured],
            output_lens=[s.num_output_tokens if d else 0 for s, d in zip(measured, done, strict=True)],
            ttfts=[s.first_token_s - s.request.arrival_s if d else 0.0 for s, d in zip(measured, done, strict=True)],
            itls=[_chunk_gaps(s) if d else [] for s, d in zip(measured, done, strict=True)],
            latencies=[s.finish_s - s.request.arrival_s if d else 0.0 for s, d in zip(measured, done, strict=True)],
            start_times=[s.request.arrival_s for s in measured],
            errors=["" if d else (s.reason or s.status.value) for s, d in zip(measured, done, strict=True)],
        )
    return jsonable(result)


# ---- vLLM bench serve result -> RequestStates / a measured run -------------------------------------------------------
def _error_reason(err: str) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return (lines[-1] if lines else str(err))[:300]


def _load_bench_serve(source: str | Path | Mapping[str, Any]) -> Mapping[str, Any]:
    """A bench serve result (a file, or one already loaded), refused naming the file when it is not JSON, not an
    object, or not detailed."""
    if isinstance(source, Mapping):
        data, name = source, "bench serve result"
    else:
        name = str(source)
        try:
            data = json.loads(Path(source).read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{name}: not a vLLM bench serve result ({type(e).__name__}: {e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{name}: not a vLLM bench serve result (a JSON {type(data).__name__}, not an object)")
    missing = [k for k in DETAIL_KEYS if k not in data]
    if missing:
        raise ValueError(f"{name}: no {missing}; save the vLLM result with --save-result --save-detailed")
    return data


def read_bench_serve(source: str | Path | Mapping[str, Any]) -> list[RequestState]:
    """A vLLM ``bench serve --save-result --save-detailed`` JSON (a path or the loaded dict) as RequestStates.

    Request i (id ``r{i}``) arrives at ``start_times[i]`` minus the earliest start (0 for all when the file has no
    ``start_times``; its throughputs are then meaningless), which is also its ``first_scheduled_s`` (vLLM starts its
    clock when the request is sent, after any ``--max-concurrency`` wait). A request with an empty error is
    FINISHED: its first token at start + ttft, one output event per chunk at the cumulated ``itls``, its
    ``output_lens`` tokens spread over the chunks by ``apportion`` (vLLM does not record tokens per chunk), finish at
    start + ``latencies[i]`` (else the last chunk). Any other request is TIMED_OUT when its error names a timeout,
    else REJECTED, with the error's last line as reason and no tokens (vLLM keeps none for failures)."""
    data = _load_bench_serve(source)
    n = len(data["input_lens"])
    for k in (*DETAIL_KEYS, "start_times", "latencies"):
        if data.get(k) is not None and len(data[k]) != n:
            raise ValueError(f"bench serve result: {k} has {len(data[k])} entries, input_lens has {n}")
    starts = data.get("start_times")
    t0 = min(starts) if starts else 0.0
    lat = data.get("latencies")
    states: list[RequestState] = []
    for i in range(n):
        arrival = float(starts[i] - t0) if starts else 0.0
        err = data["errors"][i] or ""
        n_out = int(data["output_lens"][i] or 0)
        itls = [float(x) for x in (data["itls"][i] or [])]
        ok = not err
        if ok and n_out == 0:  # vLLM counted no tokens (no usage block, no tokenizer): one per chunk
            n_out = len(itls) + 1
        req = Request(id=f"r{i}", arrival_s=arrival, prompt_len=max(1, int(data["input_lens"][i] or 0)),
                      max_new_tokens=max(1, n_out))
        s = RequestState(req)
        s.replica, s.first_scheduled_s = 0, arrival
        if ok:
            times = [arrival + float(data["ttfts"][i])]
            for g in itls:
                times.append(times[-1] + g)
            s.token_times = [t for t, k in zip(times, apportion(n_out, len(times)), strict=True) for _ in range(k)]
            s.output_token_ids = [-1] * len(s.token_times)  # ids unknown; the count is what the run files need
            s.first_token_s = s.token_times[0]
            s.finish_s = arrival + float(lat[i]) if lat is not None else s.token_times[-1]
            s.status = Status.FINISHED
        else:
            s.status = Status.TIMED_OUT if "timeout" in err.lower() else Status.REJECTED
            s.reason = _error_reason(err)
        states.append(s)
    return states


def bench_serve_to_run(source: str | Path, out_dir: str | Path, summarize_options: Mapping[str, Any] | None = None,
                       backend: str = "vllm-bench-serve") -> dict[str, Any]:
    """Turn a vLLM ``bench serve --save-detailed`` JSON into a measured run directory (requests.csv, tokens.csv,
    metrics.json; no steps.csv) and return its metrics. ``summarize_options`` are ``core.metrics.summarize``'s
    keyword arguments (``experiments.build.metrics_options(cfg, spec)`` gives a config's SLO and percentile
    settings). metrics.json also records the source file and vLLM's own ``duration`` as ``bench_duration_s``."""
    data = _load_bench_serve(source)
    states = read_bench_serve(data)
    metrics = summarize(states, **dict(summarize_options or {}))
    metrics.update(backend=backend, source=str(source), bench_duration_s=data.get("duration"),
                   has_start_times=data.get("start_times") is not None)
    write_measured_run(out_dir, states, metrics)
    return metrics
