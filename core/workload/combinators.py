"""Two workload combinators the studies need: a mixture of open-loop workloads, and a window of one.

Both are ordinary workload classes (``_target_: core.workload.combinators.Mix``), so any run can use them. Their
nested workload configs reach them as factories: ``experiments.build.build_workload`` instantiates a workload
config nested in another as a Hydra partial, which the combinator calls (with a seed when the config has none).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from collections.abc import Callable, Iterator, Mapping
from itertools import islice

from core.checks import check_int
from core.request import Request
from core.workload.base import OpenLoop

HASH_ID_STRIDE = 1 << 40  # part k's content ids move to [k * stride, (k + 1) * stride): parts never share content

# A nested workload: built, or a factory (a Hydra partial of its config) that takes ``seed=``
Part = OpenLoop | Callable[..., OpenLoop]


def _open_loop(part: Part, key: str, seed: int) -> OpenLoop:
    """The built workload, or the factory called with ``seed`` unless its config set one."""
    if isinstance(part, Mapping):
        raise ValueError(f"workload.{key}: a workload config reaches Mix and Window instantiated (as a Hydra partial); "
                         "build the outer config with experiments.build.build_workload")
    if callable(part):
        given = part.keywords if isinstance(part, functools.partial) else {}
        try:
            part = part() if "seed" in given else part(seed=seed)
        except TypeError as e:  # an unknown or missing key of the nested config (Python names it)
            raise ValueError(f"workload.{key}: {e}") from e
    wl = part
    if not isinstance(wl, OpenLoop):
        raise ValueError(f"workload.{key}: {type(wl).__name__} is not open loop; Mix and Window take open-loop "
                         "workloads only (their requests must not depend on finish times)")
    return wl


class Mix(OpenLoop):
    """The union of open-loop workloads, e.g. chat traffic plus a trickle of long-document prompts.

    ``parts`` maps a name to a workload config (with ``_target_``; see the module docstring); part names prefix
    request ids (``chat/r3``) and requests merge by arrival time. Each part's content ids are shifted into its own
    range, so parts never share a prefix by accident. A part without ``seed`` gets ``seed + its index``.
    The first ``warmup_requests`` requests of the merged stream are warmup (parts may also flag their own).
    """

    def __init__(self, parts: Mapping[str, Part], warmup_requests: int = 0, seed: int = 0) -> None:
        if not isinstance(parts, Mapping) or not parts:
            raise ValueError(f"workload.parts must be a non-empty mapping name -> workload config, got {parts!r}")
        seed = check_int(seed, "workload.seed", 0)
        self.parts = {name: _open_loop(p, f"parts.{name}", seed + k) for k, (name, p) in enumerate(parts.items())}
        self.warmup_requests = check_int(warmup_requests, "workload.warmup_requests", 0)

    def initial(self) -> Iterator[Request]:
        streams = [_renamed(name, k, wl.initial()) for k, (name, wl) in enumerate(self.parts.items())]
        for i, r in enumerate(heapq.merge(*streams, key=lambda r: r.arrival_s)):
            yield dataclasses.replace(r, warmup=True) if i < self.warmup_requests else r


def _renamed(name: str, k: int, requests: Iterator[Request]) -> Iterator[Request]:
    for r in requests:
        ids = None if r.hash_ids is None else tuple(h + k * HASH_ID_STRIDE for h in r.hash_ids)
        yield dataclasses.replace(r, id=f"{name}/{r.id}", hash_ids=ids)


class Window(OpenLoop):
    """Requests ``skip`` .. ``skip + limit`` of an open-loop workload, at their original arrival times.

    With the same inner workload and ``warmup_requests = skip``, this is the measured part of a warm run
    replayed on a cold server (how the prefix-cache study measures "cache on, from cold").
    """

    def __init__(self, inner: Part, skip: int = 0, limit: int | None = None, seed: int = 0) -> None:
        self.inner = _open_loop(inner, "inner", check_int(seed, "workload.seed", 0))
        self.skip = check_int(skip, "workload.skip", 0)
        self.limit = None if limit is None else check_int(limit, "workload.limit", 1)

    def initial(self) -> Iterator[Request]:
        stop = None if self.limit is None else self.skip + self.limit
        for r in islice(self.inner.initial(), self.skip, stop):
            yield dataclasses.replace(r, warmup=False)
