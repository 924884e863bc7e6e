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

import csv
import io
import json
import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from core.interfaces import Workload
from core.metrics import stats
from core.request import Request, RequestState
from core.specs import ModelSpec
from experiments.cli import hydra_app
from experiments.config import MetricsConfig, OutputConfig, plain, section
from experiments.serving.loadgen import scrape
from experiments.serving.loadgen.client import CLIENT_COLUMNS, ClientRecord, LoadGen
from experiments.serving.loadgen.prompts import build_prompts
from experiments.serving.loadgen.target import Target

LAG_PERCENTILES = (50, 90, 99, 99.9)
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
    ``client``: a LoadGen subclass to run instead (e.g. instrumented, as in ``experiments.benchmarks.loadgen``)."""
    from core.metrics import summarize
    from core.workload.base import OpenLoop
    from experiments.build import build_workload, summary_options
    from experiments.serving.bench_result import bench_serve_result, write_measured_run

    target = Target.from_mapping(cfg.target)
    model = ModelSpec.from_config(plain(cfg.model))
    output = section(OutputConfig, "output", cfg.get("output"))
    options = summary_options(section(MetricsConfig, "metrics", cfg.get("metrics")), cfg.slo, model)
    workload = build_workload(cfg.workload)
    prompts = build_prompts(cfg, target, model.vocab_size)
    # open-loop requests are known up front: their count gives the progress bar a total and an ETA
    requests = list(workload.initial()) if isinstance(workload, OpenLoop) else None
    if requests is not None:
        workload = _Fixed(workload, requests)
    gen = (client or LoadGen)(workload, target, prompts, progress=output.show_progress,
                              total=_known_total(workload, requests))
    before = scrape.scrape(target.url)  # the server's telemetry around the run (None: it has no /metrics)
    res = gen.run()
    after = scrape.scrape(target.url) if before is not None else None

    metrics = summarize(res.states, **options)
    lags = res.send_lags_s
    metrics.update(
        backend="loadgen", target_url=target.completions_url, target_model=res.model, prompt_mode=target.prompt_mode,
        send_lag_s=stats(lags, options["percentile_method"], LAG_PERCENTILES),
        num_unsent=len(res.records) - len(lags),
        num_token_count_mismatch=res.num_token_count_mismatch,
        num_client_errors=res.num_client_errors,
        num_prompt_length_off=prompts.num_length_off + sum(
            r.usage_prompt_tokens is not None and r.usage_prompt_tokens != s.request.prompt_len
            for r, s in zip(res.records, res.states, strict=True)),
    )
    bench = bench_serve_result(res.states, metrics["duration_s"], options["slo"])
    bench.update(backend="twinserve-loadgen", model_id=res.model, max_concurrency=target.max_concurrency)
    out = Path(out_dir)
    write_measured_run(out, res.states, metrics, {
        "bench_serve.json": json.dumps(bench, indent=2, allow_nan=False) + "\n",
        "client.csv": _client_csv(res.records),
        "config.yaml": OmegaConf.to_yaml(cfg, resolve=True),
    }, timing={"wall_s": res.wall_s})
    scrape.write(out, before, after)
    if output.plots:
        from core.output import read_metrics, read_requests_csv, read_tokens_csv
        from experiments import plots

        run = plots.RunData(read_requests_csv(out / "requests.csv"), read_tokens_csv(out / "tokens.csv"), {},
                            read_metrics(out / "metrics.json"))
        plots.latency_cdfs({out.name: run}, out / "latency_cdfs.png", f"loadgen: {res.model}")
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
    metrics = run_loadgen(cfg, out_dir)
    log.info(summary_line(metrics))
    log.info(f"wrote {out_dir} ({time.perf_counter() - t:.1f} s)")




if __name__ == "__main__":
    main()
