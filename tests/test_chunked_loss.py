"""The chunked language-model loss (issue 33): the op against eager, the graph rewrite, the knob's
automatic rule under a peak budget, explain's note, Hugging Face's own loss path, Inductor."""

from __future__ import annotations

import copy
import itertools
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat_pass
from remat_pass import BudgetInfeasibleError, ChunkLoss
from remat_pass.capture.capture import capture
from remat_pass.capture.chunked_loss_op import (apply_chain, chunked_linear_cross_entropy,
                                                chunked_linear_cross_entropy_with_gradients)
from remat_pass.capture.loss_chunking import LossGradients, chunk_losses, chunked_regions
from remat_pass.runtime.measure import peak_activation_bytes, saved_activation_bytes
from remat_pass.tools.explain import explain

SOFTCAP = "div:30.0|tanh|mul:30.0|float"
OP = torch.ops.remat_pass.chunked_linear_cross_entropy.default


def _grads(loss: torch.Tensor, tensors: tuple[torch.Tensor, ...], grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(loss, tensors, grad)


CASES = list(itertools.product(("mean", "sum", "none"), (0.0, 0.1), (False, True), ("", SOFTCAP)))


@pytest.mark.parametrize("reduction,smoothing,weighted,chain", CASES)
def test_op_matches_eager(reduction: str, smoothing: float, weighted: bool, chain: str) -> None:
    """One chunk is eager's program, bit for bit; chunks of 8 rows differ by fp32 summation order only."""
    torch.manual_seed(0)
    tokens, hidden, vocab = 37, 16, 50
    h = torch.randn(tokens, hidden, requires_grad=True)
    w = torch.randn(vocab, hidden, requires_grad=True)
    b = torch.randn(vocab, requires_grad=True)
    target = torch.randint(0, vocab, (tokens,))
    target[::5] = -100  # ignored tokens present
    class_weight = torch.rand(vocab) if weighted else None
    eager = F.cross_entropy(apply_chain(F.linear(h, w, b), chain), target, weight=class_weight, ignore_index=-100,
                            reduction=reduction, label_smoothing=smoothing)
    grad = torch.randn_like(eager)
    expected = (eager, *_grads(eager, (h, w, b), grad))
    for rows, exact in ((tokens, True), (8, False)):
        loss = chunked_linear_cross_entropy(h, w, b, target, class_weight, chain, -100, smoothing, reduction, rows)
        got = (loss, *_grads(loss, (h, w, b), grad))
        for a, e in zip(got, expected):
            if exact:
                assert torch.equal(a, e)
            else:
                torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_bf16_head_is_as_accurate_as_eager() -> None:
    """A bf16 head: the weight's gradient is accumulated over chunks in fp32, so chunking is no
    further from the fp64 truth than eager's one matmul (within 10% of eager's own error)."""
    torch.manual_seed(0)
    h = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(500, 32, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 500, (64,))
    h64, w64 = (x.detach().double().requires_grad_() for x in (h, w))
    truth = _grads(F.cross_entropy(F.linear(h64, w64), target), (h64, w64), torch.tensor(1.0, dtype=torch.float64))
    eager = _grads(F.cross_entropy(F.linear(h, w).float(), target), (h, w), torch.tensor(1.0))
    chunked = _grads(chunked_linear_cross_entropy(h, w, None, target, None, "float", -100, 0.0, "mean", 8), (h, w),
                     torch.tensor(1.0))
    for c, e, t in zip(chunked, eager, truth):
        assert c.dtype == torch.bfloat16
        assert (c.double() - t).abs().max() <= 1.1 * (e.double() - t).abs().max() + 1e-6


def test_frozen_head_gets_no_weight_gradient() -> None:
    h = torch.randn(9, 4, requires_grad=True)
    w = torch.randn(11, 4)
    target = torch.randint(0, 11, (9,))
    loss = chunked_linear_cross_entropy(h, w, None, target, None, "", -100, 0.0, "mean", 4)
    loss.backward()
    assert w.grad is None and h.grad is not None
    eager = torch.autograd.grad(F.cross_entropy(F.linear(h, w), target), h)[0]
    torch.testing.assert_close(h.grad, eager, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("reduction,smoothing,weighted,chain", [c for c in CASES if c[0] != "none"])
def test_gradients_in_forward_match_eager(reduction: str, smoothing: float, weighted: bool, chain: str) -> None:
    """The gradients computed with the loss, scaled in backward: one chunk is eager's program bit
    for bit at an incoming gradient of 1 or a power of 2 (an exact scaling); any other scale, or
    chunks of 8 rows, differ by fp32 rounding only."""
    torch.manual_seed(0)
    tokens, hidden, vocab = 37, 16, 50
    h, w, b = (torch.randn(*shape, requires_grad=True) for shape in ((tokens, hidden), (vocab, hidden), (vocab,)))
    target = torch.randint(0, vocab, (tokens,))
    target[::5] = -100
    class_weight = torch.rand(vocab) if weighted else None
    eager = F.cross_entropy(apply_chain(F.linear(h, w, b), chain), target, weight=class_weight, ignore_index=-100,
                            reduction=reduction, label_smoothing=smoothing)
    for grad, rows in itertools.product((1.0, 0.25, 0.3), (tokens, 8)):
        expected = (eager, *torch.autograd.grad(eager, (h, w, b), torch.tensor(grad), retain_graph=True))
        loss = chunked_linear_cross_entropy_with_gradients(h, w, b, target, class_weight, chain, -100, smoothing,
                                                           reduction, rows, True, True)[0]
        got = (loss, *_grads(loss, (h, w, b), torch.tensor(grad)))
        for a, e in zip(got, expected):
            if rows == tokens and grad != 0.3:
                assert torch.equal(a, e)
            else:
                torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


def test_gradients_in_forward_only_where_asked() -> None:
    """A frozen head gets no weight gradient (none computed: the held one is empty); a per-token
    loss cannot have its gradients computed before its incoming gradient is known."""
    h, w = torch.randn(9, 4, requires_grad=True), torch.randn(11, 4)
    target = torch.randint(0, 11, (9,))
    loss, grad_hidden, grad_weight, grad_bias = chunked_linear_cross_entropy_with_gradients(
        h, w, None, target, None, "", -100, 0.0, "sum", 4, True, False)
    assert grad_weight.numel() == 0 and grad_bias.numel() == 0 and grad_hidden.shape == h.shape
    loss.backward()
    assert w.grad is None
    torch.testing.assert_close(h.grad, torch.autograd.grad(F.cross_entropy(F.linear(h, w), target, reduction="sum"),
                                                           h)[0], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="reduction='none'"):
        chunked_linear_cross_entropy_with_gradients(h, w, None, target, None, "", -100, 0.0, "none", 4, True, False)


@pytest.mark.parametrize("gradients", list(LossGradients))
def test_where_the_gradients_are_computed(gradients: LossGradients) -> None:
    """Both ways give eager's step; in forward adds no FLOPs and holds the head's gradients
    (the tied embedding's 96 x 16 fp32 and the hidden states' 48 x 16), recomputed adds one head
    matmul and holds nothing."""
    torch.manual_seed(0)
    model, inputs = TinyLM(), _inputs()
    expected = _step(model, inputs)
    config = ChunkLoss(chunk_bytes=96 * 4 * 10, gradients=gradients, min_rows=1)
    chunked = remat_pass.optimize(copy.deepcopy(model), chunk_loss=config, plan_cache=False)
    _assert_step_close(_step(chunked, inputs), expected, exact=False)
    (region,) = _chunked_nodes(TinyLM(), inputs, config)
    assert region.gradients is gradients
    in_forward = gradients is LossGradients.IN_FORWARD
    assert region.extra_flops == (0 if in_forward else 2 * 48 * 16 * 96)
    assert region.held_bytes == ((96 * 16 + 48 * 16) * 4 if in_forward else 0)
    note = chunked.plan.problem.notes[0]
    assert ("computed with the loss in forward" in note) is in_forward
    assert ("backward recomputes the head" in note) is not in_forward


def test_chunk_loss_rejects_an_unknown_gradients_mode() -> None:
    with pytest.raises(ValueError, match="gradients must be one of 'in_forward', 'recomputed'"):
        ChunkLoss(gradients="later")


class TinyLM(nn.Module):
    """Embedding, one block, a head tied to the embedding, optionally softcapped; HF-style loss."""

    def __init__(self, vocab: int = 96, hidden: int = 16, softcap: float | None = None,
                 return_logits: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.block = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.softcap = softcap
        self.return_logits = return_logits

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        logits = self.head(x + self.block(x))
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100,
                               label_smoothing=0.05)
        return (loss, logits) if self.return_logits else loss


def _inputs(vocab: int = 96, batch: int = 2, seq: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab, (batch, seq), generator=generator)
    labels = torch.randint(0, vocab, (batch, seq), generator=generator)
    labels[:, :3] = -100
    return tokens, labels


def _step(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(*inputs)
    loss = loss[0] if isinstance(loss, tuple) else loss
    loss.backward()
    return loss.detach(), {n.removeprefix("module."): p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def _assert_step_close(got, expected, exact: bool) -> None:
    (loss, grads), (eager_loss, eager_grads) = got, expected
    assert grads.keys() == eager_grads.keys()
    for a, e in zip((loss, *grads.values()), (eager_loss, *eager_grads.values())):
        if exact:
            assert torch.equal(a, e)
        else:
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_optimize_chunks_the_loss_with_eager_gradients(softcap: float | None) -> None:
    torch.manual_seed(0)
    model, inputs = TinyLM(softcap=softcap), _inputs()
    expected = _step(model, inputs)
    chunked = remat_pass.optimize(copy.deepcopy(model), chunk_loss=ChunkLoss(chunk_bytes=96 * 4 * 10, min_rows=1),
                                  plan_cache=False)
    got = _step(chunked, inputs)
    _assert_step_close(got, expected, exact=False)
    (note,) = chunked.plan.problem.notes
    assert "loss chunked: 48 tokens x 96 vocabulary in 5 chunks of 10 rows" in note
    assert "div:30.0|tanh|mul:30.0|float" in note if softcap else "float" in note
    assert "loss chunked" in chunked.plan.summary()


@pytest.mark.parametrize("gradients", list(LossGradients))
def test_a_chunked_step_saves_what_its_plan_keeps(gradients: LossGradients) -> None:
    # The chunked op runs autograd inside itself (per chunk, in forward): what it saves and
    # frees there is not held until backward, and the measurement must not count it.
    torch.manual_seed(0)
    model, inputs = TinyLM(), _inputs()
    chunked = remat_pass.optimize(model, 0.5, chunk_loss=ChunkLoss(chunk_bytes=96 * 4 * 10, min_rows=1,
                                                                   gradients=gradients), plan_cache=False)
    _, saved = saved_activation_bytes(lambda: chunked(*inputs), exclude=[*inputs, *model.parameters()])
    assert saved == chunked.plan.kept_bytes


def test_one_chunk_is_bit_exact() -> None:
    torch.manual_seed(0)
    model, inputs = TinyLM(), _inputs()
    expected = _step(model, inputs)
    got = _step(remat_pass.optimize(copy.deepcopy(model), chunk_loss=True, plan_cache=False), inputs)
    _assert_step_close(got, expected, exact=True)


def _chunked_nodes(model: nn.Module, inputs: tuple[torch.Tensor, ...], config: ChunkLoss = ChunkLoss()) -> list:
    graphs = capture(model, inputs, chunk_loss=config)
    return [region for joint in graphs for region in chunked_regions(joint.module.graph)]


def test_logits_used_elsewhere_are_left_alone() -> None:
    """The logits are also returned: chunking would free nothing, so the graph is not rewritten."""
    model = TinyLM(return_logits=True)
    assert _chunked_nodes(model, _inputs()) == []
    assert len(_chunked_nodes(TinyLM(), _inputs())) == 1


class Logits3d(nn.Module):
    """cross_entropy over [batch, vocab, seq] logits: not the [tokens, vocab] class, left unchunked."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 32)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(x).transpose(1, 2), labels)


def test_non_matching_graph_is_left_alone() -> None:
    x, labels = torch.randn(2, 5, 8), torch.randint(0, 32, (2, 5))
    assert _chunked_nodes(Logits3d(), (x, labels)) == []


class Autocast(TinyLM):
    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return super().forward(tokens, labels)


def test_autocast_region_is_left_alone() -> None:
    """Under autocast the head's dtype is autocast's choice, which the op does not replay."""
    assert _chunked_nodes(Autocast(), _inputs()) == []


def _hf(kind: str, vocab: int = 128) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=vocab, num_hidden_layers=1, bos_token_id=0, eos_token_id=1)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_positions=32, n_embd=16, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0, **common)
    else:
        config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                          num_key_value_heads=1, max_position_embeddings=32, pad_token_id=None,
                                          **common)
    model = (transformers.GPT2LMHeadModel if kind == "gpt2" else transformers.LlamaForCausalLM)(config)
    # Named, so that Hugging Face's loss_function does not log (a graph break) looking for one.
    model.loss_type = "ForCausalLM"
    return model


class HFLoss(nn.Module):
    """Hugging Face's own loss path: ``labels=`` (ForCausalLMLoss: upcast, shift by padding, mean)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=input_ids).loss


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hugging_face_loss_path(kind: str) -> None:
    torch.manual_seed(0)
    model = HFLoss(_hf(kind)).train()
    inputs = (torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1)),)
    expected = _step(model, inputs)
    chunked = remat_pass.optimize(copy.deepcopy(model), chunk_loss=ChunkLoss(chunk_bytes=128 * 4 * 8, min_rows=1),
                                  plan_cache=False)
    _assert_step_close(_step(chunked, inputs), expected, exact=False)
    assert "in 4 chunks of 8 rows" in chunked.plan.problem.notes[0]


def test_explain_says_the_loss_was_chunked() -> None:
    report = explain(TinyLM(), _inputs(), budget=1.0, chunk_loss=True, plan_cache=False)
    assert "loss chunked: 48 tokens x 96 vocabulary" in report.text()
    assert "loss chunked" in report.headline()


def _measured_peak(model: nn.Module, inputs: tuple[torch.Tensor, ...], owner: nn.Module | None = None) -> int:
    """The step's activation peak, measured after a warm-up call; ``owner`` holds the parameters
    when ``model`` is a compiled callable of it."""
    owner = model if owner is None else owner

    def step() -> None:
        model(*inputs).backward()

    step()  # warm-up: compile and plan outside the measurement
    owner.zero_grad(set_to_none=False)
    return peak_activation_bytes(step, survivors=lambda: [p.grad for p in owner.parameters()])[1]


def test_peak_budget_below_the_unchunked_minimum_fits_by_chunking() -> None:
    """chunk_loss=None: a peak budget the whole loss cannot meet is met with the loss chunked."""
    torch.manual_seed(0)
    vocab = 2048
    model, inputs = TinyLM(vocab=vocab, hidden=16), _inputs(vocab=vocab, batch=2, seq=64)
    unchunked_min = _whole_loss_floor(model, inputs)
    budget = int(unchunked_min * 0.6)
    chunked = remat_pass.optimize(copy.deepcopy(model), budget=budget, budget_kind="peak",
                                  chunk_loss=None, plan_cache=False)
    assert _measured_peak(chunked, inputs) <= budget
    assert chunked.plan.problem.notes
    # A budget the whole loss meets is not chunked.
    roomy = remat_pass.optimize(copy.deepcopy(model), budget=unchunked_min * 2, budget_kind="peak",
                                chunk_loss=None, plan_cache=False)
    _measured_peak(roomy, inputs)
    assert roomy.plan.problem.notes == ()


def test_a_peak_fraction_is_of_the_whole_steps_peak_when_the_loss_is_chunked() -> None:
    """A fraction means the step as written: chunking the loss must not re-resolve it against the
    chunked step's own (different) keep-all peak."""
    torch.manual_seed(0)
    vocab = 2048
    model, inputs = TinyLM(vocab=vocab, hidden=16), _inputs(vocab=vocab, batch=2, seq=64)
    whole = remat_pass.optimize(copy.deepcopy(model), budget=1.0, budget_kind="peak", chunk_loss=False,
                                example_inputs=inputs, plan_cache=False)
    fraction = 0.4
    chunked = remat_pass.optimize(copy.deepcopy(model), budget=fraction, budget_kind="peak", chunk_loss=None,
                                  example_inputs=inputs, plan_cache=False)
    assert chunked.plan.problem.notes  # 0.4 of the whole step's peak is out of the whole loss's reach
    assert chunked.plan.budget_bytes == whole.plan.budget_bytes * fraction // 1
    assert _measured_peak(chunked, inputs) <= chunked.plan.budget_bytes


def test_a_loss_of_one_chunk_is_not_chunked_automatically() -> None:
    """One chunk lowers no peak: the automatic rule leaves the loss whole (and refuses as before)."""
    model, inputs = TinyLM(), _inputs()
    with pytest.raises(BudgetInfeasibleError):
        remat_pass.optimize(copy.deepcopy(model), budget="1KiB", budget_kind="peak", chunk_loss=None,
                            example_inputs=inputs, plan_cache=False)


def test_inductor_runs_the_chunked_loss() -> None:
    torch.manual_seed(0)
    model, inputs = TinyLM(softcap=30.0), _inputs()
    expected = _step(model, inputs)
    compiled = remat_pass.optimize(copy.deepcopy(model), inner="inductor", chunk_loss=ChunkLoss(96 * 4 * 10, min_rows=1),
                                   plan_cache=False)
    _assert_step_close(_step(compiled, inputs), expected, exact=False)
    assert compiled.plan.problem.notes


@pytest.mark.parametrize("chunked_is_cheaper", [False, True])
def test_the_cheaper_of_whole_and_chunked_is_kept(monkeypatch, chunked_is_cheaper: bool) -> None:
    """chunk_loss=None with a budget met whole by recomputing: both plans are made, the cheaper is
    the one that runs and the only one in ``plans``; the whole one still runs after the graph it was
    compiled from was rewritten for the chunked attempt (eager's gradients bit for bit)."""
    from remat_pass.planning import loss_choice
    from remat_pass.runtime import dynamo_backend

    monkeypatch.setattr(loss_choice, "worth_chunking", lambda whole, chunked, extra: chunked_is_cheaper)
    monkeypatch.setattr(dynamo_backend, "would_split", lambda gm, chunking: True)  # TinyLM's loss is one chunk
    torch.manual_seed(0)
    model, inputs = TinyLM(), _inputs()
    expected = _step(model, inputs)
    optimized = remat_pass.optimize(copy.deepcopy(model), budget=0.3, chunk_loss=None, plan_cache=False)
    got = _step(optimized, inputs)
    assert len(optimized.pieces) == 1 and optimized.plan.recompute_flops > 0
    assert bool(optimized.plan.problem.notes) is chunked_is_cheaper
    _assert_step_close(got, expected, exact=not chunked_is_cheaper)


def _counted_traces(monkeypatch) -> list:
    """The ``chunk_loss`` of every trace ``plan`` makes from now on, in order (None: the loss whole)."""
    from remat_pass.planning import plan_model

    traces: list = []
    real = plan_model.trace_repeated

    def counting(*args, **kwargs):
        traces.append(kwargs.get("chunk_loss"))
        return real(*args, **kwargs)

    monkeypatch.setattr(plan_model, "trace_repeated", counting)
    return traces


def test_plan_traces_a_step_without_a_cross_entropy_once(monkeypatch) -> None:
    """The automatic rule re-traces only steps that compute a cross-entropy: a step without one
    planned with recompute (or refused) costs one capture, not two."""
    traces = _counted_traces(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    x = torch.randn(32, 16)
    plan = remat_pass.plan(model, (x,), budget=0.3, device="cpu", solver="ilp", plan_cache=False,
                           loss_fn=lambda out, *_: out.square().mean())
    assert plan.recompute_flops > 0 or plan.recomputed  # the budget made it recompute
    assert traces == [None]


@pytest.mark.backend_default
def test_the_inductor_fit_chunks_a_loss_it_cannot_fit_whole(monkeypatch) -> None:
    """The default backend under a peak budget (Inductor, fitted): when the whole loss's compiled
    candidates do not fit, the loss is fitted chunked; when that fails too (made to, here: no
    Inductor compile runs) the eager fallback chooses by the rule, and chunks: the step measures
    within the budget with eager's gradients."""
    from remat_pass.runtime import peak_fitting

    fits, budgets = [], []

    def refuse(compile_at, inputs, **options):
        fits.append(compile_at)
        budget = budgets[0]
        raise BudgetInfeasibleError(budget, 2 * budget, 4 * budget, kind="peak")

    monkeypatch.setattr(peak_fitting, "fit_peak", refuse)
    _fit_under(0.6, budgets.append)
    # The whole loss with the fused model, priced fused with every backward tensor, priced unfused; then chunked.
    assert len(fits) == 4


@pytest.mark.slow
@pytest.mark.backend_default
def test_the_inductor_fit_chunks_for_real() -> None:
    """As above with Inductor compiling: a quarter of the whole loss's unfused minimum is below what
    Inductor's fused whole loss measures (0.43 of it, 2026-12-06), and within it chunked."""
    _fit_under(0.25)


def _whole_loss_floor(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> int:
    """The lowest peak budget ``optimize`` names for ``model``'s step with the loss whole."""
    with pytest.raises(BudgetInfeasibleError) as refused:
        remat_pass.optimize(copy.deepcopy(model), budget="1KiB", budget_kind="peak", chunk_loss=False,
                            example_inputs=inputs, plan_cache=False)
    return refused.value.min_bytes


def _fit_under(fraction: float, told: Callable[[int], None] = lambda budget: None) -> None:
    """The default backend (the Inductor fit) on a 2048-vocabulary TinyLM at ``fraction`` of its
    whole loss's floor (``told`` before compiling): the step measures within the budget, its one plan
    chunks the loss, its loss and gradients are eager's."""
    torch.manual_seed(0)
    vocab = 2048
    model, inputs = TinyLM(vocab=vocab, hidden=16), _inputs(vocab=vocab, batch=2, seq=64)
    budget = int(_whole_loss_floor(model, inputs) * fraction)
    told(budget)
    expected = _step(model, inputs)
    backend = remat_pass.backend(budget=budget, budget_kind="peak", plan_cache=False)
    assert backend.fits_compiled_peak
    fitted = copy.deepcopy(model)
    compiled = torch.compile(fitted, backend=backend)
    assert _measured_peak(lambda *x: compiled(*x), inputs, fitted) <= budget
    (plan,) = backend.plans
    assert "loss chunked" in plan.problem.notes[0]
    _assert_compiled_step_close(compiled, fitted, inputs, expected)


def _assert_compiled_step_close(compiled, owner: nn.Module, inputs, expected) -> None:
    owner.zero_grad(set_to_none=True)
    loss = compiled(*inputs)
    loss.backward()
    torch.testing.assert_close(loss.detach(), expected[0], rtol=1e-5, atol=1e-6)
    for name, p in owner.named_parameters():
        torch.testing.assert_close(p.grad, expected[1][name], rtol=1e-5, atol=1e-6)


def test_plan_does_not_retrace_a_loss_that_would_be_one_chunk(monkeypatch) -> None:
    """TinyLM's log-probabilities (48 x 96 fp32, 18 KiB) are under the smallest chunk (64 KiB): the
    automatic rule knows from the whole step's problem that chunking would leave the loss whole, and
    traces once; a loss larger than a chunk is traced again, chunked."""
    traces = _counted_traces(monkeypatch)
    plan = remat_pass.plan(TinyLM(), _inputs(), budget=0.3, device="cpu", solver="ilp", plan_cache=False)
    assert plan.recompute_flops > 0 and traces == [None]
    traces.clear()
    vocab = 2048
    remat_pass.plan(TinyLM(vocab=vocab), _inputs(vocab=vocab, batch=2, seq=64), budget=0.3, device="cpu",
                    solver="ilp", plan_cache=False)
    assert traces[0] is None and len(traces) >= 2 and all(isinstance(t, ChunkLoss) for t in traces[1:])


def test_a_chunk_has_enough_rows_for_the_head_to_run_at_its_rate() -> None:
    """Chunks grow to ``min_rows`` tokens past ``chunk_bytes`` (16 rows of a 256000 vocabulary's
    fp32 logits double the loss's time), but never past ``max_chunk_bytes`` (the budget's share)."""
    from remat_pass.capture.loss_chunking import chunk_for_budget, chunk_rows

    row = 256000 * 4
    assert chunk_rows(ChunkLoss(), row, 1024) == 256
    assert chunk_rows(ChunkLoss(), 50257 * 4, 1024) == 256
    assert chunk_rows(ChunkLoss(), 96 * 4, 48) == 48  # one chunk: the automatic rule would not chunk it
    assert chunk_rows(ChunkLoss(chunk_bytes=row * 8, min_rows=1), row, 1024) == 8
    assert chunk_rows(chunk_for_budget(64 * row), row, 1024) == 4  # 1/16 of the budget
    assert chunk_rows(chunk_for_budget(2**40), row, 1024) == 256
    with pytest.raises(ValueError, match="min_rows"):
        ChunkLoss(min_rows=0)


def test_no_gradients_are_computed_in_forward_for_a_step_without_backward() -> None:
    """Logits that do not require grad (a step traced under no_grad) ask for no gradients: the loss
    is chunked with the plain op, which computes the loss alone; a frozen head asks for none of its own."""
    from remat_pass.capture.loss_chunking import _gradients_needed

    weight = torch.randn(8, 4, requires_grad=True)
    hidden = torch.randn(3, 4, requires_grad=True)
    with torch.no_grad():
        evaluated = F.linear(hidden, weight)
    assert _gradients_needed(hidden, weight, None, evaluated) == (False, False)
    assert _gradients_needed(hidden, weight, None, F.linear(hidden, weight)) == (True, True)
    frozen = weight.detach()
    assert _gradients_needed(hidden, frozen, None, F.linear(hidden, frozen)) == (True, False)
    chosen = []

    def record(gm, example_inputs):  # a Dynamo backend: chunk Dynamo's graph, note the op, run it
        chunk_losses(gm, ChunkLoss(2048 * 4 * 16, min_rows=1))
        chosen.extend(n.target for n in gm.graph.nodes if "chunked_linear" in str(n.target))
        return gm.forward

    model, inputs = TinyLM(vocab=2048), _inputs(vocab=2048, batch=2, seq=64)
    for grad_mode in (torch.no_grad, torch.enable_grad):
        torch._dynamo.reset()
        with grad_mode():
            torch.compile(model, backend=record)(*inputs)
    assert chosen == [torch.ops.remat_pass.chunked_linear_cross_entropy.default,
                      torch.ops.remat_pass.chunked_linear_cross_entropy_with_gradients.default]
