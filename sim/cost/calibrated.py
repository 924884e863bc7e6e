"""The calibration file: a fitted cost model written as a ready ``cost_model`` config, and read back as one
(``cost_model=calibrated``: ``load_calibration`` is its ``_target_``).

Besides the cost model's own parameters a file may record what the fit measured beyond step times: the model and
hardware it was fitted for (a run on other ones is refused), a server's per-request front-end delay, the server's
per-step work besides the forward pass (``server_terms``, ``sim.cost.server``: the loaded model is wrapped in them),
and the step noise of the measured steps (``sim.noise``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from core.checks import check_keys
from core.specs import HardwareSpec, ModelSpec
from sim.cost.base import as_model_spec
from sim.cost.linear import TARGET as LINEAR_TARGET
from sim.cost.linear import LinearCostModel
from sim.cost.roofline import PARAMS as ROOFLINE_PARAMS
from sim.cost.roofline import TARGET as ROOFLINE_TARGET
from sim.cost.roofline import RooflineCostModel
from sim.cost.server import ServerCostModel, ServerTerms, with_server_terms
from sim.fit import FitReport


def calibration_dict(cost_model: LinearCostModel | RooflineCostModel) -> dict[str, Any]:
    """The ``cost_model`` config entry: ``_target_`` + parameters; a roofline takes the run's model and hardware."""
    if isinstance(cost_model, LinearCostModel):
        return cost_model.to_dict()
    if isinstance(cost_model, RooflineCostModel):
        return {"_target_": ROOFLINE_TARGET, "model": "${model}", "hardware": "${hardware}", **cost_model.params()}
    raise ValueError(f"cannot write a calibration for {type(cost_model).__name__}; expected a linear or roofline model")


def write_calibration(path: str | Path, cost_model: LinearCostModel | RooflineCostModel,
                      fit: FitReport | None = None, note: str = "", fitted_for: tuple[str, str] | None = None,
                      frontend_delay_s: float | None = None, step_noise: Mapping[str, Any] | None = None,
                      server_terms: ServerTerms | None = None) -> Path:
    """A YAML usable as a ``conf/cost_model`` option, with a commented summary; the full report (if given) goes
    next to it as ``<stem>.report.json``. ``fitted_for`` = (model name, hardware name) the measurements came from:
    loading the file for another model or hardware then fails unless the run allows it. ``frontend_delay_s``: a
    server's per-request time outside its steps (fitted from request-level runs), which a simulation with this
    file adds before each request reaches a replica (``calibrated_frontend_delay``). ``step_noise``: the measured
    steps' variability around this model (``sim.noise.record_step_noise``), last in the file: a simulation with
    this file replays it (``backend.step_noise``). ``server_terms``: the server's step work besides the forward pass
    (``sim.cost.server``), which the loaded model then includes."""
    path = Path(path)
    header = ["# Calibrated cost model (sim.cost.calibrated.write_calibration)."]
    if note:
        header += [f"# {line}" for line in note.splitlines()]
    if isinstance(cost_model, RooflineCostModel):
        header.append(f"# Fitted for model={cost_model.model.name} hardware={cost_model.hardware.name}; "
                      "${model} / ${hardware} take the run's selection.")
    if fit is not None:
        header.append(f"# Fit on {fit.num_rows} rows: median |rel err| {fit.median_rel_error:.1%}, "
                      f"p90 {fit.p90_rel_error:.1%}, max {fit.max_rel_error:.1%}, r2 {fit.r2:.4f}. "
                      f"Report: {path.stem}.report.json")
        path.with_name(path.stem + ".report.json").write_text(json.dumps(fit.to_dict(), indent=2))
    body = calibration_dict(cost_model)
    if fitted_for is not None:
        body["fitted_for"] = {"model": fitted_for[0], "hardware": fitted_for[1]}
    if frontend_delay_s is not None:
        body["frontend_delay_s"] = float(frontend_delay_s)
    if server_terms is not None and not server_terms.zero:
        body["server_terms"] = server_terms.to_dict()
    text = yaml.safe_dump(body, sort_keys=False)
    if step_noise is not None:
        sigmas = ", ".join(f"{k} {v:.3f}" for k, v in step_noise["sigma"].items())
        header.append(f"# Step noise (sim/noise.py): {step_noise['num_steps']} run steps' log(measured / predicted), "
                      f"sd {step_noise['sigma_all']:.3f} ({sigmas}), standardised per kind (z) in step order; a "
                      f"simulation replays z in blocks of {step_noise['block_steps']} steps unless "
                      "backend.step_noise=false.")
        text += yaml.safe_dump({"step_noise": dict(step_noise)}, sort_keys=False, default_flow_style=None, width=116)
    path.write_text("\n".join(header) + "\n" + text)
    return path


def read_calibration_file(path: str | Path) -> Any:
    """A calibration file's YAML (libyaml's parser where installed: a step noise section holds up to 10,000
    numbers, 0.04 s to read instead of 0.25 s); None if there is no such file."""
    path = Path(path)
    if not path.is_file():
        return None
    return yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def calibrated_step_noise(path: str | Path) -> dict[str, Any] | None:
    """The ``step_noise`` section a calibration file records (None when it has none: no run's steps were fitted)."""
    cfg = read_calibration_file(path)
    return cfg.get("step_noise") if isinstance(cfg, dict) else None


def calibrated_frontend_delay(path: str | Path) -> float:
    """The per-request front-end delay a calibration file records (0 when it has none: a step-level fit)."""
    cfg = read_calibration_file(path)
    return float(cfg.get("frontend_delay_s") or 0.0) if isinstance(cfg, dict) else 0.0


def load_calibration(path: str | Path, model: ModelSpec | Mapping[str, Any] | None = None,
                     hardware: HardwareSpec | Mapping[str, Any] | None = None,
                     allow_mismatch: bool = False) -> LinearCostModel | RooflineCostModel | ServerCostModel:
    """The cost model a calibration file describes; a roofline file needs ``model`` and ``hardware`` (it
    interpolates the run's) unless it spells them out. A file fitted for another model or hardware than the
    run's is refused (its step times would silently be another machine's) unless ``allow_mismatch``. A file with
    ``server_terms`` gives the model wrapped in them (``sim.cost.server.ServerCostModel``)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"cost_model.path={str(path)!r}: no such calibration file (an experiments.calibrate output)")
    cfg = read_calibration_file(path)
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a mapping, got {type(cfg).__name__}")
    fitted_for = cfg.pop("fitted_for", None) or {}
    cfg.pop("frontend_delay_s", None)  # the loop's, not the cost model's (calibrated_frontend_delay)
    cfg.pop("step_noise", None)  # the executor's (calibrated_step_noise)
    terms = ServerTerms.from_mapping(cfg.pop("server_terms", None))
    for key, given in (("model", model), ("hardware", hardware)):
        if key == "model" and isinstance(given, Mapping) and given.get("path"):
            given = as_model_spec(given)  # a checkpoint's name is its directory's, as calibrate recorded it
        name = getattr(given, "name", None) or (given.get("name") if isinstance(given, Mapping) else None)
        if fitted_for.get(key) and name and name != fitted_for[key] and not allow_mismatch:
            raise ValueError(f"cost_model.path={str(path)!r} was fitted for {key}={fitted_for[key]}, this run has "
                             f"{key}={name}; calibrate for it, or set cost_model.allow_mismatch=true")
    target = cfg.get("_target_")
    if target == LINEAR_TARGET:
        return with_server_terms(LinearCostModel.from_mapping(cfg), terms)
    if target != ROOFLINE_TARGET:
        raise ValueError(f"{path}: _target_={target!r}; expected {LINEAR_TARGET!r} or {ROOFLINE_TARGET!r}")
    cfg.pop("_target_")
    specs = {}
    for key, given in (("model", model), ("hardware", hardware)):
        in_file = cfg.pop(key, None)
        specs[key] = given if given is not None else in_file if isinstance(in_file, Mapping) else None
        if specs[key] is None:
            raise ValueError(f"{path}: {key}={in_file!r} is not a spec; pass {key}= to load_calibration")
    check_keys(f"{path}", cfg, ROOFLINE_PARAMS)
    return with_server_terms(RooflineCostModel(specs["model"], specs["hardware"], **cfg), terms)
