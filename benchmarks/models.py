"""Benchmark workloads: seeded models built from configs (random init, nothing downloaded).

Every model keeps its repeated blocks in ``model.blocks`` (an ``nn.ModuleList`` whose forward is
``block(x) -> x``, iterated in order by the model's forward), so per-block and sequential
checkpointing can replace the list's entries without knowing the model.

- ``gpt``: ``remat_pass.examples.GPT`` (LayerNorm, GELU, written-out attention, dropout, tied weights).
- ``llama``: RMSNorm, SwiGLU MLP, rotary embeddings, SDPA causal attention, no dropout, untied head.
- ``resnet``: a CIFAR-style ResNet of BasicBlocks (conv3x3-BN-ReLU, projection shortcuts).
- ``hf_gpt2``, ``hf_llama``, ``hf_bert``: held-out Hugging Face models (GPT-2 with eager attention,
  Llama, BERT masked LM; random weights, no dropout, so every strategy's gradients are comparable).
  They have no ``blocks`` list: ``checkpoint_blocks`` uses Hugging Face's own per-layer
  checkpointing. The loss is inside the module (``LossOf``), as a user would capture the step.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from remat_pass.examples import GPT, GPTConfig, lm_loss

from .hf_families import FAMILIES, family_model

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of one benchmark model. Fields a kind does not use are ignored.

    ``kind`` is "gpt", "llama", "resnet" or one of ``HF_KINDS`` and ``HF_FAMILY_KINDS``. For "resnet", ``hidden`` is the width of the first
    stage (doubling per stage), ``layers`` the number of BasicBlocks (spread over 4 stages) and
    ``seq`` the image side in pixels.
    """

    kind: str
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    seq: int = 128
    batch: int = 4
    dropout: float = 0.0
    vocab: int = 512
    classes: int = 10
    name: str = ""

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        if self.kind == "resnet":
            return f"resnet-b{self.layers}-w{self.hidden}-img{self.seq}-bs{self.batch}"
        return f"{self.kind}-l{self.layers}-h{self.hidden}-s{self.seq}-bs{self.batch}"

    def to_dict(self) -> dict:
        return {**asdict(self), "label": self.label}


@dataclass
class Workload:
    """A seeded model with one batch of inputs and targets; strategies deep-copy ``model``."""

    spec: ModelSpec
    model: nn.Module
    inputs: tuple[torch.Tensor, ...]
    target: torch.Tensor
    loss_fn: LossFn
    extra: dict = field(default_factory=dict)


# --- Llama-style decoder -------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 as Llama does, so bf16 runs keep the reduction accurate.
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def _rotary_tables(seq: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, heads, seq, head_dim); rotate interleaved halves (GPT-NeoX/HF layout).
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.type_as(x)


class LlamaAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, seq: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = hidden // heads
        self.wq = nn.Linear(hidden, hidden, bias=False)
        self.wk = nn.Linear(hidden, hidden, bias=False)
        self.wv = nn.Linear(hidden, hidden, bias=False)
        self.wo = nn.Linear(hidden, hidden, bias=False)
        cos, sin = _rotary_tables(seq, self.head_dim)
        # Each block owns its (small) tables so a block is a self-contained x -> x module.
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = (
            proj(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
            for proj in (self.wq, self.wk, self.wv)
        )
        cos, sin = self.cos[:seq], self.sin[:seq]
        q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(context.transpose(1, 2).reshape(batch, seq, hidden))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        # Llama's 2/3 * 4h, rounded up to a multiple of 64.
        inner = 64 * math.ceil(int(8 * hidden / 3) / 64)
        self.w1 = nn.Linear(hidden, inner, bias=False)
        self.w3 = nn.Linear(hidden, inner, bias=False)
        self.w2 = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, seq: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(hidden)
        self.attn = LlamaAttention(hidden, heads, seq)
        self.mlp_norm = RMSNorm(hidden)
        self.mlp = SwiGLU(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Llama-style decoder: token ids (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(self, vocab: int, layers: int, hidden: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(LlamaBlock(hidden, heads, seq) for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        for name, param in self.named_parameters():
            if name.endswith("weight") and param.dim() == 2:
                nn.init.normal_(param, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


# --- ResNet-style CNN -----------------------------------------------------------------------


class BasicBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride, bias=False), nn.BatchNorm2d(out_ch)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """CIFAR-style ResNet: images (batch, 3, side, side) -> logits (batch, classes)."""

    def __init__(self, blocks: int, width: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)
        )
        per_stage = [blocks // 4 + (1 if i < blocks % 4 else 0) for i in range(4)]
        layers: list[nn.Module] = []
        in_ch = width
        for stage, count in enumerate(per_stage):
            out_ch = width * 2**stage
            for i in range(count):
                layers.append(BasicBlock(in_ch, out_ch, 2 if stage > 0 and i == 0 else 1))
                in_ch = out_ch
        self.blocks = nn.ModuleList(layers)
        self.fc = nn.Linear(in_ch, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        for block in self.blocks:
            x = block(x)
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


# --- held-out Hugging Face models -----------------------------------------------------------

HF_KINDS = ("hf_gpt2", "hf_llama", "hf_bert")
# benchmarks.hf_families' nine more, as kinds: "hf_mistral", "hf_gemma", ...
HF_FAMILY_KINDS = tuple(f"hf_{name}" for name in FAMILIES)


def hf_model(name: str, layers: int, hidden: int, seq: int, vocab: int, heads: int = 4) -> nn.Module:
    """A randomly initialised Hugging Face model without dropout: "gpt2", "llama", "bert" or one of
    ``benchmarks.hf_families.FAMILIES``."""
    import transformers

    if name == "gpt2":
        config = transformers.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=hidden, n_layer=layers,
                                         n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                         bos_token_id=0, eos_token_id=0)
        config._attn_implementation = "eager"  # softmax as its own op: the large saved values are visible
        return transformers.GPT2LMHeadModel(config)
    if name == "llama":
        config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                                          num_hidden_layers=layers, num_attention_heads=heads,
                                          num_key_value_heads=max(heads // 2, 1), max_position_embeddings=seq,
                                          bos_token_id=0, eos_token_id=1, pad_token_id=None)
        return transformers.LlamaForCausalLM(config)
    if name == "bert":
        config = transformers.BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                         num_attention_heads=heads, intermediate_size=4 * hidden,
                                         max_position_embeddings=seq, pad_token_id=0, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0)
        return transformers.BertForMaskedLM(config)
    if name in FAMILIES:
        return family_model(name, layers, hidden, seq, vocab, heads)
    raise ValueError(f"unknown Hugging Face model {name!r}; expected gpt2, llama, bert or {', '.join(FAMILIES)}")


class LossOf(nn.Module):
    """input_ids -> the LM loss of a Hugging Face model, so that a captured step is the whole step.

    The targets are a non-persistent buffer: an input of the step like the weights, not counted
    as an activation.
    """

    def __init__(self, model: nn.Module, targets: torch.Tensor) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("targets", targets, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=input_ids).logits
        return F.cross_entropy(logits.flatten(0, -2), self.targets.flatten())


def model_loss(loss: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The loss function of a workload whose model already returns its loss."""
    return loss


# --- building -------------------------------------------------------------------------------


def build(spec: ModelSpec, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Workload:
    """Build ``spec``'s model, inputs and targets, seeded so every call gives the same values."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed + 1)
    if spec.kind == "gpt":
        config = GPTConfig(
            vocab_size=spec.vocab, seq_len=spec.seq, layers=spec.layers, hidden=spec.hidden,
            heads=spec.heads, dropout=spec.dropout,
        )
        model: nn.Module = GPT(config)
    elif spec.kind == "llama":
        if spec.dropout:
            raise ValueError("the Llama-style model has no dropout; set dropout=0")
        model = Llama(spec.vocab, spec.layers, spec.hidden, spec.heads, spec.seq)
    elif spec.kind == "resnet":
        model = ResNet(spec.layers, spec.hidden, spec.classes)
    elif spec.kind in HF_KINDS or spec.kind in HF_FAMILY_KINDS:
        return _build_hf(spec, generator, device, dtype)
    else:
        raise ValueError(f"unknown model kind {spec.kind!r}; expected gpt, llama, resnet or one of "
                         f"{', '.join(HF_KINDS + HF_FAMILY_KINDS)}")

    if spec.kind == "resnet":
        inputs = torch.randn(spec.batch, 3, spec.seq, spec.seq, generator=generator)
        target = torch.randint(0, spec.classes, (spec.batch,), generator=generator)
        loss_fn: LossFn = F.cross_entropy
    else:
        inputs = torch.randint(0, spec.vocab, (spec.batch, spec.seq), generator=generator)
        target = torch.randint(0, spec.vocab, (spec.batch, spec.seq), generator=generator)
        loss_fn = lm_loss
    model = model.to(device=device, dtype=dtype)
    inputs = inputs.to(device=device, dtype=dtype if inputs.is_floating_point() else inputs.dtype)
    model.train()
    return Workload(spec, model, (inputs,), target.to(device), loss_fn)


def _build_hf(spec: ModelSpec, generator: torch.Generator, device: str, dtype: torch.dtype) -> Workload:
    if spec.dropout:
        raise ValueError(f"{spec.kind} is built without dropout; set dropout=0")
    inner = hf_model(spec.kind.removeprefix("hf_"), spec.layers, spec.hidden, spec.seq, spec.vocab, spec.heads)
    inputs = torch.randint(0, spec.vocab, (spec.batch, spec.seq), generator=generator)
    target = torch.randint(0, spec.vocab, (spec.batch, spec.seq), generator=generator)
    model = LossOf(inner, target).to(device=device, dtype=dtype).train()
    return Workload(spec, model, (inputs.to(device),), model.targets, model_loss)
