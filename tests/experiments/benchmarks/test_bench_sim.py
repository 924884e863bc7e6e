"""experiments.benchmarks.sim works end to end on a tiny trace prefix (the real benchmark: ``pytest -m bench``)."""

import json

import pytest


def test_bench_sim_on_a_tiny_prefix(tmp_path, capsys):
    """The loop case and two whole-process cases (each a subprocess: a few seconds); every case has this shape."""
    from experiments.benchmarks.sim import CASES, main

    assert {c.name for c in CASES} >= {"loop", "process_csv", "process_parquet", "process_tokens_none"}
    out = main(["--limit", "20", "--replicas", "2", "--out", str(tmp_path), "--json", str(tmp_path / "b.json"),
                "--cases", "loop", "process_csv", "process_tokens_none", "process_csv_per_step"])
    assert set(out["cases"]) == {"loop", "process_csv", "process_tokens_none", "process_csv_per_step"}
    for name, r in out["cases"].items():
        assert r["requests"] == 20 and r["simulated_s"] > 0 and r["sim_s_per_wall_s"] > 0, name
    # a process's simulated seconds are timing.json's wall_s x sim_s_per_wall_s: equal up to rounding
    assert out["cases"]["loop"]["simulated_s"] == pytest.approx(out["cases"]["process_csv"]["simulated_s"], rel=1e-12)
    assert (tmp_path / "20" / "process_csv" / "tokens.csv").is_file()
    assert not (tmp_path / "20" / "process_tokens_none" / "tokens.csv").exists()
    assert json.loads((tmp_path / "b.json").read_text())["limit"] == 20
    assert out["fast_forward_identical"] is True and out["process_csv_fast_forward_speedup"] > 0
    printed = capsys.readouterr().out
    assert "whole process, default outputs" in printed and "fast-forward vs per-step files: byte-identical" in printed
