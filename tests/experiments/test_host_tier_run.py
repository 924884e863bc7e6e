"""A host KV tier through the config, read back from the run files: metrics.json's ``host_tier`` section agrees
with the model arithmetic and the host link by hand, and a run without a tier has no such section."""

from __future__ import annotations

import pytest

from tests.experiments.test_pd import composed, run

PRESSURE = ["kv.num_blocks=24", "workload.arrival.rate_rps=50"]  # the tiny model on cpu, a 24-block pool


def test_swap_run_reports_bytes_and_priced_copy_time(tmp_path):
    m = run(composed(*PRESSURE, "kv.host_blocks=512", "preemption=swap"), tmp_path)
    tier = m["host_tier"]
    # tiny model: K and V x 4 layers x 4 KV heads x head_dim 32 x fp32, 16 tokens a block
    assert tier["bytes_per_block"] == 2 * 4 * 4 * 32 * 4 * 16
    assert tier["swap_outs"] > 0 and tier["swap_ins"] == tier["swap_outs"]  # every swapped request came back
    assert tier["bytes_to_host"] == (tier["swap_out_blocks"] + tier["spill_blocks"]) * tier["bytes_per_block"]
    assert tier["bytes_to_device"] == (tier["swap_in_blocks"] + tier["load_blocks"]) * tier["bytes_per_block"]
    # conf/hardware/cpu.yaml: a 5 GB/s host link with no fixed latency, so the priced time is bytes / bandwidth
    assert tier["copy_time"] == "priced"
    assert tier["copy_s"] == pytest.approx((tier["bytes_to_host"] + tier["bytes_to_device"]) / 5.0e9, rel=1e-12)
    assert m["num_completed"] + m["num_rejected"] == m["num_requests"]


def test_recompute_run_has_no_host_tier_section(tmp_path):
    assert "host_tier" not in run(composed(*PRESSURE), tmp_path)
