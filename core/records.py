"""Per-step records: what steps.csv holds and what calibration fits, and the column store a run keeps them in."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, MutableSequence, Sequence
from dataclasses import astuple, dataclass, field
from functools import partial
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


@dataclass(slots=True)
class DecodeSteps:
    """The steps of one fast-forwarded decode run (``core.fast_forward``) as the run's own data, not a row of
    values per step: step m starts at ``begin`` (m = 0) or at ``ends[m - 1]``, lasts ``durations[m]``, and decodes
    ``num_seqs`` sequences, each one token further than at step m - 1 (``core.fast_forward.decode_features``:
    ``kv_tokens_read`` + m * ``num_seqs`` KV tokens read, max context ``max_context_len`` + m); ``blocks``: (m,
    KV blocks in use from step m on), one pair per change. ``close`` leaves about 16 bytes a step."""

    replica: int
    num_seqs: int
    kv_tokens_read: int  # step 0's
    max_context_len: int  # step 0's
    begin: float
    blocks: list[tuple[int, int]]
    ends: MutableSequence[float] = field(default_factory=list)  # appended by the run as each step ends
    durations: Sequence[float] = ()  # priced ahead: at least one per step taken

    def close(self) -> None:
        """The run is over: durations cut to the steps taken, the times as flat arrays of doubles when they are
        all floats (a clock's int time keeps its type in a list: steps.csv prints it as an int)."""
        n = len(self.ends)
        self.ends, self.durations = _compact(self.ends), _compact(self.durations[:n])


def _compact(values: Sequence[float]) -> Sequence[float]:
    return array("d", values) if set(map(type, values)) <= {float} else list(values)


class StepLog(Sequence[StepRecord]):
    """A run's steps in steps.csv's column order, in about 170 bytes a step where a StepRecord and its StepFeatures
    (with their int and float objects) take several hundred, and about 24 a fast-forwarded decode step: a
    day-long trace on many replicas keeps millions of steps.

    A step the loop applied (``add``) goes into the columns: the integer ones as int64 arrays, the two times as
    lists of the clock's own values (a clock may start at the int 0, which steps.csv prints as ``0``). The steps of
    a fast-forwarded decode run are its ``DecodeSteps`` (``add_run``) plus one int a step saying where it stands
    among the others. ``columns`` gives the columns; reads rebuild equal StepRecords."""

    def __init__(self, records: Iterator[StepRecord] | Sequence[StepRecord] = ()) -> None:
        self._cols = {c: [] if c in FLOAT_COLUMNS else array("q") for c in StepRecord.columns()}
        self._feature_cols = [self._cols[c] for c in StepFeatures.names()]
        c = self._cols
        self._head = (c["replica"].append, c["start_s"].append, c["duration_s"].append)
        self._tail = (c["kv_blocks_used"].append, c["num_preempted"].append)
        self._owner = array("q")  # per step: -1 (in the columns) or the index of its decode run in _runs
        self._runs: list[DecodeSteps] = []
        self._read: tuple[int, list[list]] | None = None  # (length, columns as lists) for reads after add_run
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
        self._owner.append(-1)

    def add_run(self, run: DecodeSteps) -> Callable[[], None]:
        """A fast-forwarded decode run's steps: returns what the run calls as each step ends (after appending the
        step's end time to ``run.ends``), which places that step after every step logged so far."""
        self._runs.append(run)
        return partial(self._owner.append, len(self._runs) - 1)

    def __len__(self) -> int:
        return len(self._owner)

    def _record(self, i: int) -> StepRecord:
        if self._runs:
            if self._read is None or self._read[0] != len(self):
                self._read = (len(self), [c.tolist() if isinstance(c, np.ndarray) else c for c in self.columns()])
            c = self._read[1]
            f = len(StepFeatures.names())
            return StepRecord(c[0][i], c[1][i], c[2][i], StepFeatures(*(col[i] for col in c[3:3 + f])), c[-2][i],
                              c[-1][i])
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
        """steps.csv's columns (``StepRecord.columns()`` order), new objects (the log stays appendable): the ints
        as int64 arrays, the times as float64 arrays, or lists where a time is not a float."""
        if not self._runs:
            return [list(self._cols[c]) if c in FLOAT_COLUMNS else np.array(self._cols[c], dtype=np.int64)
                    for c in StepRecord.columns()]
        owner = np.array(self._owner, dtype=np.int64)
        mine = np.flatnonzero(owner < 0)
        theirs = np.flatnonzero(owner >= 0)
        counts = np.bincount(owner[theirs], minlength=len(self._runs))
        theirs = theirs[np.argsort(owner[theirs], kind="stable")]  # run by run, each in step order
        run_cols = _run_columns(self._runs, counts)
        out: list[list | np.ndarray] = []
        for name in StepRecord.columns():
            mine_col, their_col = self._cols[name], run_cols.get(name, 0)
            if name in FLOAT_COLUMNS and not (isinstance(their_col, np.ndarray)
                                              and set(map(type, mine_col)) <= {float}):
                col = np.empty(len(owner), dtype=object)  # a time that is not a float: every value as it is
                col[mine], col[theirs] = mine_col, their_col
                out.append(col.tolist())
                continue
            col = np.empty(len(owner), dtype=np.float64 if name in FLOAT_COLUMNS else np.int64)
            col[mine], col[theirs] = mine_col, their_col
            out.append(col)
        return out


def _run_columns(runs: Sequence[DecodeSteps], counts: np.ndarray) -> dict[str, np.ndarray | list]:
    """The columns of decode runs' steps (run after run, ``counts[k]`` steps of run k; the columns not given are
    0), vectorised over every run at once. The times are float64 arrays, or lists where one is not a float."""
    first = np.cumsum(counts) - counts  # each run's first row
    m = np.arange(int(counts.sum())) - np.repeat(first, counts)  # step index within its run

    def per_run(attr: str) -> np.ndarray:
        return np.repeat(np.array([getattr(r, attr) for r in runs], dtype=np.int64), counts)

    n = per_run("num_seqs")
    changes = [(f + s, b) for r, f, c in zip(runs, first.tolist(), counts.tolist(), strict=True) if c
               for s, b in r.blocks if s < c]
    at = np.array([a for a, _ in changes], dtype=np.int64)
    blocks = np.array([b for _, b in changes], dtype=np.int64)[np.searchsorted(at, np.arange(len(m)), "right") - 1]
    cols: dict[str, np.ndarray | list] = {
        "replica": per_run("replica"), "num_seqs": n, "num_batched_tokens": n, "num_decode_seqs": n,
        "kv_tokens_read": per_run("kv_tokens_read") + m * n, "max_context_len": per_run("max_context_len") + m,
        "kv_blocks_used": blocks}
    live = [(r, c) for r, c in zip(runs, counts.tolist(), strict=True) if c]
    ends = _times([r.ends[:c] for r, c in live])
    durations = _times([r.durations[:c] for r, c in live])
    begins = [r.begin for r, _ in live]
    if isinstance(ends, np.ndarray) and set(map(type, begins)) <= {float}:
        starts = np.empty(len(m))
        starts[1:] = ends[:-1]
        starts[first[counts > 0]] = begins
    else:
        starts = [t for (r, c), b in zip(live, begins, strict=True) for t in (b, *r.ends[:c - 1])]
    return {**cols, "start_s": starts, "duration_s": durations}


def _times(parts: list[Sequence[float]]) -> np.ndarray | list:
    """Concatenated times: a float64 array when every part is an array of doubles or a list of floats, else a
    list of the values as they are."""
    if all(isinstance(p, array) or set(map(type, p)) <= {float} for p in parts):
        return np.frombuffer(b"".join(p if isinstance(p, array) else array("d", p) for p in parts), dtype=np.float64)
    return [t for p in parts for t in p]
