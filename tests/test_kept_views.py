"""Kept views made again in backward from their kept base (``rewrite.kept_views``): one saved tensor per storage."""

from __future__ import annotations

import torch

from remat_pass import solvers
from remat_pass.annotate.annotate import annotate
from remat_pass.capture.capture import capture
from remat_pass.capture.donated_buffers import saved_tensors_share_storage
from remat_pass.rewrite.kept_views import views_made_again
from remat_pass.rewrite.rewrite import rewrite
from remat_pass.solvers.problem import Plan, closure_from_keep_set

from .test_annotate import TwoLayer


def _annotated_two_layer():
    """Keep-all keeps its ``tanh`` and the ``detach`` of it that ``tanh_backward`` reads."""
    torch.manual_seed(0)
    (joint,) = capture(TwoLayer(), (torch.randn(2, 4),))
    return annotate(joint)


def test_keep_all_saves_one_tensor_per_storage_and_backward_makes_the_views_again():
    annotated = _annotated_two_layer()
    problem, nodes = annotated.problem, annotated.nodes
    plan = solvers.solve(problem, None, solver="keep_all")
    views = views_made_again(problem, plan, nodes).views
    assert views and views <= plan.kept  # keep-all keeps every view of a kept value
    forward, backward = rewrite(annotated, plan)
    assert not saved_tensors_share_storage(forward, annotated.joint.num_fwd_outputs)
    saved = {n.name for n in backward.graph.nodes if n.op == "placeholder"}
    made = {n.name for n in backward.graph.nodes if n.op == "call_function"}
    for i in views:
        assert nodes[i].name not in saved
    read_in_backward = {nodes[i].name for i in views} & made
    assert read_in_backward, "backward makes again the views it reads"
    for i in plan.kept - views:  # the bases of the views, and every other kept value, are saved
        assert nodes[i].name in saved or not nodes[i].users


def test_a_view_whose_base_is_not_kept_stays_saved():
    annotated = _annotated_two_layer()
    problem, nodes = annotated.problem, annotated.nodes
    keep_all = solvers.solve(problem, None, solver="keep_all")
    views = views_made_again(problem, keep_all, nodes).views
    view = max(views)
    base = next(i for i in range(view) if problem.values[i].storage == problem.values[view].storage)
    kept, recomputed = closure_from_keep_set(problem, keep_all.kept - {base})  # the base made again instead
    plan = Plan(problem=problem, kept=kept, recomputed=recomputed, solver="test")
    assert view in plan.kept and base in plan.recomputed
    assert view not in views_made_again(problem, plan, nodes).views
    forward, backward = rewrite(annotated, plan)
    assert nodes[view].name in {n.name for n in backward.graph.nodes if n.op == "placeholder"}


class TwoViews(torch.nn.Module):
    """Backward reads two views of ``h`` (for the two weights' gradients) and never ``h`` itself."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = torch.nn.Parameter(torch.randn(1, 4, 3)), torch.nn.Parameter(torch.randn(4, 1, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x)
        return (h.unsqueeze(0) * self.c1).sum() + (h.unsqueeze(1) * self.c2).sum()


def test_two_kept_views_of_a_value_not_kept_are_saved_as_that_value_and_the_step_is_exact():
    torch.manual_seed(0)
    model, x = TwoViews(), torch.randn(4, 3, requires_grad=True)
    (joint,) = capture(model, (x,))
    annotated = annotate(joint)
    problem, nodes = annotated.problem, annotated.nodes
    plan = solvers.solve(problem, None, solver="keep_all")
    made_again = views_made_again(problem, plan, nodes)
    assert [nodes[i].name for i in made_again.bases] == ["tanh"] and not made_again.bases & plan.kept
    assert len(made_again.views & plan.kept) >= 2  # the two unsqueezes (and the detach tanh_backward reads)
    forward, backward = rewrite(annotated, plan)
    assert not saved_tensors_share_storage(forward, annotated.joint.num_fwd_outputs)
    assert "tanh" in {n.name for n in backward.graph.nodes if n.op == "placeholder"}

    import remat_pass

    expected = torch.autograd.grad(model(x), [x, *model.parameters()])
    optimized = remat_pass.optimize(model, 1.0, example_inputs=(x,), solver="keep_all")
    got = torch.autograd.grad(optimized(x), [x, *model.parameters()])
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
