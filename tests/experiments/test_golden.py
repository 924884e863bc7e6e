"""Result files against copies recorded from an earlier version (refactors must not change behaviour).

Simulator runs are compared byte for byte. Engine runs keep time with measured step durations, so their
timestamps differ from run to run; what must not change is everything else: the generated tokens
(outputs.jsonl), the batch of every step (steps.csv without start/duration) and each request's outcome
(requests.csv without its time columns). Each engine case sends all its requests within microseconds, so the
batches do not depend on how long a step took.

Re-record (only after a deliberate behaviour change): ``python -m tests.experiments.test_golden``.
"""

from __future__ import annotations

import csv
import io
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parent.parent / "data" / "golden"
NO_PLOTS = ["output.plots=false", "output.progress=false"]
SIM_CASES = {
    "sim_poisson_sarathi": ["workload.num_requests=40"],
    "sim_prefix_two_replicas": ["workload=shared_prefix", "workload.num_requests=40", "replicas=2",
                                "router=prefix_aware", "eviction=lfu", "scheduler=vllm_prefill_first",
                                "kv.num_blocks=96"],
    "sim_closed_loop_orca_timeouts": ["workload=closed_loop", "scheduler=orca", "request_timeout_s=0.25",
                                      "kv.num_blocks=40"],
    "sim_multi_turn_cost_based": ["workload=multi_turn", "replicas=3", "router=cost_based", "scheduler=lpm",
                                  "eviction=cost_aware", "kv.num_blocks=120", "cost_model=roofline",
                                  "hardware=a100", "model=llama3_8b"],
    "sim_gamma_priority_preempt": ["workload=gamma", "workload.num_requests=40", "scheduler=priority",
                                   "kv.num_blocks=24", "scheduler.max_num_batched_tokens=256"],
}
ENGINE_CASES = {
    "engine_burst_sarathi": ["backend=engine", "workload.num_requests=6", "workload.arrival.kind=fixed",
                             "workload.arrival.rate_rps=1000000", "scheduler.max_num_batched_tokens=128"],
    "engine_burst_prefix_preempt": ["backend=engine", "workload=shared_prefix", "workload.num_requests=6",
                                    "workload.arrival.kind=fixed", "workload.arrival.rate_rps=1000000",
                                    "kv.num_blocks=20", "replicas=2", "router=prefix_aware"],
}
SIM_FILES = ("requests.csv", "tokens.csv", "steps.csv")
ENGINE_FILES = ("outputs.jsonl", "requests.csv", "steps.csv")
TIME_COLUMNS = {"arrival_s", "first_scheduled_s", "first_token_s", "finish_s", "ttft_s", "tpot_s", "e2e_s",
                "max_stall_s", "start_s", "duration_s", "time_s"}


def _run(overrides: list[str], out: Path) -> None:
    from hydra import compose, initialize_config_dir

    from experiments.build import CONF_DIR
    from experiments.run import run

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, *NO_PLOTS])
    run(cfg, out)


def _untimed(text: str) -> str:
    """A CSV without its time columns (engine runs: those are measured), rows in replica order (replicas
    interleave by measured time; within one replica the order is the step order)."""
    header, *rows = list(csv.reader(io.StringIO(text)))
    keep = [i for i, name in enumerate(header) if name not in TIME_COLUMNS]
    if header[0] == "replica":
        rows.sort(key=lambda r: int(r[0]))
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows([[r[i] for i in keep] for r in [header, *rows]])
    return out.getvalue()


def _comparable(case: str, name: str, directory: Path) -> str:
    text = (directory / name).read_text()
    return _untimed(text) if case in ENGINE_CASES and name.endswith(".csv") else text


@pytest.mark.parametrize("case", sorted(SIM_CASES))
def test_sim_files_unchanged(case, tmp_path):
    _run(SIM_CASES[case], tmp_path)
    for name in SIM_FILES:
        assert (tmp_path / name).read_bytes() == (GOLDEN / case / name).read_bytes(), f"{case}/{name} changed"


@pytest.mark.parametrize("case", sorted(ENGINE_CASES))
def test_engine_outputs_and_batches_unchanged(case, tmp_path):
    _run(ENGINE_CASES[case], tmp_path)
    for name in ENGINE_FILES:
        assert _comparable(case, name, tmp_path) == _comparable(case, name, GOLDEN / case), f"{case}/{name} changed"


def record() -> None:
    for case, overrides in {**SIM_CASES, **ENGINE_CASES}.items():
        files = SIM_FILES if case in SIM_CASES else ENGINE_FILES
        with tempfile.TemporaryDirectory() as tmp:
            _run(overrides, Path(tmp))
            dest = GOLDEN / case
            shutil.rmtree(dest, ignore_errors=True)
            dest.mkdir(parents=True)
            for name in files:
                shutil.copy(Path(tmp) / name, dest / name)
        print(f"recorded {case}", file=sys.stderr)


if __name__ == "__main__":
    record()
