"""What every study shares: the scale switch, running a list of config variants, backends, and summary.md.

A study module defines ``run(cfg, out) -> Report``: it builds override sets, runs them with ``run_variants``
(each into its own subdirectory, through ``experiments.run.run``), reads their metrics back from the
written ``metrics.json`` files and turns them into figures and a ``Report``. Numbers in a report therefore come
from the run's own output files, never from values written in advance.

Repeats: ``study.seeds`` (default ``[${seed}]``) runs every variant once per seed. With one seed a variant's run is
its directory, as always; with several, each seed runs into ``<variant>/seed=<s>/`` and ``<variant>/metrics.json``
holds the mean of every number over the seeds plus ``repeats`` (the seeds, n, and ``ci95``: the 95% Student-t
interval of each dotted key), which tables print as ``mean [low, high]`` and figures draw as bands or error bars.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf
from scipy import stats

from core.checks import check_choice
from core.output import read_metrics, read_timing
from experiments.build import CONF_DIR
from experiments.overrides import apply_overrides
from experiments.run import run as run_config

log = logging.getLogger(__name__)

SCALES = ("full", "tiny")


def with_section(cfg: DictConfig, section: Any, given: Collection[str] = ()) -> DictConfig:
    """``cfg`` with a scale section applied: its ``overrides`` (config overrides, ``group=option`` or ``a.b=v``)
    and its other keys replacing those of ``study`` (e.g. a shorter sweep). Keys in ``given`` (set on the command
    line: ``workload.duration_s``, ``study.budgets``) keep their value."""
    sec = OmegaConf.to_container(section, resolve=False) if OmegaConf.is_config(section) else dict(section or {})
    overrides = [o for o in sec.pop("overrides", None) or [] if str(o).partition("=")[0].lstrip("+") not in given]
    out = apply_overrides(cfg, overrides)
    for k, v in sec.items():
        if f"study.{k}" not in given:
            out.study[k] = v
    return out


def scaled(cfg: DictConfig, given: Collection[str] = ()) -> DictConfig:
    """``cfg`` at ``study.scale``: ``full`` as configured, ``tiny`` with the ``study.tiny`` section applied except
    for the keys in ``given`` (those the command line set: a user's ``study.budgets=[512]`` is not replaced)."""
    scale = cfg.study.get("scale", "full")
    check_choice(scale, "study.scale", SCALES)
    return with_section(cfg, cfg.study.get("tiny"), given) if scale == "tiny" else cfg


def option_name(cfg: DictConfig, group: str) -> str:
    """The conf/<group>/*.yaml option whose ``_target_`` the config uses (else the class name), for labels."""
    target = cfg[group]._target_
    for p in sorted((CONF_DIR / group).glob("*.yaml")):
        if OmegaConf.load(p).get("_target_") == target:
            return p.stem
    return target.rsplit(".", 1)[-1]


def slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", label).strip("_")


def seeds_of(cfg: DictConfig) -> list[int]:
    """The seeds every variant runs with: ``study.seeds``, else the run's ``seed``."""
    seeds = cfg.study.get("seeds")
    out = [int(s) for s in seeds] if seeds else [int(cfg.seed)]
    if len(set(out)) != len(out):
        raise ValueError(f"study.seeds={out}: a seed appears twice (a repeat must differ in its seed)")
    return out


def mean_ci(values: Sequence[float | None], level: float = 0.95) -> tuple[float | None, float | None, float | None]:
    """(mean, low, high) of repeated measurements: the ``level`` Student-t interval of the mean (n - 1 degrees of
    freedom, sample standard deviation); no interval (None, None) with fewer than 2 values. None and NaN values
    are left out; (None, None, None) when none is left."""
    v = np.array([x for x in values if x is not None], float)
    v = v[~np.isnan(v)]
    if not len(v):
        return None, None, None
    mean = float(v.mean())
    if len(v) < 2:
        return mean, None, None
    half = float(stats.t.ppf((1 + level) / 2, len(v) - 1) * v.std(ddof=1) / math.sqrt(len(v)))
    return mean, mean - half, mean + half


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def aggregate(per_seed: Sequence[Mapping[str, Any]], seeds: Sequence[int]) -> dict[str, Any]:
    """One metrics dict for repeated runs: the mean of every number (dotted keys recursively; None where every seed
    has None), other values from the first seed, and ``repeats``: {"seeds", "n", "ci95": {dotted key: [low, high]}}
    (``mean_ci``), for tables and figures."""
    ci: dict[str, list] = {}

    def merge(ds: Sequence[Any], prefix: str) -> Any:
        first = ds[0]
        if isinstance(first, Mapping):
            keys = list(dict.fromkeys(k for d in ds if isinstance(d, Mapping) for k in d))
            return {k: merge([d.get(k) if isinstance(d, Mapping) else None for d in ds], f"{prefix}{k}.")
                    for k in keys}
        if any(_is_number(d) for d in ds) and all(d is None or _is_number(d) for d in ds):
            mean, lo, hi = mean_ci(ds)
            if lo is not None:
                ci[prefix[:-1]] = [lo, hi]
            return mean
        return first

    out = merge(list(per_seed), "")
    out["repeats"] = {"seeds": list(seeds), "n": len(per_seed), "ci95": ci}
    return out


def run_dir(out_dir: str | Path, label: str, seed: int, seeds: Sequence[int]) -> Path:
    """Where ``label``'s run with ``seed`` goes: ``<out>/<label>`` with one seed, else ``<out>/<label>/seed=<s>``."""
    d = Path(out_dir) / slug(label)
    return d if len(seeds) == 1 else d / f"seed={seed}"


def same_seed(run_path: Path, label: str) -> Path:
    """The run directory of variant ``label`` next to ``run_path`` (a directory ``run_variants`` made), same seed."""
    if run_path.name.startswith("seed="):
        return run_path.parent.parent / slug(label) / run_path.name
    return run_path.parent / slug(label)


Derive = Callable[[str, dict, Path], dict]


def run_variants(cfg: DictConfig, variants: Mapping[str, Sequence[str]], out_dir: str | Path,
                 derive: Derive | None = None) -> dict[str, dict]:
    """Run ``cfg`` with each label's overrides into ``out_dir/<label>``, once per seed (``seeds_of``, each into
    ``run_dir``); {label: metrics read from metrics.json}. ``derive(label, metrics, run_dir)`` adds fields read from
    a run's own files (called per seed once every variant has run, so it may read another variant's same-seed run:
    ``same_seed``). With several seeds the label's metrics are ``aggregate``'d and written to
    ``<out_dir>/<label>/metrics.json``."""
    out = Path(out_dir)
    seeds = seeds_of(cfg)
    dirs: dict[str, dict[int, Path]] = {}
    for label, overrides in variants.items():
        for s in seeds:
            sub = dirs.setdefault(label, {})[s] = run_dir(out, label, s, seeds)
            seed = [f"seed={s}"] if s != int(cfg.seed) else []
            c = apply_overrides(cfg, ["output.plots=false", *seed, *overrides])
            run_config(c, sub)  # writes the run files and its resolved config.yaml
            m = read_metrics(sub / "metrics.json")
            log.info(f"[study] {label}{f' seed={s}' if len(seeds) > 1 else ''}: {m['num_completed']}/"
                     f"{m['num_requests']} completed, goodput {fmt(m.get('goodput_rps'))} req/s, wall "
                     f"{fmt(read_timing(sub).get('wall_s'))} s")
    results = {}
    for label, by_seed in dirs.items():
        per_seed = [read_metrics(d / "metrics.json") for d in by_seed.values()]
        if derive is not None:
            per_seed = [derive(label, m, d) for m, d in zip(per_seed, by_seed.values(), strict=True)]
        if len(seeds) == 1:
            results[label] = per_seed[0]
            continue
        results[label] = aggregate(per_seed, seeds)
        (out / slug(label) / "metrics.json").write_text(json.dumps(results[label], indent=2, default=str) + "\n")
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


def ci_text(metrics: Mapping[str, Any], key: str, scale: float = 1.0) -> str:
    """`` [low, high]``: the 95% interval of a dotted key over repeated seeds (``aggregate``); '' without one."""
    ci = ((metrics.get("repeats") or {}).get("ci95") or {}).get(key)
    return f" [{fmt(ci[0], scale)}, {fmt(ci[1], scale)}]" if ci else ""


def fmt_ci(metrics: Mapping[str, Any], key: str, scale: float = 1.0) -> str:
    """``fmt`` of a dotted key, followed by its ``ci_text``."""
    return fmt(get(metrics, key), scale) + ci_text(metrics, key, scale)


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
        """One row per run, one column per metric; with repeats each cell is ``mean [low, high]`` (95%
        interval over the seeds, ``fmt_ci``) and a line after the table says so."""
        self.table([first, *(c[1] for c in columns)],
                   [[label, *(fmt_ci(m, key, scale) for key, _, scale in columns)] for label, m in runs.items()])
        n = {(m.get("repeats") or {}).get("n") for m in runs.values()} - {None}
        if n:
            self.text(f"Mean over {', '.join(map(str, sorted(n)))} seeds (seeds "
                      f"{next(iter(runs.values()))['repeats']['seeds']}); [low, high]: 95% interval of the mean "
                      "(Student t, n - 1 degrees of freedom).")

    def figure(self, path: str | Path, caption: str) -> None:
        self.lines += [f"![{caption}]({Path(path).name})", "", f"*{caption}*", ""]

    def write(self, out: str | Path, header: Sequence[str] = ()) -> Path:
        out = Path(out)
        (out / "summary.json").write_text(json.dumps({"title": self.title, "numbers": self.numbers}, indent=2,
                                                     default=str) + "\n")
        path = out / "summary.md"
        path.write_text("\n".join([f"# {self.title}", "", *header, *self.lines]).rstrip() + "\n")
        return path
