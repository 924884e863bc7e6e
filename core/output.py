"""The output files of one run (DESIGN section 8) and readers for them.

Both backends write the same files: requests.csv, tokens.csv, steps.csv, metrics.json. Formatting is
deterministic (floats by ``repr``, requests ordered by arrival then input order, JSON with sorted keys),
so equal runs give byte-identical files. Missing values are empty CSV cells and ``null`` in JSON
(NaN and infinities included).
"""

from __future__ import annotations

import csv
import enum
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from core.metrics import output_events, request_metrics
from core.records import StepRecord
from core.request import RequestState

REQUEST_COLUMNS = ("id", "replica", "tenant", "arrival_s", "first_scheduled_s", "first_token_s", "finish_s",
                   "prompt_tokens", "output_tokens", "cached_tokens", "num_preemptions", "status", "ttft_s", "tpot_s",
                   "e2e_s", "max_stall_s", "reason", "warmup")
TOKEN_COLUMNS = ("request_id", "index", "time_s", "num_tokens")  # index: the event's position in its response
_STR_COLUMNS = ("id", "tenant", "status", "reason", "request_id")


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


def request_row(state: RequestState) -> list[Any]:
    r, m = state.request, request_metrics(state)
    return [r.id, state.replica, r.tenant, r.arrival_s, state.first_scheduled_s, state.first_token_s, state.finish_s,
            r.prompt_len, state.num_output_tokens, state.num_cached_tokens, state.num_preemptions, state.status,
            m.ttft_s, m.tpot_s, m.e2e_s, m.max_stall_s, state.reason, r.warmup]


def _write_csv(path: Path, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(header)
        w.writerows([fmt(v) for v in row] for row in rows)


def write_run(out_dir: str | Path, states: Iterable[RequestState], steps: Iterable[StepRecord],
              metrics: Mapping[str, Any], extra_files: Mapping[str, str | bytes] | None = None) -> dict[str, Path]:
    """Write the run's files into ``out_dir`` (created if needed); returns name -> path.

    ``extra_files`` maps a file name inside ``out_dir`` to its text or bytes (e.g. the resolved config).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ordered = sorted(states, key=lambda s: s.request.arrival_s)  # stable: ties keep the caller's order
    paths = {name: out / name for name in ("requests.csv", "tokens.csv", "steps.csv", "metrics.json")}
    _write_csv(paths["requests.csv"], REQUEST_COLUMNS, (request_row(s) for s in ordered))
    _write_csv(paths["tokens.csv"], TOKEN_COLUMNS,
               ((s.id, i, t, k) for s in ordered for i, (t, k) in enumerate(output_events(s.token_times))))
    _write_csv(paths["steps.csv"], StepRecord.columns(), (s.row() for s in steps))
    paths["metrics.json"].write_text(dumps_metrics(metrics))
    for name, content in (extra_files or {}).items():
        p = out / name
        if p.resolve().parent != out.resolve() or name in paths:
            raise ValueError(f"extra file name {name!r} must be a new plain file name inside the run directory")
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content)
        paths[name] = p
    return paths


def read_csv(path: str | Path, str_columns: Sequence[str] = _STR_COLUMNS) -> dict[str, np.ndarray]:
    """Columns of a run CSV as numpy arrays: named string columns as str, the rest int64 when every cell is
    an integer, else float64 (empty cells -> NaN)."""
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise ValueError(f"{path}: empty file (no header)")
        rows = list(reader)
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


def read_requests_csv(path: str | Path) -> dict[str, np.ndarray]:
    cols = read_csv(path)
    if "warmup" in cols:
        cols["warmup"] = cols["warmup"].astype(bool)
    return cols


def read_tokens_csv(path: str | Path) -> dict[str, np.ndarray]:
    return read_csv(path)


def read_steps_csv(path: str | Path) -> dict[str, np.ndarray]:
    return read_csv(path)


def read_metrics(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())
