"""The step log's columns in chunks (core.records.StepLog.column_chunks) are its columns, step by step as defined:
own steps from the columns, a fast-forwarded run's step m from its DecodeSteps record."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.batch import StepFeatures
from core.records import DecodeSteps, StepLog, StepRecord

NAMES = StepRecord.columns()
FEATURES = StepFeatures.names()


def random_log(seed: int, steps: int, times: str = "float") -> StepLog:
    """Own steps and several interleaved fast-forwarded runs (some closed, some still going, KV blocks changing,
    durations priced ahead). ``times``: ``float``; ``int0``: the clock starts at the int 0 (an own step's or a
    run's start); ``int``: every time an int."""
    rng = np.random.default_rng(seed)
    log, live = StepLog(), []  # live: [record, row callback, steps left]
    now = 0 if times != "float" else 0.0

    def duration():
        return int(rng.integers(1, 9)) if times == "int" else float(rng.integers(1, 999)) / 1024

    while len(log) < steps:
        u = rng.random()
        if u < 0.3 or (u < 0.4 and len(live) < 4):
            begin = now if times != "int0" or rng.random() < 0.5 else 0
            replica, seqs, kv, ctx = (int(rng.integers(0, 4)), int(rng.integers(1, 64)), int(rng.integers(0, 10**6)),
                                      int(rng.integers(1, 4096)))
            run = DecodeSteps(replica, seqs, kv, ctx, ctx, (ctx + 1) // 2, begin, [(0, int(rng.integers(0, 100)))],
                              durations=[duration() for _ in range(int(rng.integers(1, 40)))])
            live.append([run, log.add_run(run), int(rng.integers(1, len(run.durations) + 1))])
        elif u < 0.7 and live:
            entry = live[int(rng.integers(0, len(live)))]
            run, row, left = entry
            if rng.random() < 0.2:  # an allocation from step m on (at step 0 it replaces the initial count)
                m = len(run.ends)
                if run.blocks[-1][0] == m:
                    run.blocks.pop()
                run.blocks.append((m, int(rng.integers(0, 200))))
            now += duration()
            run.ends.append(now)
            row()
            entry[2] = left - 1
            if entry[2] == 0:
                live.remove(entry)
                if rng.random() < 0.8:
                    run.close()
        else:
            log.add(int(rng.integers(0, 4)), now, d := duration(), rng.integers(0, 2**40, len(FEATURES)).tolist(),
                    int(rng.integers(0, 200)), int(rng.integers(0, 3)))
            now += d
    return log


def reference_columns(log: StepLog) -> list:
    """The columns by definition, step by step: an own step's values from the columns; step m of a run starts at
    its begin (m = 0) or at the end of step m - 1, lasts durations[m], decodes num_seqs sequences each one token
    further than at step m - 1, with the KV blocks of the run's last change at or before m. The ints as int64
    arrays; the times float64 arrays when all are floats, else lists of the values as they are."""
    cols, seen, own, rows = log._cols, [0] * len(log._runs), 0, []
    for o in log._owner:
        if o < 0:
            rows.append([cols[c][own] for c in NAMES])
            own += 1
            continue
        r, m = log._runs[o], seen[o]
        seen[o] += 1
        n = r.num_seqs
        f = dict.fromkeys(FEATURES, 0) | {"num_seqs": n, "num_batched_tokens": n, "num_decode_seqs": n,
                                          "kv_tokens_read": r.kv_tokens_read + m * n,
                                          "max_context_len": r.max_context_len + m,
                                          "max_decode_context": r.max_decode_context + m,
                                          "min_decode_context": r.min_decode_context + m}
        rows.append([r.replica, r.ends[m - 1] if m else r.begin, r.durations[m], *(f[c] for c in FEATURES),
                     [b for s, b in r.blocks if s <= m][-1], 0])
    out = []
    for j, name in enumerate(NAMES):
        col = [row[j] for row in rows]
        if name not in ("start_s", "duration_s"):
            out.append(np.array(col, dtype=np.int64))
        else:
            out.append(np.array(col, dtype=np.float64) if all(type(v) is float for v in col) else col)
    return out


def assert_same_columns(a: list, b: list) -> None:
    """Equal columns of equal kinds: arrays of one dtype and values, or lists of the same values and types."""
    assert len(a) == len(b) == len(NAMES)
    for name, x, y in zip(NAMES, a, b, strict=True):
        assert type(x) is type(y), name
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), name
        else:
            assert [(type(v), v) for v in x] == [(type(v), v) for v in y], name


def concat(chunks: list[list]) -> list:
    return [np.concatenate(c) if isinstance(c[0], np.ndarray) else [v for part in c for v in part]
            for c in zip(*chunks, strict=True)]


@given(st.integers(0, 2**32), st.integers(0, 300), st.sampled_from(["float", "int0", "int"]),
       st.sampled_from([1, 7, 64, 299, 300, 301, 1000]))
def test_chunks_are_the_columns_step_by_step(seed, steps, times, rows):
    """Chunks smaller than, as long as and longer than the log (an empty one too): each ``rows`` rows (the last
    the rest; an empty log one chunk of empty columns) of the same kind, together the columns by definition."""
    log = random_log(seed, steps, times)
    chunks = list(log.column_chunks(rows))
    assert [len(c[0]) for c in chunks] == [min(rows, len(log) - lo) for lo in range(0, max(len(log), 1), rows)]
    ref = reference_columns(log)
    assert_same_columns(concat(chunks), ref)
    assert_same_columns(log.columns(), ref)
    assert all(type(c[j]) is type(ref[j]) for c in chunks for j in range(len(NAMES)))
    types = log.cell_types()
    assert types[NAMES.index("replica")] == {int}
    for name in ("start_s", "duration_s"):
        col = ref[NAMES.index(name)]
        assert types[NAMES.index(name)] == set(map(type, col.tolist() if isinstance(col, np.ndarray) else col))


def test_a_log_reads_back_its_records_with_runs():
    """Reads of a log with runs (through its columns) give the records the definition says."""
    log = random_log(3, 200, "int0")
    ref = reference_columns(log)
    f = len(FEATURES)
    for i in (0, 1, 57, 199):
        row = [c[i] for c in ref]
        rec = log[i]
        assert rec.row() == row and type(rec.start_s) is type(row[1])
        assert rec == StepRecord(row[0], row[1], row[2], StepFeatures(*row[3:3 + f]), row[-2], row[-1])


def test_the_columns_leave_the_log_appendable():
    log = random_log(5, 50)
    list(log.column_chunks(8))
    log.add(0, 1.5, 0.25, [1] * len(FEATURES), 2, 0)
    assert len(log) == 51 and log[-1].start_s == 1.5 and not math.isnan(log.columns()[1][-1])
    with pytest.raises(IndexError):
        log[51]
