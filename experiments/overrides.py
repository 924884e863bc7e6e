"""Command-line style overrides applied to a composed config (for experiments that derive runs from one config)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf

from experiments.build import CONF_DIR


def apply_overrides(cfg: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """A copy of ``cfg`` with command-line style overrides: ``group=option`` swaps a config group for
    conf/<group>/<option>.yaml, ``a.b=value`` sets a key (value parsed as YAML, as Hydra does), and
    ``key=${other.key}`` points a key (a group too) at another section of the config (``workload=${study.open}``:
    that section is the workload)."""
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    for item in overrides:
        key, sep, value = str(item).partition("=")
        key = key.lstrip("+")
        if not sep or not key:
            raise ValueError(f"override {item!r}: expected key=value")
        if value.startswith("${"):
            OmegaConf.update(out, key, value, merge=False, force_add=True)
        elif "." not in key and (CONF_DIR / key).is_dir():
            option = CONF_DIR / key / f"{value}.yaml"
            if not option.is_file():
                allowed = sorted(p.stem for p in (CONF_DIR / key).glob("*.yaml"))
                raise ValueError(f"override {item!r}: no option {value!r} in group {key}; allowed: {allowed}")
            out[key] = OmegaConf.load(option)
        else:
            OmegaConf.update(out, key, parse_value(value), merge=False, force_add=True)
    return out


def parse_value(text: str) -> object:
    """An override's value as YAML, numbers as Hydra reads them: PyYAML takes ``16e9`` or ``1.0e9`` (no exponent
    sign) for strings, Hydra's grammar for floats."""
    if not text:
        return None
    value = yaml.safe_load(text)
    if isinstance(value, str):
        try:
            return float(value) if value.strip().lower() not in ("nan", "inf", "-inf", "infinity") else value
        except ValueError:
            return value
    return value


def with_backend(cfg: DictConfig, name: str) -> DictConfig:
    """``cfg`` on backend ``name``; keeps the configured backend section when it already is that backend."""
    if cfg.backend.name == name:
        return cfg
    return apply_overrides(cfg, [f"backend={name}"])


def with_calibration(cfg: DictConfig, path: str | Path) -> DictConfig:
    """The simulator with a calibration file as its cost model (what ``cost_model=calibrated`` does)."""
    out = apply_overrides(with_backend(cfg, "sim"), ["cost_model=calibrated"])
    out.cost_model.path = str(Path(path).resolve())
    return out
