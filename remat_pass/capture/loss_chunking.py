"""Find a language-model loss in a Dynamo graph and compute it in chunks (``chunked_loss_op``).

The region is matched by its class, not by one model's spelling: a ``linear`` whose output feeds,
through a single-user chain of row-wise ops (views that keep the last dimension, ``.float()`` /
``.to(torch.float32)``, ``/ c``, ``* c``, ``tanh``: HF's upcast, Gemma-2's softcapping), the input
of ``F.cross_entropy`` on ``[tokens, vocab]`` logits and ``[tokens]`` targets. That is Hugging
Face's ``ForCausalLMLoss`` / ``fixed_cross_entropy`` (transformers 5), ``remat_pass.examples.lm_loss``
and a hand-written ``F.cross_entropy(model(x).flatten(0, 1), y)``. The whole region becomes one
``remat_pass`` op call, so AOTAutograd sees one forward node and no ``tokens x vocab`` tensor. How its
backward gets the gradients is ``ChunkLoss.gradients``: by default (a "mean" or "sum" loss) they are
computed with the loss, chunk by chunk, in forward, and backward scales them by the loss's incoming
gradient (``chunked_linear_cross_entropy_with_gradients``: no extra FLOPs; the head weight's gradient
is held from forward to backward); or backward recomputes each chunk's logits
(``chunked_linear_cross_entropy`` + its backward op: one more head matmul, only the inputs held).

The rewrite runs on Dynamo's torch-level graph, before AOTAutograd: there the loss is still one
``cross_entropy`` call with its keyword arguments, rather than its decomposition. Anything that
does not match (logits also used elsewhere, such as returned to the user; legacy ``size_average``;
3-d logits; autocast regions) is left as it is, and the reason logged at debug level.
"""

from __future__ import annotations

import copy as _copy
import enum
import inspect
import logging
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from .chunked_loss_op import REDUCTIONS, ChainStep, chain_dtype, encode_chain

logger = logging.getLogger(__name__)

MiB = 2**20
DEFAULT_CHUNK_BYTES = 16 * MiB
DEFAULT_MIN_ROWS = 256
MIN_CHUNK_BYTES = 64 * 1024
# Under a budget the loss could not meet whole, a chunk's logits get 1/16 of it: the op's working
# set is at most 7 chunks (backward; measured 5-6, annotate.scratch), under half the budget.
BUDGET_SHARE = 16
_CE_SIGNATURE = inspect.signature(F.cross_entropy)
_VIEWS = frozenset({"view", "reshape", "flatten", "contiguous"})
_VIEW_FUNCTIONS = frozenset({torch.reshape, torch.flatten})
_AUTOCAST = frozenset({torch.amp.autocast_mode._enter_autocast, torch.amp.autocast_mode._exit_autocast})


class LossGradients(str, enum.Enum):
    """Where a chunked loss's gradients are computed.

    ``IN_FORWARD``: with the loss, each chunk's logits made once (Liger's fused linear
    cross-entropy). Same FLOPs as the loss whole; holds the gradients for the hidden states and the
    head's weight (``tokens x hidden`` + ``vocab x hidden``) from forward to backward, where
    eager's weight gradient exists from the start of backward anyway. A "mean" or "sum" loss only:
    a per-token loss's gradients depend on each token's incoming gradient.
    ``RECOMPUTED``: in backward, each chunk's logits made again (Cut Cross-Entropy): one more
    head matmul (``2 x tokens x hidden x vocab``), nothing held but the inputs.
    """

    IN_FORWARD = "in_forward"
    RECOMPUTED = "recomputed"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class ChunkLoss:
    """How a loss is chunked: ``chunk_bytes`` is what one chunk's logits aim at (in the loss's
    dtype), ``min_rows`` the fewest tokens a chunk has, ``max_chunk_bytes`` (None: none) a bound
    neither may pass; ``gradients`` says where the gradients are computed (``LossGradients``; a
    per-token loss, ``reduction="none"``, is always recomputed).

    16 MiB by default: the chunk's transient working set (logits, the chain's copies, log-probs,
    their gradient: a few chunks' worth) stays a few tens of MiB, small beside a model's
    activations. At least 256 rows: below that the head's matmuls, and the weight gradient
    accumulated over chunks (read and written whole once per chunk), run far under their rate:
    measured on CPU at Gemma's 256000 vocabulary and hidden 512 (loss and gradients, fp32, against
    eager's whole loss), 16-row chunks (what 16 MiB gives there) take 2.05x, 64 rows 1.19x, 256
    rows 1.00x (``benchmarks/CHUNKED_LOSS.md``, section 7). ``min_rows=1`` lets ``chunk_bytes``
    alone decide.
    """

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    gradients: LossGradients = LossGradients.IN_FORWARD
    min_rows: int = DEFAULT_MIN_ROWS
    max_chunk_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be a positive number of bytes, got {self.chunk_bytes}")
        if self.min_rows < 1:
            raise ValueError(f"min_rows must be a positive number of tokens, got {self.min_rows}")
        if self.max_chunk_bytes is not None and self.max_chunk_bytes < 1:
            raise ValueError(f"max_chunk_bytes must be a positive number of bytes or None, got {self.max_chunk_bytes}")
        try:
            object.__setattr__(self, "gradients", LossGradients(self.gradients))
        except ValueError:
            choices = ", ".join(repr(str(g)) for g in LossGradients)
            raise ValueError(f"gradients must be one of {choices}, got {self.gradients!r}") from None


@dataclass(frozen=True)
class ChunkedRegion:
    """One loss that was chunked: its sizes and what chunking saves."""

    tokens: int
    hidden: int
    vocab: int
    chunk_rows: int
    logits_bytes: int  # one [tokens, vocab] tensor in the loss's dtype
    chain: str
    reduction: str
    gradients: LossGradients = LossGradients.RECOMPUTED
    held_bytes: int = 0  # the gradients held from forward to backward (IN_FORWARD)

    @property
    def chunks(self) -> int:
        return -(-self.tokens // self.chunk_rows)

    @property
    def extra_flops(self) -> int:
        """What chunking adds to the step: the head's matmul once more, in backward, when the
        gradients are recomputed; nothing when they are computed with the loss."""
        return 0 if self.gradients is LossGradients.IN_FORWARD else 2 * self.tokens * self.hidden * self.vocab


def _forward_ops() -> dict[Any, LossGradients]:
    ops = torch.ops.remat_pass
    return {ops.chunked_linear_cross_entropy.default: LossGradients.RECOMPUTED,
            ops.chunked_linear_cross_entropy_with_gradients.default: LossGradients.IN_FORWARD}


def chunked_regions(graph: fx.Graph) -> list[ChunkedRegion]:
    """The chunked losses of a graph after AOTAutograd (their forward op nodes)."""
    regions = []
    forward_ops = _forward_ops()
    for node in graph.nodes:
        if node.op == "call_function" and node.target in forward_ops:
            hidden, weight = (a.meta["val"] for a in node.args[:2])
            chain, reduction, rows = node.args[5], node.args[8], node.args[9]
            tokens, vocab = int(hidden.shape[0]), int(weight.shape[0])
            itemsize = torch.empty((), dtype=chain_dtype(chain, hidden.dtype)).element_size()
            gradients = forward_ops[node.target]
            held = sum(int(t.numel()) * t.element_size() for t in node.meta["val"][1:]) \
                if gradients is LossGradients.IN_FORWARD else 0
            regions.append(ChunkedRegion(tokens, int(hidden.shape[1]), vocab, int(rows), tokens * vocab * itemsize,
                                         chain, reduction, gradients, held))
    return regions


def describe(region: ChunkedRegion) -> str:
    """One line for a plan's notes: that the loss was chunked, how, and what it saves."""
    chunk = region.logits_bytes * region.chunk_rows // max(region.tokens, 1)
    return (f"loss chunked: {region.tokens} tokens x {region.vocab} vocabulary in {region.chunks} chunks of "
            f"{region.chunk_rows} rows (linear head{' + ' + region.chain if region.chain else ''} + cross_entropy, "
            f"reduction {region.reduction}); the logits ({region.logits_bytes / MiB:.1f} MiB), their "
            f"log-probabilities and gradient are never whole, one chunk's ({chunk / MiB:.1f} MiB) at a time; "
            + (f"the gradients are computed with the loss in forward (no extra FLOPs; {region.held_bytes / MiB:.1f} "
               "MiB of them held until backward)" if region.gradients is LossGradients.IN_FORWARD else
               f"backward recomputes the head (+{region.extra_flops / 1e9:.2f} GFLOP)"))


def chunk_for_budget(budget_bytes: int, gradients: LossGradients = LossGradients.IN_FORWARD) -> ChunkLoss:
    """The chunking ``chunk_loss=None`` picks for a budget: a chunk's logits at most 1/16 of the
    budget (at least 64 KiB), aiming at the default 16 MiB and 256 rows within that."""
    share = max(MIN_CHUNK_BYTES, budget_bytes // BUDGET_SHARE)
    return ChunkLoss(min(DEFAULT_CHUNK_BYTES, share), gradients, max_chunk_bytes=share)


def as_chunk_loss(chunk_loss: "bool | ChunkLoss | None") -> ChunkLoss | None:
    """The knob as a config: True -> the default ``ChunkLoss``; False/None -> none."""
    if isinstance(chunk_loss, ChunkLoss):
        return chunk_loss
    if chunk_loss is True:
        return ChunkLoss()
    if chunk_loss in (False, None):
        return None
    raise TypeError(f"chunk_loss must be a bool, None or a ChunkLoss, got {chunk_loss!r}")


def chunk_losses(gm: fx.GraphModule, config: ChunkLoss) -> list[ChunkedRegion]:
    """Rewrite every matching loss region of Dynamo graph ``gm`` in place; what was chunked."""
    if any(node.target in _AUTOCAST for node in gm.graph.nodes):
        logger.debug("loss not chunked: the graph has an autocast region")
        return []
    regions = []
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is F.cross_entropy:
            region = _chunk_one(gm.graph, node, config)
            if region is not None:
                regions.append(region)
    if regions:
        gm.graph.lint()
        gm.recompile()
    return regions


def copied(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of Dynamo's graph module that ``chunk_losses`` can rewrite: new nodes (their
    metadata and the attributes Dynamo sets on them, such as ``_dynamo_source``, shared), the
    same submodules, Dynamo's attributes and ``meta``."""
    copy = fx.GraphModule(gm, _copy.deepcopy(gm.graph))
    for old, new in zip(gm.graph.nodes, copy.graph.nodes):
        for name, value in vars(old).items():
            setattr(new, name, value)
    for name, value in vars(gm).items():
        if name not in vars(copy):
            setattr(copy, name, value)
    copy.meta = dict(gm.meta)
    return copy


def chunkable(gm: fx.GraphModule) -> bool:
    """Whether ``chunk_losses`` would rewrite any loss of ``gm``. Nothing is changed."""
    return bool(_regions(gm, ChunkLoss()))


def would_split(gm: fx.GraphModule, config: ChunkLoss) -> bool:
    """Whether chunking ``gm``'s losses with ``config`` cuts any into more than one chunk. One
    chunk lowers no peak (the whole logits exist at once, in the op) and adds the op's working
    set, so the automatic rule never chunks then. Nothing is changed."""
    return any(region.chunks > 1 for region in _regions(gm, config))


def chunking_extra_flops(gm: fx.GraphModule, config: ChunkLoss) -> int:
    """The FLOPs chunking ``gm``'s losses with ``config`` adds (``ChunkedRegion.extra_flops``:
    the head's matmul again for each loss whose gradients are recomputed). Nothing is changed."""
    return sum(region.extra_flops for region in _regions(gm, config))


def _regions(gm: fx.GraphModule, config: ChunkLoss) -> list[ChunkedRegion]:
    if any(node.target in _AUTOCAST for node in gm.graph.nodes):
        return []
    planned = (_planned(node, config) for node in gm.graph.nodes
               if node.op == "call_function" and node.target is F.cross_entropy)
    return [p.region for p in planned if p is not None]


def worth_chunking(whole_recompute_flops: int, chunked_recompute_flops: int, extra_flops: int) -> bool:
    """Whether the chunked plan is the cheaper one: its recompute plus chunking's extra head matmul
    against the whole loss's plan's recompute (both meeting the same budget)."""
    return chunked_recompute_flops + extra_flops < whole_recompute_flops


@dataclass(frozen=True)
class _Match:
    linear: fx.Node
    chain_nodes: tuple[fx.Node, ...]  # from the cross_entropy's input back to (not including) the linear
    chain: str
    arguments: dict[str, Any]


def _val(node: Any) -> Any:
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None


def _match(ce: fx.Node) -> _Match | None:
    try:
        bound = _CE_SIGNATURE.bind(*ce.args, **ce.kwargs)
    except TypeError:
        return _skip(ce, "its arguments do not bind to F.cross_entropy's signature")
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    if arguments["size_average"] is not None or arguments["reduce"] is not None:
        return _skip(ce, "legacy size_average/reduce")
    if any(isinstance(arguments[k], fx.Node) for k in ("ignore_index", "reduction", "label_smoothing")):
        return _skip(ce, "ignore_index, reduction or label_smoothing is not a constant")
    if arguments["reduction"] not in REDUCTIONS:
        return _skip(ce, f"reduction {arguments['reduction']!r}")
    logits, target = _val(arguments["input"]), _val(arguments["target"])
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not isinstance(target, torch.Tensor) \
            or target.dim() != 1 or target.is_floating_point():
        return _skip(ce, "the logits are not [tokens, vocab] with [tokens] class indices")
    steps, chain_nodes = [], []
    node = arguments["input"]
    while not (node.op == "call_function" and node.target is F.linear):
        step = _chain_step(node)
        if step is None or len(node.users) != 1:
            return _skip(ce, f"{node.format_node()} is not a single-use row-wise op after a linear head")
        if step != ():
            steps.append(step)
        chain_nodes.append(node)
        node = node.args[1] if _scalar_first(node) else node.args[0]
        if not isinstance(node, fx.Node):
            return _skip(ce, "the chain does not start at a node")
    if len(node.users) != 1:
        return _skip(ce, "the head's logits are used elsewhere too (returned or read again): nothing to free")
    weight = _val(node.args[1]) if len(node.args) > 1 else None
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] != logits.shape[-1]:
        return _skip(ce, "the head's weight is not [vocab, hidden]")
    return _Match(node, tuple(chain_nodes), encode_chain(list(reversed(steps))), arguments)


def _chain_step(node: fx.Node) -> tuple[ChainStep, float | None] | tuple[()] | None:
    """The chain step ``node`` is (``()`` for a view that keeps rows), or None if it is none."""
    if node.op == "call_method":
        if node.target in _VIEWS:
            return () if _keeps_rows(node) else None
        if node.target == "float" and len(node.args) == 1:
            return ChainStep.FLOAT, None
        if node.target == "to" and len(node.args) == 2 and node.args[1] is torch.float32 and not node.kwargs:
            return ChainStep.FLOAT, None
        if node.target == "tanh" and len(node.args) == 1:
            return ChainStep.TANH, None
        return None
    if node.op != "call_function":
        return None
    if node.target in _VIEW_FUNCTIONS:
        return () if _keeps_rows(node) else None
    if node.target is torch.tanh and len(node.args) == 1 and not node.kwargs:
        return ChainStep.TANH, None
    if node.target in (operator.truediv, torch.div) and len(node.args) == 2 and not node.kwargs \
            and _number(node.args[1]):
        return ChainStep.DIV, float(node.args[1])
    if node.target in (operator.mul, torch.mul) and len(node.args) == 2 and not node.kwargs:
        if _number(node.args[1]):
            return ChainStep.MUL, float(node.args[1])
        if _scalar_first(node):
            return ChainStep.MUL, float(node.args[0])
    return None


def _scalar_first(node: fx.Node) -> bool:
    """``c * x``: the chain continues through ``args[1]``."""
    return node.op == "call_function" and node.target in (operator.mul, torch.mul) and len(node.args) == 2 \
        and _number(node.args[0])


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _keeps_rows(node: fx.Node) -> bool:
    """A view/reshape whose input and output share the last dimension keeps each row whole."""
    source, result = _val(node.args[0]), _val(node)
    return isinstance(source, torch.Tensor) and isinstance(result, torch.Tensor) and source.dim() >= 1 \
        and result.dim() >= 1 and source.shape[-1] == result.shape[-1]


def _skip(ce: fx.Node, why: str) -> None:
    logger.debug("loss not chunked at %s: %s", ce.format_node(), why)
    return None


@dataclass(frozen=True)
class _Planned:
    """How ``chunk_losses`` would rewrite one matched loss."""

    match: _Match
    region: ChunkedRegion
    grads: tuple[bool, bool]  # (the hidden states', the head's) gradients, computed in forward


def _planned(ce: fx.Node, config: ChunkLoss) -> _Planned | None:
    match = _match(ce)
    if match is None:
        return None
    linear, arguments = match.linear, match.arguments
    hidden_val, weight_val, logits_val = _val(linear.args[0]), _val(linear.args[1]), _val(arguments["input"])
    tokens, (vocab, width) = int(logits_val.shape[0]), (int(d) for d in weight_val.shape)
    if not isinstance(hidden_val, torch.Tensor) or hidden_val.numel() != tokens * width:
        return _skip(ce, "the head's input does not hold one row per target")
    row_bytes = vocab * torch.empty((), dtype=chain_dtype(match.chain, hidden_val.dtype)).element_size()
    rows = chunk_rows(config, row_bytes, tokens)
    bias_val = _val(_bias(linear))
    grads = _gradients_needed(hidden_val, weight_val, bias_val, logits_val)
    in_forward = config.gradients is LossGradients.IN_FORWARD and arguments["reduction"] != "none" and any(grads)
    held = 0
    if in_forward:
        head = [t for t in (weight_val, bias_val) if isinstance(t, torch.Tensor)] if grads[1] else []
        held = sum(int(t.numel()) * t.element_size() for t in ([hidden_val] if grads[0] else []) + head)
    region = ChunkedRegion(tokens, width, vocab, rows, tokens * row_bytes, match.chain, arguments["reduction"],
                           LossGradients.IN_FORWARD if in_forward else LossGradients.RECOMPUTED, held)
    return _Planned(match, region, grads)


def chunk_rows(config: ChunkLoss, row_bytes: int, tokens: int) -> int:
    """A chunk's tokens: ``chunk_bytes`` worth of rows, at least ``min_rows``, within
    ``max_chunk_bytes``; between 1 and ``tokens``."""
    rows = max(config.chunk_bytes // row_bytes, config.min_rows)
    if config.max_chunk_bytes is not None:
        rows = min(rows, config.max_chunk_bytes // row_bytes)
    return max(1, min(tokens, rows))


def _bias(linear: fx.Node) -> Any:
    return linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")


def _chunk_one(graph: fx.Graph, ce: fx.Node, config: ChunkLoss) -> ChunkedRegion | None:
    planned = _planned(ce, config)
    if planned is None:
        return None
    match, region = planned.match, planned.region
    linear, arguments = match.linear, match.arguments
    hidden, weight, bias = linear.args[0], linear.args[1], _bias(linear)
    settings = (arguments["target"], arguments["weight"], match.chain, int(arguments["ignore_index"]),
                float(arguments["label_smoothing"]), arguments["reduction"], region.chunk_rows)
    in_forward = region.gradients is LossGradients.IN_FORWARD
    with graph.inserting_before(ce):
        flat = graph.call_function(torch.reshape, (hidden, (region.tokens, region.hidden)))
        if in_forward:
            fused = graph.call_function(torch.ops.remat_pass.chunked_linear_cross_entropy_with_gradients.default,
                                        (flat, weight, bias, *settings, *planned.grads))
            loss = graph.call_function(operator.getitem, (fused, 0))
        else:
            loss = graph.call_function(torch.ops.remat_pass.chunked_linear_cross_entropy.default,
                                       (flat, weight, bias, *settings))
    loss.meta.update({k: v for k, v in ce.meta.items() if k != "example_value"})
    ce.replace_all_uses_with(loss)
    for node in (ce, *match.chain_nodes, linear):
        graph.erase_node(node)
    logger.info("chunked the loss: %d tokens x %d vocabulary in %d chunks of %d rows, gradients %s", region.tokens,
                region.vocab, region.chunks, region.chunk_rows,
                "computed with the loss" if in_forward else "recomputed in backward")
    return region


def _gradients_needed(hidden: torch.Tensor, weight: torch.Tensor, bias: Any, logits: torch.Tensor) -> tuple[bool, bool]:
    """(the hidden states', the head's) gradients: what autograd will ask the loss for, read from
    Dynamo's example values. A frozen head needs none of its own; logits that do not require grad
    (a step traced under ``no_grad``: an evaluation) need none at all, and computing them in
    forward would be wasted matmuls."""
    if not logits.requires_grad:
        return False, False
    head = weight.requires_grad or (isinstance(bias, torch.Tensor) and bias.requires_grad)
    return bool(hidden.requires_grad), bool(head)


__all__ = ["ChunkLoss", "ChunkedRegion", "DEFAULT_CHUNK_BYTES", "DEFAULT_MIN_ROWS", "LossGradients", "as_chunk_loss", "chunk_for_budget",
           "chunk_losses", "chunk_rows", "chunkable", "chunked_regions", "chunking_extra_flops", "copied", "describe", "worth_chunking", "would_split"]
