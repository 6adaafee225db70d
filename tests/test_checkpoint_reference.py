"""The baselines against the real thing: torch.utils.checkpoint around every Hugging Face block.

``solver="per_block"`` claims to be per-block checkpointing. On tiny GPT-2 (eager attention),
Llama and BERT configs without dropout (torch replays dropout's RNG, the plan keeps the 1-byte
mask: they differ by design there), with Hugging Face's own ``gradient_checkpointing_enable``:

* what the plan keeps is what torch saves for backward (``remat_pass.runtime.measure``'s hooks) to the
  byte, plus the tensors the checkpointed layers read through keyword arguments, which torch
  holds by reference in its recompute closure rather than saving (Llama's rotary ``cos``/``sin``);
* the plan recomputes exactly the FLOPs torch's checkpointing adds to the step;
* run through the rewrite, the plan's measured peak is no higher than torch's;
* ``chen_sqrt`` (checkpoint_sequential with sqrt(n) segments) peaks below no rematerialization.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

import remat_pass
from remat_pass.annotate.annotate import annotate
from remat_pass.capture.capture import capture
from remat_pass.annotate.flops import extra_flop_formulas
from remat_pass.runtime.measure import peak_activation_bytes, saved_activation_bytes
from remat_pass.solvers import baselines

from .helpers import set_hf_checkpointing

transformers = pytest.importorskip("transformers")

VOCAB, LAYERS, SHAPE = 64, 3, (2, 12)
slow = pytest.mark.slow


def _hf_model(name: str) -> nn.Module:
    if name == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=LAYERS, n_head=2,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                         eos_token_id=0)
        config._attn_implementation = "eager"  # softmax as its own op: the large saved values are visible
        return transformers.GPT2LMHeadModel(config)
    if name == "llama":
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=32, bos_token_id=0, eos_token_id=1,
                                          pad_token_id=None)
        return transformers.LlamaForCausalLM(config)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32, pad_token_id=0,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(config)


class _LossOf(nn.Module):
    """input_ids -> the LM loss, so that the captured step is the whole step."""

    def __init__(self, model: nn.Module, targets: torch.Tensor) -> None:
        super().__init__()
        self.model = model
        self.targets = targets

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=input_ids).logits
        return F.cross_entropy(logits.flatten(0, -2), self.targets.flatten())


def _case(name: str) -> tuple[_LossOf, torch.Tensor]:
    torch.manual_seed(0)
    model = _LossOf(_hf_model(name), torch.randint(0, VOCAB, SHAPE)).train()
    return model, torch.randint(0, VOCAB, SHAPE)


def _layers(model: _LossOf) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, transformers.modeling_layers.GradientCheckpointingLayer)]


def _torch_checkpointing(model: _LossOf, tokens: torch.Tensor) -> dict[str, int]:
    """Saved bytes, keyword-argument bytes, extra FLOPs and peak of HF's per-layer checkpointing."""
    outside = [*model.parameters(), *model.buffers(), tokens, model.targets]

    def flops() -> int:
        # With the CPU attention kernels' formulas, which flop_counter lacks (remat_pass.annotate.flops).
        with FlopCounterMode(display=False, custom_mapping=extra_flop_formulas()) as counter:
            model(tokens).backward()
        return counter.get_total_flops()

    plain = flops()
    set_hf_checkpointing(model.model, True)
    keyword: dict[int, int] = {}
    excluded = {t.untyped_storage().data_ptr() for t in outside}

    def record(_module: nn.Module, _args: tuple, kwargs: dict) -> None:
        for value in kwargs.values():
            for tensor in value if isinstance(value, tuple) else (value,):
                if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in excluded:
                    keyword[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()

    hooks = [layer.register_forward_pre_hook(record, with_kwargs=True) for layer in _layers(model)]
    try:
        _, saved = saved_activation_bytes(lambda: model(tokens), exclude=outside)
    finally:
        for hook in hooks:
            hook.remove()
    extra_flops = flops() - plain
    model.zero_grad(set_to_none=True)
    _, peak = peak_activation_bytes(lambda: model(tokens).backward(), lambda: [p.grad for p in model.parameters()])
    getattr(model.model, "activation_checkpointing_disable", model.model.gradient_checkpointing_disable)()
    model.zero_grad(set_to_none=True)
    return {"saved": saved, "keyword": sum(keyword.values()), "extra_flops": extra_flops, "peak": peak}


@pytest.mark.parametrize("name", ["gpt2", pytest.param("llama", marks=slow), pytest.param("bert", marks=slow)])
def test_per_block_is_torch_checkpointing(name: str) -> None:
    model, tokens = _case(name)
    problem = annotate(capture(model, (tokens,))[0]).problem
    plan = baselines.per_block(problem)
    reference = _torch_checkpointing(model, tokens)
    assert reference["saved"] <= plan.kept_bytes <= reference["saved"] + reference["keyword"]
    if name != "llama":  # no tensor keyword arguments read inside the layers: byte for byte
        assert plan.kept_bytes == reference["saved"]
    assert plan.recompute_flops == reference["extra_flops"]

    torch._dynamo.reset()
    optimized = remat_pass.optimize(model, 1.0, solver="per_block", example_inputs=(tokens,))
    assert optimized.plan.kept_bytes == plan.kept_bytes
    _, held = saved_activation_bytes(lambda: optimized(tokens),
                                     exclude=[*model.parameters(), *model.buffers(), tokens, model.targets])
    assert held == plan.kept_bytes
    model.zero_grad(set_to_none=True)
    _, peak = peak_activation_bytes(lambda: optimized(tokens).backward(), lambda: [p.grad for p in model.parameters()])
    assert peak <= reference["peak"]


@pytest.mark.parametrize("name", [pytest.param("gpt2", marks=slow), "llama", pytest.param("bert", marks=slow)])
def test_chen_sqrt_is_segmented_and_peaks_below_keep_all(name: str) -> None:
    from remat_pass.solvers.analysis.memory import simulate_plan

    model, tokens = _case(name)
    problem = annotate(capture(model, (tokens,))[0]).problem
    keep_all, per_block, chen = (baselines.keep_all(problem), baselines.per_block(problem),
                                 baselines.chen_sqrt(problem))
    # ceil(sqrt(3)) = 2 layers a segment: fewer kept bytes than per layer, more recompute
    assert 0 < chen.kept_bytes < per_block.kept_bytes
    assert chen.recompute_flops >= per_block.recompute_flops
    assert simulate_plan(problem, chen).peak_bytes < simulate_plan(problem, keep_all).peak_bytes


def test_every_computed_value_has_a_module() -> None:
    """Nodes that carry no module stack of their own (the ``t``, ``detach``, ``transpose`` and
    derivative ``mul`` nodes AOTAutograd adds for backward) get one, so blocks, ``per_block``
    and ``per_module`` see them. (Code in the root module's forward, a loss, stays "".)"""
    from tests.zoo_models import _LogitsOf

    model, tokens = _case("gpt2")
    problem = annotate(capture(_LogitsOf(model.model), (tokens,))[0]).problem
    assert all(v.module for v in problem.values if not v.available)
    blocks = {baselines.block_of(v.module) for v in problem.values if not v.available}
    assert {f"model.transformer.h.{i}" for i in range(LAYERS)} <= blocks
