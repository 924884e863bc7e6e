"""Workloads: where requests come from (open loop, closed loop, prefix sharing, traces).

Each class implements ``core.interfaces.Workload``, is built from a Hydra config through ``_target_``
(see ``conf/workload/``; ``experiments.build.build_workload`` instantiates it), and is deterministic for a given
seed.
"""

from __future__ import annotations

from core.workload.base import resolve_path
from core.workload.closed_loop import ClosedLoopWorkload
from core.workload.replay import AzureTrace, MooncakeTrace, RequestList
from core.workload.shared_prefix import MultiTurnWorkload, SharedPrefixWorkload
from core.workload.synthetic import SyntheticWorkload

__all__ = ["AzureTrace", "ClosedLoopWorkload", "MooncakeTrace", "MultiTurnWorkload", "RequestList",
           "SharedPrefixWorkload", "SyntheticWorkload", "resolve_path"]
