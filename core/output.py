"""The output files of one run (DESIGN section 8) and readers for them.

Both backends write the same files: requests.csv, tokens.csv, steps.csv, metrics.json. Formatting is
deterministic (floats by ``repr``, requests ordered by arrival then input order, JSON with sorted keys),
so equal runs give byte-identical files. Missing values are empty CSV cells and ``null`` in JSON
(NaN and infinities included). Wall-clock facts (how long the run took) go to timing.json, never to
metrics.json, which stays byte-identical across same-seed reruns.

``write_run`` is the one writer of a run directory (the simulator and engine runs, the server's periodic flush,
loadgen): every file is written into a temporary directory inside the run directory and renamed into place,
metrics.json last, after the run files an earlier run left there were removed. metrics.json's ``run_status`` says
what the directory holds: ``complete``; ``running`` (a server's periodic flush); ``interrupted`` (the run or the
writing stopped early: Ctrl-C, an error, ``error`` says which). Only a complete run's data files carry their
usual names; any other run keeps them as ``<name>.partial`` (``requests.csv.partial``, ...), which no reader of
run directories opens by mistake. A crash between the renames leaves no metrics.json at all: no metrics.json, or
one whose ``run_status`` is not ``complete``, means the directory does not hold a complete run.
"""

from __future__ import annotations

import csv
import enum
import json
import math
import os
import shutil
import tempfile
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

COMPLETE, RUNNING, INTERRUPTED = "complete", "running", "interrupted"  # metrics.json's run_status
RUN_STATUSES = (COMPLETE, RUNNING, INTERRUPTED)
DATA_FILES = ("requests.csv", "tokens.csv", "steps.csv")
# Every file a run may write into its directory (plots included). Before a run's files are renamed into place,
# these and their .partial forms are removed, so a reused directory never mixes two runs.
RUN_FILES = (*DATA_FILES, "metrics.json", "timing.json", "outputs.jsonl", "config.yaml", "bench_serve.json",
             "client.csv", "latency_cdfs.png", "step_timeline.png")
PARTIAL_SUFFIX = ".partial"


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
              timing: Mapping[str, Any] | None = None, run_status: str = COMPLETE) -> dict[str, Path]:
    """Write the run's files into ``out_dir`` (created if needed); returns name -> path as written.

    requests.csv, tokens.csv, steps.csv (none when ``steps`` is None: a black box has no steps), ``extra_files``
    (a file name inside ``out_dir`` -> its text or bytes, e.g. the resolved config), timing.json (``timing``:
    wall-clock facts) and metrics.json, with ``run_status`` added, last. Files go to a temporary directory first,
    then the run files an earlier run left are removed and the new ones renamed into place. Unless ``run_status``
    is ``complete`` the data files are named ``<name>.partial``. If writing fails or is interrupted (any exception,
    KeyboardInterrupt included), what was written is kept as ``.partial`` files beside a metrics.json whose
    ``run_status`` is ``interrupted``, and the exception propagates.
    """
    if run_status not in RUN_STATUSES:
        raise ValueError(f"run_status must be one of {RUN_STATUSES}, got {run_status!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = [*DATA_FILES[:2], *(["steps.csv"] if steps is not None else [])]
    for name in extra_files or {}:
        if Path(name).name != name or name in (*names, "metrics.json", "timing.json") or name.startswith("."):
            raise ValueError(f"extra file name {name!r} must be a new plain file name inside the run directory")
    metrics = {**metrics, "run_status": run_status}
    stage = Path(tempfile.mkdtemp(prefix=".writing-", dir=out))
    try:
        try:
            ordered = sorted(states, key=lambda s: s.request.arrival_s)  # stable: ties keep the caller's order
            _write_csv(stage / "requests.csv", REQUEST_COLUMNS, (request_row(s) for s in ordered))
            _write_csv(stage / "tokens.csv", TOKEN_COLUMNS,
                       ((s.id, i, t, k) for s in ordered for i, (t, k) in enumerate(output_events(s.token_times))))
            if steps is not None:
                _write_csv(stage / "steps.csv", StepRecord.columns(), (s.row() for s in steps))
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


def read_timing(run_dir: str | Path) -> dict[str, Any]:
    """timing.json of a run directory (wall-clock facts: ``wall_s``, ...); {} when the run wrote none."""
    p = Path(run_dir) / "timing.json"
    return json.loads(p.read_text()) if p.is_file() else {}
