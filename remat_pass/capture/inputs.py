"""Example inputs as a call: positional arguments and keyword arguments, in one canonical form.

Models are called both ways: ``model(tokens)`` and ``model(**batch)`` (a Hugging Face batch is a
dict of keyword arguments). Every front door that takes example inputs accepts:

* ``example_inputs``: a tuple (or list) of positional arguments, one tensor, or a mapping of
  keyword arguments (a dict, a Hugging Face ``BatchEncoding``);
* ``example_kwargs``: keyword arguments added to positional ``example_inputs``.

A model whose forward takes a dict as its one positional argument gets it as
``example_inputs=(batch,)``: a bare mapping always means keywords.

Dynamo specializes a compiled frame on how it was called: ``model(x)`` and ``model(input_ids=x)``
are two graphs (two captures, two plans) although forward receives the same values. ``canonical``
binds a call to forward's signature and returns one form for both (parameters that can be given
by position, by position, up to the first one not given; the rest by keyword), so that a plan
made ahead of time is the plan the first training call runs.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

__all__ = ["CallInputs", "call_inputs", "canonical", "forward_signature"]


@dataclass(frozen=True)
class CallInputs:
    """One call's arguments: ``module(*args, **kwargs)``."""

    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def flat(self) -> tuple[Any, ...]:
        """Every argument, positional then keyword (for finding tensors and devices)."""
        return (*self.args, *self.kwargs.values())


def call_inputs(example_inputs: Any = None, example_kwargs: Mapping[str, Any] | None = None) -> CallInputs:
    """Normalize the ``example_inputs=`` / ``example_kwargs=`` pair every front door accepts.

    >>> call_inputs({"input_ids": 1}).kwargs, call_inputs((1, 2)).args, call_inputs(1, {"mask": 0})
    ({'input_ids': 1}, (1, 2), CallInputs(args=(1,), kwargs={'mask': 0}))
    """
    if example_kwargs is not None and not isinstance(example_kwargs, Mapping):
        raise TypeError(f"example_kwargs must be a mapping of keyword arguments, got {type(example_kwargs).__name__}")
    kwargs = dict(example_kwargs or {})
    if example_inputs is None:
        return CallInputs((), kwargs)
    if isinstance(example_inputs, Mapping):
        _check_keys(example_inputs)
        overlap = sorted(set(example_inputs) & set(kwargs))
        if overlap:
            raise TypeError(f"keyword inputs given twice, in example_inputs and example_kwargs: {overlap}")
        return CallInputs((), {**example_inputs, **kwargs})
    if isinstance(example_inputs, (tuple, list)):
        return CallInputs(tuple(example_inputs), kwargs)
    return CallInputs((example_inputs,), kwargs)


def _check_keys(mapping: Mapping[Any, Any]) -> None:
    bad = [key for key in mapping if not isinstance(key, str)]
    if bad:
        raise TypeError(
            f"a mapping as example_inputs is read as keyword arguments, but it has non-string keys {bad[:3]}; "
            "to pass a dict as the one positional argument, write example_inputs=(batch,)"
        )


def forward_signature(forward: Callable[..., Any]) -> inspect.Signature | None:
    """forward's signature (through ``functools.wraps`` decorators), or None if it has none."""
    try:
        return inspect.signature(forward)
    except (TypeError, ValueError):
        return None


def canonical(signature: inspect.Signature | None, args: tuple[Any, ...],
              kwargs: Mapping[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The same call in one form, whichever way the caller split it between positions and keywords.

    A call that does not bind (a wrong keyword) is returned as given, so that the model raises
    its own error.

    A call with positional arguments only is already in that form (binding adds no defaults and
    moves nothing): it is returned without binding, which a training step pays on every call.
    """
    if signature is None or not kwargs:
        return tuple(args), dict(kwargs)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return args, dict(kwargs)
    return bound.args, bound.kwargs
