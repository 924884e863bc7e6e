"""Prometheus metrics of the server (``GET /metrics``), named after vLLM's with a ``twinserve:`` prefix.

One registry per server (no process-global state). Counters and histograms are updated on the loop thread once
per step and once per finished request; gauges are read from the loop's snapshot when scraped. The names a
measurement reads (``experiments.serving.loadgen.scrape``) are vLLM v1's: the request phases (queue: arrival to
first scheduled; prefill: first scheduled to first token; decode: first to last token; inference: prefill +
decode), ``iteration_tokens_total`` (tokens per step) and ``cache_config_info`` (the KV pool's block count).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from core.batch import Batch
from core.records import StepRecord
from core.request import RequestState

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    def __init__(self, model_name: str, snapshot: Callable[[], object], block_size: int | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model_name": model_name}
        r = self.registry

        def gauge(name: str, doc: str, read: Callable[[], float]) -> None:
            g = Gauge(f"twinserve:{name}", doc, list(labels), registry=r).labels(**labels)
            g.set_function(read)

        gauge("num_requests_running", "Requests in the running set of a replica.", lambda: snapshot().num_running)
        gauge("num_requests_waiting", "Requests waiting for admission.", lambda: snapshot().num_waiting)
        gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).",
              lambda: snapshot().kv_used_blocks / max(snapshot().kv_total_blocks, 1))

        self._info = Gauge("twinserve:cache_config_info", "The KV cache's configuration (value 1; the labels say "
                           "it).", ["num_gpu_blocks", "block_size"], registry=r)
        self._snapshot, self._block_size = snapshot, block_size

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"twinserve:{name}", doc, [*labels, *extra], registry=r)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.").labels(**labels)
        self.generation_tokens = counter("generation_tokens", "Generated tokens.").labels(**labels)
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.prefix_queries, self.prefix_hits = (c.labels(**labels) for c in (self.prefix_queries, self.prefix_hits))
        self.preemptions = counter("num_preemptions", "Preemptions (recompute).").labels(**labels)
        self._requests = counter("request_success", "Requests ended, by status.", ("status",))
        self._labels = labels

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"twinserve:{name}", doc, list(labels), buckets=LATENCY_BUCKETS,
                             registry=r).labels(**labels)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Gap between consecutive output tokens.")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish of finished requests.")
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.")
        self.prefill = histogram("request_prefill_time_seconds", "First scheduled to first token.")
        self.decode = histogram("request_decode_time_seconds", "First token to last token.")
        self.inference = histogram("request_inference_time_seconds", "First scheduled to last token.")
        self.iteration_tokens = Histogram("twinserve:iteration_tokens_total", "Tokens per engine step.", list(labels),
                                          buckets=TOKEN_BUCKETS, registry=r).labels(**labels)

    def on_step(self, batch: Batch, record: StepRecord) -> None:
        self.iteration_tokens.observe(batch.features.num_batched_tokens)
        n = 0
        for ch in batch.chunks:
            if not ch.samples:
                continue
            times = ch.state.token_times
            k = 1  # tokens this step added: one, or several when it verified drafts (an event of k tokens)
            while k < len(times) and times[-k - 1] == times[-1]:
                k += 1
            n += k
            if len(times) == k:
                self.ttft.observe(times[0] - ch.state.request.arrival_s)
            else:  # inter-token latency between output events, as metrics.json's itl_s
                self.itl.observe(times[-1] - times[-k - 1])
        if n:
            self.generation_tokens.inc(n)
        if record.num_preempted:
            self.preemptions.inc(record.num_preempted)

    def on_terminal(self, state: RequestState) -> None:
        self._requests.labels(**self._labels, status=state.status.value.lower()).inc()
        if state.first_scheduled_s is not None:
            self.prompt_tokens.inc(state.request.prompt_len)
            self.prefix_queries.inc(state.request.prompt_len)
            self.prefix_hits.inc(state.num_cached_tokens)
            self.queue.observe(state.first_scheduled_s - state.request.arrival_s)
        if state.finish_s is not None and state.first_token_s is not None:
            self.e2e.observe(state.finish_s - state.request.arrival_s)
            if state.first_scheduled_s is not None:
                self.prefill.observe(state.first_token_s - state.first_scheduled_s)
                self.inference.observe(state.finish_s - state.first_scheduled_s)
            self.decode.observe(state.finish_s - state.first_token_s)

    def render(self) -> bytes:
        if not self._info.collect()[0].samples:  # the pool's size is known once the loop runs (its snapshot)
            self._info.labels(num_gpu_blocks=str(self._snapshot().kv_total_blocks),
                              block_size=str(self._block_size or "")).set(1)
        return generate_latest(self.registry)
