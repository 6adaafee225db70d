"""Block-mirrored plans: the peak rows' MIP restricted to plans that treat identical blocks alike.

On deep models the conservative step-rows MIP (``rows``) is the peak planner's best
source of plans, and the slowest: on a 12-layer Llama (1100 values, 1600 backward steps) one
round ran 10-40 s on HiGHS and often ended with no plan. A transformer's blocks are copies of one
block (``fast.blocks`` finds them: same ops, costs, sizes and edges), and in the plans worth
having the copies mostly make the same choices, so asking for that is a small restriction that
makes the MIP about L times smaller after presolve: each tied pair of variables is one row
``x_a == x_b`` that presolve substitutes away.

Every copy is tied to the first of its class except the *last* one (in forward order). Deep
models peak at the last block's backward, where every earlier block's kept tensors are alive,
but the last block's own activations are alive then either way (kept, or recomputed just
before): its best choice differs from the others', so it stays free. Measured at torch
checkpointing's measured peak, 12 layers, hidden 768 (FLOP-priced, x per-block's recompute; how,
in ``benchmarks/RESULTS.md``, "Issue 13 at depth"): HF GPT-2
0.830 and BERT 0.627, each a plan that fits from the first tied solve in 6-7 s; HF Llama 0.831 at
58 KB over the budget in 14 s (refreshing one value then makes it fit: ``fit_overshoot``), where the
planner without it reached 0.93. Tying the last block too, or leaving the last two free,
overshot by about 10 MB there.

A restriction, not a relaxation: a tied plan is a valid plan of the whole problem (read back
through ``closure_from_keep_set``), but the tied MIP's bound proves nothing about the untied one.

Tied, most of the rows say the same thing again. During the backward of tied copy ``k`` the
storages alive are the copy's own (alike in every tied copy) and what the earlier copies keep
for their own backward; the tied copy that runs its backward first (the last tied one in forward
order, the *representative*) has the most of those alive, so its rows imply the other copies'
at the same position. ``shadowed_steps`` names the other copies' backward steps, and the tied
solve leaves their rows out (``PeakRows.skipped_steps``): the model shrinks from L copies' rows
to about three (the representative, the free last block, what is outside blocks). Where the
copies differ in a way the rows see (a working set, a value read across blocks), the plan may
overshoot; every plan is simulated, and the planner makes it fit or drops it as before.
Measured on the same three 12-layer steps and budgets (one solve of the tied model with and
without the shadowed rows each: ``benchmarks/RESULTS.md``, "Round 11", with the code): the same objective to the last digit, in 2.4 / 4.8 / 2.8 s
instead of 7.4 / 12.6 / 6.7 s, build included (the 6-14 s above are without it); on the
scaling benchmark's 48-layer GPT a tied plan in 11 s, where the full tied model had none after
166 s (``benchmarks/SCALING.md``, "Peak budgets at depth"); in 2.8 s since ``rows`` shares one
variable per view's set of literals ("Round 12").
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..fast.blocks import Group, decompose
from ..analysis.lifetimes import backward_steps_of
from ..mip.solve import MipResult
from ..mip.keep_model import Model
from .rows import PeakRows
from ..problem import Plan, Problem

# Classes with fewer identical blocks than this are not tied: their untied MIP is small already.
MIN_BLOCKS = 3


def mirrored_pairs(problem: Problem) -> tuple[tuple[int, int], ...]:
    """Value pairs ``(a, b)``: ``b`` holds ``a``'s place in an identical block, and takes its choice.

    Per class of at least ``MIN_BLOCKS`` identical blocks, every block but the last is tied to the
    first, position by position. Empty when the problem has no such class.
    """
    pairs = []
    for groups in _tied_classes(problem)[1]:
        first, *others = groups[:-1]
        pairs += [(a, b) for group in others for a, b in zip(first.members, group.members)]
    return tuple(pairs)


def shadowed_steps(problem: Problem) -> frozenset[int]:
    """Backward steps of tied copies other than each class's representative (the last tied copy).

    A step belongs to the block of the latest (in forward order) value it reads: backward of
    copy ``k`` reads copy ``k``'s values and copy ``k - 1``'s output. A step that reads no
    block's value belongs where the step before it does.
    """
    group_of, tied = _tied_classes(problem)
    shadowed = {group_of[g.first] for groups in tied for g in groups[:-2]}
    if not shadowed:
        return frozenset()
    found, owner = set(), None
    for t, step in enumerate(backward_steps_of(problem)):
        owners = [group_of[v] for v in step.reads if v in group_of]
        owner = max(owners) if owners else owner
        if owner in shadowed:
            found.add(t)
    return frozenset(found)


def _tied_classes(problem: Problem) -> tuple[dict[int, int], list[list[Group]]]:
    """Value -> group index, and per class of at least ``MIN_BLOCKS`` identical blocks its
    copies in forward order (every copy but the last is tied)."""
    split = decompose(problem)
    tied = []
    for members in split.classes:
        groups = [split.groups[g] for g in members]
        if len(groups) >= MIN_BLOCKS and groups[0].is_block:
            tied.append(groups)
    return dict(split.group_of), tied


@dataclass(frozen=True)
class MirroredRows:
    """A ``ModelExtension``: ``rows`` plus, for each pair, ``b`` kept (recomputed) iff ``a`` is;
    ``shadowed``: backward steps whose rows are left out (``shadowed_steps``)."""

    rows: PeakRows
    pairs: tuple[tuple[int, int], ...]
    shadowed: frozenset[int] = frozenset()

    def add(self, model: Model) -> None:
        replace(self.rows, skipped_steps=self.rows.skipped_steps | self.shadowed).add(model)
        lp = model.lp
        for index, (a, b) in enumerate(self.pairs):
            for kind, variables in (("k", model.keep), ("r", model.recompute)):
                if a in variables and b in variables:
                    lp += variables[a] == variables[b], f"mirror_{kind}{index}"

    def plan_from(self, problem: Problem, model: Model, result: MipResult, **fields: object) -> Plan:
        return self.rows.plan_from(problem, model, result, **fields)


__all__ = ["MIN_BLOCKS", "MirroredRows", "mirrored_pairs", "shadowed_steps"]
