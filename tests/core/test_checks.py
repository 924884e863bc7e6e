"""core.checks: every config check names the key and what is allowed; the module is plain Python."""

import ast
from pathlib import Path

import numpy as np
import pytest

from core import checks
from core.checks import check_bool, check_choice, check_float, check_fraction, check_int, check_keys


def test_the_module_imports_no_numpy_and_nothing_of_core():
    tree = ast.parse(Path(checks.__file__).read_text())
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in modules if m and (m.startswith("core") or m.startswith("numpy"))}


def test_valid_values_pass_and_come_back_converted():
    assert check_int(3, "k") == 3 and check_int(np.int64(3), "k", 1) == 3 and type(check_int(np.int64(3), "k")) is int
    assert check_int(1024.0, "k", 1, whole_float=True) == 1024
    assert check_float(2, "k") == 2.0 and check_float(np.float32(0.5), "k", 0.0, strict=True) == 0.5
    assert check_fraction(1, "k") == 1.0 and check_bool(False, "k") is False
    assert check_choice(None, "k", [None, "w4a16"]) is None
    check_keys("s", {"a": 1}, ("a", "b"))


@pytest.mark.parametrize("call, words", [
    (lambda: check_int(True, "x.n"), ["x.n=True", "an integer"]),
    (lambda: check_int(1.5, "x.n", whole_float=True), ["x.n=1.5", "an integer"]),
    (lambda: check_int(2.0, "x.n"), ["x.n=2.0", "an integer"]),
    (lambda: check_int("3", "x.n"), ["x.n='3'"]),
    (lambda: check_int(0, "x.n", 1), ["x.n=0", "an integer >= 1"]),
    (lambda: check_float(float("nan"), "x.f"), ["x.f=nan", "finite"]),
    (lambda: check_float(float("inf"), "x.f"), ["x.f=inf"]),
    (lambda: check_float(0, "x.f", 0.0, strict=True), ["x.f=0", "> 0"]),
    (lambda: check_float(-1, "x.f"), ["x.f=-1", ">= 0"]),
    (lambda: check_float(False, "x.f"), ["x.f=False"]),
    (lambda: check_fraction(0, "x.p"), ["x.p=0", "(0, 1]"]),
    (lambda: check_fraction(1.5, "x.p"), ["x.p=1.5"]),
    (lambda: check_bool("false", "x.b"), ["x.b='false'", "true or false"]),
    (lambda: check_bool(1, "x.b"), ["x.b=1"]),
    (lambda: check_choice("fp8", "x.c", ("auto", "int8")), ["x.c='fp8'", "['auto', 'int8']"]),
    (lambda: check_choice([1], "x.c", {"a": 1}), ["x.c=[1]", "['a']"]),
    (lambda: check_keys("sec", ["a", "zz"], ["a", "b"]), ["sec", "unknown keys ['zz']", "['a', 'b']"]),
])
def test_bad_values_name_the_key_and_what_is_allowed(call, words):
    with pytest.raises(ValueError) as e:
        call()
    assert all(w in str(e.value) for w in words), str(e.value)
