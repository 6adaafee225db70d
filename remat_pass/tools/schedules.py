"""Pipeline-parallel schedules: how many micro-batches' activations a stage holds at once.

Pipeline parallelism splits the ``L`` layers into ``p`` stages of ``L/p`` layers. A stage keeps
each micro-batch's activations from its forward until its backward, so what it holds at the
peak is ``L/p`` layers times the micro-batches *in flight* there. The first stage holds the
most (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4):

* 1F1B (PipeDream-Flush, Megatron's default): the first stage runs ``p - 1`` warm-up forwards
  before its first backward, so ``min(p, m)`` micro-batches are in flight (``m`` per step):
  ``L/p * p = L`` layers' worth — the whole model's activations of one micro-batch,
  whatever ``p`` is.
* Interleaved 1F1B with ``v`` model chunks per stage (each ``L/(p*v)`` layers): Megatron's
  first stage runs ``2*(p - 1) + (v - 1)*p`` warm-up chunk-forwards plus one, so
  ``v*p + p - 1`` chunks are in flight; in units of the stage's ``L/p`` layers that is
  ``p * (1 + (p - 1)/(p*v))``, the paper's factor. Megatron requires ``m`` to be a multiple
  of ``p`` here.

Without pipeline parallelism (``p = 1``) micro-batches run one after another (gradient
accumulation): one is in flight.
"""

from __future__ import annotations

from enum import Enum
from fractions import Fraction


class Schedule(str, Enum):
    """Pipeline schedule names as the CLI spells them."""

    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"


def check_schedule(layers: int, pp: int, microbatches: int, schedule: str, virtual_stages: int) -> None:
    """Raise ValueError (naming the CLI flag) for a pipeline configuration Megatron would refuse."""
    if pp < 1 or microbatches < 1 or virtual_stages < 1:
        raise ValueError("--pp, --microbatches and --virtual-stages must be at least 1")
    if schedule not in {s.value for s in Schedule}:
        raise ValueError(f"--schedule must be one of {', '.join(s.value for s in Schedule)}, got {schedule!r}")
    if schedule == Schedule.INTERLEAVED:
        if pp < 2 or virtual_stages < 2:
            raise ValueError("--schedule interleaved needs --pp 2 or more and --virtual-stages 2 or more")
        if microbatches % pp:
            raise ValueError(f"--schedule interleaved needs --microbatches a multiple of --pp {pp}, "
                             f"got {microbatches}")
    elif virtual_stages != 1:
        raise ValueError("--virtual-stages applies to --schedule interleaved only")
    if layers % (pp * virtual_stages):
        raise ValueError(f"--layers {layers} is not divisible by --pp {pp}"
                         + (f" x --virtual-stages {virtual_stages}" if virtual_stages > 1 else ""))


def in_flight(pp: int, microbatches: int, schedule: str, virtual_stages: int = 1) -> Fraction:
    """Micro-batches the first stage holds at its peak, in units of all its ``L/p`` layers.

    >>> in_flight(8, 32, "1f1b"), in_flight(8, 4, "1f1b"), in_flight(4, 8, "interleaved", 2)
    (Fraction(8, 1), Fraction(4, 1), Fraction(11, 2))
    """
    if pp == 1:
        return Fraction(1)
    if schedule == Schedule.ONE_F_ONE_B:
        return Fraction(min(pp, microbatches))
    chunks = min(virtual_stages * pp + pp - 1, microbatches * virtual_stages)
    return Fraction(chunks, virtual_stages)
