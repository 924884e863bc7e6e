"""The published-measurements check writes its JSON, markdown table and scatter plot."""

import json

import pytest

from experiments.calibration.published import COLUMNS, main
from experiments.calibration.published_data import default_data_dir

try:
    default_data_dir()
    HAVE_DATA = True
except FileNotFoundError:  # pragma: no cover
    HAVE_DATA = False


@pytest.mark.skipif(not HAVE_DATA, reason="shared/data/gpu-measurements not found")
def test_main_writes_outputs(tmp_path, capsys):
    main(["--out", str(tmp_path), "--sources", "sarathi-serve", "--folds", "3"])
    result = json.loads((tmp_path / "published_check.json").read_text())
    (setup,) = result["sarathi-serve"]["setups"]
    assert "points" not in setup and setup["rows"] > 0
    assert 0 < setup["roofline"]["compute_eff"] <= 1
    md = (tmp_path / "published_check.md").read_text()
    assert "| " + " | ".join(COLUMNS) + " |" in md and "yi-34b-200k" in md and "Batch Id 0" in md
    png = (tmp_path / "published_scatter.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert "sarathi-serve" in capsys.readouterr().out


def test_bad_source_is_rejected(tmp_path):
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--sources", "nope"])


def test_report_states_the_defaults_the_check_uses():
    """The report's 'default roofline' sentence is the class defaults check_dataset prices with, which are
    conf/cost_model/roofline.yaml's (it said bw_eff 0.85 while both were 0.75)."""
    import yaml

    from experiments.build import CONF_DIR
    from experiments.calibration.published import _DEFAULT, markdown

    conf = yaml.safe_load((CONF_DIR / "cost_model" / "roofline.yaml").read_text())
    assert {k: conf[k] for k in ("compute_eff", "bw_eff", "overhead_s")} == \
        {k: _DEFAULT[k] for k in ("compute_eff", "bw_eff", "overhead_s")}
    assert f"compute_eff {conf['compute_eff']:g}, bw_eff {conf['bw_eff']:g}, 1 ms overhead" in markdown({})
