"""The engine's host KV tier: block copies between the KV tensors and a host tensor pool, and generation that is
token-identical whether KV was swapped, recomputed, spilled and loaded back, or never under pressure."""

from __future__ import annotations

import json

import pytest
import torch

from core.batch import BlockCopy
from core.specs import ModelSpec
from engine.attention import allocate_kv_caches
from engine.host_pool import HostKVPool

SPEC = ModelSpec(name="t", num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                 intermediate_size=64, vocab_size=64, max_model_len=64)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_copies_equal_one_by_one_copies_in_order(kv_dtype):
    caches = allocate_kv_caches(SPEC, 6, 4, torch.float32, "cpu", kv_dtype)
    for c in caches:
        for t in (c.k, c.v, c.k_scale, c.v_scale):
            if t is not None:
                t.copy_(torch.randint(-100, 100, t.shape).to(t.dtype))
    pool = HostKVPool(caches, 4)
    # a chain: out, a second out into the same host block (the later wins), in from it, a reuse of a device block
    copies = [BlockCopy("swap_out", 1, 0), BlockCopy("spill", 2, 1), BlockCopy("spill", 3, 0),
              BlockCopy("swap_in", 4, 0), BlockCopy("load", 5, 1), BlockCopy("swap_out", 4, 2)]
    expect = [[t.clone() for t in (c.k, c.v, c.k_scale, c.v_scale) if t is not None] for c in caches]
    host = [[torch.zeros_like(t[:4]) for t in layer] for layer in expect]
    for c in copies:
        for dev, h in zip((t for layer in expect for t in layer), (t for layer in host for t in layer), strict=True):
            if c.to_host:
                h[c.host_block] = dev[c.device_block]
            else:
                dev[c.device_block] = h[c.host_block]
    pool.apply(copies)
    got = [t for c in caches for t in (c.k, c.v, c.k_scale, c.v_scale) if t is not None]
    for a, b in zip(got, (t for layer in expect for t in layer), strict=True):
        assert torch.equal(a, b)
    for (_, h), ref in zip(pool.pairs, (t for layer in host for t in layer), strict=True):
        assert torch.equal(h[:3], ref[:3])  # host blocks 0-2 were written
    assert pool.bytes_per_block == sum(t[0].numel() * t.element_size() for layer in expect for t in layer)


def _run(tmp_path, name: str, overrides: list[str]) -> tuple[list, dict]:
    from hydra import compose, initialize_config_dir

    from experiments.build import CONF_DIR
    from experiments.run import run

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, "backend=engine", "output.plots=false",
                                           "output.progress=false", "workload.arrival.kind=fixed"])
    out = tmp_path / name
    metrics = run(cfg, out)
    outputs = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    return sorted((o["id"], o["output_token_ids"]) for o in outputs), metrics


def test_swap_recompute_and_no_pressure_generate_the_same_tokens(tmp_path):
    burst = ["workload.num_requests=5", "workload.arrival.rate_rps=1000000", "scheduler.max_num_batched_tokens=128"]
    free, _ = _run(tmp_path, "free", [*burst, "kv.num_blocks=400"])
    recompute, m_r = _run(tmp_path, "recompute", [*burst, "kv.num_blocks=24"])
    swap, m_s = _run(tmp_path, "swap", [*burst, "kv.num_blocks=24", "kv.host_blocks=64", "preemption=swap",
                                        "kv.host_spill=false"])
    assert "host_tier" not in m_r and m_s["host_tier"]["swap_outs"] > 0  # there was pressure, and swaps
    assert m_s["host_tier"]["swap_ins"] == m_s["host_tier"]["swap_outs"]
    assert free == recompute == swap


def test_spilled_prefix_loaded_back_generates_the_same_tokens(tmp_path):
    shared = ["workload=shared_prefix", "workload.num_requests=8", "workload.arrival.rate_rps=20"]
    free, _ = _run(tmp_path, "free", [*shared, "kv.num_blocks=400"])
    tiered, m = _run(tmp_path, "tiered", [*shared, "kv.num_blocks=20", "kv.host_blocks=64", "preemption=cost"])
    host = m["host_tier"]
    assert host["spill_blocks"] > 0 and host["load_blocks"] > 0 and host["bytes_to_device"] > 0
    assert free == tiered
