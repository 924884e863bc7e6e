"""Each backend as the gateway sees it: health, requests in flight through the gateway, the load and KV usage its
own ``/metrics`` reports (scraped every ``gateway.poll_interval_s``), and the ``ReplicaView`` a router gets of it.

Scraped names (summed over label sets): vLLM's ``vllm:`` and ours ``twinserve:`` -- ``num_requests_running``,
``num_requests_waiting``, ``kv_cache_usage_perc`` (vLLM before v1: ``gpu_cache_usage_perc``),
``prefix_cache_queries_total`` / ``prefix_cache_hits_total`` (tokens) and vLLM's ``cache_config_info``
(``block_size``, ``num_gpu_blocks`` labels). A server that exposes none of them is routed on the gateway's own
counts alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from core.interfaces import ReplicaView
from experiments.serving.gateway.config import BackendSpec
from experiments.serving.gateway.index import PrefixIndex

PREFIXES = ("vllm:", "twinserve:")
SCRAPED = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "gpu_cache_usage_perc",
           "prefix_cache_queries_total", "prefix_cache_hits_total")
log = logging.getLogger(__name__)


def parse_metrics(text: str) -> dict[str, float]:
    """The ``SCRAPED`` samples of a Prometheus text page (prefix dropped, summed over labels), plus ``block_size``
    and ``num_gpu_blocks`` from a ``cache_config_info`` sample's labels."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            prefix = next((p for p in PREFIXES if s.name.startswith(p)), None)
            if prefix is None:
                continue
            name = s.name[len(prefix):]
            if name in SCRAPED:
                out[name] = out.get(name, 0.0) + float(s.value)
            elif name == "cache_config_info":
                for key in ("block_size", "num_gpu_blocks"):
                    if str(s.labels.get(key, "")).isdigit():
                        out[key] = float(s.labels[key])
    if "kv_cache_usage_perc" not in out and "gpu_cache_usage_perc" in out:
        out["kv_cache_usage_perc"] = out["gpu_cache_usage_perc"]
    return out


@dataclass(slots=True)
class Flight:
    """A request in flight to a backend: what its ReplicaView counts as pending work."""

    prompt_len: int
    max_tokens: int
    cached: int  # tokens of its prompt the index expected the backend to hold
    generated: int = 0
    streaming: bool = False  # its first token came back


@dataclass
class Backend:
    spec: BackendSpec
    index: PrefixIndex
    healthy: bool = True  # until a health check or a request says otherwise
    reason: str = ""  # why it is out of rotation
    saturated_until: float = 0.0  # answered 429: no new request before this (monotonic time)
    flights: dict[object, Flight] = field(default_factory=dict)
    scraped: dict[str, float] = field(default_factory=dict)
    outstanding_at_scrape: int = 0  # own requests in flight when ``scraped`` was read

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def block_size(self) -> int:
        return int(self.scraped.get("block_size", self.spec.block_size))

    @property
    def num_blocks(self) -> int:
        return int(self.spec.num_blocks or self.scraped.get("num_gpu_blocks") or self.index.capacity)

    def saturated(self, now: float) -> bool:
        return len(self.flights) >= self.spec.max_in_flight or now < self.saturated_until

    def mark_down(self, reason: str) -> None:
        if self.healthy:
            log.warning("backend %s out of rotation: %s", self.name, reason)
        self.healthy, self.reason = False, reason

    def mark_up(self) -> None:
        if not self.healthy:
            log.warning("backend %s back in rotation", self.name)
        self.healthy, self.reason = True, ""

    def on_scrape(self, values: dict[str, float]) -> None:
        self.scraped, self.outstanding_at_scrape = values, len(self.flights)
        if "num_gpu_blocks" in values and self.spec.num_blocks is None:
            self.index.capacity = int(values["num_gpu_blocks"])

    def external_load(self) -> int:
        """Requests the backend reported beyond those the gateway had in flight there (other clients' load)."""
        reported = self.scraped.get("num_requests_running", 0.0) + self.scraped.get("num_requests_waiting", 0.0)
        return max(0, int(reported) - self.outstanding_at_scrape)

    def view(self, position: int, hashes: list[int], now: float) -> ReplicaView:
        """The ReplicaView of this backend for one routing decision (``hashes``: the prompt's block hashes at this
        backend's block size). Waiting: own requests without a first token plus the external load; running: own
        streaming ones; free blocks: the pool minus the scraped KV usage."""
        flights = list(self.flights.values())
        running = sum(f.streaming for f in flights)
        usage = min(max(self.scraped.get("kv_cache_usage_perc", 0.0), 0.0), 1.0)
        num_blocks, block_size = self.num_blocks, self.block_size
        cached = self.index.match(hashes, now) * block_size

        def pending() -> tuple[int, int]:
            prefill = sum(f.prompt_len - f.cached for f in flights if not f.streaming)
            return prefill, sum(max(f.max_tokens - f.generated, 0) for f in flights)

        return ReplicaView(position, len(flights) - running + self.external_load(), running,
                           round(num_blocks * (1.0 - usage)), num_blocks, block_size, pending, lambda _r: cached)

