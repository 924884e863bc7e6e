"""The published-measurements check writes its JSON, markdown table and scatter plot."""

import json

import pytest

from experiments.published import COLUMNS, main
from sim.published import default_data_dir

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
