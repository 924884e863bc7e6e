"""Per-step records: what steps.csv holds and what calibration fits, and the column store a run keeps them in."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, MutableSequence, Sequence
from dataclasses import astuple, dataclass, field
from functools import partial
from itertools import chain
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
    ``kv_tokens_read`` + m * ``num_seqs`` KV tokens read, max context ``max_context_len`` + m, decode contexts
    ``max_decode_context`` + m and ``min_decode_context`` + m); ``blocks``: (m,
    KV blocks in use from step m on), one pair per change. ``close`` leaves about 16 bytes a step."""

    replica: int
    num_seqs: int
    kv_tokens_read: int  # step 0's
    max_context_len: int  # step 0's
    max_decode_context: int  # step 0's
    min_decode_context: int  # step 0's
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
    among the others. ``column_chunks`` gives the columns a chunk of rows at a time (``columns``: all at once);
    reads rebuild equal StepRecords."""

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

    def cell_types(self) -> list[set[type]]:
        """Per column (``StepRecord.columns()`` order), the types of its values over the whole log: int for the
        integer columns; the times' own (float, or an int where a clock started at 0). It fixes each column's type
        before any chunk is built: the times are float64 arrays only when every time is a float, and a Parquet
        writer gives every chunk the whole column's type."""
        n = len(self)
        counts = np.zeros(len(self._runs), dtype=np.int64)
        for lo in range(0, n, 1 << 16):
            owner = np.array(self._owner[lo:min(lo + (1 << 16), n)], dtype=np.int64)
            counts += np.bincount(owner[owner >= 0], minlength=len(self._runs))
        live = [(r, c) for r, c in zip(self._runs, counts.tolist(), strict=True) if c]
        out = []
        for name in StepRecord.columns():
            if name not in FLOAT_COLUMNS:
                out.append({int})
                continue
            types = set(map(type, self._cols[name]))
            for r, c in live:  # step m starts at begin (m = 0) or ends[m - 1]
                times, k = (r.durations, c) if name == "duration_s" else (r.ends, c - 1)
                types |= {float} if isinstance(times, array) else set(map(type, times[:k]))
                if name == "start_s":
                    types.add(type(r.begin))
            out.append(types)
        return out

    def column_chunks(self, rows: int) -> Iterator[list[list | np.ndarray]]:
        """steps.csv's columns (``StepRecord.columns()`` order) ``rows`` rows at a time, as new objects: the ints as
        int64 arrays, the times as float64 arrays, or lists where a time in the log is not a float (``cell_types``).
        At least one chunk (an empty log: empty columns). A chunk costs O(rows) memory whatever the log's length:
        its own steps are a range of the columns, its fast-forwarded ones gathered from their runs' records."""
        n, names = len(self), StepRecord.columns()
        floats = {c for c, t in zip(names, self.cell_types(), strict=True) if t <= {float}}
        runs = _RunRows(self._runs)
        own = 0  # own steps before the chunk
        for lo in range(0, max(n, 1), rows):
            owner = np.array(self._owner[lo:min(lo + rows, n)], dtype=np.int64)
            mine = np.flatnonzero(owner < 0)
            theirs, their_cols = runs.rows(owner)
            chunk: list[list | np.ndarray] = []
            for name in names:
                mine_col, their_col = self._cols[name][own:own + len(mine)], their_cols.get(name, 0)
                if name in floats or name not in FLOAT_COLUMNS:
                    col = np.empty(len(owner), dtype=np.float64 if name in FLOAT_COLUMNS else np.int64)
                    col[mine] = mine_col
                    col[theirs] = _doubles(their_col) if name in FLOAT_COLUMNS else their_col
                    chunk.append(col)
                elif len(theirs):  # a time that is not a float: every value as it is
                    col = np.empty(len(owner), dtype=object)
                    col[mine], col[theirs] = mine_col, [t for part in their_col for t in part]
                    chunk.append(col.tolist())
                else:
                    chunk.append(mine_col)
            own += len(mine)
            yield chunk

    def columns(self) -> list[list | np.ndarray]:
        """steps.csv's columns (``column_chunks``, all rows in one chunk); the log stays appendable."""
        return next(self.column_chunks(max(len(self), 1)))


class _RunRows:
    """The rows of fast-forwarded decode runs' steps, chunk after chunk (``StepLog.column_chunks``): per run its
    constants as arrays and how many of its steps the chunks so far held, so a chunk's rows of a run are its next
    steps. ``blocks``: every run's (step, KV blocks in use from then on) changes, keyed (run << 32) | step."""

    def __init__(self, runs: Sequence[DecodeSteps]) -> None:
        def per_run(attr: str) -> np.ndarray:
            return np.array([getattr(r, attr) for r in runs], dtype=np.int64)

        self.runs = runs
        self.replica, self.num_seqs = per_run("replica"), per_run("num_seqs")
        self.kv_tokens_read, self.max_context_len = per_run("kv_tokens_read"), per_run("max_context_len")
        self.max_decode_context, self.min_decode_context = per_run("max_decode_context"), per_run("min_decode_context")
        self.seen = np.zeros(len(runs), dtype=np.int64)
        changes = np.fromiter(chain.from_iterable(chain.from_iterable(r.blocks for r in runs)), dtype=np.int64)
        per_run_changes = np.fromiter(map(len, map(attrgetter("blocks"), runs)), dtype=np.int64, count=len(runs))
        run = np.repeat(np.arange(len(runs), dtype=np.int64), per_run_changes)
        self.block_keys = (run << 32) | changes[0::2]  # each run's from step 0
        self.blocks = changes[1::2]

    def rows(self, owner: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray | list[Sequence[float]]]]:
        """The chunk's run rows (their positions, run by run, each run's in step order) and their columns (those
        not given are 0); the times as the runs' slices, to be concatenated."""
        theirs = np.flatnonzero(owner >= 0)
        theirs = theirs[np.argsort(owner[theirs], kind="stable")]
        run = owner[theirs]
        ks, first, counts = np.unique(run, return_index=True, return_counts=True)
        base = self.seen[ks]  # each run's steps in the chunks before
        m = np.arange(len(run)) - np.repeat(first - base, counts)  # step index within its run
        self.seen[ks] += counts
        n = self.num_seqs[run]
        blocks = self.blocks[np.searchsorted(self.block_keys, (run << 32) | m, "right") - 1]
        starts: list[Sequence[float]] = []
        durations: list[Sequence[float]] = []
        for k, a, c in zip(ks.tolist(), base.tolist(), counts.tolist(), strict=True):
            r = self.runs[k]
            starts += (r.ends[a - 1:a + c - 1],) if a else ([r.begin], r.ends[:c - 1])
            durations.append(r.durations[a:a + c])
        return theirs, {
            "replica": self.replica[run], "num_seqs": n, "num_batched_tokens": n, "num_decode_seqs": n,
            "kv_tokens_read": self.kv_tokens_read[run] + m * n, "max_context_len": self.max_context_len[run] + m,
            "max_decode_context": self.max_decode_context[run] + m,
            "min_decode_context": self.min_decode_context[run] + m,
            "kv_blocks_used": blocks, "start_s": starts, "duration_s": durations}


def _doubles(parts: list[Sequence[float]]) -> np.ndarray:
    """Float times concatenated into a float64 array (arrays of doubles copied as bytes)."""
    return np.frombuffer(b"".join(p if isinstance(p, array) else array("d", p) for p in parts), dtype=np.float64)
