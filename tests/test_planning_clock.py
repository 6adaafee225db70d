"""The planning clock (``solvers.clock``): a time limit buys the same work on a busy machine.

A planner's deadlines were read on the wall clock, so on a machine shared with other processes the
same graph and budget got less search, and a hard budget could be planned in one run and refused
in another. Within a planning call the clock counts the smaller of wall and this process's CPU time.
"""

from __future__ import annotations

import time

from remat_pass import solvers
from remat_pass.solvers import clock

from .test_solvers import chain


def _busy(seconds: float) -> None:
    until = time.process_time() + seconds
    while time.process_time() < until:
        pass


def test_time_this_process_does_not_run_is_not_counted():
    """Half of every millisecond descheduled (what sharing a core with one busy process does): the
    limit still buys its full share of work, and the call takes about twice as long on the wall."""
    with clock.counting():
        began_wall, began = time.perf_counter(), clock.now()
        rounds = 0
        while clock.now() < began + 0.3:
            _busy(0.002)
            time.sleep(0.002)
            rounds += 1
        wall = time.perf_counter() - began_wall
    assert rounds >= 0.3 / 0.002 * 0.8, rounds  # the work of 0.3 s, give or take the loop's own cost
    assert wall >= 0.5, wall


def test_outside_a_planning_call_and_for_a_multithreaded_solver_it_is_the_wall_clock():
    """The smaller of the two: CPU time that runs ahead of the wall's (a solver's worker threads)
    does not shorten a limit, and outside a call nothing but the wall is counted."""
    before = time.perf_counter()
    assert before <= clock.now() <= time.perf_counter()
    with clock.counting():
        began = clock.now()
        _busy(0.05)
        assert clock.now() - began <= time.perf_counter() - before


def test_nested_calls_share_the_outer_count_and_every_planner_counts(monkeypatch):
    """A planner called inside another (``ilp_peak``'s cap search runs ``ilp``) spends the outer
    call's limit, so it must not restart the count; every registered planner runs counting."""
    with clock.counting():
        outer = clock._STARTED.get()
        with clock.counting():
            assert clock._STARTED.get() == outer
    assert clock._STARTED.get() is None

    counted = []
    decide = solvers.peak.planner.baselines.keep_all
    monkeypatch.setattr(solvers.peak.planner.baselines, "keep_all",
                        lambda problem: counted.append(clock._STARTED.get() is not None) or decide(problem))
    solvers.get_solver("ilp_peak")(chain(), 250, time_limit=5)
    assert counted == [True]
