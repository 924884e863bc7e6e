"""The output files of one run (docs/outputs.md) and readers for them.

Both backends write the same files: requests.csv, tokens.csv, steps.csv, metrics.json. Formatting is
deterministic (floats by ``repr``, requests ordered by arrival then input order, JSON with sorted keys),
so equal runs give byte-identical files. Missing values are empty CSV cells and ``null`` in JSON
(NaN and infinities included). Wall-clock facts (how long the run took) go to timing.json, never to
metrics.json, which stays byte-identical across same-seed reruns.

``write_run`` is the one writer of a run directory (the simulator and engine runs, the server's periodic flush,
loadgen): every file is written into a temporary directory inside the run directory and renamed into place,
metrics.json last, after the run files an earlier run left there were removed. metrics.json's ``run_status`` says
what the directory holds: ``complete``; ``running`` (a server's periodic flush); ``interrupted`` (the run or the
writing stopped early: Ctrl-C, an error, ``error`` says which); ``failed`` (it ended, but too many of its
requests failed: a load test against a dead server). Only a complete run's data files carry their
usual names; any other run keeps them as ``<name>.partial`` (``requests.csv.partial``, ...), which no reader of
run directories opens by mistake. A crash between the renames leaves no metrics.json at all: no metrics.json, or
one whose ``run_status`` is not ``complete``, means the directory does not hold a complete run.

Formats (``write_run``'s ``file_format``, config ``output.format``): ``csv`` (default) or ``parquet`` (requests.parquet,
tokens.parquet, steps.parquet: same columns, numeric columns int64 / float64 with nulls where the CSV has empty
cells, text columns as strings). ``read_table`` / ``read_requests`` / ``read_tokens`` / ``read_steps`` read either
(a run directory, or a file path: a ``.csv`` path that is absent falls back to its ``.parquet`` sibling) into the
same numpy columns. ``tokens`` (``output.tokens``): ``all`` writes the tokens file, ``none`` writes none (the
metrics come from the request states, not from that file). CSV cells are formatted column by column (numpy, ``map``)
into exactly the bytes ``csv.writer`` over ``fmt`` cells gives. A run's steps are written ``_CHUNK_ROWS`` rows at a
time (``StepLog.column_chunks``; a Parquet row group each, every column of its whole column's type): millions of
steps take no more memory to write than one chunk.
"""

from __future__ import annotations

import contextlib
import csv
import enum
import io
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from operator import attrgetter
from pathlib import Path
from typing import Any

import numpy as np

from core.batch import LATER_FEATURES, StepFeatures
from core.checks import check_choice
from core.metrics import RequestMetrics, float_times, many_request_metrics, output_events, request_metrics
from core.records import StepLog, StepRecord
from core.request import RequestState

REQUEST_COLUMNS = ("id", "replica", "tenant", "arrival_s", "first_scheduled_s", "first_token_s", "finish_s",
                   "prompt_tokens", "output_tokens", "cached_tokens", "num_preemptions", "status", "ttft_s", "tpot_s",
                   "e2e_s", "max_stall_s", "reason", "warmup")
TOKEN_COLUMNS = ("request_id", "index", "time_s", "num_tokens")  # index: the event's position in its response
_STR_COLUMNS = ("id", "tenant", "status", "reason", "request_id", "backend")  # backend: the gateway's

COMPLETE, RUNNING, INTERRUPTED = "complete", "running", "interrupted"  # metrics.json's run_status
FAILED = "failed"  # the run ended, but too many of its requests failed (a load test: target.max_failed_share)
RUN_STATUSES = (COMPLETE, RUNNING, INTERRUPTED, FAILED)
FORMATS = ("csv", "parquet")  # output.format
TOKEN_OUTPUTS = ("all", "none")  # output.tokens: every output event in the tokens file, or no tokens file
TABLES = ("requests", "tokens", "steps")
CSV_FILES = tuple(f"{t}.csv" for t in TABLES)
PARQUET_FILES = tuple(f"{t}.parquet" for t in TABLES)
DATA_FILES = (*CSV_FILES, *PARQUET_FILES)
# Every file a run may write into its directory (plots included). Before a run's files are renamed into place,
# these and their .partial forms are removed, so a reused directory never mixes two runs.
RUN_FILES = (*DATA_FILES, "metrics.json", "timing.json", "outputs.jsonl", "config.yaml", "bench_serve.json",
             "client.csv", "latency_cdfs.png", "step_timeline.png")
PARTIAL_SUFFIX = ".partial"
_CHUNK_ROWS = 65536  # rows formatted and written at a time: memory for the text stays bounded
_QUOTED = (",", '"', "\r", "\n")  # a cell holding one of these is quoted by csv.writer (QUOTE_MINIMAL)


def check_output_options(fmt: Any, tokens: Any) -> tuple[str, str]:
    """``output.format`` (csv | parquet) and ``output.tokens`` (all | none), checked."""
    return check_choice(fmt, "output.format", FORMATS), check_choice(tokens, "output.tokens", TOKEN_OUTPUTS)


def fmt(v: Any) -> str:
    """One CSV cell: '' for None/NaN, 0/1 for bools, repr for floats (round-trips exactly)."""
    if v is None:
        return ""
    if isinstance(v, bool | np.bool_):
        return "1" if v else "0"
    if isinstance(v, int | np.integer):
        return str(int(v))
    if isinstance(v, float | np.floating):
        return repr(float(v)) if math.isfinite(v) else ""
    if isinstance(v, enum.Enum):
        return str(v.value)
    return str(v)


def jsonable(x: Any) -> Any:
    """Plain JSON types: numpy scalars/arrays unwrapped, NaN/inf -> None, enums -> value, tuples -> lists."""
    if isinstance(x, Mapping):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple | np.ndarray):
        return [jsonable(v) for v in x]
    if isinstance(x, bool | np.bool_):
        return bool(x)
    if isinstance(x, int | np.integer):
        return int(x)
    if isinstance(x, float | np.floating):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, enum.Enum):
        return x.value
    if isinstance(x, Path):
        return str(x)
    return x


def dumps_metrics(metrics: Mapping[str, Any]) -> str:
    return json.dumps(jsonable(metrics), sort_keys=True, indent=2, allow_nan=False) + "\n"


def request_row(state: RequestState, m: RequestMetrics | None = None) -> list[Any]:
    """requests.csv's row of ``state`` (``m``: its metrics, when already computed)."""
    r, m = state.request, m or request_metrics(state)
    return [r.id, state.replica, r.tenant, r.arrival_s, state.first_scheduled_s, state.first_token_s, state.finish_s,
            r.prompt_len, state.num_output_tokens, state.num_cached_tokens, state.num_preemptions, state.status,
            m.ttft_s, m.tpot_s, m.e2e_s, m.max_stall_s, state.reason, r.warmup]


# ---- columns: what each data file holds, as Python lists or numpy arrays (one per column) ------------------------
Column = list | np.ndarray


def request_columns(states: Sequence[RequestState]) -> list[Column]:
    """requests.csv's columns (``REQUEST_COLUMNS``) of ``states`` in the order given (``request_row`` per state)."""
    metrics = many_request_metrics(states)
    rows = [request_row(s, m) for s, m in zip(states, metrics, strict=True)]
    return [list(c) for c in zip(*rows, strict=True)] if rows else [[] for _ in REQUEST_COLUMNS]


def token_columns(states: Sequence[RequestState]) -> list[Column]:
    """tokens.csv's columns (``TOKEN_COLUMNS``: one row per output event, ``core.metrics.output_events``) of
    ``states`` in the order given, computed with numpy over all token times at once."""
    folded = next((s for s in states if s.folded is not None), None)
    if folded is not None:
        raise ValueError(f"request {folded.id}'s token times were folded into the run's ITL pool "
                         "(output.tokens=none): no tokens file can be written from it")
    arrays = [float_times(s.token_times) for s in states]
    if any(a is None for a in arrays):  # exact (slow) path for hand-made states with non-float times
        rows = [(s.id, i, t, k) for s in states for i, (t, k) in enumerate(output_events(s.token_times))]
        return [list(c) for c in zip(*rows, strict=True)] if rows else [[] for _ in TOKEN_COLUMNS]
    lens = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    times = np.concatenate(arrays) if arrays else np.empty(0)
    owner = np.repeat(np.arange(len(arrays)), lens)
    starts = np.ones(len(times), dtype=bool)  # an event starts at each request's first token and at each new time
    starts[1:] = (times[1:] != times[:-1]) | (owner[1:] != owner[:-1])
    first = np.flatnonzero(starts)
    counts = np.diff(np.append(first, len(times)))
    ev_owner = owner[first]
    index = np.arange(len(first)) - np.searchsorted(ev_owner, ev_owner, side="left")
    ids = np.array([s.id for s in states] or [""], dtype=object)
    return [ids[ev_owner], index, times[first], counts]


def step_columns(steps: Sequence[StepRecord]) -> list[Column]:
    """steps.csv's columns (``StepRecord.columns()``: the record's fields, its features spread out)."""
    if isinstance(steps, StepLog):  # a run's own column store
        return steps.columns()
    feats = set(StepFeatures.names())
    return [list(map(attrgetter(f"features.{c}" if c in feats else c), steps)) for c in StepRecord.columns()]


def step_chunks(steps: Sequence[StepRecord], rows: int | None = None) -> Iterator[list[Column]]:
    """``step_columns`` in chunks of ``rows`` rows (default ``_CHUNK_ROWS``): a StepLog's never built whole
    (``StepLog.column_chunks``: millions of steps are written in bounded memory), a list of records' as one chunk."""
    if isinstance(steps, StepLog):
        yield from steps.column_chunks(rows or _CHUNK_ROWS)
    else:
        yield step_columns(steps)


def _one_chunk(build: Callable[[], list[Column]]) -> Iterator[list[Column]]:
    """``build()``'s columns as the only chunk, built when asked for (after the file's header is written)."""
    yield build()


def _quote(cells: list[str]) -> list[str]:
    """What csv.writer (QUOTE_MINIMAL, lineterminator "\\n") writes for each text cell: the rare cell holding a
    delimiter, quote or line break goes through csv.writer itself."""
    joined = "".join(cells)
    if not any(c in joined for c in _QUOTED):
        return cells
    out = []
    for c in cells:
        if any(q in c for q in _QUOTED):
            buf = io.StringIO()
            csv.writer(buf, lineterminator="\n").writerow([c])
            c = buf.getvalue()[:-1]
        out.append(c)
    return out


def _repeated(a: np.ndarray, cell) -> list[str] | None:
    """Cells of a long column with few distinct values (step shapes, token counts, decode step times): each distinct
    value formatted once, then gathered by numpy; None when that does not pay (or -0.0 could merge with 0.0)."""
    if len(a) < 4096:
        return None
    if a.dtype.kind == "f" and np.signbit(a[a == 0]).any():
        return None
    u, inv = np.unique(a, return_inverse=True)
    if len(u) * 4 > len(a):
        return None
    return np.array([cell(v) for v in u.tolist()], dtype=object)[inv.reshape(-1)].tolist()


def _cells(col: Column) -> list[str]:
    """``fmt`` of every cell of a column, as csv.writer writes it, with C-level loops for the common column types."""
    if isinstance(col, list) and len(col) >= 4096 and type(col[0]) in (int, float):
        types = set(map(type, col))
        if types == {int}:
            with contextlib.suppress(OverflowError):  # beyond int64: the list path below
                col = np.array(col, dtype=np.int64)
        elif types == {float}:
            col = np.array(col, dtype=np.float64)
    if isinstance(col, np.ndarray):
        kind = col.dtype.kind
        if kind in "iu":
            return _repeated(col, str) or list(map(str, col.tolist()))
        if kind == "f":
            if not np.isfinite(col).all():
                return [fmt(v) for v in col.tolist()]
            return _repeated(col, repr) or list(map(repr, col.tolist()))
        if kind == "b":
            return ["1" if v else "0" for v in col.tolist()]
        col = col.tolist()
    types = set(map(type, col))
    if types <= {int}:
        return list(map(str, col))
    if types <= {int, float}:  # repr of a Python int or float is fmt's cell (ints stay ints: "0", not "0.0")
        return list(map(repr, col)) if all(map(math.isfinite, col)) else [fmt(v) for v in col]
    if types <= {str}:
        return _quote(col)
    return _quote([fmt(v) for v in col])


def _write_csv(path: Path, header: Sequence[str], chunks: Iterable[Sequence[Column]],
               types: Sequence[set[type]] | None = None) -> None:
    """The header, then the rows of each chunk of columns (taken after the header is written: a file cut short by
    an error still shows what it is) formatted column by column, ``_CHUNK_ROWS`` rows at a time. A cell's text
    does not depend on the chunks. (``types``: as ``_write_parquet``'s, not needed here.)"""
    # backslashreplace: a text no UTF-8 can hold (a lone surrogate) is escaped, never a failed write
    with open(path, "w", newline="", encoding="utf-8", errors="backslashreplace") as f:
        f.write(",".join(_quote(list(header))) + "\n")
        for columns in chunks:
            n = len(columns[0]) if columns else 0
            for lo in range(0, n, _CHUNK_ROWS):
                cells = [_cells(c[lo:lo + _CHUNK_ROWS]) for c in columns]
                f.write("\n".join(map(",".join, zip(*cells, strict=True))) + "\n")


def _cell_types(col: Column) -> set[type]:
    """The types of a column's cells (a numeric array's: int, float or bool, even with no cells)."""
    if isinstance(col, np.ndarray) and col.dtype.kind in "iufb":
        return {float if col.dtype.kind == "f" else bool if col.dtype.kind == "b" else int}
    return set(map(type, col.tolist() if isinstance(col, np.ndarray) else col))


def _arrow_type(types: set[type]):
    """The Parquet type of a column whose cells have these types (``_cell_types``): int64 (ints, None -> null),
    bool, float64 (numbers with a float or a bool among them; no cells at all), else string."""
    import pyarrow as pa

    types = types - {type(None)}
    if types and types <= {bool, np.bool_}:
        return pa.bool_()
    if types and all(issubclass(t, int | np.integer) and not issubclass(t, bool) for t in types):
        return pa.int64()
    if all(issubclass(t, int | float | np.integer | np.floating) for t in types):
        return pa.float64()
    return pa.string()


def _arrow_column(col: Column, arrow_type=None):
    """One column as a pyarrow array of ``arrow_type`` (default: ``_arrow_type`` of its cells; a chunk of a column
    takes the whole column's): int64 (None -> null), bool, float64 (None and non-finite -> null, as the CSV's empty
    cell), or string (``fmt`` of each cell: enums by value)."""
    import pyarrow as pa

    types = _cell_types(col)
    t = _arrow_type(types) if arrow_type is None else arrow_type
    if t == pa.float64():
        x = np.asarray(col, dtype=np.float64)  # None -> NaN
        return pa.array(x, type=t, mask=~np.isfinite(x))
    if isinstance(col, np.ndarray) and col.dtype.kind in "iub" and t != pa.string():
        return pa.array(col, type=t)
    vals = col.tolist() if isinstance(col, np.ndarray) else col
    if types <= ({int} if t == pa.int64() else {str} if t == pa.string() else set()):
        return pa.array(vals, type=t)
    if t == pa.string():
        return pa.array([fmt(v) for v in vals], type=t)
    cast = bool if t == pa.bool_() else int
    return pa.array([None if v is None else cast(v) for v in vals], type=t)


def _write_parquet(path: Path, header: Sequence[str], chunks: Iterable[Sequence[Column]],
                   types: Sequence[set[type]] | None = None) -> None:
    """One row group per chunk of columns, each column of the type ``_arrow_column`` gives the whole column: from
    ``types`` (per column, its cells' types over all chunks: ``_cell_types``), else from the first chunk (the only
    one, or one that has every type its column has)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.touch()  # as _write_csv: a file that was being written when an error came
    schema = None if types is None else pa.schema([(n, _arrow_type(t)) for n, t in zip(header, types, strict=True)])
    writer = None
    try:
        for columns in chunks:
            arrays = [_arrow_column(c, None if schema is None else schema.field(i).type)
                      for i, c in enumerate(columns)]
            if writer is None:
                schema = pa.schema([(n, a.type) for n, a in zip(header, arrays, strict=True)])
                writer = pq.ParquetWriter(path, schema)
            writer.write_table(pa.Table.from_arrays(arrays, schema=schema))
        if writer is None:  # no chunks: no rows
            writer = pq.ParquetWriter(path, schema or pa.schema([(n, pa.float64()) for n in header]))
    finally:
        if writer is not None:
            writer.close()


def remove_run_files(out_dir: str | Path) -> list[str]:
    """Remove the run files (``RUN_FILES``, complete or ``.partial``) an earlier run left in ``out_dir``; returns
    the names removed. Other files and every subdirectory (Hydra's .hydra/, a sweep's jobs) stay."""
    out, removed = Path(out_dir), []
    for name in RUN_FILES:
        for n in (name, name + PARTIAL_SUFFIX):
            p = out / n
            if p.is_file() or p.is_symlink():
                p.unlink()
                removed.append(n)
    return removed


def write_run(out_dir: str | Path, states: Iterable[RequestState], steps: Iterable[StepRecord] | None,
              metrics: Mapping[str, Any], extra_files: Mapping[str, str | bytes] | None = None, *,
              timing: Mapping[str, Any] | None = None, run_status: str = COMPLETE, file_format: str = "csv",
              tokens: str = "all",
              extra_request_columns: Mapping[str, Callable[[RequestState], Any]] | None = None,
              extra_step_columns: Mapping[str, int] | None = None) -> dict[str, Path]:
    """Write the run's files into ``out_dir`` (created if needed); returns name -> path as written.

    requests, tokens (unless ``tokens`` is ``none``) and steps (none when ``steps`` is None: a black box has no
    steps) as ``.csv`` or, with ``file_format="parquet"``, ``.parquet`` files; ``extra_files``
    (a file name inside ``out_dir`` -> its text or bytes, e.g. the resolved config), timing.json (``timing``:
    wall-clock facts) and metrics.json, with ``run_status`` added, last. Files go to a temporary directory first,
    then the run files an earlier run left are removed and the new ones renamed into place. Unless ``run_status``
    is ``complete`` the data files are named ``<name>.partial``. If writing fails or is interrupted (any exception,
    KeyboardInterrupt included), what was written is kept as ``.partial`` files beside a metrics.json whose
    ``run_status`` is ``interrupted``, and the exception propagates. ``extra_request_columns``: more requests-file
    columns after the usual ones, name -> the cell of a request (a PD cluster's transfer columns);
    ``extra_step_columns``: more steps-file columns after the usual ones, name -> the run's one value (a tensor-
    parallel run's rank count).
    """
    if run_status not in RUN_STATUSES:
        raise ValueError(f"run_status must be one of {RUN_STATUSES}, got {run_status!r}")
    ext, tokens = check_output_options(file_format, tokens)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tables = ["requests", *(["tokens"] if tokens == "all" else []), *(["steps"] if steps is not None else [])]
    names = [f"{t}.{ext}" for t in tables]
    for name in extra_files or {}:
        if Path(name).name != name or name in (*names, "metrics.json", "timing.json") or name.startswith("."):
            raise ValueError(f"extra file name {name!r} must be a new plain file name inside the run directory")
    metrics = {**metrics, "run_status": run_status}
    write = _write_parquet if ext == "parquet" else _write_csv
    stage = Path(tempfile.mkdtemp(prefix=".writing-", dir=out))
    try:
        try:
            ordered = sorted(states, key=lambda s: s.request.arrival_s)  # stable: ties keep the caller's order
            extra = extra_request_columns or {}
            write(stage / f"requests.{ext}", (*REQUEST_COLUMNS, *extra), _one_chunk(
                lambda: [*request_columns(ordered), *([cell(s) for s in ordered] for cell in extra.values())]))
            if tokens == "all":
                write(stage / f"tokens.{ext}", TOKEN_COLUMNS, [token_columns(ordered)])
            if steps is not None:  # in chunks: the columns of a long run's steps are never all built at once
                steps = steps if isinstance(steps, Sequence) else list(steps)
                const = extra_step_columns or {}
                types = steps.cell_types() if isinstance(steps, StepLog) else None
                chunks = ([*c, *([v] * (len(c[0]) if c else 0) for v in const.values())] for c in step_chunks(steps))
                write(stage / f"steps.{ext}", (*StepRecord.columns(), *const), chunks,
                      None if types is None else [*types, *({type(v)} for v in const.values())])
            for name, content in (extra_files or {}).items():
                if isinstance(content, bytes):
                    (stage / name).write_bytes(content)
                else:
                    (stage / name).write_text(content)
            if timing is not None:
                (stage / "timing.json").write_text(dumps_metrics(timing))
            (stage / "metrics.json").write_text(dumps_metrics(metrics))
        except BaseException as e:
            _keep_partial(out, stage, metrics, e)
            raise
        remove_run_files(out)
        partial = run_status != COMPLETE
        paths: dict[str, Path] = {}
        order = [*names, *(extra_files or {}), *(["timing.json"] if timing is not None else []), "metrics.json"]
        for name in order:  # metrics.json last: its presence marks a finished write
            final = name + PARTIAL_SUFFIX if partial and name in DATA_FILES else name
            os.replace(stage / name, out / final)
            paths[final] = out / final
        return paths
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _keep_partial(out: Path, stage: Path, metrics: Mapping[str, Any], error: BaseException) -> None:
    """Writing stopped: keep what the temporary directory holds as ``.partial`` files and say so in metrics.json
    (best effort: the original exception is what the caller sees)."""
    try:
        remove_run_files(out)
        kept = []
        for p in sorted(stage.iterdir()):
            if p.name != "metrics.json":
                os.replace(p, out / (p.name + PARTIAL_SUFFIX))
                kept.append(p.name + PARTIAL_SUFFIX)
        note = {**metrics, "run_status": INTERRUPTED, "partial_files": kept,
                "error": f"writing the run files failed: {type(error).__name__}: {error}"}
        tmp = stage / "metrics.json"
        tmp.write_text(dumps_metrics(note))
        os.replace(tmp, out / "metrics.json")
    except Exception:  # noqa: BLE001 - never mask the error that stopped the write
        pass


def _read_csv_python(path: str | Path, str_columns: Sequence[str] = _STR_COLUMNS) -> dict[str, np.ndarray]:
    """``read_csv`` with the csv module (the reference ``read_csv`` matches; used where pyarrow cannot parse)."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise ValueError(f"{path}: empty file (no header)")
        rows = []
        for row in reader:
            if row and len(row) != len(header):  # a blank line is skipped, as pyarrow does
                raise ValueError(f"{path}:{reader.line_num}: {len(row)} values but the header has {len(header)} "
                                 "columns (a truncated or edited file)")
            if row:
                rows.append(row)
    cols: dict[str, np.ndarray] = {}
    for j, name in enumerate(header):
        cells = [row[j] for row in rows]
        if name in str_columns:
            cols[name] = np.array(cells, dtype=str)
            continue
        try:
            cols[name] = np.array([int(c) for c in cells], dtype=np.int64)
        except ValueError:
            try:
                cols[name] = np.array([float(c) if c else math.nan for c in cells], dtype=np.float64)
            except ValueError:
                raise ValueError(f"{path}: column {name!r} is not numeric") from None
    return cols


def _numpy_columns(table, path: str | Path, str_columns: Sequence[str]) -> dict[str, np.ndarray]:
    """A pyarrow table (read from CSV or Parquet) as ``read_csv``'s columns: text columns str; numeric ones int64
    without missing values, else float64 with NaN; bools as int64 0/1 (what the CSV holds)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    cols: dict[str, np.ndarray] = {}
    for name, col in zip(table.column_names, table.columns, strict=True):
        t = col.type
        text = pa.types.is_string(t) or pa.types.is_large_string(t)
        if name in str_columns:
            d = pc.fill_null(col if text else col.cast(pa.string()), "").combine_chunks().dictionary_encode()
            cols[name] = np.array(d.dictionary.to_pylist() or [""], dtype=str)[d.indices.to_numpy()]
        elif text:
            raise ValueError(f"{path}: column {name!r} is not numeric")
        elif not len(col):  # no rows: as the CSV reader, whose empty numeric columns parse as int64
            cols[name] = np.empty(0, dtype=np.int64)
        elif pa.types.is_null(t):
            cols[name] = np.full(len(col), math.nan)
        elif pa.types.is_boolean(t) or pa.types.is_integer(t):
            x = col.cast(pa.int64())
            cols[name] = (x.to_numpy() if x.null_count == 0
                          else pc.fill_null(x.cast(pa.float64()), math.nan).to_numpy())
        elif pa.types.is_floating(t):
            cols[name] = pc.fill_null(col.cast(pa.float64()), math.nan).to_numpy()
        else:
            raise ValueError(f"{path}: column {name!r} is not numeric")
    return cols


def read_csv(path: str | Path, str_columns: Sequence[str] = _STR_COLUMNS) -> dict[str, np.ndarray]:
    """Columns of a run CSV as numpy arrays: named string columns as str, the rest int64 when every cell is
    an integer, else float64 (empty cells -> NaN). Parsed by pyarrow (C++, exact float parsing)."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    path = Path(path)
    with open(path, newline="", encoding="utf-8-sig") as f:
        header = next(csv.reader(f), None)
    if header is None:
        raise ValueError(f"{path}: empty file (no header)")
    try:
        table = pcsv.read_csv(path, parse_options=pcsv.ParseOptions(newlines_in_values=True),
                              convert_options=pcsv.ConvertOptions(
                                  column_types={c: pa.string() for c in header if c in str_columns},
                                  null_values=[""], strings_can_be_null=False, quoted_strings_can_be_null=False,
                                  timestamp_parsers=[]))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):  # what pyarrow's parser refuses: the csv module decides
        return _read_csv_python(path, str_columns)
    return _numpy_columns(table, path, str_columns)


def read_parquet(path: str | Path, str_columns: Sequence[str] = _STR_COLUMNS) -> dict[str, np.ndarray]:
    """A run's Parquet file as ``read_csv`` reads the same data written as CSV."""
    import pyarrow.parquet as pq

    return _numpy_columns(pq.read_table(path), path, str_columns)


def table_path(path: str | Path, table: str | None = None) -> Path:
    """The file holding a data table: ``path`` a run directory (then ``table``: requests | tokens | steps, its
    .csv, else its .parquet) or a file (a .csv path that is absent falls back to the .parquet beside it).
    Raises FileNotFoundError naming what was looked for."""
    p = Path(path)
    if p.is_dir():
        if table not in TABLES:
            raise ValueError(f"table must be one of {TABLES} for a run directory, got {table!r}")
        candidates = [p / f"{table}.csv", p / f"{table}.parquet"]
    else:
        candidates = [p, p.with_suffix(".parquet")] if p.suffix == ".csv" else [p]
    for c in candidates:
        if c.is_file():
            return c
    if p.is_dir() and (p / "journal" / "requests.jsonl").is_file():  # core.journal.JOURNAL_DIR, REQUESTS
        raise FileNotFoundError(f"{p} holds the journal of a session that has not written its run files (still "
                                f"running, or killed): `twinserve recover {p}` writes them")
    raise FileNotFoundError(f"no {' or '.join(c.name for c in candidates)} in {candidates[0].parent}")


def has_table(run_dir: str | Path, table: str) -> bool:
    """Whether a run directory holds the complete ``table`` (requests | tokens | steps) in either format."""
    return any((Path(run_dir) / f"{table}.{ext}").is_file() for ext in FORMATS)


def read_table(path: str | Path, table: str | None = None) -> dict[str, np.ndarray]:
    """The one reader of run data files, CSV or Parquet (``table_path`` finds the file): numpy columns."""
    p = table_path(path, table)
    return read_parquet(p) if p.suffix == ".parquet" else read_csv(p)


def read_requests(path: str | Path) -> dict[str, np.ndarray]:
    """requests.csv / requests.parquet (a run directory or the file) with ``warmup`` as bool."""
    cols = read_table(path, "requests")
    if "warmup" in cols:
        cols["warmup"] = cols["warmup"].astype(bool)
    return cols


def read_tokens(path: str | Path) -> dict[str, np.ndarray]:
    return read_table(path, "tokens")


def read_steps(path: str | Path) -> dict[str, np.ndarray]:
    return read_table(path, "steps")


# the names from before Parquet: they read either format too
read_requests_csv, read_tokens_csv, read_steps_csv = read_requests, read_tokens, read_steps


def read_metrics(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def read_timing(run_dir: str | Path) -> dict[str, Any]:
    """timing.json of a run directory (wall-clock facts: ``wall_s``, ...); {} when the run wrote none."""
    p = Path(run_dir) / "timing.json"
    return json.loads(p.read_text()) if p.is_file() else {}


def read_step_features(path: str | Path) -> tuple[list[StepFeatures], np.ndarray, np.ndarray]:
    """Read a run's steps.csv (columns ``StepRecord.columns()``): (features, durations in s, replica ids). A run
    written as Parquet: its steps.parquet (the path itself, or the sibling of an absent steps.csv)."""
    path = Path(path)
    names = StepFeatures.names()
    if not path.is_file() or path.suffix == ".parquet":
        cols = read_steps(table_path(path))
        missing = sorted(set(StepRecord.columns()) - set(cols) - LATER_FEATURES)
        if missing:
            raise ValueError(f"{path}: missing columns {missing}; expected {StepRecord.columns()}")
        zeros = [0] * len(cols["duration_s"])  # a feature added after the file was written (LATER_FEATURES)
        feats = [StepFeatures(*row) for row in zip(*(cols[k].astype(np.int64).tolist() if k in cols else zeros
                                                     for k in names), strict=True)]
        return feats, cols["duration_s"].astype(float), cols["replica"].astype(int)
    features, durations, replicas = [], [], []
    with open(path, newline="", encoding="utf-8-sig") as fh:
        reader = csv.DictReader(fh)
        # features added since the first recordings (core.batch.LATER_FEATURES): older files have none (0)
        missing = sorted(set(StepRecord.columns()) - set(reader.fieldnames or ()) - LATER_FEATURES)
        if missing:
            raise ValueError(f"{path}: missing columns {missing}; expected {StepRecord.columns()}")
        for line, row in enumerate(reader, start=2):
            short = [k for k, v in row.items() if v is None and k is not None]  # would read as 0 below
            if short or None in row:
                what = f"no value for {short}" if short else f"{len(row[None])} values more than the header has"
                raise ValueError(f"{path}:{reader.line_num}: {what} (a truncated or edited file)")
            try:
                features.append(StepFeatures(**{k: int(row.get(k) or 0) for k in names}))
                durations.append(float(row["duration_s"]))
                replicas.append(int(row["replica"]))
            except ValueError as e:
                raise ValueError(f"{path}:{line}: bad value ({e})") from None
    return features, np.array(durations, dtype=float), np.array(replicas, dtype=int)
