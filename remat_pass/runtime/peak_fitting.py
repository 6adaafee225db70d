"""Inductor under a peak budget: compile candidate plans and measure them until one fits.

The planner's peak model is of the unfused program, which Inductor's fused one does not follow, so
under a peak budget with ``inner="inductor"`` the backend fits the plan to the compiled program
(``inductor_fit.fit_peak``: candidates compiled by Inductor, each step measured once). This module
holds the order of those fits, as a mixin of ``dynamo_backend.RematBackend``: plans of the fused
model first (prices, and the backward tensors Inductor never allocates: ``annotate.fused_costs``),
then priced fused with every backward tensor counted, then priced unfused, then
(``chunk_loss=None``) the loss chunked; where none fits,
the eager fallback (Inductor by default, not by request) or one last fit that searches the user's
budget longer before refusing it. A fit that ended before under the same settings is measured first
from the plan cache (``inductor_fit.refit``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from torch import fx

from remat_pass import solvers
from remat_pass.solvers.problem import Plan

from ..capture.cached_compile import graph_digest
from ..capture.capture import make_dynamo_backend
from ..capture.loss_chunking import chunk_for_budget, chunkable, would_split
from ..compat import backward_compiled_with_forward
from ..planning.loss_choice import Pin
from ..planning.pipeline import OnInfeasible
from .inductor_fit import FitOutcome, fit_peak, plan_identity, refit
from .plan_cache import compiled_key

logger = logging.getLogger(__name__)


class PeakFitting:
    """The fit's order of attempts, for ``RematBackend`` (whose attributes it uses: ``options``,
    ``_compile``, ``_eager_fallback``, ``_chunk_when_infeasible``, the thread-local ``_choosing`` and
    ``_fitting`` that ``_options_now`` reads, ``_partition``, ``_whole_or_chunked`` and ``_record``)."""

    def _compile_fitted(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        """Compile with Inductor at the plan whose compiled step's measured peak fits the budget.
        Plans of the fused model (``annotate.fused_costs``) are fitted first; then the same prices
        with every backward tensor counted (a model low where Inductor's multi-output kernels hold
        several at once can refuse where it fits: HF BERT at its checkpointing's compiled peak,
        benchmarks/VS_INDUCTOR.md, "The backward's fused tensors"); where none
        fits, plans priced unfused: the fused prices recompute more pointwise values, and where
        Inductor materializes them (its own order, multi-output kernels) the compiled step can peak
        over every such plan (HF GPT-2 at torch's 0.1 point: 1.004-1.18 of the budget, where the
        unfused prices' plans fit at 0.81). With ``chunk_loss=None``, a budget the whole loss
        cannot be fitted to is fitted with the loss chunked (its gradients in forward); the eager
        fallback then chooses by the rule, and without one the fit runs once more, searching longer."""
        auto_chunking = self._chunk_when_infeasible and chunkable(gm)
        clamp = OnInfeasible(self.options.on_infeasible) is OnInfeasible.CLAMP and self._eager_fallback is None
        try:
            return self._fit(gm, example_inputs, self._compile, clamp=False)
        except _Unplanned as nothing:
            return nothing.compiled
        except solvers.BudgetInfeasibleError as error:
            refused = error
        logger.info("no plan of the fused model fits (%s); fitting plans priced fused, every backward tensor "
                    "counted", refused)
        self._choosing.unfused_memory = True
        try:
            return self._fit(gm, example_inputs, self._compile, clamp=False)
        except solvers.BudgetInfeasibleError as error:
            refused = min((refused, error), key=lambda e: e.min_bytes)
        finally:
            self._choosing.unfused_memory = False
        logger.info("no plan priced for Inductor's fused program fits (%s); fitting plans priced unfused", refused)
        self._choosing.unfused_prices = True
        try:
            return self._fit(gm, example_inputs, self._compile, clamp=clamp and not auto_chunking)
        except solvers.BudgetInfeasibleError as error:
            refused = min((refused, error), key=lambda e: e.min_bytes)
        finally:
            self._choosing.unfused_prices = False
        chunking = chunk_for_budget(refused.budget_bytes)
        if auto_chunking and would_split(gm, chunking):
            logger.info("no plan of the whole loss compiled by Inductor fits (%s); fitting the loss chunked", refused)
            self._choosing.pin = Pin(refused.budget_bytes, refused.kind)
            try:
                return self._fit(gm, example_inputs, make_dynamo_backend(self._partition, "inductor", chunking, self),
                                 clamp=clamp, variant=repr(chunking))
            except solvers.BudgetInfeasibleError as error:
                refused = min((refused, error), key=lambda e: e.min_bytes)
            finally:
                self._choosing.pin = None
        if self._eager_fallback is None:
            return self._fit_searching_longer(gm, example_inputs, refused, clamp=clamp)
        logger.warning("no plan compiled by Inductor measured within the peak budget (%s); running this graph "
                       "with inner='eager', whose peak the planner models exactly", refused.args[0])
        if auto_chunking:
            return self._whole_or_chunked(gm, example_inputs, "eager")
        return self._eager_fallback(gm, example_inputs)

    def _fit_searching_longer(self, gm: fx.GraphModule, example_inputs: list[Any],
                              refused: solvers.BudgetInfeasibleError, *, clamp: bool) -> Any:
        """The last try before refusing a budget with Inductor alone: the fit again, its first plan (at
        the user's budget) searched on before a refusal (``effort.REFUSAL_TIME_LIMIT``), as outside the
        fit; refused there, it ends. The short search's answers depend on the machine's load
        (benchmarks/results/h256_ckpt_fit_runs/: refused beside a CI run, fitted when quiet)."""
        logger.info("no candidate fits after the fit's short searches (%s); fitting again, the budget itself "
                    "planned with the longer search", refused)
        self._choosing.search_longer = True
        try:
            return self._fit(gm, example_inputs, self._compile, clamp=clamp, variant="whole, searched longer")
        except solvers.BudgetInfeasibleError as error:
            lowest = min((refused, error), key=lambda e: e.min_bytes)
            raise lowest from (None if lowest is error else error)
        finally:
            self._choosing.search_longer = False

    def _fit(self, gm: fx.GraphModule, example_inputs: list[Any], compile_: Callable[..., Any], *,
             clamp: bool, variant: str = "whole") -> Any:
        """``inductor_fit.fit_peak`` over ``compile_``'s candidates (``variant`` names the loss's
        form), the chosen plan recorded; where a fit of this graph under these settings ended
        before (the plan cache keeps it), its chosen candidate is measured first (``refit``)."""
        asked_of: dict[tuple[frozenset[int], ...], int | None] = {}

        def compile_at(asked: int | None, seen: set[tuple[frozenset[int], ...]]) -> tuple[Any, Plan]:
            self._fitting.asked, self._fitting.seen, self._fitting.made = asked, seen, []
            self._fitting.answered = False
            try:
                with backward_compiled_with_forward():
                    compiled = compile_(gm, example_inputs)
            finally:
                made, self._fitting.seen = self._fitting.made, None
            if not made:  # no backward, so nothing planned: nothing to fit
                raise _Unplanned(compiled)
            asked_of[plan_identity(made[-1])] = asked
            return compiled, made[-1]

        cache = self.options.plan_cache
        key = None if cache is None else compiled_key(f"{graph_digest(gm, example_inputs)} fit {variant}",
                                                       self._options_now())
        before = None if cache is None or key is None else cache.get_compiled(key)
        chosen = (refit(compile_at, example_inputs, before, answered_by_caches=lambda: self._fitting.answered)
                  if isinstance(before, FitOutcome) else None)
        if chosen is None:
            chosen = fit_peak(compile_at, example_inputs, clamp=clamp,
                              first_refusal_ends=getattr(self._choosing, "search_longer", False))
            target = chosen.plan.budget_bytes
            if cache is not None and key is not None and target is not None and chosen.measured_bytes <= target:
                cache.put_compiled(key, FitOutcome(target, asked_of.get(plan_identity(chosen.plan)),
                                                   chosen.measured_bytes))
        self._record(chosen.plan)
        return chosen.compiled


class _Unplanned(Exception):
    """A compile that planned nothing (a graph without backward): there is no peak to fit."""

    def __init__(self, compiled: Any) -> None:
        super().__init__("nothing planned")
        self.compiled = compiled
