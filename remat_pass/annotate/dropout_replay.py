"""Dropout outputs rebuilt from their kept mask instead of kept, where that is bit-exact.

Random ops are never run again; a dropout output is ``input * mask * scale``, so where those two
multiplications give the dropout kernel's bits the 1-byte mask and the input are enough for
backward. Whether they do depends on the kernel (CPU, CUDA), the dtype and the probability, so it
is not assumed: ``replay_is_exact`` runs the dropout once on a probe tensor of that device, dtype
and probability, under a forked RNG, and compares the rebuilt product with its output bit for bit
(cached per device, dtype and probability). Where they differ the output is kept, as before.
On meta tensors (``plan()``) nothing can run: the rule measured on the CPU (fp32 and fp64
replay exactly) is used.
"""

from __future__ import annotations

import functools
import operator

import torch
from torch import fx

from ..compat import real_tensors


def _dropout_getitems(dropout: fx.Node) -> dict[int, fx.Node]:
    return {user.args[1]: user for user in dropout.users if user.target is operator.getitem}


def dropout_replay_sources(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(input, mask) if ``node`` is a dropout output that can be rebuilt bit-exactly from them
    (``replay_is_exact`` for its device, dtype and probability)."""
    if node.target is not operator.getitem or node.args[1] != 0:
        return None
    dropout = node.args[0]
    if not isinstance(dropout, fx.Node) or dropout.target is not torch.ops.aten.native_dropout.default:
        return None
    val = node.meta.get("val")
    mask = _dropout_getitems(dropout).get(1)
    source = dropout.args[0]
    if (not isinstance(val, torch.Tensor) or mask is None or not isinstance(source, fx.Node)
            or len(dropout.args) < 3 or dropout.args[2] is not True or not isinstance(dropout.args[1], float)):
        return None
    if not replay_is_exact(str(val.device), val.dtype, dropout.args[1]):
        return None
    return source, mask


def replay_scale(probability: float) -> float:
    """The scale dropout applies to the kept elements (what ``native_dropout_backward`` takes)."""
    return 1.0 / (1.0 - probability)


def replay(source: torch.Tensor, mask: torch.Tensor, probability: float) -> torch.Tensor:
    """The rebuilt dropout output, with the ops the rewrite emits (``rewrite._replay_dropouts``)."""
    ops = torch.ops.aten
    return ops.mul.Tensor(ops.mul.Tensor(source, mask), replay_scale(probability))


# Probe size: several vectorised kernel blocks plus a ragged tail, values over many binades.
_PROBE_ELEMENTS = 4 * 4096 + 37


@functools.lru_cache(maxsize=None)
def replay_is_exact(device: str, dtype: torch.dtype, probability: float) -> bool:
    """Whether ``replay`` reproduces ``native_dropout``'s output bit for bit on ``device`` for
    ``dtype`` and ``probability``, measured once on a probe tensor (the user's RNG is untouched)."""
    if device == "meta":
        return dtype in (torch.float32, torch.float64)
    if not 0.0 < probability < 1.0:
        return False
    where = torch.device(device)
    # The dropout draws from ``where``'s default generator: fork_rng restores it (and the CPU's).
    with real_tensors(), torch.random.fork_rng(devices=[where] if where.type == "cuda" else []), torch.no_grad():
        values = torch.randn(_PROBE_ELEMENTS, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        probe = (values * torch.logspace(-8, 8, _PROBE_ELEMENTS, dtype=torch.float64)).to(device=where, dtype=dtype)
        output, mask = torch.ops.aten.native_dropout.default(probe, probability, True)
        return bool(torch.equal(output, replay(probe, mask, probability)))


def order_dropout_masks(graph: fx.Graph) -> None:
    """Put each dropout's mask right after the dropout, so it precedes the output in topological order."""
    for dropout in graph.find_nodes(op="call_function", target=torch.ops.aten.native_dropout.default):
        mask = _dropout_getitems(dropout).get(1)
        if mask is not None:
            dropout.append(mask)
