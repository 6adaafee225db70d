"""Real architectures, built from tiny configs with random weights (no downloads).

Each builder returns ``(model, inputs, loss_fn)`` like ``tests.models.make_case``: the model's
forward returns one tensor (logits or a loss), ``loss_fn(output, *inputs)`` makes it a scalar.
Hugging Face models are wrapped so that forward takes tensors and returns a tensor; sizes are
2 layers, hidden 32, sequence 12, so that capture and planning take seconds on a CPU.

``record_rewrites`` lets a test see the graphs remat_pass really ran: the annotated joint
graph, the plan, and the rewritten forward and backward graphs of every subgraph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import fx, nn
from torch.nn import functional as F

VOCAB = 64
SEQ = 12
BATCH = 2
HIDDEN = 32


class _LogitsOf(nn.Module):
    """forward(input_ids) -> logits of a Hugging Face causal/masked LM."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits


class _Seq2SeqLoss(nn.Module):
    """forward(input_ids, labels) -> the model's own cross-entropy loss (T5 shifts the labels)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


class _ImageLogits(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values).logits


class _CausalEncoder(nn.Module):
    """torch's nn.TransformerEncoder with a causal float mask passed in as an input.

    ``is_causal=True`` tells the encoder what the mask is; without it the encoder compares the
    mask with a causal one (data-dependent), which cannot be captured as one graph.
    """

    def __init__(self, declare_causal: bool = True) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(HIDDEN, 2, 2 * HIDDEN, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.declare_causal = declare_causal

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.declare_causal:
            return self.head(self.encoder(x, mask=mask, is_causal=True))
        return self.head(self.encoder(x, mask=mask))


def _lm_loss(targets: torch.Tensor) -> Callable[..., torch.Tensor]:
    def loss(logits: torch.Tensor, *_inputs: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())

    return loss


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ))


def gpt2(seq: int = SEQ, batch: int = BATCH, attention: str = "sdpa"):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=HIDDEN, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)  # dropout 0.1 (embeddings, attention, residual)
    config._attn_implementation = attention  # "sdpa" (fused) or "eager" (softmax and dropout as ops)
    model = _LogitsOf(GPT2LMHeadModel(config))
    tokens = torch.randint(0, VOCAB, (batch, seq))
    return model, (tokens,), _lm_loss(torch.randint(0, VOCAB, (batch, seq)))


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         attention_dropout=0.1, bos_token_id=0, eos_token_id=1, pad_token_id=None)
    return _LogitsOf(LlamaForCausalLM(config)), (_tokens(),), _lm_loss(_tokens())


def bert():
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=2 * HIDDEN, max_position_embeddings=32, pad_token_id=0)
    return _LogitsOf(BertForMaskedLM(config)), (_tokens(),), _lm_loss(_tokens())


def t5():
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, d_ff=2 * HIDDEN, num_layers=2, num_decoder_layers=2,
                      num_heads=4, dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    labels = torch.randint(1, VOCAB, (BATCH, 8))
    return _Seq2SeqLoss(T5ForConditionalGeneration(config)), (_tokens(), labels), lambda loss, *_: loss


def vit():
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2, intermediate_size=2 * HIDDEN,
                       image_size=16, patch_size=4, num_channels=3, num_labels=5, hidden_dropout_prob=0.1,
                       attention_probs_dropout_prob=0.1)
    labels = torch.randint(0, 5, (BATCH,))
    return _ImageLogits(ViTForImageClassification(config)), (torch.randn(BATCH, 3, 16, 16),), _lm_loss(labels)


def torch_encoder(declare_causal: bool = True):
    mask = nn.Transformer.generate_square_subsequent_mask(SEQ)
    return _CausalEncoder(declare_causal), (torch.randn(BATCH, SEQ, HIDDEN), mask), _lm_loss(_tokens())


ZOO: dict[str, Callable[[], tuple]] = {
    "gpt2": gpt2,
    "llama": llama,
    "bert": bert,
    "t5": t5,
    "vit": vit,
    "torch_encoder": torch_encoder,
}
HF_MODELS = ("gpt2", "llama", "bert", "t5", "vit")


def make_zoo(name: str, seed: int = 0, **options):
    """A seeded zoo model in training mode, its inputs and its loss function."""
    torch.manual_seed(seed)
    model, inputs, loss_fn = ZOO[name](**options)
    return model.train(), inputs, loss_fn


# --- seeing the graphs ---------------------------------------------------------------------------


@dataclass
class Rewritten:
    annotated: object
    plan: object
    forward: fx.GraphModule
    backward: fx.GraphModule


def record_rewrites(monkeypatch) -> list[Rewritten]:
    """Record every (annotated graph, plan, forward, backward) the dynamo backend produces."""
    import remat_pass.planning.pipeline as pipeline

    records: list[Rewritten] = []
    original = pipeline.rewrite

    def recording(annotated, plan):
        forward, backward = original(annotated, plan)
        records.append(Rewritten(annotated, plan, forward, backward))
        return forward, backward

    monkeypatch.setattr(pipeline, "rewrite", recording)
    return records


def is_random(node: fx.Node) -> bool:
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and torch.Tag.nondeterministic_seeded in target.tags
    )


def assert_random_ops_run_once(record: Rewritten) -> None:
    """No random op in the backward graph; the plan recomputes no random value."""
    in_backward = [node.format_node() for node in record.backward.graph.nodes if is_random(node)]
    assert not in_backward, f"backward draws random numbers again: {in_backward}"
    values = record.plan.problem.values
    recomputed_random = [values[i].name for i in record.plan.recomputed if "random" in values[i].tags]
    assert not recomputed_random, recomputed_random
