"""What ``optimize`` says about graph breaks: what a budget means over the pieces, the way round a
break, and a call dynamo ran without compiling anything (a frame skipped at a break it cannot
resume after), which would otherwise train with the budget silently unapplied."""

from __future__ import annotations

import functools
import logging

from ..capture.capture_errors import CaptureCause
from ..compat import dynamo_disabled
from ..errors import CaptureError
from ..planning.budget import parse_budget
from ..planning.pipeline import BudgetKind, resolve_budget_kind

logger = logging.getLogger(__name__)


def ran_without_a_graph(model: str) -> None:
    """A training call that compiled no graph: ``CaptureError`` (``ran_eagerly``), unless dynamo is off
    for the process (``TORCHDYNAMO_DISABLE=1``, a debugging switch that turns every ``torch.compile``
    into eager), where the step running eagerly is what was asked: said once per model class."""
    if not dynamo_disabled():
        raise ran_eagerly(model)
    _say_dynamo_is_off(model)


@functools.cache
def _say_dynamo_is_off(model: str) -> None:
    logger.warning("%s: dynamo is disabled (TORCHDYNAMO_DISABLE=1), so optimize runs the model eagerly: nothing is "
                   "planned and the budget is not applied", model)


def ran_eagerly(model: str) -> CaptureError:
    """A training call dynamo ran without any compiled graph: nothing was planned, nothing kept to a budget
    (the benchmark of benchmarks/results/graph_breaks/ met it as the 8th optimize of one model class)."""
    return CaptureError(
        f"{model}: dynamo ran this training call without compiling any graph of it, so remat_pass planned nothing "
        "and the step ran eagerly, keeping every activation: the budget was not applied. Dynamo runs a whole frame "
        "eagerly where it cannot resume after a graph break (one inside a for or while loop, such as a data-dependent "
        "`if` in the loop over the blocks: make it traceable with torch.where or torch.cond, or move it out of the "
        "loop), and once the frame reached its recompile limit (torch._dynamo.config.recompile_limit: each new input "
        "signature, and each optimize() of a model of the same class, compiles the same code again; "
        "torch._dynamo.reset() forgets those compiles). TORCH_LOGS=graph_breaks,recompiles shows which.")


def warn_graph_breaks(budget: object, budget_kind: str, pieces: int) -> None:
    """Pieces are planned one by one: say so, and what the budget then means."""
    parsed = parse_budget(budget)
    if parsed.fraction is not None:
        applies = "each piece keeps that fraction of what it saves as given"
    elif resolve_budget_kind(parsed, budget_kind) is BudgetKind.PEAK:
        applies = "each piece's peak budget is what the earlier pieces' saved tensors leave of the budget"
    else:
        applies = "an absolute budget of saved bytes bounds each piece on its own, not their sum"
    logger.warning("the forward was captured in %d pieces (graph breaks); each piece is planned separately: %s. "
                   "TORCH_LOGS=graph_breaks shows where tracing broke", pieces, applies)


def with_fullgraph_hint(error: CaptureError, fullgraph: bool) -> CaptureError:
    """The capture error (its ``diagnosis`` kept), plus the way round a graph break ``optimize`` has."""
    diagnosis = getattr(error, "diagnosis", None)
    if fullgraph and error.args and getattr(diagnosis, "cause", None) is not CaptureCause.PRECOMPILE:
        error.args = (f"{error.args[0]}\nTo plan each piece between graph breaks instead, pass "
                      "optimize(..., fullgraph=False).", *error.args[1:])
    return error
