"""Every policy config composes and instantiates through Hydra, and a user's own policy outside the
project packages is selected by ``_target_`` alone."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from core.interfaces import EvictionPolicy, Router, Scheduler
from core.request import Request, Status
from experiments.build import build_replicas
from tests.helpers import parsed, run_requests

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
EXAMPLES = ROOT / "examples"


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.mark.parametrize("name", options("scheduler"))
def test_every_scheduler_config_builds_replicas_with_its_limits(name):
    cfg = composed(f"scheduler={name}")
    assert {"_target_", "max_num_batched_tokens", "max_num_seqs"} <= set(cfg.scheduler)
    reps = build_replicas(parsed(cfg, num_kv_blocks=64))
    assert isinstance(reps[0].scheduler, Scheduler)
    assert reps[0].limits.max_num_batched_tokens == cfg.scheduler.max_num_batched_tokens
    assert reps[0].limits.max_num_seqs == cfg.scheduler.max_num_seqs


@pytest.mark.parametrize("name", options("eviction"))
def test_every_eviction_config_instantiates(name):
    cfg = composed(f"eviction={name}")  # keep the root alive: interpolations resolve against it
    policy = instantiate(cfg.eviction)
    assert isinstance(policy, EvictionPolicy) and len(policy) == 0


@pytest.mark.parametrize("name", options("router"))
def test_every_router_config_instantiates(name):
    cfg = composed(f"router={name}")
    assert isinstance(instantiate(cfg.router), Router)


def test_policy_zoo_is_complete():
    assert {"static", "orca", "vllm_prefill_first", "vllm_v1", "sarathi", "priority",
            "lpm"} <= set(options("scheduler"))
    assert {"lru", "lfu", "fifo", "cost_aware"} <= set(options("eviction"))
    assert {"round_robin", "random", "least_outstanding", "least_kv", "prefix_aware", "cost_based",
            "power_of_two"} <= set(options("router"))


@pytest.mark.parametrize("overrides", [
    ["scheduler._target_=my_policies.shortest_prompt_first.ShortestPromptFirst"],
    [f"hydra.searchpath=[file://{EXAMPLES / 'my_policies' / 'conf'}]", "scheduler=shortest_prompt_first"],
])
def test_user_policy_outside_the_packages_is_selected_by_target(monkeypatch, overrides):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    cfg = composed(*overrides)
    reps = build_replicas(parsed(cfg, num_kv_blocks=64))
    sched = reps[0].scheduler
    assert type(sched).__module__ == "my_policies.shortest_prompt_first"
    # it runs in the simulator: with one seat, the short prompt queued behind a long one goes first
    reqs = [Request("first", 0.0, 8, 4), Request("long", 0.001, 200, 2), Request("short", 0.002, 10, 2)]
    res, _ = run_requests(reqs, lambda: sched, max_num_seqs=1, max_num_batched_tokens=512)
    s = {x.id: x for x in res.states}
    assert all(x.status is Status.FINISHED for x in res.states)
    assert s["short"].first_scheduled_s < s["long"].first_scheduled_s


def test_kv_prefix_cache_mode_reaches_every_pool():
    cfg = composed("scheduler=vllm_v1", "kv.prefix_cache_mode=vllm", "replicas=2")
    assert [r.kv.prefix_cache_mode for r in build_replicas(parsed(cfg, num_kv_blocks=64))] == ["vllm", "vllm"]
    with pytest.raises(ValueError, match="kv.prefix_cache_mode='lru'; allowed"):
        parsed(composed("kv.prefix_cache_mode=lru"))
