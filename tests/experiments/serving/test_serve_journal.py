"""A served session loses nothing that ended: SIGKILL after a flush or before the first one, then `twinserve
recover`, gives every finished request and the in-flight ones as CANCELLED; a second signal during the drain cancels
what runs and still writes the run files; while draining new requests get 503 and /health says draining; gauges
fall to 0 when every running request is aborted and nothing else arrives. Servers are `backend=sim` (no model)."""

from __future__ import annotations

import csv
import http.client
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.output import read_requests
from experiments.serving.server.process import ROOT, ServerProcess


def wait_for(predicate, timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def post(s: ServerProcess, n: int, max_tokens: int = 3) -> None:
    for i in range(n):
        status, _ = s.post("/v1/completions", json.dumps({"prompt": [5, 6, 7 + i], "max_tokens": max_tokens}).encode())
        assert status == 200


def open_stream(s: ServerProcess, rid: str, max_tokens: int = 1800) -> tuple[http.client.HTTPConnection, object]:
    """A streaming request, read up to its first event: it is running now."""
    c = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
    c.request("POST", "/v1/completions", json.dumps({"prompt": [9, 9, 9], "max_tokens": max_tokens, "stream": True}),
              {"Content-Type": "application/json", "X-Request-Id": rid})
    r = c.getresponse()
    assert r.status == 200 and r.readline().startswith(b"data: ")
    return c, r


def status_file(out: Path) -> dict:
    try:
        return json.loads((out / "metrics.json").read_text())
    except (OSError, ValueError):
        return {}


def rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("flushed", [True, False], ids=["after-a-flush", "before-the-first-flush"])
def test_sigkill_then_recover_gives_every_finished_request(tmp_path, flushed):
    out = tmp_path / "run"
    s = ServerProcess(None, out, "backend=sim", f"serve.flush_interval_s={0.3 if flushed else 600}")
    streams = []
    try:
        post(s, 6)
        streams = [open_stream(s, f"live-{i}") for i in range(3)]
        if flushed:
            wait_for(lambda: status_file(out).get("num_requests") == 6 and status_file(out).get("num_unfinished") == 3,
                     what="a flush")
        assert status_file(out)["run_status"] == "running"
        s.proc.send_signal(signal.SIGKILL)
        s.proc.wait(10)
    finally:
        for c, _ in streams:
            c.close()
        s.stop()
    with pytest.raises(FileNotFoundError, match="twinserve recover"):
        read_requests(out)
    cli = "import sys; from experiments.cli import twinserve; sys.exit(twinserve())"
    done = subprocess.run([sys.executable, "-c", cli, "recover", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["run_status"] == "interrupted" and "recovered from its journal" in metrics["error"]
    assert metrics["num_unfinished"] == 3 and metrics["counts_by_status"]["FINISHED"] == 6
    got = rows(out / "requests.csv.partial")
    assert sorted(r["status"] for r in got) == ["CANCELLED"] * 3 + ["FINISHED"] * 6
    assert {r["id"] for r in got if r["status"] == "CANCELLED"} == {"live-0", "live-1", "live-2"}
    assert all(int(r["output_tokens"]) == 3 for r in got if r["status"] == "FINISHED")
    assert not (out / "journal").exists() and (out / "steps.csv.partial").stat().st_size > 0


def test_a_second_signal_during_the_drain_cancels_and_still_writes_the_run_files(tmp_path):
    out = tmp_path / "run"
    s = ServerProcess(None, out, "backend=sim", "serve.drain_timeout_s=120")
    streams = []
    try:
        post(s, 2)
        streams = [open_stream(s, f"long-{i}") for i in range(3)]
        s.terminate()  # first signal: drain (the long streams would take ~10 s)
        wait_for(lambda: s.get("/health")[1] == json.dumps({"status": "draining"}), what="/health draining")
        status, body = s.post("/v1/completions", json.dumps({"prompt": [5], "max_tokens": 2}).encode())
        assert status == 503 and "shutting down" in body["error"]["message"]
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)  # second signal: cancel what runs, then write
        tails = [r.read().decode() for _, r in streams]
        assert s.proc.wait(30) == 0 and time.monotonic() - t0 < 15
    finally:
        for c, _ in streams:
            c.close()
        s.stop()
    for tail in tails:  # every cut client got an error event, then [DONE]
        assert "second signal" in tail and tail.rstrip().endswith("data: [DONE]")
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["run_status"] == "complete"
    got = {r["id"]: r for r in rows(out / "requests.csv")}
    assert len(got) == 5 and all(got[f"long-{i}"]["status"] == "CANCELLED" for i in range(3))
    assert "second signal" in got["long-0"]["reason"]


def test_gauges_fall_when_every_running_request_is_aborted_and_nothing_else_comes(tmp_path):
    s = ServerProcess(None, tmp_path / "run", "backend=sim")
    try:
        streams = [open_stream(s, f"s{i}") for i in range(4)]
        wait_for(lambda: s.metric("num_requests_running") == 4, what="4 running")
        assert s.metric("kv_cache_usage_perc") > 0
        for c, _ in streams:
            c.close()
        wait_for(lambda: s.metric("num_requests_running") == 0 and s.metric("kv_cache_usage_perc") == 0,
                 timeout_s=5, what="the gauges to fall")
    finally:
        assert s.stop() == 0
    statuses = [r["status"] for r in rows(tmp_path / "run" / "requests.csv")]
    assert statuses == ["CANCELLED"] * 4


def test_an_id_with_any_bytes_breaks_no_write(tmp_path):
    """An X-Request-Id holding a byte no UTF-8 decodes (0xff) is refused at the door with a 400 naming the header;
    every flush and the final write of the other requests succeed."""
    s = ServerProcess(None, tmp_path / "run", "backend=sim", "serve.flush_interval_s=0.2")
    try:
        c = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
        c.putrequest("POST", "/v1/completions")
        c.putheader("Content-Type", "application/json")
        c.putheader("X-Request-Id", b"id-\xff-end")  # sent as the raw byte
        body = json.dumps({"prompt": [5, 6], "max_tokens": 2}).encode()
        c.putheader("Content-Length", str(len(body)))
        c.endheaders(body)
        r = c.getresponse()
        answer = json.loads(r.read())
        assert r.status == 400 and answer["error"]["param"] == "X-Request-Id"
        post(s, 2)
        wait_for(lambda: status_file(tmp_path / "run").get("num_requests") == 2, what="a flush")
    finally:
        assert s.stop() == 0
    assert [r["status"] for r in rows(tmp_path / "run" / "requests.csv")] == ["FINISHED"] * 2
