"""Tracing a stack of identical blocks once per block (remat_pass.planning.repeated_blocks,
block_stamp): the stamped Problem is the traced one, the plans are the same, and blocks that are
not identical are traced whole."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import remat_pass
from benchmarks.models import LossOf, hf_model
from benchmarks.scaling import HFStep
from remat_pass import solvers
from remat_pass.examples import GPT, GPTConfig
from remat_pass.planning import repeated_blocks
from remat_pass.planning.block_stamp import StampRefused, stamp_problem, without_names
from remat_pass.planning.plan_model import traceable
from remat_pass.planning.repeated_blocks import block_labels, repeated_stack, trace_repeated
from remat_pass.planning.tracing import trace_step

LAYERS = 8


def _output(output, *_):
    return output


def _traced(model, inputs, stamped: bool):
    with traceable(model, inputs) as fake:
        trace = trace_repeated if stamped else trace_step
        return trace(model, fake, loss_fn=_output, device="h100")


def _llama() -> tuple[nn.Module, tuple[torch.Tensor]]:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=32, use_cache=False, attn_implementation="sdpa")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).train()
    return HFStep(model), (torch.zeros(1, 32, dtype=torch.long, device="meta"),)


def _gpt(layers: int = LAYERS) -> tuple[nn.Module, tuple[torch.Tensor]]:
    with torch.device("meta"):
        model = GPT(GPTConfig(layers=layers, hidden=64, heads=2, seq_len=32, vocab_size=128, dropout=0.1))
    return model, (torch.zeros(2, 32, dtype=torch.long, device="meta"),)


@pytest.fixture(scope="module", params=["llama", "gpt"])
def both(request):
    model, inputs = _llama() if request.param == "llama" else _gpt()
    return _traced(model, inputs, stamped=False), _traced(model, inputs, stamped=True)


def test_the_stamped_problem_is_the_traced_one(both):
    full, stamped = both
    assert not stamped.annotated  # it was stamped, not traced whole
    assert without_names(stamped.problem) == without_names(full.problem)
    assert stamped.step_flops == full.step_flops
    assert [v.name for v in stamped.problem.values if v.available] == [v.name for v in full.problem.values
                                                                       if v.available]


def test_real_tensor_constants_numbered_graph_wide_still_stamp():
    """HF GPT-2's eager attention makes its mask value from Python: on real tensors AOTAutograd
    lifts it into the graph as ``_tensor_constant<n>``, numbered graph-wide like the primals; the
    stamp numbers them in the same order (it was refused, and the model traced whole)."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = LossOf(hf_model("gpt2", LAYERS, 64, 32, 128), torch.randint(0, 128, (1, 32))).train()  # eager attention
    inputs = (torch.randint(0, 128, (1, 32)),)
    full, stamped = (trace(model, inputs, loss_fn=_output, device="cpu") for trace in (trace_step, trace_repeated))
    assert not stamped.annotated, "traced whole, not stamped"
    constants = [v.op for v in full.problem.values if v.op.startswith("_tensor_constant")]
    assert len(constants) >= 2 * LAYERS
    assert [v.op for v in stamped.problem.values if v.op.startswith("_tensor_constant")] == constants
    assert without_names(stamped.problem) == without_names(full.problem)


@pytest.mark.parametrize("solver, fraction", [("fast", 0.3), ("ilp", 0.2), ("per_block", None)])
def test_the_plans_are_the_same(both, solver, fraction):
    full, stamped = both
    budget = None if fraction is None else int(fraction * full.problem.keep_all_bytes())
    plans = [solvers.solve(t.problem, budget, solver=solver) for t in (full, stamped)]
    assert plans[0].kept == plans[1].kept and plans[0].recomputed == plans[1].recomputed
    assert plans[0].kept_bytes == plans[1].kept_bytes and plans[0].recompute_seconds == plans[1].recompute_seconds
    peaks = [solvers.simulate_plan(p.problem, p).peak_bytes for p in plans]
    assert peaks[0] == peaks[1]


def test_stamping_to_the_traced_depth_changes_nothing():
    model, inputs = _gpt(4)
    with traceable(model, inputs) as fake:
        traced = trace_step(model, fake, loss_fn=_output)
    labels = block_labels(traced, "blocks", 4)
    assert stamp_problem(traced.problem, labels, 4, 4, "blocks") == traced.problem


class _Scaled(nn.Module):
    """A block whose forward depends on its index: attributes alike, graphs not (Gemma-2's
    alternating layers, in miniature)."""

    def __init__(self, index: int, width: int = 16) -> None:
        super().__init__()
        self.layer_idx = index
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return x + (torch.sigmoid(y) if self.layer_idx % 2 else torch.tanh(y))  # alike but for the op


class _Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.stem = nn.Linear(16, 16)  # so that block 0, too, computes its input's gradient
        self.layers = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def _refused(model: nn.Module, caplog) -> str:
    with caplog.at_level(logging.INFO, logger=repeated_blocks.__name__):
        traced = _traced(model, (torch.zeros(4, 16, device="meta"),), stamped=True)
    assert traced.annotated, "traced whole"
    return caplog.text


def test_layer_dependent_control_flow_is_found_by_the_check_and_traced_whole(caplog):
    with torch.device("meta"):
        model = _Stack([_Scaled(i) for i in range(LAYERS)])
    assert repeated_stack(model) is not None  # the attributes alike: only the check can tell
    assert "differ from 4 traced" in _refused(model, caplog)


def test_blocks_of_other_shapes_or_with_hooks_are_traced_whole(caplog):
    with torch.device("meta"):
        shapes = _Stack([nn.Linear(16, 16) for _ in range(LAYERS - 1)] + [nn.Linear(16, 16, bias=False)])
        hooked = _Stack([nn.Linear(16, 16) for _ in range(LAYERS)])
    hooked.layers[3].register_forward_hook(lambda *_: None)
    assert "differs from block 0" in _refused(shapes, caplog)
    assert "block 3 has hooks" in _refused(hooked, caplog)


def test_gemma_alternating_sliding_window_layers_are_refused_before_tracing():
    transformers = pytest.importorskip("transformers")
    for config in (transformers.Gemma2Config, transformers.Gemma3TextConfig):
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config(
                vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=16))
        assert repeated_stack(model) is None  # each layer's attention_type / sliding_window differs


@pytest.mark.slow
def test_mixtral_stamps_to_the_traced_problem():
    """Mixtral's layers are alike and its traced expert routing is the same graph in every layer:
    it passes the check, and the stamped Problem is the traced one."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                        num_local_experts=4, max_position_embeddings=32)
    with torch.device("meta"):
        model = HFStep(transformers.AutoModelForCausalLM.from_config(config).train())
    inputs = (torch.zeros(1, 32, dtype=torch.long, device="meta"),)
    full, stamped = _traced(model, inputs, stamped=False), _traced(model, inputs, stamped=True)
    assert not stamped.annotated and without_names(stamped.problem) == without_names(full.problem)


def test_a_stack_too_shallow_to_gain_is_traced_whole():
    model, _ = _gpt(repeated_blocks.MIN_DEPTH - 1)
    assert repeated_stack(model) is None


def test_a_reference_two_blocks_back_is_refused():
    model, inputs = _gpt(4)
    with traceable(model, inputs) as fake:
        traced = trace_step(model, fake, loss_fn=_output)
    labels = block_labels(traced, "blocks", 4)
    shifted = type(labels)(tuple(None if label == 1 else label for label in labels.values), labels.steps)
    with pytest.raises(StampRefused):
        stamp_problem(traced.problem, shifted, 4, 9, "blocks")


def test_plan_on_a_meta_model_uses_the_stamped_problem(caplog):
    model, inputs = _gpt()
    with caplog.at_level(logging.INFO, logger=repeated_blocks.__name__):
        plan = remat_pass.plan(model, inputs, budget=0.3, plan_cache=False)
    assert f"{LAYERS} blocks stamped from 4 traced" in caplog.text
    assert {v.module for v in plan.problem.values if v.module.startswith("blocks.")} >= {f"blocks.{LAYERS - 1}.attn"}


def test_tracing_again_and_again_never_reaches_dynamos_recompile_limit():
    """Every trace compiles a new loss wrapper (and stamping traces twice a plan): the wrapper's
    compiled entries are dropped each time, so a process may plan any number of times."""
    from remat_pass.compat import recompile_limit

    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    for _ in range(recompile_limit() + 2):
        assert trace_step(model, (torch.randn(2, 8),), loss_fn=_output).problem.values
