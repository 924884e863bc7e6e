"""Prediction bands (experiments/calibration/draws.py): the band of the step-noise draws by hand, rows marked inside
or outside it, bad band settings, and a constructed case end to end: a noisy calibration simulated over seeded
draws gives a band that holds every draw's median and each draw's own headline numbers at its ends."""

from __future__ import annotations

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from core.batch import StepFeatures
from experiments.build import CONF_DIR
from experiments.calibration.compare import errors_markdown, percentile_errors
from experiments.calibration.draws import band_percentiles, band_summary, draw_band, simulate_draws, with_band
from sim.cost.calibrated import write_calibration
from sim.cost.linear import LinearCostModel
from sim.noise import record_step_noise

MODEL = LinearCostModel(c0_s=2e-3, per_prefill_token_s=5e-5, per_decode_seq_s=3e-4, per_kv_token_read_s=1e-6)


def test_band_by_hand():
    runs = [{"ttft_s": {"p50": float(v), "p90": None if v == 3 else 2.0 * v}, "n": v} for v in range(1, 11)]
    band = draw_band(runs, (10, 90))
    # numpy's linear percentile of 1..10: position 0.1 x 9 = 0.9 -> 1.9, 0.9 x 9 = 8.1 -> 9.1
    assert band == {"ttft_s": {"p50": [pytest.approx(1.9), pytest.approx(9.1)]}}  # p90 is None in one draw
    assert draw_band(runs, (0, 100))["ttft_s"]["p50"] == [1.0, 10.0]


def test_rows_inside_and_outside_the_band():
    band = {"ttft_s": {"p50": [1.0, 2.0]}, "tpot_s": {"p90": [0.01, 0.02]}}
    rows = [{"metric": "ttft_s", "percentile": "p50", "engine": 2.0},  # an end counts as inside
            {"metric": "tpot_s", "percentile": "p90", "engine": 0.03},
            {"metric": "tpot_s", "percentile": "p50", "engine": 0.015},  # no band for this statistic
            {"metric": "ttft_s", "percentile": "p50", "engine": None}]
    out = with_band(rows, band)
    assert [r["in_band"] for r in out] == [True, False, None, None]
    assert out[1]["band_low"] == 0.01 and out[2]["band_high"] is None
    assert band_summary(out) == "measured inside the prediction band: 1 of 2 statistics"
    assert "no prediction band" in band_summary(with_band(rows, None))


@pytest.mark.parametrize("band", [(95, 5), (5,), (-1, 50), (5, 101), ("a", 9)])
def test_a_bad_band_is_a_clear_error(band):
    with pytest.raises(ValueError, match=r"compare\.band="):
        band_percentiles(band)


def test_a_noisy_calibration_gives_a_band_the_draws_fill(tmp_path):
    """Constructed case: a linear model with sigma-0.3 step noise; 5 seeded draws of a 60-request run."""
    rng = np.random.default_rng(3)
    n = 400
    decode = StepFeatures(1, 1, 0, 0, 1, 0, 100, 0, 100, 0, 100, 100)
    rec = record_step_noise([decode] * n, np.exp(0.3 * rng.standard_normal(n)), np.ones(n))
    path = write_calibration(tmp_path / "noisy.yaml", MODEL, step_noise=rec)
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("compare", overrides=["backend=sim", "~backend.cpu_gemm", "cost_model=calibrated",
                                            f"cost_model.path={path}", "workload.num_requests=60",
                                            "compare.noise_draws=5", "compare.band=[0,100]"])
    median, draws = simulate_draws(cfg, tmp_path / "sim")
    assert draws is not None and draws["band_percentiles"] == [0.0, 100.0]
    band = draws["band"]
    p50s = [h["ttft_p50"] for h in draws["headline"]]
    assert band["ttft_s"]["p50"] == [min(p50s), max(p50s)] and min(p50s) < max(p50s)  # 0-100%: the draws' range
    for m in ("ttft_s", "tpot_s", "e2e_s"):
        for stat in ("p50", "p90"):
            lo, hi = band[m][stat]
            assert lo <= median[m][stat] <= hi
    # the median run as "measured" is inside every band; a run 3x slower is outside
    slow = {m: {k: 3 * v for k, v in median[m].items() if isinstance(v, float)} for m in ("ttft_s", "tpot_s")}
    inside = with_band(percentile_errors(median, median, ["ttft_s", "tpot_s"], [50, 90]), band)
    outside = with_band(percentile_errors(slow, median, ["ttft_s", "tpot_s"], [50, 90]), band)
    assert all(r["in_band"] for r in inside if r["percentile"])
    assert not any(r["in_band"] for r in outside if r["percentile"])
    md = errors_markdown(outside)
    assert "| inside |" in md and "NO" in md and "inside the prediction band: 0 of 4" in md
