"""Per-step records: what steps.csv holds and what calibration fits."""

from __future__ import annotations

from dataclasses import astuple, dataclass

from core.batch import StepFeatures


@dataclass(frozen=True, slots=True)
class StepRecord:
    replica: int
    start_s: float
    duration_s: float
    features: StepFeatures
    kv_blocks_used: int
    num_preempted: int

    @staticmethod
    def columns() -> list[str]:
        return ["replica", "start_s", "duration_s", *StepFeatures.names(), "kv_blocks_used", "num_preempted"]

    def row(self) -> list:
        return [self.replica, self.start_s, self.duration_s, *astuple(self.features),
                self.kv_blocks_used, self.num_preempted]
