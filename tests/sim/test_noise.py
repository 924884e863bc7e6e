"""Step noise (sim.noise): the record's scales and standardised residuals by hand, the automatic block length on
processes with a known autocorrelation, the bootstrap's factors (mean 1 per kind, blocks of consecutive residuals,
seeded, the same however they are asked for), the executor counting steps through decode runs, bad records, and
the round trip: a simulated machine with known noise, calibrated from its steps, gives back that noise."""

from __future__ import annotations

import math

import numpy as np
import pytest
import yaml
from hydra import compose, initialize_config_dir
from hypothesis import given, settings
from hypothesis import strategies as st

from core.batch import Batch, Chunk, StepFeatures
from core.fast_forward import decode_features
from experiments.build import CONF_DIR, build_executors, build_replicas
from experiments.calibration.calibrate import calibrate
from experiments.calibration.draws import median_metrics
from experiments.run import run
from sim.cost.calibrated import calibrated_step_noise, load_calibration, write_calibration
from sim.cost.linear import LinearCostModel
from sim.executor import CostModelExecutor
from sim.noise import MIN_STEPS, StepNoise, auto_block_steps, record_step_noise
from tests.helpers import parsed

DECODE = StepFeatures(1, 1, 0, 0, 1, 0, 100, 0, 100, 0, 100, 100)
PREFILL = StepFeatures(1, 64, 1, 64, 0, 2080, 0, 64, 64)
MODEL = LinearCostModel(c0_s=2e-3, per_prefill_token_s=5e-5, per_decode_seq_s=3e-4, per_kv_token_read_s=1e-6)


def cfg_with(*overrides, name="config"):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose(name, overrides=list(overrides))


def ar1(phi: float, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    e = rng.standard_normal(n)
    x = np.empty(n)
    x[0] = e[0]
    for i in range(1, n):
        x[i] = phi * x[i - 1] + math.sqrt(1 - phi * phi) * e[i]
    return x


# ---- the record -------------------------------------------------------------------------------------------------
def test_record_scales_and_standardises_per_kind():
    """60 decodes (log-ratios alternating +-0.2) and 40 prefills (+-0.05 around 0.1): each kind's sd and its own
    standardisation; a kind with fewer than 10 steps takes the pooled mean and sd."""
    feats = [DECODE] * 60 + [PREFILL] * 40 + [StepFeatures(2, 33, 1, 32, 1, 528, 50, 32, 50)] * 3
    r = np.array([0.2, -0.2] * 30 + [0.15, 0.05] * 20 + [0.0, 0.3, 0.6])
    pred = np.full(len(r), 0.01)
    rec = record_step_noise(feats, pred * np.exp(r), pred, block_steps=1, source="run")
    assert rec["sigma"] == {"decode": pytest.approx(0.2), "prefill": pytest.approx(0.05)}  # mixed: 3 steps
    assert rec["sigma_all"] == pytest.approx(float(np.std(r)), abs=1e-5)
    z = np.array(rec["z"])
    assert z[:4] == pytest.approx([1, -1, 1, -1]) and z[60:62] == pytest.approx([1, -1])
    assert z[100:] == pytest.approx((r[100:] - r.mean()) / r.std(), abs=1e-4)
    assert rec["num_steps"] == 103 and rec["source"] == "run" and rec["block_steps"] == 1
    assert yaml.safe_load(yaml.safe_dump(rec)) == rec  # plain YAML types


def test_record_drops_unusable_steps_and_needs_enough():
    y = np.full(MIN_STEPS + 2, 0.01)
    y[3], y[7] = 0.0, np.nan
    assert record_step_noise([DECODE] * len(y), y, np.full(len(y), 0.01))["num_steps"] == MIN_STEPS
    assert record_step_noise([DECODE] * 10, np.ones(10), np.ones(10)) is None
    with pytest.raises(ValueError, match="noise_block_steps=0"):
        record_step_noise([DECODE] * 60, np.ones(60), np.ones(60), block_steps=0)
    with pytest.raises(ValueError, match="60 steps, 59 measured"):
        record_step_noise([DECODE] * 60, np.ones(59), np.ones(60))


@pytest.mark.parametrize("phi,lag", [(0.0, 1), (0.5, 5), (0.9, 33), (0.97, 113)])
def test_auto_block_is_where_the_autocorrelation_fades(phi, lag):
    """AR(1) with coefficient phi has autocorrelation phi^k: it falls below 2/sqrt(4000) = 0.032 at
    k = ln(0.032) / ln(phi): 1 for white noise, 5 for 0.5, 33 for 0.9, 113 for 0.97. The sample autocorrelation of
    a long-memory process is itself noisy (sd ~0.05 at phi 0.9), so the estimate is within a factor of 3."""
    assert lag / 3 <= auto_block_steps(ar1(phi, 4000)) <= lag * 3


def test_auto_block_limits():
    assert auto_block_steps(np.zeros(100)) == 1
    assert auto_block_steps(np.linspace(0, 1, 400)) == 50  # never fades: capped at n // 8


# ---- the factors ------------------------------------------------------------------------------------------------
def test_factors_have_mean_one_per_kind_and_follow_the_blocks():
    z = np.arange(20) / 10.0 - 1.0
    noise = StepNoise(z, {"decode": 0.3, "prefill": 0.1}, 0.2, block_steps=5, seed=7)
    for kind, s in (("decode", 0.3), ("prefill", 0.1), ("mixed", 0.2)):
        assert np.mean(np.exp(s * z)) / np.mean(np.exp(s * z)) == 1.0
        f = noise.factors(0, 5000, kind)
        zs = np.log(f * np.mean(np.exp(s * z))) / s  # back to the drawn z
        assert set(np.round(zs, 9)) <= set(np.round(z, 9))
        blocks = np.round(zs * 10 + 10).astype(int).reshape(-1, 5)  # pool indices, one row per block
        assert np.all((np.diff(blocks, axis=1) % 20) == 1)  # consecutive, wrapping around the pool
        assert f.mean() == pytest.approx(1.0, rel=0.02)
    d, p = noise.factors(0, 100, "decode"), noise.factors(0, 100, "prefill")
    assert np.allclose(np.log(d * np.mean(np.exp(0.3 * z))) / 0.3, np.log(p * np.mean(np.exp(0.1 * z))) / 0.1)


def test_zero_scale_gives_exactly_one():
    noise = StepNoise(np.random.default_rng(0).standard_normal(100), {"decode": 0.0}, 0.0, block_steps=3)
    assert np.all(noise.factors(0, 1000, "decode") == 1.0) and np.all(noise.factors(50, 10, "prefill") == 1.0)


@settings(max_examples=30, deadline=None)
@given(asks=st.lists(st.tuples(st.integers(0, 5000), st.integers(1, 700)), min_size=1, max_size=12),
       seed=st.integers(0, 2**16))
def test_factors_do_not_depend_on_how_they_are_asked_for(asks, seed):
    """Runs of steps asked for in order, with gaps (steps skipped: another kind's), equal one long run's."""
    z = ar1(0.8, 300, seed=1)
    end = sum(gap + n for gap, n in asks)
    whole = StepNoise(z, {"decode": 0.25}, 0.25, 9, seed=[seed, 0]).factors(0, end, "decode").copy()
    noise, at = StepNoise(z, {"decode": 0.25}, 0.25, 9, seed=[seed, 0]), 0
    for gap, n in asks:
        at += gap
        assert np.array_equal(noise.factors(at, n, "decode"), whole[at:at + n])
        at += n
    other = StepNoise(z, {"decode": 0.25}, 0.25, 9, seed=[seed, 1]).factors(0, end, "decode")
    assert end < 20 or not np.array_equal(other, whole)


@pytest.mark.parametrize("kwargs,message", [
    ({"z": []}, "non-empty"), ({"z": [0.0, math.inf]}, "finite"), ({"block_steps": 0}, "block_steps=0"),
    ({"block_steps": 4}, r"\[1, 3\]"), ({"sigma": {"decode": -0.1}}, ">= 0"), ({"sigma_all": "x"}, ">= 0")])
def test_bad_noise_is_a_clear_error(kwargs, message):
    args = {"z": [0.1, -0.1, 0.0], "sigma": {"decode": 0.2}, "sigma_all": 0.2, "block_steps": 1, **kwargs}
    with pytest.raises(ValueError, match=message):
        StepNoise(**args)
    with pytest.raises(ValueError, match="expected a mapping with z, sigma"):
        StepNoise.from_mapping({"z": [0.0]})


# ---- the executor -----------------------------------------------------------------------------------------------
def decode_batch(f: StepFeatures) -> Batch:
    """A batch of one decode whose features are ``f``'s (context f.max_context_len)."""
    b = Batch([Chunk(None, f.max_context_len - 1, 1, samples=True, is_decode=True)])
    assert b.features == f
    return b


def test_executor_counts_the_steps_a_decode_run_took():
    """Step by step, every step takes the next factor; a decode run prices ahead, and the steps after it continue
    from the ones it started (decodes_taken), not from the ones it priced."""
    z = ar1(0.5, 200)
    rec = {"z": z.tolist(), "sigma": {"decode": 0.3}, "sigma_all": 0.3, "block_steps": 4}
    first = decode_features(DECODE, 0)
    per_step = CostModelExecutor(MODEL, noise=StepNoise.from_mapping(rec, seed=3))
    expected = [per_step.execute(decode_batch(decode_features(first, m))).duration_s for m in range(30)]
    ex = CostModelExecutor(MODEL, noise=StepNoise.from_mapping(rec, seed=3))
    got = [ex.execute(decode_batch(first)).duration_s]
    run1 = ex.forecast_decodes(decode_features(first, 1), 8)
    run1_more = ex.forecast_decodes(decode_features(first, 9), 8)  # the run priced further ...
    got += [*run1.durations, *run1_more.durations][:12]  # ... and started 12 of its 16 steps
    ex.decodes_taken(12)
    ex.forecast_decodes(decode_features(first, 13), 5)  # priced, never begun: the next execute takes none of it
    got += [ex.execute(decode_batch(decode_features(first, m))).duration_s for m in range(13, 30)]
    assert got == expected
    plain = CostModelExecutor(MODEL)
    assert expected != [plain.execute(decode_batch(decode_features(first, m))).duration_s for m in range(30)]


# ---- calibration files and runs ----------------------------------------------------------------------------------
def noisy_file(path, sigma: float, phi: float, n: int = 3000):
    """A calibration file: MODEL plus step noise whose z is an AR(1) with coefficient phi."""
    rec = record_step_noise([DECODE] * n, np.exp(sigma * ar1(phi, n, seed=5)), np.ones(n))
    return write_calibration(path, MODEL, step_noise=rec)


def test_calibration_file_keeps_the_noise_out_of_the_cost_model(tmp_path):
    path = noisy_file(tmp_path / "noisy.yaml", 0.3, 0.9)
    assert load_calibration(path) == MODEL
    rec = calibrated_step_noise(path)
    assert rec["sigma"]["decode"] == pytest.approx(0.3, rel=0.1) and 20 <= rec["block_steps"] <= 60
    assert "Step noise" in path.read_text().split("_target_")[0]  # the header says what the section is
    assert calibrated_step_noise(write_calibration(tmp_path / "plain.yaml", MODEL)) is None


def test_noise_round_trip_through_a_simulated_machine(tmp_path):
    """A simulator with known noise (sigma 0.3, slow stretches: AR(1) 0.95) stands for a machine; calibrating from
    its steps recovers the cost model's coefficients (the noise has mean 1) and the noise's scale and stretch
    length; the noisy run's mean step time is the model's; without noise it is the plain model."""
    path = noisy_file(tmp_path / "machine.yaml", 0.3, 0.95)
    common = ["cost_model=calibrated", f"cost_model.path={path}", "workload.num_requests=300",
              "workload.arrival.rate_rps=8", "output.plots=false"]
    noisy = run(cfg_with(*common), tmp_path / "noisy")
    plain = run(cfg_with(*common, "backend.step_noise=false"), tmp_path / "plain")
    assert noisy["tpot_s"]["p50"] != plain["tpot_s"]["p50"]
    rerun = run(cfg_with(*common), tmp_path / "rerun")
    assert (tmp_path / "rerun" / "steps.csv").read_bytes() == (tmp_path / "noisy" / "steps.csv").read_bytes()
    assert rerun == noisy
    cal = calibrate(cfg_with("backend=sim", "calibrate.profile=false", f"calibrate.steps=[{tmp_path / 'noisy'}]",
                             "calibrate.fits=[linear]", "calibrate.plot=false", name="calibrate"), tmp_path / "cal")
    fitted = yaml.safe_load(cal.paths["linear"].read_text())
    assert fitted["c0_s"] == pytest.approx(MODEL.c0_s, rel=0.1)
    assert fitted["per_decode_seq_s"] + fitted["c0_s"] == pytest.approx(MODEL.per_decode_seq_s + MODEL.c0_s, rel=0.1)
    rec = fitted["step_noise"]
    assert rec["sigma"]["decode"] == pytest.approx(0.3, rel=0.15) and rec["block_steps"] >= 20
    off = calibrate(cfg_with("backend=sim", "calibrate.profile=false", f"calibrate.steps=[{tmp_path / 'noisy'}]",
                             "calibrate.fits=[linear]", "calibrate.plot=false", "calibrate.step_noise=false",
                             name="calibrate"), tmp_path / "off")
    assert calibrated_step_noise(off.paths["linear"]) is None


def test_median_metrics_by_hand():
    a = {"ttft_s": {"p50": 1.0, "p90": None}, "n": 2, "name": "x", "ok": True}
    b = {"ttft_s": {"p50": 3.0, "p90": 4.0}, "n": 4, "name": "y", "ok": False}
    c = {"ttft_s": {"p50": 2.5, "p90": 5.0}, "n": 40, "name": "z", "ok": True}
    assert median_metrics([a, b]) == {"ttft_s": {"p50": 2.0, "p90": None}, "n": 3.0, "name": "x", "ok": True}
    assert median_metrics([a, b, c]) == {"ttft_s": {"p50": 2.5, "p90": None}, "n": 4.0, "name": "x", "ok": True}


def test_a_bad_noise_section_names_the_file(tmp_path):
    path = noisy_file(tmp_path / "bad.yaml", 0.3, 0.5)
    text = path.read_text()
    path.write_text(text.replace(f"block_steps: {calibrated_step_noise(path)['block_steps']}\n", "block_steps: 0\n"))
    common = ["cost_model=calibrated", f"cost_model.path={path}", "workload.num_requests=5", "output.plots=false"]
    with pytest.raises(ValueError, match=r"bad.yaml'?: step noise: block_steps=0.*backend.step_noise=false"):
        run(cfg_with(*common), tmp_path / "run")
    assert run(cfg_with(*common, "backend.step_noise=false"), tmp_path / "off")["num_completed"] == 5


def test_a_long_run_keeps_only_recent_chunks():
    """Millions of steps keep a few chunks of draws: steps only move forward, so older ones are forgotten."""
    noise = StepNoise(ar1(0.5, 300), {"decode": 0.2}, 0.2, 3, seed=1)
    for step in range(0, 2_000_000, 997):
        noise.factors(step, 40, "decode")
        noise.factor(step, "prefill")
    assert len(noise._z) <= 2 and all(len(c) <= 2 for c in noise._factors.values())
    with pytest.raises(ValueError, match="was forgotten"):
        noise.factors(0, 1)


def test_each_replica_draws_its_own_noise(tmp_path):
    """Replicas are machines of their own: seeded [noise_seed, replica]; another noise_seed draws anew."""
    path = noisy_file(tmp_path / "noisy.yaml", 0.3, 0.9)

    def factors(*overrides):
        cfg = cfg_with("cost_model=calibrated", f"cost_model.path={path}", "replicas=2", *overrides)
        run = parsed(cfg, num_kv_blocks=64)
        return [ex.noise.factors(0, 200, "decode").copy() for ex in build_executors(run, build_replicas(run))]

    a, b = factors()
    assert not np.array_equal(a, b)
    assert np.array_equal(factors()[0], a) and not np.array_equal(factors("backend.noise_seed=1")[0], a)
