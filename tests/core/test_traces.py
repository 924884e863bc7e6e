"""Trace readers and replay workloads on the real trace files and on malformed inputs."""

import json
import time
from pathlib import Path

import pytest

from core.prompt import block_hashes
from core.workload import AzureTrace, MooncakeTrace, RequestList
from core.workload.traces import read_azure, read_mooncake, read_request_list, read_trace

TRACES = Path(__file__).resolve().parents[3] / "shared" / "data" / "traces"
MOONCAKE = TRACES / "conversation_trace.jsonl"
AZURE = TRACES / "AzureLLMInferenceTrace_conv.csv"


def _raw_mooncake(n):
    with open(MOONCAKE) as f:
        return [json.loads(next(f)) for _ in range(n)]


def test_mooncake_first_100_rows():
    raw = _raw_mooncake(100)
    reqs = list(MooncakeTrace(limit=100).initial())
    assert len(reqs) == 100 and reqs[0].arrival_s == 0.0
    t0 = min(d["timestamp"] for d in raw)
    by_id = {r.id: r for r in reqs}
    for i, d in enumerate(raw):
        r = by_id[f"r{i}"]
        assert r.arrival_s == pytest.approx((d["timestamp"] - t0) / 1000)
        assert (r.prompt_len, r.max_new_tokens, r.hash_ids, r.tokens_per_hash_id) == \
            (d["input_length"], d["output_length"], tuple(d["hash_ids"]), 512)
    # rows sharing their first hash ids share exactly those KV blocks (16-token blocks: 32 per id)
    a, b = by_id["r0"], by_id["r1"]
    common = next(k for k, (x, y) in enumerate(zip(a.hash_ids, b.hash_ids, strict=False)) if x != y)
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert ha[:32 * common] == hb[:32 * common] and ha[32 * common] != hb[32 * common]


def test_mooncake_default_path_resolves_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert len(MooncakeTrace(limit=3)) == 3


def test_mooncake_time_and_length_scale():
    base = list(MooncakeTrace(limit=50).initial())
    small = list(MooncakeTrace(limit=50, time_scale=0.5, length_scale=1 / 32).initial())
    for r, s in zip(base, small, strict=True):
        assert s.arrival_s == pytest.approx(r.arrival_s * 0.5)
        assert s.tokens_per_hash_id == 16 and s.hash_ids == r.hash_ids
        assert s.prompt_len == max(1, round(r.prompt_len / 32)) and s.max_new_tokens == max(1, round(r.max_new_tokens
                                                                                                      / 32))
    with pytest.raises(ValueError, match="length_scale"):
        MooncakeTrace(limit=5, length_scale=0.3)


def test_azure_first_100_rows():
    reqs = list(AzureTrace(limit=100).initial())
    assert len(reqs) == 100 and reqs[0].arrival_s == 0.0
    # 18:15:46.6805900 -> 18:15:50.9951690 and -> 18:15:51.2224670 (rows 1-3 of the file)
    assert reqs[1].arrival_s == pytest.approx(4.314579, abs=1e-9)
    assert reqs[2].arrival_s == pytest.approx(4.541877, abs=1e-9)
    assert [(r.prompt_len, r.max_new_tokens) for r in reqs[:2]] == [(374, 44), (396, 109)]
    assert all(r.hash_ids is None and r.prompt_token_ids is None for r in reqs)
    assert len({r.id for r in reqs}) == 100


def test_read_trace_detects_the_format():
    assert next(read_trace(MOONCAKE)).hash_ids == (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13)
    assert next(read_trace(AZURE)).prompt_len == 374


@pytest.mark.parametrize("lines, words", [
    (['{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}', '{"timestamp": 1,'],
     [":2:", "bad JSON"]),
    (['{"timestamp": 0, "input_length": 5, "hash_ids": [0]}'], [":1:", "'output_length'", "missing"]),
    (['{"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": [0]}'], [":1:", "'input_length'", ">= 1"]),
    (['', '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0]}'], [":2:", "'hash_ids'",
                                                                                           "cannot cover"]),
    (['{"timestamp": "x", "input_length": 6, "output_length": 1, "hash_ids": [0]}'], ["'timestamp'", "not a number"]),
    (['{"timestamp": 0, "input_length": 6, "output_length": 1, "hash_ids": [0, "a"]}'], ["'hash_ids'"]),
    (['[1, 2]'], [":1:", "JSON object"]),
])
def test_malformed_mooncake_lines(tmp_path, lines, words):
    f = tmp_path / "bad.jsonl"
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as e:
        MooncakeTrace(path=str(f))
    assert str(f) in str(e.value) and all(w in str(e.value) for w in words)


def test_unsorted_timestamps_are_sorted(tmp_path):
    f = tmp_path / "t.jsonl"
    rows = [(3000, 10), (1000, 20), (2000, 30), (1000, 40)]
    f.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": 1, "hash_ids": [i]}) + "\n"
                         for i, (t, n) in enumerate(rows)))
    reqs = list(MooncakeTrace(path=str(f)).initial())
    assert [(r.arrival_s, r.prompt_len) for r in reqs] == [(0.0, 20), (0.0, 40), (1.0, 30), (2.0, 10)]


def test_malformed_azure(tmp_path):
    f = tmp_path / "a.csv"
    f.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,10,2\n"
                 "2023-11-16 18:15:47.00,x,2\n")
    with pytest.raises(ValueError, match=r":3: field 'ContextTokens'"):
        AzureTrace(path=str(f))
    f.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,10,2\n")
    with pytest.raises(ValueError, match=r":2: field 'TIMESTAMP'"):
        AzureTrace(path=str(f))
    f.write_text("TIMESTAMP,Context\n2023-11-16 18:15:46.68,10\n")
    with pytest.raises(ValueError, match="missing column"):
        list(read_azure(f))


def test_request_list_jsonl_and_csv(tmp_path):
    j = tmp_path / "r.jsonl"
    j.write_text("\n".join([
        '{"id": "b", "arrival_s": 2.0, "prompt_token_ids": [5, 6, 7], "output_tokens": 4, "tenant": "x"}',
        '{"id": "a", "arrival_s": 1.0, "hash_ids": [1, 2], "output_tokens": 3, "warmup": true, "priority": -1}',
        '{"id": "c", "arrival_s": 3.0, "hash_ids": [1, 9], "prompt_tokens": 20, "output_tokens": 1}',
    ]) + "\n")
    c = tmp_path / "r.csv"
    c.write_text("id,arrival_s,prompt_tokens,prompt_token_ids,hash_ids,output_tokens,tenant,warmup,priority\n"
                 "b,2.0,,5 6 7,,4,x,,\n"
                 "a,1.0,,,1 2,3,,1,-1\n"
                 "c,3.0,20,,1 9,1,,false,\n")
    for f in (j, c):
        a, b, cc = list(RequestList(path=str(f), tokens_per_hash_id=16, time_scale=2.0).initial())
        assert (a.id, a.arrival_s, a.prompt_len, a.hash_ids, a.warmup, a.priority) == ("a", 2.0, 32, (1, 2), True, -1)
        assert (b.id, b.prompt_token_ids, b.prompt_len, b.tenant, b.max_new_tokens) == ("b", (5, 6, 7), 3, "x", 4)
        assert (cc.prompt_len, cc.warmup) == (20, False)
        assert block_hashes(a, 16)[0] == block_hashes(cc, 16)[0]  # shared first content id


@pytest.mark.parametrize("row, words", [
    ('{"arrival_s": 0, "prompt_tokens": 5}', ["'output_tokens'", "missing"]),
    ('{"arrival_s": -1, "prompt_tokens": 5, "output_tokens": 1}', ["'arrival_s'", ">= 0"]),
    ('{"arrival_s": 0, "output_tokens": 1}', ["'prompt_tokens'", "missing"]),
    ('{"arrival_s": 0, "prompt_token_ids": [1], "hash_ids": [1], "output_tokens": 1}', ["not both"]),
    ('{"arrival_s": 0, "prompt_tokens": 4, "prompt_token_ids": [1], "output_tokens": 1}', ["'prompt_tokens'"]),
    ('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 1, "warmup": "maybe"}', ["'warmup'"]),
])
def test_malformed_request_list(tmp_path, row, words):
    f = tmp_path / "r.jsonl"
    f.write_text('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 1}\n' + row + "\n")
    with pytest.raises(ValueError) as e:
        list(read_request_list(f))
    assert ":2:" in str(e.value) and all(w in str(e.value) for w in words)


@pytest.mark.parametrize("row, words", [
    ('{"id": "a\\ud800", "arrival_s": 0, "prompt_tokens": 5, "output_tokens": 1}', ["'id'", "surrogate"]),
    ('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 1, "tenant": "\\udfff"}', ["'tenant'", "surrogate"]),
])
def test_a_lone_surrogate_is_refused_when_read(tmp_path, row, words):
    """Valid JSON that no output file can hold: refused with file:line when read, not after the whole run."""
    f = tmp_path / "r.jsonl"
    f.write_text('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 1}\n' + row + "\n")
    with pytest.raises(ValueError) as e:
        list(read_request_list(f))
    assert f"{f}:2:" in str(e.value) and all(w in str(e.value) for w in words)


@pytest.mark.parametrize("name", ["r.jsonl", "r.csv", "a.csv", "m.jsonl"])
def test_a_binary_file_is_refused_with_file_and_line(tmp_path, name):
    f = tmp_path / name
    f.write_bytes(b'{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 1}\n' if name.endswith("jsonl")
                  else b"arrival_s,prompt_tokens,output_tokens\n0,5,1\n")
    with open(f, "ab") as out:
        out.write(b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x00\n")
    line = 2 if name.endswith("jsonl") else 3
    with pytest.raises(ValueError, match=f"{f}:{line}: not UTF-8 text"):
        list(read_trace(f))
    nul = tmp_path / f"nul-{name}"
    nul.write_bytes(b"\x00\x01\x02\n")
    with pytest.raises(ValueError, match=f"{nul}:1: a NUL byte"):
        list(read_trace(nul))


def test_request_list_duplicate_ids_and_missing_file(tmp_path):
    f = tmp_path / "r.jsonl"
    f.write_text('{"id": "x", "arrival_s": 0, "prompt_tokens": 5, "output_tokens": 1}\n' * 2)
    with pytest.raises(ValueError, match="duplicate id 'x'"):
        RequestList(path=str(f))
    with pytest.raises(FileNotFoundError, match="no such file"):
        RequestList(path=str(tmp_path / "nope.jsonl"))


def test_limit_stops_reading_early(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n{broken\n')
    assert len(list(read_mooncake(f, limit=1))) == 1


@pytest.mark.slow
def test_100k_row_trace_loads_in_seconds(tmp_path):
    f = tmp_path / "big.jsonl"
    line = '{{"timestamp": {t}, "input_length": 9000, "output_length": 300, "hash_ids": [{ids}]}}\n'
    f.write_text("".join(line.format(t=i * 30, ids=", ".join(str(i * 18 + k) for k in range(18)))
                         for i in range(100_000)))
    start = time.perf_counter()
    wl = MooncakeTrace(path=str(f))
    n = sum(1 for _ in wl.initial())
    assert n == 100_000 and time.perf_counter() - start < 10.0


def test_a_byte_order_mark_is_not_part_of_the_header(tmp_path):
    azure = tmp_path / "azure.csv"
    azure.write_bytes(b"\xef\xbb\xbfTIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n")
    rows = list(read_trace(azure))
    assert [(r.prompt_len, r.output_len) for r in rows] == [(374, 44)]
    listed = tmp_path / "reqs.csv"
    listed.write_bytes(b"\xef\xbb\xbfarrival_s,prompt_tokens,output_tokens\n0.5,10,3\n")
    assert [(r.arrival_s, r.prompt_len) for r in read_request_list(listed)] == [(0.5, 10)]
    jsonl = tmp_path / "reqs.jsonl"
    jsonl.write_bytes(b'\xef\xbb\xbf{"arrival_s": 1, "prompt_tokens": 4, "output_tokens": 2}\n')
    assert [r.prompt_len for r in read_trace(jsonl)] == [4]


def test_an_unknown_request_list_field_warns_once_with_its_line(tmp_path, caplog):
    f = tmp_path / "reqs.jsonl"
    f.write_text("\n".join(json.dumps({"arrival_s": i, "prompt_tokens": 4, "output_tokens": 2, "priorty": 1})
                           for i in range(3)))
    with caplog.at_level("WARNING"):
        rows = list(read_request_list(f))
    assert [r.priority for r in rows] == [0, 0, 0]
    warnings = [r.getMessage() for r in caplog.records if "priorty" in r.getMessage()]
    assert len(warnings) == 1 and f"{f}:1:" in warnings[0] and "did you mean 'priority'" in warnings[0]


@pytest.mark.parametrize("text, words", [
    # an unquoted comma in the last field: its tail would be dropped without a word
    ("arrival_s,prompt_tokens,output_tokens,tenant\n0,10,2,acme\n1,10,2,acme, inc\n",
     [":3:", "5 values but the header has 4 columns", "' inc'"]),
    # the second arrival_s column would silently win
    ("arrival_s,prompt_tokens,output_tokens,arrival_s\n0,10,2,7\n", [":1:", "['arrival_s'] named more than once"]),
    ("", [":1:", "empty file", "header row"]),
])
def test_a_malformed_csv_layout_fails_with_its_line(tmp_path, text, words):
    f = tmp_path / "reqs.csv"
    f.write_text(text)
    with pytest.raises(ValueError) as e:
        RequestList(path=str(f))
    assert str(e.value).startswith(f"{f}:") and all(w in str(e.value) for w in words)
    azure = tmp_path / "azure.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,10,2,9\n")
    with pytest.raises(ValueError, match=r"azure.csv:2: 4 values but the header has 3 columns"):
        list(read_azure(azure))
