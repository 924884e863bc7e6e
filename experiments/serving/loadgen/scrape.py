"""A server's own telemetry around a measured run: its Prometheus ``/metrics`` scraped before and after.

vLLM exports ``vllm:*`` names, our server the same names under ``twinserve:`` (experiments/serving/server/metrics.py);
the prefix is dropped here, so one reader serves both. ``server_metrics.json`` in the loadgen run directory holds:

- ``before`` / ``after``: every sample, ``{name: {labels: value}}`` (labels as ``k=v,k=v``, sorted; ``""`` none);
- ``delta``: after - before of the counters and histogram series (``_total``, ``_count``, ``_sum``, ``_bucket``);
- ``summary``: what the simulator and the comparison read: ``num_gpu_blocks`` / ``block_size`` (the KV pool, from
  ``cache_config_info``), the run's mean queue / prefill / decode / inference time per request and its count
  (queueing split from service), iterations and tokens per iteration (``iteration_tokens_total``), and the gauges
  at the end (running, waiting, KV usage). A name the server does not export is absent from the summary.

A server without ``/metrics`` (the fake server, another product) leaves no file and no error: telemetry is optional.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PREFIXES = ("vllm:", "twinserve:")
FILE = "server_metrics.json"
Samples = dict[str, dict[str, float]]
# request-phase histograms: summary key -> metric name (vLLM v1's names; seconds per finished request)
PHASES = {"queue": "request_queue_time_seconds", "prefill": "request_prefill_time_seconds",
          "decode": "request_decode_time_seconds", "inference": "request_inference_time_seconds",
          "ttft": "time_to_first_token_seconds", "e2e": "e2e_request_latency_seconds"}
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
CUMULATIVE = ("_total", "_count", "_sum", "_bucket")


def parse(text: str) -> Samples:
    """Prometheus text format -> ``{name without prefix: {labels: value}}`` (only the known prefixes)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = next((s.name[len(p):] for p in PREFIXES if s.name.startswith(p)), None)
            if name is None:
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "engine"))
            out.setdefault(name, {})[labels] = float(s.value)
    return out


def scrape(base_url: str, timeout_s: float = 10.0) -> Samples | None:
    """``GET <base_url>/metrics``, parsed; None when the server has no metrics endpoint or does not answer."""
    url = base_url.rstrip("/").removesuffix("/v1/completions").removesuffix("/v1") + "/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return parse(r.read().decode())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def delta(before: Samples, after: Samples) -> Samples:
    """after - before of every cumulative series (a series new after the run counts from 0)."""
    return {name: {lab: v - before.get(name, {}).get(lab, 0.0) for lab, v in series.items()}
            for name, series in after.items() if name.endswith(CUMULATIVE)}


def _total(series: Mapping[str, float] | None) -> float | None:
    return None if not series else float(sum(series.values()))


def summarize(before: Samples, after: Samples) -> dict[str, Any]:
    """The run's telemetry that the simulator and the comparison use (see the module docstring)."""
    d = delta(before, after)
    out: dict[str, Any] = {}
    cache = after.get("cache_config_info", {})
    for labels in cache:
        kv = dict(p.split("=", 1) for p in labels.split(",") if "=" in p)
        for key in ("num_gpu_blocks", "block_size"):
            if kv.get(key, "").isdigit():
                out[key] = int(kv[key])
    for key, name in PHASES.items():
        n, s = _total(d.get(f"{name}_count")), _total(d.get(f"{name}_sum"))
        if n:
            out[f"{key}_count"], out[f"{key}_mean_s"] = int(n), s / n
    n, s = _total(d.get("iteration_tokens_total_count")), _total(d.get("iteration_tokens_total_sum"))
    if n:
        out["iterations"], out["tokens_per_iteration"] = int(n), s / n
    for name in ("prompt_tokens_total", "generation_tokens_total", "num_preemptions_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total"):
        if (v := _total(d.get(name))) is not None:
            out[name] = int(v)
    if out.get("prefix_cache_queries_total"):  # tokens looked up vs found: the share of prompt tokens not computed
        out["prefix_hit_rate"] = out.get("prefix_cache_hits_total", 0) / out["prefix_cache_queries_total"]
    for name in GAUGES:
        if (v := _total(after.get(name))) is not None:
            out[name] = v
    return out


def write(run_dir: str | Path, before: Samples | None, after: Samples | None) -> Path | None:
    """``server_metrics.json`` in ``run_dir`` (None, nothing written, when either scrape failed)."""
    if before is None or after is None:
        return None
    path = Path(run_dir) / FILE
    body = {"before": before, "after": after, "delta": delta(before, after), "summary": summarize(before, after)}
    path.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    return path


def read_summary(run_dir: str | Path) -> dict[str, Any] | None:
    """The ``summary`` of a run directory's server_metrics.json (None when the run has none), recomputed from its
    ``before`` / ``after`` samples, so a file written by an older reader gains what this one reads."""
    path = Path(run_dir) / FILE
    if not path.is_file():
        return None
    body = json.loads(path.read_text())
    return summarize(body["before"], body["after"]) if "before" in body and "after" in body else body["summary"]
