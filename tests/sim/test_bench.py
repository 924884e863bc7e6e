"""Benchmarks (``make bench`` / ``pytest -m bench``): print speed ratios measured in one run; never in CI."""

import pytest


@pytest.mark.bench
def test_simulator_speed_on_azure_conv():
    from experiments.bench_sim import main

    out = main(["--limit", "4000"])
    print(f"simulated seconds per wall second: {out['sim_s_per_wall_s']:.1f} (goal >= 60)")
    assert out["requests"] == 4000


@pytest.mark.bench
def test_engine_vs_transformers():
    from experiments.bench_engine import main

    out = main(["--requests", "32"])
    print(f"engine / transformers throughput: {out['speedup_vs_hf']:.2f}x (goal >= 1.5x); "
          f"python overhead {out['python_overhead_share']:.1%} (goal < 10%)")
