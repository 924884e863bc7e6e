"""Calibration fits: recover known coefficients from synthetic steps, NNLS sign constraints, calibration files."""

import csv
from pathlib import Path

import numpy as np
import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from core.batch import StepFeatures
from core.output import read_step_features
from core.records import StepRecord
from core.specs import HardwareSpec, ModelSpec
from experiments.calibration.samples import prefill_steps, request_samples
from sim.cost.base import decode_features, prefill_features
from sim.cost.calibrated import load_calibration, write_calibration
from sim.cost.linear import LinearCostModel
from sim.cost.roofline import RooflineCostModel
from sim.fit import (
    LINEAR_TERMS,
    OpGroupCost,
    RequestSample,
    cross_validate,
    cross_validate_requests,
    feature_matrix,
    fit_linear,
    fit_linear_requests,
    fit_roofline,
    report,
)

CONF = Path(__file__).resolve().parents[2] / "conf"


def conf(group: str, name: str) -> dict:
    return OmegaConf.to_container(OmegaConf.load(CONF / group / f"{name}.yaml"))


LLAMA7B = ModelSpec.from_mapping(conf("model", "llama2_7b"))
A100 = HardwareSpec.from_mapping(conf("hardware", "a100"))


def mixed(pre: StepFeatures, dec: StepFeatures) -> StepFeatures:
    return StepFeatures(**{k: (max if k == "max_context_len" else int.__add__)(getattr(pre, k), getattr(dec, k))
                           for k in StepFeatures.names()})


def random_steps(n: int, seed: int) -> list[StepFeatures]:
    """Prefill (with and without cached prefix), decode and mixed steps of widely varying size."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        pre = prefill_features(int(rng.integers(16, 4096)), int(rng.integers(0, 2048)))
        dec = decode_features(int(rng.integers(1, 256)), int(rng.integers(16, 4096)))
        out.append((pre, dec, mixed(prefill_features(int(rng.integers(16, 1024))), dec))[i % 3])
    return out


def noisy(y: np.ndarray, seed: int, low: float = 0.02, high: float = 0.05) -> np.ndarray:
    """Multiplicative noise of 2-5% with a random sign."""
    rng = np.random.default_rng(seed)
    return y * (1 + rng.choice([-1, 1], len(y)) * rng.uniform(low, high, len(y)))


def test_feature_matrix_hand_computed():
    pre, dec = prefill_features(10, cached=4), decode_features(3, context=100)
    run = (prefill_features(8), prefill_features(8, cached=8))
    verify = StepFeatures(num_seqs=2, num_batched_tokens=8, num_decode_seqs=2, kv_tokens_read=2 * 104,
                          max_context_len=104, num_draft_tokens=6)
    X = feature_matrix([pre, dec, run, verify])
    # the cached context the prefill chunks attend to, then the draft tokens verified
    np.testing.assert_array_equal(X[0], [1, 10, 0, 10 * 4 + 10 * 11 // 2, 0, 4, 0])
    np.testing.assert_array_equal(X[1], [1, 0, 3, 0, 300, 0, 0])
    # a run sums its steps: 2 intercepts, 16 tokens, pairs 36 + (64 + 36), context 0 + 8
    np.testing.assert_array_equal(X[2], [2, 16, 0, 36 + 100, 0, 8, 0])
    np.testing.assert_array_equal(X[3], [1, 0, 2, 0, 208, 0, 6])


def test_fit_linear_recovers_coefficients_under_noise():
    truth = LinearCostModel(c0_s=5e-3, per_prefill_token_s=1e-4, per_decode_seq_s=3e-4, per_attention_pair_s=2e-8,
                            per_kv_token_read_s=1e-7)
    F = random_steps(300, seed=1)
    y = noisy(np.array([truth.step_time(f) for f in F]), seed=2)
    fitted, rep = fit_linear(F, y)
    for k, v in truth.to_dict().items():
        if k != "_target_":
            assert getattr(fitted, k) == pytest.approx(v, rel=0.10), k
    assert rep.num_rows == 300 and rep.median_rel_error < 0.05 and rep.r2 > 0.99
    assert set(rep.groups) == {"prefill", "decode", "mixed"}


def test_fit_linear_keeps_coefficients_non_negative():
    # Truth pulls decode seqs *negatively*: unconstrained least squares goes negative, NNLS must clamp at exactly 0.
    F = random_steps(90, seed=3)
    X = feature_matrix(F)
    y = 5e-3 + 1e-4 * X[:, 1] - 2e-5 * X[:, 2] + 1e-7 * X[:, 4]
    unconstrained = np.linalg.lstsq(X / y[:, None], np.ones(len(y)), rcond=None)[0]
    assert unconstrained[2] < 0
    fitted, _ = fit_linear(F, y)
    assert fitted.per_decode_seq_s == 0.0
    # A truly absent term stays (near) zero under noise too.
    truth = LinearCostModel(c0_s=4e-3, per_prefill_token_s=1e-4, per_kv_token_read_s=1e-7)
    y = noisy(np.array([truth.step_time(f) for f in F]), seed=4)
    fitted, _ = fit_linear(F, y)
    pairs, tokens = 1024 * 1025 / 2, 1024  # a 1k-token prefill: the spurious term adds < 5% of the token term
    assert fitted.per_attention_pair_s * pairs < 0.05 * truth.per_prefill_token_s * tokens


def test_relative_weighting_minimises_relative_error():
    truth = RooflineCostModel(LLAMA7B, A100, compute_eff=0.6, bw_eff=0.8, overhead_s=2e-3)
    F = random_steps(120, seed=5)
    y = noisy(np.array([truth.step_time(f) for f in F]), seed=6)
    sq = {rel: float(np.sum((np.array([m.step_time(f) for f in F]) / y - 1) ** 2))
          for rel, m in ((rel, fit_linear(F, y, relative=rel)[0]) for rel in (True, False))}
    assert sq[True] <= sq[False]


def test_fit_roofline_recovers_efficiencies():
    truth = RooflineCostModel(LLAMA7B, A100, compute_eff=0.55, bw_eff=0.7, overhead_s=2e-3)
    F = random_steps(150, seed=7)
    y = noisy(np.array([truth.step_time(f) for f in F]), seed=8, low=0.0, high=0.03)
    fitted, rep = fit_roofline(F, y, LLAMA7B, A100)
    assert fitted.compute_eff == pytest.approx(0.55, rel=0.05)
    assert fitted.bw_eff == pytest.approx(0.7, rel=0.05)
    assert fitted.overhead_s == pytest.approx(2e-3, rel=0.25)
    assert rep.median_rel_error < 0.03
    # the report prices with the returned model
    assert rep.median_rel_error == pytest.approx(report(fitted, F, y).median_rel_error)


def test_fit_roofline_runs_of_steps_and_tensor_parallel():
    """Chunked prefills measured as one sum (runs), tp=2: noise-free data is fitted exactly."""
    truth = RooflineCostModel(LLAMA7B, A100, compute_eff=0.4, bw_eff=0.9, overhead_s=5e-3, tp=2)
    rng = np.random.default_rng(9)
    F = []
    for _ in range(40):
        n, chunk = int(rng.integers(512, 8192)), int(rng.choice([256, 512, 1024]))
        F.append(tuple(prefill_features(min(chunk, n - s), s) for s in range(0, n, chunk)))
        F.append(decode_features(int(rng.integers(1, 128)), int(rng.integers(64, 4096))))
    y = np.array([sum(truth.step_time(f) for f in (m if isinstance(m, tuple) else (m,))) for m in F])
    fitted, rep = fit_roofline(F, y, LLAMA7B, A100, truth)
    assert fitted.tp == 2
    assert (fitted.compute_eff, fitted.bw_eff) == pytest.approx((0.4, 0.9), rel=0.01)
    assert fitted.overhead_s == pytest.approx(5e-3, rel=0.02)
    assert rep.max_rel_error < 0.01
    assert set(rep.groups) == {"prefill", "decode"}


def test_fit_roofline_on_one_op_group():
    """Per-operator data: only the linear layers were timed (plus a launch overhead)."""
    truth = OpGroupCost(RooflineCostModel(LLAMA7B, A100, compute_eff=0.75, bw_eff=0.6, overhead_s=3e-5), ("linear",))
    F = [StepFeatures(num_seqs=1, num_batched_tokens=t, num_prefill_seqs=1, num_prefill_tokens=t)
         for t in np.unique(np.geomspace(1, 8192, 80).astype(int))]
    y = noisy(np.array([truth.step_time(f) for f in F]), seed=10, low=0.0, high=0.02)
    fitted, rep = fit_roofline(F, y, LLAMA7B, A100, ops=("linear",))
    assert (fitted.compute_eff, fitted.bw_eff) == pytest.approx((0.75, 0.6), rel=0.05)
    assert rep.median_rel_error < 0.02


def test_cross_validate_is_held_out():
    truth = LinearCostModel(c0_s=1e-3, per_prefill_token_s=2e-4, per_decode_seq_s=1e-4)
    F = random_steps(30, seed=11)
    y = np.array([truth.step_time(f) for f in F])
    rel = cross_validate(lambda f, t: fit_linear(f, t)[0], F, y, folds=3)
    assert rel.shape == (30,) and np.abs(rel).max() < 1e-6
    # a model that memorised nothing (mean duration) is judged on rows it never saw: errors are large
    mean_model = lambda f, t: LinearCostModel(c0_s=float(np.mean(t)))
    assert np.median(np.abs(cross_validate(mean_model, F, y, folds=3))) > 0.2


def test_report_groups_and_perfect_prediction():
    m = LinearCostModel(c0_s=1e-3, per_prefill_token_s=1e-5)
    F = [prefill_features(100), prefill_features(200), decode_features(4, 10)]
    y = np.array([m.step_time(f) for f in F])
    rep = report(m, F, y, labels=["a", "b", "a"])
    assert rep.r2 == pytest.approx(1.0) and rep.max_rel_error == pytest.approx(0.0, abs=1e-12)
    assert rep.groups["a"]["num_rows"] == 2 and rep.groups["b"]["num_rows"] == 1
    slow = report(LinearCostModel(c0_s=2e-3, per_prefill_token_s=2e-5), F, y)
    assert slow.median_signed_rel_error == pytest.approx(1.0)  # everything predicted twice as slow
    assert slow.to_dict()["groups"]["decode"]["num_rows"] == 1


def write_steps(path: Path, records: list[StepRecord]) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(StepRecord.columns())
        w.writerows(r.row() for r in records)


def test_steps_from_csv_round_trip(tmp_path):
    F = random_steps(6, seed=12)
    records = [StepRecord(i % 2, 0.1 * i, 0.01 + i * 1e-3, f, 3, 0) for i, f in enumerate(F)]
    write_steps(tmp_path / "steps.csv", records)
    feats, durations, replicas = read_step_features(tmp_path / "steps.csv")
    assert feats == F
    np.testing.assert_allclose(durations, [r.duration_s for r in records])
    np.testing.assert_array_equal(replicas, [0, 1, 0, 1, 0, 1])


def test_steps_from_csv_errors(tmp_path):
    (tmp_path / "a.csv").write_text("replica,start_s,duration_s\n0,0,1\n")
    with pytest.raises(ValueError, match="missing columns.*num_prefill_tokens"):
        read_step_features(tmp_path / "a.csv")
    write_steps(tmp_path / "b.csv", [StepRecord(0, 0.0, 0.01, prefill_features(4), 1, 0)])
    text = (tmp_path / "b.csv").read_text().replace("0.01", "fast")
    (tmp_path / "b.csv").write_text(text)
    with pytest.raises(ValueError, match="b.csv:2"):
        read_step_features(tmp_path / "b.csv")


def test_bad_inputs_are_named():
    F = [prefill_features(10), decode_features(2, 5)]
    with pytest.raises(ValueError, match="durations must be finite and > 0; row 1"):
        fit_linear(F, [0.1, 0.0])
    with pytest.raises(ValueError, match="2 measurements"):
        fit_linear(F, [0.1])
    with pytest.raises(ValueError, match="unknown op groups"):
        fit_roofline(F, [0.1, 0.2], LLAMA7B, A100, ops=("mlp",))
    with pytest.raises(ValueError, match="unknown keys"):
        fit_roofline(F, [0.1, 0.2], LLAMA7B, A100, {"tensor_parallel": 2})
    with pytest.raises(ValueError, match="loss"):
        fit_roofline(F, [0.1, 0.2], LLAMA7B, A100, loss="huber")
    with pytest.raises(ValueError, match="measurement"):
        feature_matrix([()])


def test_linear_calibration_round_trip(tmp_path):
    model = LinearCostModel(c0_s=1.234e-3, per_prefill_token_s=5.6e-5, per_decode_seq_s=7e-5,
                            per_attention_pair_s=1.1e-9, per_kv_token_read_s=3.3e-8)
    F = random_steps(20, 13)
    rep = report(model, F, noisy(np.array([model.step_time(f) for f in F]), 14))
    path = write_calibration(tmp_path / "cal.yaml", model, rep, note="engine run 2024-01-01")
    text = path.read_text()
    assert text.startswith("# Calibrated") and "engine run" in text and "median |rel err|" in text
    assert (tmp_path / "cal.report.json").is_file()
    loaded = load_calibration(path)
    assert loaded == model
    via_hydra = instantiate(OmegaConf.load(path))
    assert [via_hydra.step_time(f) for f in F] == [model.step_time(f) for f in F]


def test_roofline_calibration_round_trip_and_hydra(tmp_path):
    model = RooflineCostModel(LLAMA7B, A100, compute_eff=0.6123456789, bw_eff=0.7, overhead_s=3.21e-3, tp=2,
                              weight_bits=8, kv_bits=8, group_size=64)
    path = write_calibration(tmp_path / "roof.yaml", model)
    F = random_steps(20, 15)
    expect = [model.step_time(f) for f in F]
    loaded = load_calibration(path, LLAMA7B, A100)
    assert loaded.params() == model.params()
    assert [loaded.step_time(f) for f in F] == expect
    # compose as a run would: model/hardware groups + this file as the cost_model option
    cfg = OmegaConf.create({"model": conf("model", "llama2_7b"), "hardware": conf("hardware", "a100")})
    cfg.cost_model = OmegaConf.load(path)
    via_hydra = instantiate(cfg.cost_model)
    assert isinstance(via_hydra, RooflineCostModel) and via_hydra.params() == model.params()
    assert [via_hydra.step_time(f) for f in F] == expect
    with pytest.raises(ValueError, match="pass model="):
        load_calibration(path)


def test_load_calibration_rejects_unknown_target(tmp_path):
    (tmp_path / "x.yaml").write_text("_target_: sim.cost.other.Model\n")
    with pytest.raises(ValueError, match="_target_"):
        load_calibration(tmp_path / "x.yaml")
    (tmp_path / "y.yaml").write_text("_target_: sim.cost.roofline.RooflineCostModel\nbw_eff: 0.5\nfoo: 1\n")
    with pytest.raises(ValueError, match="unknown keys"):
        load_calibration(tmp_path / "y.yaml", LLAMA7B, A100)


def test_calibration_for_another_model_is_refused(tmp_path):
    from core.specs import ModelSpec

    path = write_calibration(tmp_path / "lin.yaml", LinearCostModel(c0_s=1e-3), fitted_for=("tiny", "cpu"))
    other = ModelSpec("big", 2, 64, 4, 2, 16, 128, 160)
    with pytest.raises(ValueError, match="fitted for model=tiny"):
        load_calibration(path, model=other)
    assert load_calibration(path, model=other, allow_mismatch=True).c0_s == 1e-3
    assert load_calibration(path, model={"name": "tiny"}).c0_s == 1e-3


# ---- request-level samples (a server seen as a black box) --------------------------------------------------------
def _runfiles(reqs, events):
    """requests.csv / tokens.csv columns from (id, arrival, prompt, status, cached, preemptions) and
    {id: [(time, tokens), ...]}: first token and finish from the events."""
    cols = {k: [] for k in ("id", "arrival_s", "first_token_s", "finish_s", "prompt_tokens", "cached_tokens",
                            "num_preemptions", "status", "replica", "warmup")}
    toks = {k: [] for k in ("request_id", "index", "time_s", "num_tokens")}
    for rid, arrival, prompt, status, cached, pre in reqs:
        ev = events.get(rid, [])
        for i, (t, k) in enumerate(ev):
            toks["request_id"].append(rid)
            toks["index"].append(i)
            toks["time_s"].append(t)
            toks["num_tokens"].append(k)
        for key, v in (("id", rid), ("arrival_s", arrival), ("first_token_s", ev[0][0] if ev else np.nan),
                       ("finish_s", ev[-1][0] if ev else np.nan), ("prompt_tokens", prompt),
                       ("cached_tokens", cached), ("num_preemptions", pre), ("status", status), ("replica", 0),
                       ("warmup", 0)):
            cols[key].append(v)
    return {k: np.array(v) for k, v in cols.items()}, {k: np.array(v) for k, v in toks.items()}


def _decode(*contexts):
    return StepFeatures(num_seqs=len(contexts), num_batched_tokens=len(contexts), num_decode_seqs=len(contexts),
                        kv_tokens_read=sum(contexts), max_context_len=max(contexts), max_decode_context=max(contexts),
                        min_decode_context=min(contexts))


def test_request_samples_by_hand():
    """a alone, then b joins: a's TTFT is isolated; the gaps while b is prefilling are not samples; the step both
    decode in is seen by both (weight 1/2 each, contexts = prompt + tokens so far); b alone after a ends."""
    reqs, toks = _runfiles(
        [("a", 0.0, 10, "FINISHED", 0, 0), ("b", 1.05, 20, "FINISHED", 0, 0)],
        {"a": [(1.0, 1), (1.1, 1), (1.2, 1), (1.3, 1)], "b": [(1.2, 1), (1.3, 1), (1.4, 1)]})
    got = request_samples(reqs, toks)
    summary = sorted((((s.source, s.kind, round(s.duration_s, 9), s.weight), s.steps) for s in got), key=lambda x: x[0])
    assert summary == sorted([
        (("a", "ttft", 1.0, 1.0), (prefill_features(10),)),
        (("a", "itl", 0.1, 0.5), (_decode(13, 21),)),
        (("b", "itl", 0.1, 0.5), (_decode(21, 13),)),
        (("b", "itl", 0.1, 1.0), (_decode(22),)),
    ], key=lambda x: x[0])


def test_request_samples_chunks_events_and_unusable_neighbours():
    """Prefill chunks after cached tokens; an event of 2 tokens is a run of 2 decode steps; a request that was
    preempted (or did not finish) makes the samples it overlaps unusable, its own included."""
    reqs, toks = _runfiles([("c", 0.0, 100, "FINISHED", 32, 0)], {"c": [(0.5, 1), (0.7, 2)]})
    got = request_samples(reqs, toks, prefill_chunk=64)
    ttft = [s for s in got if s.kind == "ttft"]
    assert ttft[0].steps == (prefill_features(64, 32), prefill_features(4, 96)) and ttft[0].duration_s == 0.5
    itl = [s for s in got if s.kind == "itl"]
    assert len(itl) == 1 and itl[0].steps == (_decode(101), _decode(102))
    assert itl[0].duration_s == pytest.approx(0.2)
    for status, pre in (("FINISHED", 1), ("TIMED_OUT", 0)):
        reqs, toks = _runfiles([("c", 0.0, 100, "FINISHED", 0, 0), ("x", 0.1, 50, status, 0, pre)],
                               {"c": [(0.5, 1), (0.7, 1), (0.9, 1)], "x": [(0.6, 1), (0.8, 1)]})
        assert request_samples(reqs, toks) == []


def test_request_samples_check_their_inputs():
    reqs, toks = _runfiles([("c", 0.0, 10, "FINISHED", 0, 0)], {"c": [(0.5, 1)]})
    with pytest.raises(ValueError, match="prefill_chunk"):
        request_samples(reqs, toks, prefill_chunk=0)
    with pytest.raises(ValueError, match="tolerance"):
        request_samples(reqs, toks, tolerance=0.5)
    del reqs["status"]
    with pytest.raises(ValueError, match="status"):
        request_samples(reqs, toks)


def test_fit_linear_requests_recovers_the_model_and_the_overhead():
    truth = LinearCostModel(c0_s=3e-3, per_prefill_token_s=1e-4, per_decode_seq_s=4e-4, per_attention_pair_s=5e-8,
                            per_kv_token_read_s=2e-6, per_prefill_context_token_s=1e-6)
    samples = []
    for n in (16, 100, 700, 2000):
        for chunk in (None, 512):
            steps = prefill_steps(n, 0, chunk)
            samples.append(RequestSample(steps, sum(map(truth.step_time, steps)) + 2e-3, "ttft"))
    for b in (1, 3, 8, 32):
        for ctx in (20, 300, 1500):
            steps = (_decode(*[ctx] * b), _decode(*[ctx + 1] * b))[: 1 + (b % 2)]
            samples.append(RequestSample(steps, sum(map(truth.step_time, steps)), "itl", 1 / b))
    for target in ("mean", "relative"):
        fit = fit_linear_requests(samples, target=target)
        for k in LINEAR_TERMS:
            assert getattr(fit.model, k) == pytest.approx(getattr(truth, k), rel=1e-6), k
        assert fit.request_overhead_s == pytest.approx(2e-3, rel=1e-6)
        assert fit.report.max_rel_error < 1e-9 and set(fit.report.groups) == {"ttft", "itl"}
    assert np.abs(cross_validate_requests(samples, folds=4)).max() < 1e-6
    with pytest.raises(ValueError, match="no request-level samples"):
        fit_linear_requests([])
