"""The server telemetry around a loadgen run (experiments/serving/loadgen/scrape.py): vLLM's text format parsed,
deltas and the summary by hand, our server's metrics under the same names, a server without /metrics skipped."""

from __future__ import annotations

import json

import pytest

from core.batch import Batch, Chunk
from core.records import StepRecord
from core.request import Request, RequestState
from experiments.serving.fake_openai import FakeOpenAIServer
from experiments.serving.loadgen import scrape
from experiments.serving.server.metrics import ServerMetrics

VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} %(running)s
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="1024",enable_prefix_caching="True"} 1.0
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{engine="0",le="0.5",model_name="m"} %(q)s
vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} %(q)s
vllm:request_queue_time_seconds_count{engine="0",model_name="m"} %(q)s
vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} %(qsum)s
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_bucket{engine="0",le="+Inf",model_name="m"} %(it)s
vllm:iteration_tokens_total_count{engine="0",model_name="m"} %(it)s
vllm:iteration_tokens_total_sum{engine="0",model_name="m"} %(itsum)s
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{engine="0",model_name="m"} %(gen)s
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} %(pq)s
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} %(ph)s
# TYPE other_metric counter
other_metric_total 5.0
"""


def text(**kw):
    return VLLM_TEXT % {"running": 0, "q": 0, "qsum": 0, "it": 0, "itsum": 0, "gen": 0, "pq": 0, "ph": 0, **kw}


def test_vllm_text_parsed_and_summarised_by_hand():
    before = scrape.parse(text(q=10, qsum=1.0, it=100, itsum=3000, gen=500))
    after = scrape.parse(text(running=3, q=30, qsum=5.0, it=300, itsum=9400, gen=2500))
    assert "other_metric_total" not in before and before["generation_tokens_total"] == {"": 500.0}
    d = scrape.delta(before, after)
    assert d["request_queue_time_seconds_count"] == {"": 20.0} and "num_requests_running" not in d
    s = scrape.summarize(before, after)
    assert s["num_gpu_blocks"] == 1024 and s["block_size"] == 128
    assert s["queue_count"] == 20 and s["queue_mean_s"] == pytest.approx(4.0 / 20)
    assert s["iterations"] == 200 and s["tokens_per_iteration"] == pytest.approx(6400 / 200)
    assert s["generation_tokens_total"] == 2000 and s["num_requests_running"] == 3
    assert "prefix_hit_rate" not in s  # no lookups in the run: no rate, not a zero one


def test_prefix_hits_and_an_old_file_summarised_again(tmp_path):
    before = scrape.parse(text(pq=1000, ph=100))
    after = scrape.parse(text(pq=5000, ph=1100))
    s = scrape.summarize(before, after)
    assert s["prefix_cache_queries_total"] == 4000 and s["prefix_cache_hits_total"] == 1000
    assert s["prefix_hit_rate"] == pytest.approx(0.25)
    path = scrape.write(tmp_path, before, after)
    body = json.loads(path.read_text())
    body["summary"] = {"num_gpu_blocks": 1}  # as an older reader wrote it
    path.write_text(json.dumps(body))
    assert scrape.read_summary(tmp_path)["prefix_hit_rate"] == pytest.approx(0.25)


def test_our_server_exports_the_names_a_measurement_reads():
    m = ServerMetrics("m", lambda: type("S", (), {"num_running": 1, "num_waiting": 0, "kv_used_blocks": 2,
                                                  "kv_total_blocks": 64})(), block_size=16)
    req = Request("a", 0.0, 8, 2)
    st = RequestState(req)
    st.first_scheduled_s = 0.5
    st.num_computed_tokens = 0
    batch = Batch([Chunk.next(st, 8)])
    st.num_computed_tokens = 8
    st.output_token_ids.append(1)
    st.token_times.append(1.0)
    st.first_token_s = 1.0
    m.on_step(batch, StepRecord(0, 0.5, 0.5, batch.features, 1, 0))
    st.token_times.append(1.5)
    st.output_token_ids.append(1)
    st.finish_s = 1.5
    m.on_terminal(st)
    s = scrape.summarize({}, scrape.parse(m.render().decode()))
    assert s["num_gpu_blocks"] == 64 and s["block_size"] == 16
    assert s["queue_mean_s"] == pytest.approx(0.5) and s["prefill_mean_s"] == pytest.approx(0.5)
    assert s["decode_mean_s"] == pytest.approx(0.5) and s["inference_mean_s"] == pytest.approx(1.0)
    assert s["iterations"] == 1 and s["tokens_per_iteration"] == 8


def test_a_server_without_metrics_leaves_no_file(tmp_path):
    with FakeOpenAIServer(ttft_s=0.001, itl_s=0.001) as srv:
        got = scrape.scrape(srv.url)
    assert got is None
    assert scrape.write(tmp_path, got, got) is None and scrape.read_summary(tmp_path) is None
