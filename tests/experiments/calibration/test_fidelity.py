"""The fidelity command's measurement plan (experiments/calibration/fidelity.py): every run its own prompt content,
the closed-loop capacity probe against a fake server, and offered load set as a share of that capacity."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from core.prompt import materialize
from core.request import Request
from experiments.build import CONF_DIR, build_workload
from experiments.calibration import fidelity as fid
from experiments.serving.fake_openai import FakeOpenAIServer


def cfg_with(*overrides):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("fidelity", overrides=list(overrides))


def test_every_run_of_a_measurement_gets_its_own_prompt_content():
    cfg = cfg_with()
    names = [*cfg.fidelity.profiles, *cfg.fidelity.workloads]
    seeds = {fid.content_seed(rep, i) for rep in range(cfg.fidelity.repeats) for i in range(len(names))}
    assert len(seeds) == cfg.fidelity.repeats * len(names)
    probes = {fid.capacity_config(cfg, list(cfg.fidelity.workloads[n]), i).seed
              for i, n in enumerate(cfg.fidelity.workloads)}
    assert not probes & seeds
    # the bug this guards: two workloads of one round, one seed -> the same first tokens of request i
    req = Request("0", 0.0, 64, 8)
    a, b = (materialize(req, 32000, fid.content_seed(0, i)) for i in (2, 3))
    assert a[:16] != b[:16]
    assert materialize(req, 32000, fid.content_seed(0, 2)) == a  # and a run's content is reproducible


def test_capacity_config_is_a_closed_loop_of_the_servers_batch():
    cfg = cfg_with("scheduler.max_num_seqs=24", "fidelity.capacity.num_requests=40")
    c = fid.capacity_config(cfg, list(cfg.fidelity.workloads.bursty), 1)
    assert c.target.max_concurrency == 24 and c.workload.num_requests == 40
    reqs = list(build_workload(c.workload).initial())
    assert len(reqs) == 40 and max(r.arrival_s for r in reqs) < 0.05  # all queued at once
    held = list(build_workload(fid.run_config(cfg, list(cfg.fidelity.workloads.bursty), 0).workload).initial())
    # the same mix as the measured workload (uniform 100-600 prompts)
    assert np.median([r.prompt_len for r in reqs]) == pytest.approx(np.median([r.prompt_len for r in held]), rel=0.2)
    cfg2 = cfg_with("fidelity.capacity.clients=3")
    assert fid.capacity_config(cfg2, list(cfg2.fidelity.workloads.poisson), 0).target.max_concurrency == 3


def test_probe_measures_capacity_and_sets_the_offered_rate(tmp_path):
    workloads = {"short": ["workload=poisson", "workload.seed=1", "workload.num_requests=8",
                           "workload.prompt_len.mean=32", "workload.prompt_len.max=64",
                           "workload.output_len={kind: fixed, value: 10}"],
                 "long": ["workload=poisson", "workload.seed=2", "workload.num_requests=8",
                          "workload.prompt_len.mean=32", "workload.prompt_len.max=64",
                          "workload.output_len={kind: fixed, value: 40}"]}
    with FakeOpenAIServer(ttft_s=0.01, itl_s=0.004) as srv:
        cfg = cfg_with(f"target.url={srv.url}", "fidelity.capacity.clients=4", "fidelity.capacity.num_requests=16",
                       "fidelity.pairs=[[short,long]]")
        cfg.fidelity.workloads, cfg.fidelity.load = workloads, {"short": 0.5}
        body = fid.probe_capacity(cfg, tmp_path)
    cap = body["capacity_rps"]
    # 4 clients, each request ~ttft + out x itl: 0.05 s (short) and 0.17 s (long) -> ~80 and ~24 req/s at most
    assert 0 < cap["long"] < cap["short"] <= 4 / (0.01 + 10 * 0.004) * 1.05
    assert cap["short"] / cap["long"] == pytest.approx((0.01 + 40 * 0.004) / (0.01 + 10 * 0.004), rel=0.5)
    assert body["rate_rps"] == {"short": pytest.approx(0.5 * cap["short"])}
    assert json.loads((tmp_path / "capacity" / "capacity.json").read_text()) == body
    over = fid.workload_overrides(cfg.fidelity, "short", body)
    assert over[-1] == f"workload.arrival.rate_rps={0.5 * cap['short']:.4f}"
    assert fid.workload_overrides(cfg.fidelity, "long", body) == workloads["long"]  # not in fidelity.load


@pytest.mark.parametrize("load, match", [({"nope": 0.5}, "not in fidelity.workloads"),
                                         ({"poisson": 0.0}, "share of the probed capacity"),
                                         ({"poisson": "half"}, "share of the probed capacity")])
def test_a_bad_load_is_refused_before_anything_is_sent(tmp_path, load, match):
    cfg = cfg_with("target.url=http://127.0.0.1:9")
    cfg.fidelity.load = load
    with pytest.raises(ValueError, match=match):
        fid.probe_capacity(cfg, tmp_path)
