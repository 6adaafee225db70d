"""Offload end to end on the CPU: planned for an H100, run with the stand-in transfer ops, gradients
bit-exact against eager; the emitted graphs, their replayed memory, and the errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from remat_pass.solvers.analysis.memory import simulate_plan
from remat_pass.solvers.tags import Tag
from torch import nn

import remat_pass
from remat_pass import solvers
from remat_pass.annotate.annotate import annotate
from remat_pass.capture.capture import capture
from remat_pass.examples import GPTConfig
from remat_pass.rewrite.offload import (
    HOST_META,
    OffloadUnavailableError,
    ao_ops_available,
    transfer_ops,
)
from remat_pass.rewrite.rewrite import rewrite
from remat_pass.rewrite.simulate import simulate

from .models import GPTWithLoss
from .helpers import eager_reference, run_step


class ViewsAndInPlace(nn.Module):
    """Backward reads views of matmul outputs (GELU's input is a view), and activations are
    changed in place (functionalized in the graph)."""

    def __init__(self, width: int = 32, layers: int = 3) -> None:
        super().__init__()
        self.up = nn.ModuleList(nn.Linear(width, 2 * width) for _ in range(layers))
        self.down = nn.ModuleList(nn.Linear(2 * width, width) for _ in range(layers))

    def forward(self, x):
        batch, seq, width = x.shape
        for up, down in zip(self.up, self.down):
            h = up(x.reshape(batch * seq, width)).view(batch, seq, 2 * width)
            h = F.gelu(h)
            h.mul_(0.5).add_(1.0)
            x = x + down(h).view(batch, seq, width)
            x.relu_()
        return x.square().mean()


def _gpt_case():
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=128, seq_len=64, layers=3, hidden=64, heads=4, dropout=0.1)
    return GPTWithLoss(config), (torch.randint(0, 128, (2, 64)), torch.randint(0, 128, (2, 64)))


def _loss(output, *_):
    return output


def _assert_bit_exact(actual, expected):
    assert torch.equal(actual.loss, expected.loss)
    assert actual.grads.keys() == expected.grads.keys()
    for name, grad in expected.grads.items():
        assert torch.equal(actual.grads[name], grad), name


@pytest.mark.parametrize("budget, kind", [(0.2, "saved"), (0.7, "peak")])
def test_gradients_through_the_stand_in_are_bit_exact_with_dropout(budget, kind):
    model, inputs = _gpt_case()
    expected = eager_reference(model, inputs, _loss)
    optimized = remat_pass.optimize(model, budget=budget, budget_kind=kind, offload=True, device="h100")
    actual = run_step(model, optimized, inputs, _loss)
    _assert_bit_exact(actual, expected)
    plan = optimized.plan
    assert plan.offloaded and "ilp_offload" in plan.solver
    assert plan.offloaded_bytes > 0 and plan.host_bytes == plan.offloaded_bytes
    if kind == "saved":
        assert plan.kept_bytes <= budget * plan.keep_all_bytes
    else:
        assert plan.predicted_peak_bytes <= plan.budget_bytes


def test_views_are_offloaded_through_their_base_once_and_in_place_ops_survive():
    torch.manual_seed(0)
    model, x = ViewsAndInPlace(), torch.randn(4, 16, 32)
    expected = eager_reference(model, (x,), _loss)
    optimized = remat_pass.optimize(model, budget=0.15, offload=True, device="h100")
    actual = run_step(model, optimized, (x,), _loss)
    _assert_bit_exact(actual, expected)

    (joint,) = capture(model, (x,))
    annotated = annotate(joint, "h100")
    problem = annotated.problem
    plan = solvers.solve(problem, int(0.15 * problem.keep_all_bytes()), solver="ilp_offload")
    assert any(Tag.VIEW in problem.values[i].tags for i in plan.offloaded), "expected a view offloaded via its base"
    forward, backward = rewrite(annotated, plan)
    sends = [n for n in forward.graph.nodes if n.target is torch.ops.remat_pass.offload_copy.default]
    storages = {problem.values[i].storage for i in plan.offloaded}
    assert len(sends) == len(storages)  # each base once, however many of its views backward reads
    fetches = [n for n in backward.graph.nodes if n.target is torch.ops.remat_pass.reload_copy.default]
    assert len(fetches) == len(storages)


def test_transfers_are_placed_as_the_link_model_says():
    model, inputs = _gpt_case()
    (joint,) = capture(model, inputs)
    annotated = annotate(joint, "h100")
    problem = annotated.problem
    plan = solvers.solve(problem, int(0.2 * problem.keep_all_bytes()), solver="ilp_offload")
    forward, backward = rewrite(annotated, plan)
    wait = torch.ops.remat_pass.wait_copy.default
    order = {node: index for index, node in enumerate(forward.graph.nodes)}
    for send in (n for n in forward.graph.nodes if n.target is torch.ops.remat_pass.offload_copy.default):
        base = send.args[0]
        assert send.prev is base  # the send starts as soon as the base exists
        (done,) = [u for u in send.users if u.target is wait]
        assert all(order[u] <= order[done] for u in base.users)  # freed after its last forward reader
        assert done.meta[HOST_META] == "host"
    order = {node: index for index, node in enumerate(backward.graph.nodes)}
    for fetch in (n for n in backward.graph.nodes if n.target is torch.ops.remat_pass.reload_copy.default):
        (ready,) = fetch.users
        assert ready.target is wait and order[fetch] < order[ready]
        first_use = min(ready.users, key=order.__getitem__)
        between = list(backward.graph.nodes)[order[ready] + 1:order[first_use]]
        assert all(n.target is wait for n in between)  # the wait just before first use (with other waits)
    # Prefetched: at least one fetch is issued well before its wait.
    gaps = [order[next(iter(f.users))] - order[f] for f in backward.graph.nodes
            if f.target is torch.ops.remat_pass.reload_copy.default]
    assert max(gaps) > 1


@pytest.mark.parametrize("fraction", [0.5, 0.2, 0.1])
def test_plan_level_simulation_matches_the_graph_replay(fraction):
    model, inputs = _gpt_case()
    (joint,) = capture(model, inputs)
    annotated = annotate(joint, "h100")
    problem = annotated.problem
    plan = solvers.solve(problem, int(fraction * problem.keep_all_bytes()), solver="ilp_offload")
    assert plan.offloaded
    graph = simulate(*rewrite(annotated, plan))
    assert graph.peak_bytes == pytest.approx(simulate_plan(problem, plan).peak_bytes, rel=0.01)


def test_offload_on_a_device_without_a_host_link_is_a_clear_error():
    model, _ = _gpt_case()
    with pytest.raises(ValueError, match="has none"):
        remat_pass.optimize(model, budget=0.3, offload=True)  # device="cpu"
    with pytest.raises(ValueError, match="does not offload"):
        remat_pass.optimize(model, budget=0.3, offload=True, device="h100", solver="per_block")


def test_offload_on_a_torch_without_the_ops_is_a_clear_error(monkeypatch):
    monkeypatch.setattr("remat_pass.rewrite.offload.ao_ops_available", lambda: False)
    with pytest.raises(OffloadUnavailableError, match=r"torch\.ops\.ao\.offload.*torch 2\.13"):
        transfer_ops(torch.device("cuda"))
    assert transfer_ops(torch.device("cpu")).kind == "stand-in"  # the CPU needs no accelerator ops


def test_this_torch_ships_the_offload_ops():
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    if (major, minor) < (2, 13):
        pytest.skip("torch.ops.ao offload ops ship with torch 2.13")
    assert ao_ops_available()
    assert transfer_ops(torch.device("cuda")).kind == "ao"  # chosen without touching a GPU


def test_the_backend_and_plan_take_offload_too():
    torch.manual_seed(0)
    model, x = ViewsAndInPlace(), torch.randn(4, 16, 32)
    expected = eager_reference(model, (x,), _loss)
    backend = remat_pass.backend(budget=0.15, offload=True, device="h100")
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    _assert_bit_exact(run_step(model, compiled, (x,), _loss), expected)
    assert backend.plans[-1].offloaded

    with torch.device("meta"):
        meta_model = ViewsAndInPlace()
    plan = remat_pass.plan(meta_model, (torch.empty(4, 16, 32, device="meta"),), budget=0.15, solver="ilp",
                           offload=True, host_budget="1MB")
    assert plan.offloaded and plan.host_bytes <= 10**6 and plan.host_budget_bytes == 10**6


def test_host_budget_is_a_size():
    from remat_pass.errors import InvalidBudgetError
    from remat_pass.rewrite.offload import parse_host_budget

    assert parse_host_budget("2KiB") == 2048 and parse_host_budget(None) is None
    with pytest.raises(InvalidBudgetError, match="host_budget is a size"):
        parse_host_budget(0.5)


@pytest.mark.slow
def test_offload_under_inductor():
    from .helpers import assert_same_step

    torch.manual_seed(0)
    model, x = ViewsAndInPlace(), torch.randn(4, 16, 32)
    expected = eager_reference(model, (x,), _loss)
    optimized = remat_pass.optimize(model, budget=0.15, offload=True, device="h100", inner="inductor")
    assert_same_step(run_step(model, optimized, (x,), _loss), expected)  # fused kernels: close, not bit-exact
    assert optimized.plan.offloaded
