"""A long solve says it is alive (driver-side INFO log); the default MIP backend is HiGHS."""

from __future__ import annotations

import importlib.util
import logging
import time

import pytest
from remat_pass.solvers.mip import solve as _mip
from remat_pass.solvers.problem import Problem, Value

from remat_pass import solvers
from remat_pass.planning import progress
from remat_pass.planning.budget import Budget
from remat_pass.planning.pipeline import PlanOptions, plan_problem


def _chain() -> Problem:
    values = (Value(0, "x", (), 0, available=True, keepable=False, recomputable=False),
              Value(1, "a", (0,), 1, recompute_seconds=1.0), Value(2, "b", (1,), 2, recompute_seconds=1.0))
    return Problem(values, (0, 100, 100), frozenset({1, 2}))


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == progress.__name__ and r.levelno == logging.INFO]


def test_a_long_solve_is_reported_while_it_runs(caplog):
    caplog.set_level(logging.INFO, logger=progress.__name__)
    with progress.solving("a test plan", 30.0, after=0.05, every=0.05):
        time.sleep(0.3)
    messages = _messages(caplog)
    assert sum(m.startswith("still solving a test plan") for m in messages) >= 2
    assert "(time limit 30s)" in messages[0] and messages[-1].startswith("solved a test plan in")


def test_a_short_solve_says_nothing(caplog):
    caplog.set_level(logging.INFO, logger=progress.__name__)
    with progress.solving("a quick plan"):
        pass
    assert _messages(caplog) == []


def test_the_driver_reports_a_slow_solver(caplog, monkeypatch):
    solve = solvers.solve

    def slow_solve(*args, **options):
        time.sleep(0.3)
        return solve(*args, **options)

    monkeypatch.setattr(solvers, "solve", slow_solve)  # the registry stays as it is
    monkeypatch.setattr(progress, "FIRST_REPORT_SECONDS", 0.05)
    caplog.set_level(logging.INFO, logger=progress.__name__)
    planned = plan_problem(_chain(), PlanOptions(Budget(fraction=1.0), solver="keep_all"))
    assert planned.plan.kept == {1, 2}
    assert any(m.startswith("still solving a keep_all plan for 3 values") for m in _messages(caplog))


@pytest.mark.skipif(importlib.util.find_spec("highspy") is None, reason="highspy not installed")
def test_the_default_mip_backend_is_highs():
    """highspy is a core dependency: "auto" must pick it (CBC is the fallback, tests/test_solvers.py)."""
    assert _mip.resolve_backend("auto") == "highs"


class _Terminal:
    """A stand-in for stderr at a terminal: what was written, and isatty()."""

    def __init__(self) -> None:
        self.text = ""

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> None:
        self.text += text

    def flush(self) -> None:
        pass


def test_at_a_terminal_a_long_phase_shows_a_line_that_ends_with_its_outcome(monkeypatch):
    """stderr a terminal and INFO not logged (a plain script): one status line, rewritten while the
    phase runs and ended with its outcome (a plan's gap); an inner phase owns the line while it runs;
    not a terminal: nothing written."""
    monkeypatch.setattr(logging.getLogger(progress.__name__), "level", logging.WARNING)
    terminal = _Terminal()
    with progress.phase("capturing a graph", "captured a graph", after=0.05, stream=terminal):
        with progress.solving("a test plan", 5.0, after=0.05, stream=terminal) as outcome:
            time.sleep(1.3)
            outcome.text = "feasible, proven gap 17.5%"
        time.sleep(1.3)
    assert "\rremat_pass: solving a test plan: 1s (time limit 5s)" in terminal.text
    assert "solved a test plan in 1." in terminal.text and terminal.text.count("proven gap 17.5%\x1b[K\n") == 1
    assert "\rremat_pass: capturing a graph: 2s" in terminal.text
    assert terminal.text.endswith("\x1b[K\n") and "\rremat_pass: captured a graph in 2." in terminal.text
    quiet = _Terminal()
    quiet.isatty = lambda: False
    with progress.phase("capturing a graph", "captured a graph", after=0.05, stream=quiet):
        time.sleep(0.2)
    assert quiet.text == ""
