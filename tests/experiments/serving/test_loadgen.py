"""The load client against a fake OpenAI-compatible server with known timings (in-process, 127.0.0.1, free port).

References are independent of the client: the workload's own draws (lengths), the fake server's log (its receipt
and chunk write times, the bodies it got), numbers computed by hand from requests.csv / tokens.csv, and JSON
written by hand in vLLM's format."""

import json
import math
import sys

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from core.output import read_requests_csv, read_tokens_csv
from core.request import Status
from experiments.build import CONF_DIR, build_workload
from experiments.serving.bench_result import (
    apportion,
    bench_serve_result,
    bench_serve_to_run,
    read_bench_serve,
)
from experiments.serving.fake_openai import FakeOpenAIServer
from experiments.serving.loadgen.prompts import TextPrompts
from experiments.serving.loadgen.run import run_loadgen
from experiments.serving.loadgen.target import Target

TTFT, ITL = 0.03, 0.01
FAST = ["output.plots=false", "output.progress=false"]


def cfg_with(*overrides):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("loadgen", overrides=[*FAST, *overrides])


def small_poisson(n=12, rate=25.0):
    return [f"workload.num_requests={n}", f"workload.arrival.rate_rps={rate}",
            "~workload.output_len", "+workload.output_len={kind: uniform, low: 2, high: 10}",
            "~workload.prompt_len", "+workload.prompt_len={kind: uniform, low: 8, high: 64}"]


@pytest.fixture(autouse=True, scope="module")
def _short_gil_switch():
    """The fake server shares this interpreter: let its thread take the GIL within 0.5 ms (default 5 ms), so that its
    pacing is not held up by the client's thread (a real server is another process)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    yield
    sys.setswitchinterval(old)


@pytest.fixture(scope="module")
def poisson_run(tmp_path_factory):
    """One Poisson run against a server that would stop at 3 tokens unless told to ignore EOS."""
    out = tmp_path_factory.mktemp("poisson")
    with FakeOpenAIServer(ttft_s=TTFT, itl_s=ITL, eos_after=3) as srv:
        cfg = cfg_with(f"target.url={srv.url}", *small_poisson())
        metrics = run_loadgen(cfg, out)
        log = dict(srv.log)
    return cfg, out, metrics, log


def test_poisson_requests_finish_with_their_exact_lengths(poisson_run):
    cfg, out, metrics, log = poisson_run
    expected = {r.id: r for r in build_workload(cfg.workload).initial()}
    req = read_requests_csv(out / "requests.csv")
    assert sorted(req["id"].tolist()) == sorted(expected)
    assert set(req["status"].tolist()) == {"FINISHED"}
    for rid, n_out, n_in in zip(req["id"], req["output_tokens"], req["prompt_tokens"], strict=True):
        assert n_out == expected[rid].max_new_tokens
        body = log[rid].body
        assert len(body["prompt"]) == n_in == expected[rid].prompt_len
        assert all(isinstance(t, int) for t in body["prompt"])
        assert body["ignore_eos"] is True and body["min_tokens"] == body["max_tokens"] == n_out
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert metrics["num_completed"] == metrics["num_requests"] == len(expected)
    assert not (out / "steps.csv").exists()
    assert {"requests.csv", "tokens.csv", "metrics.json", "bench_serve.json", "client.csv"} <= {
        p.name for p in out.iterdir()}


def test_measured_times_agree_with_the_server(poisson_run):
    """Against the fake server's known delays, and request by request against its own log. Tolerances are a few ms:
    this 2-core machine is shared, and the server runs in this interpreter."""
    _, out, metrics, log = poisson_run
    req = read_requests_csv(out / "requests.csv")
    tok = read_tokens_csv(out / "tokens.csv")
    ttft = req["ttft_s"]
    client_delay = req["first_scheduled_s"] - req["arrival_s"]  # send lag: the request left the client then
    assert np.all(client_delay >= 0) and np.all(ttft >= TTFT - 1e-3)
    assert abs(float(np.median(ttft)) - TTFT) < 0.010
    assert abs(metrics["itl_s"]["p50"] - ITL) < 0.005  # a few ms: CI runs two busy workers on two cores
    # TTFT = client delay + the server's own receipt-to-first-chunk time + two trips over loopback (each side stamps
    # its times right after a socket call, so a thread descheduled in between stamps late: a few ms either way)
    server_ttft = np.array([log[rid].chunk_times[0] - log[rid].received for rid in req["id"]])
    trips = ttft - client_delay - server_ttft
    assert np.median(np.abs(trips)) < 0.005 and np.abs(trips).max() < 0.05
    nearest_rank_p50 = np.sort(client_delay)[math.ceil(len(client_delay) / 2) - 1]
    assert metrics["queue_s"]["p50"] == pytest.approx(nearest_rank_p50)  # queue delay = the client's send delay
    # each token at the time the server wrote it (relative to the first; both clocks are CLOCK_MONOTONIC). Compared
    # token by token: two chunks that reach the client in one socket read are one event of two tokens there
    dev = []
    for rid in req["id"]:
        rows = tok["request_id"] == rid
        mine = np.repeat(tok["time_s"][rows], tok["num_tokens"][rows])
        theirs = np.repeat(np.array(log[rid].chunk_times), log[rid].chunk_tokens)
        assert len(mine) == len(theirs)
        dev.extend(np.abs((mine - mine[0]) - (theirs - theirs[0])).tolist())
    assert np.median(dev) < 0.005 and max(dev) < 0.05
    lag = metrics["send_lag_s"]
    assert lag["count"] == len(req["id"]) and lag["p50"] < 0.01


def test_bench_serve_json_equals_a_hand_computation(poisson_run):
    _, out, metrics, _ = poisson_run
    bench = json.loads((out / "bench_serve.json").read_text())
    req = read_requests_csv(out / "requests.csv")
    tok = read_tokens_csv(out / "tokens.csv")
    ok = req["status"] == "FINISHED"
    dur = metrics["duration_s"]
    ttft, e2e, n_out = req["ttft_s"][ok], req["e2e_s"][ok], req["output_tokens"][ok]
    tpot = [(e - t) / (n - 1) for e, t, n in zip(e2e, ttft, n_out, strict=True) if n > 1]
    itl = []  # vLLM: gaps between consecutive chunks of a response, not divided by tokens per chunk
    for rid in req["id"][ok]:
        t = tok["time_s"][tok["request_id"] == rid]
        itl.extend(np.diff(np.sort(t)).tolist())
    assert bench["completed"] == int(ok.sum()) and bench["failed"] == 0
    assert bench["total_input_tokens"] == int(req["prompt_tokens"][ok].sum())
    assert bench["total_output_tokens"] == int(n_out.sum())
    assert bench["duration"] == pytest.approx(dur)
    assert bench["request_throughput"] == pytest.approx(ok.sum() / dur)
    assert bench["output_throughput"] == pytest.approx(n_out.sum() / dur)
    assert bench["total_token_throughput"] == pytest.approx((n_out.sum() + req["prompt_tokens"][ok].sum()) / dur)
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2e)):
        v = np.asarray(values) * 1000
        assert bench[f"mean_{name}_ms"] == pytest.approx(v.mean())
        assert bench[f"median_{name}_ms"] == pytest.approx(np.median(v))
        assert bench[f"std_{name}_ms"] == pytest.approx(v.std())
        assert bench[f"p99_{name}_ms"] == pytest.approx(np.percentile(v, 99))
    # slo=default sets TTFT <= 2 s and max stall <= 0.5 s: all of these meet it
    assert bench["request_goodput"] == pytest.approx(ok.sum() / dur)
    # the detailed lists read back as the same requests
    back = {s.id: s for s in read_bench_serve(out / "bench_serve.json")}
    assert len(back) == len(req["id"])
    order = np.argsort(req["arrival_s"], kind="stable")
    for i, j in enumerate(order):
        s = back[f"r{i}"]
        assert s.first_token_s - s.request.arrival_s == pytest.approx(req["ttft_s"][j], abs=1e-9)
        assert s.finish_s - s.request.arrival_s == pytest.approx(req["e2e_s"][j], abs=1e-9)
        assert s.num_output_tokens == req["output_tokens"][j]


@pytest.mark.parametrize("token_ids", [False, True])
def test_chunks_with_several_tokens_are_one_event(token_ids, tmp_path):
    """Three chunks of 3 + 3 + 1 tokens: three events. Chunks carry text only, so the usage count (7) is spread over
    them, unless the server lists each chunk's token_ids (vLLM's return_token_ids). (Chunks that reach the client in
    one network read are one event: the client may merge neighbours when it was busy, never split one.)"""
    extra = ["+target.extra_body.return_token_ids=true"] if token_ids else []
    with FakeOpenAIServer(ttft_s=0.005, itl_s=0.02, tokens_per_chunk=3) as srv:
        metrics = run_loadgen(cfg_with(f"target.url={srv.url}", "target.model=m", "workload.num_requests=4",
                                       "workload.arrival.rate_rps=50", "workload.output_len=7",
                                       "workload.prompt_len=16", *extra), tmp_path)
    req = read_requests_csv(tmp_path / "requests.csv")
    tok = read_tokens_csv(tmp_path / "tokens.csv")
    assert req["output_tokens"].tolist() == [7] * 4
    for rid in req["id"]:
        counts = tok["num_tokens"][tok["request_id"] == rid].tolist()
        if token_ids:  # exact: [3, 3, 1], or neighbours merged
            assert set(np.cumsum(counts).tolist()) <= {3, 6, 7} and sum(counts) == 7
        else:
            assert counts == apportion(7, len(counts)) and len(counts) <= 3
    assert metrics["num_token_count_mismatch"] == 0 if token_ids else metrics["num_token_count_mismatch"] >= 1


def test_errors_and_timeouts_are_counted_with_reasons(tmp_path):
    def plan(rid, body):
        return [None, {"status": 429, "message": "queue full"}, {"status": 500, "message": "engine died"},
                {"ttft_s": 0.01, "itl_s": 5.0},  # one token, then nothing in time
                {"abort_after": 2}][int(rid[1:]) % 5]  # two chunks, then the connection drops

    with FakeOpenAIServer(ttft_s=0.01, itl_s=0.002, plan=plan) as srv:
        metrics = run_loadgen(cfg_with(f"target.url={srv.url}", "target.timeout_s=0.4", *small_poisson(10, 40.0),
                                       "workload.output_len=6", "target.max_failed_share=1"), tmp_path)
    req = read_requests_csv(tmp_path / "requests.csv")
    assert len(req["id"]) == 10 and metrics["num_requests"] == 10
    for rid, status, reason, n_out, ttft in zip(req["id"], req["status"], req["reason"], req["output_tokens"],
                                                req["ttft_s"], strict=True):
        kind = int(rid[1:]) % 5
        if kind == 0:
            assert status == "FINISHED" and reason == "" and n_out == 6
        elif kind == 1:
            assert status == "REJECTED" and "429" in reason and "queue full" in reason and n_out == 0
        elif kind == 2:
            assert status == "REJECTED" and "500" in reason and "engine died" in reason and n_out == 0
        elif kind == 3:  # the tokens that arrived are kept
            assert status == "TIMED_OUT" and "timeout_s=0.4" in reason and n_out == 1 and ttft < 0.4
        else:
            assert status == "REJECTED" and "ClientPayloadError" in reason and "\n" not in reason and n_out == 2
    assert metrics["num_completed"] == 2 and metrics["num_rejected"] == 6 and metrics["num_timed_out"] == 2
    assert sum(metrics["counts_by_status"].values()) == 10
    bench = json.loads((tmp_path / "bench_serve.json").read_text())
    assert bench["completed"] == 2 and bench["failed"] == 8
    assert metrics["goodput_rps"] == pytest.approx(2 / metrics["duration_s"])  # failures stay in the denominator


def test_unreachable_server_rejects_every_request_and_the_run_fails(tmp_path):
    """Against a dead port every request is rejected: run_status failed (data files .partial), the reason in
    ``error``; the command line says so in one line and exits 1."""
    import socket
    import subprocess

    from experiments.serving.server.process import ROOT

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    metrics = run_loadgen(cfg_with(f"target.url=http://127.0.0.1:{port}", "target.model=m",
                                   *small_poisson(3, 100.0)), tmp_path)
    req = read_requests_csv(tmp_path / "requests.csv.partial")
    assert metrics["num_rejected"] == 3 and set(req["status"].tolist()) == {"REJECTED"}
    assert all("connect" in r.lower() for r in req["reason"])
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert written["run_status"] == "failed" and written["error"].startswith("3 of 3 requests failed")
    for model in ("target.model=m", "target.model=null"):  # null: the model lookup fails first (a user error)
        done = subprocess.run([sys.executable, "-m", "experiments.serving.loadgen.run", f"hydra.run.dir={tmp_path}/c",
                               f"target.url=http://127.0.0.1:{port}", model, *FAST, *small_poisson(3, 100.0)],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
        assert "Traceback" not in done.stderr and len(errors) == 1, done.stderr
        assert done.returncode == (1 if model.endswith("=m") else 2) and "127.0.0.1" in errors[0]


@pytest.mark.parametrize("sig", ["SIGINT", "SIGKILL"])
def test_an_interrupted_or_killed_load_test_leaves_every_request(tmp_path, sig):
    """SIGINT while requests stream: exit 130, .partial files with run_status interrupted, the requests that had
    ended and the ones in flight (CANCELLED), so every request sent is accounted for. SIGKILL: its journal, which
    `twinserve recover` turns into the same."""
    import signal
    import subprocess
    import time

    from experiments.serving.server.process import ROOT

    def plan(rid, body):  # the first requests end at once, the others stream for a long time
        return None if int(rid[1:]) < 3 else {"ttft_s": 0.01, "itl_s": 2.0}

    with FakeOpenAIServer(ttft_s=0.01, itl_s=0.001, plan=plan) as srv:
        proc = subprocess.Popen([sys.executable, "-m", "experiments.serving.loadgen.run", f"hydra.run.dir={tmp_path}",
                                 f"target.url={srv.url}", *FAST, *small_poisson(8, 50.0), "workload.output_len=4"],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while len(srv.log) < 8 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        proc.send_signal(getattr(signal, sig))
        _, err = proc.communicate(timeout=60)
    if sig == "SIGKILL":
        assert json.loads((tmp_path / "metrics.json").read_text())["run_status"] == "running"
        from experiments.serving.recover import recover

        recover(tmp_path)
    else:
        assert proc.returncode == 130 and "Traceback" not in err, err
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["run_status"] == "interrupted" and metrics["num_unfinished"] == 5
    req = read_requests_csv(tmp_path / "requests.csv.partial")
    assert sorted(req["status"].tolist()) == ["CANCELLED"] * 5 + ["FINISHED"] * 3
    assert not (tmp_path / "journal").exists() and (tmp_path / "client.csv").is_file()


def test_closed_loop_keeps_its_clients_busy(tmp_path):
    with FakeOpenAIServer(ttft_s=0.02, itl_s=0.005) as srv:
        metrics = run_loadgen(cfg_with(f"target.url={srv.url}", "workload=closed_loop", "workload.num_clients=3",
                                       "workload.num_requests=9", "workload.think_time_s=0.0",
                                       "workload.output_len=4", "workload.prompt_len=8"), tmp_path)
        log = dict(srv.log)
    assert metrics["num_completed"] == metrics["num_requests"] == 9
    # concurrency at the server, from its own receipt / last-chunk times: never above 3, and 3 reached
    events = sorted([(e.received, 1) for e in log.values()] + [(e.chunk_times[-1], -1) for e in log.values()],
                    key=lambda x: (x[0], x[1]))
    level = peak = 0
    for _, d in events:
        level += d
        peak = max(peak, level)
    assert peak == 3
    req = read_requests_csv(tmp_path / "requests.csv")
    later = np.sort(req["arrival_s"])[3:]
    assert np.all(later > 0)  # every request after the first three was sent when an earlier one finished
    assert np.all(np.sort(req["finish_s"])[:6] <= later + 1e-9)


def test_vllm_detailed_json_becomes_a_measured_run(tmp_path):
    src = {
        "duration": 2.0, "completed": 2, "failed": 2,
        "input_lens": [10, 20, 30, 40], "output_lens": [3, 4, 0, 0],
        "ttfts": [0.1, 0.2, 0.0, 0.0], "itls": [[0.02, 0.03], [0.05], [], []],
        "latencies": [0.15, 0.25, 0.0, 0.0], "start_times": [1000.0, 1000.5, 1001.0, 1001.2],
        "errors": ["", "", "Traceback (most recent call last):\n  ...\nTimeoutError",
                   "Bad Request"],
    }
    path = tmp_path / "vllm.json"
    path.write_text(json.dumps(src))
    out = tmp_path / "run"
    metrics = bench_serve_to_run(path, out)
    assert not (out / "steps.csv").exists()
    req = read_requests_csv(out / "requests.csv")
    assert req["status"].tolist() == ["FINISHED", "FINISHED", "TIMED_OUT", "REJECTED"]
    assert req["arrival_s"].tolist() == pytest.approx([0.0, 0.5, 1.0, 1.2])
    assert req["ttft_s"][:2].tolist() == pytest.approx([0.1, 0.2])
    assert req["e2e_s"][:2].tolist() == pytest.approx([0.15, 0.25])
    assert req["output_tokens"].tolist() == [3, 4, 0, 0]
    assert req["reason"].tolist()[2:] == ["TimeoutError", "Bad Request"]
    tok = read_tokens_csv(out / "tokens.csv")
    assert tok["time_s"][tok["request_id"] == "r0"].tolist() == pytest.approx([0.1, 0.12, 0.15])
    assert tok["num_tokens"][tok["request_id"] == "r1"].tolist() == [2, 2]  # 4 tokens over 2 chunks
    assert metrics["num_completed"] == 2 and metrics["num_timed_out"] == 1 and metrics["num_rejected"] == 1
    # our TPOT equals vLLM's (E2E - TTFT) / (n - 1); ITL divides a 2-token chunk's gap by 2
    assert metrics["tpot_s"]["max"] == pytest.approx((0.15 - 0.1) / 2)
    assert metrics["tpot_s"]["min"] == pytest.approx((0.25 - 0.2) / 3)
    assert metrics["itl_s"]["count"] == 4 and metrics["itl_s"]["mean"] == pytest.approx((0.02 + 0.03 + 0.05) / 4)
    # and back to vLLM's form: the same per-request numbers
    again = bench_serve_result(read_bench_serve(path), 2.0)
    for key in ("input_lens", "output_lens", "errors"):
        assert again[key][:2] == src[key][:2]
    assert again["ttfts"] == pytest.approx(src["ttfts"])
    assert again["latencies"] == pytest.approx(src["latencies"])
    assert [x for xs in again["itls"] for x in xs] == pytest.approx([0.02, 0.03, 0.05])
    assert again["completed"] == 2 and again["failed"] == 2 and again["total_output_tokens"] == 7
    assert again["mean_ttft_ms"] == pytest.approx(150.0) and again["request_goodput"] is None


@pytest.mark.parametrize("text, words", [
    ("{broken", ["not a vLLM bench serve result", "JSONDecodeError"]),
    ("[1, 2]", ["not a vLLM bench serve result", "a JSON list"]),
    ('{"duration": 1.0}', ["no ['input_lens'", "--save-detailed"]),
])
def test_a_bad_bench_serve_file_is_named(tmp_path, text, words):
    """compare.measured=<file>.json: a file that is not a detailed bench serve result is refused naming the file
    (a bare JSONDecodeError, a TypeError on a list, or 'bench serve result' without the path before)."""
    path = tmp_path / "vllm.json"
    path.write_text(text)
    for read in (read_bench_serve, lambda f: bench_serve_to_run(f, tmp_path / "run")):
        with pytest.raises(ValueError) as e:
            read(path)
        assert str(e.value).startswith(f"{path}: ") and all(w in str(e.value) for w in words)


def test_apportion_spreads_tokens_over_chunks():
    assert apportion(7, 3) == [2, 2, 3]
    assert apportion(2, 4) == [1, 1, 0, 0]
    assert apportion(5, 0) == []
    for total, n in [(10, 4), (3, 3), (100, 7)]:
        assert sum(apportion(total, n)) == total


def _bpe_tokenizer(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "serving", "model", "token", "cache",
             "prefix", "batch", "queue"]
    rng = np.random.default_rng(0)
    corpus = [" ".join(rng.choice(words, 12)) for _ in range(200)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="<unk>")
    fast.save_pretrained(path)
    return path


def _wordlevel_bos_tokenizer(path):
    """A WordLevel tokenizer (whitespace words) whose encoding starts with a BOS token, as servers add it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(200)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(path)
    return path


@pytest.mark.parametrize("make, shortest", [(_bpe_tokenizer, 1), (_wordlevel_bos_tokenizer, 2)])
def test_text_prompts_tokenize_to_the_length_and_keep_shared_prefixes(make, shortest, tmp_path):
    from transformers import AutoTokenizer

    from core.prompt import materialize
    from core.request import Request
    from experiments.serving.loadgen.prompts import load_tokenizer

    d = make(tmp_path / "tok")
    builder = TextPrompts(load_tokenizer(d))
    reference = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    a = Request("a", 0.0, 40, 4, hash_ids=(1, 2, 3), tokens_per_hash_id=16)
    b = Request("b", 0.0, 40, 4, hash_ids=(1, 2, 9), tokens_per_hash_id=16)
    texts = {}
    for r in (a, b, Request("c", 0.0, 2, 1), Request("d", 0.0, 300, 1)):
        text, got = builder.text(materialize(r, len(reference)), r.prompt_len)
        assert got == r.prompt_len == len(reference(text)["input_ids"])  # special tokens the server adds included
        texts[r.id] = text
    text, got = builder.text([5], 1)  # one token: impossible when the tokenizer adds a BOS; the nearest is returned
    assert got == shortest == len(reference(text)["input_ids"])
    shared = reference(texts["a"], add_special_tokens=False)["input_ids"][:32]
    assert reference(texts["b"], add_special_tokens=False)["input_ids"][:32] == shared


def test_text_mode_end_to_end(tmp_path):
    from transformers import AutoTokenizer

    d = _bpe_tokenizer(tmp_path / "tok")
    cfg = cfg_with("target.prompt_mode=text", f"target.tokenizer={d}", *small_poisson(3, 100.0))
    with FakeOpenAIServer(ttft_s=0.005, itl_s=0.002) as srv:
        cfg.target.url = srv.url
        metrics = run_loadgen(cfg, tmp_path / "run")
        bodies = {rid: e.body for rid, e in srv.log.items()}
    assert metrics["num_completed"] == 3 and metrics["prompt_mode"] == "text"
    reference = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    for r in build_workload(cfg.workload).initial():
        assert len(reference(bodies[r.id]["prompt"])["input_ids"]) == r.prompt_len


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF_DIR / "workload").glob("*.yaml")
                                        if p.stem != "requests"))
def test_every_workload_option_composes_with_loadgen(name):
    cfg = cfg_with(f"workload={name}")
    assert build_workload(cfg.workload) is not None
    assert Target.from_mapping(cfg.target).completions_url == "http://127.0.0.1:8000/v1/completions"


@pytest.mark.parametrize("override, key", [
    ("target.prompt_mode=words", "target.prompt_mode"), ("target.timeout_s=0", "target.timeout_s"),
    ("target.max_concurrency=0", "target.max_concurrency"), ("target.url=localhost:8000", "target.url"),
    ("+target.bogus=1", "bogus")])
def test_bad_target_settings_fail_naming_the_key(override, key, tmp_path):
    with pytest.raises(ValueError, match=key):
        run_loadgen(cfg_with(override), tmp_path)


def test_target_url_forms():
    for url in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/completions"):
        t = Target(url)
        assert t.completions_url == "http://h:1/v1/completions" and t.models_url == "http://h:1/v1/models"


def test_status_of_every_request_is_terminal_and_unique(poisson_run):
    _, out, _, _ = poisson_run
    req = read_requests_csv(out / "requests.csv")
    assert len(set(req["id"].tolist())) == len(req["id"])
    assert set(req["status"].tolist()) <= {s.value for s in Status if s.terminal}
    assert not any(math.isnan(x) for x in req["finish_s"])


@pytest.mark.bench
def test_send_lag_at_100_rps():
    from experiments.benchmarks.loadgen import main

    out = main(["--rate", "100", "--requests", "1000"])
    print(f"send lag p50 {out['send_lag_p50_ms']:.2f} ms, p99 {out['send_lag_p99_ms']:.2f} ms (goal p99 < 2 ms)")
    assert out["completed"] == 1000 and out["exact_lengths"]
