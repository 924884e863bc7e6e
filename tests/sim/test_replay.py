"""Replay: a simulation driven by a run's recorded step durations reproduces that run exactly (logic error 0),
and a logic difference is reported at the first step where the batches differ."""

from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from core.batch import StepFeatures
from core.interfaces import BaseExecutor, StepOutput
from core.output import read_step_features
from experiments.build import CONF_DIR
from experiments.run import replay, run
from sim.replay import RecordedStep, ReplayDivergence, ReplayExecutor, load_recording, replay_executors

FILES = ("requests.csv", "tokens.csv", "steps.csv")


def cfg_with(*overrides, name="config"):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose(name, overrides=["output.plots=false", *overrides])


class JitteryExecutor(BaseExecutor):
    """Cost model A: a linear step time times lognormal noise from a seeded stream (no two steps alike)."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def execute(self, batch):
        f = batch.features
        base = 2e-3 + 4e-5 * f.num_prefill_tokens + 3e-4 * f.num_decode_seqs + 1e-6 * f.kv_tokens_read
        return StepOutput([7] * sum(ch.samples for ch in batch.chunks), float(base * self.rng.lognormal(0.0, 0.3)))


def record(cfg, out: Path):
    return run(cfg, out, lambda reps: [JitteryExecutor(i) for i in range(len(reps))], "sim")


CASES = {
    "sarathi": ["workload.num_requests=30"],
    "two_replicas_shared_prefix": ["workload=shared_prefix", "workload.num_requests=30", "replicas=2",
                                   "router=least_outstanding"],
    "small_pool_preemptions": ["workload.num_requests=30", "kv.num_blocks=20", "workload.prompt_len.max=150",
                               "workload.arrival.rate_rps=100"],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_replay_reproduces_the_recorded_run_byte_for_byte(tmp_path, case):
    cfg = cfg_with(*CASES[case])
    record(cfg, tmp_path / "a")
    replay(cfg, tmp_path / "a", tmp_path / "b")
    for name in FILES:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    _, durations, _ = read_step_features(tmp_path / "a" / "steps.csv")
    assert len(set(durations.tolist())) > 0.9 * len(durations)  # the recording really is jittery


def test_small_pool_case_really_preempts(tmp_path):
    """The preemption case exercises recompute: some request was preempted (else it tests less than it says)."""
    cfg = cfg_with(*CASES["small_pool_preemptions"])
    record(cfg, tmp_path)
    from core.output import read_requests_csv

    assert read_requests_csv(tmp_path / "requests.csv")["num_preemptions"].sum() > 0


def test_a_different_budget_diverges_at_the_first_step_it_binds(tmp_path):
    """Recorded with a 512-token budget, replayed with 256: every step before the first one that ran more than 256
    tokens is the same, so the replay must stop exactly there, naming recorded vs replayed features."""
    cfg = cfg_with("workload.num_requests=30", "workload.prompt_len.mean=300")
    record(cfg, tmp_path / "a")
    features, _, _ = read_step_features(tmp_path / "a" / "steps.csv")
    first = next(i for i, f in enumerate(features) if f.num_batched_tokens > 256)
    with pytest.raises(ReplayDivergence, match=rf"replica 0 step {first}: .*num_batched_tokens: recorded "
                                               rf"{features[first].num_batched_tokens}, replayed 256"):
        replay(cfg_with("workload.num_requests=30", "workload.prompt_len.mean=300",
                        "scheduler.max_num_batched_tokens=256"), tmp_path / "a", tmp_path / "b")


def test_executor_checks_features_and_length():
    f1 = StepFeatures(num_seqs=1, num_batched_tokens=1, num_decode_seqs=1, kv_tokens_read=5, max_context_len=5)
    ex = ReplayExecutor([RecordedStep(f1, 0.25)], replica=3)

    class B:
        features = f1
        chunks = []

    assert ex.execute(B()).duration_s == 0.25
    with pytest.raises(ReplayDivergence, match="replica 3 step 1: the replay runs a step the recording does not"):
        ex.execute(B())
    left = ReplayExecutor([RecordedStep(f1, 0.25)] * 2, replica=1)
    left.execute(B())
    with pytest.raises(ReplayDivergence, match="replica 1: replay ended after 1 steps, the recording has 2"):
        left.finish()


def test_recording_is_read_per_replica_in_order(tmp_path):
    cfg = cfg_with(*CASES["two_replicas_shared_prefix"])
    record(cfg, tmp_path)
    rec = load_recording(tmp_path)
    features, durations, replicas = read_step_features(tmp_path / "steps.csv")
    for r in (0, 1):
        rows = [(f, d) for f, d, k in zip(features, durations.tolist(), replicas.tolist(), strict=True) if k == r]
        assert [(s.features, s.duration_s) for s in rec[r]] == rows
    with pytest.raises(ReplayDivergence, match=r"replicas \[1\], the config has 1"):
        replay_executors(tmp_path, 1)
    with pytest.raises(ValueError, match="no steps.csv"):
        load_recording(tmp_path / "nope")


def test_engine_run_replays_byte_for_byte(tmp_path):
    """The real engine (tiny model, a handful of short requests): the simulator fed its measured step times
    reproduces every timestamp of its requests.csv and tokens.csv."""
    from experiments.run import run

    cfg = cfg_with("workload.num_requests=6", "workload.prompt_len.mean=24", "workload.output_len.mean=6",
                   "kv.num_blocks=64", "workload.arrival.rate_rps=20", name="compare")
    metrics = run(cfg, tmp_path / "engine")
    assert metrics["backend"] == "engine" and metrics["num_completed"] == 6
    replay(cfg, tmp_path / "engine", tmp_path / "replay")
    for name in FILES:
        assert (tmp_path / "engine" / name).read_bytes() == (tmp_path / "replay" / name).read_bytes(), name
