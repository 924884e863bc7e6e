"""Issue 13 (fast results): the columnar CSV writer gives csv.writer's bytes, Parquet carries the same data, the one
reader reads both, ``output.tokens=none`` changes no metric, and per-token state is a flat array."""

import csv
import enum
import io
import json
import math
from array import array

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import core.output as output
from core.metrics import itl_samples, output_events, request_metrics, summarize, token_stats
from core.output import (
    RUN_FILES,
    TOKEN_COLUMNS,
    _cells,
    _read_csv_python,
    fmt,
    has_table,
    read_csv,
    read_metrics,
    read_requests,
    read_steps,
    read_table,
    read_tokens,
    token_columns,
    write_run,
)
from core.request import Request, RequestState, Status
from tests.core.test_output import _states, _steps
from tests.core.test_records import NAMES, random_log, reference_columns
from tests.helpers import parsed


def _same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert np.array_equal(a[k], b[k], equal_nan=a[k].dtype.kind == "f"), k


def _csv_reference(columns) -> str:
    """What the writer replaced: csv.writer over fmt cells, row by row."""
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows([fmt(v) for v in row] for row in zip(*columns, strict=True))
    return buf.getvalue()


def _csv_columnar(columns) -> str:
    cells = [_cells(list(c) if not isinstance(c, np.ndarray) else c) for c in columns]
    return "".join(",".join(r) + "\n" for r in zip(*cells, strict=True))


class Color(enum.Enum):
    RED = "red, dark"


CELL = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(), st.text(max_size=6),
                 st.sampled_from([Color.RED, Status.FINISHED, np.float64(0.1), np.int64(3), np.bool_(True)]))


@given(st.lists(st.lists(CELL, min_size=3, max_size=3), max_size=20))
def test_columnar_cells_are_csv_writer_bytes(rows):
    columns = list(zip(*rows, strict=True)) if rows else []
    assert _csv_columnar(columns) == _csv_reference(columns)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**40), st.integers(1, 50), st.booleans())
def test_long_columns_take_the_numpy_paths_exactly(seed, distinct, neg_zero):
    """Long columns (>= 4096 rows) go through numpy (distinct values formatted once): ints, floats with repeats,
    -0.0 beside 0.0, ints mixed with floats (an int stays ``0``), NaN and inf (empty cells)."""
    rng = np.random.default_rng(seed)
    n = 5000
    ints = rng.integers(0, distinct, n).tolist()
    floats = (rng.integers(0, distinct, n) * 0.001).tolist()
    if neg_zero:
        floats[7] = -0.0
    mixed = [0, *rng.random(n - 1).tolist()]
    odd = rng.random(n).tolist()
    odd[3], odd[9] = math.nan, math.inf
    columns = [ints, floats, mixed, odd, np.array(floats), np.array(ints), np.array(odd)]
    assert _csv_columnar(columns) == _csv_reference(columns)


def test_token_rows_match_output_events():
    """tokens.csv's rows computed with numpy equal the per-request output_events rows (multi-token events, empty
    responses, lists of floats, array('d'), and int times, which keep the exact path)."""
    rng = np.random.default_rng(1)
    states = []
    for i in range(30):
        n = int(rng.integers(0, 40))
        t = np.cumsum(rng.integers(0, 3, n) * 0.01).tolist()  # 0 steps: several tokens in one event
        s = RequestState(Request(f"r{i}", 0.0, 4, 50))
        s.token_times = array("d", t) if i % 2 else t
        states.append(s)
    expected = [(s.id, i, t, k) for s in states for i, (t, k) in enumerate(output_events(s.token_times))]
    got = list(zip(*(list(c) for c in token_columns(states)), strict=True))
    assert [tuple(map(fmt, r)) for r in got] == [tuple(map(fmt, r)) for r in expected]
    states[0].token_times = [1, 2, 2]  # ints: written as "1", not "1.0"
    assert _csv_columnar(token_columns(states[:1])) == "r0,0,1,1\nr0,1,2,2\n"


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=9, max_size=60))
def test_request_metrics_numpy_path_is_the_definition(steps):
    times = np.cumsum(np.array(steps) * 0.013 + 0.0).tolist()
    s = RequestState(Request("a", 0.0, 4, 100), status=Status.FINISHED, first_scheduled_s=0.0,
                     first_token_s=times[0], finish_s=times[-1])
    s.token_times = array("d", times)
    m = request_metrics(s)
    events = output_events(times)
    gaps = [t1 - t0 for (t0, _), (t1, _) in zip(events, events[1:], strict=False)]
    assert m.max_stall_s == max(gaps, default=0.0)
    pooled = token_stats([s, s], [True, False])
    assert pooled.itl_s.tolist() == itl_samples(events) and list(pooled.itl_counts) == [len(pooled.itl_s), 0]


def test_add_tokens_keeps_a_flat_array():
    s = RequestState(Request("a", 0.0, 4, 10))
    assert isinstance(s.token_times, array) and s.token_times.typecode == "d"
    s.add_token(5, 0.5)
    s.add_tokens([1, 2], 0.75)  # one event of two tokens
    s.add_tokens([3, 4], [1.0, 1.25])
    assert s.output_token_ids == [5, 1, 2, 3, 4] and list(s.token_times) == [0.5, 0.75, 0.75, 1.0, 1.25]
    assert s.first_token_s == 0.5 and output_events(s.token_times)[1] == (0.75, 2)
    with pytest.raises(ValueError, match="2 tokens but 1 times"):
        s.add_tokens([1, 2], [2.0])


def _write_both(tmp_path, states=None, steps=None, **kw):
    states = _states() if states is None else states
    steps = _steps() if steps is None else steps
    m = summarize(states)
    a = write_run(tmp_path / "csv", states, steps, m, **kw)
    b = write_run(tmp_path / "pq", states, steps, m, file_format="parquet", **kw)
    return a, b


def test_parquet_carries_the_csv_data(tmp_path):
    a, b = _write_both(tmp_path)
    assert set(b) == {"requests.parquet", "tokens.parquet", "steps.parquet", "metrics.json"}
    assert {"requests.parquet", "tokens.parquet", "steps.parquet"} <= set(RUN_FILES)
    for reader in (read_requests, read_tokens, read_steps):
        _same(reader(tmp_path / "csv"), reader(tmp_path / "pq"))
    assert read_requests(tmp_path / "pq")["warmup"].dtype == bool
    assert read_requests(tmp_path / "pq")["tenant"].tolist() == ["", "", "t,1"]
    assert a["metrics.json"].read_text() == b["metrics.json"].read_text()


def test_the_reader_takes_a_directory_or_either_file(tmp_path):
    _write_both(tmp_path)
    csv_cols = read_table(tmp_path / "csv" / "tokens.csv")
    _same(csv_cols, read_table(tmp_path / "pq" / "tokens.csv"))  # absent .csv: its .parquet sibling
    _same(csv_cols, read_table(tmp_path / "pq" / "tokens.parquet"))
    _same(csv_cols, read_table(tmp_path / "pq", "tokens"))
    assert has_table(tmp_path / "pq", "steps") and not has_table(tmp_path, "steps")
    with pytest.raises(FileNotFoundError, match="no requests.csv or requests.parquet"):
        read_table(tmp_path, "requests")


def test_the_arrow_csv_reader_is_the_csv_module_reader(tmp_path):
    """read_csv parses with pyarrow; it gives the csv module reader's columns: types, NaN, quoted text, no rows."""
    _write_both(tmp_path)
    p = tmp_path / "odd.csv"
    p.write_text('id,a,b,c,reason\nx,1,,0.5,"a, ""b""\nc"\ny,2,,1e-05,\n')
    (tmp_path / "empty.csv").write_text("id,a,b\n")
    for f in [p, tmp_path / "empty.csv", *(tmp_path / "csv").glob("*.csv")]:
        _same(read_csv(f), _read_csv_python(f))
    (tmp_path / "bad.csv").write_text("a,b\n1,x\n")
    with pytest.raises(ValueError, match="column 'b' is not numeric"):
        read_csv(tmp_path / "bad.csv")


def test_no_tokens_file_with_tokens_none(tmp_path):
    a, b = _write_both(tmp_path, tokens="none")
    assert "tokens.csv" not in a and "tokens.parquet" not in b and not has_table(tmp_path / "csv", "tokens")


def test_a_crash_mid_write_keeps_parquet_as_partial(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    states = _states()
    write_run(run_dir, states, _steps(), summarize(states))  # an earlier CSV run in the same directory
    real = output.request_row

    def dying_row(state, m=None):
        if state.id == "a":
            raise KeyboardInterrupt
        return real(state, m)

    monkeypatch.setattr(output, "request_row", dying_row)
    with pytest.raises(KeyboardInterrupt):
        write_run(run_dir, states, _steps(), summarize(states), file_format="parquet")
    assert {p.name for p in run_dir.iterdir()} == {"requests.parquet.partial", "metrics.json"}
    m = read_metrics(run_dir / "metrics.json")
    assert m["run_status"] == "interrupted" and m["partial_files"] == ["requests.parquet.partial"]
    monkeypatch.setattr(output, "request_row", real)
    paths = write_run(run_dir, states, _steps(), summarize(states), file_format="parquet", run_status="running")
    assert set(paths) == {"requests.parquet.partial", "tokens.parquet.partial", "steps.parquet.partial",
                          "metrics.json"}
    write_run(run_dir, states, _steps(), summarize(states), file_format="parquet")
    assert {p.name for p in run_dir.iterdir()} == {"requests.parquet", "tokens.parquet", "steps.parquet",
                                                   "metrics.json"}


def test_bad_output_options_name_their_key(tmp_path):
    with pytest.raises(ValueError, match="output.format='xml'"):
        write_run(tmp_path, [], [], {}, file_format="xml")
    with pytest.raises(ValueError, match="output.tokens='some'"):
        write_run(tmp_path, [], [], {}, tokens="some")


# ---- whole runs through experiments.run.run ----------------------------------------------------------------------
def _run(tmp_path, name, *overrides):
    from hydra import compose, initialize_config_dir

    from experiments.build import CONF_DIR
    from experiments.run import run

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["workload.num_requests=30", "output.progress=false", *overrides])
    run(cfg, tmp_path / name)
    return tmp_path / name


def test_runs_in_every_output_mode_give_the_same_data(tmp_path):
    base = _run(tmp_path, "csv", "output.plots=false")
    pq = _run(tmp_path, "pq", "output.format=parquet", "output.plots=false")
    none = _run(tmp_path, "none", "output.tokens=none", "output.plots=false")
    for t in ("requests", "tokens", "steps"):
        _same(read_table(base, t), read_table(pq, t))
    assert (base / "metrics.json").read_bytes() == (pq / "metrics.json").read_bytes() \
        == (none / "metrics.json").read_bytes()
    assert (base / "requests.csv").read_bytes() == (none / "requests.csv").read_bytes()
    assert not has_table(none, "tokens") and json.loads((none / "metrics.json").read_text())["itl_s"]["count"] > 0


@pytest.mark.parametrize("fast_forward", [True, False])
def test_tokens_none_folds_token_times_and_changes_no_metric(tmp_path, fast_forward):
    """output.tokens=none: every request folds its token times into the loop's ITL pool as it ends (no per-token
    memory); metrics.json and requests.csv stay byte-identical, with prefix hits, warmup, timeouts, buckets."""
    from hydra import compose, initialize_config_dir

    from experiments.build import CONF_DIR, build_loop
    from sim.clock import run_virtual

    case = ["workload=shared_prefix", "workload.num_requests=60", "workload.warmup_requests=5", "replicas=2",
            "request_timeout_s=0.2", "workload.arrival.rate_rps=40", "kv.num_blocks=64",
            "metrics.prompt_len_edges=[120,140]",
            f"backend.fast_forward={fast_forward}", "output.plots=false"]
    base = _run(tmp_path, "all", *case)
    none = _run(tmp_path, "none", *case, "output.tokens=none")
    assert (base / "metrics.json").read_bytes() == (none / "metrics.json").read_bytes()
    assert (base / "requests.csv").read_bytes() == (none / "requests.csv").read_bytes()
    m = json.loads((none / "metrics.json").read_text())
    assert m["num_timed_out"] > 0 and m["num_warmup"] == 5 and 0 < m["request_hit_rate"] < 1
    assert all(g["itl_s"]["count"] > 0 for g in m["groups"]["prompt_len"].values())
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[*case, "output.tokens=none", "workload.num_requests=30"])
    result = run_virtual(build_loop(parsed(cfg)))
    assert all(s.folded is not None and not s.token_times for s in result.states)
    assert len(result.itl_pool.samples()) > 0


def test_plots_auto_draws_small_runs_and_reads_parquet(tmp_path):
    d = _run(tmp_path, "pq", "output.format=parquet")  # plots: auto, 30 requests -> drawn from the Parquet files
    assert (d / "latency_cdfs.png").is_file() and (d / "step_timeline.png").is_file()
    d = _run(tmp_path, "none", "output.tokens=none", "output.plots=true")  # no tokens file: an empty ITL panel
    assert (d / "latency_cdfs.png").is_file()


@pytest.mark.parametrize("key,value", [("format", "xml"), ("tokens", "some"), ("plots", "maybe")])
def test_bad_output_config_fails_before_the_run(tmp_path, key, value):
    with pytest.raises(ValueError, match=f"output.{key}='{value}'"):
        _run(tmp_path, "bad", f"output.{key}={value}")
    assert not (tmp_path / "bad").exists()


def test_plot_itl_is_the_metrics_definition(tmp_path):
    """plots.RunData.itl (numpy) equals the per-request itl_samples in (request id, event) order."""
    from experiments.plots import _event_order, load_run

    d = _run(tmp_path, "csv", "output.plots=false", "workload.num_requests=40")
    run = load_run(d)
    keep = set(run.requests["id"][run._measured()].tolist())
    t, events = run.tokens, {}
    for rid, _i, time, k in sorted(zip(t["request_id"].tolist(), t["index"].tolist(), t["time_s"].tolist(),
                                       t["num_tokens"].tolist(), strict=True)):
        if rid in keep:
            events.setdefault(rid, []).append((time, k))
    assert np.array_equal(run.itl(), np.array([x for ev in events.values() for x in itl_samples(ev)]))
    rng = np.random.default_rng(0)
    p = rng.permutation(len(t["index"]))  # rows out of file order: the general sort
    rid, idx = t["request_id"][p], t["index"][p]
    assert np.array_equal(_event_order(rid, idx), np.lexsort((idx, rid)))
    assert tuple(TOKEN_COLUMNS) == tuple(t)


def test_a_run_without_requests_reads_the_same_in_both_formats(tmp_path):
    _write_both(tmp_path, states=[], steps=[])
    for reader in (read_requests, read_tokens, read_steps):
        _same(reader(tmp_path / "csv"), reader(tmp_path / "pq"))


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 2**32), st.sampled_from([0, 1, 5, 40, 97]), st.sampled_from(["float", "int0", "int"]),
       st.sampled_from([1, 7, 40, 1000]))
def test_the_steps_file_in_chunks_is_the_whole_column_file(tmp_path_factory, seed, steps, times, rows):
    """A step log's steps file written ``rows`` rows at a time (one row group per chunk): the CSV's bytes are
    csv.writer's over the whole columns (by definition, tests.core.test_records) and a list of its records' file;
    the Parquet table is the whole columns' (whole-column types: float64 times where the clock started at the int
    0, int64 where every time is an int), the list's but for an empty log's types, and reads back as the CSV."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp_path = tmp_path_factory.mktemp("steps")
    log = random_log(seed, steps, times)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(output, "_CHUNK_ROWS", rows)
        chunked = _write_both(tmp_path / "log", steps=log)
        whole = _write_both(tmp_path / "list", steps=list(log))
    text = chunked[0]["steps.csv"].read_text()
    assert text == ",".join(NAMES) + "\n" + _csv_reference(reference_columns(log))
    assert chunked[0]["steps.csv"].read_bytes() == whole[0]["steps.csv"].read_bytes()
    a = pq.ParquetFile(chunked[1]["steps.parquet"])
    ref = pa.table({n: output._arrow_column(c) for n, c in zip(NAMES, reference_columns(log), strict=True)})
    assert a.metadata.num_row_groups == max(1, -(-len(log) // rows))
    assert a.read().equals(ref) and a.schema_arrow == ref.schema
    assert not len(log) or pq.read_table(whole[1]["steps.parquet"]).equals(ref)
    _same(read_steps(tmp_path / "log" / "csv"), read_steps(tmp_path / "log" / "pq"))


def test_a_chunk_takes_the_whole_columns_parquet_type(tmp_path):
    """Chunks whose own cells would give another type (ints only, in a column that has floats later) are written
    as the whole column, from ``types``; without ``types`` the first chunk decides."""
    import pyarrow.parquet as pq

    chunks = [[[0, 1], ["a", "b"]], [[0.5, 2], [3, None]]]
    types = [set().union(*(output._cell_types(c[j]) for c in chunks)) for j in range(2)]
    output._write_parquet(tmp_path / "a.parquet", ["x", "y"], chunks, types)
    output._write_parquet(tmp_path / "b.parquet", ["x", "y"], [[sum((c[j] for c in chunks), []) for j in range(2)]])
    a, b = pq.read_table(tmp_path / "a.parquet"), pq.read_table(tmp_path / "b.parquet")
    assert a.equals(b) and a.column("x").to_pylist() == [0.0, 1.0, 0.5, 2.0]
    assert a.column("y").to_pylist() == ["a", "b", "3", ""]
    output._write_parquet(tmp_path / "c.parquet", ["x"], iter([]), [{int}])  # no chunks: no rows, the type kept
    assert str(pq.read_table(tmp_path / "c.parquet").schema.field("x").type) == "int64"
