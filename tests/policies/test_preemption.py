"""Preemption policies (conf/preemption) compose, instantiate and get their model / hardware numbers filled in."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from core import arithmetic
from core.interfaces import PreemptionPolicy
from experiments.build import build_replicas
from tests.helpers import parsed

CONF = Path(__file__).resolve().parents[2] / "conf"


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF / "preemption").glob("*.yaml")))
def test_every_preemption_config_builds_with_a_host_tier(name):
    cfg = composed(f"preemption={name}", "kv.host_blocks=32", "kv.host_eviction=lfu")
    rep = build_replicas(parsed(cfg, num_kv_blocks=64))[0]
    assert isinstance(rep.preemption, PreemptionPolicy)
    assert rep.kv.host.num_blocks == 32 and type(rep.kv.host.eviction).__name__ == "LFUEviction"


def test_cost_policy_gets_the_model_and_hardware_numbers():
    cfg = composed("preemption=cost", "kv.host_blocks=8", "hardware=h100", "model=llama3_8b")
    run = parsed(cfg, num_kv_blocks=64)
    spec, hw = run.model, run.hardware
    p = build_replicas(run)[0].preemption
    assert p.kv_bytes_per_token == arithmetic.kv_bytes_per_token(spec, 16) == 131072  # 2 * 32 layers * 8 * 128 * 2 B
    assert p.host_link_bw == hw.host_link_bw == 50e9 and p.host_link_latency_s == hw.host_link_latency_s
    assert p.prefill_tokens_per_s == pytest.approx(0.5 * hw.peak_flops / arithmetic.linear_flops_per_token(spec))


def test_host_tier_defaults_off_and_bad_values_name_their_key():
    cfg = composed()
    rep = build_replicas(parsed(cfg, num_kv_blocks=16))[0]
    assert rep.kv.host is None and type(rep.preemption).__name__ == "RecomputePreemption"
    with pytest.raises(ValueError, match="kv.host_blocks"):
        build_replicas(parsed(composed("preemption=swap"), num_kv_blocks=16))
    with pytest.raises(ValueError, match="kv.host_eviction"):
        build_replicas(parsed(composed("kv.host_blocks=4", "kv.host_eviction=nope"), num_kv_blocks=16))
    with pytest.raises(ValueError, match="kv.host_blocks"):
        build_replicas(parsed(composed("kv.host_blocks=-1"), num_kv_blocks=16))
    sized = composed("kv.host_memory_bytes=1e6")  # tiny model: 64 KiB per 16-token block -> 15 blocks
    assert build_replicas(parsed(sized, num_kv_blocks=16))[0].kv.host.num_blocks == 15
