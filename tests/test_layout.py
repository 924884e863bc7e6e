"""The layout the README describes, checked from the source: the import arrows point one way, no module imports
itself through a cycle, experiments/ keeps only the run path (its jobs are packages), and nothing cites a document a
clone does not have."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "policies", "sim", "engine", "kernels", "experiments")


def modules() -> dict[str, Path]:
    out = {}
    for top in PACKAGES:
        for f in (ROOT / top).rglob("*.py"):
            out[".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")] = f
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports (type-only and function-level imports included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            targets = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


GRAPH = {m: imports(m, p, modules()) for m, p in modules().items()}


def test_no_import_cycle():
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(GRAPH[m]):
            if state.get(n) == 1:
                cycles.append(" -> ".join([*stack[stack.index(n):], n]))
            elif n not in state:
                visit(n, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [])
    assert not cycles, cycles[:3]


@pytest.mark.parametrize(("package", "forbidden"), [
    ("core", ("policies", "sim", "engine", "kernels", "experiments")),
    ("policies", ("sim", "engine", "kernels", "experiments")),
    ("sim", ("engine", "experiments")),
    ("engine", ("sim", "experiments")),
    ("kernels", ("sim", "engine", "experiments", "policies")),
])
def test_arrows_point_one_way(package, forbidden):
    bad = {m: sorted(n for n in deps if n.split(".")[0] in forbidden)
           for m, deps in GRAPH.items() if m.split(".")[0] == package}
    assert not {m: v for m, v in bad.items() if v}


def test_core_imports_no_framework():
    pattern = re.compile(r"^\s*(from|import) (torch|simpy|hydra|omegaconf)\b", re.M)
    assert not [p.name for p in (ROOT / "core").rglob("*.py") if pattern.search(p.read_text())]


def test_experiments_keeps_the_run_path_and_its_jobs_are_packages():
    own = [p for p in (ROOT / "experiments").glob("*.py")]
    assert sum(len(p.read_text().splitlines()) for p in own) <= 3000
    for job in ("serving", "calibration", "studies", "benchmarks"):
        assert (ROOT / "experiments" / job / "__init__.py").is_file()


def test_no_file_cites_a_document_outside_the_repository():
    cite = re.compile(r"DESIGN(\.md| section| §)")
    files = [p for ext in ("*.py", "*.md", "*.yaml") for p in ROOT.glob(f"**/{ext}")
             if not any(part.startswith(".") or part in ("outputs", "multirun") for part in p.relative_to(ROOT).parts)]
    assert not [str(p.relative_to(ROOT)) for p in files if cite.search(p.read_text())]
