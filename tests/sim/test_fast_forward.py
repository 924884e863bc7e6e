"""Decode fast-forward (core.fast_forward): runs with and without it write byte-identical files, over random
workloads, every scheduler, eviction policy and router, prefix caching on and off, small KV pools (preemption),
request timeouts and step noise (sim.noise); the vectorised decode pricing equals the scalar cost model bit for
bit; fast-forward really happens where it may and never where a scheduler or executor did not opt in; the heap
clock orders events as SimPy.
"""

from __future__ import annotations

import filecmp
import random
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from core.batch import Batch, StepFeatures
from core.fast_forward import decode_features
from core.interfaces import SchedulerView
from core.kv_cache import KVCacheManager
from core.loop import ServingLoop
from core.output import DATA_FILES
from core.replica import Replica, SchedulerLimits
from core.request import Request
from core.specs import HardwareSpec, ModelSpec
from experiments.build import CONF_DIR
from experiments.run import run
from policies.eviction.lru import LRUEviction
from policies.routers.round_robin import RoundRobinRouter
from policies.schedulers.sarathi import SarathiScheduler
from sim.clock import run_virtual
from sim.cost.calibrated import write_calibration
from sim.cost.linear import LinearCostModel
from sim.cost.roofline import RooflineCostModel
from sim.executor import CostModelExecutor
from sim.noise import StepNoise, record_step_noise
from tests.helpers import ListWorkload

OPTIONS = {g: sorted(p.stem for p in (CONF_DIR / g).glob("*.yaml")) for g in ("scheduler", "eviction", "router")}
WORKLOADS = ("poisson", "gamma", "shared_prefix", "closed_loop", "multi_turn")
COMPARED = (*DATA_FILES, "metrics.json")


def compose_cfg(overrides):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def run_both(tmp_path: Path, overrides) -> Path:
    """Run the config per step and fast-forwarded; assert every output file is byte-identical."""
    common = ["output.plots=false", "output.progress=false", *overrides]
    dirs = {}
    for ff in (False, True):
        d = dirs[ff] = tmp_path / f"ff_{ff}"
        try:
            run(compose_cfg([*common, f"backend.fast_forward={str(ff).lower()}"]), d)
        except ValueError as e:  # a random config no run can serve (e.g. all requests rejected): both must refuse
            if ff:
                raise AssertionError(f"fast-forward raised, per-step did not: {e}") from e
            with pytest.raises(ValueError, match=str(e)[:40].replace("(", r"\(").replace("[", r"\[")):
                run(compose_cfg([*common, "backend.fast_forward=true"]), tmp_path / "ff_refused")
            return d
    for name in COMPARED:
        a, b = dirs[False] / name, dirs[True] / name
        assert a.is_file() == b.is_file(), name
        if a.is_file():
            assert filecmp.cmp(a, b, shallow=False), f"{name} differs with {overrides}"
    return dirs[True]


def random_overrides(draw_or_rng) -> list[str]:
    rng = draw_or_rng
    workload = rng.choice(WORKLOADS)
    replicas = rng.choice([1, 1, 2, 3])
    ov = [f"workload={workload}", f"scheduler={rng.choice(OPTIONS['scheduler'])}",
          f"eviction={rng.choice(OPTIONS['eviction'])}", f"router={rng.choice(OPTIONS['router'])}",
          f"replicas={replicas}", f"seed={rng.randrange(1000)}",
          f"kv.prefix_caching={rng.choice(['true', 'false'])}",
          f"kv.block_size={rng.choice([4, 8, 16])}",
          f"kv.num_blocks={rng.choice([48, 96, 400])}",  # small pools force preemption
          "scheduler.max_num_batched_tokens=512",
          f"scheduler.max_num_seqs={rng.choice([2, 4, 64])}"]
    if workload in ("poisson", "gamma", "shared_prefix", "closed_loop"):
        ov.append(f"workload.num_requests={rng.randrange(6, 24)}")
    else:
        ov.append(f"workload.num_sessions={rng.randrange(2, 6)}")
    if workload in ("poisson", "gamma", "shared_prefix", "multi_turn"):
        ov.append(f"workload.arrival.rate_rps={rng.choice([2.0, 8.0, 50.0])}")
    if rng.random() < 0.3:
        ov.append(f"request_timeout_s={rng.choice([0.05, 0.3, 2.0])}")
    if rng.random() < 0.3:
        ov.append("cost_model=roofline")
    return ov


@settings(max_examples=12, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_fast_forward_writes_identical_files(tmp_path_factory, seed):
    rng = random.Random(seed)
    overrides = random_overrides(rng)
    if rng.random() < 0.4:  # a calibrated cost model with step noise: each step's factor by its index
        overrides = [o for o in overrides if not o.startswith("cost_model=")]
        overrides += ["cost_model=calibrated", f"cost_model.path={noisy_calibration(tmp_path_factory)}"]
    run_both(tmp_path_factory.mktemp("ff"), overrides)


def noisy_calibration(tmp_path_factory) -> Path:
    """A linear cost model with strong, long-memory step noise (sigma 0.4, blocks of 7 steps)."""
    path = tmp_path_factory.getbasetemp() / "noisy_calibration.yaml"
    if not path.is_file():
        rng = np.random.default_rng(0)
        feats = [StepFeatures(1, 64, 1, 64, 0, 2080, 0, 64, 64), StepFeatures(2, 2, 0, 0, 2, 0, 300, 0, 150)] * 200
        z = np.repeat(rng.standard_normal(80), 5)
        rec = record_step_noise(feats, np.exp(0.4 * z), np.ones(len(z)), block_steps=7)
        write_calibration(path, LinearCostModel(c0_s=2e-3, per_prefill_token_s=5e-5, per_decode_seq_s=3e-4,
                                                per_kv_token_read_s=1e-6), step_noise=rec)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", OPTIONS["scheduler"])
@pytest.mark.parametrize("eviction", OPTIONS["eviction"])
def test_fast_forward_identical_exhaustive(tmp_path, scheduler, eviction):
    """Every scheduler x eviction x router x workload (prefix caching alternating; random pool, limits, timeouts)."""
    for i, router in enumerate(OPTIONS["router"]):
        for j, workload in enumerate(WORKLOADS):
            caching = ("true", "false")[(i + j) % 2]
            rng = random.Random(f"{scheduler}{eviction}{router}{workload}{caching}")
            ov = [o for o in random_overrides(rng) if not o.startswith(("workload", "replicas", "kv.prefix"))]
            ov += [f"scheduler={scheduler}", f"eviction={eviction}", f"router={router}", f"workload={workload}",
                   f"kv.prefix_caching={caching}", f"replicas={1 + i % 3}",
                   "workload.num_requests=16" if workload != "multi_turn" else "workload.num_sessions=4"]
            run_both(tmp_path / f"{router}_{workload}", ov)


# ---- fast-forward happens, and only where declared ------------------------------------------------------------


def decode_heavy(n=6, out=200):
    return [Request(f"r{i}", 0.01 * i, 24 + 7 * i, out) for i in range(n)]


def loop_for(requests, scheduler_factory=SarathiScheduler, executor_factory=None, replicas=1, fast_forward=True,
             num_blocks=400, **limits):
    reps = [Replica(i, scheduler_factory(), KVCacheManager(num_blocks, 16, LRUEviction()), SchedulerLimits(**limits))
            for i in range(replicas)]
    make = executor_factory or (lambda: CostModelExecutor(LinearCostModel(c0_s=0.01, per_kv_token_read_s=1e-6)))
    return ServingLoop(reps, [make() for _ in reps], RoundRobinRouter(), ListWorkload(requests),
                       fast_forward=fast_forward)


def outcome(res) -> str:
    """Every step row and every request's tokens and times, as repr (0 and 0.0 differ, as they do in the files)."""
    return repr(([s.row() for s in res.steps],
                 [(s.id, s.status, s.replica, list(s.output_token_ids), list(s.token_times), s.first_scheduled_s,
                   s.first_token_s, s.finish_s, s.num_preemptions, s.reason) for s in res.states], res.end_s))


@pytest.mark.parametrize("noisy", [False, True])
def test_fast_forward_happens_on_a_decode_heavy_workload(noisy):
    """With step noise too: every step's duration differs from the model's, fast-forwarded or not, identically."""
    z = np.random.default_rng(1).standard_normal(500)

    def make():
        noise = StepNoise(z, {"decode": 0.3}, 0.3, 11, seed=4) if noisy else None
        return CostModelExecutor(LinearCostModel(c0_s=0.01, per_kv_token_read_s=1e-6), noise=noise)

    fast = loop_for(decode_heavy(), executor_factory=make)
    res = run_virtual(fast)
    assert fast.fast_forwarded_steps > 0.9 * len(res.steps)
    slow = loop_for(decode_heavy(), executor_factory=make, fast_forward=False)
    assert outcome(run_virtual(slow)) == outcome(res)
    assert slow.fast_forwarded_steps == 0
    plain = run_virtual(loop_for(decode_heavy()))
    changed = sum(a.row()[2] != b.row()[2] for a, b in zip(res.steps, plain.steps, strict=False))
    assert (changed > 0.9 * len(res.steps)) if noisy else changed == 0


class UndeclaredSarathi:
    """Sarathi's decisions without the SteadyDecodeScheduler declaration (a user's policy)."""

    def __init__(self):
        self.inner = SarathiScheduler()

    def schedule(self, view: SchedulerView) -> Batch:
        return self.inner.schedule(view)


class CountingSarathi(SarathiScheduler):
    def __init__(self):
        self.calls = 0

    def schedule(self, view):
        self.calls += 1
        return super().schedule(view)


def test_a_scheduler_that_does_not_declare_it_is_called_every_step():
    loop = loop_for(decode_heavy(), UndeclaredSarathi)
    res = run_virtual(loop)
    assert loop.fast_forwarded_steps == 0
    assert outcome(res) == outcome(run_virtual(loop_for(decode_heavy())))


def test_fast_forwarded_steps_skip_the_scheduler():
    loop = loop_for(decode_heavy(), CountingSarathi)
    res = run_virtual(loop)
    calls = loop.replicas[0].scheduler.calls
    assert calls == len(res.steps) - loop.fast_forwarded_steps + 1  # + the final call on an empty replica


def test_an_executor_that_does_not_predict_keeps_per_step():
    from tests.helpers import FormulaExecutor

    loop = loop_for(decode_heavy(), executor_factory=lambda: FormulaExecutor(lambda f: 0.01))
    run_virtual(loop)
    assert loop.fast_forwarded_steps == 0


def test_step_listeners_and_keep_batches_keep_per_step():
    loop = loop_for(decode_heavy())
    seen = []
    loop.on_step.append(lambda i, batch, record: seen.append(len(batch)))
    res = run_virtual(loop)
    assert loop.fast_forwarded_steps == 0 and len(seen) == len(res.steps)
    loop = loop_for(decode_heavy())
    loop.keep_batches = True
    res = run_virtual(loop)
    assert loop.fast_forwarded_steps == 0 and len(res.batches) == len(res.steps)


def test_stop_token_of_the_simulator_ends_a_run_exactly():
    """The simulator samples token 0; a request with stop id 0 ends after min_tokens outputs."""
    reqs = [Request("a", 0.0, 20, 100, stop_token_ids=(0,), min_tokens=30), Request("b", 0.0, 20, 90),
            Request("c", 0.02, 33, 120, stop_token_ids=(0,), min_tokens=55)]
    fast, slow = loop_for(reqs), loop_for(reqs, fast_forward=False)
    res = run_virtual(fast)
    assert outcome(res) == outcome(run_virtual(slow))
    assert len(res.states[0].output_token_ids) == 31 and fast.fast_forwarded_steps > 0


def test_timeouts_preemption_and_lockstep_replicas():
    """Identical replicas in lockstep (equal step end times: event order decides steps.csv order), a pool small
    enough to preempt, and timeouts that fire during decode."""
    reqs = [Request(f"r{i}", 0.0, 40, 150) for i in range(8)] + [Request(f"s{i}", 0.5, 30, 60) for i in range(4)]
    for kw in ({"num_blocks": 30}, {"request_timeout_s": 1.2}, {"replicas": 2}, {"replicas": 2, "num_blocks": 40}):
        fast, slow = loop_for(reqs, **kw), loop_for(reqs, fast_forward=False, **kw)
        res = run_virtual(fast)
        assert outcome(res) == outcome(run_virtual(slow)), kw
        assert fast.fast_forwarded_steps > 0, kw


# ---- vectorised pricing -----------------------------------------------------------------------------------------


def roofline_models():
    model = ModelSpec.from_config(compose_cfg(["model=llama3_8b"]).model)
    for hw in ("h100", "a100", "cpu"):
        hardware = HardwareSpec.from_mapping(dict(compose_cfg([f"hardware={hw}"]).hardware))
        yield RooflineCostModel(model, hardware)
        yield RooflineCostModel(model, hardware, weight_bits=4, kv_bits=8, overhead_s=3e-4, compute_eff=0.55)
    h100 = HardwareSpec.from_mapping(dict(compose_cfg(["hardware=h100"]).hardware))
    yield RooflineCostModel(ModelSpec.from_config(compose_cfg(["model=llama2_70b"]).model), h100, tp=4)


@given(n=st.integers(1, 512), ctx=st.integers(1, 8000), extra=st.integers(0, 8000), k=st.integers(1, 300),
       coefs=st.lists(st.floats(0, 1e-2, allow_subnormal=False), min_size=6, max_size=6))
@settings(max_examples=60, deadline=None, derandomize=True)
def test_vectorised_decode_prices_equal_the_scalar_bit_for_bit(n, ctx, extra, k, coefs):
    first = StepFeatures(n, n, 0, 0, n, 0, n * ctx + extra, 0, ctx + 1)
    models = [LinearCostModel(*coefs), *ROOFLINES]
    for cm in models:
        got = cm.decode_step_times(first, k)
        want = [cm.step_time(decode_features(first, m)) for m in range(k)]
        assert [x.hex() for x in got] == [x.hex() for x in want], type(cm).__name__
        assert all(type(x) is float for x in got)


ROOFLINES = list(roofline_models())


def test_executor_decode_run_matches_execute():
    """CostModelExecutor.forecast_decodes prices the batches execute() would see, vectorised or per step."""
    from sim.fit import OpGroupCost

    for cm in (ROOFLINES[0], OpGroupCost(ROOFLINES[0], ("linear", "attention_decode"))):
        ex = CostModelExecutor(cm)
        first = StepFeatures(3, 3, 0, 0, 3, 0, 900, 0, 400)
        run_ = ex.forecast_decodes(first, 40)
        assert run_.token == ex.token_id
        assert list(run_.durations) == [cm.step_time(decode_features(first, m)) for m in range(40)]


# ---- the heap clock orders events as SimPy --------------------------------------------------------------------


@pytest.mark.parametrize("replicas", [1, 3])
def test_heap_clock_matches_simpy(replicas):
    reqs = [Request(f"r{i}", round(0.013 * (i // 2), 3), 10 + i % 7 * 13, 5 + i % 5 * 17) for i in range(40)]
    results = [outcome(run_virtual(loop_for(reqs, replicas=replicas, num_blocks=60, fast_forward=ff), clock=clk))
               for ff, clk in ((False, "simpy"), (False, "heap"), (True, "simpy"), (True, "heap"))]
    assert all(r == results[0] for r in results)


def test_memory_per_output_token_is_its_time_alone():
    """A finished run keeps about 8 bytes a token (its time; the simulator's ids compact to one RepeatedTokens)
    plus a few bytes a fast-forwarded step (its place in the step log, end time and duration, not a row of values):
    about 14 bytes per extra output token at 16 decodes a step, where ids, times and step rows took 28."""
    import gc
    import tracemalloc

    def retained(out: int) -> tuple[int, int]:
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        res = run_virtual(loop_for(decode_heavy(n=16, out=out), num_blocks=4000))
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        assert all(type(s.output_token_ids).__name__ == "RepeatedTokens" for s in res.states)
        return used, sum(s.num_output_tokens for s in res.states)

    small, large = retained(100), retained(900)
    per_token = (large[0] - small[0]) / (large[1] - small[1])
    assert per_token < 16, per_token


def test_compact_keeps_the_outputs():
    """RequestState.compact: ids all one token become a RepeatedTokens equal to the list (len, index, slice,
    iteration); any other ids stay as they are."""
    from core.request import RepeatedTokens, RequestState

    s = RequestState(Request("a", 0.0, 4, 10))
    s.add_tokens([7, 7, 7], [0.5, 0.75, 1.0])
    s.compact()
    out = s.output_token_ids
    assert isinstance(out, RepeatedTokens) and out == [7, 7, 7] and out != [7, 7]
    assert [7, 7, 7] == out  # noqa: SIM300 - the list on the left: its __eq__ defers to RepeatedTokens
    assert len(out) == s.num_output_tokens == 3 and out[-1] == 7 and out[1:] == [7, 7] and list(out) == [7, 7, 7]
    assert s.num_tokens == 7
    mixed = RequestState(Request("b", 0.0, 4, 10))
    mixed.add_tokens([1, 2], 0.5)
    mixed.compact()
    assert mixed.output_token_ids == [1, 2] and type(mixed.output_token_ids) is list
