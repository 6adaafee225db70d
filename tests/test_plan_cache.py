"""The plan cache on disk: a restarted job (a fresh process) skips the solve; a changed planning input misses."""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import remat_pass
from remat_pass.runtime import plan_cache as plan_cache_module
from remat_pass.planning.budget import Budget
from remat_pass.planning.pipeline import PlanOptions, plan_problem
from remat_pass.runtime.plan_cache import PlanCache
from remat_pass.solvers.analysis.memory import simulate_plan
from remat_pass.solvers.problem import BackwardStep, Plan, Problem, Value
from remat_pass.solvers.status import Status

from .helpers import assert_same_step, eager_reference, run_step


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8))


def _loss(output, *_inputs):
    return output.square().mean()


def _step(cache, budget=0.5):
    torch._dynamo.reset()  # a fresh compile, as a restarted job would make
    model, inputs = _model(), (torch.randn(4, 8),)
    compiled = torch.compile(model, backend=remat_pass.backend(budget, plan_cache=cache))
    return model, inputs, run_step(model, compiled, inputs, _loss), compiled


def test_same_graph_and_inputs_hit_and_a_changed_budget_misses(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=plan_cache_module.__name__)
    cache = PlanCache(tmp_path)
    _step(cache)
    assert cache.stats == {"hits": 0, "misses": 1} and len(list(tmp_path.glob("*.json"))) == 1
    model, inputs, cached, _ = _step(cache)
    assert cache.stats == {"hits": 1, "misses": 1}
    assert_same_step(cached, eager_reference(model, inputs, _loss))
    _step(cache, budget=0.3)
    assert cache.stats == {"hits": 1, "misses": 2} and len(list(tmp_path.glob("*.json"))) == 2
    messages = [r.getMessage() for r in caplog.records if r.name == plan_cache_module.__name__]
    assert sum("plan cache hit" in m for m in messages) == 1 and sum("plan cache miss" in m for m in messages) == 2


def test_a_fresh_process_with_the_same_cache_hits(tmp_path):
    _step(str(tmp_path))
    script = textwrap.dedent(f"""
        import json, torch
        from torch import nn
        import remat_pass
        from remat_pass.runtime.plan_cache import PlanCache
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8))
        cache = PlanCache({str(tmp_path)!r})
        # eager, as conftest makes the parent's: Inductor hands the partitioner another joint graph
        compiled = torch.compile(model, backend=remat_pass.backend(0.5, plan_cache=cache, inner="eager"))
        compiled(torch.randn(4, 8)).square().mean().backward()
        print(json.dumps(cache.stats))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"hits": 1, "misses": 0}


def test_an_unreadable_file_is_a_miss_and_is_rewritten(tmp_path):
    cache = PlanCache(tmp_path)
    _step(cache)
    (path,) = tmp_path.glob("*.json")
    path.write_text("{not json")
    _step(cache)
    assert cache.stats == {"hits": 0, "misses": 2}
    assert json.loads(path.read_text())["format"] == plan_cache_module.FORMAT


def test_plan_cache_argument_is_checked():
    with pytest.raises(TypeError, match="plan_cache must be"):
        remat_pass.backend(0.5, plan_cache=42)


def test_optimize_takes_a_plan_cache(tmp_path):
    cache = PlanCache(tmp_path)
    for expected_stats in ({"hits": 0, "misses": 1}, {"hits": 1, "misses": 1}):
        torch._dynamo.reset()
        model, inputs = _model(), (torch.randn(4, 8),)
        optimized = remat_pass.optimize(model, budget=0.5, plan_cache=cache)
        assert_same_step(run_step(model, optimized, inputs, _loss), eager_reference(model, inputs, _loss))
        assert cache.stats == expected_stats


# --- measured costs: keyed by structure, re-priced on a hit -------------------------------------


def _chain(seconds: list[float], nbytes: int = 1000, costs: str = "measure") -> Problem:
    """x (available) -> v1 -> ... -> vn, each value its own storage, all read by backward."""
    values = [Value(0, "x", (), storage=0, available=True)]
    values += [Value(i, f"v{i}", (i - 1,), storage=i, recompute_seconds=s, flops=10, op="tanh")
               for i, s in enumerate(seconds, start=1)]
    return Problem(tuple(values), (0, *[nbytes] * len(seconds)), frozenset(range(1, len(values))), costs=costs)


def _jittered(problem: Problem, seed: int, spread: float = 0.05) -> Problem:
    rng = random.Random(seed)
    values = tuple(dataclasses.replace(v, recompute_seconds=v.recompute_seconds * rng.uniform(1 - spread, 1 + spread))
                   for v in problem.values)
    return dataclasses.replace(problem, values=values)


def test_measured_costs_that_jitter_hit_one_entry_and_the_plan_is_repriced(tmp_path):
    cache = PlanCache(tmp_path)
    options = PlanOptions(Budget(fraction=0.5), plan_cache=cache, costs="measure")
    measured = _chain([3e-4, 1e-4, 5e-4, 2e-4, 4e-4, 1e-4, 6e-4, 2e-4])
    first = plan_problem(measured, options).plan
    assert cache.stats == {"hits": 0, "misses": 1} and first.recomputed and first.status is Status.OPTIMAL
    for seed in range(3):
        rerun = _jittered(measured, seed)
        cached = plan_problem(rerun, options).plan
        assert cache.stats == {"hits": seed + 1, "misses": 1} and len(list(tmp_path.glob("*.json"))) == 1
        assert (cached.kept, cached.recomputed) == (first.kept, first.recomputed)
        assert cached.problem is rerun  # priced with this run's costs, not the stored ones
        assert cached.recompute_seconds == pytest.approx(sum(rerun.values[i].recompute_seconds for i in cached.recomputed))
        assert cached.recompute_seconds != first.recompute_seconds
        # The gap it claims holds: this run's own optimum is no cheaper than the bound it implies.
        fresh = plan_problem(rerun, dataclasses.replace(options, plan_cache=None)).plan
        assert cached.gap is not None and fresh.recompute_seconds >= (1 - cached.gap) * cached.recompute_seconds - 1e-15
        assert cached.status is (Status.OPTIMAL if cached.gap == 0 else Status.FEASIBLE)
    plan_problem(_chain([3e-4, 1e-4, 5e-4, 2e-4, 4e-4, 1e-4, 6e-4, 2e-4], nbytes=1024), options)
    assert cache.stats == {"hits": 3, "misses": 2}, "other bytes are another problem"


def test_costs_that_scale_uniformly_keep_a_proven_plan_optimal(tmp_path):
    cache = PlanCache(tmp_path)
    options = PlanOptions(Budget(fraction=0.5), plan_cache=cache, costs="measure")
    measured = _chain([3e-4, 1e-4, 5e-4, 2e-4, 4e-4, 1e-4])
    first = plan_problem(measured, options).plan
    slower = dataclasses.replace(measured, values=tuple(
        dataclasses.replace(v, recompute_seconds=2 * v.recompute_seconds) for v in measured.values))
    cached = plan_problem(slower, options).plan
    assert cache.stats["hits"] == 1 and cached.status is Status.OPTIMAL and cached.gap == 0
    assert cached.recompute_seconds == pytest.approx(2 * first.recompute_seconds)


def test_model_costs_stay_in_the_key(tmp_path):
    cache = PlanCache(tmp_path)
    options = PlanOptions(Budget(fraction=0.5), plan_cache=cache)
    roofline = _chain([3e-4, 1e-4, 5e-4, 2e-4], costs="roofline")
    plan_problem(roofline, options)
    plan_problem(_jittered(roofline, 0), options)  # a roofline that moved is another device or graph
    assert cache.stats == {"hits": 0, "misses": 2}


def _offloading(middle_seconds: float) -> Problem:
    """a (100 B) is offloaded; its send (1 s on a 100 B/s link) ends during b or c, by b's cost."""
    seconds = (0.0, 1.0, middle_seconds, 1.0, 1.0)
    values = [Value(0, "x", (), 0, available=True)]
    values += [Value(i, "abcd"[i - 1], (i - 1,), i, recompute_seconds=seconds[i]) for i in range(1, 5)]
    return Problem(tuple(values), (0, 100, 10, 10, 10), frozenset({1, 4}), device="cuda",
                   forward_outputs=frozenset({4}), backward_steps=(BackwardStep((4,), seconds=1.0),
                                                                   BackwardStep((1,), seconds=1.0)),
                   host_bytes_per_second=100.0, costs="measure")


def test_a_cached_offload_plan_whose_peak_rises_with_the_measured_costs_misses(tmp_path):
    cache = PlanCache(tmp_path)
    options = PlanOptions(Budget(nbytes=110), offload=True, costs="measure")
    budget = {"fraction": None, "nbytes": 110, "kind": "peak"}

    def offload_plan(problem: Problem) -> Plan:
        plan = Plan(problem, frozenset({4}), frozenset(), "manual", offloaded=frozenset({1}))
        return dataclasses.replace(plan, predicted_peak_bytes=simulate_plan(problem, plan).peak_bytes)

    planned = _offloading(1.0)  # the send ends with b: a is freed before c is made
    cache.put(planned, options, offload_plan(planned), budget)
    hit, _ = cache.get(_offloading(1.5), options)  # still ends during b
    assert hit.predicted_peak_bytes == 110 and hit.gap is None and hit.status is Status.FEASIBLE
    assert cache.get(_offloading(0.1), options) is None  # now a lives through c: 120 bytes
    assert cache.stats == {"hits": 1, "misses": 1}


def test_measured_costs_hit_the_cache_across_compiles(tmp_path):
    cache = PlanCache(tmp_path)
    for _ in range(2):
        torch._dynamo.reset()
        model, inputs = _model(), (torch.randn(4, 8),)
        compiled = torch.compile(model, backend=remat_pass.backend(0.5, plan_cache=cache, costs="measure"))
        assert_same_step(run_step(model, compiled, inputs, _loss), eager_reference(model, inputs, _loss))
    assert cache.stats == {"hits": 1, "misses": 1}


@pytest.fixture
def solves(monkeypatch):
    """The name of every planner run, in order (each registry entry wrapped)."""
    import functools

    from remat_pass import solvers

    ran: list[str] = []
    for name, planner in list(solvers.SOLVERS.items()):
        @functools.wraps(planner)
        def counting(*args, _planner=planner, _name=name, **kwargs):
            ran.append(_name)
            return _planner(*args, **kwargs)

        monkeypatch.setitem(solvers.SOLVERS, name, counting)
    return ran


def test_by_default_a_second_run_does_not_solve_again_and_a_new_shape_does(solves, monkeypatch):
    """The cache is on by default (conftest points its directory at a temporary one): a new
    ``RematModule`` in what stands for a second process (no cache object in memory, a fresh dynamo)
    plans the same graph without a solve, and trains like eager; a new input shape is a new
    graph, solved. ``plan`` and ``explain`` the same; ``plan_cache=False`` always solves."""
    from remat_pass.tools.explain import explain

    model, x = _model(), torch.randn(4, 8)
    remat_pass.optimize(model, 0.5, example_inputs=(x,))
    first = len(solves)
    assert first > 0
    monkeypatch.setattr(plan_cache_module, "_DEFAULT_CACHES", {})  # a second process: nothing in memory
    torch._dynamo.reset()
    again = remat_pass.optimize(model, 0.5, example_inputs=(x,))
    assert len(solves) == first and again.plan is not None
    assert_same_step(run_step(model, again, (x,), _loss), eager_reference(model, (x,), _loss))
    torch._dynamo.reset()
    remat_pass.optimize(model, 0.5, example_inputs=(torch.randn(6, 8),))
    assert len(solves) > first
    for front_door in (lambda: remat_pass.plan(model, (x,), budget=0.5, device="cpu", solver="ilp"),
                       lambda: explain(model, (x,), 0.5)):
        torch._dynamo.reset()
        front_door()
        solved = len(solves)
        torch._dynamo.reset()
        front_door()
        assert len(solves) == solved
    torch._dynamo.reset()
    remat_pass.optimize(model, 0.5, example_inputs=(x,), plan_cache=False)
    assert len(solves) == solved + 1


def test_the_default_directory_is_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(plan_cache_module, "DEFAULT_DIRECTORY", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert plan_cache_module.default_directory() == tmp_path / "remat_pass" / "plans"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert plan_cache_module.default_directory() == Path.home() / ".cache" / "remat_pass" / "plans"
    assert plan_cache_module.as_plan_cache(True) is plan_cache_module.as_plan_cache(True)
    assert plan_cache_module.as_plan_cache(False) is None and plan_cache_module.as_plan_cache(None) is None


def test_a_changed_graph_with_the_same_parameters_and_inputs_misses(tmp_path):
    """The key is the traced graph (its Problem), not the parameters' and inputs' shapes: a forward
    with another op in it is a miss and trains with its own plan (never the stale one)."""
    cache = PlanCache(tmp_path)
    _step(cache)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Sigmoid(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8))
    inputs = (torch.randn(4, 8),)
    compiled = torch.compile(model, backend=remat_pass.backend(0.5, plan_cache=cache))
    stepped = run_step(model, compiled, inputs, _loss)
    assert cache.stats == {"hits": 0, "misses": 2} and len(list(tmp_path.glob("*.json"))) == 2
    assert_same_step(stepped, eager_reference(model, inputs, _loss))
