"""Stage 5: ``optimize(model, budget)`` — a module that trains like ``model`` with less memory.

The returned module shares the original's parameters and buffers (nothing is copied, the
original is not modified) and runs its forward through the "remat" dynamo backend with
``fullgraph=True`` (one graph, or a clear error) and ``dynamic=False`` (every new input
signature is captured and planned again, so a plan is never reused for shapes it was not made
for). Plans are cached per signature: shapes, dtypes, devices, requires_grad, train/eval.
"""

from __future__ import annotations

import logging
from typing import Any, Hashable, Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from remat_pass.solvers.problem import Plan

from .dynamo_backend import RematBackend
from .capture import capture_failure
from .compat import recompile_limit, recompile_limit_errors
from .costs import DeviceProfile
from .distributed import reject_wrapped_model
from .errors import CaptureError, RematError
from .pipeline import DEFAULT_BUDGET

logger = logging.getLogger(__name__)

Signature = tuple[Hashable, ...]
_RECOMPILE_LIMIT_HIT = recompile_limit_errors()  # absent in older torch: then nothing matches


def input_signature(training: bool, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Signature:
    """What a plan depends on: every tensor's shape, dtype, device, requires_grad; the mode."""
    flat, spec = tree_flatten((args, dict(kwargs)))
    parts: list[Hashable] = [training, str(spec)]
    for leaf in flat:
        if isinstance(leaf, torch.Tensor):
            parts.append((tuple(leaf.shape), leaf.dtype, str(leaf.device), leaf.requires_grad))
        else:
            parts.append(repr(leaf))
    return tuple(parts)


class RematModule(nn.Module):
    """What ``optimize`` returns. Call it like the original; ``.plan`` is the plan in use.

    ``state_dict``/``load_state_dict`` are the original module's (same keys), so checkpoints
    move freely between the two.
    """

    def __init__(
        self,
        module: nn.Module,
        budget: object,
        *,
        inner: str,
        solver: str,
        device: str | DeviceProfile,
        time_limit: float,
        budget_kind: str = "auto",
        offload: bool = False,
        host_budget: object = None,
        **solver_options: Any,
    ) -> None:
        super().__init__()
        self.module = module
        self._plans: dict[Signature, Plan] = {}
        self._signature: Signature | None = None
        self._last_signature: Signature | None = None
        self._backend = RematBackend(
            budget, inner=inner, solver=solver, device=device, time_limit=time_limit, budget_kind=budget_kind,
            on_plan=self._record_plan, free_inputs=True, offload=offload, host_budget=host_budget, **solver_options,
        )
        # Not a registered submodule: its parameters are the original's.
        object.__setattr__(self, "_compiled", torch.compile(module, backend=self._backend, fullgraph=True, dynamic=False))

    @property
    def plan(self) -> Plan | None:
        """The plan used by the most recent call (None before the first training call)."""
        return self._plans.get(self._last_signature) if self._last_signature is not None else None

    @property
    def plans(self) -> dict[Signature, Plan]:
        """Every plan made so far, by input signature."""
        return dict(self._plans)

    def _record_plan(self, plan: Plan) -> None:
        if self._signature is not None:
            self._plans[self._signature] = plan

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.module(*args, **kwargs)  # no backward, nothing to plan
        self._signature = input_signature(self.module.training, args, kwargs)
        try:
            return self._compiled(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as error:
            cause = getattr(error, "inner_exception", None) or error.__cause__
            if isinstance(cause, RematError):
                raise cause.with_traceback(cause.__traceback__) from None
            raise RematError(
                f"planning or rewriting the captured graph failed: {type(cause).__name__}: {cause}. "
                "This is a remat_pass bug; please report it with the model."
            ) from error
        except torch._dynamo.exc.TorchDynamoException as error:
            raise capture_failure(error) from error
        except _RECOMPILE_LIMIT_HIT as error:  # not a TorchDynamoException
            limit = recompile_limit()
            raise CaptureError(
                f"dynamo's recompile limit for this forward ({limit}, torch._dynamo.config.recompile_limit) is "
                f"reached: every new input signature (shapes, dtypes, train/eval) is captured and planned again "
                f"(this module has {len(self._plans)} plans), and so is every change of Python state forward "
                f"reads, such as an int attribute it increments (`self.calls += 1`: dynamo specializes on the "
                f"value). Pad or bucket inputs to a few shapes, keep changing state in a tensor buffer, or raise "
                f"torch._dynamo.config.recompile_limit. TORCH_LOGS=recompiles shows why each recompile happened."
            ) from error
        finally:
            self._last_signature, self._signature = self._signature, None

    def plan_ahead(self, *example_inputs: Any) -> Plan | None:
        """Capture and plan for these inputs now, leaving buffers and RNG state as they were."""
        buffers = [buffer.detach().clone() for buffer in self.module.buffers()]
        with torch.random.fork_rng(devices=_cuda_devices(example_inputs)):
            self(*example_inputs)
        with torch.no_grad():
            for buffer, saved in zip(self.module.buffers(), buffers):
                buffer.copy_(saved)
        return self.plan

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):  # type: ignore[override]
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def extra_repr(self) -> str:
        return repr(self._backend)


def _cuda_devices(inputs: tuple[Any, ...]) -> list[int]:
    """CUDA devices whose RNG state a planning run might advance (CPU's is always saved)."""
    flat, _ = tree_flatten(inputs)
    return sorted({leaf.device.index or 0 for leaf in flat if isinstance(leaf, torch.Tensor) and leaf.is_cuda})


def optimize(
    model: nn.Module,
    budget: object = DEFAULT_BUDGET,
    *,
    example_inputs: tuple[Any, ...] | None = None,
    inner: str = "eager",
    solver: str = "ilp",
    device: str | DeviceProfile = "cpu",
    time_limit: float = 60.0,
    budget_kind: str = "auto",
    offload: bool = False,
    host_budget: object = None,
    **solver_options: Any,
) -> RematModule:
    """Wrap ``model`` so that its training step keeps at most ``budget`` activation bytes.

    budget: a float in (0, 1] is a fraction of what the un-rematerialized step saves for
    backward; an int (bytes) or a string like "512MB" / "2GiB" is an absolute cap on the peak
    activation memory of the step. ``budget_kind`` ("saved" or "peak") overrides that choice
    (a peak fraction is relative to the un-rematerialized step's peak). The plan is made on the
    first call (or now, from ``example_inputs``); an impossible budget raises
    BudgetInfeasibleError with the smallest feasible one. ``device`` picks the cost model.

    ``offload=True`` lets the planner also send saved activations to host memory over the
    device's host link where the transfer hides behind compute (``device`` must have one, e.g.
    "h100"; ``host_budget`` bounds the host bytes). On CUDA the step uses PyTorch's
    ``torch.ops.ao`` offload ops; on the CPU a copy stands in for the transfer, so a model on
    the CPU can be planned for an H100 and checked against eager.

    >>> import remat_pass
    >>> from remat_pass.examples import gpt_example, lm_loss
    >>> model, tokens, targets = gpt_example()
    >>> opt = remat_pass.optimize(model, budget=0.4)
    >>> lm_loss(opt(tokens), targets).backward()
    >>> opt.plan.kept_bytes <= 0.4 * opt.plan.keep_all_bytes
    True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize expects an nn.Module, got {type(model).__name__}")
    reject_wrapped_model(model)
    optimized = RematModule(
        model, budget, inner=inner, solver=solver, device=device, time_limit=time_limit,
        budget_kind=budget_kind, offload=offload, host_budget=host_budget, **solver_options,
    )
    if example_inputs is not None:
        if not isinstance(example_inputs, tuple):
            example_inputs = (example_inputs,)
        optimized.plan_ahead(*example_inputs)
    return optimized
