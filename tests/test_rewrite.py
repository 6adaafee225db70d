"""Rewrite: the emitted graphs, recomputation placed just in time, exactly what the plan says."""

from __future__ import annotations

import operator
from pathlib import Path

import pytest
import torch
from torch import fx

from remat_pass import solvers
from remat_pass.annotate.annotate import annotate
from remat_pass.capture.capture import capture
from remat_pass.rewrite.rewrite import rewrite
from remat_pass.solvers.tags import Tag

from .models import make_case
from .test_annotate import TwoLayer

GOLDEN = Path(__file__).parent / "golden"


def _plan_and_rewrite(model, inputs, solver, budget=None):
    torch.manual_seed(0)
    (joint,) = capture(model, inputs)
    annotated = annotate(joint)
    plan = solvers.solve(annotated.problem, budget, solver=solver)
    forward, backward = rewrite(annotated, plan)
    return annotated, plan, forward, backward


def _code(module: fx.GraphModule) -> str:
    return "\n".join(line.rstrip() for line in module.code.strip().splitlines()) + "\n"


@pytest.mark.parametrize("solver", ["keep_all", "recompute_all"])
def test_golden_graphs_of_a_tiny_mlp(solver):
    torch.manual_seed(0)
    _, _, forward, backward = _plan_and_rewrite(TwoLayer(), (torch.randn(2, 4),), solver)
    for name, module in (("forward", forward), ("backward", backward)):
        path = GOLDEN / f"two_layer_{solver}_{name}.py.txt"
        assert _code(module) == path.read_text(), f"{path.name} changed; review the diff and update the file"


def test_backward_recomputes_exactly_the_plan():
    model, inputs, _ = make_case("gpt")
    annotated, plan, forward, backward = _plan_and_rewrite(model, inputs, "recompute_all")
    names = {annotated.nodes[i].name for i in plan.recomputed}
    forward_names = {node.name for node in annotated.nodes}
    recomputed_in_backward = {
        n.name for n in backward.graph.nodes if n.op == "call_function" and n.name in forward_names
    }
    replayed = {annotated.nodes[i].name for i in plan.recomputed if Tag.DROPOUT_REPLAY in annotated.problem.values[i].tags}
    assert replayed, "CPU fp32 dropout outputs are rebuilt from their masks"
    assert recomputed_in_backward == names - replayed  # replayed outputs became mask products
    saved = [n for n in backward.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
    kept = {annotated.nodes[i].name for i in plan.kept}
    assert kept <= {n.name for n in saved}


def test_recomputation_is_just_in_time():
    """Between a recomputed node and its first reader there is only other recomputation."""
    model, inputs, _ = make_case("gpt")
    annotated, plan, _, backward = _plan_and_rewrite(model, inputs, "recompute_all")
    forward_names = {node.name for node in annotated.nodes}
    nodes = list(backward.graph.nodes)
    position = {node: index for index, node in enumerate(nodes)}

    def is_recompute(node):
        return node.op == "call_function" and (node.name in forward_names or node.name.endswith(("_replay", "_masked")))

    recomputed = [n for n in nodes if is_recompute(n)]
    assert recomputed, "recompute_all must recompute something"
    for node in recomputed:
        if node.target is operator.getitem:
            continue  # unpacked right after its tuple (rewrite._unpack_at_once), checked below
        first_reader = min(position[user] for user in node.users)
        between = nodes[position[node] + 1 : first_reader]
        assert all(is_recompute(other) for other in between), f"{node.name} is computed too early"
    for node in recomputed:
        if node.target is operator.getitem:
            assert node.args[0] is nodes[position[node] - 1] or nodes[position[node] - 1].target is operator.getitem
    # and not all at the start: the last recomputation comes after some gradient work
    first_backward_op = next(n for n in nodes if n.op == "call_function" and not is_recompute(n))
    assert position[recomputed[-1]] > position[first_backward_op]


def test_graphs_lint_and_run():
    model, inputs, loss_fn = make_case("mlp")
    _, plan, forward, backward = _plan_and_rewrite(model, inputs, "ilp", budget=1)
    forward.graph.lint()
    backward.graph.lint()
    assert plan.kept_bytes <= 1
