"""Annotate: exact bytes and FLOPs on tiny graphs, storages shared by views, flags."""

from __future__ import annotations

import networkx as nx
import pytest
import torch
from torch import nn

from remat_pass.annotate.annotate import META_KEY, annotate
from remat_pass.capture.capture import capture
from remat_pass.solvers.problem import recomputable_from_inputs
from remat_pass.solvers.tags import Tag

from .models import make_case


class TwoLayer(nn.Module):
    """x (2, 4) -> Linear(4, 8, no bias) -> tanh -> Linear(8, 3, no bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8, bias=False)
        self.fc2 = nn.Linear(8, 3, bias=False)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _annotated(model, *inputs, device="cpu"):
    (joint,) = capture(model, inputs)
    return annotate(joint, device)


def _value(annotated, op_prefix):
    matches = [v for v in annotated.problem.values if v.op.startswith(op_prefix)]
    assert matches, f"no {op_prefix} in {[v.op for v in annotated.problem.values]}"
    return matches


def test_bytes_and_flops_are_exact_on_a_tiny_mlp():
    annotated = _annotated(TwoLayer(), torch.randn(2, 4))
    problem = annotated.problem
    first, second = _value(annotated, "mm.")
    assert first.flops == 2 * 2 * 4 * 8 and second.flops == 2 * 2 * 8 * 3
    assert problem.storage_bytes[first.storage] == 2 * 8 * 4
    (tanh,) = _value(annotated, "tanh.")
    assert problem.storage_bytes[tanh.storage] == 2 * 8 * 4 and tanh.flops == 0
    assert tanh.recompute_seconds > 0  # memory-bound, not free
    # backward reads tanh's output (for tanh' and for fc2's weight gradient), not fc1's output:
    assert tanh.id in problem.backward_reads
    assert problem.keep_all_bytes() == 64  # x and the weights are available: 0 bytes


def test_parameters_inputs_and_their_views_cost_nothing():
    annotated = _annotated(TwoLayer(), torch.randn(2, 4))
    problem = annotated.problem
    for value in problem.values:
        if value.available:
            assert problem.storage_bytes[value.storage] == 0
    transposes = _value(annotated, "t.")
    assert all(Tag.VIEW in t.tags and problem.storage_bytes[t.storage] == 0 for t in transposes)


def test_views_share_their_base_storage():
    class ViewOfActivation(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 6)

        def forward(self, x):
            h = torch.relu(self.fc(x))
            return (h.view(3, 2, 6).transpose(0, 1) * 2).sum()

    annotated = _annotated(ViewOfActivation(), torch.randn(6, 6))
    problem = annotated.problem
    (relu,) = _value(annotated, "relu.")
    views = [v for v in problem.values if Tag.VIEW in v.tags and v.storage == relu.storage]
    assert views, "the view of relu's output must share its storage"
    assert problem.bytes_of([relu.id, *(v.id for v in views)]) == 6 * 6 * 4


def test_dropout_is_random_and_its_output_replays_from_the_mask():
    model, inputs, _ = make_case("gpt")
    annotated = _annotated(model, *inputs)
    values = annotated.problem.values
    dropouts = _value(annotated, "native_dropout.")
    assert all(Tag.RANDOM in d.tags and not d.recomputable and not d.keepable for d in dropouts)
    replays = [v for v in values if Tag.DROPOUT_REPLAY in v.tags]
    rebuildable = recomputable_from_inputs(annotated.problem)
    assert len(replays) == len(dropouts)
    for replay in replays:
        source, mask = (values[i] for i in replay.inputs)
        assert mask.op == "getitem" and not rebuildable[mask.id]  # the mask is never redrawn
        assert annotated.problem.storage_bytes[mask.storage] * 4 == annotated.problem.storage_bytes[replay.storage]


def test_attention_core_is_between_the_two_activation_matmuls():
    model, inputs, _ = make_case("gpt")
    annotated = _annotated(model, *inputs)
    core = [v for v in annotated.problem.values if Tag.ATTENTION_CORE in v.tags]
    ops = {v.op.split(".")[0] for v in core}
    assert {"bmm", "_softmax", "masked_fill"} <= ops
    assert not any(v.op.startswith(("addmm", "native_layer_norm", "gelu")) for v in core)
    assert all(v.module.startswith("blocks.") for v in core)
    assert sum(1 for v in core if Tag.MATMUL in v.tags) == 2 * model.config.layers  # Q·Kᵀ and P·V


def test_module_paths_and_networkx_view():
    model, inputs, _ = make_case("gpt")
    annotated = _annotated(model, *inputs)
    modules = {v.module for v in annotated.problem.values}
    assert {"blocks.0.attn.qkv", "blocks.1.mlp.fc", "ln_f"} <= modules
    graph = annotated.to_networkx()
    assert nx.is_directed_acyclic_graph(graph)
    phases = nx.get_node_attributes(graph, "phase")
    assert {"forward", "backward"} <= set(phases.values())
    node = next(n for n in annotated.joint.module.graph.nodes if n.op == "call_function")
    assert node.meta[META_KEY].phase in ("forward", "backward")


class _GlobalSquare(nn.Module):
    """A function wrapped in a module held by a global, as transformers 5.25's hub kernels wrap
    ``apply_rotary_pos_emb``: not part of the model's module tree."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) * x


GLOBAL_SQUARE = _GlobalSquare()


class _CallsAGlobalModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return GLOBAL_SQUARE(self.layer(x))


class _Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _CallsAGlobalModule()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x).sum()


def test_ops_of_a_global_module_belong_to_the_calling_module():
    annotated = _annotated(_Wrapper(), torch.randn(3, 4))
    sines = [v for v in annotated.problem.values if v.op.startswith("sin.")]
    assert sines and all(v.module == "block" for v in sines)  # not "" (between blocks), as before


@pytest.mark.parametrize("device", ["cpu", "h100"])
def test_cost_model_prices_memory_bound_ops(device):
    annotated = _annotated(TwoLayer(), torch.randn(64, 4), device=device)
    (tanh,) = _value(annotated, "tanh.")
    first, _ = _value(annotated, "mm.")
    assert tanh.recompute_seconds > 0 and first.recompute_seconds > 0
    assert annotated.problem.device == device


def test_flops_profile_prices_flops_alone():
    """"flops": a matmul costs its FLOPs; a pointwise op only the tie-breaking launch."""
    annotated = _annotated(TwoLayer(), torch.randn(64, 4), device="flops")
    (tanh,) = _value(annotated, "tanh.")
    first, _ = _value(annotated, "mm.")
    assert first.recompute_seconds == pytest.approx(1e-9 + first.flops / 1e12)
    assert tanh.flops == 0 and tanh.recompute_seconds == pytest.approx(1e-9)


class Attention(nn.Module):
    def forward(self, q, k, v):
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_cpu_fused_attention_counts_its_matmul_flops():
    """torch's flop_counter has no formula for the CPU's fused attention; a FLOP-priced plan
    must not believe recomputing it free (issue 13: it recomputed every attention)."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    q, k, v = (torch.randn(2, 2, 16, 8, requires_grad=True) for _ in range(3))
    annotated = _annotated(Attention(), q, k, v, device="flops")
    (attention,) = _value(annotated, "_scaled_dot_product_flash_attention_for_cpu.")
    assert attention.flops == sdpa_flop_count(q.shape, k.shape, v.shape) > 0
    assert attention.recompute_seconds == pytest.approx(1e-9 + attention.flops / 1e12)
    backward = [n for n in annotated.joint.module.graph.nodes
                if "flash_attention_for_cpu_backward" in str(n.target)]
    assert [n.meta[META_KEY].flops for n in backward] == [sdpa_backward_flop_count(q.shape, q.shape, k.shape, v.shape)]


def test_auto_profile_is_the_device_the_step_runs_on(monkeypatch):
    from remat_pass.annotate.costs import get_profile, model_profile, profile_name_for

    assert _annotated(TwoLayer(), torch.randn(64, 4), device="auto").problem.device == "cpu"
    assert model_profile("auto", TwoLayer()) == "cpu" and model_profile("h200", TwoLayer()) == "h200"
    assert profile_name_for(None) == profile_name_for(torch.device("meta")) == "cpu"
    for name, expected in [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
                           ("NVIDIA GH200 480GB", "h100"), ("NVIDIA A100-SXM4-40GB", "a100"),
                           ("NVIDIA L4", "h100")]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert profile_name_for(torch.device("cuda", 0)) == expected
        assert get_profile("auto", torch.device("cuda", 0)).name == expected


def _call(graph, target, args, tag):
    node = graph.call_function(target, args)
    if tag is not None:
        node.meta["partitioner_tag"] = tag
    return node


def test_untagged_nodes_a_pass_made_for_backward_are_backward_and_random_ones_stay():
    """Inductor's joint-graph patterns make nodes without a partitioner tag (``nll_loss_backward``'s
    scatter becomes ``where(eq(iota, target), -1, 0)``, only the ``where`` tagged). A tangent-free
    untagged node that only backward reads is backward, as eager computes it there; one a forward
    output needs, or a random one, is not."""
    from torch import fx

    from remat_pass.annotate.annotate import tangent_dependent
    from remat_pass.annotate.eager_parity import derived_in_backward

    aten = torch.ops.aten
    graph = fx.Graph()
    x, tangent = graph.placeholder("primals_1"), graph.placeholder("tangents_1")
    doubled = _call(graph, aten.mul.Tensor, (x, 2), "is_forward")
    shared = _call(graph, aten.neg.default, (x,), None)  # untagged, read by forward and backward
    out = _call(graph, aten.add.Tensor, (doubled, shared), "is_forward")
    mask = _call(graph, aten.eq.Scalar, (x, 0), None)
    minus_one = _call(graph, aten.scalar_tensor.default, (-1.0,), None)
    picked = _call(graph, aten.where.self, (mask, minus_one, shared), "is_backward")
    noise = _call(graph, aten.rand_like.default, (x,), None)
    noisy = _call(graph, aten.mul.Tensor, (picked, noise), "is_backward")
    grad = _call(graph, aten.mul.Tensor, (noisy, tangent), "is_backward")
    graph.output((out, grad))
    backward = tangent_dependent(graph)
    assert derived_in_backward(graph, backward, num_fwd_outputs=1) == {picked, noisy, mask, minus_one}
    assert noise not in backward and shared not in backward
