"""Analytic per-layer recompute planner for GPT-style transformers (``remat-pass estimate``).

No tracing and no torch: from a model shape and a GPU budget it predicts per-GPU memory and
picks, for each of the ``L`` identical layers, one of four policies so that the step fits with
the least extra time. It answers "will this config fit, and what does fitting cost?" before
anyone writes a training script; the traced planner answers the same question exactly later.

Activation memory (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", arXiv:2205.05198, Table 2). Per layer, in bytes, with 16-bit activations
and 1-byte dropout masks (``t`` = tensor-parallel size):

=====================================  ===================================
no parallelism                          ``s*b*h*(34 + 5*a*s/h)``
tensor parallel                         ``s*b*h*(10 + 24/t + 5*a*s/(h*t))``
tensor + sequence parallel (SP)         ``s*b*h/t*(34 + 5*a*s/h)``
selective recompute                     drop the ``5*a*s/h`` term
full recompute                          ``2*s*b*h`` (the layer input; ``/t`` with SP)
=====================================  ===================================

The constants are counts of 2-byte tensors plus 1-byte masks: ``34 = 32 + 2`` (2 masks) and
``5 = 4 + 1`` (the softmax-dropout mask). Of the 34, ``10 = 8 + 2`` is what TP leaves
replicated (both LayerNorm inputs, the QKV and first-MLP inputs, both dropout masks) and
``24 = 8 + 16`` is split (Q, K, V, the projection input, the two ``4h``-wide MLP tensors).
So the constants are kept *per element*: with ``e`` bytes per activation element the figure
is ``s*b*h*(16*e + 2 + (2*e + 1)*a*s/h)``, i.e. fp32 (``e = 4``) gives ``66 + 9*a*s/h``, not a
plain doubling, because dropout masks stay 1 byte. ``--ffn-hidden F`` replaces the two
``4h``-wide MLP tensors by ``F``-wide ones: the split part becomes ``(4 + 2*F/h)`` elements.

FlashAttention never writes the ``s x s`` scores to memory and recomputes them in its own
backward, so with it the "none" figure already equals the selective one and "selective" is not
offered as a separate policy.

Outside the layers (only with ``--vocab``; paper section 4.3): the embedding-dropout mask
``s*b*h``, the final LayerNorm and output-projection inputs ``2 * e*s*b*h`` (all ``/t`` with SP)
and fp32 logits ``4*s*b*V/t``.

Pipeline parallelism (``--pp p``, ``--microbatches m``, ``--schedule 1f1b|interleaved``,
``--virtual-stages v``; see ``remat_pass.tools.schedules``): the figures are the *first* stage's, which
holds the most. It owns ``L/p`` layers (the policies are chosen for them) and keeps each
layer's activations for every micro-batch in flight: ``min(p, m)`` under 1F1B, ``p*(1 +
(p-1)/(p*v))`` interleaved (Korthikanti et al. section 4), so stored bytes per layer are
multiplied by that; a rebuilt layer's working set is one micro-batch's. Its parameters are its
layers' plus the embedding; outside the layers it holds the embedding-dropout mask of each
micro-batch in flight (the final norm and the logits live on the last stage, with one
micro-batch in flight). Times are per micro-batch; the pipeline bubble is not modelled.

Model state, per GPU: parameters ``P = L*(4*h^2 + 2*h*F) + V*h`` (``12*L*h^2 + V*h`` for
``F = 4h``; biases and norms ignored), divided by ``t``. Mixed precision Adam holds 2 bytes of
weights, 2 of gradients and 12 of optimizer state (fp32 master, m, v) per parameter; fp32
training holds 4 + 4 + 8. ZeRO stage 1/2/3 over ``dp`` ranks divides optimizer / +gradients /
+weights by ``dp`` (Rajbhandari et al. 2020).

Cost model (seconds per GPU, ``tflops`` is *achieved* throughput):

* forward FLOPs of a layer: ``(8*b*s*h^2 + 4*b*s*h*F + 4*b*s^2*h) / t``; the step is
  ``3 x`` the forward of all layers plus the logits, which for ``F = 4h`` is the paper's
  ``72*b*s*L*h^2*(1 + s/(6h) + V/(12*h*L))`` (Appendix A) divided by ``t``.
* none: 0.
* selective: the attention core forward again, ``4*b*s^2*h/t`` FLOPs (``Q K^T`` and ``P V``),
  plus writing and reading back the rebuilt score tensors at HBM bandwidth, because softmax
  and dropout are memory bound and their FLOPs understate their time.
* full: one more forward of the layer.
* offload: the layer's activations go to host memory over PCIe during forward and come back
  during backward; each direction costs ``max(0, bytes / pcie - compute it hides behind)``,
  the layer's forward (1x) on the way out and its backward (2x forward) on the way back.

Peak memory, not just the sum: layers are placed offload, full, selective, none from the
input up, so backward meets the cheap layers last. When backward reaches a recomputed or
offloaded layer it rebuilds that layer's working set (its "none" bytes; the score tensors for
selective) while only the layers below it are still stored. The peak is the larger of the sum
at the end of forward and those moments. Activation gradients, allocator fragmentation, the
CUDA context and communication buffers are not modelled: leave headroom. Offload assumes the
host has room for what it receives and that ``pcie`` is this GPU's own share of the link.

Layers are identical, so the multiple-choice knapsack reduces to counting how many layers take
each policy; :func:`plan_layers` enumerates the (offload, full) counts and binary-searches the
smallest selective count that fits, which is exact because the peak never rises as layers move
from none to selective.

>>> w = Workload(layers=80, hidden=8192, heads=64, seq=8192, tp=8, sequence_parallel=True,
...              dp=8, zero=1)
>>> plan = plan_layers(w, Hardware(memory_bytes=parse_bytes("80GB")))
>>> plan.counts()[Policy.SELECTIVE] > 0
True
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, fields, replace
from fractions import Fraction
from typing import Any, Mapping

from remat_pass.planning.budget import parse_size  # torch-free, like this module
from remat_pass.errors import InvalidBudgetError
from remat_pass.tools.schedules import Schedule, check_schedule, in_flight
from remat_pass.solvers.errors import RematError
from remat_pass.solvers.problem import format_bytes
from remat_pass.tools.layer_policies import Policy, PolicyRow, activation_peak, search_counts

logger = logging.getLogger(__name__)

__all__ = [
    "Hardware",
    "DoesNotFitError",
    "LayerPlan",
    "Policy",
    "Workload",
    "format_bytes",
    "parse_bytes",
    "plan_layers",
]

DTYPE_BYTES: Mapping[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}
# (weights, gradients, optimizer) bytes per parameter.
_STATE_BYTES: Mapping[int, tuple[int, int, int]] = {2: (2, 2, 12), 4: (4, 4, 8)}


class DoesNotFitError(RematError, ValueError):
    """No assignment of policies fits; carries the smallest per-GPU memory that would."""

    def __init__(self, budget_bytes: int, needed_bytes: int, state_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.needed_bytes = needed_bytes
        self.state_bytes = state_bytes
        hint = ("weights, gradients and optimizer state alone exceed it; shard them with --tp or --dp --zero"
                if state_bytes > budget_bytes else "reduce --batch or --seq, or add --tp / --sequence-parallel")
        super().__init__(
            f"does not fit: the smallest plan needs {format_bytes(needed_bytes)} per GPU "
            f"({needed_bytes} bytes) but --gpu-memory is {format_bytes(budget_bytes)}; "
            f"weights+grads+optimizer take {format_bytes(state_bytes)}. Next step: {hint}."
        )


@dataclass(frozen=True)
class Workload:
    """A GPT-style training step as one GPU sees it. Sizes are counts, not bytes.

    ``ffn_hidden`` defaults to ``4 * hidden``; ``vocab = 0`` leaves embeddings and logits out.
    Raises ``ValueError`` on shapes tensor parallelism cannot split evenly.
    """

    layers: int
    hidden: int
    heads: int
    seq: int
    batch: int = 1
    vocab: int = 0
    ffn_hidden: int | None = None
    dtype: str = "bf16"
    tp: int = 1
    sequence_parallel: bool = False
    flash_attention: bool = False
    dp: int = 1
    zero: int = 0
    pp: int = 1
    microbatches: int = 1
    schedule: str = Schedule.ONE_F_ONE_B.value
    virtual_stages: int = 1

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "batch", "tp", "dp"):
            _require(getattr(self, name) >= 1, f"--{name.replace('_', '-')} must be at least 1")
        _require(self.vocab >= 0, "--vocab must not be negative")
        _require(self.ffn_hidden is None or self.ffn_hidden >= 1, "--ffn-hidden must be at least 1")
        _require(self.dtype in DTYPE_BYTES, f"--dtype must be one of {', '.join(DTYPE_BYTES)}")
        _require(self.zero in (0, 1, 2, 3), "--zero must be 0, 1, 2 or 3")
        _require(self.hidden % self.heads == 0,
                 f"--hidden {self.hidden} is not divisible by --heads {self.heads}")
        _require(self.heads % self.tp == 0, f"--heads {self.heads} is not divisible by --tp {self.tp}")
        _require(self.ffn % self.tp == 0, f"--ffn-hidden {self.ffn} is not divisible by --tp {self.tp}")
        _require(not self.sequence_parallel or self.seq % self.tp == 0,
                 f"--seq {self.seq} is not divisible by --tp {self.tp}, which --sequence-parallel needs")
        check_schedule(self.layers, self.pp, self.microbatches, self.schedule, self.virtual_stages)

    @property
    def stage_layers(self) -> int:
        """Layers on one pipeline stage (all of them without pipeline parallelism)."""
        return self.layers // self.pp

    @property
    def in_flight(self) -> Fraction:
        """Micro-batches whose activations the first stage holds at once."""
        return in_flight(self.pp, self.microbatches, self.schedule, self.virtual_stages)

    @property
    def ffn(self) -> int:
        return 4 * self.hidden if self.ffn_hidden is None else self.ffn_hidden

    @property
    def elem_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Hardware:
    """One GPU: memory in bytes, achieved dense TFLOP/s, PCIe GB/s per direction, HBM TB/s.

    ``pcie_gbps = 0`` means no host offload. Defaults are H100-class guesses.
    """

    memory_bytes: int
    tflops: float = 400.0
    pcie_gbps: float = 25.0
    hbm_tbps: float = 3.35

    def __post_init__(self) -> None:
        _require(self.memory_bytes > 0, "--gpu-memory must be positive")
        _require(self.tflops > 0, "--tflops must be positive")
        _require(self.pcie_gbps >= 0, "--pcie-gbps must not be negative")
        _require(self.hbm_tbps > 0, "--hbm-tbps must be positive")


@dataclass(frozen=True)
class MemoryBreakdown:
    """Per-GPU bytes at the peak; ``activations`` includes the transient rebuild."""

    weights: int
    grads: int
    optimizer: int
    layer_activations: int
    other_activations: int
    transient: int

    @property
    def state(self) -> int:
        return self.weights + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.state + self.layer_activations + self.other_activations + self.transient


@dataclass(frozen=True)
class LayerPlan:
    """The chosen policy counts with predicted memory and time. Built by :func:`plan_layers`."""

    workload: Workload
    hardware: Hardware
    rows: tuple[PolicyRow, ...]
    memory: MemoryBreakdown
    step_seconds: float
    parameters: int

    def counts(self) -> dict[Policy, int]:
        return {row.policy: row.layers for row in self.rows}

    @property
    def extra_seconds(self) -> float:
        return sum(row.layers * row.extra_seconds for row in self.rows)

    @property
    def extra_fraction(self) -> float:
        return self.extra_seconds / self.step_seconds

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; derived totals are included for readers and ignored by ``from_dict``."""
        data = asdict(self)
        data["rows"] = [{**asdict(row), "policy": row.policy.value} for row in self.rows]
        data["counts"] = {row.policy.value: row.layers for row in self.rows}
        data["memory"]["state"] = self.memory.state
        data["memory"]["total"] = self.memory.total
        data["memory"]["budget"] = self.hardware.memory_bytes
        data["extra_seconds"] = self.extra_seconds
        data["extra_fraction"] = self.extra_fraction
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LayerPlan:
        rows = tuple(PolicyRow(**{**row, "policy": Policy(row["policy"])}) for row in data["rows"])
        return cls(
            workload=Workload(**data["workload"]),
            hardware=Hardware(**data["hardware"]),
            rows=rows,
            memory=MemoryBreakdown(**_known(MemoryBreakdown, data["memory"])),
            step_seconds=data["step_seconds"],
            parameters=data["parameters"],
        )


# -- memory formulas -------------------------------------------------------------------


def layer_activation_bytes(w: Workload, policy: Policy) -> int:
    """Bytes one layer keeps on the GPU from forward to backward (Korthikanti Table 2)."""
    if policy is Policy.OFFLOAD:
        return 0
    sb, h, t, e = w.seq * w.batch, w.hidden, w.tp, w.elem_bytes
    if policy is Policy.FULL:
        return sb * h * e // t if w.sequence_parallel else sb * h * e
    replicated = sb * h * (4 * e + 2)
    split = sb * (4 * h + 2 * w.ffn) * e // t
    scores = _score_bytes(w) if policy is Policy.NONE else 0
    if w.sequence_parallel:
        replicated //= t
    return replicated + split + scores


def _score_bytes(w: Workload) -> int:
    """The ``5*a*s^2*b / t`` attention-score term at ``e`` bytes per element; 0 with FlashAttention."""
    if w.flash_attention:
        return 0
    return (w.heads // w.tp) * w.seq * w.seq * w.batch * (2 * w.elem_bytes + 1)


def other_activation_bytes(w: Workload) -> int:
    """Embedding-dropout mask, final norm and output-projection inputs, fp32 logits (section 4.3).

    With pipeline parallelism: the first stage's embedding-dropout masks, one per micro-batch in flight.
    """
    if w.vocab == 0:
        return 0
    sbh = w.seq * w.batch * w.hidden
    if w.pp > 1:
        return math.ceil(sbh // (w.tp if w.sequence_parallel else 1) * w.in_flight)
    around = sbh * (1 + 2 * w.elem_bytes)
    if w.sequence_parallel:
        around //= w.tp
    return around + 4 * w.seq * w.batch * math.ceil(w.vocab / w.tp)


def parameter_count(w: Workload) -> int:
    """``L*(4h^2 + 2hF) + V*h``: the standard ``12*L*h^2`` when ``F = 4h``, plus embeddings."""
    h = w.hidden
    return w.layers * (4 * h * h + 2 * h * w.ffn) + w.vocab * h


def stage_parameter_count(w: Workload) -> int:
    """Parameters of the first pipeline stage: its ``L/p`` layers and the embedding."""
    h = w.hidden
    return w.stage_layers * (4 * h * h + 2 * h * w.ffn) + w.vocab * h


def state_bytes(w: Workload) -> tuple[int, int, int]:
    """Per-GPU (weights, gradients, optimizer) bytes after TP, PP and ZeRO sharding."""
    per_gpu = math.ceil(stage_parameter_count(w) / w.tp)
    weight_b, grad_b, optim_b = _STATE_BYTES[w.elem_bytes]

    def sharded(nbytes: int, stage: int) -> int:
        # ZeRO stage 1 shards the optimizer state over the data-parallel ranks, 2 also the
        # gradients, 3 also the weights.
        return math.ceil(per_gpu * nbytes / (w.dp if w.zero >= stage else 1))

    return sharded(weight_b, 3), sharded(grad_b, 2), sharded(optim_b, 1)


# -- time formulas ---------------------------------------------------------------------


def layer_forward_flops(w: Workload) -> int:
    """Forward FLOPs of one layer on one GPU: the linears plus the attention core."""
    b, s, h = w.batch, w.seq, w.hidden
    return (8 * b * s * h * h + 4 * b * s * h * w.ffn + 4 * b * s * s * h) // w.tp


def step_flops(w: Workload) -> int:
    """Forward plus backward (2x forward) of all layers and the logits, one GPU, no recompute.

    With pipeline parallelism: one micro-batch through the first stage's layers (no logits).
    """
    logits = 2 * w.batch * w.seq * w.hidden * math.ceil(w.vocab / w.tp) if w.pp == 1 else 0
    return 3 * (w.stage_layers * layer_forward_flops(w) + logits)


def attention_core_flops(w: Workload) -> int:
    """``Q K^T`` and ``P V``: what selective recompute runs again, per layer and GPU."""
    return 4 * w.batch * w.seq * w.seq * w.hidden // w.tp


def _policy_row(w: Workload, hw: Hardware, policy: Policy) -> PolicyRow:
    """Per-layer stored bytes, transient rebuild bytes and extra seconds for one policy."""
    flops_per_s = hw.tflops * 1e12
    forward = layer_forward_flops(w) / flops_per_s
    working_set = layer_activation_bytes(w, Policy.NONE)
    stored = layer_activation_bytes(w, policy)
    if policy is Policy.NONE:
        return PolicyRow(policy, 0, stored, 0, 0.0)
    if policy is Policy.SELECTIVE:
        traffic = 2 * _score_bytes(w) / (hw.hbm_tbps * 1e12)
        extra = attention_core_flops(w) / flops_per_s + traffic
        return PolicyRow(policy, 0, stored, _score_bytes(w), extra)
    if policy is Policy.FULL:
        return PolicyRow(policy, 0, stored, working_set - stored, forward)
    transfer = working_set / (hw.pcie_gbps * 1e9)
    extra = max(0.0, transfer - forward) + max(0.0, transfer - 2 * forward)
    return PolicyRow(policy, 0, stored, working_set, extra)


def available_policies(w: Workload, hw: Hardware) -> tuple[Policy, ...]:
    """Selective is moot under FlashAttention; offload needs a PCIe link."""
    return tuple(p for p in Policy
                 if not (p is Policy.SELECTIVE and w.flash_attention)
                 and not (p is Policy.OFFLOAD and hw.pcie_gbps == 0))


def plan_layers(w: Workload, hw: Hardware) -> LayerPlan:
    """Choose per-layer policies that fit ``hw.memory_bytes`` with the least extra time.

    Raises :class:`DoesNotFitError` (with the smallest memory that would fit) when even
    the leanest assignment does not.
    """
    rows = {p: _in_flight_row(_policy_row(w, hw, p), w) for p in available_policies(w, hw)}
    weights, grads, optimizer = state_bytes(w)
    other = other_activation_bytes(w)
    fixed = weights + grads + optimizer + other
    counts, lowest = search_counts(rows, w.stage_layers, hw.memory_bytes - fixed)
    if counts is None:
        raise DoesNotFitError(hw.memory_bytes, fixed + lowest, weights + grads + optimizer)
    stored = sum(n * rows[p].stored_bytes for p, n in counts.items())
    memory = MemoryBreakdown(weights, grads, optimizer, stored, other,
                             activation_peak(rows, counts) - stored)
    chosen = tuple(PolicyRow(p, counts[p], r.stored_bytes, r.transient_bytes, r.extra_seconds)
                   for p, r in rows.items())
    return LayerPlan(w, hw, chosen, memory, step_flops(w) / (hw.tflops * 1e12), parameter_count(w))


def _in_flight_row(row: PolicyRow, w: Workload) -> PolicyRow:
    """A layer's stored bytes for every micro-batch in flight; it is rebuilt one micro-batch at a time."""
    return replace(row, stored_bytes=math.ceil(row.stored_bytes * w.in_flight))


# -- small helpers ---------------------------------------------------------------------


def parse_bytes(text: str) -> int:
    """``"80GB"`` -> 80e9, ``"80GiB"`` -> 80 * 2**30; SI for GB, binary for GiB.

    The units are the budget's (:func:`remat_pass.planning.budget.parse_size`); a GPU's memory must
    name one ("80" alone is refused: 80 bytes is never what was meant).
    """
    message = f"invalid size {text!r}: use a positive number and a unit such as 80GB, 79.6GiB, 512MiB"
    if not text.strip().lower().endswith("b"):
        raise ValueError(message)
    try:
        return parse_size(text)
    except InvalidBudgetError:
        raise ValueError(message) from None


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _known(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}
