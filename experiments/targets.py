"""What a config's ``_target_`` may name, checked before anything is called.

Hydra's ``instantiate`` calls whatever ``_target_`` names: ``_target_: os.system`` in a workload file would run a
shell command. Every plugin group is instantiated through ``experiments.build.instantiate_group``, which first
checks each ``_target_`` in the node (nested ones included) here:

- the group's own target must be a class that has the methods of the group's Protocol (a workload class needs
  ``initial`` and ``on_finish``), or a factory function whose return annotation is such a class;
- a nested target (the parts of ``core.workload.combinators.Mix``) must be a class, or a factory function with a
  return annotation naming a class.

Builtins and functions without a class return annotation (``os.system``, ``subprocess.run``, ``eval``) are refused
with the key to fix. Importing the target's module still runs its top-level code, as any Python import does.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Iterator
from typing import Any

from hydra.utils import get_object

from core.interfaces import EvictionPolicy, Placement, PreemptionPolicy, Router, Scheduler, SpeculationPolicy, Workload
from sim.cost.base import CostModel

GROUP_PROTOCOLS: dict[str, type] = {"workload": Workload, "scheduler": Scheduler, "eviction": EvictionPolicy,
                                    "router": Router, "cost_model": CostModel, "speculation": SpeculationPolicy,
                                    "placement": Placement, "preemption": PreemptionPolicy}


def protocol_methods(protocol: type) -> tuple[str, ...]:
    """The methods a class needs to implement ``protocol`` (public ones and ``__len__``)."""
    return tuple(sorted(name for name, v in vars(protocol).items()
                        if inspect.isfunction(v) and (not name.startswith("_") or name == "__len__")))


def _returned_classes(fn: Any) -> list[type]:
    """The classes a factory function's return annotation names (all members of a union); [] when unannotated."""
    try:
        ret = typing.get_type_hints(fn).get("return")
    except Exception:  # an annotation that does not resolve
        return []
    if isinstance(ret, types.UnionType) or typing.get_origin(ret) is typing.Union:
        members = typing.get_args(ret)
    else:
        members = (ret,)
    return [m for m in members if inspect.isclass(m) and m is not type(None)]


def _produced_classes(obj: Any) -> list[type]:
    if inspect.isclass(obj):
        return [obj]
    if inspect.isfunction(obj):  # a Python function (not a builtin like os.system)
        return _returned_classes(obj)
    return []


def _targets(node: Any, key: str) -> Iterator[tuple[str, str]]:
    """(key of the mapping, target) for every ``_target_`` in ``node``, outermost first."""
    if isinstance(node, dict):
        if "_target_" in node:
            yield key, node["_target_"]
        for k, v in node.items():
            if k != "_target_":
                yield from _targets(v, f"{key}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _targets(v, f"{key}[{i}]")


def check_targets(tree: dict[str, Any], group: str) -> None:
    """Refuse (ValueError naming the key) any ``_target_`` in ``tree`` that is not a plugin class or a factory of
    one; the group's own target must implement the group's Protocol (see the module docstring)."""
    protocol = GROUP_PROTOCOLS.get(group)
    for key, target in _targets(tree, group):
        where = f"{key}._target_={target!r}"
        if not isinstance(target, str) or not target:
            raise ValueError(f"{where}: must be a dotted path to a class, e.g. policies.routers.random.RandomRouter")
        try:
            obj = get_object(target)
        except Exception as e:
            raise ValueError(f"{where}: cannot import it ({e})") from None
        classes = _produced_classes(obj)
        if not classes:
            raise ValueError(f"{where} is not a class or a factory function annotated to return one; "
                             "refusing to call it")
        if key != group or protocol is None:
            continue
        need = protocol_methods(protocol)
        for cls in classes:
            missing = [m for m in need if not callable(getattr(cls, m, None))]
            if missing:
                raise ValueError(f"{where}: {cls.__qualname__} does not implement {protocol.__name__} "
                                 f"(missing {', '.join(missing)})")
