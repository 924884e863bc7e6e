"""The run entry point through Hydra's compose API: every config option composes, runs write the output
contract, runs are reproducible byte for byte, and bad configs fail at start naming the key."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from core.output import read_metrics, read_timing
from experiments.build import CONF_DIR
from experiments.run import run
from tests.helpers import parsed

GROUPS = ("scheduler", "eviction", "router", "workload", "slo", "model", "hardware", "cost_model", "backend")


def cfg_with(*overrides):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def options(group):
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


@pytest.mark.parametrize("group", GROUPS)
def test_every_option_composes(group):
    for name in options(group):
        cfg = cfg_with(f"{group}={name}")
        OmegaConf.to_container(cfg[group], resolve=True)


SMALL = ["workload.num_requests=12", "output.plots=false"]


def test_sim_run_writes_the_output_contract(tmp_path):
    metrics = run(cfg_with(*SMALL), tmp_path)
    for name in ("requests.csv", "tokens.csv", "steps.csv", "metrics.json"):
        assert (tmp_path / name).stat().st_size > 0
    header = (tmp_path / "requests.csv").read_text().splitlines()[0].split(",")
    assert header[:16] == ["id", "replica", "tenant", "arrival_s", "first_scheduled_s", "first_token_s", "finish_s",
                           "prompt_tokens", "output_tokens", "cached_tokens", "num_preemptions", "status", "ttft_s",
                           "tpot_s", "e2e_s", "max_stall_s"]
    for key in ("num_requests", "num_completed", "num_rejected", "num_timed_out", "duration_s", "percentile_method",
                "goodput_rps", "slo_attainment", "throughput_tok_s", "request_hit_rate", "token_reuse_rate",
                "prefill_work_saved"):
        assert key in metrics
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s", "max_stall_s", "queue_s"):
        assert {"mean", "p50", "p90", "p99", "max"} <= set(metrics[key])
    assert metrics["num_completed"] == metrics["num_requests"] == 12


@pytest.mark.parametrize("extra", [[], ["workload=shared_prefix", "replicas=2", "router=round_robin"]])
def test_same_seed_same_bytes(tmp_path, extra):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        run(cfg_with(*SMALL, "seed=3", *extra), d)
    for name in ("requests.csv", "tokens.csv", "steps.csv", "metrics.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    # wall-clock facts live apart, in timing.json; metrics.json says the run is complete
    assert "wall_s" not in (a / "metrics.json").read_text()
    assert read_timing(a)["wall_s"] > 0 and read_timing(a)["sim_s_per_wall_s"] > 0
    assert read_metrics(a / "metrics.json")["run_status"] == "complete"


def test_an_interrupted_run_says_so_and_keeps_partial_files(tmp_path, monkeypatch):
    """Ctrl-C in the middle of a run: the requests that ended are kept as .partial files, metrics.json says
    interrupted, and no file named requests.csv claims a complete run (not even the previous run's)."""
    run(cfg_with(*SMALL), tmp_path)  # a complete earlier run in the same directory
    from core.loop import ServingLoop

    original, calls = ServingLoop._terminal, []

    def stop_after_five(self, state, now):
        original(self, state, now)
        calls.append(state.id)
        if len(calls) == 5:
            raise KeyboardInterrupt

    monkeypatch.setattr(ServingLoop, "_terminal", stop_after_five)
    with pytest.raises(KeyboardInterrupt):
        run(cfg_with(*SMALL), tmp_path)
    names = {p.name for p in tmp_path.iterdir()}
    assert not names & {"requests.csv", "tokens.csv", "steps.csv"}
    assert {"requests.csv.partial", "tokens.csv.partial", "steps.csv.partial", "metrics.json"} <= names
    m = read_metrics(tmp_path / "metrics.json")
    assert m["run_status"] == "interrupted" and "KeyboardInterrupt" in m["error"]
    assert m["num_requests"] == 5 and m["num_unfinished"] >= 1  # arrived, not ended when it stopped
    assert len((tmp_path / "requests.csv.partial").read_text().splitlines()) == 1 + 5
    assert not [n for n in names if n.startswith(".writing-")]


def test_plots_are_written(tmp_path):
    run(cfg_with("workload.num_requests=8"), tmp_path)
    for name in ("latency_cdfs.png", "step_timeline.png"):
        assert (tmp_path / name).stat().st_size > 10_000


@pytest.mark.parametrize("override,message", [
    ("scheduler._target_=policies.schedulers.nope.Nope", "scheduler._target_"),
    ("workload.arrival.rate_rps=-1", "rate_rps"),
    ("replicas=0", "replicas"),
    ("kv.block_size=0", "block_size"),
    ("model.num_kv_heads=3", "num_kv_heads"),
    ("scheduler.max_num_batched_tokens=1.5", "max_num_batched_tokens"),
    ("request_timeout_s=abc", "request_timeout_s"),
    ("cost_model=calibrated", "cost_model"),
    ("kv.memory_bytes=-5", "kv.memory_bytes=-5.0"),
    ("kv.memory_fraction=5", "kv.memory_fraction=5"),
    ("kv.memory_fraction=0.0000001", "kv.memory_fraction=1e-07: model tiny .* does not fit"),
    ("metrics.prompt_len_edges=[512,256]", r"metrics.prompt_len_edges=\[512, 256\]"),
    ("metrics.prefix_cost=[1]", r"metrics.prefix_cost=\[1.0\]"),
    ("metrics.percentile_method=mean", "metrics.percentile_method"),
    ("metrics.latency_from=client", "metrics.latency_from"),
    ("output.progress=maybe", "output.progress='maybe'"),
    ("workload.warmup_requests=12", "workload.warmup_requests=12: not below workload.num_requests=12"),
    ("backend=engine", None),
])
def test_bad_config_fails_naming_the_key(tmp_path, override, message):
    if message is None:  # engine option errors, on a valid engine config
        for bad, key in (("backend.kernels=fast", "backend.kernels"), ("quant.weight_bits=8", "quant.weight_bits"),
                         ("quant.weight_bits=4", "quant.group_size")):
            extra = ["quant.group_size=100"] if key == "quant.group_size" else []
            with pytest.raises(ValueError, match=key):
                run(cfg_with(*SMALL, override, bad, *extra), tmp_path)
        return
    with pytest.raises(ValueError, match=message):
        run(cfg_with(*SMALL, override, *(["cost_model.path=/nope.yaml"] if "calibrated" in override else [])),
            tmp_path)


@pytest.mark.parametrize("scheduler", ["orca", "static"])
def test_scheduler_reserve_must_be_a_bool(tmp_path, scheduler):
    with pytest.raises(ValueError, match="scheduler.reserve='maybe'; allowed: true or false"):
        run(cfg_with(*SMALL, f"scheduler={scheduler}", "scheduler.reserve=maybe"), tmp_path)


def test_a_run_of_only_warmup_requests_is_refused(tmp_path):
    """A workload that cannot tell its request count up front (a time bound): refused once the run shows it."""
    with pytest.raises(ValueError, match="workload.warmup_requests=1000: all .* requests of the run are warmup"):
        run(cfg_with(*SMALL, "workload.num_requests=null", "workload.duration_s=2", "workload.warmup_requests=1000"),
            tmp_path)
    assert not (tmp_path / "metrics.json").exists()


def test_cli_user_error_is_one_line_naming_the_key(tmp_path):
    """The command line: one line on stderr and exit code 2; HYDRA_FULL_ERROR=1 gives the traceback."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "experiments.run", "kv.memory_bytes=-5", f"hydra.run.dir={tmp_path}"]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    short = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert short.returncode == 2
    assert short.stderr.strip().splitlines() == ["error: kv.memory_bytes=-5.0; allowed: a finite number > 0"]
    full = subprocess.run(cmd, cwd=root, env={**env, "HYDRA_FULL_ERROR": "1"}, capture_output=True, text=True,
                          timeout=120)
    assert full.returncode != 0 and "Traceback" in full.stderr and "kv.memory_bytes=-5.0" in full.stderr


@pytest.mark.parametrize("override,key", [("kv.prefix_caching=maybe", "kv.prefix_caching"),
                                          ("kv.memory_bytes=lots", "kv.memory_bytes"),
                                          ("metrics.prompt_len_edges=abc", "metrics.prompt_len_edges"),
                                          ("quant.kv_bits=four", "quant.kv_bits"),
                                          ("kv.blocksize=32", "kv.blocksize")])
def test_typed_sections_are_checked_by_hydra_at_composition(override, key):
    """kv, quant, metrics and output are structured configs (experiments.config): a value of the wrong type, or a
    key the section does not have, fails while the config is composed, naming the key."""
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as e:
        cfg_with(override)
    assert key in f"{e.value} {e.value.__cause__}"


def test_unknown_group_option_is_a_clear_error():
    with pytest.raises(Exception, match="scheduler"):
        cfg_with("scheduler=does_not_exist")


def test_checkpoint_directory_as_model_option(tmp_path):
    from experiments.cli import checkpoint_paths_to_overrides

    (tmp_path / "config.json").write_text("{}")
    path = f"model.path={Path(tmp_path).resolve()}"
    assert checkpoint_paths_to_overrides([f"model={tmp_path}"]) == ["model=checkpoint", path]
    assert checkpoint_paths_to_overrides([f"model.path={tmp_path}"]) == ["model=checkpoint", path]
    assert checkpoint_paths_to_overrides(["model=llama3_8b", f"model.path={tmp_path}"]) == ["model=llama3_8b", path]


@pytest.mark.parametrize("overrides,key", [
    (["kv.num_blocks=1000000000000"], "kv.num_blocks=1000000000000 with replicas=1"),
    (["replicas=1000000"], "kv.memory_fraction=.* with replicas=1000000"),
    (["kv.memory_bytes=1e17"], "kv.memory_bytes"),
    (["backend=engine", "model=tiny", "kv.num_blocks=1000000000"], "kv.num_blocks"),
])
def test_a_config_that_cannot_fit_is_refused_at_once(tmp_path, overrides, key):
    """Estimated before anything is built: seconds, not minutes followed by an out-of-memory kill."""
    import time

    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=f"{key}.*host memory.*lower kv"):
        run(cfg_with(*SMALL, *overrides), tmp_path)
    assert time.perf_counter() - t0 < 5
    assert not (tmp_path / "metrics.json").exists()


def test_memory_estimate_counts_blocks_replicas_and_engine_tensors():
    from core.resources import block_bookkeeping_bytes
    from experiments.build import check_memory
    from experiments.config import ClusterConfig

    four = ClusterConfig(num_replicas=4)
    cfg = parsed(cfg_with(*SMALL), num_kv_blocks=1_000_000, cluster=four)
    per_block = block_bookkeeping_bytes()
    check_memory(cfg, available=4 * 1_000_000 * per_block + 10**6)  # fits
    with pytest.raises(ValueError, match="replicas=4"):
        check_memory(cfg, available=3 * 1_000_000 * per_block)
    engine = parsed(cfg_with(*SMALL, "backend=engine", "model=tiny"), num_kv_blocks=10_000)
    with pytest.raises(ValueError, match="host memory"):  # the KV tensors count for the CPU engine
        check_memory(engine, available=10_000 * per_block + 10**6)


class RaisingScheduler:
    """Raises on its third step (a user plugin with a bug)."""

    def __init__(self) -> None:
        from policies.schedulers.sarathi import SarathiScheduler

        self.inner, self.steps = SarathiScheduler(), 0

    def schedule(self, view):
        self.steps += 1
        if self.steps == 3:
            raise ZeroDivisionError("my bug")
        return self.inner.schedule(view)


def test_an_error_a_scheduler_raises_names_it_in_metrics_json(tmp_path):
    """The error used to be the plugin's message alone ("ZeroDivisionError: my bug")."""
    with pytest.raises(ZeroDivisionError, match="my bug"):
        run(cfg_with(*SMALL, f"scheduler._target_={__name__}.RaisingScheduler"), tmp_path)
    m = read_metrics(tmp_path / "metrics.json")
    assert m["run_status"] == "interrupted"
    assert m["error"] == "ZeroDivisionError: my bug (raised by scheduler RaisingScheduler.schedule on replica 0)"
