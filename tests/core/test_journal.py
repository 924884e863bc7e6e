"""The run journal (core.journal): a loop that journals its requests and steps writes, once the journal is read back,
the same bytes as a loop that kept them; a kill leaves a readable journal; ids of any bytes are written."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.journal import IN_FLIGHT_REASON, RunJournal, SeenIds, read_journal, safe_text
from core.kv_cache import KVCacheManager
from core.loop import ServingLoop
from core.metrics import ITLPool, summarize
from core.output import write_run
from core.replica import Replica, SchedulerLimits
from core.request import Request, RequestState, Status
from experiments.serving.journal import journal_result
from policies.eviction.lru import LRUEviction
from policies.routers.round_robin import RoundRobinRouter
from policies.schedulers.sarathi import SarathiScheduler
from sim.clock import run_virtual
from tests.helpers import FormulaExecutor, ListWorkload

IDS = ["plain", "with,comma", 'quo"te', "é-ü", "new\nline", safe_text("raw\udcffbyte")]


def requests(seed: int) -> list[Request]:
    rng = random.Random(seed)
    out = []
    for i in range(40):
        n = rng.randint(1, 300)
        out.append(Request(f"{IDS[i % len(IDS)]}-{i}", rng.random() * 2, n, rng.randint(1, 40),
                           prompt_token_ids=tuple(rng.randrange(50) for _ in range(n)) if i % 2 else None,
                           tenant=rng.choice(["", "a", "b,c"]), warmup=i < 3))
    out.append(Request("too-long", 0.5, 900, 200))  # rejected at dispatch: prompt + output > max_model_len
    return out


def loop(reqs: list[Request], pool: ITLPool | None = None) -> ServingLoop:
    reps = [Replica(i, SarathiScheduler(), KVCacheManager(64, 16, LRUEviction()),
                    SchedulerLimits(256, 8, 1024)) for i in range(2)]
    return ServingLoop(reps, [FormulaExecutor(lambda f: 0.001 + 1e-5 * f.num_batched_tokens) for _ in reps],
                       RoundRobinRouter(), ListWorkload(reqs), itl_pool=pool)


def files(out, states, steps, metrics, tokens="all") -> dict[str, bytes]:
    paths = write_run(out, states, steps, metrics, tokens=tokens)
    return {n: p.read_bytes() for n, p in paths.items()}


@pytest.mark.parametrize("tokens", ["all", "none"])
def test_a_journaled_run_writes_the_bytes_of_a_run_that_kept_everything(tmp_path, tokens):
    kept = loop(requests(1), ITLPool() if tokens == "none" else None)
    a = run_virtual(kept)
    journaled = loop(requests(1))
    journal = RunJournal(tmp_path / "b", {"kind": "test"})
    journaled.journal_to(journal)
    b_run = run_virtual(journaled)
    journal.close()
    assert b_run.states == [] and journal.num_steps == len(a.steps) and journal.num_live == 0
    contents = read_journal(tmp_path / "b")
    b = journal_result(contents, a.end_s, a.wall_s, tokens, ITLPool().edges)
    assert [s.id for s in b.states] == [s.id for s in a.states] and not contents.in_flight
    assert any(s.status is Status.REJECTED for s in b.states)
    ma = summarize(a.states, itl_pool=a.itl_pool)
    mb = summarize(b.states, itl_pool=b.itl_pool)
    assert ma == mb
    assert files(tmp_path / "a", a.states, a.steps, ma, tokens) == files(tmp_path / "c", b.states, b.steps, mb, tokens)


def test_a_killed_session_leaves_ended_requests_and_in_flight_ones_as_cancelled(tmp_path):
    journal = RunJournal(tmp_path, {"kind": "test"})
    done = RequestState(Request("done", 0.0, 4, 2), status=Status.FINISHED, replica=0, first_scheduled_s=0.5,
                        finish_s=1.25)
    done.add_tokens([7, 8], [1.0, 1.25])
    live = RequestState(Request("live", 0.75, 3, 9))
    journal.admit(done)
    journal.admit(live)
    journal.end(done)
    journal.add(0, 0.5, 0.5, [1] * 12, 3, 0)
    with open(tmp_path / "journal" / "requests.jsonl", "ab") as f:
        f.write(b'{"end": {"id": "li')  # killed in the middle of a write
    c = read_journal(tmp_path)
    assert [s.id for s in c.states] == ["done", "live"] and c.torn_lines == 1 and len(c.steps) == 1
    assert c.ended[0].output_token_ids == [7, 8] and list(c.ended[0].token_times) == [1.0, 1.25]
    assert c.in_flight[0].status is Status.CANCELLED and c.in_flight[0].reason == IN_FLIGHT_REASON
    assert c.last_time_s == 1.25
    with pytest.raises(ValueError, match="holds the journal of an earlier session"):
        RunJournal(tmp_path, {})


def test_a_bad_line_inside_the_journal_is_named_by_file_and_line(tmp_path):
    RunJournal(tmp_path, {}).close()
    (tmp_path / "journal" / "requests.jsonl").write_text('{"admit": {}}\nnot json\n{}\n')
    with pytest.raises(ValueError, match=r"requests.jsonl:2: not a journal record"):
        read_journal(tmp_path)


def test_ids_of_any_bytes_are_written_and_read_back(tmp_path):
    rid = safe_text("x\udcff\udcfey")  # how a server sees a header holding the raw bytes ff fe
    assert rid == "x\\xff\\xfey" and safe_text("ok é") == "ok é" and safe_text("\ud800") == "\\ud800"
    s = RequestState(Request(rid, 0.0, 1, 1), status=Status.CANCELLED, reason="gone")
    write_run(tmp_path, [s], None, {"n": 1})
    assert rid in (tmp_path / "requests.csv").read_text()
    unsafe = RequestState(Request("a\ud800b", 0.0, 1, 1), status=Status.CANCELLED)  # never a failed write
    write_run(tmp_path / "u", [unsafe], None, {})
    assert "a\\ud800b" in (tmp_path / "u" / "requests.csv").read_text()
    journal = RunJournal(tmp_path / "j", {})
    journal.end(unsafe)
    journal.close()
    assert read_journal(tmp_path / "j").states[0].id == "a\ud800b"
    assert json.loads((tmp_path / "j" / "journal" / "requests.jsonl").read_text())["end"]["id"] == "a\ud800b"


@settings(max_examples=30, deadline=None)
@given(st.lists(st.text(max_size=12), max_size=300), st.lists(st.text(max_size=12), max_size=50))
def test_seen_ids_answers_as_a_set(added, probes):
    seen, ref = SeenIds(), set()
    for i, x in enumerate(added):
        seen.add(x)
        ref.add(x)
        if i % 7 == 0:
            assert all((p in seen) == (p in ref) for p in probes[:5])
    assert all((p in seen) == (p in ref) for p in [*probes, *added])
    assert len(seen) == len({SeenIds._key(x) for x in ref})


def test_seen_ids_merges_into_its_sorted_array():
    seen = SeenIds()
    for i in range(10000):
        seen.add(f"id-{i}")
    assert len(seen._recent) < 4096 and all(f"id-{i}" in seen for i in range(0, 10000, 97))
    assert "id-10000" not in seen
