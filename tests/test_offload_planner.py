"""Offload as a planner decision, on hand-made problems (torch-free): when it is chosen, when it is
not, what its transfers cost and what they do to memory."""

from __future__ import annotations

import pytest
from remat_pass.solvers.analysis.memory import simulate_plan
from remat_pass.solvers.analysis.transfers import offload_candidates, transfer_schedule
from remat_pass.solvers.problem import BackwardStep, Plan, Problem, Value
from remat_pass.solvers.tags import Tag

from remat_pass import solvers


def _chain(host_bytes_per_second: float, forward: tuple[float, float, float] = (1.0, 1.0, 1.0),
           reads_first: int = 3) -> Problem:
    """x -> h1 -> h2 -> h3, 100 bytes each; backward reads h3, h2, h1 in that order (1 s a step),
    or ``reads_first`` first."""
    x = Value(0, "x", (), storage=0, available=True)
    hs = [Value(i, f"h{i}", (i - 1,), storage=i, recompute_seconds=forward[i - 1], flops=10**9, module=f"layer{i}",
                tags=frozenset({Tag.MATMUL})) for i in (1, 2, 3)]
    order = [reads_first] + [i for i in (3, 2, 1) if i != reads_first]
    steps = tuple(BackwardStep((i,), 0, 1.0) for i in order)
    return Problem((x, *hs), (0, 100, 100, 100), frozenset({1, 2, 3}), device="test", backward_steps=steps,
                   host_bytes_per_second=host_bytes_per_second)


def test_offload_is_chosen_for_expensive_values_on_a_fast_link():
    problem = _chain(host_bytes_per_second=1000.0)  # 0.1 s a transfer, 1 s of compute around each
    plan = solvers.solve(problem, 100, solver="ilp_offload")
    assert plan.offloaded == {1, 2} and plan.kept == {3} and not plan.recomputed
    assert plan.exposed_transfer_seconds == 0.0 and plan.recompute_seconds == 0.0
    assert plan.kept_bytes == 100 and plan.offloaded_bytes == plan.host_bytes == 200
    without = solvers.solve(problem, 100, solver="ilp")
    assert without.recompute_seconds == pytest.approx(2.0)  # what offloading saved


def test_offload_is_never_chosen_when_the_transfer_cannot_hide_and_recompute_is_cheap():
    problem = _chain(host_bytes_per_second=10.0, forward=(0.01, 0.01, 0.01))  # 10 s a transfer
    assert offload_candidates(problem) == {}
    plan = solvers.solve(problem, 100, solver="ilp_offload")
    assert not plan.offloaded and plan.recompute_seconds == pytest.approx(0.02)


@pytest.mark.parametrize("budget", [0, 100, 200])
def test_values_backward_reads_at_once_are_never_offloaded(budget):
    problem = _chain(host_bytes_per_second=1e9, reads_first=1)  # h1 is read by backward's first op
    assert 1 not in {c.creator for c in offload_candidates(problem).values()}
    plan = solvers.solve(problem, budget, solver="ilp_offload")
    assert 1 not in plan.offloaded


def test_a_host_budget_bounds_the_offloaded_bytes():
    problem = _chain(host_bytes_per_second=1000.0)
    plan = solvers.solve(problem, 100, solver="ilp_offload", host_budget_bytes=100)
    assert plan.offloaded_bytes <= 100 and plan.recompute_seconds > 0


def test_a_send_that_outlasts_the_forward_is_exposed_time():
    # h1 made at 1.0 s, h2 at 1.1 s, forward over at 2.1 s; 0.9 s a send, one at a time:
    # h1 goes 1.0-1.9, h2 waits for the link and goes 1.9-2.8: 0.7 s after the forward ends.
    problem = _chain(host_bytes_per_second=100 / 0.9, forward=(1.0, 0.1, 1.0))
    plan = Plan(problem, kept=frozenset({3}), recomputed=frozenset(), offloaded=frozenset({1, 2}), solver="manual")
    schedule = transfer_schedule(problem, plan)
    assert schedule.forward_exposed_seconds == pytest.approx(0.7)
    # Backward needs h2 at 1.0 s and h1 at 2.0 s: fetched as late as hides, no stall.
    assert schedule.backward_exposed_seconds == pytest.approx(0.0, abs=1e-12)
    by = schedule.by_storage()
    assert by[2].fetch_end <= by[2].need_time and by[1].fetch_end <= by[1].need_time
    assert plan.exposed_transfer_seconds == pytest.approx(0.7)


def test_a_fetch_that_cannot_finish_in_time_stalls_backward():
    problem = _chain(host_bytes_per_second=100 / 1.5, forward=(1.0, 5.0, 1.0))
    plan = Plan(problem, kept=frozenset({1, 3}), recomputed=frozenset(), offloaded=frozenset({2}), solver="manual")
    # h2 is needed at 1.0 s into backward; its fetch takes 1.5 s from backward's start.
    assert transfer_schedule(problem, plan).backward_exposed_seconds == pytest.approx(0.5)


def test_offloaded_bytes_leave_the_device_when_the_send_is_done_and_return_at_the_fetch():
    problem = _chain(host_bytes_per_second=1000.0)
    keep_all = solvers.solve(problem, None, solver="keep_all")
    offload = Plan(problem, kept=frozenset({3}), recomputed=frozenset(), offloaded=frozenset({1, 2}), solver="manual")
    kept, sent = simulate_plan(problem, keep_all), simulate_plan(problem, offload)
    assert kept.forward_live == (100, 200, 300)
    # h1's send (1.0-1.1 s) is done by the end of h2's op: h1's wait runs there, after h2 read it.
    assert sent.forward_live == (100, 200, 200)
    # Backward, 1 s a step: h2 is read at 1.0 s, so its 0.1 s fetch must run in step 0 and is issued
    # at its start; h1 is read at 2.0 s and fetched at the start of step 1. h3 dies after step 0.
    assert sent.backward_live == (200, 200, 100)
    assert sent.peak_bytes < kept.peak_bytes


def test_a_storage_is_kept_or_offloaded_never_both():
    x = Value(0, "x", (), storage=0, available=True)
    base = Value(1, "mm", (0,), storage=1, recompute_seconds=1.0)
    view = Value(2, "view", (1,), storage=1)
    problem = Problem((x, base, view), (0, 64), frozenset({1, 2}), host_bytes_per_second=1.0)
    with pytest.raises(ValueError, match="both kept on the device and offloaded"):
        Plan(problem, kept=frozenset({2}), recomputed=frozenset(), offloaded=frozenset({1}), solver="manual")


def test_offload_needs_a_host_link():
    problem = _chain(host_bytes_per_second=0.0)
    with pytest.raises(ValueError, match="no host link"):
        Plan(problem, kept=frozenset({3}), recomputed=frozenset(), offloaded=frozenset({1, 2}), solver="manual")
    with pytest.raises(ValueError, match="needs a device with a host link"):
        solvers.offload_solver(problem, "ilp", peak=False)
    with pytest.raises(ValueError, match="does not offload"):
        solvers.offload_solver(_chain(1000.0), "per_block", peak=False)


def test_per_module_labels_offload():
    problem = _chain(host_bytes_per_second=1000.0)
    plan = solvers.solve(problem, 100, solver="ilp_offload")
    policies = {row.module: row.policy for row in plan.per_module()}
    assert policies == {"layer1": "offload", "layer2": "offload", "layer3": "none"}
    assert plan.to_dict()["offloaded_bytes"] == 200


def test_peak_budget_with_offload_is_met_and_beats_recompute():
    problem = _chain(host_bytes_per_second=1000.0)
    keep_all_peak = simulate_plan(problem, solvers.solve(problem, None, solver="keep_all")).peak_bytes
    plan = solvers.solve(problem, 250, solver="ilp_peak", cap_solver="ilp_offload")
    assert simulate_plan(problem, plan).peak_bytes <= 250 < keep_all_peak
    assert plan.offloaded
    recompute_only = solvers.solve(problem, 250, solver="ilp_peak")
    assert plan.predicted_extra_seconds < recompute_only.predicted_extra_seconds
