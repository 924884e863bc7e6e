"""Check the roofline against published GPU measurements (Vidur, Splitwise, Sarathi-Serve, DistServe).

    python -m experiments.published --out outputs/published

For every measured setup: the default roofline's error, the fitted efficiencies and overhead with their in-sample
and 5-fold held-out errors, a fitted linear model, and (Splitwise) the default roofline with the host term of its
node, ``host_kernel_s`` fitted on one setup's decode rows, with the errors of the rows that fit did not see.
Writes published_check.json (everything but per-point values), published_check.md (the table) and
published_scatter.png (predicted vs measured, log-log).
"""

from __future__ import annotations

import argparse
import inspect
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from core.specs import HardwareSpec, ModelSpec
from experiments.build import CONF_DIR
from experiments.calibration.published_data import READERS, Specs, check
from experiments.plots import COLORS, figure, legend_outside
from sim.cost.roofline import RooflineCostModel


def conf_spec(group: str, name: str, conf_dir: Path = CONF_DIR) -> dict[str, Any]:
    """A ``conf/model`` or ``conf/hardware`` entry (read with OmegaConf: YAML 1.1 loaders read 312.0e12 as text)."""
    path = conf_dir / group / f"{name}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"no {group} config {name!r} ({path})")
    return OmegaConf.to_container(OmegaConf.load(path))


def conf_specs(conf_dir: Path = CONF_DIR) -> Specs:
    """The published-data readers' specs from ``conf/model`` and ``conf/hardware``."""
    return Specs(model=lambda name: ModelSpec.from_mapping(conf_spec("model", name, conf_dir)),
                 hardware=lambda name: HardwareSpec.from_mapping(conf_spec("hardware", name, conf_dir)))


def run(out: Path, data_dir: Path | None = None, sources: Sequence[str] = tuple(READERS),
        folds: int = 5) -> dict[str, Any]:
    """Check every source; write the JSON, markdown table and scatter plot into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    specs = conf_specs()
    results = {s: check(s, specs, data_dir, folds) for s in sources}
    scatter(results, out / "published_scatter.png")
    points_free = {s: {**r, "setups": [{k: v for k, v in x.items() if k != "points"} for x in r["setups"]]}
                   for s, r in results.items()}
    (out / "published_check.json").write_text(json.dumps(points_free, indent=2))
    (out / "published_check.md").write_text(markdown(results))
    return points_free


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.1f}%"


COLUMNS = ("source", "setup", "gpu", "tp", "rows", "default median", "default p90", "compute_eff", "bw_eff",
           "overhead ms", "fitted median", "fitted p90", "fitted held-out median", "linear held-out median",
           "host us/kernel", "host median", "host held-out prefill", "host held-out decode")


def table_rows(results: dict[str, Any]) -> list[list[str]]:
    rows = []
    for source, r in results.items():
        for x in r["setups"]:
            d, f, lin, h = x["default"], x["roofline"], x["linear"], x["host"]
            held = h["held_out_median"] if h else {}
            rows.append([source + (" (derived)" if x["derived"] else ""), x["name"].removeprefix(source + " "),
                         x["hardware"], str(x["tp"]), str(x["rows"]), _pct(d["median_rel_error"]),
                         _pct(d["p90_rel_error"]), f"{f['compute_eff']:.3f}", f"{f['bw_eff']:.3f}",
                         f"{1e3 * f['overhead_s']:.3f}", _pct(f["report"]["median_rel_error"]),
                         _pct(f["report"]["p90_rel_error"]), _pct(f["cv_median_rel_error"]),
                         _pct(lin["cv_median_rel_error"]) if lin else "—",
                         f"{1e6 * h['host_kernel_s']:.1f}" if h else "—", _pct(h["median"]["all"]) if h else "—",
                         _pct(held.get("prefill")), _pct(held.get("decode"))])
    return rows


_DEFAULT = {k: p.default for k, p in inspect.signature(RooflineCostModel).parameters.items()}


def markdown(results: dict[str, Any]) -> str:
    lines = ["# Roofline vs published GPU measurements", "",
             "Errors are |predicted − measured| / measured. Default roofline (`conf/cost_model/roofline.yaml`): "
             f"compute_eff {_DEFAULT['compute_eff']:g}, bw_eff {_DEFAULT['bw_eff']:g}, "
             f"{1e3 * _DEFAULT['overhead_s']:g} ms overhead "
             "(0 for Vidur's per-operator rows, compared with the `linear` op group of one layer), "
             "and each hardware preset's per-kernel launch cost (`hardware.kernel_launch_s`: 4 us on a100/h100, "
             "not fitted; not in Vidur's per-operator rows). "
             "Splitwise's collectives come from Vidur's NCCL tables of the same DGX nodes. "
             "'derived' rows come from DistServe's published fitted coefficients, not raw measurements.", "",
             "Host term (`cost_model.host_kernel_s`: a stage lasts max(device, kernels x host_kernel_s)), one value "
             "per host node, each fitted on one setup's decode rows; 'host held-out' columns: the rows that fit did "
             "not see:", ""]
    lines += [f"- {fit}" for r in results.values() for fit in r.get("host_fits", [])] or ["- none"]
    lines += ["", "| source | setups | rows | default median | fitted median | host-term median |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {s} | {r['summary']['setups']} | {r['summary']['rows']} | "
              f"{_pct(r['summary']['default_median_rel_error'])} | {_pct(r['summary']['fitted_median_rel_error'])} | "
              f"{_pct(r['summary'].get('host_median_rel_error'))} |"
              for s, r in results.items()]
    lines += ["", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(results)]
    skipped = [(s, k, why) for s, r in results.items() for k, why in r["skipped"].items()]
    if skipped:
        lines += ["", "Skipped:", ""] + [f"- {k}: {why}" for _, k, why in skipped]
    return "\n".join(lines) + "\n"


def scatter(results: dict[str, Any], path: Path) -> Path:
    """Predicted vs measured seconds, default and fitted roofline side by side, one colour per source."""
    with figure(1, 2, (10, 4.5)) as (fig, axes):
        for ax, key, title in ((axes[0, 0], "default", "default roofline"), (axes[0, 1], "fitted", "fitted roofline")):
            lo, hi = float("inf"), 0.0
            for i, (source, r) in enumerate(results.items()):
                meas = [v for x in r["setups"] for v in x["points"]["measured"]]
                pred = [v for x in r["setups"] for v in x["points"][key]]
                ax.scatter(meas, pred, s=4 if len(meas) > 100 else 14, alpha=0.5, color=COLORS[i % len(COLORS)],
                           label=source, zorder=3 if len(meas) > 100 else 4)  # small sources stay visible
                lo, hi = min(lo, *meas, *pred), max(hi, *meas, *pred)
            ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="y = x")
            ax.set(xscale="log", yscale="log", xlabel="measured (s)", ylabel="predicted (s)", title=title)
        legend_outside(fig)  # the same sources in both panels
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, bbox_inches="tight")
    return path


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("outputs/published"), help="output directory")
    p.add_argument("--data-dir", type=Path, default=None, help="gpu-measurements directory (default: shared/data)")
    p.add_argument("--sources", nargs="+", choices=sorted(READERS), default=list(READERS))
    p.add_argument("--folds", type=int, default=5, help="cross-validation folds for held-out errors")
    args = p.parse_args(argv)
    results = run(args.out, args.data_dir, args.sources, args.folds)
    widths = [max(len(c), *(len(r[i]) for r in table_rows(results))) for i, c in enumerate(COLUMNS)]
    for row in (list(COLUMNS), *table_rows(results)):
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))
    for r in results.values():
        for fit in r.get("host_fits", []):
            print(f"{r['source']}: {fit}; every other row held out")
    print(f"wrote {args.out}/published_check.json, published_check.md, published_scatter.png")


if __name__ == "__main__":
    main()
