"""Workloads: where requests come from (open loop, closed loop, prefix sharing, traces).

Each class implements ``core.interfaces.Workload``, is built from a Hydra config through ``_target_``
(see ``conf/workload/``), and is deterministic for a given seed.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any

from core.interfaces import Workload
from core.workload.base import plain, resolve_path
from core.workload.closed_loop import ClosedLoopWorkload
from core.workload.replay import AzureTrace, MooncakeTrace, RequestList
from core.workload.shared_prefix import MultiTurnWorkload, SharedPrefixWorkload
from core.workload.synthetic import SyntheticWorkload

BUILTIN = {cls.__name__: cls for cls in (SyntheticWorkload, SharedPrefixWorkload, MultiTurnWorkload,
                                         ClosedLoopWorkload, MooncakeTrace, AzureTrace, RequestList)}

__all__ = ["BUILTIN", "AzureTrace", "ClosedLoopWorkload", "MooncakeTrace", "MultiTurnWorkload", "RequestList",
           "SharedPrefixWorkload", "SyntheticWorkload", "build_workload", "resolve_path"]

_HYDRA_KEYS = ("_recursive_", "_convert_", "_partial_")


def _resolve_target(target: Any) -> type:
    allowed = ", ".join(f"core.workload.{n}" for n in BUILTIN)
    if not isinstance(target, str) or not target:
        raise ValueError(f"workload._target_ is missing or not a string: {target!r}; built-in: {allowed}")
    if target in BUILTIN:  # short form
        return BUILTIN[target]
    module, _, name = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name) if module else None
    except ImportError as e:
        raise ValueError(f"workload._target_={target!r}: cannot import {module!r} ({e}); built-in: {allowed}") from None
    except AttributeError:
        cls = None
    if cls is None or not callable(cls):
        raise ValueError(f"workload._target_={target!r}: no such class; built-in: {allowed}")
    return cls


def build_workload(cfg: Mapping[str, Any]) -> Workload:
    """Instantiate the workload a config describes (a dict or an OmegaConf node with ``_target_``)."""
    if not isinstance(cfg, Mapping):
        raise ValueError(f"workload config must be a mapping with _target_, got {type(cfg).__name__}")
    try:
        kwargs = plain(cfg)
    except Exception as e:  # e.g. OmegaConf's MissingMandatoryValue for a `???` left unset
        raise ValueError(f"workload config: {e}") from e
    cls = _resolve_target(kwargs.pop("_target_", None))
    for k in _HYDRA_KEYS:
        kwargs.pop(k, None)
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):  # some builtins have no signature; the call below then decides
        params = {"kwargs": inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)}
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(kwargs) - set(params))
        if unknown:
            raise ValueError(f"workload ({cls.__name__}): unknown keys {unknown}; allowed: {sorted(params)}")
        missing = sorted(n for n, p in params.items() if p.default is p.empty and n not in kwargs
                         and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
        if missing:
            raise ValueError(f"workload ({cls.__name__}): missing required keys {missing}")
    wl = cls(**kwargs)
    if not isinstance(wl, Workload):
        raise ValueError(f"workload._target_={cls.__module__}.{cls.__qualname__} does not implement Workload "
                         "(initial() and on_finish(state, now))")
    return wl
