"""Real architectures (GPT-2, Llama, BERT, T5, ViT, nn.TransformerEncoder) against eager.

Every case: same loss (bit for bit: same ops, same dropout masks) and same gradients as eager,
measured saved bytes equal to the plan's prediction and within the budget, no random op run
again in backward. The default run covers every model once at a tight budget and the registered
backend on GPT-2; ``-m slow`` runs every model at every budget, at its smallest feasible budget,
through the backend (eager and Inductor inner compilers) and with padding masks.

Then a new input shape (planned again, never served by another shape's plan), and hostile small
models: in-place ops, mutated inputs, BatchNorm statistics, outputs that alias inputs or views of
kept activations, a model that already uses torch.utils.checkpoint.
"""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import remat_pass
from remat_pass.annotate.baseline import as_given_plan
from remat_pass import solvers
from remat_pass import BudgetInfeasibleError

from .helpers import assert_same_step, eager_reference, fraction_bound, optimize_and_step, run_step
from .zoo_models import HF_MODELS, VOCAB, ZOO, assert_random_ops_run_once, make_zoo, record_rewrites

slow = pytest.mark.slow
TIGHT = 0.3


def _build(name: str, **options):
    if name in HF_MODELS:
        pytest.importorskip("transformers")
    return make_zoo(name, **options)


def _check_records(records, budget_bytes=None):
    assert records, "nothing was planned"
    for record in records:
        assert_random_ops_run_once(record)
        if budget_bytes is not None:
            assert record.plan.kept_bytes <= budget_bytes(record.plan)


def _assert_backend_accounting(actual, plans, inputs):
    """Through the backend a graph cannot tell the step's inputs from a previous piece's
    activations, so it charges the inputs it keeps; the measurement excludes the step's inputs."""
    predicted = sum(plan.kept_bytes for plan in plans)
    input_bytes = sum(t.untyped_storage().nbytes() for t in inputs)
    assert actual.saved_bytes <= predicted <= actual.saved_bytes + input_bytes


def _optimize_case(name, budget, monkeypatch, **options):
    """Run one step through ``optimize`` at ``budget`` (a fraction, or bytes saved for backward);
    a fraction below the smallest feasible budget is replaced by the smallest feasible one (the
    error says which)."""
    model, inputs, loss_fn = _build(name, **options)
    expected = eager_reference(model, inputs, loss_fn)
    records = record_rewrites(monkeypatch)
    optimized, actual, budget = optimize_and_step(model, inputs, loss_fn, budget, fallback=TIGHT,
                                                  on_retry=records.clear)
    return optimized, actual, expected, records, budget


def _budget_params():
    params = []
    for name in ZOO:
        for budget in (1.0, 0.5, TIGHT):
            marks = () if budget == TIGHT else (slow,)
            params.append(pytest.param(name, budget, marks=marks, id=f"{name}-{budget}"))
    return params


@pytest.mark.parametrize("name, budget", _budget_params())
def test_optimize_matches_eager_within_budget(name, budget, monkeypatch):
    optimized, actual, expected, records, budget = _optimize_case(name, budget, monkeypatch)
    assert_same_step(actual, expected)
    assert torch.equal(actual.loss, expected.loss), "same ops and dropout masks: the loss must be bit-identical"
    plan = optimized.plan
    assert actual.saved_bytes == plan.kept_bytes, "measured saved bytes must equal the prediction"
    limit = budget * plan.keep_all_bytes if isinstance(budget, float) else budget
    assert actual.saved_bytes <= limit
    _check_records(records)
    if budget == 1.0:
        assert not plan.recomputed and actual.saved_bytes == plan.keep_all_bytes
    else:
        assert plan.recomputed, "a budget below keep-all must recompute something"


@pytest.mark.parametrize("name", [pytest.param(n, marks=slow) for n in ZOO])
def test_smallest_feasible_budget_is_met_exactly(name, monkeypatch):
    model, inputs, loss_fn = _build(name)
    probe = remat_pass.optimize(model, budget=1.0, example_inputs=inputs)
    smallest = solvers.min_feasible_bytes(probe.plan.problem)
    assert 0 < smallest < probe.plan.keep_all_bytes
    torch._dynamo.reset()
    optimized, actual, expected, records, _ = _optimize_case(name, smallest, monkeypatch)
    assert_same_step(actual, expected)
    assert torch.equal(actual.loss, expected.loss)
    assert actual.saved_bytes == optimized.plan.kept_bytes == smallest
    _check_records(records)
    torch._dynamo.reset()
    with pytest.raises(BudgetInfeasibleError) as raised:
        remat_pass.optimize(model, budget=smallest - 1, budget_kind="saved", example_inputs=inputs)
    assert raised.value.min_bytes == smallest


@pytest.mark.parametrize("name", ["gpt2", *(pytest.param(n, marks=slow) for n in ZOO if n != "gpt2")])
def test_registered_remat_backend_matches_eager(name, monkeypatch):
    model, inputs, loss_fn = _build(name)
    expected = eager_reference(model, inputs, loss_fn)
    records = record_rewrites(monkeypatch)
    actual = run_step(model, torch.compile(model, backend="remat"), inputs, loss_fn)
    assert_same_step(actual, expected)
    assert torch.equal(actual.loss, expected.loss)
    _check_records(records, budget_bytes=lambda plan: fraction_bound(plan, remat_pass.DEFAULT_BUDGET))
    _assert_backend_accounting(actual, [record.plan for record in records], inputs)


@slow
@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_backend_with_an_absolute_budget(name, monkeypatch):
    model, inputs, loss_fn = _build(name)
    probe = remat_pass.optimize(model, budget=1.0, example_inputs=inputs)
    cap = probe.plan.keep_all_bytes // 4
    torch._dynamo.reset()
    expected = eager_reference(model, inputs, loss_fn)
    records = record_rewrites(monkeypatch)
    backend = remat_pass.backend(budget=f"{cap}B", budget_kind="saved")
    actual = run_step(model, torch.compile(model, backend=backend), inputs, loss_fn)
    assert_same_step(actual, expected)
    assert [r.plan for r in records] == backend.plans
    assert all(plan.kept_bytes <= cap for plan in backend.plans)
    _assert_backend_accounting(actual, backend.plans, inputs)


def test_gpt2_with_eager_attention_replays_attention_dropout(monkeypatch):
    """Softmax and attention dropout as separate ops: at a tight budget the attention-probability
    dropouts are rebuilt from their kept masks (never drawn again); the loss stays bit-identical."""
    optimized, actual, expected, records, _ = _optimize_case("gpt2", 0.15, monkeypatch, attention="eager")
    assert_same_step(actual, expected)
    assert torch.equal(actual.loss, expected.loss)
    assert actual.saved_bytes == optimized.plan.kept_bytes
    _check_records(records)
    (record,) = records
    values = record.plan.problem.values
    dropouts = [v for v in values if v.op == "native_dropout.default"]
    assert len(dropouts) == 7  # embeddings; per layer: attention probabilities, attention output, MLP output
    replayed = {values[i].module for i in record.plan.recomputed if "dropout_replay" in values[i].tags}
    assert len({m for m in replayed if m.endswith(".attn")}) == 2, replayed  # both layers' attention


class _WithPaddingMask(nn.Module):
    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.model = lm.model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


@pytest.mark.parametrize("name", ["bert", pytest.param("gpt2", marks=slow), pytest.param("llama", marks=slow)])
def test_padding_attention_mask(name, monkeypatch):
    """A padded batch: the mask is built from an input tensor inside the captured graph."""
    lm, (tokens,), loss_fn = _build(name)
    model = _WithPaddingMask(lm).train()
    mask = torch.ones_like(tokens)
    mask[0, -3:] = 0
    inputs = (tokens, mask)
    expected = eager_reference(model, inputs, loss_fn)
    records = record_rewrites(monkeypatch)
    optimized = remat_pass.optimize(model, budget=TIGHT)
    actual = run_step(model, optimized, inputs, loss_fn)
    assert_same_step(actual, expected)
    assert torch.equal(actual.loss, expected.loss)
    assert actual.saved_bytes == optimized.plan.kept_bytes <= TIGHT * optimized.plan.keep_all_bytes
    _check_records(records)


@slow
@pytest.mark.parametrize("name", ["gpt2", "torch_encoder"])
def test_backend_with_inductor_inner(name, monkeypatch):
    model, inputs, loss_fn = _build(name)
    expected = eager_reference(model, inputs, loss_fn)
    records = record_rewrites(monkeypatch)
    backend = remat_pass.backend(budget=TIGHT, inner="inductor")
    # Inductor draws its own random numbers unless told to call aten's RNG, as eager does.
    with torch._inductor.config.patch(fallback_random=True):
        actual = run_step(model, torch.compile(model, backend=backend), inputs, loss_fn)
    assert_same_step(actual, expected, tol=1e-4)  # Inductor fuses and reorders float arithmetic
    _check_records(records, budget_bytes=lambda plan: fraction_bound(plan, TIGHT))
    _assert_backend_accounting(actual, backend.plans, inputs)


# --- shapes: a new signature is planned again, never served by another's plan ---------------------


def test_new_sequence_length_or_batch_replans_and_each_plan_serves_only_its_shape(monkeypatch):
    model, (tokens,), _ = _build("gpt2", seq=12, batch=2)
    records = record_rewrites(monkeypatch)
    optimized = remat_pass.optimize(model, budget=TIGHT)
    shapes = [(2, 12), (2, 8), (3, 12), (2, 12), (3, 12)]
    seen = {}
    for batch, seq in shapes:
        torch.manual_seed(batch * 100 + seq)
        inputs = (torch.randint(0, VOCAB, (batch, seq)),)
        targets = torch.randint(0, VOCAB, (batch, seq))
        loss_fn = lambda logits, *_: torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())  # noqa: E731
        expected = eager_reference(model, inputs, loss_fn)
        actual = run_step(model, optimized, inputs, loss_fn)
        assert_same_step(actual, expected)
        assert torch.equal(actual.loss, expected.loss)
        plan = optimized.plan
        assert actual.saved_bytes == plan.kept_bytes <= TIGHT * plan.keep_all_bytes
        if (batch, seq) in seen:
            assert plan is seen[batch, seq], "a signature seen before must reuse its own plan"
        seen[batch, seq] = plan
    assert len(records) == len(optimized.plans) == 3  # one capture and plan per distinct shape
    keep_all = {shape: plan.keep_all_bytes for shape, plan in seen.items()}
    assert keep_all[2, 8] < keep_all[2, 12] < keep_all[3, 12]
    assert len({id(plan) for plan in seen.values()}) == 3


# --- side effects and aliasing ------------------------------------------------------------------------


class AliasingOutputs(nn.Module):
    """Returns the real output plus views of the input and of a kept activation."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor):
        h = torch.tanh(self.a(x))
        y = torch.sigmoid(self.b(h)) * h
        return y, x.view(-1), x[:, :2], h.t(), h.view(-1, 4, 2).transpose(1, 2)


def _aliasing_loss(outputs, x):
    y, flat_x, x_slice, h_t, h_view = outputs
    return y.square().mean() + 0.1 * h_t.sum() + h_view.mean() + (x_slice * flat_x[:2]).sum()


class MutatesInputsAndActivations(nn.Module):
    """Counts calls in a tensor it is given, scales its input in place, edits activation views."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, counter: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
        counter.add_(1)
        scratch.mul_(2)  # an input that needs no grad, modified in place
        h = self.a(x + scratch)
        h.mul_(2)
        h[:, :4].add_(1)  # in place on a view of an activation
        h = torch.relu_(h)
        return self.b(h) * torch.sigmoid(h) + counter


class BatchNormTwice(nn.Module):
    """One BatchNorm applied twice per forward (its statistics move twice, as in eager), one
    without affine parameters, one without running statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.shared = nn.BatchNorm1d(6)
        self.plain = nn.BatchNorm1d(6, affine=False)
        self.stateless = nn.BatchNorm1d(6, track_running_stats=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.shared(self.fc(x)))
        h = torch.tanh(self.shared(self.fc(h))) + h
        return self.stateless(self.plain(h)).sigmoid()


def _fresh(inputs):
    return tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in inputs)


def _budgets_down_to_the_smallest(model, inputs):
    probe = remat_pass.optimize(model, budget=1.0, example_inputs=_fresh(inputs))
    smallest = max(solvers.min_feasible_bytes(probe.plan.problem), 1)
    torch._dynamo.reset()
    return [1.0, 0.5, f"{smallest}B"]  # with its unit: a bare int up to 100 reads like a percentage


@pytest.mark.parametrize("case", ["aliasing", "mutation", "batchnorm"])
def test_side_effects_and_aliases_match_eager_at_every_budget(case, monkeypatch):
    torch.manual_seed(0)
    if case == "aliasing":
        model, inputs, loss_fn = AliasingOutputs(), (torch.randn(6, 8, requires_grad=True),), _aliasing_loss
    elif case == "mutation":
        model, loss_fn = MutatesInputsAndActivations(), lambda out, *_: out.square().mean()
        inputs = (torch.randn(6, 8, requires_grad=True), torch.zeros(()), torch.randn(6, 8))
    else:
        model, inputs, loss_fn = BatchNormTwice(), (torch.randn(10, 6),), lambda out, *_: out.square().mean()
    for budget in _budgets_down_to_the_smallest(model, inputs):
        torch._dynamo.reset()
        eager_inputs, remat_inputs = _fresh(inputs), _fresh(inputs)
        steps_before = {name: b.item() for name, b in model.named_buffers() if "num_batches" in name}
        expected = eager_reference(model, eager_inputs, loss_fn)
        records = record_rewrites(monkeypatch)
        optimized = remat_pass.optimize(model, budget=budget, budget_kind="saved")
        actual = run_step(model, optimized, remat_inputs, loss_fn)
        assert_same_step(actual, expected)  # buffers included: statistics moved exactly as in eager
        for mine, theirs in zip(remat_inputs, eager_inputs):
            assert torch.equal(mine, theirs), "inputs must be mutated exactly as eager mutates them"
            if theirs.grad is not None:
                assert torch.equal(mine.grad, theirs.grad)
        assert actual.saved_bytes == optimized.plan.kept_bytes
        assert len(records) == 1
        monkeypatch.undo()
        if case == "mutation":
            assert remat_inputs[1].item() == 1  # counted once per step
        if case == "batchnorm":  # the shared BatchNorm runs twice a step, the other once
            assert actual.buffers["shared.num_batches_tracked"].item() == steps_before["shared.num_batches_tracked"] + 2
            assert actual.buffers["plain.num_batches_tracked"].item() == steps_before["plain.num_batches_tracked"] + 1


def test_outputs_that_alias_inputs_still_alias_them():
    torch.manual_seed(0)
    model = AliasingOutputs()
    x = torch.randn(6, 8, requires_grad=True)
    optimized = remat_pass.optimize(model, budget=0.5)
    y, flat_x, x_slice, h_t, h_view = optimized(x)
    assert flat_x.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert x_slice.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert h_t.untyped_storage().data_ptr() == h_view.untyped_storage().data_ptr()  # both views of h
    _aliasing_loss((y, flat_x, x_slice, h_t, h_view), x).backward()
    assert x.grad is not None


class AlreadyCheckpointed(nn.Module):
    """Blocks wrapped in torch.utils.checkpoint (with dropout inside) by the model's author."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.3), nn.Linear(16, 16), nn.Tanh()) for _ in range(3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) + x
        return x


@pytest.mark.parametrize("budget", [1.0, 0.3])
def test_model_that_already_checkpoints(budget, monkeypatch):
    """The author's checkpoint regions are the reference (the model as given): remat_pass plans
    the whole step within what they save, at no more recompute, and gives eager's results,
    dropout included."""
    torch.manual_seed(0)
    model, inputs = AlreadyCheckpointed(), (torch.randn(4, 16),)
    loss_fn = lambda out, *_: out.square().mean()  # noqa: E731
    expected = eager_reference(model, inputs, loss_fn)
    records = record_rewrites(monkeypatch)
    optimized = remat_pass.optimize(model, budget=budget)
    actual = run_step(model, optimized, inputs, loss_fn)
    assert_same_step(actual, expected)
    assert torch.equal(actual.loss, expected.loss)
    as_given = as_given_plan(optimized.plan.problem)
    assert as_given.recomputed and as_given.kept_bytes < optimized.plan.keep_all_bytes
    assert actual.saved_bytes == optimized.plan.kept_bytes <= budget * as_given.kept_bytes
    if budget == 1.0:
        assert optimized.plan.recompute_seconds <= as_given.recompute_seconds
    _check_records(records)


def test_batchnorm_in_eval_mode_leaves_statistics_alone():
    torch.manual_seed(0)
    model = BatchNormTwice()
    model(torch.randn(10, 6))  # move the statistics away from their initial values
    model.eval()
    inputs = (torch.randn(10, 6),)
    loss_fn = lambda out, *_: out.square().mean()  # noqa: E731
    expected = eager_reference(model, inputs, loss_fn)
    before = {name: b.clone() for name, b in model.named_buffers()}
    optimized = remat_pass.optimize(model, budget=0.5)
    actual = run_step(model, optimized, inputs, loss_fn)
    assert_same_step(actual, expected)
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, before[name]), name
