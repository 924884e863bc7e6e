"""Ready-made studies (experiments/study.py): every preset composes and names its module; tiny-scale runs end in
figures and a summary.md whose headline numbers equal the values in the runs' own output files; the workload
combinators the studies use behave as documented."""

import json
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from experiments.build import CONF_DIR, build_workload
from experiments.studies.study import run_study, studies

# A few seconds each: the default run (chunk_tradeoff runs there too, in test_headline_number_is_the_run_metric).
FAST = ("stall_metrics", "decode_batch_roofline", "load_test_modes")


def study_cfg(name, *overrides):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("study", overrides=[f"study={name}", *overrides])


def test_the_issue_studies_are_all_there():
    assert set(studies()) >= {"chunk_tradeoff", "load_test_modes", "stall_metrics", "prefix_cache_value",
                              "cache_aware_routing", "batching_modes", "decode_batch_roofline", "quantization_gain",
                              "capacity_under_slo"}


@pytest.mark.parametrize("name", studies())
def test_every_study_composes_and_has_a_module(name):
    import importlib

    cfg = study_cfg(name)
    assert cfg.study.name == name
    assert cfg.study.scale == "full"
    assert callable(importlib.import_module(f"experiments.studies.{name}").run)
    assert "tiny" in cfg.study, f"{name}: no study.tiny section (CI runs every study at tiny scale)"


def check_outputs(out: Path) -> None:
    """summary.md exists with a figure that exists; every recorded headline number equals the value in the file it
    names and appears in summary.md as printed with 4 significant digits."""
    text = (out / "summary.md").read_text()
    figures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert figures and all((out / f).stat().st_size > 5_000 for f in figures)
    numbers = json.loads((out / "summary.json").read_text())["numbers"]
    assert numbers, "no headline number recorded"
    for name, rec in numbers.items():
        file, _, key = rec["source"].partition(":")
        path = out / file
        if file.endswith(".json"):
            value = json.loads(path.read_text())
            for part in key.split("."):
                value = value[int(part)] if isinstance(value, list) else value[part]
            assert value == rec["value"], name
        else:  # a CSV the study wrote: the value must at least be printed
            assert path.is_file(), name
            value = rec["value"]
        if value is not None:
            printed = str(value) if isinstance(value, int) else f"{float(value):.4g}"
            assert printed in text, (name, printed)


def run_tiny(name, tmp_path, *overrides):
    cfg = study_cfg(name, "study.scale=tiny", *overrides)
    path = run_study(cfg, tmp_path)
    assert path == tmp_path / "summary.md"
    check_outputs(tmp_path)
    return tmp_path


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in studies()])
def test_tiny_study_runs_end_to_end(name, tmp_path):
    run_tiny(name, tmp_path)


def test_headline_number_is_the_run_metric(tmp_path):
    """An independent read of the chunk-size study: the best goodput over the budget runs' metrics.json files is
    the number the summary reports."""
    out = run_tiny("chunk_tradeoff", tmp_path)
    goodputs = {int(p.parent.name.split("=")[1]): json.loads(p.read_text())["goodput_rps"]
                for p in (out / "sim").glob("budget=*/metrics.json")}
    assert len(goodputs) == len(study_cfg("chunk_tradeoff", "study.scale=tiny").study.tiny.budgets)
    best = max(goodputs.values())
    assert f"{best:.4g} req/s" in (out / "summary.md").read_text()


@pytest.mark.slow
def test_engine_overlay_runs_at_cpu_scale(tmp_path):
    out = run_tiny("decode_batch_roofline", tmp_path, "study.engine=true")
    assert (out / "measured.csv").is_file() and (out / "decode_engine_vs_roofline.png").is_file()


def test_bad_scale_and_unknown_study_fail_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match="study.scale"):
        run_study(study_cfg("chunk_tradeoff", "study.scale=huge"), tmp_path)
    cfg = study_cfg("chunk_tradeoff")
    cfg.study.name = "nope"
    with pytest.raises(ValueError, match="study.name"):
        run_study(cfg, tmp_path)
    with pytest.raises(ValueError, match="engine_scale"):
        cfg = study_cfg("chunk_tradeoff", "study.scale=tiny", "study.engine=true", "~study.engine_scale")
        run_study(cfg, tmp_path)


def test_missing_study_is_a_clear_error(tmp_path):
    from experiments.studies.study import run_study

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("study")  # composes (so --help works); running it names the choices
    with pytest.raises(ValueError, match=r"study=NAME is required; allowed: \['batching_modes'"):
        run_study(cfg, tmp_path)


# ---- workload combinators -------------------------------------------------------------------------------------
SHARED = {"_target_": "core.workload.SharedPrefixWorkload", "num_requests": 6, "arrival": {"kind": "fixed",
          "rate_rps": 2.0}, "num_groups": 1, "prefix_len": 32, "suffix_len": 8, "output_len": 4}
UNIQUE = {"_target_": "core.workload.SyntheticWorkload", "num_requests": 3, "arrival": {"kind": "fixed",
          "rate_rps": 1.5}, "prompt_len": 100, "output_len": 2}


def test_mix_merges_by_time_renames_and_never_shares_content_across_parts():
    mix = build_workload({"_target_": "core.workload.combinators.Mix", "warmup_requests": 2,
                          "parts": {"a": SHARED, "b": SHARED, "c": UNIQUE}})
    reqs = list(mix.initial())
    assert len(reqs) == 6 + 6 + 3
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    assert len({r.id for r in reqs}) == len(reqs) and {r.id.split("/")[0] for r in reqs} == {"a", "b", "c"}
    assert [r.warmup for r in reqs] == [True, True] + [False] * 13
    a = [r for r in reqs if r.id.startswith("a/")]
    b = [r for r in reqs if r.id.startswith("b/")]
    assert a[0].hash_ids[:2] == a[1].hash_ids[:2]  # within a part the system prompt is shared ...
    assert not set(a[0].hash_ids) & set(b[0].hash_ids)  # ... but two identical parts share nothing


def test_window_skips_and_keeps_arrival_times():
    inner = {**UNIQUE, "num_requests": 5}
    full = list(build_workload(inner).initial())
    win = list(build_workload({"_target_": "core.workload.combinators.Window", "inner": inner, "skip": 2,
                               "limit": 2}).initial())
    assert [(r.id, r.arrival_s) for r in win] == [(r.id, r.arrival_s) for r in full[2:4]]
    assert not any(r.warmup for r in win)


def test_mix_rejects_closed_loop_parts():
    closed = {"_target_": "core.workload.ClosedLoopWorkload", "num_clients": 2, "num_requests": 4, "prompt_len": 8,
              "output_len": 2}
    with pytest.raises(ValueError, match="open loop"):
        build_workload({"_target_": "core.workload.combinators.Mix", "parts": {"x": closed}})


def test_nested_workloads_without_seed_take_the_combinators_seed():
    """A Mix part without ``seed`` gets the Mix's seed + its index, a Window's inner workload the Window's seed."""
    drawn = {**UNIQUE, "arrival": {"kind": "poisson", "rate_rps": 1.5}}

    def times(cfg, prefix=""):
        return [r.arrival_s for r in build_workload(cfg).initial() if r.id.startswith(prefix)]

    mix = {"_target_": "core.workload.combinators.Mix", "seed": 5, "parts": {"a": drawn, "b": {**drawn, "seed": 9},
                                                                              "c": drawn}}
    for name, seed in (("a", 5), ("b", 9), ("c", 7)):
        assert times(mix, f"{name}/") == times({**drawn, "seed": seed})
    window = {"_target_": "core.workload.combinators.Window", "inner": drawn, "seed": 4}
    assert times(window) == times({**drawn, "seed": 4}) != times({**drawn, "seed": 0})


def test_nested_workload_errors_name_the_part():
    with pytest.raises(ValueError, match=r"workload.parts.x.*rate"):
        build_workload({"_target_": "core.workload.combinators.Mix", "parts": {"x": {**UNIQUE, "rate": 1}}})


def test_decode_roofline_weight_reads_include_the_lm_head():
    """The 'weight reads' time is every weight byte a step streams (weight_bytes counts the LM head: so must it)."""
    from hydra.utils import instantiate

    from experiments.studies.decode_batch_roofline import decode_features, roofline_rows

    cost = instantiate(study_cfg("decode_batch_roofline").cost_model)
    row = roofline_rows(cost, [8], [1024], 10**9)[0]
    t = cost.breakdown(decode_features(8, 1024))
    assert t["lm_head"] > 0 and row["weights_s"] == pytest.approx(t["linear"] + t["lm_head"])


# ---- repeats: study.seeds ---------------------------------------------------------------------------------------
def test_mean_ci_by_hand():
    from experiments.studies.common import mean_ci

    t_975_2 = 4.302652729911275  # Student t, 97.5th percentile, 2 degrees of freedom
    mean, lo, hi = mean_ci([1.0, 2.0, 3.0])  # sample sd 1
    assert mean == 2.0
    assert (lo, hi) == pytest.approx((2.0 - t_975_2 / 3 ** 0.5, 2.0 + t_975_2 / 3 ** 0.5))
    t_975_1 = 12.706204736174698
    mean, lo, hi = mean_ci([None, float("nan"), 4.0, 6.0])  # missing values left out: n = 2, sd sqrt(2)
    assert mean == 5.0 and hi - mean == pytest.approx(t_975_1 * 2 ** 0.5 / 2 ** 0.5)
    assert mean_ci([5.0]) == (5.0, None, None)  # one seed: no interval
    assert mean_ci([None]) == (None, None, None)


def test_aggregate_means_every_number_and_records_intervals():
    from experiments.studies.common import aggregate, fmt_ci

    a = {"goodput_rps": 1.0, "ttft_s": {"p99": 0.5}, "num_requests": 10, "slo": {"ttft_s": 2.0, "tpot_s": None},
         "percentile_method": "nearest_rank", "flag": True, "maybe": None}
    b = {**a, "goodput_rps": 3.0, "ttft_s": {"p99": 0.7}, "num_requests": 12}
    m = aggregate([a, b], [0, 1])
    assert m["goodput_rps"] == 2.0 and m["ttft_s"]["p99"] == pytest.approx(0.6) and m["num_requests"] == 11.0
    assert m["slo"] == {"ttft_s": 2.0, "tpot_s": None} and m["percentile_method"] == "nearest_rank"
    assert m["flag"] is True and m["maybe"] is None
    assert m["repeats"]["n"] == 2 and m["repeats"]["seeds"] == [0, 1]
    lo, hi = m["repeats"]["ci95"]["goodput_rps"]
    assert lo == pytest.approx(2.0 - 12.706204736174698) and hi == pytest.approx(2.0 + 12.706204736174698)
    assert m["repeats"]["ci95"]["slo.ttft_s"] == [2.0, 2.0]
    assert fmt_ci(m, "goodput_rps") == f"2 [{lo:.4g}, {hi:.4g}]" and fmt_ci(a, "goodput_rps") == "1"


def test_default_seeds_are_the_run_seed():
    from experiments.studies.common import seeds_of

    for name in studies():
        cfg = study_cfg(name, "seed=7")
        if "seeds" in cfg.study:
            assert seeds_of(cfg) == [7], name


def test_study_with_two_seeds_reports_mean_and_interval(tmp_path):
    """stall_metrics (seconds) with study.seeds=[0,1]: each variant runs per seed into <variant>/seed=<s>/, its
    metrics.json is the mean over the seeds with their 95% interval, the table prints `mean [low, high]`, and the
    headline numbers still equal the files they name."""
    from experiments.studies.common import mean_ci

    out = run_tiny("stall_metrics", tmp_path, "study.seeds=[0,1]")
    variant = out / "sim" / "vllm_prefill_first"
    per_seed = [json.loads((variant / f"seed={s}" / "metrics.json").read_text()) for s in (0, 1)]
    assert per_seed[0] != per_seed[1]  # the seed changes the runs
    agg = json.loads((variant / "metrics.json").read_text())
    assert agg["repeats"]["n"] == 2 and agg["repeats"]["seeds"] == [0, 1]
    values = [m["itl_s"]["p99"] for m in per_seed]
    mean, lo, hi = mean_ci(values)
    assert agg["itl_s"]["p99"] == pytest.approx(mean)
    assert agg["repeats"]["ci95"]["itl_s.p99"] == pytest.approx([lo, hi]) and lo < mean < hi
    text = (out / "summary.md").read_text()
    assert f"{mean * 1e3:.4g} [{lo * 1e3:.4g}, {hi * 1e3:.4g}]" in text  # p99 ITL (ms) cell
    assert "Mean over 2 seeds" in text and "study.seeds=[0,1]" in text


def test_command_line_keys_win_over_the_tiny_section(tmp_path):
    """`study.scale=tiny study.budgets=[512]` used to run the tiny section's budgets [256, 16384] instead."""
    import subprocess
    import sys

    from experiments.studies.common import scaled

    cfg = study_cfg("chunk_tradeoff", "study.scale=tiny", "study.budgets=[512]", "workload.parts.docs.duration_s=2")
    out = scaled(cfg, {"study.budgets", "workload.parts.docs.duration_s"})
    assert list(out.study.budgets) == [512] and out.workload.parts.docs.duration_s == 2
    assert out.workload.parts.chat.duration_s == 3  # the tiny section's, not given
    assert list(scaled(cfg).study.budgets) == [256, 16384]
    cmd = [sys.executable, "-m", "experiments.study", "study=chunk_tradeoff", "study.scale=tiny",
           "study.budgets=[512]", f"hydra.run.dir={tmp_path}"]
    subprocess.run(cmd, check=True, capture_output=True, cwd=CONF_DIR.parent, timeout=300)
    assert sorted(p.name for p in (tmp_path / "sim").iterdir()) == ["budget=512"]
