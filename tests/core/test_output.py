"""Run output files: exact columns, round trips, byte-identical for equal inputs."""

import csv
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.batch import StepFeatures
from core.metrics import summarize
from core.output import (
    REQUEST_COLUMNS,
    fmt,
    read_metrics,
    read_requests_csv,
    read_step_features,
    read_steps_csv,
    read_tokens_csv,
    write_run,
)
from core.records import StepRecord
from core.request import Request, RequestState, Status


def _states():
    a = RequestState(Request("a", 0.1, 40, 3, tenant="t,1"), status=Status.FINISHED, replica=0,
                     output_token_ids=[1, 2, 3], num_cached_tokens=32, num_preemptions=1, first_scheduled_s=0.2,
                     first_token_s=0.5, finish_s=0.9, token_times=[0.5, 0.7, 0.9])
    b = RequestState(Request("b", 0.05, 9000, 2), status=Status.REJECTED, finish_s=0.05,
                     reason='prompt of 9000 tokens exceeds max_model_len "4096", rejected')
    w = RequestState(Request("w", 0.0, 8, 1, warmup=True), status=Status.FINISHED, replica=1, output_token_ids=[7],
                     first_scheduled_s=0.0, first_token_s=1 / 3, finish_s=1 / 3, token_times=[1 / 3])
    return [a, b, w]


def _steps():
    f = StepFeatures(num_seqs=2, num_batched_tokens=41, num_prefill_seqs=1, num_prefill_tokens=40, num_decode_seqs=1,
                     attention_pairs=820, kv_tokens_read=9, prefill_kv_tokens=40, max_context_len=40)
    return [StepRecord(0, 0.2, 0.3, f, 5, 0), StepRecord(0, 0.5, 0.2, StepFeatures(), 5, 1)]


def _write(tmp_path, name, states=None):
    states = _states() if states is None else states
    return write_run(tmp_path / name, states, _steps(), summarize(states, slo={"ttft_s": 1.0}),
                     extra_files={"config.yaml": "seed: 0\n"})


def test_files_and_exact_columns(tmp_path):
    paths = _write(tmp_path, "run")
    assert set(paths) == {"requests.csv", "tokens.csv", "steps.csv", "metrics.json", "config.yaml"}
    with open(paths["requests.csv"]) as f:
        header, *rows = list(csv.reader(f))
    assert tuple(header) == REQUEST_COLUMNS and REQUEST_COLUMNS[:16] == (
        "id", "replica", "tenant", "arrival_s", "first_scheduled_s", "first_token_s", "finish_s", "prompt_tokens",
        "output_tokens", "cached_tokens", "num_preemptions", "status", "ttft_s", "tpot_s", "e2e_s", "max_stall_s")
    assert [r[0] for r in rows] == ["w", "b", "a"]  # by arrival
    assert paths["steps.csv"].read_text().splitlines()[0].split(",") == StepRecord.columns()
    assert paths["tokens.csv"].read_text().splitlines() == [
        "request_id,index,time_s,num_tokens", f"w,0,{1 / 3!r},1", "a,0,0.5,1", "a,1,0.7,1", "a,2,0.9,1"]
    assert (paths["config.yaml"]).read_text() == "seed: 0\n"


def test_round_trip(tmp_path):
    paths = _write(tmp_path, "run")
    r = read_requests_csv(paths["requests.csv"])
    assert list(r["id"]) == ["w", "b", "a"] and list(r["tenant"]) == ["", "", "t,1"]
    assert list(r["status"]) == ["FINISHED", "REJECTED", "FINISHED"] and list(r["warmup"]) == [True, False, False]
    assert r["first_token_s"][0] == 1 / 3 and np.isnan(r["first_token_s"][1]) and r["finish_s"][2] == 0.9
    assert list(r["prompt_tokens"]) == [8, 9000, 40] and r["prompt_tokens"].dtype == np.int64
    assert r["ttft_s"][2] == pytest.approx(0.4) and r["tpot_s"][2] == pytest.approx(0.2)
    assert r["max_stall_s"][2] == pytest.approx(0.2) and np.isnan(r["e2e_s"][1])
    assert r["reason"][1].startswith("prompt of 9000 tokens") and r["reason"][1].endswith('"4096", rejected')
    s = read_steps_csv(paths["steps.csv"])
    assert list(s["attention_pairs"]) == [820, 0] and list(s["duration_s"]) == [0.3, 0.2]
    assert list(s["num_preempted"]) == [0, 1]
    t = read_tokens_csv(paths["tokens.csv"])
    assert list(t["request_id"]) == ["w", "a", "a", "a"] and list(t["index"]) == [0, 0, 1, 2]
    m = read_metrics(paths["metrics.json"])
    assert m["num_requests"] == 2 and m["num_warmup"] == 1 and m["tpot_s"]["count"] == 1


def test_cancelled_request_row(tmp_path):
    """A request cancelled after two tokens: its status and reason, its TTFT and tokens, but no E2E / TPOT."""
    c = RequestState(Request("c", 0.0, 8, 10), status=Status.CANCELLED, replica=0, output_token_ids=[4, 5],
                     first_scheduled_s=0.1, first_token_s=0.3, finish_s=0.6, token_times=[0.3, 0.4],
                     reason="client disconnected")
    paths = write_run(tmp_path / "run", [c], [], summarize([c]))
    r = read_requests_csv(paths["requests.csv"])
    assert list(r["status"]) == ["CANCELLED"] and list(r["reason"]) == ["client disconnected"]
    assert list(r["output_tokens"]) == [2] and r["ttft_s"][0] == pytest.approx(0.3)
    assert np.isnan(r["e2e_s"][0]) and np.isnan(r["tpot_s"][0])
    assert read_tokens_csv(paths["tokens.csv"])["index"].tolist() == [0, 1]
    m = read_metrics(paths["metrics.json"])
    assert m["num_cancelled"] == 1 and m["num_completed"] == 0 and m["slo_attainment"] == 0.0


def test_equal_runs_are_byte_identical(tmp_path):
    a = _write(tmp_path, "a")
    b = _write(tmp_path, "b", list(reversed(_states())))  # arrival order decides the row order
    for name in ("requests.csv", "tokens.csv", "steps.csv", "metrics.json"):
        assert a[name].read_bytes() == b[name].read_bytes()


def test_metrics_json_sorted_and_null_for_nan(tmp_path):
    p = write_run(tmp_path, [], [], {"z": float("nan"), "a": {"y": np.float64(1.5), "b": [np.int64(2), float("inf")]},
                                     "status": Status.FINISHED})
    text = p["metrics.json"].read_text()
    assert text == json.dumps({"a": {"b": [2, None], "y": 1.5}, "run_status": "complete", "status": "FINISHED",
                               "z": None}, indent=2, sort_keys=True) + "\n"
    assert read_requests_csv(p["requests.csv"])["id"].size == 0


def test_extra_file_names_stay_inside(tmp_path):
    with pytest.raises(ValueError, match="extra file"):
        write_run(tmp_path, [], [], {}, extra_files={"../x.txt": "no"})
    with pytest.raises(ValueError, match="extra file"):
        write_run(tmp_path, [], [], {}, extra_files={"metrics.json": "no"})


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_float_cells_round_trip_exactly(x):
    assert float(fmt(x)) == x


def _names(d):
    return {p.name for p in d.iterdir()}


def test_a_crash_mid_write_leaves_no_file_that_reads_as_complete(tmp_path, monkeypatch):
    """The CSV writer dies after two rows of requests.csv (Ctrl-C while writing): the truncated file is kept only as
    requests.csv.partial, metrics.json says interrupted, and the previous run's files in the directory are gone."""
    import core.output as output

    run_dir = tmp_path / "run"
    _write(tmp_path, "run")  # a complete earlier run
    (run_dir / "step_timeline.png").write_bytes(b"old plot")
    real, rows = output.request_row, []

    def dying_row(state, m=None):
        if len(rows) == 2:
            raise KeyboardInterrupt
        rows.append(state.id)
        return real(state, m)

    monkeypatch.setattr(output, "request_row", dying_row)
    states = _states()
    with pytest.raises(KeyboardInterrupt):
        write_run(run_dir, states, _steps(), summarize(states))
    assert _names(run_dir) == {"requests.csv.partial", "metrics.json"}
    assert (run_dir / "requests.csv.partial").read_text().splitlines()[0].startswith("id,replica")
    m = read_metrics(run_dir / "metrics.json")
    assert m["run_status"] == "interrupted" and "KeyboardInterrupt" in m["error"]
    assert m["partial_files"] == ["requests.csv.partial"]


def test_a_reused_directory_keeps_no_stale_run_file(tmp_path):
    """A second run into the same directory: the first run's files are removed first (a measured run has no
    steps.csv, so an old one would be read as its steps); other files and subdirectories (.hydra) stay."""
    from experiments.serving.bench_result import write_measured_run

    run_dir = tmp_path / "run"
    _write(tmp_path, "run")
    (run_dir / "timing.json").write_text("{}")
    (run_dir / "latency_cdfs.png").write_bytes(b"old plot")
    (run_dir / ".hydra").mkdir()
    (run_dir / "notes.txt").write_text("mine")
    states = _states()[:1]
    write_measured_run(run_dir, states, summarize(states), timing={"wall_s": 1.5})
    assert _names(run_dir) == {"requests.csv", "tokens.csv", "metrics.json", "timing.json", ".hydra", "notes.txt"}
    assert read_requests_csv(run_dir / "requests.csv")["id"].tolist() == ["a"]
    assert json.loads((run_dir / "timing.json").read_text()) == {"wall_s": 1.5}


def test_a_snapshot_is_partial_until_the_complete_write(tmp_path):
    """A server's periodic flush: data files named .partial, run_status running; the final write replaces them."""
    states = _states()
    paths = write_run(tmp_path, states, _steps(), summarize(states), run_status="running")
    assert set(paths) == {"requests.csv.partial", "tokens.csv.partial", "steps.csv.partial", "metrics.json"}
    assert read_metrics(paths["metrics.json"])["run_status"] == "running"
    write_run(tmp_path, states, _steps(), summarize(states))
    assert _names(tmp_path) == {"requests.csv", "tokens.csv", "steps.csv", "metrics.json"}
    with pytest.raises(ValueError, match="run_status"):
        write_run(tmp_path, states, _steps(), {}, run_status="done")


def test_step_log_keeps_records_exactly_and_writes_what_a_list_writes(tmp_path):
    """The loop's column store gives back equal StepRecords (the clock's int 0 start included) and the same
    steps.csv bytes as a list of the records."""
    from core.batch import StepFeatures
    from core.output import write_run
    from core.records import StepLog, StepRecord

    recs = [StepRecord(0, 0, 0.1, StepFeatures(2, 9, 1, 8, 1, 40, 17, 8, 16, 0), 3, 0),
            StepRecord(1, 0.1, 1e-3, StepFeatures(1, 5, 0, 0, 1, 0, 2**40, 0, 2**40, 4), 7, 1)]
    log = StepLog(recs)
    assert list(log) == recs and log[-1] == recs[-1] and log[0:1] == recs[:1] and len(log) == 2
    assert type(log[0].start_s) is int
    with pytest.raises(IndexError):
        log[2]
    write_run(tmp_path / "a", [], recs, {"x": 1})
    write_run(tmp_path / "b", [], log, {"x": 1})
    assert (tmp_path / "a" / "steps.csv").read_bytes() == (tmp_path / "b" / "steps.csv").read_bytes()


def test_a_truncated_run_file_fails_naming_its_line(tmp_path):
    """A run CSV cut mid-row (a copy stopped short, an edit) is refused at the row: read as data, a short requests
    row crashed with IndexError and a short steps row read its lost features as 0 (a wrong calibration)."""
    _write(tmp_path, "run")
    requests, steps = tmp_path / "run" / "requests.csv", tmp_path / "run" / "steps.csv"
    requests.write_text(requests.read_text().rsplit(",", 5)[0] + "\n")
    with pytest.raises(ValueError, match=r"requests.csv:4: \d+ values but the header has 18 columns"):
        read_requests_csv(tmp_path / "run")
    whole = steps.read_text()
    steps.write_text(whole.rsplit(",", 3)[0] + "\n")
    with pytest.raises(ValueError, match=r"steps.csv:3: no value for \['min_decode_context', 'kv_blocks_used', "
                                         r"'num_preempted'\]"):
        read_step_features(steps)
    steps.write_text(whole.rstrip("\n") + ",9\n")  # the last row one value too many
    with pytest.raises(ValueError, match=r"steps.csv:3: 1 values more than the header has"):
        read_step_features(steps)
