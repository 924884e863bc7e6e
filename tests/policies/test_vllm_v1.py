"""scheduler=vllm_v1 against vLLM 0.32's own decisions: a committed recording (tests/data/vllm_v1_decisions.json,
made by experiments/calibration/vllm_sched_trace.py from vLLM itself) replayed step by step, the same live on fresh
seeds (slow; needs .venv-vllm), and one hand-built case per rule."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from core.kv_cache import VLLM, KVCacheManager
from core.loop import ServingLoop
from core.replica import Replica, SchedulerLimits
from core.request import Request, RequestState, Status
from experiments.calibration.vllm_sched_trace import make_stream, prompt_tokens, sampled_token, step_record
from policies.eviction.lru import LRUEviction
from policies.routers.round_robin import RoundRobinRouter
from policies.schedulers.vllm_v1 import VLLMv1Scheduler
from sim.clock import run_virtual
from sim.cost.linear import LinearCostModel
from sim.executor import CostModelExecutor
from tests.helpers import ListWorkload
from tests.sim.test_fast_forward import outcome

ROOT = Path(__file__).resolve().parents[2]
RECORDING = ROOT / "tests" / "data" / "vllm_v1_decisions.json"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SCHEDULER_KEYS = ("long_prefill_token_threshold", "long_prefill_token_threshold_adaptive", "enable_chunked_prefill",
                  "scheduler_reserve_full_isl")


# ---- replaying a stream through a Replica ------------------------------------------------------------------
def replay(stream: dict) -> tuple[list[dict], list[RequestState], Replica, int]:
    """The stream through a Replica with the vllm_v1 scheduler and vLLM's prefix-cache mode, one step per
    ``schedule()`` as on vLLM's side: the step records, the request states, the replica and how many chunks were
    partial prefills."""
    cfg = stream["config"]
    limits = SchedulerLimits(max_num_batched_tokens=cfg["max_num_batched_tokens"], max_num_seqs=cfg["max_num_seqs"],
                             max_model_len=cfg["max_model_len"])
    kv = KVCacheManager(cfg["num_gpu_blocks"] - 1, cfg["block_size"], LRUEviction(), cfg["enable_prefix_caching"],
                        prefix_cache_mode=VLLM)  # vLLM's pool also holds its null block
    rep = Replica(0, VLLMv1Scheduler(**{k: cfg[k] for k in SCHEDULER_KEYS}), kv, limits)
    index = {r["id"]: i for i, r in enumerate(stream["requests"])}
    pending = sorted(stream["requests"], key=lambda r: r["arrival"])
    steps, states, k, partial = [], [], 0, 0
    while pending or rep.waiting or rep.running:
        while pending and pending[0]["arrival"] <= k:
            r = pending.pop(0)
            prompt = tuple(prompt_tokens(stream, r))
            states.append(rep.add(Request(r["id"], float(k), len(prompt), r["max_tokens"], prompt_token_ids=prompt),
                                  float(k)))
        batch = rep.schedule(float(k))
        tokens = [sampled_token(stream, index[ch.state.id], ch.state.num_output_tokens)
                  for ch in batch.chunks if ch.samples]
        rep.apply(batch, tokens, k + 1.0)
        partial += sum(not ch.samples for ch in batch.chunks)
        finished = [ch.state.id for ch in batch.chunks if ch.state.status is Status.FINISHED]
        steps.append(step_record({ch.state.id: ch.num_tokens for ch in batch.chunks}, batch.preempted, finished))
        k += 1
    return steps, states, rep, partial


def assert_same_decisions(stream: dict) -> tuple[list[RequestState], int]:
    """Replay ``stream`` and compare with its recorded steps: the same tokens per request in the same order, the
    same preemptions and finished requests, in every step; the pool back to free / evictable at the end. Returns
    the request states and the number of partial-prefill chunks."""
    ours, states, rep, partial = replay(stream)
    theirs = stream["steps"]
    for k, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if list(a["s"].items()) != list(b["s"].items()) or a.get("p") != b.get("p") or a.get("f") != b.get("f"):
            raise AssertionError(f"stream {stream['seed']} ({stream['config']}), step {k}:\n"
                                 f"  vLLM: {b}\n  ours: {a}\n  previous steps: {theirs[max(0, k - 3):k]}")
    assert len(ours) == len(theirs), f"stream {stream['seed']}: {len(ours)} steps, vLLM took {len(theirs)}"
    assert all(s.status is Status.FINISHED for s in states)
    rep.kv.check_invariants()
    assert rep.kv.num_used_blocks == 0
    return states, partial


# ---- the recording ---------------------------------------------------------------------------------------
def load_recording() -> dict:
    return json.loads(RECORDING.read_text())


def test_recording_is_vllms_and_describes_the_streams_generated_here():
    rec = load_recording()
    assert rec["vllm"] == "0.32.0"
    for stream in rec["streams"]:
        assert {k: v for k, v in stream.items() if k != "steps"} == make_stream(stream["seed"])


def test_decisions_match_the_recording():
    streams = load_recording()["streams"]
    replays = {stream["seed"]: assert_same_decisions(stream) for stream in streams}
    # what the recording covers, on vLLM's decisions (which the replay just matched: its counts are vLLM's too)
    steps = [step for stream in streams for step in stream["steps"]]
    assert len(steps) >= 10_000 and len(streams) >= 40
    assert sum(len(s.get("p", ())) for s in steps) >= 300  # preemptions
    assert sum(partial for _, partial in replays.values()) >= 1000  # chunked prefills
    capped = {stream["seed"] for stream in streams for s in stream["steps"]
              if stream["config"]["long_prefill_token_threshold"] in s["s"].values()}
    assert len(capped) >= 10  # chunks cut at the threshold in many streams
    hits = [sum(s.num_cached_tokens > 0 for s in states) for states, _ in replays.values()]  # at first admission
    assert sum(hits) >= 300 and sum(h > 0 for h in hits) >= 25
    for key in ("enable_chunked_prefill", "scheduler_reserve_full_isl", "enable_prefix_caching",
                "long_prefill_token_threshold_adaptive"):
        assert len({s["config"][key] for s in streams}) == 2, key  # both settings recorded


@pytest.mark.slow
@pytest.mark.skipif(not any(ROOT.glob(".venv-vllm/lib/python3*/site-packages/vllm/v1/core/sched/scheduler.py")),
                    reason="no vLLM in .venv-vllm (experiments/calibration/vllm_sched_trace.py needs it)")
def test_decisions_match_vllm_live(tmp_path):
    """12 seeds never recorded before (drawn anew each run; a mismatch names its seed, which
    ``vllm_sched_trace.py --seeds`` records again), recorded by vLLM now (under a minute) and replayed here."""
    first = random.SystemRandom().randrange(1000, 10**6)
    out = tmp_path / "live.json"
    subprocess.run([str(VLLM_PYTHON), str(ROOT / "experiments" / "calibration" / "vllm_sched_trace.py"),
                    "--seeds", f"{first}-{first + 11}", "--out", str(out)], check=True, cwd=ROOT, stdout=sys.stderr)
    for stream in json.loads(out.read_text())["streams"]:
        assert_same_decisions(stream)


# ---- one rule at a time --------------------------------------------------------------------------------------
BS = 4


def replica(num_blocks: int = 64, mode: str = VLLM, prefix_caching: bool = True, budget: int = 64, seqs: int = 8,
            **scheduler) -> Replica:
    kv = KVCacheManager(num_blocks, BS, LRUEviction(), prefix_caching, prefix_cache_mode=mode)
    return Replica(0, VLLMv1Scheduler(**scheduler), kv,
                   SchedulerLimits(max_num_batched_tokens=budget, max_num_seqs=seqs, max_model_len=1024))


def add(rep: Replica, rid: str, prompt: tuple[int, ...] | int, max_tokens: int = 4, now: float = 0.0) -> None:
    """Queue a request: ``prompt`` its token ids, or its length (content private to it)."""
    if isinstance(prompt, int):
        rep.add(Request(rid, now, prompt, max_tokens), now)
    else:
        rep.add(Request(rid, now, len(prompt), max_tokens, prompt_token_ids=prompt), now)


def step(rep: Replica, now: float = 0.0) -> tuple[dict[str, int], list[str]]:
    """One schedule / apply (token 1 for every sampling chunk): tokens per request, preempted ids."""
    batch = rep.schedule(now)
    rep.apply(batch, [1] * sum(ch.samples for ch in batch.chunks), now + 1.0)
    return {ch.state.id: ch.num_tokens for ch in batch.chunks}, batch.preempted


def test_running_first_in_running_order_then_waiting_fcfs_in_one_budget():
    rep = replica(budget=32)
    add(rep, "A", 20)
    assert step(rep) == ({"A": 20}, [])
    add(rep, "B", 30)
    add(rep, "C", 5)
    assert step(rep) == ({"A": 1, "B": 30, "C": 1}, [])  # B's whole prompt, C's first chunk fills the budget
    assert step(rep) == ({"A": 1, "B": 1, "C": 4}, [])  # C's partial prefill runs as a running request


def test_long_prefill_threshold_caps_chunks_unless_alone():
    rep = replica(long_prefill_token_threshold=8)
    add(rep, "A", 20)
    assert step(rep) == ({"A": 20}, [])  # the only request: nobody to starve
    add(rep, "B", 20)
    add(rep, "C", 20)
    assert step(rep) == ({"A": 1, "B": 8, "C": 8}, [])
    assert step(rep) == ({"A": 1, "B": 8, "C": 8}, [])  # running prefills are capped too
    assert step(rep) == ({"A": 1, "B": 4, "C": 4}, [])


def test_adaptive_threshold_is_at_least_a_fair_share_of_the_budget():
    rep = replica(budget=64, long_prefill_token_threshold=4, long_prefill_token_threshold_adaptive=True)
    for rid in "ABCD":
        add(rep, rid, 30)
    assert step(rep) == ({"A": 16, "B": 16, "C": 16, "D": 16}, [])  # max(4, 64 // 4 requests)


def test_kv_exhaustion_preempts_the_newest_then_the_request_itself_and_admits_nobody():
    rep = replica(num_blocks=5, prefix_caching=False)
    add(rep, "A", 8)
    add(rep, "B", 8)
    assert step(rep) == ({"A": 8, "B": 8}, [])  # 4 of 5 blocks
    add(rep, "C", 1)
    # A's decode takes the last block; B's finds none: B, the newest, is preempted -- B itself, so nothing after it
    # runs, and although C's one block is free now, nobody is admitted in a step that preempted
    assert step(rep) == ({"A": 1}, ["B"])
    assert [s.id for s in rep.waiting] == ["B", "C"]
    # B (8 prompt tokens + 1 output = 3 blocks) does not fit the 2 free blocks: it holds C back (FCFS)
    assert step(rep) == ({"A": 1}, [])
    rep3 = replica(num_blocks=7, prefix_caching=False)
    for rid in "ABC":
        add(rep3, rid, 8)
    assert step(rep3) == ({"A": 8, "B": 8, "C": 8}, [])
    assert step(rep3) == ({"A": 1, "B": 1}, ["C"])  # A's block takes the last one; B's preempts C, the newest


def test_waiting_head_that_does_not_fit_blocks_the_queue():
    rep = replica(num_blocks=8)
    add(rep, "A", 20)
    assert step(rep) == ({"A": 20}, [])  # 5 blocks held
    add(rep, "B", 16)  # needs 4 blocks
    add(rep, "C", 2)  # would fit in the 2 left after A's decode takes a 6th
    assert step(rep) == ({"A": 1}, [])


def test_full_sequence_must_fit_before_the_first_chunk():
    for reserve, expected in ((True, {"A": 1}), (False, {"A": 1, "B": 8})):
        rep = replica(num_blocks=8, budget=9, scheduler_reserve_full_isl=reserve)
        add(rep, "A", 16)
        step(rep)
        step(rep)  # A: 16 + 1 tokens -> 5 blocks, 3 free
        add(rep, "B", 16)  # B's 8-token chunk needs 2 blocks, its prompt 4
        assert step(rep) == (expected, [])


def test_without_chunked_prefill_a_prompt_over_the_budget_left_stops_admission():
    for chunked, expected in ((True, {"A": 12, "B": 4}), (False, {"A": 12})):
        rep = replica(budget=16, enable_chunked_prefill=chunked)
        for rid, n in (("A", 12), ("B", 10), ("C", 2)):
            add(rep, rid, n)
        assert step(rep) == (expected, [])


def test_max_num_seqs_bounds_admission():
    rep = replica(seqs=2)
    for rid in "ABC":
        add(rep, rid, 5, max_tokens=2)
    assert step(rep) == ({"A": 5, "B": 5}, [])
    assert step(rep) == ({"A": 1, "B": 1}, [])  # A and B finish
    assert step(rep) == ({"C": 5}, [])


def test_a_fully_cached_prompt_recomputes_its_last_block():
    """vLLM caps a hit at num_tokens - 1 tokens and counts whole blocks only: a prompt of whole blocks, all cached,
    recomputes its last block (and samples from it); a cached prefix ending mid-block leaves the rest."""
    prompt = tuple(range(8))  # two blocks
    rep = replica()
    add(rep, "W", prompt, max_tokens=1)
    assert step(rep) == ({"W": 8}, [])
    add(rep, "X", prompt)
    add(rep, "Y", prompt + (9,))
    assert step(rep) == ({"X": 4, "Y": 1}, [])


def test_a_request_admitted_later_in_the_step_hits_blocks_scheduled_before_it():
    """vLLM publishes a block when the step computing it is scheduled: B reuses A's prompt in A's own step (with
    kv.prefix_cache_mode=prompt it would only after that step)."""
    prompt = tuple(range(8))
    for mode, expected in ((VLLM, {"A": 8, "B": 2}), ("prompt", {"A": 8, "B": 10})):
        rep = replica(mode=mode)
        add(rep, "A", prompt)
        add(rep, "B", prompt + (8, 9))
        assert step(rep) == (expected, [])


def test_preempted_request_resumes_from_its_cached_generated_blocks():
    """A preempted request's blocks stay cached, its generated tokens' full block too: it resumes from there."""
    for mode, resume in ((VLLM, 1), ("prompt", 5)):
        rep = replica(num_blocks=7, mode=mode)
        add(rep, "A", 8, max_tokens=7)
        add(rep, "B", 8, max_tokens=7)
        steps = [step(rep, float(k)) for k in range(8)]
        # step 5: A's decode takes the last block, B (newest) preempts itself with 8 + 5 tokens, 12 of them in full
        # blocks; step 6: B (4 blocks with its 3 evictable hits) does not fit; A finishes and frees its blocks
        assert steps[5] == ({"A": 1}, ["B"]) and steps[6] == ({"A": 1}, [])
        assert steps[7] == ({"B": resume}, [])  # vLLM: 13 - 12 cached; prompt blocks only: 13 - 8


def test_steady_decode_fast_forward_writes_the_same_run():
    """The scheduler declares steady_decode: fast-forwarded and per-step runs are identical (preemption included);
    a pool in vllm mode publishes blocks as steps are scheduled, so the replica does not fast-forward it."""
    reqs = [Request(f"r{i}", 0.01 * i, 24 + 7 * i, 120) for i in range(5)]

    def run(fast_forward: bool, mode: str):
        rep = Replica(0, VLLMv1Scheduler(long_prefill_token_threshold=16),
                      KVCacheManager(30, 16, LRUEviction(), prefix_cache_mode=mode),
                      SchedulerLimits(max_num_batched_tokens=64, max_num_seqs=4))
        loop = ServingLoop([rep], [CostModelExecutor(LinearCostModel(c0_s=0.01, per_kv_token_read_s=1e-6))],
                           RoundRobinRouter(), ListWorkload(reqs), fast_forward=fast_forward)
        res = run_virtual(loop)
        return outcome(res), loop.fast_forwarded_steps, sum(s.num_preemptions for s in res.states)

    for mode in ("prompt", VLLM):
        (fast, n_fast, preempted), (slow, n_slow, _) = run(True, mode), run(False, mode)
        assert fast == slow and preempted > 0 and n_slow == 0
        assert (n_fast > 0) == (mode == "prompt")
