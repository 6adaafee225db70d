"""The tags annotate puts on values (``Value.tags``); planners may read them, nothing requires them.

A ``str`` enum, so a tag compares and hashes equal to its plain string: a ``Value`` built with
``tags=frozenset({"view"})`` (a test, a problem read back from JSON) is read the same as one
built with ``Tag.VIEW``, and a problem's digest (``plan_cache.problem_digest``) is the same
either way. The strings are part of the cache key: do not rename them.
"""

from __future__ import annotations

import enum


class Tag(enum.StrEnum):
    """What kind of op made a value, where it matters to planning or to a report."""

    RANDOM = "random"  # draws random numbers (dropout): never run twice
    MUTATION = "mutation"  # writes state the step reads later: never run twice
    VIEW = "view"  # shares its base's storage: free to keep once the base is
    MATMUL = "matmul"
    ATTENTION_CORE = "attention_core"  # between two activation-by-activation matmuls (remat_pass.annotate.attention_core)
    DROPOUT_REPLAY = "dropout_replay"  # a dropout output rebuilt from its input and kept mask
    COLLECTIVE = "collective"  # communication over a process group: never run twice
    CHECKPOINTED = "checkpointed"  # recomputed by the model's own checkpointing (remat_pass.annotate.baseline)
    PIECE_INPUT = "piece_input"  # an input of a graph piece, charged when kept: keepable, never recomputed


__all__ = ["Tag"]
