"""The chunked language-model loss as one opaque op: linear head, row-wise chain, cross-entropy.

A language model's step peaks at its loss: the ``tokens x vocab`` logits, their log-probabilities
(saved for backward) and their gradient are each larger than any activation of a block, and no
keep/recompute choice touches one op's output. ``remat_pass::chunked_linear_cross_entropy``
computes ``F.cross_entropy(chain(F.linear(hidden, weight, bias)), target, ...)`` a few rows of
tokens at a time, so at most one chunk's logits are alive; it saves nothing but its inputs, and
its backward op (``remat_pass::chunked_linear_cross_entropy_backward``) recomputes each chunk's
logits (Cut Cross-Entropy's trade: one more head matmul for the logits' memory).
``remat_pass::chunked_linear_cross_entropy_with_gradients`` instead computes the gradients with
the loss, in forward, each chunk's logits made once (Liger's fused linear cross-entropy: no extra
matmul; the head weight's gradient held until backward, which only scales it).

Every chunk is PyTorch's own ``F.linear`` + chain + ``F.cross_entropy`` with ``reduction="sum"``
(or ``"none"``), so label smoothing, ``ignore_index`` and class weights keep PyTorch's semantics;
``"mean"`` divides by PyTorch's own denominator (the count of targets that are not ignored, or
their class weights' sum). The backward differentiates the chain and the loss of one chunk with
autograd, from the head's output, then does the head's two matmuls itself, accumulating the
weight's gradient in place (a per-chunk weight-sized gradient would be a second copy of the head).

The chain is the row-wise ops between the head and the loss, as a string of ``ChainStep``s
(``"div:30.0|tanh|mul:30.0|float"`` is Gemma-2's softcapping then HF's upcast): custom ops take
strings, not callables, and a closed vocabulary is what can be recomputed without the graph.
"""

from __future__ import annotations

import enum
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from ..compat import autograd_inside_kernel

OP_NAME = "remat_pass::chunked_linear_cross_entropy"
BACKWARD_OP_NAME = "remat_pass::chunked_linear_cross_entropy_backward"
WITH_GRADIENTS_OP_NAME = "remat_pass::chunked_linear_cross_entropy_with_gradients"
REDUCTIONS = ("mean", "sum", "none")


class ChainStep(str, enum.Enum):
    """The row-wise ops a chain may hold (each keeps every row's values to itself)."""

    FLOAT = "float"  # .float() / .to(torch.float32)
    DIV = "div"  # / a Python number
    MUL = "mul"  # * a Python number
    TANH = "tanh"

    def __str__(self) -> str:
        return self.value


def encode_chain(steps: list[tuple[ChainStep, float | None]]) -> str:
    """``[(DIV, 30.0), (TANH, None)]`` -> ``"div:30.0|tanh"`` (``repr`` keeps every float exact)."""
    return "|".join(str(step) if arg is None else f"{step}:{arg!r}" for step, arg in steps)


def _decode_chain(chain: str) -> Iterator[tuple[ChainStep, float]]:
    for text in filter(None, chain.split("|")):
        name, _, arg = text.partition(":")
        yield ChainStep(name), float(arg) if arg else 0.0


def apply_chain(logits: torch.Tensor, chain: str) -> torch.Tensor:
    """The chain's ops on ``logits``, as eager spells them (``x / c``, ``torch.tanh``, ``x * c``)."""
    for step, arg in _decode_chain(chain):
        if step is ChainStep.FLOAT:
            logits = logits.float()
        elif step is ChainStep.DIV:
            logits = logits / arg
        elif step is ChainStep.MUL:
            logits = logits * arg
        else:
            logits = torch.tanh(logits)
    return logits


def chain_dtype(chain: str, head_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the chain's output (the loss's dtype)."""
    return torch.float32 if any(step is ChainStep.FLOAT for step, _ in _decode_chain(chain)) else head_dtype


def _spans(rows: int, chunk_rows: int) -> Iterator[tuple[int, int]]:
    step = max(chunk_rows, 1)
    for start in range(0, rows, step):
        yield start, min(start + step, rows)


def _denominator(target: torch.Tensor, class_weight: Optional[torch.Tensor], ignore_index: int) -> torch.Tensor:
    """What PyTorch's ``reduction="mean"`` divides by: the targets not ignored, or their weights' sum."""
    kept = target != ignore_index
    if class_weight is None:
        return kept.sum()
    return class_weight.gather(0, target.masked_select(kept)).sum()


def _per_chunk_reduction(reduction: str, rows: int, chunk_rows: int) -> str:
    """Each chunk's reduction: ``reduction`` itself when there is one chunk (eager's own program,
    bit for bit), else "sum" (divided by the global denominator for "mean") or "none"."""
    return reduction if reduction == "none" or rows <= chunk_rows else "sum"


def _chunk_loss(logits: torch.Tensor, target: torch.Tensor, class_weight: Optional[torch.Tensor], chain: str,
                ignore_index: int, label_smoothing: float, reduction: str) -> torch.Tensor:
    return F.cross_entropy(apply_chain(logits, chain), target, weight=class_weight, ignore_index=ignore_index,
                           reduction=reduction, label_smoothing=label_smoothing)


@torch.library.custom_op(OP_NAME, mutates_args=())
def chunked_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], target: torch.Tensor,
    class_weight: Optional[torch.Tensor], chain: str, ignore_index: int, label_smoothing: float,
    reduction: str, chunk_rows: int,
) -> torch.Tensor:
    """``F.cross_entropy(chain(F.linear(hidden, weight, bias)), target, ...)``, ``chunk_rows``
    rows of ``hidden`` (``[tokens, hidden]``) at a time; ``target`` is ``[tokens]``."""
    per_chunk = _per_chunk_reduction(reduction, hidden.shape[0], chunk_rows)
    parts = [_chunk_loss(F.linear(hidden[a:b], weight, bias), target[a:b], class_weight, chain, ignore_index,
                         label_smoothing, per_chunk) for a, b in _spans(hidden.shape[0], chunk_rows)]
    return _combined(parts, hidden, target, class_weight, chain, ignore_index, reduction, per_chunk)


def _combined(parts: list[torch.Tensor], hidden: torch.Tensor, target: torch.Tensor,
              class_weight: Optional[torch.Tensor], chain: str, ignore_index: int, reduction: str,
              per_chunk: str) -> torch.Tensor:
    """The loss from its chunks' losses: concatenated ("none"), the one chunk's, or summed in
    order (and over the global denominator for "mean")."""
    if reduction == "none":
        return torch.cat(parts) if parts else hidden.new_empty(0, dtype=chain_dtype(chain, hidden.dtype))
    if len(parts) == 1 and per_chunk == reduction:
        return parts[0]
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total / _denominator(target, class_weight, ignore_index) if reduction == "mean" else total


@chunked_linear_cross_entropy.register_fake
def _fake_forward(hidden, weight, bias, target, class_weight, chain, ignore_index, label_smoothing, reduction,
                  chunk_rows):
    shape = (hidden.shape[0],) if reduction == "none" else ()
    return hidden.new_empty(shape, dtype=chain_dtype(chain, hidden.dtype))


@torch.library.custom_op(BACKWARD_OP_NAME, mutates_args=())
def chunked_linear_cross_entropy_backward(
    grad: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
    target: torch.Tensor, class_weight: Optional[torch.Tensor], chain: str, ignore_index: int,
    label_smoothing: float, reduction: str, chunk_rows: int, weight_grads: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the loss for ``hidden``, ``weight`` and ``bias`` (the last two empty when
    ``weight_grads`` is False; the bias's empty without a bias), recomputing each chunk's logits."""
    per_chunk = _per_chunk_reduction(reduction, hidden.shape[0], chunk_rows)
    scale = grad / _denominator(target, class_weight, ignore_index) if reduction == "mean" != per_chunk else grad
    _, grads = _loss_and_gradients(hidden, weight, bias, target, class_weight, chain, ignore_index, label_smoothing,
                                   reduction, chunk_rows, scale, True, weight_grads)
    return grads


def _loss_and_gradients(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], target: torch.Tensor,
    class_weight: Optional[torch.Tensor], chain: str, ignore_index: int, label_smoothing: float, reduction: str,
    chunk_rows: int, scale: torch.Tensor, hidden_grads: bool, weight_grads: bool,
) -> tuple[list[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each chunk's loss (``reduction`` per chunk, as the forward computes it) and the gradients
    for ``hidden``, ``weight``, ``bias`` at ``scale`` (the gradient of each chunk's loss: the
    incoming one, over the global denominator for a chunked "mean"); a gradient not asked for,
    or the bias's without a bias, is empty. The weight's gradient is accumulated in place over
    chunks, in fp32 for a low-precision weight (a per-chunk weight-sized gradient would be a
    second copy of the head)."""
    per_chunk = _per_chunk_reduction(reduction, hidden.shape[0], chunk_rows)
    grad_hidden = torch.empty_like(hidden) if hidden_grads else hidden.new_empty(0)
    accumulate = torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype
    grad_weight: torch.Tensor | None = None
    grad_bias: torch.Tensor | None = None
    losses = []
    for a, b in _spans(hidden.shape[0], chunk_rows):
        rows = hidden[a:b]
        with autograd_inside_kernel():
            logits = F.linear(rows, weight, bias).detach().requires_grad_()
            loss = _chunk_loss(logits, target[a:b], class_weight, chain, ignore_index, label_smoothing, per_chunk)
            (grad_logits,) = torch.autograd.grad(loss, logits, scale[a:b] if reduction == "none" else scale)
        losses.append(loss.detach())
        if hidden_grads:
            torch.mm(grad_logits, weight, out=grad_hidden[a:b])
        if not weight_grads:
            continue
        g, x = (grad_logits, rows) if accumulate == weight.dtype else (grad_logits.to(accumulate), rows.to(accumulate))
        grad_weight = g.t().mm(x) if grad_weight is None else grad_weight.addmm_(g.t(), x)
        if bias is not None:
            grad_bias = g.sum(0) if grad_bias is None else grad_bias.add_(g.sum(0))
    grad_weight = torch.zeros_like(weight) if weight_grads and grad_weight is None else grad_weight
    return losses, (grad_hidden, hidden.new_empty(0) if grad_weight is None else grad_weight.to(weight.dtype),
                    hidden.new_empty(0) if grad_bias is None else grad_bias.to(weight.dtype))


@chunked_linear_cross_entropy_backward.register_fake
def _fake_backward(grad, hidden, weight, bias, target, class_weight, chain, ignore_index, label_smoothing,
                   reduction, chunk_rows, weight_grads):
    return (torch.empty_like(hidden), torch.empty_like(weight) if weight_grads else hidden.new_empty(0),
            torch.empty_like(bias) if weight_grads and bias is not None else hidden.new_empty(0))


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, bias, target, class_weight, *rest = inputs
    ctx.save_for_backward(hidden, weight, bias, target, class_weight)
    ctx.settings = tuple(rest)


def _backward(ctx, grad):
    hidden, weight, bias, target, class_weight = ctx.saved_tensors
    weight_grads = bool(ctx.needs_input_grad[1] or (bias is not None and ctx.needs_input_grad[2]))
    grad_hidden, grad_weight, grad_bias = chunked_linear_cross_entropy_backward(
        grad, hidden, weight, bias, target, class_weight, *ctx.settings, weight_grads)
    return (grad_hidden if ctx.needs_input_grad[0] else None,
            grad_weight if ctx.needs_input_grad[1] else None,
            grad_bias if bias is not None and ctx.needs_input_grad[2] else None,
            None, None, None, None, None, None, None)


chunked_linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)


# --- gradients computed with the loss -----------------------------------------------------------


@torch.library.custom_op(WITH_GRADIENTS_OP_NAME, mutates_args=())
def chunked_linear_cross_entropy_with_gradients(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], target: torch.Tensor,
    class_weight: Optional[torch.Tensor], chain: str, ignore_index: int, label_smoothing: float,
    reduction: str, chunk_rows: int, hidden_grads: bool, weight_grads: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loss (a "mean" or "sum": one number) and its gradients for ``hidden``, ``weight`` and
    ``bias`` at an incoming gradient of 1, chunk by chunk in one pass (Liger's fused linear
    cross-entropy): each chunk's logits are made once, never again. The gradient a scalar loss
    receives only scales these (the chain rule is linear in it), so backward multiplies and
    recomputes nothing; a gradient not asked for (``hidden_grads``/``weight_grads`` False, or
    the bias's without a bias) is empty."""
    if reduction == "none":
        raise ValueError("the gradients of a reduction='none' loss depend on each token's incoming gradient; "
                         "chunk it with backward='recompute'")
    per_chunk = _per_chunk_reduction(reduction, hidden.shape[0], chunk_rows)
    one = torch.ones((), dtype=chain_dtype(chain, hidden.dtype), device=hidden.device)
    scale = one / _denominator(target, class_weight, ignore_index) if reduction == "mean" != per_chunk else one
    losses, grads = _loss_and_gradients(hidden, weight, bias, target, class_weight, chain, ignore_index,
                                        label_smoothing, reduction, chunk_rows, scale, hidden_grads, weight_grads)
    return (_combined(losses, hidden, target, class_weight, chain, ignore_index, reduction, per_chunk), *grads)


@chunked_linear_cross_entropy_with_gradients.register_fake
def _fake_with_gradients(hidden, weight, bias, target, class_weight, chain, ignore_index, label_smoothing,
                         reduction, chunk_rows, hidden_grads, weight_grads):
    return (hidden.new_empty((), dtype=chain_dtype(chain, hidden.dtype)),
            torch.empty_like(hidden) if hidden_grads else hidden.new_empty(0),
            torch.empty_like(weight) if weight_grads else hidden.new_empty(0),
            torch.empty_like(bias) if weight_grads and bias is not None else hidden.new_empty(0))


def _setup_with_gradients(ctx, inputs, output) -> None:
    _, grad_hidden, grad_weight, grad_bias = output
    ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
    ctx.has_bias = inputs[2] is not None
    ctx.mark_non_differentiable(grad_hidden, grad_weight, grad_bias)


def _backward_with_gradients(ctx, grad, *_unused):
    """The stored gradients times the loss's incoming one (exact when it is 1 or a power of 2)."""
    grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
    needs = ctx.needs_input_grad
    return (grad_hidden * grad if needs[0] else None, grad_weight * grad if needs[1] else None,
            grad_bias * grad if ctx.has_bias and needs[2] else None,
            None, None, None, None, None, None, None, None, None)


chunked_linear_cross_entropy_with_gradients.register_autograd(_backward_with_gradients,
                                                              setup_context=_setup_with_gradients)


__all__ = ["BACKWARD_OP_NAME", "ChainStep", "OP_NAME", "REDUCTIONS", "WITH_GRADIENTS_OP_NAME", "apply_chain",
           "chain_dtype", "chunked_linear_cross_entropy", "chunked_linear_cross_entropy_backward",
           "chunked_linear_cross_entropy_with_gradients", "encode_chain"]
