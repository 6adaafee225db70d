"""Determinism: the same model, inputs and budget give the same plan, every time.

Plans are compared by the names of the kept and recomputed values (node names are stable for
a given model and torch version), after a fresh ``torch._dynamo.reset()``; the slow test also
compares across processes with different hash seeds, which would expose any dependence on
set or dict iteration order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import remat_pass

from .helpers import run_step
from .models import make_case

ROOT = Path(__file__).resolve().parents[1]


def plan_fingerprint(plan) -> dict:
    values = plan.problem.values
    return {
        "kept": sorted(values[i].name for i in plan.kept),
        "recomputed": sorted(values[i].name for i in plan.recomputed),
        "kept_bytes": plan.kept_bytes,
        "keep_all_bytes": plan.keep_all_bytes,
        "values": [(v.name, v.op, v.storage, v.inputs) for v in values],
        "storage_bytes": list(plan.problem.storage_bytes),
    }


def _plan_once(name: str, budget, **options) -> dict:
    torch._dynamo.reset()
    model, inputs, loss_fn = make_case(name)  # seeded: the same weights and inputs each time
    optimized = remat_pass.optimize(model, budget=budget, **options)
    run_step(model, optimized, inputs, loss_fn)
    return plan_fingerprint(optimized.plan)


@pytest.mark.parametrize("name, budget", [
    ("gpt", 0.3), ("cnn", 0.2),
    pytest.param("tied", 0.4, marks=pytest.mark.slow), pytest.param("gpt", 0.05, marks=pytest.mark.slow),
])
def test_same_inputs_same_plan(name, budget):
    try:
        first = _plan_once(name, budget)
    except remat_pass.BudgetInfeasibleError as error:
        budget = f"{error.min_bytes}B"  # the smallest budget: where ties between plans are most likely
        first = _plan_once(name, budget, budget_kind="saved")
    for _ in range(2):
        again = _plan_once(name, budget, **({} if isinstance(budget, float) else {"budget_kind": "saved"}))
        assert again == first
    assert first["recomputed"], "the budget should make the plan recompute something"


def test_planning_ahead_and_planning_on_first_call_agree():
    model, inputs, loss_fn = make_case("gpt")
    ahead = remat_pass.optimize(model, budget=0.3, example_inputs=inputs).plan
    torch._dynamo.reset()
    on_call = _plan_once("gpt", 0.3)
    assert plan_fingerprint(ahead) == on_call


@pytest.mark.slow
def test_plan_does_not_depend_on_the_rng_state_or_previous_plans():
    reference = _plan_once("gpt", 0.3)
    torch.manual_seed(12345)
    torch.rand(1000)  # move the global RNG; dropout masks change, the plan must not
    model, inputs, loss_fn = make_case("gpt")
    optimized = remat_pass.optimize(model, budget=0.3)
    optimized(inputs[0][:, :8]).sum().backward()  # another shape planned first
    torch.manual_seed(999)
    optimized(*inputs).sum().backward()
    assert plan_fingerprint(optimized.plan) == reference


_CHILD = """
import json, sys
sys.path.insert(0, {root!r})
import torch, remat_pass
from tests.models import make_case
from tests.test_determinism import plan_fingerprint
model, inputs, loss_fn = make_case("gpt")
optimized = remat_pass.optimize(model, budget=0.3, example_inputs=inputs)
print("FINGERPRINT " + json.dumps(plan_fingerprint(optimized.plan)))
"""


@pytest.mark.slow
def test_same_plan_across_processes_and_hash_seeds():
    fingerprints = []
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run([sys.executable, "-c", _CHILD.format(root=str(ROOT))], capture_output=True,
                                text=True, env=env, cwd=ROOT, timeout=300, check=True)
        line = next(line for line in result.stdout.splitlines() if line.startswith("FINGERPRINT "))
        fingerprints.append(json.loads(line[len("FINGERPRINT "):]))
    assert fingerprints[0] == fingerprints[1] == fingerprints[2]
    torch._dynamo.reset()
    here = json.loads(json.dumps(_plan_once("gpt", 0.3)))  # tuples become lists, as in the children
    assert here == fingerprints[0]
