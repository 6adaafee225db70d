"""The plan of a step torch's precompile restored, and whether it was planned under today's settings.

Under ``TORCH_CACHING_PRECOMPILE=1`` a restarted process runs the step a previous one compiled
(``capture.precompiled``) without calling remat_pass, so a ``RematModule`` sees a training call
that ran no plan of its own. torch keys that step by the function's name and line alone: were the
budget changed before the restart, the old plan would run, silently. So when a ``RematModule``
compiles under precompile it stores its plans in the plan cache under its forward and its settings
(``record_plans``), and on a call that ran no plan ``plans_compiled_elsewhere`` reads them back;
found, ``.plan`` is the plan that runs; not found, the step was compiled under other settings (or
the plan cache was emptied), and a warning names the directory to delete.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

from torch import nn

from remat_pass.solvers.problem import Plan

from ..compat import inductor_cache_dir, precompile_source_id
from .plan_cache import PlanCache, compiled_key

logger = logging.getLogger(__name__)


def _key(module: nn.Module, options: Any) -> str:
    return compiled_key(f"precompiled step of {precompile_source_id(module.forward)}", options)


def record_plans(cache: PlanCache | None, module: nn.Module, options: Any, plans: tuple[Plan, ...]) -> None:
    """Store the plans ``module``'s step was just compiled with under ``options`` (the last compile's)."""
    if cache is not None and plans:
        cache.put_compiled(_key(module, options), plans)


def plans_compiled_elsewhere(cache: PlanCache | None, module: nn.Module, options: Any) -> tuple[Plan, ...]:
    """The plans a precompiled step of ``module`` was compiled with under ``options``; () and a
    warning where none are stored."""
    stored = None if cache is None else cache.get_compiled(_key(module, options), count=False)
    if isinstance(stored, tuple) and all(isinstance(plan, Plan) for plan in stored):
        logger.info("%s: the step torch's precompile restored was planned under these settings; its plan read back",
                    type(module).__name__)
        return stored
    warnings.warn(
        f"{type(module).__name__}: this training call ran a step that torch's precompile (TORCH_CACHING_PRECOMPILE) "
        f"compiled in another process, and the plan cache holds no record of it being planned under this module's "
        f"budget and settings ({getattr(options, 'budget', options)}): if they changed since, delete "
        f"{os.path.join(inductor_cache_dir(), 'dynamo')} and restart, or the step keeps the old plan's memory",
        stacklevel=5)  # the user's call: this, _forward, Module._call_impl, _wrapped_call_impl
    return ()


__all__ = ["plans_compiled_elsewhere", "record_plans"]
