"""Measured op costs (``costs="measure"``): time each forward op of a joint graph on its device.

The roofline (``costs``) ranks ops by published peaks; what an op really costs depends on the
kernel, the shapes, the cache and the dispatcher. Here the joint graph's forward runs once on
the step's real inputs (the tensors dynamo compiled the graph for: parameters, buffers, the
batch), node by node, and each op is timed in isolation with enough repeats to beat the timer:
a warm-up call gives the value the next nodes read, a calibration call sizes a block to about
``BLOCK_SECONDS``, and the op's time is the fastest of ``BLOCKS`` blocks per call (wall clock
on the CPU; CUDA events between synchronizations on a GPU): timeit's rule, as slower blocks
measure other processes, not the op, and on a shared machine the median moved plans between runs.
An op runs with its inputs in cache, as it rarely does when backward recomputes it: measured
prices are a lower bound (benchmarks/RESULTS.md, "Cost models", compares them with real steps). Views and ``getitem`` cost 0, as in
the roofline; a dropout output that backward rebuilds from its mask is priced as that rebuild
(``input * mask * scale``). Collectives are not run (one rank alone would wait forever): their
outputs are stand-ins and their price stays the link model's.

Nothing is left behind: gradients are off, autocast is off (the graph has its casts already),
ops that write into an argument get a copy, the random-number generators of the CPU and of the
step's device come back as they were, and each value is freed after its last forward reader.
Where measuring cannot run (meta or fake tensors, as ``plan()`` traces with; an input the graph
does not map to a real tensor; an op that fails on real data) the roofline prices the graph and
a warning says why.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import time
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten, tree_map

from .collectives import is_collective
from ..compat import real_tensors
from .dropout_replay import dropout_replay_sources, order_dropout_masks, replay

logger = logging.getLogger(__name__)

BLOCKS = 5  # timed blocks per op; the fastest is kept
BLOCK_SECONDS = 4e-4  # about this long per block (a dispatch is ~5 us, perf_counter ~0.1 us)
MAX_CALLS = 200  # calls per block at most


class Unmeasurable(Exception):
    """This graph cannot be timed on real data; the message says why."""


def measure_forward_ops(graph: fx.Graph, step_inputs: Any, backward: set[fx.Node]) -> dict[fx.Node, float]:
    """Seconds per call of every forward node of ``graph`` (all nodes not in ``backward``),
    run on ``step_inputs`` (``capture.StepInputs``); views and getitems are 0, collectives absent.

    Raises ``Unmeasurable`` where the real inputs are missing or not real tensors.
    """
    env = {**_real_primals(graph, step_inputs, backward), **_constants(graph, backward)}
    device = _device_of(env.values())
    order_dropout_masks(graph)  # as annotate does: a mask is known by the time its output is rebuilt
    forward = [n for n in graph.nodes if n.op == "call_function" and n not in backward]
    reads = {node: [*node.all_input_nodes, *(dropout_replay_sources(node) or ())] for node in forward}
    last_read = {source: node for node in forward for source in reads[node]}
    started = time.perf_counter()
    seconds: dict[fx.Node, float] = {}
    with isolated(device):
        for node in forward:
            seconds[node], env[node] = _run(node, env, device)
            replay = dropout_replay_sources(node)
            if replay is not None:
                seconds[node] = _replay_seconds(node, replay, env, device)
            for done in (*reads[node], node):  # free what no later forward node reads
                if last_read.get(done, node) is node:
                    env.pop(done, None)
    logger.info("measured %d forward ops on %s in %.2fs (their sum: %.3f ms)", len(forward), device,
                time.perf_counter() - started, sum(seconds.values()) * 1e3)
    return {node: s for node, s in seconds.items() if not is_collective(node)}


def _real_primals(graph: fx.Graph, step_inputs: Any, backward: set[fx.Node]) -> dict[fx.Node, Any]:
    """The real value of every forward placeholder, by AOTAutograd's input descriptors."""
    inputs = step_inputs.inputs() if step_inputs is not None else None
    if inputs is None:
        raise Unmeasurable("the step's real inputs are not available (only a graph dynamo is compiling has them)")
    primals = [n for n in graph.find_nodes(op="placeholder") if n not in backward]
    env: dict[fx.Node, Any] = {}
    for position, node in enumerate(primals):
        desc = node.meta.get("desc")
        kind = type(desc).__name__
        if desc is None and len(primals) == len(inputs):  # older torch: no descriptors, one to one
            value = inputs[position]
        elif kind == "PlainAOTInput" and desc.idx < len(inputs):
            value = inputs[desc.idx]
        elif kind in ("ParamAOTInput", "BufferAOTInput"):
            value = step_inputs.attribute(desc.target)
        else:
            raise Unmeasurable(f"no real value for graph input {node.name} ({desc})")
        env[node] = _checked(node, value)
    return env


def _constants(graph: fx.Graph, backward: set[fx.Node]) -> dict[fx.Node, Any]:
    """The real value of every constant the forward reads: a ``get_attr`` of the graph's module (a tensor
    the trace lifted, as ``torch.tensor(...)`` in a forward becomes)."""
    found: dict[fx.Node, Any] = {}
    for node in graph.find_nodes(op="get_attr"):
        if node in backward:
            continue
        try:
            found[node] = _checked(node, operator.attrgetter(node.target)(graph.owning_module))
        except AttributeError as error:  # no owning module, or not on it
            raise Unmeasurable(f"no value for the graph's constant {node.target}") from error
    return found


def _checked(node: fx.Node, value: Any) -> Any:
    fake = node.meta.get("val")
    if not isinstance(fake, torch.Tensor):
        return value
    if isinstance(value, FakeTensor):
        raise Unmeasurable("the step was traced with fake tensors (as plan() does for meta ones): there is nothing "
                           "to time")
    if not isinstance(value, torch.Tensor) or type(value) not in (torch.Tensor, torch.nn.Parameter):
        raise Unmeasurable(f"graph input {node.name} is a {type(value).__name__}, not a plain tensor")
    if value.device.type == "meta":
        raise Unmeasurable("the step's tensors are on the meta device: there is nothing to time")
    sizes_differ = value.dim() != fake.dim() or any(
        isinstance(f, int) and f != v for f, v in zip(fake.shape, value.shape))  # symbolic sizes: not compared
    if sizes_differ or value.dtype != fake.dtype:
        raise Unmeasurable(f"graph input {node.name} maps to a {tuple(value.shape)} {value.dtype} tensor, "
                           f"the graph expects {tuple(fake.shape)} {fake.dtype}")
    return value


def _device_of(values: Iterable[Any]) -> torch.device:
    for value in values:
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            if value.device.type != "cuda":
                raise Unmeasurable(f"op timing supports CPU and CUDA tensors, not {value.device.type}")
            return value.device
    return torch.device("cpu")


@contextlib.contextmanager
def isolated(device: torch.device) -> Iterator[None]:
    """No autograd, no autocast, no fake mode; the RNG of the CPU and of ``device`` restored
    (also for ``scratch``, which runs ops on random inputs)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(real_tensors())
        stack.enter_context(torch.no_grad())
        stack.enter_context(torch.random.fork_rng(devices=[device] if device.type == "cuda" else []))
        for kind in {"cpu", device.type}:
            stack.enter_context(torch.autocast(kind, enabled=False))
        if device.type == "cuda":  # events and synchronize act on the current device: make it the step's
            stack.enter_context(torch.cuda.device(device))
        yield


def _run(node: fx.Node, env: dict[fx.Node, Any], device: torch.device) -> tuple[float, Any]:
    """(seconds per call, the node's value)."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
    if is_collective(node):  # a stand-in of the right shape: one rank alone must not communicate
        return 0.0, tree_map(_stand_in, node.meta.get("val"))
    call = _call(node.target, args, kwargs)
    value = call()
    if _free(node, value, args):
        return 0.0, value
    return _seconds_per_call(call, device), value


def _call(target: Any, args: Any, kwargs: Any) -> Callable[[], Any]:
    """``target(*args, **kwargs)``; an op that writes into an argument writes into a copy."""
    schema = getattr(target, "_schema", None)
    if schema is not None and schema.is_mutable:
        args, kwargs = tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, (args, kwargs))
    return lambda: target(*args, **kwargs)


def _free(node: fx.Node, value: Any, args: Any) -> bool:
    """getitem, and views of an argument: no data moves (the roofline prices them at 0 too)."""
    if node.target is operator.getitem:
        return True
    outputs = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    inputs = {t.untyped_storage().data_ptr() for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)}
    return bool(outputs) and all(t.untyped_storage().data_ptr() in inputs for t in outputs)


def _stand_in(fake: Any) -> Any:
    if not isinstance(fake, torch.Tensor):
        return fake
    return torch.zeros(fake.shape, dtype=fake.dtype, device=fake.device)


def _replay_seconds(node: fx.Node, sources: tuple[fx.Node, fx.Node], env: dict[fx.Node, Any],
                    device: torch.device) -> float:
    """What backward pays to rebuild a dropout output from its mask (``dropout_replay.replay``)."""
    source, mask = env[sources[0]], env[sources[1]]
    probability = node.args[0].args[1]  # type: ignore[union-attr]
    return _seconds_per_call(lambda: replay(source, mask, probability), device)


def _seconds_per_call(call: Callable[[], Any], device: torch.device) -> float:
    clock = _cuda_block if device.type == "cuda" else _cpu_block
    calls = max(1, min(MAX_CALLS, int(BLOCK_SECONDS / max(clock(call, 1), 1e-9))))
    return min(clock(call, calls) / calls for _ in range(BLOCKS))


def _cpu_block(call: Callable[[], Any], calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        call()
    return time.perf_counter() - started


def _cuda_block(call: Callable[[], Any], calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def measured_seconds(graph: fx.Graph, step_inputs: Any, backward: set[fx.Node]) -> dict[fx.Node, float]:
    """``measure_forward_ops``, or {} (the roofline prices the graph) with a warning saying why
    measuring could not run."""
    try:
        return measure_forward_ops(graph, step_inputs, backward)
    except Unmeasurable as error:
        reason = str(error)
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as error:  # an op refused real data
        reason = f"running the forward failed: {type(error).__name__}: {error}"
    logger.warning("costs='measure': %s; pricing this graph with the device's roofline instead", reason)
    return {}
