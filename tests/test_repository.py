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
