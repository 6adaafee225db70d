"""Kernel scratch (remat_pass.annotate.scratch): measured per op on the step's device, carried in the
Problem, counted by both memory models, and what keeps a CNN's measured peak within budget."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat_pass
from remat_pass import solvers
from remat_pass.annotate.annotate import annotate
from remat_pass.capture.capture import capture
from remat_pass.runtime.measure import allocator_peak, peak_activation_bytes
from remat_pass.rewrite.rewrite import rewrite
from remat_pass.annotate.scratch import estimated_scratch_bytes, kernel_scratch
from remat_pass.rewrite.simulate import simulate
from remat_pass.solvers.analysis.memory import simulate_plan
from remat_pass.solvers.problem import BackwardStep, Problem, Value
from remat_pass.planning.tracing import trace_step

from .helpers import assert_same_step, eager_reference, run_step

aten = torch.ops.aten
BATCH, CHANNELS, SIDE = 8, 16, 16


class TinyCNN(nn.Module):
    """conv-BN-ReLU four times and a linear head: two convolution configurations (3 -> 16
    channels, 16 -> 16), both with scratch on CPU."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        widths = [3] + [CHANNELS] * depth
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(a, b, 3, padding=1, bias=False), nn.BatchNorm2d(b), nn.ReLU())
            for a, b in zip(widths, widths[1:]))
        self.head = nn.Linear(CHANNELS, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((2, 3)))


def _images(device: str = "cpu") -> torch.Tensor:
    return torch.randn(BATCH, 3, SIDE, SIDE, generator=torch.Generator().manual_seed(0)).to(device)


@pytest.fixture(scope="module")
def annotated():
    torch.manual_seed(0)
    (joint,) = capture(TinyCNN(), (_images(),))
    return annotate(joint)


def _node(annotated, target, index=0):
    return [n for n in annotated.joint.module.graph.nodes if n.target == target][index]


def test_forward_scratch_equals_a_direct_allocator_measurement(annotated):
    """conv2's forward: the allocator's peak during F.conv2d on real tensors, less its output."""
    x = torch.randn(BATCH, CHANNELS, SIDE, SIDE)
    weight = torch.randn(CHANNELS, CHANNELS, 3, 3)
    nn.functional.conv2d(x, weight, padding=1)  # warm-up, as annotate's measurement does
    output_bytes = x.nbytes  # 16 -> 16 channels, same padding: the output has the input's shape
    measured = allocator_peak(lambda: nn.functional.conv2d(x, weight, padding=1)).peak - output_bytes
    conv2 = _node(annotated, aten.convolution.default, 1)
    value = annotated.problem.values[annotated.nodes.index(conv2)]
    assert measured > 0, "this convolution should need scratch on CPU; the test would prove nothing"
    assert value.scratch_bytes == measured


def test_backward_scratch_equals_a_direct_allocator_measurement(annotated):
    """conv2's backward: allocator peak less the input gradient, the weight gradient left out
    at its allocation (parameter gradients are not activation memory in any of the accounts)."""
    grad_out, x = torch.randn(BATCH, CHANNELS, SIDE, SIDE), torch.randn(BATCH, CHANNELS, SIDE, SIDE)
    weight = torch.randn(CHANNELS, CHANNELS, 3, 3)
    found = []

    def backward():
        grads = aten.convolution_backward(grad_out, x, weight, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                          [True, True, False])
        found[:] = grads[:2]
        return grads

    backward()
    measured = allocator_peak(backward, survivors=lambda: [found[1]]).peak_excluding - x.nbytes
    node = _node(annotated, aten.convolution_backward.default, 0)  # backward runs conv2's first
    assert tuple(node.meta["val"][0].shape) == tuple(x.shape)
    assert measured > 0 and node.meta["remat"].scratch_bytes == measured
    step = next(s for s in annotated.problem.backward_steps if s.scratch_bytes == measured)
    assert step.working_bytes >= step.scratch_bytes


def test_measuring_leaves_the_rng_state_alone():
    """Measuring runs ops (dropout included) on random inputs: the user's random stream must not move."""
    model = nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.5), nn.Linear(32, 4))
    (joint,) = capture(model, (torch.randn(64, 32),))
    state = torch.get_rng_state()
    scratch = kernel_scratch(joint.module.graph)
    assert torch.equal(torch.get_rng_state(), state)
    assert any(n.target == aten.native_dropout.default for n in scratch)  # the float mask it draws


def test_meta_tensors_get_the_documented_estimate():
    model = TinyCNN().to("meta")
    traced = trace_step(model, (_images("meta"),))
    (piece,) = traced.annotated
    conv2 = _node(piece, aten.convolution.default, 1)
    value = traced.problem.values[piece.nodes.index(conv2)]
    activation, weight = BATCH * CHANNELS * SIDE * SIDE * 4, CHANNELS * CHANNELS * 9 * 4
    assert value.scratch_bytes == estimated_scratch_bytes(conv2) == 2 * activation + weight
    backward = _node(piece, aten.convolution_backward.default, 0)
    assert backward.meta["remat"].scratch_bytes == 2 * activation + weight


def test_a_meta_model_traced_as_fake_cpu_is_estimated_without_running_a_kernel(monkeypatch):
    """plan() traces a meta model as fake CPU tensors: no kernel may run (at a 70B model's shapes
    that took minutes), every scratch is the estimate."""
    from remat_pass.annotate import scratch as scratch_module
    from remat_pass.planning.plan_model import traceable

    def refuse(*_args, **_kwargs):
        raise AssertionError("a kernel ran on a step traced from fake tensors")

    monkeypatch.setattr(scratch_module, "_measure_or_estimate", refuse)
    model, images = TinyCNN().to("meta"), _images("meta")
    with traceable(model, (images,)) as fake_inputs:
        traced = trace_step(model, fake_inputs)
    (piece,) = traced.annotated
    assert piece.joint.step_inputs.are_fake()
    conv2 = _node(piece, aten.convolution.default, 1)
    activation, weight = BATCH * CHANNELS * SIDE * SIDE * 4, CHANNELS * CHANNELS * 9 * 4
    assert traced.problem.values[piece.nodes.index(conv2)].scratch_bytes == 2 * activation + weight


def test_measurements_persist_in_a_store_and_a_new_process_runs_no_kernel(tmp_path, monkeypatch):
    from remat_pass.annotate import scratch as scratch_module

    model = nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.5), nn.Linear(32, 4))
    (joint,) = capture(model, (torch.randn(64, 32),))
    monkeypatch.setattr(scratch_module, "_MEASURED", {})
    first = kernel_scratch(joint.module.graph, store=tmp_path)
    assert first and len(list(tmp_path.glob("scratch-torch*.json"))) == 1

    def refuse(*_args, **_kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(scratch_module, "_MEASURED", {})  # a new process
    monkeypatch.setattr(scratch_module, "_measure_or_estimate", refuse)
    assert kernel_scratch(joint.module.graph, store=tmp_path) == first
    monkeypatch.setattr(scratch_module, "_MEASURED", {})
    with pytest.raises(AssertionError, match="measured again"):  # another store knows nothing
        kernel_scratch(joint.module.graph, store=tmp_path / "other")


def test_optimize_keeps_its_measurements_beside_the_plan_cache_only_when_there_is_one(tmp_path, monkeypatch):
    from remat_pass.annotate import scratch as scratch_module

    inputs = (_images(),)
    for cache in (False, tmp_path):
        monkeypatch.setattr(scratch_module, "_MEASURED", {})
        torch._dynamo.reset()
        remat_pass.optimize(TinyCNN(), 0.5, example_inputs=inputs, plan_cache=cache)
    assert [p.parent.name for p in tmp_path.rglob("scratch-*.json")] == ["scratch"]


def test_scratch_counts_while_its_op_runs_not_beside_recomputation():
    """x -> a -> b; backward: step 0 reads b (scratch 50), step 1 reads a (scratch 70).
    a's kernel takes 30 bytes of scratch; all storages 100 bytes."""
    x = Value(0, "x", (), storage=0, available=True)
    a = Value(1, "a", (0,), storage=1, recompute_seconds=1.0, scratch_bytes=30)
    b = Value(2, "b", (1,), storage=2, recompute_seconds=1.0)
    steps = (BackwardStep((2,), 150, 0.0, 50), BackwardStep((1,), 170, 0.0, 70))
    problem = Problem((x, a, b), (0, 100, 100), frozenset({1, 2}), backward_steps=steps)
    keep_all = solvers.solve(problem, solver="keep_all")
    memory = simulate_plan(problem, keep_all)
    assert memory.forward_live == (100 + 30, 200)  # a made with its scratch, then b
    assert memory.backward_live == (200 + 150, 100 + 170)  # each step's working set, scratch included
    recompute_a = solvers.solve(problem, solver="recompute_all")
    assert recompute_a.recomputed == frozenset({1, 2})
    memory = simulate_plan(problem, recompute_a)
    # b is rebuilt (a first, with a's scratch; step 0 has not run: no working set), then step 0;
    # a is already there for step 1.
    assert memory.backward_live == (100 + 30, 200, 200 + 150, 100 + 170)


PLANS = [("keep_all", None), ("ilp", 0.7), ("recompute_all", None), ("per_block", None)]


@pytest.mark.parametrize("solver, fraction", PLANS)
def test_claimed_peak_equals_both_simulators_on_a_cnn(annotated, solver, fraction):
    problem = annotated.problem
    budget = None if fraction is None else int(fraction * problem.keep_all_bytes())
    plan = solvers.solve(problem, budget, solver=solver)
    claimed = plan.predicted_peak_bytes or simulate_plan(problem, plan).peak_bytes
    assert claimed == simulate_plan(problem, plan).peak_bytes
    graph_peak = simulate(*rewrite(annotated, plan)).peak_bytes
    assert abs(claimed - graph_peak) <= 0.01 * graph_peak


@pytest.mark.parametrize("fraction", [0.9, 0.8])
def test_cnn_peak_budget_is_kept_and_predicted_within_5_percent(fraction):
    torch.manual_seed(0)
    model, inputs = TinyCNN(), (_images(),)
    loss_fn = lambda out, *_: out.square().mean()  # noqa: E731
    expected = eager_reference(model, inputs, loss_fn)
    keep_all_peak = remat_pass.optimize(model, budget=1.0, example_inputs=inputs).plan.predicted_peak_bytes
    torch._dynamo.reset()
    budget = int(fraction * keep_all_peak)
    optimized = remat_pass.optimize(model, budget=budget, budget_kind="peak", example_inputs=inputs)
    plan = optimized.plan
    assert plan.recomputed and plan.predicted_peak_bytes <= budget
    assert_same_step(run_step(model, optimized, inputs, loss_fn), expected)  # first: steps move BN statistics
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(1234)
    _, measured = peak_activation_bytes(lambda: loss_fn(optimized(*inputs)).backward(),
                                        survivors=lambda: [p.grad for p in model.parameters()])
    assert measured <= budget, f"measured peak {measured} over the {budget}-byte budget"
    assert abs(plan.predicted_peak_bytes - measured) <= 0.05 * measured
    # Tighter: the model is an upper bound up to the runtime's few small tensors (here it is
    # 472 B above the allocator). Without the convolutions' scratch the allocator is 8.6 KB above.
    assert measured <= plan.predicted_peak_bytes + 4096


@pytest.mark.slow
def test_resnet_benchmark_step_stays_within_a_tight_peak_budget():
    """The benchmark's ResNet (8 blocks, width 32, 32 px, batch 32) at 55% of its keep-all peak:
    about where per-block checkpointing peaks (benchmarks/RESULTS.md); it overshot before
    convolution scratch was measured."""
    from benchmarks.models import ModelSpec, build

    work = build(ModelSpec("resnet", layers=8, hidden=32, seq=32, batch=32))
    model, inputs = work.model, tuple(work.inputs)
    loss_fn = lambda out, *_: nn.functional.cross_entropy(out, work.target)  # noqa: E731
    keep_all_peak = remat_pass.optimize(model, budget=1.0, example_inputs=inputs).plan.predicted_peak_bytes
    torch._dynamo.reset()
    budget = int(0.55 * keep_all_peak)
    optimized = remat_pass.optimize(model, budget=budget, budget_kind="peak", example_inputs=inputs)
    loss_fn(optimized(*inputs)).backward()
    for p in model.parameters():
        p.grad = None
    _, measured = peak_activation_bytes(lambda: loss_fn(optimized(*inputs)).backward(),
                                        survivors=lambda: [p.grad for p in model.parameters()])
    assert measured <= budget
    assert abs(optimized.plan.predicted_peak_bytes - measured) <= 0.01 * measured


def test_an_op_reading_its_forwards_workspace_is_estimated_not_run(monkeypatch):
    """``mkldnn_rnn_layer_backward`` run on made-up inputs (its workspace among them) crashed the
    process while an ``nn.LSTM`` under ``allow_rnn`` was annotated: such ops are never run."""
    from torch import fx

    from remat_pass.annotate import scratch as scratch_module

    def refuse(*_args, **_kwargs):
        raise AssertionError("a kernel that reads its forward's workspace ran on made-up inputs")

    monkeypatch.setattr(scratch_module, "_measure", refuse)
    op = aten.mkldnn_rnn_layer_backward.default
    graph = fx.Graph()
    args = []
    for argument in op._schema.arguments:
        if "Tensor" in str(argument.type):
            node = graph.placeholder(argument.name)
            node.meta["val"] = torch.zeros(2, 2)
            args.append(node)
        else:
            args.append({"bool": False, "int": 1, "int[]": []}.get(str(argument.type), None))
    rnn_backward = graph.call_function(op, tuple(args))
    assert scratch_module._reads_opaque_state(rnn_backward)
    assert scratch_module._measure_or_estimate(rnn_backward, ()) == (estimated_scratch_bytes(rnn_backward), False)
    matmul = graph.call_function(aten.mm.default, (args[0], args[1]))
    assert not scratch_module._reads_opaque_state(matmul)
