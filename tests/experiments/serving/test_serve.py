"""The OpenAI-compatible server as a client sees it: the real ``openai`` SDK against `python -m experiments.serve`
on loopback (a tiny random checkpoint with a word-level tokenizer), compared with the offline engine."""

from __future__ import annotations

import asyncio
import csv
import json
import threading
import time
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai")

from core.kv_cache import KVCacheManager  # noqa: E402
from core.loop import ServingLoop  # noqa: E402
from core.replica import Replica, SchedulerLimits  # noqa: E402
from core.request import Request  # noqa: E402
from core.specs import ModelSpec  # noqa: E402
from engine.executor import build_engine_executor  # noqa: E402
from engine.loader import load_model  # noqa: E402
from experiments.serving.server.process import ServerProcess  # noqa: E402
from policies.eviction.lru import LRUEviction  # noqa: E402
from policies.routers.round_robin import RoundRobinRouter  # noqa: E402
from policies.schedulers.sarathi import SarathiScheduler  # noqa: E402
from sim.clock import run_virtual  # noqa: E402
from tests.engine.checkpoints import TINY, save_word_tokenizer, tiny_checkpoint  # noqa: E402
from tests.helpers import ListWorkload  # noqa: E402

Server = ServerProcess


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    _, path = tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))
    save_word_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    s = Server(ckpt, tmp_path_factory.mktemp("serve"), "kv.num_blocks=512", "scheduler.max_num_seqs=64", "replicas=2",
               "router=least_outstanding")  # two engine replicas behind the router, in one process
    yield s
    s.stop()


def prompts(n: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(6, TINY["vocab_size"], (int(k),), generator=g).tolist()
            for k in torch.randint(4, 40, (n,), generator=g)]


def offline(ckpt: Path, prompt_ids: list[list[int]], new: int) -> list[list[int]]:
    """Greedy outputs of the engine run in-process on the simulated clock (no server)."""
    spec = ModelSpec.from_pretrained(ckpt)
    kv = KVCacheManager(512, 16, LRUEviction())
    replica = Replica(0, SarathiScheduler(), kv, SchedulerLimits(2048, 64, spec.max_model_len))
    executor = build_engine_executor(spec, kv_manager=kv, model=load_model(ckpt, spec))
    reqs = [Request(f"r{i}", 0.0, len(p), new, prompt_token_ids=tuple(p)) for i, p in enumerate(prompt_ids)]
    states = {s.id: s for s in run_virtual(ServingLoop([replica], [executor], RoundRobinRouter(),
                                                     ListWorkload(reqs))).states}
    return [states[f"r{i}"].output_token_ids for i in range(len(prompt_ids))]


def test_models_and_health(server, ckpt):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == [str(ckpt)]
    assert server.get("/health") == (200, '{"status": "ok"}')


def test_completions_match_the_offline_engine_streaming_or_not(server, ckpt):
    ps = prompts(4)
    want = offline(ckpt, ps, 8)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    tok = save_word_tokenizer(Path(server.out) / "tok")
    for p, expected in zip(ps, want, strict=True):
        whole = client.completions.create(model=str(ckpt), prompt=p, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
        assert whole.choices[0].model_extra["token_ids"] == expected
        assert whole.choices[0].text == tok.decode(expected)
        assert whole.choices[0].finish_reason == "length"
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(p), 8)
        chunks = list(client.completions.create(model=str(ckpt), prompt=tok.decode(p), max_tokens=8, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == tok.decode(expected)
        assert chunks[-1].usage.completion_tokens == 8 and chunks[-2].choices[0].finish_reason == "length"


def test_32_concurrent_streams_equal_the_offline_run(server, ckpt):
    ps = prompts(32, seed=5)
    want = offline(ckpt, ps, 12)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none")

    async def one(p):
        ids = []
        stream = await client.completions.create(model=str(ckpt), prompt=p, max_tokens=12, temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True, "return_token_ids": True})
        async for chunk in stream:
            if chunk.choices:
                ids += chunk.choices[0].model_extra.get("token_ids") or []
        return ids

    async def everything():
        try:
            return await asyncio.gather(*(one(p) for p in ps))
        finally:
            await client.close()

    assert asyncio.run(everything()) == want


def test_chat_uses_the_checkpoint_template_and_stop_strings_end_the_request(server, ckpt):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    messages = [{"role": "user", "content": "héllo w7 日本"}]
    out = client.chat.completions.create(model=str(ckpt), messages=messages, max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
    tok = save_word_tokenizer(Path(server.out) / "tok")
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
    expected = offline(ckpt, [list(prompt)], 6)[0]
    assert out.choices[0].message.content == tok.decode(expected)
    assert out.usage.prompt_tokens == len(prompt)
    # a stop string cut at the second generated word: the text ends before it and the reason is "stop"
    words = tok.decode(expected).split(" ")
    cut = client.chat.completions.create(model=str(ckpt), messages=messages, max_tokens=6, temperature=0,
                                         stop=[words[1]], extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == words[0] + " "


@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps({"prompt": [1, 2], "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": [1, 2], "max_tokens": "many"}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": [1, 2], "temperature": "hot"}).encode(), 400, "temperature"),
    (json.dumps({"prompt": [1] * 300, "max_tokens": 4}).encode(), 400, "prompt"),
    (json.dumps({"prompt": [1] * 200, "max_tokens": 100}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": [99999]}).encode(), 400, "prompt"),
    (json.dumps({"prompt": []}).encode(), 400, "prompt"),
    (json.dumps({"prompt": [1], "model": "other"}).encode(), 404, "model"),
])
def test_bad_requests_get_a_clear_error_and_the_server_lives_on(server, body, status, param):
    code, answer = server.post("/v1/completions", body)
    assert code == status and answer["error"]["message"]
    assert answer["error"]["param"] == param
    assert server.get("/health")[0] == 200


def test_backpressure_disconnect_and_sigterm(ckpt, tmp_path):
    """One sequence at a time and one waiting slot: a third request gets 429. A client that drops its stream
    frees its KV at once. SIGTERM drains and writes complete run files."""
    s = Server(ckpt, tmp_path / "run", "scheduler.max_num_seqs=1", "serve.max_waiting=1", "kv.num_blocks=64",
               "serve.drain_timeout_s=5", "serve.flush_interval_s=0.5")
    try:
        assert s.metric("kv_cache_usage_perc") == 0.0
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        long = client.completions.create(model=str(ckpt), prompt=[7] * 20, max_tokens=230, stream=True,
                                         extra_body={"ignore_eos": True})
        next(iter(long))  # running now
        assert s.metric("kv_cache_usage_perc") > 0
        # the waiting request from a thread (a subprocess took long enough to start that the long one could end)
        waiting_status: list[int] = []
        waiting = threading.Thread(target=lambda: waiting_status.append(s.post(
            "/v1/completions", json.dumps({"prompt": [8] * 5, "max_tokens": 3}).encode())[0]))
        waiting.start()
        deadline = time.monotonic() + 20
        while s.metric("num_requests_waiting") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=str(ckpt), prompt=[9] * 5, max_tokens=3)
        long.close()  # disconnect mid-stream: the long request is cancelled, the waiting one runs and ends
        waiting.join(timeout=60)
        assert waiting_status == [200]
        deadline = time.monotonic() + 20
        while s.metric("kv_cache_usage_perc") > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.metric("kv_cache_usage_perc") == 0.0
        def flushed() -> dict:  # metrics.json written while serving (every 0.5 s; {} between two renames)
            try:
                return json.loads((tmp_path / "run" / "metrics.json").read_text())
            except (OSError, ValueError):
                return {}

        deadline = time.monotonic() + 15
        snapshot = flushed()
        while snapshot.get("num_requests", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
            snapshot = flushed()
        assert snapshot["num_requests"] >= 2  # the cancelled and the finished request
        assert snapshot["run_status"] == "running"  # a snapshot: its data files are named .partial
        # SIGTERM while a request streams: it is drained (finishes), files are written, the process exits
        last = client.completions.create(model=str(ckpt), prompt=[10] * 5, max_tokens=30, stream=True,
                                         extra_body={"ignore_eos": True})
        next(iter(last))
        s.terminate()
        assert len([c for c in last]) >= 1
    finally:
        rc = s.stop()
    assert rc == 0
    statuses = sorted(r["status"] for r in csv.DictReader((tmp_path / "run" / "requests.csv").open()))
    assert statuses == ["CANCELLED", "FINISHED", "FINISHED"]  # the 429 never reached the engine
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["counts_by_status"]["CANCELLED"] == 1 and metrics["counts_by_status"]["FINISHED"] == 2
    assert (tmp_path / "run" / "steps.csv").stat().st_size > 0
    assert metrics["run_status"] == "complete" and not list((tmp_path / "run").glob("*.partial"))


def test_a_burst_beyond_max_waiting_is_429_with_the_count_that_was_compared(ckpt, tmp_path):
    """A burst arrives faster than the loop dispatches: the queue count compared with serve.max_waiting includes the
    submissions not yet dispatched, and the 429 message states that count (it once printed the dispatched ones
    only: "0 >= serve.max_waiting=4"). Every request that got a 200 is in the run files."""
    s = Server(ckpt, tmp_path / "run", "scheduler.max_num_seqs=1", "serve.max_waiting=4", "kv.num_blocks=64")
    body = json.dumps({"prompt": [5] * 20, "max_tokens": 8, "ignore_eos": True}).encode()
    answers: list[tuple[int, dict]] = []
    try:
        threads = [threading.Thread(target=lambda: answers.append(s.post("/v1/completions", body)))
                   for _ in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        assert s.stop() == 0
    assert len(answers) == 24 and {code for code, _ in answers} == {200, 429}
    for code, answer in answers:
        if code == 429:
            count = int(answer["error"]["message"].split("(")[1].split(" >=")[0])
            assert count >= 4, answer
    rows = list(csv.DictReader((tmp_path / "run" / "requests.csv").open()))
    assert len(rows) == sum(code == 200 for code, _ in answers) and {r["status"] for r in rows} == {"FINISHED"}


def test_loadgen_agrees_with_the_servers_own_records(ckpt, tmp_path):
    """loadgen's per-request TTFT and token gaps against the server's requests.csv / tokens.csv (paired through
    X-Request-Id): the client sees the server's times plus the HTTP path."""
    from hydra import compose, initialize_config_dir

    from experiments.build import CONF_DIR
    from experiments.serving.loadgen.run import run_loadgen

    s = Server(ckpt, tmp_path / "server", "kv.num_blocks=512")
    try:
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            cfg = compose("loadgen", overrides=[f"target.url={s.url}", f"model.path={ckpt}", "output.plots=false",
                                                "output.progress=false", "workload.num_requests=16",
                                                "workload.arrival.rate_rps=8", "workload.prompt_len.max=64",
                                                "workload.output_len.max=16",
                                                "+target.extra_body.return_token_ids=true"])
        metrics = run_loadgen(cfg, tmp_path / "client")
    finally:
        assert s.stop() == 0
    assert metrics["num_completed"] == 16
    server_rows = {r["id"]: r for r in csv.DictReader((tmp_path / "server" / "requests.csv").open())}
    client_rows = {r["id"]: r for r in csv.DictReader((tmp_path / "client" / "requests.csv").open())}
    assert set(server_rows) == set(client_rows)
    extra = sorted(float(client_rows[i]["ttft_s"]) - float(server_rows[i]["ttft_s"]) for i in server_rows)
    assert extra[0] > -0.005  # the client never sees a token before the server made it
    assert extra[len(extra) // 2] < 0.03, extra  # median HTTP + client overhead per request
    assert all(client_rows[i]["output_tokens"] == server_rows[i]["output_tokens"] for i in server_rows)

    def total_gap(path):
        times = {}
        for row in csv.DictReader(path.open()):
            times.setdefault(row["request_id"], []).append(float(row["time_s"]))
        return {k: v[-1] - v[0] for k, v in times.items()}

    server_span = total_gap(tmp_path / "server" / "tokens.csv")
    client_span = total_gap(tmp_path / "client" / "tokens.csv")
    diffs = sorted(abs(client_span[i] - server_span[i]) for i in server_span)
    assert diffs[len(diffs) // 2] < 0.03, diffs  # first-to-last token span: the decode timeline seen by both


def test_a_speculative_server_streams_every_accepted_token(ckpt, tmp_path):
    """With n-gram drafts a step can yield several tokens per request: the stream carries all of them, in order,
    and greedy outputs equal the plain offline run's."""
    ps = prompts(4, seed=7)
    want = offline(ckpt, ps, 16)
    s = Server(ckpt, tmp_path / "serve", "kv.num_blocks=256", "spec=ngram")
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none")
        for p, expected in zip(ps, want, strict=True):
            ids = []
            for chunk in client.completions.create(model=str(ckpt), prompt=p, max_tokens=16, temperature=0,
                                                   stream=True,
                                                   extra_body={"ignore_eos": True, "return_token_ids": True}):
                if chunk.choices:
                    ids += chunk.choices[0].model_extra.get("token_ids") or []
            assert ids == expected
        status, text = s.get("/metrics")
        generated = [ln for ln in text.splitlines() if ln.startswith("twinserve:generation_tokens_total")]
        assert status == 200 and float(generated[0].rsplit(" ", 1)[1]) == 4 * 16  # every token counted once
    finally:
        s.stop()
    metrics = json.loads((tmp_path / "serve" / "metrics.json").read_text())
    assert metrics["draft_tokens_accepted"] > 0  # some steps did yield several tokens
