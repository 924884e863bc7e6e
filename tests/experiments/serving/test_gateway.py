"""The routing gateway against real backends on loopback: our server with ``backend=sim`` (two processes shared by
the module), a fake OpenAI server for faults it cannot be made to show, and the gateway in-process (one event loop
in a thread) or as `python -m experiments.gateway` (run files at SIGTERM). Every process started is stopped."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from aiohttp import web
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from core.output import read_metrics, read_requests, read_tokens
from experiments.serving.fake_openai import FakeOpenAIServer
from experiments.serving.gateway.backends import parse_metrics
from experiments.serving.gateway.index import CHARS_PER_TOKEN, PrefixIndex, key_hashes, prompt_keys, proxy_keys
from experiments.serving.gateway.main import build_gateway
from experiments.serving.server.process import ROOT, ServerProcess, free_port

ROUTERS = sorted(p.stem for p in (ROOT / "conf" / "router").glob("*.yaml"))
PREFIX = list(range(10, 74))  # 64 shared tokens: 4 blocks of 16


@pytest.fixture(scope="module")
def sims(tmp_path_factory):
    with ThreadPoolExecutor(2) as pool:
        servers = list(pool.map(lambda i: ServerProcess(None, tmp_path_factory.mktemp(f"sim{i}"), "backend=sim",
                                                        "kv.num_blocks=256"), range(2)))
    yield servers
    for s in servers:
        s.stop()


def config(backends, router="round_robin", **gateway):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("gateway", overrides=[f"router={router}"])
    with open_dict(cfg):
        cfg.gateway.backends = [b if isinstance(b, dict) else {"url": b} for b in backends]
        cfg.gateway.update(gateway)
    return cfg


@contextlib.contextmanager
def gateway(backends, out: Path, router="round_robin", **settings):
    """The gateway app served from a thread's event loop on a free port; yields (url, Gateway)."""
    gw, app = build_gateway(config(backends, router, **settings), out)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    port = free_port()

    async def start():
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()

    loop.run_until_complete(start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}", gw
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def post(url: str, body: dict, path: str = "/v1/completions", rid: str | None = None, timeout: float = 30):
    """(status, SSE data payloads or the JSON body, arrival time of each payload)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    headers = {"Content-Type": "application/json", **({"X-Request-Id": rid} if rid else {})}
    conn.request("POST", path, json.dumps(body), headers)
    r = conn.getresponse()
    if not body.get("stream") or r.status != 200:
        out = (r.status, json.loads(r.read()), [])
        conn.close()
        return out
    events, times = [], []
    while line := r.readline():
        if line.startswith(b"data:"):
            data = line[5:].strip().decode()
            events.append(data if data == "[DONE]" else json.loads(data))
            times.append(time.monotonic())
    conn.close()
    return r.status, events, times


def completion(prompt, n=4, stream=True):
    return {"prompt": prompt, "max_tokens": n, "stream": stream, "ignore_eos": True,
            "stream_options": {"include_usage": True}}


def metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def get(url: str, path: str) -> tuple[int, str]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", path)
    r = conn.getresponse()
    out = (r.status, r.read().decode())
    conn.close()
    return out


# ---- the pieces ----------------------------------------------------------------------------------------------------
def test_prefix_index_forgets_by_capacity_and_age():
    idx = PrefixIndex(capacity=3, max_age_s=10.0)
    a, b = key_hashes(tuple(range(64)), 16), key_hashes(tuple(range(32)) + (99,) * 32, 16)
    assert a[:2] == b[:2] and a[2] != b[2]  # chained: equal prefixes, equal hashes
    idx.add(a[:3], now=0.0)
    assert idx.match(a, 1.0) == 3 and idx.match(b, 1.0) == 2
    idx.add(b[2:3], now=2.0)  # a 4th block: the least recently sent (a[0]) goes, and a chain breaks at its start
    assert len(idx) == 3 and idx.match(a, 2.0) == 0
    assert idx.match(b[1:], 11.5) == 0 and len(idx) == 1  # at 11.5 the blocks sent at 0 are older than 10 s
    assert idx.match(b[2:], 11.5) == 1  # the one sent at 2 is not
    assert idx.match(b[2:], 12.5) == 0


def test_prompt_keys_ids_text_proxy_and_chat():
    assert prompt_keys({"prompt": [5, 6, 7]}, False, None) == (5, 6, 7)
    assert prompt_keys({"prompt": [[5, 6]]}, False, None) == (5, 6)
    text = "a system prompt shared by many requests; " * 4
    keys = prompt_keys({"prompt": text + "mine"}, False, None)
    assert len(keys) == -(-len(text + "mine") // CHARS_PER_TOKEN) and keys[:40] == proxy_keys(text)[:40]
    chat = prompt_keys({"messages": [{"role": "user", "content": "hi"}]}, True, None)
    assert chat == proxy_keys("<user>hi")
    assert prompt_keys({"prompt": 3}, False, None) == ()  # unreadable: the backend answers it


def test_text_prompts_and_messages_go_through_the_backends_tokenizer(tmp_path):
    from tests.engine.checkpoints import save_word_tokenizer

    save_word_tokenizer(tmp_path / "tok")
    gw, _ = build_gateway(config(["http://127.0.0.1:9"], tokenizer=str(tmp_path / "tok")), tmp_path / "out")
    tok = gw.tokenizers[str(tmp_path / "tok")]
    assert prompt_keys({"prompt": "w5 w6 w7"}, False, tok) == tuple(tok.encode("w5 w6 w7"))
    messages = [{"role": "user", "content": "w9 w10"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert prompt_keys({"messages": messages}, True, tok) == tuple(ids if isinstance(ids, list) else ids["input_ids"])


@pytest.mark.parametrize("gateway_cfg, message", [
    ({"backends": []}, "gateway.backends is empty"),
    ({"backends": [{"url": "http://a:1", "bogus": 1}]}, r"gateway.backends\[0\]: unknown keys \['bogus'\]"),
    ({"backends": ["ftp://a"]}, "url must be an http"),
    ({"backends": [{"url": "http://a:1", "name": "x"}, {"url": "http://b:1", "name": "x"}]}, "names must be unique"),
    ({"backends": ["http://a:1"], "timeout_s": 0}, "gateway.timeout_s"),
    ({"backends": ["http://a:1"], "colour": 1}, r"gateway: unknown keys \['colour'\]"),
])
def test_bad_gateway_config_is_a_one_line_error_naming_the_key(gateway_cfg, message):
    from experiments.serving.gateway.config import GatewayConfig

    with pytest.raises(ValueError, match=message):
        GatewayConfig.from_config(gateway_cfg)


@pytest.mark.parametrize("nl", [b"\n", b"\r\n"])
def test_sse_reader_passes_complete_events_and_counts_tokens(nl):
    from experiments.serving.gateway.sse import SSEReader

    event = b'data: {"choices": [{"text": "a", "finish_reason": null}]}' + nl + nl
    last = b'data: {"choices": [{"text": "", "finish_reason": "length"}], "usage": {"completion_tokens": 2}}' + nl + nl
    sse = SSEReader()
    assert sse.feed(event + event[:10]) == (event, 1)  # a partial event waits for its end
    assert sse.feed(event[10:] + last + b"data: [DONE]" + nl + nl) == (event + last + b"data: [DONE]" + nl + nl, 1)
    assert sse.complete and sse.usage == {"completion_tokens": 2}


def test_scraped_metrics_of_vllm_and_ours():
    vllm = ('vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
            '# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total{engine="0"} 128.0\n'
            'vllm:cache_config_info{block_size="32",num_gpu_blocks="4096"} 1.0\n')
    assert parse_metrics(vllm) == {"num_requests_running": 3, "num_requests_waiting": 2, "kv_cache_usage_perc": 0.25,
                                   "prefix_cache_hits_total": 128, "block_size": 32, "num_gpu_blocks": 4096}
    ours = 'twinserve:num_requests_waiting{model_name="tiny"} 1.0\nother_metric 5\n'
    assert parse_metrics(ours) == {"num_requests_waiting": 1}


# ---- routing -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("router", ROUTERS)
def test_every_router_routes_real_backends(sims, tmp_path, router):
    prompts = [PREFIX + [100 + i] * (8 + i) for i in range(6)]
    with gateway([s.url for s in sims], tmp_path, router) as (url, gw):
        answers = [post(url, completion(p)) for p in prompts]
        _, page = get(url, "/metrics")
    for status, events, _ in answers:
        assert status == 200 and events[-1] == "[DONE]"
        assert events[-2]["usage"]["completion_tokens"] == 4
    name = type(gw.router).__name__
    counts = [metric(page, "twinserve_gateway:routing_decisions_total", router=name, backend=b) for b in ("b0", "b1")]
    assert sum(counts) == len(prompts)
    assert metric(page, "twinserve_gateway:requests_total", outcome="finished") == len(prompts)
    if router == "round_robin":
        assert counts == [3, 3]
    if router in ("prefix_aware", "cost_based"):  # sequential: no load, so the shared prefix keeps one backend
        assert sorted(counts) == [0, 6]


def test_prefix_aware_sends_a_shared_prefix_where_it_is_cached(sims, tmp_path):
    """Two groups of prompts: each group's prefix lives on one backend, whose own prefix cache then hits."""
    before = [s.metric("prefix_cache_hits_total") for s in sims]
    groups = [list(range(200, 264)), list(range(300, 364))]
    with gateway([s.url for s in sims], tmp_path, "prefix_aware") as (url, gw):
        post(url, completion(groups[0] + [1]))  # -> b0 (ties: lowest index)
        post(url, completion(groups[1] + [1]))  # -> b0 again (equal load 0, no cached prefix anywhere): tie
        sent = []
        for i in range(4):
            post(url, completion(groups[i % 2] + [2 + i]))
            sent.append([b.index.match(key_hashes(tuple(g), 16), gw.now()) for b in gw.backends for g in groups])
    hits = [s.metric("prefix_cache_hits_total") - h for s, h in zip(sims, before, strict=True)]
    assert sum(hits) >= 4 * 64  # every later request reused its group's 4 blocks on the backend it went to
    assert sent[-1][:2] == [4, 4]  # the index knows both prefixes are on b0


def test_streaming_passes_chunk_by_chunk_and_whole_answers_pass_through(sims, tmp_path):
    prompt = list(range(500, 540))
    direct = post(sims[0].url, completion(prompt, n=12))
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with gateway([sims[0].url], tmp_path) as (url, _):
        status, events, times = post(url, completion(prompt, n=12))
        whole = post(url, completion(prompt, n=12, stream=False))
        refused = post(url, chat, path="/v1/chat/completions")  # the sim server has no chat template: its 400
    assert refused == post(sims[0].url, chat, path="/v1/chat/completions") and refused[0] == 400
    assert status == 200 and len(events) == len(direct[1]) == 12 + 3  # 12 token chunks, the finish, usage, [DONE]
    assert [e["choices"][0]["finish_reason"] for e in events[:13]] == [None] * 12 + ["length"]
    assert events[-2]["usage"] == direct[1][-2]["usage"]
    assert times[11] - times[0] > 0.01  # chunks reach the client as the backend makes them, not all at the end
    assert whole[0] == 200 and whole[1]["usage"]["completion_tokens"] == 12 and whole[1]["object"] == "text_completion"


# ---- faults --------------------------------------------------------------------------------------------------------
def test_a_refusing_backend_is_skipped_and_taken_out_of_rotation(sims, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with gateway([dead, sims[0].url], tmp_path, poll_interval_s=60) as (url, gw):
        gw.backends[0].healthy = True  # as if it had just died after the first health check
        answers = [post(url, completion(PREFIX)) for _ in range(3)]
        _, page = get(url, "/metrics")
        health = json.loads(get(url, "/health")[1])
    assert [a[0] for a in answers] == [200] * 3
    assert metric(page, "twinserve_gateway:backend_errors_total", backend="b0", kind="refused") == 1
    assert health["backends"]["b0"]["healthy"] is False and "refused" in health["backends"]["b0"]["reason"]
    assert metric(page, "twinserve_gateway:requests_total", backend="b1", outcome="finished") == 3
    with gateway([dead], tmp_path) as (url, _):
        status, body, _ = post(url, completion(PREFIX))
    assert status == 503 and "no backend is in rotation" in body["error"]["message"]


def test_a_backend_that_dies_mid_stream_ends_the_request_with_an_error_event_and_comes_back(tmp_path):
    plan = (lambda rid, body: {"abort_after": 2} if rid.startswith("die") else None)
    with FakeOpenAIServer(ttft_s=0.005, itl_s=0.002, plan=plan) as fake, \
            gateway([fake.url], tmp_path, poll_interval_s=0.2) as (url, gw):
        status, events, _ = post(url, completion(PREFIX, n=8), rid="die-1")
        assert gw.backends[0].healthy is False
        time.sleep(0.6)  # the health check passes: back in rotation
        again = post(url, completion(PREFIX, n=8), rid="ok-1")
    assert status == 200 and events[-1] == "[DONE]"
    assert "broke off" in events[-2]["error"]["message"] or "without a finish" in events[-2]["error"]["message"]
    assert again[0] == 200 and again[1][-2]["usage"]["completion_tokens"] == 8


def test_a_silent_backend_times_out(tmp_path):
    with FakeOpenAIServer(ttft_s=2.0, itl_s=0.01) as fake, \
            gateway([fake.url], tmp_path, timeout_s=0.3, poll_interval_s=60) as (url, gw):
        status, events, _ = post(url, completion(PREFIX, n=4))
        gw.backends[0].mark_up()
        whole = post(url, completion(PREFIX, n=4, stream=False))
    assert status == 200 and "sent nothing for gateway.timeout_s=0.3" in events[-2]["error"]["message"]
    assert whole[0] == 504 and "no answer within gateway.timeout_s=0.3" in whole[1]["error"]["message"]


def test_429_when_every_backend_is_saturated_and_a_backends_own_429_goes_elsewhere(tmp_path):
    busy = (lambda rid, body: {"status": 429} if rid.startswith("x") else None)
    with FakeOpenAIServer(ttft_s=0.5, itl_s=0.01) as slow, FakeOpenAIServer(plan=busy) as limited:
        backends = [{"url": slow.url, "max_in_flight": 1}, {"url": slow.url, "max_in_flight": 1}]
        with gateway(backends, tmp_path) as (url, _), ThreadPoolExecutor(2) as pool:
            held = [pool.submit(post, url, completion(PREFIX, n=2)) for _ in range(2)]
            time.sleep(0.2)
            status, body, _ = post(url, completion(PREFIX, n=2))
            assert [h.result()[0] for h in held] == [200, 200]
        assert status == 429 and "every backend is saturated" in body["error"]["message"]
        with gateway([limited.url, slow.url], tmp_path / "b") as (url, gw):
            answer = post(url, completion(PREFIX, n=2), rid="x1")
            assert gw.backends[0].saturated(gw.now())
    assert answer[0] == 200  # b0 said 429, b1 answered


def test_a_client_disconnect_cancels_upstream(sims, tmp_path):
    sim = sims[1]
    before = metric(sim.get("/metrics")[1], "twinserve:request_success_total", status="cancelled")
    with gateway([sim.url], tmp_path) as (url, gw):
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("POST", "/v1/completions", json.dumps(completion(PREFIX, n=1900)),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.readline().startswith(b"data:")
        conn.sock.shutdown(2)
        conn.close()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and metric(sim.get("/metrics")[1], "twinserve:request_success_total",
                                                     status="cancelled") == before:
            time.sleep(0.05)
        assert not gw.backends[0].flights
    assert metric(sim.get("/metrics")[1], "twinserve:request_success_total", status="cancelled") == before + 1


# ---- the run files and the command ---------------------------------------------------------------------------------
def test_run_files_snapshot_while_serving_and_complete_at_shutdown(sims, tmp_path):
    from experiments.calibration.compare import _request_list
    from experiments.studies.sweep_report import collect

    out = tmp_path / "runs" / "0"
    with gateway([s.url for s in sims], out, flush_interval_s=0.2) as (url, gw):
        # our server shows its pool as vLLM does (cache_config_info): the index is sized to it
        assert [(b.block_size, b.num_blocks, b.index.capacity) for b in gw.backends] == [(16, 256, 256)] * 2
        for i in range(3):
            post(url, completion(PREFIX + [i], n=2), rid=f"q{i}")
        deadline, partial = time.monotonic() + 20, {"id": []}  # a snapshot with all 3 (slow on a busy box)
        while time.monotonic() < deadline and len(partial["id"]) < 3:
            time.sleep(0.05)
            with contextlib.suppress(FileNotFoundError):
                partial = read_requests(out / "requests.csv.partial")
        snapshot = read_metrics(out / "metrics.json")
    assert snapshot["run_status"] == "running" and len(partial["id"]) == 3
    metrics = read_metrics(out / "metrics.json")
    assert metrics["run_status"] == "complete" and metrics["num_completed"] == 3
    reqs = read_requests(out / "requests.csv")
    assert list(reqs["backend"]) == ["b0", "b1", "b0"] and list(reqs["replica"]) == [0, 1, 0]
    assert read_tokens(out / "tokens.csv")["num_tokens"].sum() == 6
    assert metrics["backend_metrics"]["b0"]["prefix_cache_queries_total"] > 0  # the last scrape of each backend
    assert not list(out.glob("*.partial")) and not list(out.glob(".writing-*"))
    # what compare (a measured run's request list) and sweep_report (complete jobs) read
    assert (out / "config.yaml").is_file() and _request_list(out).read_text().count("\n") == 4
    [(_, job)] = collect(tmp_path / "runs")
    assert job["num_completed"] == 3


@pytest.mark.slow
def test_the_command_writes_its_run_files_atomically(sims, tmp_path):
    port, out, log = free_port(), tmp_path / "run", (tmp_path / "gateway.log").open("wb")
    backends = "[" + ",".join(f'{{url:"{s.url}",name:sim{i}}}' for i, s in enumerate(sims)) + "]"
    proc = subprocess.Popen([sys.executable, "-m", "experiments.gateway", f"gateway.port={port}",
                             f"gateway.backends={backends}", "gateway.flush_interval_s=0.3", "router=round_robin",
                             f"hydra.run.dir={out}"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                if get(url, "/health")[0] == 200:
                    break
            assert proc.poll() is None, (tmp_path / "gateway.log").read_text()
            time.sleep(0.1)
        for i in range(4):
            assert post(url, completion(PREFIX + [i], n=3), rid=f"r{i}")[0] == 200
        time.sleep(0.6)
        assert read_metrics(out / "metrics.json")["run_status"] == "running"  # a snapshot, data files .partial
        assert (out / "requests.csv.partial").is_file() and not (out / "requests.csv").exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    metrics = read_metrics(out / "metrics.json")
    assert metrics["run_status"] == "complete" and metrics["num_completed"] == 4
    assert metrics["requests_per_backend"] == {"sim0": 2, "sim1": 2}
    reqs, toks = read_requests(out / "requests.csv"), read_tokens(out / "tokens.csv")
    assert sorted(reqs["id"]) == ["r0", "r1", "r2", "r3"] and sorted(reqs["backend"]) == ["sim0", "sim0", "sim1",
                                                                                            "sim1"]
    assert list(reqs["output_tokens"]) == [3] * 4 and toks["num_tokens"].sum() == 12
    assert not list(out.glob("*.partial")) and not list(out.glob(".writing-*"))
