"""The adapter's plugin, chosen the project's way: Hydra overrides of the scheduler group, composed with conf/.

``TWINSERVE_SCHEDULER="scheduler=priority scheduler.max_num_batched_tokens=256"`` (environment) or vLLM's
``--additional-config '{"twinserve_scheduler": "scheduler=priority ..."}'`` selects the plugin; neither: the project's
default scheduler group. Only the scheduler group applies inside vLLM (its KV cache manager keeps vLLM's own
eviction), so any other override is refused rather than silently ignored.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ENV = "TWINSERVE_SCHEDULER"
ADDITIONAL_KEY = "twinserve_scheduler"  # the key in vLLM's additional_config


@dataclass(frozen=True)
class PluginChoice:
    """The plugin and the scheduler group's budgets (``SchedulerLimits`` is built against vLLM's own limits)."""

    scheduler: Any
    name: str  # the plugin's _target_, for the log line
    max_num_batched_tokens: int
    max_num_seqs: int
    overrides: tuple[str, ...]


def overrides_from(environ: Mapping[str, str], additional_config: Any) -> list[str]:
    """The overrides from vLLM's additional_config (a string or a list of strings under ``twinserve_scheduler``) or
    the ``TWINSERVE_SCHEDULER`` environment variable (a shell-quoted string); both set is an error."""
    given = additional_config.get(ADDITIONAL_KEY) if isinstance(additional_config, Mapping) else None
    env = environ.get(ENV, "").strip()
    if given is not None and env:
        raise ValueError(f"twinserve scheduler chosen twice: additional_config.{ADDITIONAL_KEY}={given!r} and "
                         f"{ENV}={env!r}; set one")
    if given is None:
        return shlex.split(env)
    if isinstance(given, str):
        return shlex.split(given)
    if isinstance(given, Sequence) and all(isinstance(o, str) for o in given):
        return list(given)
    raise ValueError(f"additional_config.{ADDITIONAL_KEY} must be a string or a list of strings, got {given!r}")


def check_overrides(overrides: Sequence[str]) -> None:
    """Only ``scheduler=<name>`` and ``scheduler.<key>=<value>`` (``+``/``~`` forms included) carry into vLLM."""
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if "=" not in o and not o.startswith("~"):
            raise ValueError(f"{ENV}: {o!r} is not a Hydra override (key=value)")
        if key != "scheduler" and not key.startswith("scheduler."):
            raise ValueError(f"{ENV}: {o!r} does not apply inside vLLM: only the scheduler group does (vLLM keeps "
                             "its own KV cache manager, eviction and model settings)")


def choose(overrides: Sequence[str]) -> PluginChoice:
    """Compose conf/config.yaml with ``overrides`` and instantiate the scheduler group's plugin (its budgets aside,
    as ``experiments.build.build_replicas`` does)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from core.checks import check_int
    from experiments.build import instantiate_group
    from experiments.config import CONF_DIR, LIMIT_KEYS, plain

    check_overrides(overrides)
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    group = plain(cfg.scheduler)
    missing = [k for k in LIMIT_KEYS if k not in group]
    if missing:
        raise ValueError(f"scheduler config lacks {missing}")
    budget, seqs = (check_int(group[k], f"scheduler.{k}", 1, whole_float=True) for k in LIMIT_KEYS)
    node = OmegaConf.create({k: v for k, v in group.items() if k not in LIMIT_KEYS})
    return PluginChoice(instantiate_group(node, "scheduler"), str(group.get("_target_")), budget, seqs,
                        tuple(overrides))


def choose_from(environ: Mapping[str, str] | None = None, additional_config: Any = None) -> PluginChoice:
    return choose(overrides_from(os.environ if environ is None else environ, additional_config))
