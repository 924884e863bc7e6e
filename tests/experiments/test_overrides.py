"""Override values as Hydra reads them: the compare / study override lists go through ``apply_overrides``."""

from __future__ import annotations

from omegaconf import OmegaConf

from experiments.overrides import apply_overrides, parse_value


def test_numbers_without_an_exponent_sign_are_floats():
    # PyYAML reads these as strings; Hydra's grammar (the command line) as floats
    assert parse_value("16e9") == 16e9 and parse_value("1.0e9") == 1e9 and parse_value("20e-6") == 20e-6
    assert parse_value("3") == 3 and parse_value("true") is True and parse_value("[1, 2]") == [1, 2]
    assert parse_value("null") is None and parse_value("") is None
    assert parse_value("lru") == "lru" and parse_value("nan") == "nan"  # words stay words


def test_apply_overrides_sets_parsed_values():
    cfg = OmegaConf.create({"hardware": {"interconnect_bw": 63.0e9}})
    out = apply_overrides(cfg, ["hardware.interconnect_bw=16e9", "+extra.name=x"])
    assert out.hardware.interconnect_bw == 16e9 and isinstance(out.hardware.interconnect_bw, float)
    assert out.extra.name == "x" and cfg.hardware.interconnect_bw == 63.0e9  # a copy
