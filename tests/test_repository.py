"""Repository rules the README's test command checks too (CI also runs them on their own)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _line_budget():
    spec = importlib.util.spec_from_file_location("line_budget", ROOT / ".ci" / "line_budget.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_library_modules_keep_the_line_budget():
    assert _line_budget().violations(ROOT) == []


def test_the_line_budget_catches_a_long_module(tmp_path):
    budget = _line_budget()
    (tmp_path / "remat_pass").mkdir()
    (tmp_path / "solvers").mkdir()
    (tmp_path / "remat_pass" / "long.py").write_text("x = 1\n" * (budget.LIMIT + 1))
    found = budget.violations(tmp_path)
    assert any(line.startswith(f"remat_pass/long.py: {budget.LIMIT + 1} lines") for line in found)
    assert all("missing" in line for line in found if not line.startswith("remat_pass/long.py"))


def _private_imports(path: Path) -> list[str]:
    """``from <a remat_pass module> import _name`` in ``path``: one module reaching into another's privates."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ImportFrom) or node.module == "__future__":
            continue
        ours = node.level > 0 or (node.module or "").split(".")[0] in ("remat_pass", "benchmarks")
        for alias in node.names if ours else ():
            if alias.name.startswith("_"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {alias.name}")
    return found


def test_no_module_imports_another_modules_private_names():
    """Library, solver and benchmark code share only public names (a private one is free to change)."""
    files = [p for folder in ("remat_pass", "solvers", "benchmarks") for p in sorted((ROOT / folder).rglob("*.py"))]
    found = [hit for path in files for hit in _private_imports(path)]
    assert found == []
