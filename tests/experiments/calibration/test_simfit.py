"""The simulation fit (experiments/calibration/simfit.py) and the fidelity report's spread rows: a 'measured' run
made by the simulator itself with known server terms is recovered from a base model without them."""

from __future__ import annotations

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from experiments.build import CONF_DIR
from experiments.calibration import simfit
from experiments.calibration.fidelity import markdown, spread_rows
from experiments.overrides import with_calibration
from experiments.run import run
from sim.cost.calibrated import load_calibration, write_calibration
from sim.cost.linear import LinearCostModel
from sim.cost.server import ServerCostModel, ServerTerms

BASE = LinearCostModel(c0_s=3e-3, per_prefill_token_s=1e-4, per_decode_seq_s=4e-4, per_kv_token_read_s=1e-7)


def cfg_with(*overrides):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("fidelity", overrides=["workload.num_requests=30", "workload.arrival.rate_rps=20",
                                              "output.plots=false", *overrides])


def test_fit_recovers_server_terms_of_a_simulated_server(tmp_path):
    cfg = cfg_with()
    truth = write_calibration(tmp_path / "truth.yaml", BASE, frontend_delay_s=0.004,
                              server_terms=ServerTerms(per_running_seq_s=6e-4, per_output_token_s=2e-4))
    measured = tmp_path / "measured"
    want = run(with_calibration(cfg, truth), measured)
    base = write_calibration(tmp_path / "base.yaml", BASE, frontend_delay_s=0.004)
    rep = simfit.fit(cfg, measured, base, tmp_path / "fit", {"params": ["per_running_seq_s", "decode_scale"],
                                                             "max_evals": 60})
    assert rep["loss_before"] > 0.01 and rep["loss_after"] < 0.02 * rep["loss_before"]
    assert isinstance(load_calibration(rep["path"]), ServerCostModel)
    got = simfit.simulate_measured(cfg, measured, rep["path"], tmp_path / "predict")
    for m in ("ttft_s", "tpot_s"):
        assert got[m]["p50"] == pytest.approx(want[m]["p50"], rel=0.05)


def test_measured_arrays_match_the_run_metrics(tmp_path):
    cfg = cfg_with()
    cal = write_calibration(tmp_path / "c.yaml", BASE)
    m = run(with_calibration(cfg, cal), tmp_path / "r")
    a = simfit.measured_arrays(tmp_path / "r")
    assert len(a["ttft"]) == m["num_completed"]
    assert np.median(a["tpot"]) == pytest.approx(m["tpot_s"]["p50"], rel=0.05)


def test_telemetry_gives_the_kv_pool(tmp_path):
    import json

    (tmp_path / "server_metrics.json").write_text(json.dumps({"summary": {"num_gpu_blocks": 1024,
                                                                          "block_size": 128}}))
    assert simfit.telemetry_overrides(tmp_path) == ["kv.block_size=128", "kv.num_blocks=1024",
                                                    "kv.memory_bytes=null"]
    assert simfit.telemetry_overrides(tmp_path / "none") == []


def test_spread_rows_by_hand():
    measured = [{"ttft_s": {"p50": 0.10}}, {"ttft_s": {"p50": 0.12}}, {"ttft_s": {"p50": 0.08}}]
    rows = spread_rows(measured, {"sim-fit": {"ttft_s": {"p50": 0.125}}, "base": {"ttft_s": {"p50": 0.09}}},
                       ["ttft_s"], [50], tolerance=0.1)
    (r,) = rows
    assert r["median"] == pytest.approx(0.10) and r["spread"] == pytest.approx(0.4)  # (0.12 - 0.08) / 0.10
    assert r["sim-fit"]["error"] == pytest.approx(0.25) and r["sim-fit"]["pass"]  # 25% < the 40% spread
    assert r["base"]["error"] == pytest.approx(-0.1) and r["base"]["pass"]
    strict = spread_rows(measured[:1], {"sim-fit": {"ttft_s": {"p50": 0.125}}}, ["ttft_s"], [50], 0.1)
    assert strict[0]["spread"] == 0 and not strict[0]["sim-fit"]["pass"]  # one round: the tolerance decides
    text = markdown({"held": {"train": "t", "rows": rows}}, ["sim-fit", "base"])
    assert "+25.0%" in text and "40.0%" in text


def test_calibrate_simulate_runs_writes_a_simulated_calibration(tmp_path):
    from experiments.calibration.calibrate import calibrate

    cfg = cfg_with()
    truth = write_calibration(tmp_path / "truth.yaml", BASE, server_terms=ServerTerms(per_running_seq_s=6e-4))
    plain = write_calibration(tmp_path / "plain.yaml", BASE)
    run(with_calibration(cfg, plain), tmp_path / "steps")  # its steps.csv: the base fit's data (BASE exactly)
    run(with_calibration(cfg, truth), tmp_path / "loaded")
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        ccfg = compose("calibrate", overrides=["workload.num_requests=30", "workload.arrival.rate_rps=20",
                                               "calibrate.profile=false", f"calibrate.steps=[{tmp_path / 'steps'}]",
                                               "calibrate.fits=[linear]", "calibrate.plot=false",
                                               f"calibrate.simulate_runs=[{tmp_path / 'loaded'}]",
                                               "calibrate.simulate.params=[per_running_seq_s]",
                                               "calibrate.simulate.max_evals=30", "calibrate.simulate.passes=1"])
    cal = calibrate(ccfg, tmp_path / "cal")
    got = load_calibration(cal.paths["simulated"])
    assert isinstance(got, ServerCostModel)
    assert got.terms.per_running_seq_s == pytest.approx(6e-4, rel=0.1)


def test_fitted_step_noise_widens_the_simulated_spread_and_keeps_the_mean(tmp_path):
    from sim.noise import StepNoise

    assert simfit.noise_record(0.0) is None
    rec = simfit.noise_record(0.4, block_steps=8, seed=3)
    f = StepNoise.from_mapping(rec, [0, 0]).factors(0, 4000, "decode")
    assert f.mean() == pytest.approx(1.0, abs=0.05) and f.std() > 0.3
    cfg = cfg_with()
    sim = simfit.Simulator(cfg, write_calibration(tmp_path / "b.yaml", BASE))
    quiet = simfit.state_arrays(sim.states(BASE, 0.0))["itl"]
    noisy = simfit.state_arrays(sim.states(BASE, 0.0, rec))["itl"]
    assert np.std(np.log(noisy)) > np.std(np.log(quiet)) + 0.1


def test_loss_weighs_each_quantile_by_the_measured_repeat_spread():
    q = np.array([1.0, 2.0])
    meas = {m: q for m in simfit.METRICS}
    sim = {m: q * np.array([np.e, 1.0]) for m in simfit.METRICS}  # log error 1 on the first quantile, 0 on the second
    n = 2 * len(simfit.METRICS)
    assert simfit.loss(sim, meas) == pytest.approx(len(simfit.METRICS) / n)
    sd = {m: np.array([0.3, 0.0]) for m in simfit.METRICS}  # the first quantile moved ~30% across rounds
    assert simfit.loss(sim, meas, sd) == pytest.approx(0.01 / (0.01 + 0.09) * len(simfit.METRICS) / n)
    assert simfit.loss(sim, meas, {m: np.zeros(2) for m in simfit.METRICS}) == simfit.loss(sim, meas)


def test_measured_quantiles_give_the_spread_of_repeats(tmp_path):
    cfg = cfg_with()
    cal = write_calibration(tmp_path / "c.yaml", BASE)
    run(with_calibration(cfg, cal), tmp_path / "a")
    med, sd = simfit.measured_quantiles([tmp_path / "a"])
    assert all((sd[m] == 0).all() for m in simfit.METRICS)  # one run: no spread, every weight 1
    med2, sd2 = simfit.measured_quantiles([tmp_path / "a", tmp_path / "a"])
    assert all(np.allclose(med[m], med2[m]) and (sd2[m] == 0).all() for m in simfit.METRICS)
