"""Python's full garbage collections during a capture scan only what the capture made.

A capture allocates a few hundred thousand objects that live on (FX nodes, fake tensors, the
planner's models), so Python's cyclic collector runs its oldest generation several times during
it, and each of those collections walks every object of the process: with a 12-layer Hugging
Face GPT-2 built (~540k objects), three full collections took 0.74-0.81 s of `optimize`'s first
call. Freezing the objects that were alive before the capture (``gc.freeze``: moved to a
generation the collector skips) leaves them out of those walks; they are unfrozen afterwards, into
the oldest generation, and collected as before. Garbage made during the capture is still collected
during it. Measured (``python -m benchmarks.scaling --one-call DIR --phases``, its "gc" phases;
``benchmarks/results/one_call_i31h_gc.txt``): full collections 0.74-0.81 -> 0.35-0.43 s of the call,
all collections 0.89-0.98 -> 0.49-0.61 s.

Nothing is frozen when objects are frozen already: by the user (a server that freezes before it
forks keeps its own freeze), or by an enclosing capture (``plan_ahead`` around the backend).
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def older_objects_frozen() -> Iterator[None]:
    """Within the block, the collector walks only objects made in it (see the module)."""
    if gc.get_freeze_count() > 0:
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
