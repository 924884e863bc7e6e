"""Calibration: profile shapes are the batches they claim to be, a fit recovers a known linear cost model from its
own (synthetic) timings and from a run's steps.csv, the written file composes as `cost_model=calibrated`, and the
engine profile runs on the real tiny model."""

import json
import time

import numpy as np
import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from core.batch import StepFeatures
from experiments.build import CONF_DIR, build_executors, build_replicas, engine_clock, model_spec
from experiments.calibrate import Shape, calibrate, grid_shapes, profile, read_profile
from experiments.runs import run
from sim.cost.linear import LinearCostModel

TRUE = {"c0_s": 2e-3, "per_prefill_token_s": 5e-5, "per_decode_seq_s": 3e-4, "per_attention_pair_s": 2e-8,
        "per_kv_token_read_s": 1e-6}
SMALL_GRID = ["calibrate.grid.prefill_lens=[16,64,200]", "calibrate.grid.prefill_cached=[0,100]",
              "calibrate.grid.decode_batch_sizes=[1,3,8]", "calibrate.grid.decode_contexts=[20,150]",
              "calibrate.grid.mixed_chunks=[32]", "calibrate.grid.mixed_decodes=[2]", "calibrate.grid.mixed_context=64"]


def cfg_with(*overrides, name="calibrate"):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose(name, overrides=list(overrides))


def sim_cfg(*overrides):
    """The calibrate config on the simulator whose cost model is the known linear model TRUE."""
    return cfg_with("backend=sim", "cost_model=linear", *[f"cost_model.{k}={v}" for k, v in TRUE.items()],
                    "calibrate.repeats=1", "calibrate.warmup=0", "calibrate.plot=false", *SMALL_GRID, *overrides)


def test_grid_shapes_are_the_grid():
    shapes = grid_shapes({"prefill_lens": [8, 64], "prefill_cached": [0, 32], "decode_batch_sizes": [1, 4],
                          "decode_contexts": [10, 100], "mixed_chunks": [16], "mixed_decodes": [3],
                          "mixed_context": 50}, max_model_len=2048)
    assert [s.group for s in shapes].count("prefill") == 4 and [s.group for s in shapes].count("decode") == 4
    mixed = [s for s in shapes if s.group == "mixed"]
    assert mixed == [Shape("mixed", "n=16,c=50,b=3,ctx=50", prefills=((50, 16),), decodes=(50, 50, 50))]
    assert Shape("decode", "", decodes=(100,) * 4).blocks(16) == 4 * 7


@pytest.mark.parametrize("grid,message", [
    ({"prefill_len": [8]}, "unknown keys"),
    ({"prefill_lens": [0]}, "prefill_lens"),
    ({"decode_batch_sizes": [2], "decode_contexts": [1]}, "decode_contexts"),
    ({"prefill_lens": [4000]}, "max_model_len"),
    ({"mixed_context": [8, 9]}, "mixed_context"),
    ({}, "no shapes"),
])
def test_bad_grid_is_a_clear_error(grid, message):
    with pytest.raises(ValueError, match=message):
        grid_shapes(grid, max_model_len=2048)


def test_profiled_batches_have_the_shapes_features():
    """Features of the batches the profile built against the KV manager equal those computed by hand."""
    shapes = [Shape("prefill", "a", prefills=((100, 30),)), Shape("decode", "b", decodes=(20, 20, 20)),
              Shape("mixed", "c", prefills=((64, 32),), decodes=(64, 64))]
    rows = profile(sim_cfg(), shapes, repeats=2, warmup=1)
    pairs_a = 30 * 100 + 30 * 31 // 2
    assert rows[0].features == StepFeatures(num_seqs=1, num_batched_tokens=30, num_prefill_seqs=1,
                                            num_prefill_tokens=30, attention_pairs=pairs_a, prefill_kv_tokens=130,
                                            max_context_len=130)
    assert rows[1].features == StepFeatures(num_seqs=3, num_batched_tokens=3, num_decode_seqs=3, kv_tokens_read=60,
                                            max_context_len=20)
    f = rows[2].features
    assert (f.num_prefill_tokens, f.num_decode_seqs, f.kv_tokens_read, f.attention_pairs) == (
        32, 2, 128, 32 * 64 + 32 * 33 // 2)
    truth = LinearCostModel(**TRUE)
    for r in rows:
        assert len(r.samples) == 2 and r.median_s == pytest.approx(truth.step_time(r.features))


def test_profile_fit_recovers_a_known_linear_model(tmp_path):
    cal = calibrate(sim_cfg(), tmp_path)
    fitted = yaml.safe_load((tmp_path / "linear.yaml").read_text())
    for k, v in TRUE.items():
        assert fitted[k] == pytest.approx(v, rel=1e-6), k
    assert cal.reports["linear"].r2 == pytest.approx(1.0)
    report = json.loads((tmp_path / "fit_report.json").read_text())
    assert report["linear"]["max_rel_error"] < 1e-6 and report["linear_cv"]["max_rel_error"] < 1e-6
    assert set(report["linear"]["groups"]) == {"prefill", "decode", "mixed"}
    assert report["roofline"]["r2"] is not None
    assert len(read_profile(tmp_path / "profile.csv")[0]) == 6 + 6 + 1


def test_fit_from_a_runs_steps_and_profile_reuse(tmp_path):
    """A simulated run's steps.csv (timed by TRUE) alone recovers TRUE; a reused profile.csv gives the same fit."""
    run(cfg_with("backend=sim", "cost_model=linear", *[f"cost_model.{k}={v}" for k, v in TRUE.items()],
                 "workload.num_requests=30", "output.plots=false", name="config"), tmp_path / "run")
    calibrate(sim_cfg("calibrate.profile=false", f"calibrate.steps=[{tmp_path / 'run'}]",
                      "calibrate.fits=[linear]"), tmp_path / "from_run")
    fitted = yaml.safe_load((tmp_path / "from_run" / "linear.yaml").read_text())
    for k, v in TRUE.items():
        assert fitted[k] == pytest.approx(v, rel=1e-6), k
    calibrate(sim_cfg("calibrate.fits=[linear]"), tmp_path / "first")
    calibrate(sim_cfg("calibrate.fits=[linear]", "calibrate.profile=false",
                      f"calibrate.profile_from={tmp_path / 'first' / 'profile.csv'}"), tmp_path / "again")
    assert (tmp_path / "first" / "linear.yaml").read_text().split("\n", 3)[3] == \
        (tmp_path / "again" / "linear.yaml").read_text().split("\n", 3)[3]


def test_calibration_file_is_a_cost_model_option(tmp_path):
    calibrate(sim_cfg("calibrate.fits=[linear,roofline]"), tmp_path)
    for fit in ("linear", "roofline"):
        cfg = cfg_with("cost_model=calibrated", f"cost_model.path={tmp_path / (fit + '.yaml')}", name="config")
        model = instantiate(cfg.cost_model)
        assert model.step_time(StepFeatures(num_seqs=1, num_batched_tokens=1, num_decode_seqs=1,
                                            kv_tokens_read=100)) > 0
    cfg = cfg_with("cost_model=calibrated", f"cost_model.path={tmp_path / 'linear.yaml'}", "workload.num_requests=8",
                   "output.plots=false", name="config")
    assert run(cfg, tmp_path / "run")["num_completed"] == 8


@pytest.mark.parametrize("override,message", [
    ("calibrate.fits=[nope]", "calibrate.fits"),
    ("calibrate.profile_weight=-1", "profile_weight"),
    ("calibrate.repeats=0", "repeats"),
])
def test_bad_calibrate_options_fail_naming_the_key(tmp_path, override, message):
    with pytest.raises(ValueError, match=message):
        calibrate(sim_cfg(override), tmp_path)


def test_nothing_to_fit_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="nothing to fit"):
        calibrate(sim_cfg("calibrate.profile=false"), tmp_path)
    with pytest.raises(ValueError, match="no steps.csv"):
        calibrate(sim_cfg("calibrate.profile=false", f"calibrate.steps=[{tmp_path / 'missing'}]"), tmp_path)


def test_engine_clock_choice():
    assert engine_clock(cfg_with()) == "thread"  # CPU engine on one thread
    assert engine_clock(cfg_with("backend.num_threads=2")) == "wall"
    assert engine_clock(cfg_with("engine_clock=wall")) == "wall"
    with pytest.raises(ValueError, match="engine_clock=thread needs"):
        engine_clock(cfg_with("engine_clock=thread", "backend.num_threads=2"))
    with pytest.raises(ValueError, match="engine_clock='sundial'"):
        engine_clock(cfg_with("engine_clock=sundial"))


def test_engine_profile_on_the_tiny_model(tmp_path):
    """The real engine times a few shapes (thread CPU clock); the fit and its files come out."""
    cfg = cfg_with("calibrate.repeats=2", "calibrate.warmup=1", "calibrate.grid.prefill_lens=[16,128]",
                   "calibrate.grid.prefill_cached=[0]", "calibrate.grid.decode_batch_sizes=[1,4]",
                   "calibrate.grid.decode_contexts=[64]", "calibrate.grid.mixed_chunks=[32]",
                   "calibrate.grid.mixed_decodes=[2]", "calibrate.fits=[linear]")
    cal = calibrate(cfg, tmp_path)
    assert len(cal.features) == 5 and np.all(cal.durations > 0)
    assert (tmp_path / "calibration_scatter.png").stat().st_size > 10_000
    report = json.loads((tmp_path / "fit_report.json").read_text())
    assert report["engine_clock"] == "thread" and report["backend"] == "engine"
    small = OmegaConf.merge(cfg, {"kv": {"num_blocks": 8}})
    spec = model_spec(small)
    assert build_executors(small, spec, build_replicas(small, spec, 8))[0].stopwatch is time.thread_time
