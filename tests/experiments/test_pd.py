"""``cluster=pd`` through the config: both command-line paths run, the run files carry the PD columns and metrics
(a colocated run's do not), goodput checks TTFT and TPOT separately, and bad values fail naming their key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from core.output import REQUEST_COLUMNS, read_requests
from experiments.build import CONF_DIR, build_loop
from experiments.run import run
from tests.helpers import parsed

ROOT = Path(__file__).resolve().parents[2]
QUIET = ["output.plots=false", "output.progress=false"]
PD = ["cluster=pd", "cluster.prefill_replicas=1", "cluster.decode_replicas=3"]


def composed(*overrides: str):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=[*overrides, *QUIET])


def test_sim_pd_run_writes_transfer_columns_and_metrics(tmp_path):
    m = run(composed(*PD, "workload.num_requests=30", "slo.tpot_s=0.05"), tmp_path)
    req = read_requests(tmp_path)
    assert list(req)[:len(REQUEST_COLUMNS)] == list(REQUEST_COLUMNS)
    assert list(req)[len(REQUEST_COLUMNS):] == ["prefill_replica", "decode_replica", "transfer_queued_s",
                                                "transfer_start_s", "transfer_end_s"]
    assert set(req["prefill_replica"]) == {0} and set(req["decode_replica"]) <= {1, 2, 3}
    assert (req["first_token_s"] == req["transfer_end_s"]).all()  # TTFT includes the transfer
    assert (req["transfer_start_s"] >= req["transfer_queued_s"]).all()
    pd = m["pd"]
    assert pd["num_transfers"] == 30 and pd["transfer_timing"] == "link" and pd["link"]["name"] == "default"
    assert pd["transfer_s"]["p50"] > 0 and pd["transfer_kv_wait_s"]["p99"] >= 0
    assert json.loads((tmp_path / "metrics.json").read_text())["pd"] == pd


def test_colocated_files_have_no_pd_parts(tmp_path):
    m = run(composed("workload.num_requests=5"), tmp_path)
    assert "pd" not in m and list(read_requests(tmp_path)) == list(REQUEST_COLUMNS)


def test_goodput_checks_ttft_and_tpot_separately(tmp_path):
    base = run(composed(*PD, "workload.num_requests=30", "slo=none"), tmp_path / "none")
    tight_tpot = run(composed(*PD, "workload.num_requests=30", "slo=none", "slo.tpot_s=1e-6"), tmp_path / "tpot")
    tight_ttft = run(composed(*PD, "workload.num_requests=30", "slo=none", "slo.ttft_s=1e-6"), tmp_path / "ttft")
    assert base["num_slo_met"] == 30
    assert tight_tpot["num_slo_met"] == 0 and tight_ttft["num_slo_met"] == 0


def test_link_preset_and_override():
    def link(cfg):
        return parsed(cfg).cluster.link

    h100 = composed("cluster=pd", "hardware=h100", "cluster.link=rdma_400g")
    assert (link(h100).bandwidth_bytes_s, link(h100).latency_s) == (50e9, 2e-5)
    assert link(composed("cluster=pd", "hardware=h100")).bandwidth_bytes_s == 450e9  # default: NVLink 4
    own = composed("cluster=pd", "cluster.link=null", "cluster.link_bandwidth_bytes_s=1e9")
    assert (link(own).bandwidth_bytes_s, link(own).latency_s) == (1e9, 0.0)


@pytest.mark.parametrize(("overrides", "key"), [
    (["cluster.prefill_replicas=0"], "cluster.prefill_replicas"),
    (["cluster.decode_replicas=0"], "cluster.decode_replicas"),
    (["replicas=3"], "replicas=3"),
    (["cluster.link=nvlink9"], "cluster.link='nvlink9'"),
    (["cluster.link=null"], "cluster.link_bandwidth_bytes_s"),
    (["cluster.link_bandwidth_bytes_s=-1"], "cluster.link_bandwidth_bytes_s"),
    (["cluster.name=split"], "cluster.name"),
    (["placement._target_=os.system"], "placement._target_"),
    (["placement._target_=policies.routers.random.RandomRouter"], "does not implement Placement"),
])
def test_bad_pd_config_names_the_key(overrides, key):
    with pytest.raises(ValueError, match=key.replace("(", r"\(").replace(".", r"\.")):
        build_loop(parsed(composed("cluster=pd", *overrides)))


@pytest.mark.parametrize("name", ["least_loaded", "kv_aware", "random"])
def test_every_placement_config_runs(tmp_path, name):
    m = run(composed(*PD, f"placement={name}", "workload.num_requests=10"), tmp_path)
    assert m["num_completed"] == 10 and m["pd"]["num_transfers"] == 10


def test_user_placement_by_target(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    target = "my_policies.long_prompt_placement.LongPromptPlacement"
    cfg = composed(*PD, f"placement._target_={target}", "+placement.long_prompt=64", "workload.num_requests=10")
    loop = build_loop(parsed(cfg))
    assert type(loop.placement).__name__ == "LongPromptPlacement" and loop.placement.long_prompt == 64
    assert run(cfg, tmp_path)["pd"]["num_transfers"] == 10


def test_pd_study_goodput_is_read_from_its_runs(tmp_path):
    """The PD study at tiny scale, read independently: every (workload, split, rate) ran, and a goodput the summary
    reports is the count of FINISHED requests within both targets of that workload's SLO over the run's duration."""
    import json

    import pandas as pd

    from tests.experiments.studies.test_studies import run_tiny

    out = run_tiny("pd_disaggregation", tmp_path)
    runs = sorted((out / "sim").glob("*/*/rate=*/metrics.json"))
    assert len(runs) == 2 * 6 * 2  # workloads x splits x rates
    run = out / "sim" / "summarization_arXiv" / "2P2D" / "rate=4"
    r = pd.read_csv(run / "requests.csv")
    m = json.loads((run / "metrics.json").read_text())
    ok = (r.status == "FINISHED") & (r.ttft_s <= 1.0) & ~(r.tpot_s > 0.035)  # tight TPOT, summarization's SLO
    summary = (out / "summary.md").read_text()
    assert f"{ok.sum() / m['duration_s']:.4g}" in summary
    moved = r.transfer_end_s.notna()  # the first token reaches the client when its KV transfer ends
    assert moved.any() and (r.first_token_s[moved] - r.transfer_end_s[moved]).abs().max() < 1e-9
    assert len(list(out.glob("pd_disaggregation_*.png"))) == 2
