"""Per-step records: what steps.csv holds and what calibration fits, and the column store a run keeps them in."""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from dataclasses import astuple, dataclass
from operator import attrgetter
from typing import overload

import numpy as np

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


FLOAT_COLUMNS = ("start_s", "duration_s")
feature_values = attrgetter(*StepFeatures.names())  # StepFeatures -> its values in field order (a C-level getter)


class StepLog(Sequence[StepRecord]):
    """A run's steps, one column per steps.csv column: the integer columns as int64 arrays (8 bytes a value), the
    two times as lists of the clock's own values (a clock may start at the int 0, which steps.csv prints as ``0``),
    about 170 bytes a step where a StepRecord and its StepFeatures (with their int and float objects) take several
    hundred. A day-long trace on many replicas keeps millions of steps. Reads rebuild equal StepRecords;
    ``columns`` gives the columns."""

    def __init__(self, records: Iterator[StepRecord] | Sequence[StepRecord] = ()) -> None:
        self._cols = {c: [] if c in FLOAT_COLUMNS else array("q") for c in StepRecord.columns()}
        self._feature_cols = [self._cols[c] for c in StepFeatures.names()]
        c = self._cols
        self._head = (c["replica"].append, c["start_s"].append, c["duration_s"].append)
        self._tail = (c["kv_blocks_used"].append, c["num_preempted"].append)
        for r in records:
            self.append(r)

    def append(self, r: StepRecord) -> None:
        self.add(r.replica, r.start_s, r.duration_s, feature_values(r.features), r.kv_blocks_used, r.num_preempted)

    def add(self, replica: int, start_s: float, duration_s: float, features: Sequence[int], kv_blocks_used: int,
            num_preempted: int) -> None:
        """A step from its values (``features`` in ``StepFeatures.names()`` order), with no record built."""
        put_replica, put_start, put_duration = self._head
        put_replica(replica), put_start(start_s), put_duration(duration_s)
        for col, v in zip(self._feature_cols, features, strict=True):
            col.append(v)
        put_blocks, put_preempted = self._tail
        put_blocks(kv_blocks_used), put_preempted(num_preempted)

    def __len__(self) -> int:
        return len(self._cols["replica"])

    def _record(self, i: int) -> StepRecord:
        c = self._cols
        return StepRecord(c["replica"][i], c["start_s"][i], c["duration_s"][i],
                          StepFeatures(*(col[i] for col in self._feature_cols)), c["kv_blocks_used"][i],
                          c["num_preempted"][i])

    @overload
    def __getitem__(self, i: int) -> StepRecord: ...

    @overload
    def __getitem__(self, i: slice) -> list[StepRecord]: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._record(k) for k in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"step {i} of {n}")
        return self._record(i % n)

    def __iter__(self) -> Iterator[StepRecord]:
        return (self._record(i) for i in range(len(self)))

    def columns(self) -> list[list | np.ndarray]:
        """steps.csv's columns (``StepRecord.columns()`` order): the times as lists, the rest as int64 arrays (a
        copy: no Python int per value, and the log stays appendable)."""
        return [list(self._cols[c]) if c in FLOAT_COLUMNS else np.frombuffer(self._cols[c], dtype=np.int64).copy()
                for c in StepRecord.columns()]
