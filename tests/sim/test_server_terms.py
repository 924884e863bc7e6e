"""The server terms (sim/cost/server.py): hand-computed compositions, a decode run priced like its steps, and the
calibration file that carries them."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.batch import StepFeatures
from core.fast_forward import decode_features
from sim.cost.base import decode_features as decode_shape
from sim.cost.base import prefill_features
from sim.cost.calibrated import load_calibration, write_calibration
from sim.cost.linear import LinearCostModel
from sim.cost.server import ServerCostModel, ServerTerms, with_server_terms

BASE = LinearCostModel(c0_s=2e-3, per_prefill_token_s=1e-4, per_decode_seq_s=5e-4, per_kv_token_read_s=1e-7)


def test_compose_by_hand():
    t = ServerTerms(per_step_s=1e-3, per_running_seq_s=2e-4, per_output_token_s=1e-4, overlap=0.5)
    f = decode_shape(8, 100)  # 8 sequences, 8 sampled tokens
    host = 1e-3 + 8 * 2e-4 + 8 * 1e-4
    fwd = BASE.step_time(f)
    assert t.host_s(f) == pytest.approx(host)
    assert ServerCostModel(BASE, t).step_time(f) == pytest.approx(fwd + host - 0.5 * min(host, fwd))
    # a prefill chunk: one sequence, one sampled token
    p = prefill_features(64)
    assert t.host_s(p) == pytest.approx(1e-3 + 2e-4 + 1e-4)


def test_full_overlap_hides_host_work_up_to_the_forward():
    f = decode_shape(4, 50)
    fwd = BASE.step_time(f)
    small = ServerTerms(per_step_s=fwd / 2, overlap=1.0)
    assert ServerCostModel(BASE, small).step_time(f) == pytest.approx(fwd)  # hidden entirely
    big = ServerTerms(per_step_s=3 * fwd, overlap=1.0)
    assert ServerCostModel(BASE, big).step_time(f) == pytest.approx(3 * fwd)  # the longer of the two


def test_zero_terms_are_the_model_itself():
    assert with_server_terms(BASE, None) is BASE
    assert with_server_terms(BASE, ServerTerms()) is BASE
    assert isinstance(with_server_terms(BASE, {"per_step_s": 1e-3}), ServerCostModel)


def test_bad_terms_name_the_key():
    with pytest.raises(ValueError, match="server_terms.overlap"):
        ServerTerms(overlap=1.5)
    with pytest.raises(ValueError, match="per_step_s"):
        ServerTerms(per_step_s=-1.0)
    with pytest.raises(ValueError, match="server_terms"):
        ServerTerms.from_mapping({"per_token": 1.0})


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 32), st.integers(1, 500), st.integers(1, 40), st.floats(0, 1e-2), st.floats(0, 1e-3),
       st.floats(0, 1e-3), st.floats(0, 1))
def test_decode_run_prices_each_step_bit_identically(batch, context, steps, a, b, c, overlap):
    m = ServerCostModel(BASE, ServerTerms(a, b, c, overlap))
    first = StepFeatures(num_seqs=batch, num_batched_tokens=batch, num_decode_seqs=batch,
                         kv_tokens_read=batch * context, max_context_len=context)
    assert m.decode_step_times(first, steps) == [m.step_time(decode_features(first, k)) for k in range(steps)]


def test_calibration_file_carries_the_terms(tmp_path):
    terms = ServerTerms(per_step_s=1e-3, per_output_token_s=2e-4, overlap=0.25)
    path = write_calibration(tmp_path / "c.yaml", BASE, frontend_delay_s=0.01, server_terms=terms)
    loaded = load_calibration(path)
    assert isinstance(loaded, ServerCostModel) and loaded.terms == terms and loaded.forward == BASE
    assert loaded.c0_s == BASE.c0_s  # the wrapped model's attributes stay readable
    plain = write_calibration(tmp_path / "p.yaml", BASE, server_terms=ServerTerms())
    assert load_calibration(plain) == BASE and "server_terms" not in plain.read_text()
