"""PuLP, imported once for all the planners, without the frames of whoever imported it first.

PuLP keeps the exception of each solver library it failed to load at import (``CPLEX_PY.err``,
``COPT_DLL.err``: "not available", shown if one is asked to solve), and with it the traceback, whose
frames are every caller's up the stack. Imported from within a call, it kept that call's locals
alive for the process's life: ``torch.compile(model, backend="remat")`` imports the planners from
inside ``torch.compile``, so the first model compiled that way was never freed. The messages stay;
the tracebacks are dropped.
"""

from __future__ import annotations

import pulp


def _drop_import_tracebacks() -> None:
    for solver in getattr(pulp.apis, "_all_solvers", ()):
        error = vars(solver).get("err")
        while isinstance(error, BaseException):
            error.__traceback__ = None
            error = error.__cause__ or error.__context__


_drop_import_tracebacks()
