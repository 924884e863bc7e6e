"""The server against hostile and careless clients (issue 33): generated bodies and headers never get a 5xx and
leave the engine exact; a failing step ends only its requests; a live duplicate id leaves the first stream whole;
a 10 MB prompt is tokenized off the event loop while another stream keeps its pace; the API key guards /v1."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.kv_cache import KVCacheManager
from core.loop import ServingLoop
from core.realtime import RealTimeClock
from core.replica import Replica, SchedulerLimits
from core.request import Request, Status
from experiments.serving.server.bridge import EndEvent, LoopThread, NoArrivals
from experiments.serving.server.process import ServerProcess
from policies.eviction.lru import LRUEviction
from policies.routers.round_robin import RoundRobinRouter
from policies.schedulers.sarathi import SarathiScheduler
from tests.engine.checkpoints import TINY, save_word_tokenizer, tiny_checkpoint
from tests.helpers import FormulaExecutor


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    _, path = tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))
    save_word_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    # prompts up to 100 MB pass the size cap, so a 10 MB one goes through reading, parsing and tokenizing
    s = ServerProcess(ckpt, tmp_path_factory.mktemp("serve"), "kv.num_blocks=256", "serve.max_waiting=64",
                      "serve.max_prompt_chars=100000000")
    yield s
    assert s.stop() == 0


def post(url: str, path: str, body: bytes, headers: dict[str, bytes] | None = None,
         timeout: float = 60) -> tuple[int, bytes]:
    """A raw POST (header values as bytes, sent as they are); (status, body)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.putrequest("POST", path)
        for k, v in {"Content-Type": b"application/json", **(headers or {})}.items():
            conn.putheader(k, v)
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def offline_tokens(ckpt: Path, prompt: list[int], new: int) -> list[int]:
    from tests.experiments.serving.test_serve import offline

    return offline(ckpt, [prompt], new)[0]


# ---- generated requests ---------------------------------------------------------------------------------------
ODD_TEXT = st.one_of(st.text(max_size=20), st.sampled_from(
    ["\ud800", "w5 \udfff w6", "\x00", "\u202e w7", "\ufeffw8", "w9 " * 30, "日本 w10", "", " "]))
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([1e-40, 1e-320, 5e-324, 1e308, -0.0, 0.009, 0.01, 2.0, 100.0, 101.0]))
INTS = st.one_of(st.integers(-3, 300), st.sampled_from([-(2**63) - 1, 2**63, 2**64, 10**12, 10**30]))
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, ODD_TEXT)
VALUES = st.recursive(SCALARS, lambda v: st.one_of(st.lists(v, max_size=4),
                                                   st.dictionaries(ODD_TEXT, v, max_size=3)), max_leaves=8)
TOKEN_IDS = st.lists(st.one_of(st.integers(0, TINY["vocab_size"] - 1), INTS), min_size=0, max_size=12)
FIELDS = {
    "temperature": FLOATS, "top_p": FLOATS, "top_k": INTS, "seed": INTS, "n": INTS, "min_tokens": INTS,
    "stop": st.one_of(ODD_TEXT, st.lists(ODD_TEXT, max_size=3)), "stop_token_ids": TOKEN_IDS,
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(), "return_token_ids": st.booleans(), "echo": st.booleans(),
    "logprobs": st.one_of(st.booleans(), INTS), "top_logprobs": INTS,
    "logit_bias": st.dictionaries(st.one_of(st.integers(-2, 200).map(str), ODD_TEXT), FLOATS, max_size=3),
    "presence_penalty": FLOATS, "frequency_penalty": FLOATS, "repetition_penalty": FLOATS,
    "best_of": INTS, "suffix": ODD_TEXT, "response_format": VALUES, "tools": VALUES, "tool_choice": VALUES,
    "model": st.one_of(ODD_TEXT, st.none()), "max_completion_tokens": INTS, "user": ODD_TEXT, "mystery": VALUES,
}
FIELDS = {k: st.one_of(v, VALUES) for k, v in FIELDS.items()}  # the right kind of value, or anything
MAX_TOKENS = st.one_of(st.integers(1, 8), st.integers(1, 8), INTS, FLOATS, st.none())
PROMPT = st.one_of(TOKEN_IDS, ODD_TEXT, st.lists(TOKEN_IDS, max_size=2), VALUES)
MESSAGES = st.one_of(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x"]),
                                                     "content": ODD_TEXT}), max_size=3), VALUES)
COMPLETION = st.fixed_dictionaries({"prompt": PROMPT, "max_tokens": MAX_TOKENS}, optional=FIELDS)
CHAT = st.fixed_dictionaries({"messages": MESSAGES, "max_tokens": MAX_TOKENS}, optional=FIELDS)
# header values as HTTP allows them (visible ASCII, space, tab, and obs-text bytes 0x80-0xff, which are not UTF-8
# on their own); control characters make a malformed message, which aiohttp's HTTP layer answers 400 in plain text
FIELD_BYTES = [9, *range(0x20, 0x7F), *range(0x80, 0x100)]
HEADER = st.lists(st.sampled_from(FIELD_BYTES), min_size=1, max_size=40).map(bytes).filter(lambda b: b.strip() == b)
HEADERS = st.fixed_dictionaries({}, optional={"X-Request-Id": HEADER, "Content-Type": HEADER,
                                              "Authorization": HEADER, "Accept": HEADER})


@st.composite
def requests(draw) -> tuple[str, bytes, dict[str, bytes]]:
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    kind = draw(st.sampled_from(["json", "json", "json", "raw"]))
    if kind == "raw":
        body = draw(st.one_of(st.binary(max_size=60), st.sampled_from([b"", b"{", b"[" * 5000, b"1" * 5000,
                                                                        b'{"prompt": NaN}'])))
    else:  # ensure_ascii: lone surrogates go as \ud800 escapes, which JSON allows; NaN / Infinity as Python writes
        body = json.dumps(draw(COMPLETION if path == "/v1/completions" else CHAT)).encode()
    return path, body, draw(HEADERS)


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(case=requests())
def test_generated_requests_get_2xx_or_4xx_with_a_json_message(server, case):
    path, body, headers = case
    status, answer = post(server.url, path, body, headers)
    assert status < 500, (status, answer[:300])
    if status >= 400:
        assert json.loads(answer)["error"]["message"]
    elif answer.startswith(b"data:"):  # a stream ends with [DONE] and no error event
        assert answer.rstrip().endswith(b"data: [DONE]") and b'"error"' not in answer, answer[-300:]
    else:
        assert json.loads(answer)["choices"]


@pytest.mark.slow
def test_generated_requests_against_the_simulator(tmp_path):
    """The same bodies against backend=sim (no tokenizer, placeholder tokens, logit fields refused)."""
    s = ServerProcess(None, tmp_path / "run", "backend=sim")
    try:
        @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        @given(case=requests())
        def one(case):
            test_generated_requests_get_2xx_or_4xx_with_a_json_message.hypothesis.inner_test(s, case)

        one()
        body = b'{"prompt": [1, 2], "max_tokens": 3, "return_token_ids": true}'
        status, answer = post(s.url, "/v1/completions", body)
        assert status == 200 and json.loads(answer)["choices"][0]["token_ids"] == [0, 0, 0]
    finally:
        assert s.stop() == 0


def test_after_the_generated_requests_the_engine_is_exact(server, ckpt):
    """Runs after the generated bodies (file order): the server lives, and a normal request gets exactly the
    offline engine's greedy tokens."""
    prompt = [7, 8, 9, 10, 11]
    status, answer = post(server.url, "/v1/completions", json.dumps(
        {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}).encode())
    assert status == 200 and json.loads(answer)["choices"][0]["token_ids"] == offline_tokens(ckpt, prompt, 12)
    assert server.get("/health") == (200, '{"status": "ok"}')


def test_logprobs_penalties_and_logit_bias_through_the_engine(server, ckpt):
    """logprobs are the model's own log-probabilities (against transformers' logits); a logit bias of +100 forces
    its token; a repetition penalty changes a greedy answer that repeats, and never picks what the bias forbids."""
    import torch
    import transformers

    from tests.engine.checkpoints import hf_logits

    prompt = [7, 8, 9]
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()

    def ask(**fields):
        status, answer = post(server.url, "/v1/completions", json.dumps(
            {"prompt": prompt, "max_tokens": 6, "ignore_eos": True, "return_token_ids": True, **fields}).encode())
        assert status == 200, answer
        return json.loads(answer)["choices"][0]

    plain = ask(logprobs=3)
    ids = plain["token_ids"]
    assert ids == offline_tokens(ckpt, prompt, 6)  # asking for logprobs leaves the tokens alone
    ref = hf_logits(hf, torch.tensor(prompt + ids[:-1])).log_softmax(-1)[len(prompt) - 1:]
    torch.testing.assert_close(torch.tensor(plain["logprobs"]["token_logprobs"]), ref[range(6), ids], atol=1e-4,
                               rtol=1e-4)
    assert [len(t) for t in plain["logprobs"]["top_logprobs"]] == [3] * 6
    assert ask(logit_bias={"42": 100})["token_ids"] == [42] * 6
    assert 42 not in ask(logit_bias={"42": -100}, repetition_penalty=1.5)["token_ids"]
    penalised = ask(frequency_penalty=2.0)["token_ids"]
    assert len(set(penalised)) >= len(set(ids))  # repeats cost: at least as many distinct tokens


def test_a_live_duplicate_id_is_refused_and_the_first_stream_runs_to_its_end(server, ckpt):
    prompt, n = [20, 21, 22], 200
    got: list[bytes] = []
    first = threading.Thread(target=lambda: got.append(post(server.url, "/v1/completions", json.dumps(
        {"prompt": prompt, "max_tokens": n, "stream": True, "ignore_eos": True, "return_token_ids": True}).encode(),
        {"X-Request-Id": b"twin"})[1]))
    first.start()
    deadline = time.monotonic() + 30
    while server.metric("num_requests_running") < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    status, answer = post(server.url, "/v1/completions", json.dumps({"prompt": [5], "max_tokens": 2}).encode(),
                          {"X-Request-Id": b"twin"})
    first.join(60)
    assert status == 409 and json.loads(answer)["error"]["param"] == "X-Request-Id"
    ids = [t for line in got[0].split(b"\n\n") if line.startswith(b"data: {")
           for t in json.loads(line[6:])["choices"][0].get("token_ids") or []]
    assert ids == offline_tokens(ckpt, prompt, n)
    # a byte that is not UTF-8 in an id: refused at the door (it would otherwise break every later run-file write)
    status, answer = post(server.url, "/v1/completions", b'{"prompt": [5], "max_tokens": 1}',
                          {"X-Request-Id": b"a\xff"})
    assert status == 400 and json.loads(answer)["error"]["param"] == "X-Request-Id"


def test_a_finished_requests_id_may_come_again(server, ckpt):
    """A benchmark rerun against a long-lived server reuses its ids once the first run has ended: served again, the
    answer carries the id the run files give it (``<id>#<n>``), so no two records share one."""
    body = json.dumps({"prompt": [7, 8, 9], "max_tokens": 3, "ignore_eos": True}).encode()
    answers = [post(server.url, "/v1/completions", body, {"X-Request-Id": b"again"}) for _ in range(3)]
    assert [status for status, _ in answers] == [200, 200, 200], answers
    assert [json.loads(a)["id"] for _, a in answers] == ["again", "again#1", "again#2"]
    assert len({json.loads(a)["choices"][0]["text"] for _, a in answers}) == 1  # greedy: the same answer


def test_a_10_mb_prompt_does_not_stall_another_stream(server):
    """A stream's token gaps while a 10 MB text prompt is read, parsed and tokenized (then refused: it is far
    over the context): the largest gap stays bounded."""
    times: list[float] = []

    def stream() -> None:
        host, port = server.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": [30, 31], "max_tokens": 250, "stream": True,
                                                           "ignore_eos": True}), {"Content-Type": "application/json"})
        r = conn.getresponse()
        while line := r.readline():
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
        conn.close()

    t = threading.Thread(target=stream)
    t.start()
    while len(times) < 20:
        time.sleep(0.005)
    big = json.dumps({"prompt": "w5 w6 " * (10_000_000 // 6), "max_tokens": 4}).encode()
    t0 = time.perf_counter()
    status, answer = post(server.url, "/v1/completions", big)
    t1 = time.perf_counter()
    t.join(60)
    assert status == 400 and json.loads(answer)["error"]["param"] == "prompt"
    during = [b - a for a, b in zip(times, times[1:], strict=False) if t0 <= b <= t1 + 0.05]
    before = sorted(b - a for a, b in zip(times[:20], times[1:20], strict=False))
    print(f"10 MB prompt answered in {t1 - t0:.2f} s; stream gaps meanwhile: max {max(during):.3f} s over "
          f"{len(during)} tokens (median gap before {before[len(before) // 2]:.4f} s)")
    assert len(during) >= 5 and max(during) < 0.5


def test_api_key_guards_every_v1_route(tmp_path, monkeypatch):
    monkeypatch.setenv("TWINSERVE_API_KEY", "s3cret")  # the child inherits it; backend=sim starts fast
    s = ServerProcess(None, tmp_path / "run", "backend=sim")
    try:
        body = json.dumps({"prompt": [1, 2], "max_tokens": 2}).encode()
        for headers in ({}, {"Authorization": b"Bearer wrong"}, {"Authorization": b"s3cret"}):
            status, answer = post(s.url, "/v1/completions", body, headers)
            assert status == 401 and json.loads(answer)["error"]["type"] == "authentication_error"
        assert post(s.url, "/v1/completions", body, {"Authorization": b"Bearer s3cret"})[0] == 200
        assert s.get("/health")[0] == 200  # not a /v1 route
        # the simulator has no logits: fields that need them are refused, naming the field
        status, answer = post(s.url, "/v1/completions", json.dumps(
            {"prompt": [1], "max_tokens": 2, "logit_bias": {"1": 3}}).encode(), {"Authorization": b"Bearer s3cret"})
        assert status == 400 and json.loads(answer)["error"]["param"] == "logit_bias"
    finally:
        assert s.stop() == 0


# ---- a failing step, in process ------------------------------------------------------------------------------
class PoisonExecutor(FormulaExecutor):
    """Fails any step that holds a request named ``poison...``."""

    def execute(self, batch):
        if any(ch.state.id.startswith("poison") for ch in batch.chunks):
            raise FloatingPointError("sampling produced NaN")
        return super().execute(batch)


def test_a_failing_step_ends_only_its_requests_and_the_loop_serves_on():
    replica = Replica(0, SarathiScheduler(), KVCacheManager(64, 16, LRUEviction()), SchedulerLimits(256, 8, 256))
    loop = ServingLoop([replica], [PoisonExecutor(lambda f: 0.002)], RoundRobinRouter(), NoArrivals())

    async def scenario():
        bridge = LoopThread(loop, RealTimeClock(), asyncio.get_running_loop())
        bridge.start()

        async def run(rid: str, n: int) -> tuple[list[int], EndEvent]:
            stream = await bridge.submit(Request(rid, bridge.now(), 4, n, prompt_token_ids=(1, 2, 3, 4)))
            tokens = []
            while not isinstance(event := await stream.queue.get(), EndEvent):
                tokens.append(event.token_id)
            return tokens, event

        try:
            poisoned = await run("poison", 5)
            last = await run("poison-last", 1)  # its one token comes from the failing step: FINISHED by length
            after = await asyncio.gather(run("a", 6), run("b", 7))
            return poisoned, last, after, bridge.error
        finally:
            bridge.stop()

    (tokens, end), last, after, error = asyncio.run(scenario())
    assert tokens == [] and end.status is Status.CANCELLED and "FloatingPointError" in end.reason
    assert last[0] == [] and last[1].status is Status.CANCELLED
    assert {s.id: s.status for s in loop.states}["poison-last"] is Status.CANCELLED  # the run files agree
    assert error is None and [(len(t), e.status) for t, e in after] == [(6, Status.FINISHED), (7, Status.FINISHED)]
    assert not loop.unfinished() and replica.kv.num_used_blocks == 0
