"""Every private or version-dependent torch API remat_pass relies on, in one place.

torch's public surface does not cover what a graph pass needs (symbolic sizes, AOTAutograd's
partitioner helpers, boxed FX codegen, profiler allocator events, fake tensors), so these come
from private modules that move between releases: a new torch is checked in this one file, and each
shim says what it guards. Tested on torch 2.13 (CPU); GPU machines may run 2.11, hence the fallbacks.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import sys
from typing import Any, Callable, Iterator, Sequence, TypeVar

import torch
from torch import fx
# Inductor's base class for a graph pass with a cache identity (``uuid()``), and its hash of source files:
# ``capture.late_addmm`` is one, set as ``post_grad_custom_post_pass`` (both in torch since before 2.6).
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

logger = logging.getLogger(__name__)

T = TypeVar("T")

# --- symbolic sizes ---------------------------------------------------------------------------


def is_symbolic(val: Any) -> bool:
    """True for a scalar graph value (a SymInt/SymFloat/SymBool or a plain number), not a tensor."""
    return isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


def concrete_int(x: Any) -> int:
    """An int for a possibly symbolic size: its hint, without adding a guard.

    A data-dependent size (``h[h > 0]``, ``nonzero``) has no hint: take the upper bound dynamo
    proved for it (e.g. every element selected), so that a plan's bytes are never under-counted
    and the budget still holds; 0 only when no usable bound exists.
    """
    if isinstance(x, torch.SymInt):
        hint = x.node.hint  # private: SymNode.hint
        return int(hint) if hint is not None else _upper_bound(x)
    return int(x)


def _upper_bound(x: torch.SymInt) -> int:
    try:
        upper = x.node.shape_env.bound_sympy(x.node.expr).upper
        if upper.is_finite and int(upper) < 2**48:
            return int(upper)
    except Exception as error:  # no shape env or an expression it cannot bound
        logger.debug("no upper bound for %s: %s", x, error)
    logger.warning("data-dependent size %s has no usable upper bound; planning counts it as 0 bytes", x)
    return 0


# --- dynamo -----------------------------------------------------------------------------------


def recompile_limit_errors() -> tuple[type[BaseException], ...]:
    """What dynamo raises when it gives up recompiling; empty in older torch, which raises nothing."""
    import torch._dynamo.exc

    error = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", None)
    return (error,) if error is not None else ()


def forget_compiled(fn: Any) -> None:
    """Drop dynamo's compiled entries for ``fn``'s code (``torch._dynamo.reset_code``), so that tracing it
    again and again (a new wrapper each time) never reaches the recompile limit; a no-op where torch lacks it."""
    reset = getattr(torch._dynamo, "reset_code", None)
    if reset is not None:
        reset(fn.__code__)


def recompile_limit() -> int:
    """dynamo's recompile limit (``recompile_limit``; ``cache_size_limit`` before torch 2.6)."""
    import torch._dynamo.config as config

    return getattr(config, "recompile_limit", None) or config.cache_size_limit


_SIDE_EFFECTS_FLAG = "skip_fwd_side_effects_in_bwd_under_checkpoint"


@contextlib.contextmanager
def capture_config() -> Iterator[None]:
    """Dynamo's settings while remat_pass captures a step as one graph (every training call: the closure
    patcher, as ``config.patch`` costs ~50 us, 2% of a small step).

    ``skip_fwd_side_effects_in_bwd_under_checkpoint``: dynamo breaks the graph at a checkpoint region
    whose forward mutates outside state, which eager replays in backward; remat_pass recomputes graph ops
    only, so side effects run once anyway (transformers 5.2x's hub-kernel wrapper sets a context
    variable in every attention forward: each ``gradient_checkpointing_enable()`` layer was a break).
    Hugging Face's ``Logger.warning_once`` (transformers sets it on ``logging.Logger``) is ignored: dynamo
    cannot trace a logger call, and GPT-2 given ``labels`` makes this one in forward (its ``loss_type`` is
    unset), so ``optimize`` refused it. Its message is not printed then, as under ``torch.export``.
    """
    import torch._dynamo.config as config
    changes: dict[str, Any] = {}
    if getattr(config, _SIDE_EFFECTS_FLAG, True) is False:  # each read of the config costs ~1.4 us
        changes[_SIDE_EFFECTS_FLAG] = True
    name = _ignored_logging_setting(config)
    once, ignored = getattr(logging.Logger, "warning_once", None), getattr(config, name, None)
    if once is not None and isinstance(ignored, set) and once not in ignored:
        changes[name] = ignored | {once}
    patcher = _patcher(config, changes) if changes else None
    revert = patcher() if patcher is not None else None
    with config.patch(**changes) if changes and revert is None else contextlib.nullcontext():
        try:
            yield
        finally:
            if revert is not None:
                revert()


@functools.cache
def _ignored_logging_setting(config: Any) -> str:  # ``ignore_logger_methods`` in older torch
    return next((n for n in ("ignore_logging_functions", "ignore_logger_methods") if hasattr(config, n)), "")


_PATCHERS: dict[tuple[int, frozenset[Any]], Callable[[], Callable[[], None]] | None] = {}


def _patcher(config: Any, changes: dict[str, Any]) -> Callable[[], Callable[[], None]] | None:
    """The config's closure patcher making ``changes`` (one per distinct change); None if torch has none."""
    key = (id(config), frozenset((k, frozenset(v) if isinstance(v, set) else v) for k, v in changes.items()))
    if key not in _PATCHERS:
        make = getattr(config, "_make_closure_patcher", None)
        _PATCHERS[key] = make(**changes) if make is not None else None
    return _PATCHERS[key]


def compiling_frame() -> int | None:
    """The id of the frame dynamo is compiling now (``CompileId.frame_id``, private): the same for every
    recompile of one frame (new shapes, eval), another for a graph break's resume; None if unknown."""
    try:
        from torch._guards import CompileContext

        return getattr(CompileContext.current_compile_id(), "frame_id", None)
    except Exception:  # noqa: BLE001
        return None


def last_recompile_reason() -> str | None:
    """The first failed guard of dynamo's latest frame compile (None for a first compile).

    From ``torch._dynamo.utils.get_compilation_metrics`` (private; torch 2.4 to 2.13). Optional
    diagnostics: any failure to read it gives None, never an error in a training step.
    """
    try:
        from torch._dynamo.utils import get_compilation_metrics

        for metrics in reversed(get_compilation_metrics()):
            if getattr(metrics, "is_forward", True) is False:
                continue  # a backward compile: no guards
            return getattr(metrics, "recompile_reason", None)
    except Exception:  # noqa: BLE001
        logger.debug("could not read dynamo's recompile reason", exc_info=True)
    return None


# --- FX and AOTAutograd -----------------------------------------------------------------------


def use_boxed_codegen(gm: fx.GraphModule) -> None:
    """Generate ``gm``'s code to take its arguments as one list it clears (boxed calling), so
    the graph can drop each argument after its last use."""
    from torch.fx.graph import _BoxedCodeGen

    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()


def graph_module(root: torch.nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule of ``graph``, lazy where AOTAutograd made its own lazy (inside its compile):
    its Python code is generated only if it is called or read, not on construction (0.13-0.2 s
    for a 12-layer GPT-2's joint graph, which the rewrite copies and never runs)."""
    try:
        from torch.fx._lazy_graph_module import _make_graph_module
    except ImportError:  # older torch: always eager
        return fx.GraphModule(root, graph)
    return _make_graph_module(root, graph)


try:  # Inductor type-checks custom partitioners against this base class (torch >= 2.9)
    from torch._inductor.custom_graph_pass import CustomPartitionerFn as PartitionerBase
except ImportError:  # older torch: no custom partitioner support at all (see has_custom_partitioner)
    PartitionerBase = object  # type: ignore[misc,assignment]


def is_view_op(node: fx.Node) -> bool:
    """Whether ``node`` is an aten op whose output aliases its input (``OpOverload.is_view``): no kernel, no buffer."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target.is_view


def inductor_cache_dir() -> str:
    """Where Inductor keeps its kernels (``TORCHINDUCTOR_CACHE_DIR`` or its default), to name in an error."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        return os.environ.get("TORCHINDUCTOR_CACHE_DIR", "its cache directory")
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()  # cache_dir() would create it


def dynamo_disabled() -> bool:
    """Whether dynamo is off: ``TORCHDYNAMO_DISABLE=1`` (``torch.compile`` reads it) or ``config.disable``."""
    return os.environ.get("TORCHDYNAMO_DISABLE") == "1" or bool(getattr(torch._dynamo.config, "disable", False))


def caching_precompile() -> bool:
    """Whether torch's precompile is on (``TORCH_CACHING_PRECOMPILE=1``)."""
    return bool(getattr(torch._dynamo.config, "caching_precompile", False))


def aot_cache_bundles_graphs() -> bool:
    """Whether AOTAutograd's cache bundles compiled graphs (``bundled_autograd_cache``, or precompile)."""
    return caching_precompile() or bool(getattr(torch._functorch.config, "bundled_autograd_cache", False))


def _starts_with(prefixes: tuple[str, ...], name: str) -> bool:
    return name.startswith(prefixes)


def _is_among(names: tuple[str, ...], name: str) -> bool:
    return name in names


def storable_graph_compiler(compile_graph: Callable[[fx.GraphModule], fx.GraphModule],
                            ops: tuple[str, ...], metadata: tuple[str, ...]) -> Any:
    """An AOTAutograd forward/backward compiler returning ``compile_graph(gm)`` in the shape
    AOTAutograd's cache stores (``SerializableAOTDispatchCompiler`` of ``RegionalOutputCode``: the
    GraphModule itself, pickled with torch's ``GraphPickler``), which pickles the ops whose names
    start with one of ``ops`` (another bypasses the cache) and the nodes' ``metadata`` keys only;
    None where this torch has no such compiler."""
    try:
        from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler
        from torch._inductor.output_code import RegionalOutputCode
    except ImportError:
        return None
    if not {"ops_filter", "node_metadata_key_filter"} <= set(inspect.signature(RegionalOutputCode).parameters):
        return None

    def compile_(gm: fx.GraphModule, _inputs: Sequence[Any]) -> Any:
        # The filters are pickled with the entry: module-level functions, not closures.
        return RegionalOutputCode(compile_graph(gm), ops_filter=functools.partial(_starts_with, ops),
                                  node_metadata_key_filter=functools.partial(_is_among, metadata))

    return SerializableAOTDispatchCompiler(RegionalOutputCode, compile_)


def precompile_source_id(fn: Callable[..., Any]) -> str:
    """The key torch's precompile stores a function under (``CompilePackage.source_id_from_fn``), else its name."""
    try:
        from torch._dynamo.package import CompilePackage
    except ImportError:
        return getattr(fn, "__qualname__", repr(fn))
    return CompilePackage.source_id_from_fn(fn)


def precompile_artifact(backend_id: str) -> Any:
    """The compiled program torch's precompile (``torch._dynamo.config.caching_precompile``, torch
    2.9+) holds for the Dynamo graph ``backend_id`` (``gm._backend_id``), to be saved by
    ``torch.compiler.save_cache_artifacts()``; None where nothing is held or this torch has no precompile."""
    try:
        from torch._dynamo.precompile_context import PrecompileContext
    except ImportError:
        return None
    return PrecompileContext.serialize_artifact_by_key(backend_id)


def hold_precompile_artifact(backend_id: str, artifact: Any) -> None:
    """Make ``artifact`` (from ``precompile_artifact``) the program precompile saves for ``backend_id``;
    None withdraws the graph from it (torch then logs "Backend not found" at the save, and a restarted
    process traces that graph again). torch has no public withdrawal: its artifact table is used."""
    try:
        from torch._dynamo.precompile_context import PrecompileContext
    except ImportError:
        return
    if artifact is not None:
        PrecompileContext.record_artifact(artifact)
    else:
        PrecompileContext._backend_artifacts_by_key.pop(backend_id, None)


def has_custom_partitioner() -> bool:
    """Whether Inductor accepts ``custom_partitioner_fn`` (needed for ``inner="inductor"``)."""
    from torch._inductor import config as inductor_config

    return hasattr(inductor_config, "custom_partitioner_fn")


def backward_compiled_with_forward() -> Any:
    """A context in which AOTAutograd compiles the backward graph with the forward, not lazily at
    the first backward (``torch._functorch.config.force_non_lazy_backward_lowering``): a step run
    inside a backend's compile (``runtime.inductor_fit`` measures one) cannot compile there."""
    import torch._functorch.config as functorch_config

    if not hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        return contextlib.nullcontext()
    return functorch_config.patch(force_non_lazy_backward_lowering=True)


def extract_fwd_bwd_modules(joint_module: fx.GraphModule, saved_values: Sequence[fx.Node],
                            saved_symbols: Sequence[fx.Node], num_fwd_outputs: int,
                            static_lifetime_input_indices: Sequence[int] | None = None,
                            ) -> tuple[fx.GraphModule, fx.GraphModule]:
    """AOTAutograd's own forward/backward extraction, with the arguments this torch accepts."""
    from torch._functorch import partitioners

    extract = partitioners._extract_fwd_bwd_modules
    accepted = inspect.signature(extract).parameters
    kwargs: dict[str, Any] = {"num_fwd_outputs": num_fwd_outputs}
    if "static_lifetime_input_nodes" in accepted and static_lifetime_input_indices is not None:
        from torch.utils._ordered_set import OrderedSet

        placeholders = joint_module.graph.find_nodes(op="placeholder")
        kwargs["static_lifetime_input_nodes"] = OrderedSet(placeholders[i] for i in static_lifetime_input_indices)
    return extract(joint_module, list(saved_values), list(saved_symbols), **kwargs)


def donated_buffers_scope() -> contextlib.AbstractContextManager[Any]:
    """A scope at whose end AOTAutograd's donated-buffer setting (private ``torch._functorch.config.donated_buffer``;
    absent: no-op) is back to what it was, so that ``stop_donating_buffers`` inside it lasts one compile."""
    config = torch._functorch.config
    return config.patch(donated_buffer=config.donated_buffer) if hasattr(config, "donated_buffer") else contextlib.nullcontext()


def stop_donating_buffers() -> None:
    """No donated buffers from here: AOTAutograd reads the setting just after its partitioner returns."""
    if hasattr(torch._functorch.config, "donated_buffer"):
        torch._functorch.config.donated_buffer = False


# --- fake tensors -----------------------------------------------------------------------------


def is_fake(tensor: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def fake_tensor_mode(**options: Any) -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(**options)


def real_tensors() -> Any:
    """A context in which tensors are real even inside a fake-tensor trace (for probes that must
    run a kernel, e.g. ``dropout_replay.replay_is_exact``)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


@contextlib.contextmanager
def autograd_inside_kernel() -> Iterator[None]:
    """Autograd usable inside a custom op's kernel (``chunked_loss_op``'s backward recomputes a
    chunk under autograd): the kernel runs below the autograd dispatch key with grad mode off,
    so both are restored here for its body only."""
    from torch._C import DispatchKey, DispatchKeySet

    exclude = torch._C._dispatch_tls_local_exclude_set() - DispatchKeySet(DispatchKey.AutogradFunctionality)
    with torch.enable_grad(), torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
        yield


# --- profiler ---------------------------------------------------------------------------------


@contextlib.contextmanager
def quiet_profiler_switch() -> Iterator[None]:
    """Descriptor 2 at the null device meanwhile: torch 2.13's kineto writes "USDT: ..." there at each
    profiler start and stop (~80 lines on a GPT-2's first call); a user who set ``KINETO_LOG_LEVEL`` sees it."""
    if "KINETO_LOG_LEVEL" in os.environ:
        yield
        return
    try:
        saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    except OSError:
        yield
        return
    if sys.stderr is not None:
        sys.stderr.flush()  # Python's own pending text goes out before the descriptor moves
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


@contextlib.contextmanager
def running_quietly(prof: Any) -> Iterator[Any]:
    """``with prof:`` for a ``torch.profiler.profile``, its start and stop silenced
    (``quiet_profiler_switch``); what runs inside writes to stderr as usual."""
    with quiet_profiler_switch():
        prof.start()
    try:
        yield prof
    finally:
        with quiet_profiler_switch():
            prof.stop()


def allocator_events(prof: Any, device_type: str) -> list[tuple[int, int, int]]:
    """(time ns, address, signed bytes) of the allocator events ``prof`` recorded on ``device_type``.

    ``prof``: a finished ``torch.profiler.profile(profile_memory=True)``; events from its tree (private:
    ``experimental_event_tree``), one timestamp's in tree pre-order (the order they happened in).
    """
    from torch._C._profiler import _EventType

    found: list[tuple[int, int, int, int]] = []
    stack = list(reversed(prof.profiler.kineto_results.experimental_event_tree()))
    order = 0
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            if fields.device.type == device_type:
                found.append((event.start_time_ns, order, fields.ptr, fields.alloc_size))
            order += 1
        stack.extend(reversed(event.children))
    found.sort()
    return [(t, ptr, size) for t, _, ptr, size in found]


_CUDA_TRACE_ENTRIES = 10_000_000  # the allocator's history ring; a step makes far fewer events


def cuda_allocator_events(fn: Callable[[], T], device: torch.device) -> tuple[T, list[tuple[int, int, int]]]:
    """``fn()``'s result and the CUDA allocator's (index, address, signed bytes) events on ``device``.

    The profiler's event tree misses frees made on autograd's CUDA thread (on an H200 it put eager's
    peak at 1.75x ``max_memory_allocated``), so the allocator's history is read (private:
    ``torch.cuda.memory._record_memory_history``, ``_snapshot``): a block counts when allocated and when
    its free completes; frees of blocks allocated before the call are left out (the timeline starts at 0).

    Recording is on for the call and off after it, unless the user's own was on (``_cuda_history_enabled``):
    it stays on then, with torch's default tracebacks and a ring of ``_CUDA_TRACE_ENTRIES``.
    """
    from torch.cuda import memory as cuda_memory

    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.synchronize(device)
    users_recording = _cuda_history_enabled()
    cuda_memory._record_memory_history(enabled="all", context=None, stacks="python",
                                       max_entries=_CUDA_TRACE_ENTRIES)
    try:
        start = len(cuda_memory._snapshot()["device_traces"][index])
        result = fn()
        torch.cuda.synchronize(device)
        trace = cuda_memory._snapshot()["device_traces"][index][start:]
    finally:
        if users_recording:
            cuda_memory._record_memory_history(enabled="all", context="all", stacks="all",
                                               max_entries=_CUDA_TRACE_ENTRIES)
        else:
            cuda_memory._record_memory_history(enabled=None)
    return result, _allocator_trace_events(trace)


def _cuda_history_enabled() -> bool:
    """Whether the CUDA allocator is recording its history (private: the check inductor's
    cudagraph trees make, ``torch._C._cuda_isHistoryEnabled``); False where torch lacks it."""
    query = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    return bool(query()) if query is not None else False


def _allocator_trace_events(trace: list[dict[str, Any]]) -> list[tuple[int, int, int]]:
    live: set[int] = set()
    events = []
    for position, entry in enumerate(trace):
        action, address, size = entry.get("action"), entry.get("addr"), int(entry.get("size", 0))
        if action == "alloc":
            live.add(address)
            events.append((position, address, size))
        elif action == "free_completed" and address in live:
            live.discard(address)
            events.append((position, address, -size))
    return events


__all__ = [
    "allocator_events", "aot_cache_bundles_graphs", "autograd_inside_kernel", "capture_config", "compiling_frame",
    "concrete_int", "cuda_allocator_events", "CustomGraphPass", "donated_buffers_scope", "dynamo_disabled",
    "extract_fwd_bwd_modules", "fake_tensor_mode", "forget_compiled", "get_hash_for_files",
    "has_custom_partitioner", "inductor_cache_dir", "is_fake", "is_symbolic", "is_view_op", "PartitionerBase",
    "real_tensors", "recompile_limit", "recompile_limit_errors", "stop_donating_buffers", "storable_graph_compiler",
    "use_boxed_codegen",
]
