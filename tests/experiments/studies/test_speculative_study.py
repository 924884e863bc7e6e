"""The speculative-decoding study, read independently: the speed-up it reports is the ratio of its runs'
throughputs, and the roofline's answer has the expected shape (drafts pay at batch 1, where a decode step is
memory-bound, and pay more at higher acceptance)."""

from __future__ import annotations

import json

from tests.experiments.studies.test_studies import run_tiny


def test_speedup_is_the_throughput_ratio_and_pays_at_batch_one(tmp_path):
    out = run_tiny("speculative_decoding", tmp_path)
    runs = (out / "sim").glob("B*/*/metrics.json")
    tput = {p.parent.name: json.loads(p.read_text())["throughput_tok_s"] for p in runs}
    up = {k: tput[k] / tput[k.replace(k.split("_B=")[0], "off")] for k in tput if not k.startswith("off")}
    summary = (out / "summary.md").read_text()
    for label in ("k=4_alpha=0.8_B=1", "k=2_alpha=0.7_B=1"):
        assert up[label] > 1.0, up  # memory-bound decode: verifying drafts is almost free, accepted ones save steps
        assert f"{up[label]:.4g}" in summary
    assert up["k=4_alpha=0.8_B=1"] > up["k=2_alpha=0.7_B=1"]
    assert (out / "speedup_vs_batch.png").is_file()
