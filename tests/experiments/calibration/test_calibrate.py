"""Calibration: profile shapes are the batches they claim to be (decodes advancing like a run's), the auto grid spans
the model and the scheduler, a fit recovers a known linear cost model from its own (synthetic) timings, from a
run's steps.csv, and from request-level files alone (a black box: the profile workloads, or any run), the written
file composes as `cost_model=calibrated`, and the engine profile runs on the real tiny model. Slow: the default grid
on the tiny engine, and calibration against `experiments.serving.serve` end to end on the wall clock."""

import contextlib
import json
import time

import numpy as np
import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from core.batch import StepFeatures
from experiments.build import CONF_DIR, build_executors, build_replicas
from experiments.calibration.calibrate import calibrate
from experiments.calibration.grid import Shape, config_grid, grid_plan, grid_shapes
from experiments.calibration.profiler import profile, read_profile
from experiments.calibration.samples import request_samples_from_run
from experiments.config import RunConfig
from experiments.run import run
from experiments.serving.server.process import ServerProcess
from sim.cost.linear import LinearCostModel
from sim.fit import fit_linear_requests
from tests.helpers import parsed

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
    rows = profile(RunConfig.from_config(sim_cfg()), shapes, repeats=2, warmup=1)
    pairs_a = 30 * 100 + 30 * 31 // 2
    assert rows[0].features == StepFeatures(num_seqs=1, num_batched_tokens=30, num_prefill_seqs=1,
                                            num_prefill_tokens=30, attention_pairs=pairs_a, prefill_kv_tokens=130,
                                            max_context_len=130)
    assert rows[1].features == StepFeatures(num_seqs=3, num_batched_tokens=3, num_decode_seqs=3, kv_tokens_read=60,
                                            max_context_len=20, max_decode_context=20, min_decode_context=20)
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
    def engine_clock(cfg):
        return RunConfig.from_config(cfg).engine_clock

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
    small = parsed(cfg, num_kv_blocks=8)
    assert build_executors(small, build_replicas(small))[0].stopwatch is time.thread_time


def grid_of(cfg):
    """``config_grid`` of a composed calibrate config."""
    return config_grid(RunConfig.from_config(cfg), cfg.calibrate.grid)


def test_auto_grid_spans_the_model_and_the_scheduler():
    """auto = the whole context range and batch sizes up to max_num_seqs; shapes beyond the KV pool are left out
    with a note, as are chunk + cached-context combinations beyond max_model_len."""
    cfg = cfg_with("kv.num_blocks=1024")
    shapes, notes, grid = grid_of(cfg)
    assert grid["prefill_lens"] == [8, 16, 32, 64, 128, 256, 512]  # up to the token budget
    assert grid["prefill_cached"] == [0, 128, 512, 1536]  # up to max_model_len - budget
    assert grid["decode_batch_sizes"] == [1, 2, 4, 8, 16, 32, 64]  # up to max_num_seqs
    assert grid["decode_contexts"] == [32, 128, 512, 2048]  # up to max_model_len
    labels = {s.label for s in shapes}
    assert {"n=512,c=1536", "b=1,ctx=2048", "b=8,ctx=2048", "b=64,ctx=128", "b=32,ctx=512"} <= labels
    skipped = {n.split(":")[0] for n in notes}
    assert skipped == {"decode b=16,ctx=2048", "decode b=32,ctx=2048", "decode b=64,ctx=512", "decode b=64,ctx=2048"}
    assert all(s.blocks(16) <= 1024 for s in shapes)
    assert len(shapes) + len(notes) == 7 * 4 + 7 * 4 + 3 * 2
    # another model and scheduler: the grid follows them
    _, _, grid = grid_of(cfg_with("model=llama3_8b", "hardware=h100", "scheduler.max_num_batched_tokens=2048",
                                  "scheduler.max_num_seqs=256", "backend=sim"))
    assert grid["prefill_lens"][-1] == 2048 and grid["decode_batch_sizes"][-1] == 256
    assert grid["decode_contexts"][-1] == 8192 and grid["prefill_cached"][-1] == 8192 - 2048
    # a combination beyond max_model_len is skipped; a single value beyond it is an error
    shapes, notes = grid_plan({"prefill_lens": [512], "prefill_cached": [0, 1800]}, max_model_len=2048)
    assert [s.label for s in shapes] == ["n=512,c=0"] and "max_model_len" in notes[0]
    with pytest.raises(ValueError, match="auto applies to"):
        grid_plan({"mixed_chunks": "auto"}, 2048, 512, 64)


def test_profiled_decodes_advance_like_a_run():
    """Each execution of a decode shape decodes one more token of the same sequences (as a run's consecutive
    steps do); the row's features are those of the median execution, at the shape's context."""
    rows = profile(RunConfig.from_config(sim_cfg()), [Shape("decode", "d", decodes=(100, 100))], repeats=3,
                   warmup=1)
    truth = LinearCostModel(**TRUE)
    assert rows[0].features == StepFeatures(num_seqs=2, num_batched_tokens=2, num_decode_seqs=2, kv_tokens_read=200,
                                            max_context_len=100, max_decode_context=100, min_decode_context=100)
    # the three timed executions at contexts 99, 100, 101 (hand-computed features)
    expected = [truth.step_time(StepFeatures(num_seqs=2, num_batched_tokens=2, num_decode_seqs=2,
                                             kv_tokens_read=2 * t, max_context_len=t)) for t in (99, 100, 101)]
    assert rows[0].samples == pytest.approx(expected)


KNOWN = {"c0_s": 3e-3, "per_prefill_token_s": 8e-5, "per_decode_seq_s": 4e-4, "per_attention_pair_s": 3e-8,
         "per_kv_token_read_s": 1.5e-6, "per_prefill_context_token_s": 2e-6}


def test_black_box_fit_recovers_a_known_model_from_request_level_runs(tmp_path):
    """The core check of calibrating against a server: simulated runs of the profile workloads with a known linear
    cost model, their steps.csv deleted, calibrated from requests.csv + tokens.csv alone."""
    known = [f"cost_model.{k}={v}" for k, v in KNOWN.items()]
    for w in ("profile_prefill", "profile_decode"):
        run(cfg_with("backend=sim", "cost_model=linear", *known, f"workload={w}", "output.plots=false",
                     name="config"), tmp_path / w)
        (tmp_path / w / "steps.csv").unlink()
    runs = f"calibrate.runs=[{tmp_path / 'profile_prefill'},{tmp_path / 'profile_decode'}]"
    cal = calibrate(cfg_with("backend=sim", runs, "calibrate.plot=false"), tmp_path / "cal")
    assert "profile" not in cal.paths  # profile: auto -> no profiling when runs are given
    fitted = yaml.safe_load((tmp_path / "cal" / "linear.yaml").read_text())
    for k, v in KNOWN.items():
        assert fitted[k] == pytest.approx(v, rel=0.02), k
    report = json.loads((tmp_path / "cal" / "fit_report.json").read_text())
    level = report["request_level"]
    assert level["request_overhead_s"] == pytest.approx(0.0, abs=1e-6)  # a simulated request has none
    assert level["num_samples"]["ttft"] >= 30 and level["num_samples"]["itl"] >= 1000
    assert level["prefill_chunk"] == 512 and report["linear"]["max_rel_error"] < 1e-6
    assert set(report["linear"]["groups"]) == {"request:ttft", "request:itl"}
    # the file is a cost model: a simulation with it reproduces the known model's run
    cfg = cfg_with("cost_model=calibrated", f"cost_model.path={tmp_path / 'cal' / 'linear.yaml'}",
                   "workload.num_requests=20", "output.plots=false", name="config")
    ref = cfg_with("backend=sim", "cost_model=linear", *known, "workload.num_requests=20", "output.plots=false",
                   name="config")
    a, b = run(cfg, tmp_path / "a"), run(ref, tmp_path / "b")
    assert a["ttft_s"]["p90"] == pytest.approx(b["ttft_s"]["p90"], rel=1e-6)
    assert a["tpot_s"]["p50"] == pytest.approx(b["tpot_s"]["p50"], rel=1e-6)


def test_request_level_runs_are_checked(tmp_path):
    with pytest.raises(ValueError, match="calibrate.runs: no requests.csv"):
        calibrate(cfg_with("backend=sim", f"calibrate.runs=[{tmp_path}]"), tmp_path / "cal")
    with pytest.raises(ValueError, match="calibrate.profile="):
        calibrate(cfg_with("backend=sim", "calibrate.profile=sometimes"), tmp_path / "cal")


@contextlib.contextmanager
def served(out, *overrides):
    """`python -m experiments.serve` in a subprocess on a free loopback port (SIGTERM at the end)."""
    server = ServerProcess(None, out, *overrides)
    try:
        yield server.url
    finally:
        server.stop()


HELD_OUT = ["workload=poisson", "workload.num_requests=40", "workload.arrival.rate_rps=2", "workload.seed=5",
            "workload.prompt_len={kind:lognormal,mean:512,sigma:0.6,min:32,max:1900}",
            "workload.output_len={kind:lognormal,mean:48,sigma:0.5,min:8,max:128}"]


@pytest.mark.slow
def test_black_box_calibration_against_a_served_simulator(tmp_path):
    """End to end on the wall clock: a server with known speed (`experiments.serving.serve backend=sim`, the default
    linear cost model), the profile workloads through `experiments.serving.loadgen`, `calibrate.runs`, then a held-out
    long-prompt workload against the same server and in the simulator with the calibration: p50/p90 TTFT and TPOT
    within 15% (measured here: within 4%)."""
    from experiments.calibration.compare import compare
    from experiments.serving.loadgen.run import run_loadgen

    lg = ["output.plots=false", "output.progress=false"]
    with served(tmp_path / "serve", "backend=sim") as url:
        for w in ("profile_prefill", "profile_decode"):
            m = run_loadgen(cfg_with(f"workload={w}", f"target.url={url}", *lg, name="loadgen"), tmp_path / w)
            assert m["num_completed"] == m["num_requests"] > 0
        runs = f"calibrate.runs=[{tmp_path / 'profile_prefill'},{tmp_path / 'profile_decode'}]"
        calibrate(cfg_with("backend=sim", runs, "calibrate.plot=false"), tmp_path / "cal")
        measured = run_loadgen(cfg_with(*HELD_OUT, f"target.url={url}", *lg, name="loadgen"), tmp_path / "server")
    fitted = yaml.safe_load((tmp_path / "cal" / "linear.yaml").read_text())
    served_model = yaml.safe_load((CONF_DIR / "cost_model" / "linear.yaml").read_text())
    # the big terms of the served model come back (the server adds its own per-step and per-token overheads)
    for k in ("per_prefill_token_s", "per_attention_pair_s"):
        assert fitted[k] == pytest.approx(served_model[k], rel=0.25), k
    assert served_model["c0_s"] <= fitted["c0_s"] <= served_model["c0_s"] + 3e-3
    # the held-out check as a user runs it: experiments.calibration.compare with the loadgen run as the measured side
    summary = compare(cfg_with(f"compare.measured={tmp_path / 'server'}",
                               f"compare.calibration={tmp_path / 'cal' / 'linear.yaml'}", "compare.rates=[]",
                               "kv.num_blocks=null", name="compare"), tmp_path / "compare")
    errors = {(r["metric"], r["percentile"]): r["rel_error"] for r in summary["errors"]}
    assert summary["metrics"]["measured"]["ttft_p50"] == measured["ttft_s"]["p50"]
    for key in [(m, p) for m in ("ttft_s", "tpot_s") for p in ("p50", "p90")]:
        assert abs(errors[key]) < 0.15, (key, errors)


@pytest.mark.slow
def test_default_grid_on_the_tiny_engine_finds_attention_and_kv_costs(tmp_path):
    """The default (auto) grid reaches 2048-token contexts and 64-sequence batches on the tiny CPU engine, where
    attention over a long cached context and reading a long KV cost measurably: both coefficients come out > 0."""
    cal = calibrate(cfg_with("calibrate.fits=[linear]", "calibrate.plot=false"), tmp_path)
    fitted = yaml.safe_load((tmp_path / "linear.yaml").read_text())
    assert fitted["per_attention_pair_s"] > 0 and fitted["per_kv_token_read_s"] > 0
    assert max(f.max_context_len for f in cal.features) >= 2000 and max(f.num_decode_seqs for f in cal.features) == 64


def test_request_level_fit_reads_any_run(tmp_path):
    """Not only the profiles: the isolated TTFTs and fixed-batch decode stretches of an ordinary Poisson run (long
    prompts, chunked prefills, mixed steps in between) recover the known model too."""
    known = [f"cost_model.{k}={v}" for k, v in KNOWN.items()]
    run(cfg_with("backend=sim", "cost_model=linear", *known, "workload.num_requests=200", "workload.arrival.rate_rps=4",
                 "workload.prompt_len.max=1500", "output.plots=false", name="config"), tmp_path / "run")
    samples = request_samples_from_run(tmp_path / "run", prefill_chunk=512)
    assert {s.kind for s in samples} == {"ttft", "itl"}
    fit = fit_linear_requests(samples)
    for k, v in KNOWN.items():
        assert getattr(fit.model, k) == pytest.approx(v, rel=1e-6), k
