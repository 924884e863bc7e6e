"""`python -m experiments.loadgen`: replay any workload against any OpenAI-compatible server, measured like a run.

Every workload of the simulator (``conf/workload/*``) is sent to ``target.url``'s ``/v1/completions``, streamed
(SSE, ``stream_options.include_usage``), and measured per output chunk, so the run directory holds the same
requests.csv, tokens.csv and metrics.json as a simulated run (no steps.csv: a black box shows no steps), plus:

- ``bench_serve.json``: the same run in vLLM ``bench serve`` result form (``experiments.serving.bench_result``);
- ``client.csv``: per request the scheduled and actual send times (s from the start), the HTTP status and the
  token counts the server reported in its usage block;
- ``config.yaml`` (the resolved config) and ``latency_cdfs.png`` (``output.plots``);
- ``server_metrics.json``: the server's Prometheus ``/metrics`` before and after the run, their difference and a
  summary (KV block count, queue / prefill / decode time per request), when it has one (``loadgen.scrape``).

Prompts: a request of n prompt tokens is sent as exactly n token ids (``target.prompt_mode=tokens``: its
``prompt_token_ids``, else ``core.prompt.materialize``'s deterministic ids, the ones our engine runs, so requests
sharing content share token prefixes), or as text that tokenizes to n tokens with the target's tokenizer
(``prompt_mode=text``, ``TextPrompts``). ``target.ignore_eos`` sends ``ignore_eos`` and ``min_tokens`` =
``max_tokens`` so that every request generates exactly its workload output length.

Timing (one asyncio loop, ``time.monotonic``): request i is due at start + ``arrival_s``; the client sleeps until
just before, then yields to the loop until the due time and launches it. Its ``arrival_s`` in the run files is the
due time (so client delays count in TTFT), its ``first_scheduled_s`` the time its body was written to the socket
(metrics' queue_s is therefore the client-side delay: send lag plus any wait for a ``target.max_concurrency``
slot; the server's own queue is not visible). Each network read is one timestamp: the tokens of the SSE chunks it
carries are one output event (k tokens -> one event of k tokens, ``core.metrics.output_events``). A chunk's
tokens are counted from its ``token_ids`` (or ``logprobs.tokens``) when the server sends them, else 1 per chunk
(0 for an empty final chunk); when the usage block's ``completion_tokens`` disagrees, the usage count is spread
over the chunks (``bench_format.apportion``) and ``num_token_count_mismatch`` counts it. A FINISHED request's
``finish_s`` is its last token's time (as in the simulator, and vLLM's E2EL).

Every request ends in exactly one terminal status: FINISHED (a stream with >= 1 token that ended with a
finish_reason or ``[DONE]``); TIMED_OUT (no complete answer ``target.timeout_s`` after its due time; the
connection is closed, which a server sees as a cancel); REJECTED (an HTTP error status, a connection error, an
error object in the stream, or a stream that ended early), with the reason. Closed-loop and multi-turn workloads
get each client's next request from ``workload.on_finish(state, now)``, as in the simulator.

Send lag (actual send - due time, over all requests that were sent) is in metrics.json as ``send_lag_s``;
``python -m experiments.bench_loadgen`` measures it at 100 req/s against a fake server. To keep it small the
client opens a few keep-alive connections before the clock starts, builds each request body before its due time,
and pauses Python's automatic garbage collection during the run (young generations are collected when no send is
due within ``GC_QUIET_S``).
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import math
import sys
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from core.interfaces import Workload
from core.journal import read_journal, remove_journal
from core.metrics import stats
from core.output import COMPLETE, FAILED, INTERRUPTED, write_run
from core.request import Request, RequestState, Status
from core.specs import ModelSpec
from experiments.cli import hydra_app
from experiments.config import MetricsConfig, OutputConfig, plain, section
from experiments.serving.journal import LOADGEN, open_journal
from experiments.serving.loadgen import scrape
from experiments.serving.loadgen.client import CLIENT_COLUMNS, ClientRecord, LoadGen, LoadgenResult
from experiments.serving.loadgen.prompts import build_prompts
from experiments.serving.loadgen.target import Target

LAG_PERCENTILES = (50, 90, 99, 99.9)
EXIT_RUN_FAILED = 1  # more than target.max_failed_share of the requests failed
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)
log = logging.getLogger(__name__)


def _known_total(workload: Workload, requests: list[Request] | None) -> int | None:
    if requests is not None:
        return len(requests)
    n = getattr(workload, "num_requests", None)
    return n if isinstance(n, int) else None


def _client_csv(records: Sequence[ClientRecord]) -> str:
    from core.output import fmt

    f = io.StringIO()
    w = csv.writer(f, lineterminator="\n")
    w.writerow(CLIENT_COLUMNS)
    for r in sorted(records, key=lambda r: r.scheduled_s):
        w.writerow([fmt(getattr(r, c)) for c in CLIENT_COLUMNS])
    return f.getvalue()


def run_loadgen(cfg: DictConfig, out_dir: str | Path, client: type[LoadGen] | None = None) -> dict[str, Any]:
    """Replay ``cfg.workload`` against ``cfg.target`` and write the run directory; returns metrics.json's dict.
    ``client``: a LoadGen subclass to run instead (e.g. instrumented, as in ``experiments.benchmarks.loadgen``).

    Requests are journaled as they are sent and as they end (``core.journal``, ``experiments.serving.recover``): a
    killed load test is recovered by ``twinserve recover DIR``. Interrupted (Ctrl-C, an error), it writes what it
    has as ``.partial`` files with ``run_status: interrupted`` (the requests in flight CANCELLED) and re-raises.
    More than ``target.max_failed_share`` of the requests failed: ``run_status: failed`` (see ``failure``)."""
    from core.workload.base import OpenLoop
    from experiments.build import build_workload

    target = Target.from_mapping(cfg.target)
    model = ModelSpec.from_config(plain(cfg.model))
    output = section(OutputConfig, "output", cfg.get("output"))
    workload = build_workload(cfg.workload)
    prompts = build_prompts(cfg, target, model.vocab_size)
    # open-loop requests are known up front: their count gives the progress bar a total and an ETA
    requests = list(workload.initial()) if isinstance(workload, OpenLoop) else None
    if requests is not None:
        workload = _Fixed(workload, requests)
    out = Path(out_dir)
    journal = open_journal(out, LOADGEN, "loadgen", OmegaConf.to_yaml(cfg, resolve=True))
    gen = (client or LoadGen)(workload, target, prompts, progress=output.show_progress,
                              total=_known_total(workload, requests), journal=journal)
    before = scrape.scrape(target.url)  # the server's telemetry around the run (None: it has no /metrics)
    try:
        res = gen.run()
    except BaseException as e:
        journal.close()
        contents = read_journal(out)
        for s in contents.in_flight:
            s.reason = f"loadgen stopped ({type(e).__name__}) while it was in flight"
        with contextlib.suppress(Exception):  # the error that stopped the run is the one to report
            write_loadgen_run(cfg, out, contents.states, gen.records, contents.last_time_s, None,
                              run_status=INTERRUPTED, note={"error": f"{type(e).__name__}: {e}".rstrip(": "),
                                                            "num_unfinished": len(contents.in_flight)},
                              num_length_off=prompts.num_length_off)
            remove_journal(out)
        raise
    journal.close()
    after = scrape.scrape(target.url) if before is not None else None
    failed = failure(res.states, target.max_failed_share)
    metrics = write_loadgen_run(cfg, out, res.states, res.records, res.wall_s, res,
                                run_status=FAILED if failed else COMPLETE, note={"error": failed} if failed else None,
                                num_length_off=prompts.num_length_off)
    remove_journal(out)
    scrape.write(out, before, after)
    if output.plots and not failed:
        from core.output import read_metrics, read_requests_csv, read_tokens_csv
        from experiments import plots

        run = plots.RunData(read_requests_csv(out / "requests.csv"), read_tokens_csv(out / "tokens.csv"), {},
                            read_metrics(out / "metrics.json"))
        plots.latency_cdfs({out.name: run}, out / "latency_cdfs.png", f"loadgen: {res.model}")
    return metrics


def failure(states: Sequence[RequestState], max_failed_share: float) -> str | None:
    """Why a load test failed (more than ``max_failed_share`` of its measured requests did not complete: rejected
    or timed out, e.g. against a dead port), with the commonest reason; None when it did not."""
    measured = [s for s in states if not s.request.warmup]
    bad = [s for s in measured if s.status in (Status.REJECTED, Status.TIMED_OUT)]
    if not measured or len(bad) <= max_failed_share * len(measured):
        return None
    reasons = Counter(s.reason for s in bad).most_common(1)
    return (f"{len(bad)} of {len(measured)} requests failed (> target.max_failed_share={max_failed_share}); "
            f"the commonest reason ({reasons[0][1]}x): {reasons[0][0]}")


def write_loadgen_run(cfg: DictConfig, out_dir: str | Path, states: Sequence[RequestState],
                      records: Sequence[ClientRecord], wall_s: float, res: LoadgenResult | None, *,
                      run_status: str = COMPLETE, note: Mapping[str, Any] | None = None,
                      num_length_off: int = 0) -> dict[str, Any]:
    """A load test's run directory from its states and client records (``res``: the finished run's counts; None
    for a run cut short or recovered from its journal; ``num_length_off``: prompts the client could not give their
exact length, ``Prompts.num_length_off``); returns metrics.json's dict."""
    from core.metrics import summarize
    from experiments.build import summary_options
    from experiments.serving.bench_result import bench_serve_result

    target = Target.from_mapping(cfg.target)
    model = ModelSpec.from_config(plain(cfg.model))
    options = summary_options(section(MetricsConfig, "metrics", cfg.get("metrics")), cfg.slo, model)
    metrics = summarize(states, **options)
    lags = [r.sent_s - r.scheduled_s for r in records if r.sent_s is not None]
    prompt_tokens = {r.id: r.usage_prompt_tokens for r in records}
    model_id = res.model if res is not None else (target.model or "")
    metrics.update(
        backend="loadgen", target_url=target.completions_url, target_model=model_id, prompt_mode=target.prompt_mode,
        send_lag_s=stats(lags, options["percentile_method"], LAG_PERCENTILES),
        num_unsent=len(records) - len(lags),
        num_token_count_mismatch=res.num_token_count_mismatch if res is not None else None,
        num_client_errors=res.num_client_errors if res is not None else None,
        num_prompt_length_off=num_length_off + sum(
            prompt_tokens.get(s.id) is not None and prompt_tokens[s.id] != s.request.prompt_len for s in states),
        **(note or {}),
    )
    bench = bench_serve_result(states, metrics["duration_s"], options["slo"])
    bench.update(backend="twinserve-loadgen", model_id=model_id, max_concurrency=target.max_concurrency)
    write_run(out_dir, states, None, metrics, {
        "bench_serve.json": json.dumps(bench, indent=2, allow_nan=False) + "\n",
        "client.csv": _client_csv(records),
        "config.yaml": OmegaConf.to_yaml(cfg, resolve=True),
    }, timing={"wall_s": wall_s}, run_status=run_status)
    return metrics


class _Fixed:
    """An open-loop workload whose requests were already drawn (``initial`` replays the list)."""

    def __init__(self, inner: Workload, requests: list[Request]) -> None:
        self.inner, self.requests = inner, requests

    def initial(self) -> Iterator[Request]:
        return iter(self.requests)

    def on_finish(self, state: RequestState, now: float) -> Request | None:
        return self.inner.on_finish(state, now)


def summary_line(metrics: Mapping[str, Any]) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 1e3:.2f}"

    lag = metrics["send_lag_s"]
    return (f"completed {metrics['num_completed']}/{metrics['num_requests']} (rejected {metrics['num_rejected']}, "
            f"timed out {metrics['num_timed_out']}); TTFT p50/p99 ms {ms(metrics['ttft_s']['p50'])}/"
            f"{ms(metrics['ttft_s']['p99'])}; ITL p50/p99 ms {ms(metrics['itl_s']['p50'])}/"
            f"{ms(metrics['itl_s']['p99'])}; send lag p50/p99/max ms {ms(lag['p50'])}/{ms(lag['p99'])}/"
            f"{ms(lag['max'])}")


@hydra_app("loadgen")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    out_dir = HydraConfig.get().runtime.output_dir
    t = time.perf_counter()
    try:
        metrics = run_loadgen(cfg, out_dir)
    except KeyboardInterrupt:
        log.error(f"interrupted: wrote what had ended to {out_dir} (.partial files, run_status: interrupted)")
        raise SystemExit(EXIT_INTERRUPTED) from None
    log.info(summary_line(metrics))
    log.info(f"wrote {out_dir} ({time.perf_counter() - t:.1f} s)")
    if metrics.get("error"):  # run_status failed: too many requests failed
        print(f"error: {metrics['error']}; wrote {out_dir} (run_status: failed)", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_RUN_FAILED)




if __name__ == "__main__":
    main()
