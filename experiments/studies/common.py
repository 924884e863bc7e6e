"""What every study shares: the scale switch, running a list of config variants, backends, and summary.md.

A study module defines ``run(cfg, out) -> Report``: it builds override sets, runs them with ``run_variants``
(each into its own subdirectory, through ``experiments.runs.run``), reads their metrics back from the
written ``metrics.json`` files and turns them into figures and a ``Report``. Numbers in a report therefore come
from the run's own output files, never from values written in advance.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from core.checks import check_choice
from core.output import read_metrics, read_timing
from experiments.build import CONF_DIR
from experiments.overrides import apply_overrides
from experiments.runs import run as run_config

SCALES = ("full", "tiny")


def with_section(cfg: DictConfig, section: Any) -> DictConfig:
    """``cfg`` with a scale section applied: its ``overrides`` (config overrides, ``group=option`` or ``a.b=v``)
    and its other keys replacing those of ``study`` (e.g. a shorter sweep)."""
    sec = OmegaConf.to_container(section, resolve=False) if OmegaConf.is_config(section) else dict(section or {})
    out = apply_overrides(cfg, sec.pop("overrides", None) or [])
    for k, v in sec.items():
        out.study[k] = v
    return out


def scaled(cfg: DictConfig) -> DictConfig:
    """``cfg`` at ``study.scale``: ``full`` as configured, ``tiny`` with the ``study.tiny`` section applied."""
    scale = cfg.study.get("scale", "full")
    check_choice(scale, "study.scale", SCALES)
    return with_section(cfg, cfg.study.get("tiny")) if scale == "tiny" else cfg


def option_name(cfg: DictConfig, group: str) -> str:
    """The conf/<group>/*.yaml option whose ``_target_`` the config uses (else the class name), for labels."""
    target = cfg[group]._target_
    for p in sorted((CONF_DIR / group).glob("*.yaml")):
        if OmegaConf.load(p).get("_target_") == target:
            return p.stem
    return target.rsplit(".", 1)[-1]


def slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", label).strip("_")


def run_variants(cfg: DictConfig, variants: Mapping[str, Sequence[str]], out_dir: str | Path) -> dict[str, dict]:
    """Run ``cfg`` with each label's overrides into ``out_dir/<label>``; {label: metrics read from metrics.json}."""
    out = Path(out_dir)
    results = {}
    for label, overrides in variants.items():
        sub = out / slug(label)
        c = apply_overrides(cfg, ["output.plots=false", *overrides])
        run_config(c, sub)  # writes the run files and its resolved config.yaml
        results[label] = read_metrics(sub / "metrics.json")
        m = results[label]
        print(f"[study] {label}: {m['num_completed']}/{m['num_requests']} completed, goodput "
              f"{fmt(m.get('goodput_rps'))} req/s, wall {fmt(read_timing(sub).get('wall_s'))} s", flush=True)
    return results


def backends(cfg: DictConfig) -> dict[str, DictConfig]:
    """The configs a study runs its variants on: ``sim`` always; with ``study.engine=true`` also the CPU-scale
    version (the ``study.engine_scale`` section) on the simulator and on the real engine, to overlay them."""
    out = {"sim": cfg}
    if cfg.study.get("engine"):
        if not cfg.study.get("engine_scale"):
            raise ValueError(f"study.engine=true: study {cfg.study.name} has no engine_scale section (not supported)")
        cpu = with_section(cfg, cfg.study.engine_scale)
        out["sim (cpu scale)"] = apply_overrides(cpu, ["backend=sim"])
        out["engine (cpu scale)"] = apply_overrides(cpu, ["backend=engine"])
    return out


def get(metrics: Mapping[str, Any], key: str) -> Any:
    """A dotted key of a metrics dict (``ttft_s.p99``, ``groups.prefix.hit.ttft_s.p50``); None when absent."""
    v: Any = metrics
    for part in key.split("."):
        if not isinstance(v, Mapping) or part not in v:
            return None
        v = v[part]
    return v


def fmt(v: Any, scale: float = 1.0) -> str:
    """How every number appears in a summary: 4 significant digits, ``n/a`` for missing."""
    if v is None:
        return "n/a"
    if isinstance(v, bool) or isinstance(v, int) and scale == 1.0:
        return str(v)
    return f"{float(v) * scale:.4g}"


Column = tuple[str, str, float]  # (metrics key, header, scale), e.g. ("itl_s.p99", "p99 ITL (ms)", 1e3)


@dataclass
class Report:
    """summary.md: text, tables and figures, plus summary.json recording each headline number and its source."""

    title: str
    lines: list[str] = field(default_factory=list)
    numbers: dict[str, dict[str, Any]] = field(default_factory=dict)

    def text(self, *paragraphs: str) -> None:
        for p in paragraphs:
            self.lines += [p, ""]

    def number(self, name: str, value: Any, source: str) -> str:
        """Record a headline number (its source: ``<run dir>/metrics.json:<key>`` or a CSV) and return it formatted."""
        self.numbers[name] = {"value": value, "source": source}
        return fmt(value)

    def table(self, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self.lines.append("| " + " | ".join(header) + " |")
        self.lines.append("|" + "---|" * len(header))
        self.lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
        self.lines.append("")

    def metric_table(self, runs: Mapping[str, Mapping[str, Any]], columns: Sequence[Column],
                     first: str = "variant") -> None:
        self.table([first, *(c[1] for c in columns)],
                   [[label, *(fmt(get(m, key), scale) for key, _, scale in columns)] for label, m in runs.items()])

    def figure(self, path: str | Path, caption: str) -> None:
        self.lines += [f"![{caption}]({Path(path).name})", "", f"*{caption}*", ""]

    def write(self, out: str | Path, header: Sequence[str] = ()) -> Path:
        out = Path(out)
        (out / "summary.json").write_text(json.dumps({"title": self.title, "numbers": self.numbers}, indent=2,
                                                     default=str) + "\n")
        path = out / "summary.md"
        path.write_text("\n".join([f"# {self.title}", "", *header, *self.lines]).rstrip() + "\n")
        return path
