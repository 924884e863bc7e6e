"""The gateway's Prometheus page (``GET /metrics``): per backend its requests by outcome, errors by kind, requests in
flight, health, routing decisions, the size of its prefix index and what its own /metrics last said.

One registry per gateway (no process-global state); names carry the ``twinserve_gateway:`` prefix."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from experiments.serving.gateway.backends import Backend

P = "twinserve_gateway:"
SCRAPED_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                  "prefix_cache_hits_total")


class GatewayMetrics:
    def __init__(self, backends: Sequence[Backend], router: str) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.router = router
        self.requests = Counter(P + "requests", "Requests ended, by backend and outcome (finished, error, cancelled, "
                                "http_<status>).", ["backend", "outcome"], registry=r)
        self.errors = Counter(P + "backend_errors", "Backend faults: refused, timeout, died (mid-stream), http_5xx.",
                              ["backend", "kind"], registry=r)
        self.decisions = Counter(P + "routing_decisions", "Requests the router sent to each backend.",
                                 ["router", "backend"], registry=r)
        self.rejected = Counter(P + "rejected", "Requests the gateway answered itself: no_backend (503), saturated "
                                "(429), bad_request (400).", ["reason"], registry=r)
        gauges = {
            "in_flight": ("Requests in flight through the gateway.", lambda b: len(b.flights)),
            "healthy": ("1 while the backend is in rotation.", lambda b: float(b.healthy)),
            "index_blocks": ("Prefix blocks the gateway's index holds for the backend.", lambda b: len(b.index)),
        }
        for name in SCRAPED_GAUGES:
            gauges["backend_" + name.removesuffix("_total")] = (
                f"The backend's own {name} (last scrape; NaN: not exposed).",
                lambda b, n=name: b.scraped.get(n, float("nan")))
        for name, (doc, read) in gauges.items():
            g = Gauge(P + name, doc, ["backend"], registry=r)
            for b in backends:
                g.labels(backend=b.name).set_function(lambda b=b, read=read: read(b))

    def render(self) -> bytes:
        return generate_latest(self.registry)
