"""Undoing Inductor's ``add(mm) -> addmm`` fusion where it delays the matmul (``capture.late_addmm``).

On hand-made post-grad graphs: an ``addmm`` whose bias is made after both matrices, and whose
matrices nothing later reads, is split back into an early ``mm`` and a late ``add`` with the same
values; the cases where the fusion delays nothing or frees nothing are left alone; a user's own
post-grad pass still runs. End to end (Inductor, ``backend_default``): a tied-embedding model's
compiled step peaks lower with the pass than without it, with eager's gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

import remat_pass
from remat_pass.capture import late_addmm
from remat_pass.capture.late_addmm import ChainedPostGradPass, UnfuseLateAddmm, post_grad_pass_for_our_compiles
from remat_pass.examples import GPT, GPTConfig, lm_loss
from remat_pass.runtime.measure import allocator_peak

aten = torch.ops.aten
TOKENS, VOCAB, HIDDEN = 128, 256, 64


def _node(graph: fx.Graph, target, args, value: torch.Tensor, **kwargs) -> fx.Node:
    node = graph.call_function(target, args, kwargs)
    node.meta["val"] = value
    return node


def _tied_weight_gradient(read_logits_grad_later: bool = False, bias_first: bool = False,
                          beta: float = 1) -> tuple[fx.GraphModule, list[torch.Tensor]]:
    """The backward's shape of a tied weight's gradient: ``grad_logits^T @ hidden + embedding_grad``,
    the embedding's gradient made last (unless ``bias_first``)."""
    torch.manual_seed(0)
    inputs = [torch.randn(TOKENS, VOCAB), torch.randn(TOKENS, HIDDEN), torch.randn(VOCAB, HIDDEN)]
    graph = fx.Graph()
    logits_in, hidden_in, embedding_in = (graph.placeholder(name) for name in ("logits", "hidden", "embedding"))
    for node, value in zip((logits_in, hidden_in, embedding_in), inputs):
        node.meta["val"] = value

    def embedding_grad() -> fx.Node:
        return _node(graph, aten.mul.Tensor, (embedding_in, 2.0), inputs[2] * 2)

    early_bias = embedding_grad() if bias_first else None
    grad_logits = _node(graph, aten.relu.default, (logits_in,), inputs[0].relu())
    hidden = _node(graph, aten.relu.default, (hidden_in,), inputs[1].relu())
    transposed = _node(graph, aten.permute.default, (grad_logits, [1, 0]), inputs[0].relu().t())
    bias = early_bias if bias_first else embedding_grad()
    kwargs = {} if beta == 1 else {"beta": beta}
    weight_grad = _node(graph, aten.addmm.default, (bias, transposed, hidden), torch.empty(VOCAB, HIDDEN), **kwargs)
    outputs = [weight_grad]
    if read_logits_grad_later:
        outputs.append(_node(graph, aten.sum.default, (grad_logits,), torch.empty(())))
    graph.output(outputs)
    return fx.GraphModule(torch.nn.Module(), graph), inputs


def _targets(gm: fx.GraphModule) -> list:
    return [node.target for node in gm.graph.nodes if node.op == "call_function"]


def test_a_delayed_matmul_is_split_back_early_with_the_same_values():
    gm, inputs = _tied_weight_gradient()
    before = gm(*inputs)[0]
    UnfuseLateAddmm()(gm.graph)
    gm.recompile()
    order = _targets(gm)
    assert aten.addmm.default not in order
    # the matmul right after its operands, before the embedding's gradient; the add where the addmm was
    assert order.index(aten.mm.default) == order.index(aten.permute.default) + 1
    assert order.index(aten.mm.default) < order.index(aten.mul.Tensor) < order.index(aten.add.Tensor)
    torch.testing.assert_close(gm(*inputs)[0], before)
    assert torch.equal(gm(*inputs)[0], inputs[0].relu().t().mm(inputs[1].relu()) + inputs[2] * 2)


@pytest.mark.parametrize("case", ["bias ready first", "logits' gradient read later", "beta != 1"])
def test_a_fusion_that_delays_nothing_or_frees_nothing_is_kept(case):
    gm, _ = _tied_weight_gradient(bias_first=case == "bias ready first",
                                  read_logits_grad_later=case == "logits' gradient read later",
                                  beta=0.5 if case == "beta != 1" else 1)
    before = _targets(gm)
    UnfuseLateAddmm()(gm.graph)
    assert _targets(gm) == before


class _Counting(CustomGraphPass):
    def __init__(self, identity) -> None:
        self.calls, self.identity = 0, identity

    def __call__(self, graph: fx.Graph) -> None:
        self.calls += 1

    def uuid(self):
        return self.identity


def test_a_users_own_post_grad_pass_runs_first_and_keys_the_cache():
    assert isinstance(post_grad_pass_for_our_compiles(None), UnfuseLateAddmm)
    users = _Counting("theirs")
    chained = post_grad_pass_for_our_compiles(users)
    assert isinstance(chained, ChainedPostGradPass)
    gm, _ = _tied_weight_gradient()
    chained(gm.graph)
    assert users.calls == 1 and aten.addmm.default not in _targets(gm)
    assert chained.uuid() == ("theirs", UnfuseLateAddmm().uuid())
    assert post_grad_pass_for_our_compiles(_Counting(None)).uuid() is None  # theirs uncacheable: so is the chain
    theirs = [_Counting("a"), _Counting("b")]  # a torch that takes a list of passes gets ours after them
    assert post_grad_pass_for_our_compiles(theirs)[:2] == theirs
    assert isinstance(post_grad_pass_for_our_compiles(theirs)[2], UnfuseLateAddmm)
    with pytest.raises(TypeError, match="CustomGraphPass"):
        post_grad_pass_for_our_compiles(lambda graph: None)


class _GPTStep(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.model(tokens), targets)


def _compiled_peak_and_grads(model: torch.nn.Module, inputs) -> tuple[int, list[torch.Tensor]]:
    torch._dynamo.reset()
    step = remat_pass.optimize(model, budget=1.0, budget_kind="saved", solver="per_block", inner="inductor",
                               example_inputs=inputs, plan_cache=False)
    step(*inputs).backward()  # compiles; not measured
    model.zero_grad(set_to_none=True)
    measured = allocator_peak(lambda: step(*inputs).backward(), "cpu", lambda: [p.grad for p in model.parameters()])
    return measured.peak_excluding, [p.grad for p in model.parameters()]


@pytest.mark.backend_default
def test_a_tied_embedding_step_peaks_lower_with_the_pass_and_keeps_eagers_gradients(monkeypatch):
    """The built-in GPT ties its embedding to its head; with the logits' gradient (batch x seq x
    vocab) four times the tied weight, holding it to the end of the backward costs more than the
    weight-sized product the pass holds instead."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=VOCAB, seq_len=32, layers=2, hidden=32, heads=2, dropout=0.0)  # 561,416 -> 413,960 B
    model = _GPTStep(GPT(config))
    inputs = tuple(torch.randint(0, VOCAB, (4, config.seq_len)) for _ in range(2))
    reference = copy.deepcopy(model)
    reference(*inputs).backward()

    with_pass, grads = _compiled_peak_and_grads(copy.deepcopy(model).train(), inputs)
    monkeypatch.setattr(late_addmm.UnfuseLateAddmm, "__call__", lambda self, graph: None)
    # another identity, or Inductor's FX graph cache would answer with the first run's backward
    monkeypatch.setattr(late_addmm.UnfuseLateAddmm, "uuid", lambda self: "the pass turned off")
    without_pass, _ = _compiled_peak_and_grads(copy.deepcopy(model).train(), inputs)

    assert with_pass < without_pass
    for grad, expected in zip(grads, (p.grad for p in reference.parameters())):
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6)
