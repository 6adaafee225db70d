"""A plan's cache key made before tracing: what the traced step could depend on, without tracing it.

``plan()``, ``plan_with_report()`` and ``explain()`` return data and run nothing, so a repeated
call can be answered from the plan cache before Dynamo and AOTAutograd run (they are most of a
cached re-plan's seconds: benchmarks/SCALING.md). The plan cache's own key is the traced
``Problem``, which needs the trace; this key stands in for it and must miss whenever the traced
graph could differ. It is a SHA-256 of

* the call's arguments as the front door normalised them (budget, solver, cost model and the
  whole device-profile table, time limit, proof work, offload, chunk_loss, depth, ...) and the
  plan cache's planning inputs' versions: remat_pass, torch, the digest of remat_pass's source
  (``plan_cache.code_digest``);
* the model: every submodule's path, class (module and qualname) and ``training`` flag, every
  parameter's and buffer's name, shape, stride, dtype, device, ``requires_grad`` and which ones
  are the same tensor (tied weights), every other attribute (``vars(module)``: numbers, strings,
  a Hugging Face config's every attribute, functions, hooks), described recursively, but for
  attributes named like a hash (``_original_object_hash``: Python's per-process string hash);
* code: for every class in the MRO of every submodule type and for every function met above (a
  hook, an activation, ``loss_fn``), its code objects' bytecode, constants and names, and the
  whole source file that defines it (helpers beside a forward, such as Hugging Face's
  ``eager_attention_forward``), read once per file per process and again when its size or
  modification time changes; the ``__version__`` of every package those classes come from;
* the example inputs: each tensor's metadata as above and, for real tensors, its contents
  (token ids can steer a trace through data-dependent branches); other inputs described;
* the global state a trace reads: grad mode, inference mode, autocast per device type, the
  default dtype and device, deterministic algorithms, matmul precision, the
  ``torch.backends`` flags that pick kernels and decompositions (mkldnn, cuDNN, TF32, the SDPA
  backends), the Dynamo, AOTAutograd and Inductor configs (entry by entry: their ``get_hash``
  pickles sets in hash order, which differs per process), the active
  torch-function and dispatch modes, and the names of the CUDA devices the tensors are on.

What it cannot see (and a pre-trace hit would then return a stale plan): global Python state a
forward reads (a module-level flag or registry, such as ``ALL_ATTENTION_FUNCTIONS``, a function
defined in another file whose package has no ``__version__``, an environment variable), the
*values* of parameters and buffers (a forward that branches on them), an object attribute with no
``__dict__`` whose ``repr`` shows only its address (described by its type), a method of torch's or
the model's classes patched at run time under a construction or printing name (``__init__``,
``__repr__``, ...: Dynamo itself patches two of them while tracing, so they are left out), remat_pass's
own module-level settings changed at run time (its source is in the key, not its globals; the
``Problem``-keyed cache shares this for the planning settings), and kernel scratch measured again
after its store was deleted. Such a model should pass ``pretrace_key=False`` (the
trace then always runs; the ``Problem``-keyed cache still skips the solve) or ``plan_cache=False``.
A key cannot be made (None: the trace runs) for measured costs (``costs="measure"``: the plan is
re-priced with this run's timings, which needs the trace) or a tensor subclass (DTensor). Code
whose file cannot be read (typed at a prompt) is keyed by its code objects alone.

A hit returns what the traced call returned, stored whole (``PlanCache.put_traced``): the same
plan and problem, and the first call's measured forward time.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import inspect
import json
import logging
import os
import sys
import types
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

import torch
from torch import nn

from ..annotate.costs import DEVICE_PROFILES
from ..capture.inputs import CallInputs
from ..compat import is_fake
from ..runtime.plan_cache import PlanCache, canonical, planning_versions

logger = logging.getLogger(__name__)
T = TypeVar("T")

# How deep an attribute that is neither a module, a tensor nor a container is followed (a Hugging
# Face config holds sub-configs; deeper objects are described by type).
_DEPTH = 4
# A tensor held as a plain attribute or nested in an input up to this many elements has its values
# in the key (it may be traced as a constant); a larger one, its metadata only.
_CONSTANT_NUMEL = 4096


class Unkeyable(Exception):
    """Something the trace may depend on cannot be described: no pre-trace key, the trace runs."""


def before_tracing(entry: str, model: nn.Module, call: CallInputs, arguments: dict[str, Any],
                   cache: PlanCache | None, compute: Callable[[], T]) -> T:
    """``compute()`` (which traces and plans), unless ``cache`` holds its result under the
    pre-trace key; then that result, and nothing is traced. ``cache`` None: always compute."""
    key = trace_key(entry, model, call, arguments) if cache is not None else None
    if key is not None and (found := cache.get_traced(key)) is not None:
        return found
    result = compute()
    if key is not None:
        cache.put_traced(key, result)
    return result


def trace_key(entry: str, model: nn.Module, call: CallInputs, arguments: dict[str, Any]) -> str | None:
    """The pre-trace key of ``entry`` ("plan", "explain") planning ``model`` on ``call`` with
    ``arguments`` (the front door's normalised keyword arguments, ``loss_fn`` included), or None
    where one cannot be made (see the module)."""
    try:
        record = trace_record(entry, model, call, arguments)
    except Unkeyable as reason:
        logger.info("no pre-trace plan cache key (%s): tracing", reason)
        return None
    except Exception as error:  # an attribute whose repr or vars fails: no key, never a failed plan
        logger.warning("no pre-trace plan cache key (%s: %s): tracing", type(error).__name__, error)
        return None
    return hashlib.sha256(json.dumps(record, separators=(",", ":"), default=repr).encode()).hexdigest()


def trace_record(entry: str, model: nn.Module, call: CallInputs, arguments: dict[str, Any]) -> dict[str, Any]:
    """What ``trace_key`` hashes, JSON-ready; raises Unkeyable where no key can be made."""
    if arguments.get("costs") == "measure":
        raise Unkeyable('costs="measure": the plan is re-priced with timings the trace measures')
    describer = _Describer(model)
    record = {
        "entry": entry,
        "versions": planning_versions(),
        "arguments": describer.describe(arguments, 0),
        "device_profiles": canonical(DEVICE_PROFILES),
        "model": describer.model(),
        "inputs": [describer.tensor_or_value(x, contents=True) for x in call.flat()],
        "input_names": [len(call.args), list(call.kwargs)],
        "state": _global_state(list(_tensors(model, call.flat())), describer),
    }
    record["code"] = describer.code()
    return record


def _tensors(model: nn.Module, inputs: Iterable[Any]) -> Iterable[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()
    yield from (x for x in inputs if isinstance(x, torch.Tensor))


# --- the model and its attributes -------------------------------------------------------------


_HOOKS = "hook"  # vars(module) entries naming hooks: their values, not their handle ids, count
# Described on their own (the first five), or bookkeeping a trace leaves behind: Dynamo marks a
# module it compiled with ``_is_torch_compile`` (read only for a torch.compile nested in another),
# which would make the call after the first trace miss.
_SKIP = frozenset({"_parameters", "_buffers", "_modules", "training", "_non_persistent_buffers_set",
                   "_is_torch_compile"})


class _Describer:
    """Describes one call's model and arguments as JSON-ready data; collects the code it meets."""

    def __init__(self, model: nn.Module) -> None:
        self.root = model
        self.paths = {id(module): path for path, module in model.named_modules(remove_duplicate=False)}
        self.tensor_ids: dict[int, int] = {}
        self.classes: dict[type, None] = {}
        self.functions: dict[types.CodeType, None] = {}
        self.seen: dict[int, int] = {}

    def model(self) -> list[Any]:
        rows = []
        for path, module in self.root.named_modules(remove_duplicate=False):
            self.classes[type(module)] = None
            attributes = {name: self.describe(list(value.values()) if _HOOKS in name and isinstance(value, dict)
                                              else value, 0)
                          for name, value in vars(module).items() if name not in _SKIP and not _derived(name)}
            rows.append([path, _qualname(type(module)), module.training,
                         [[name, self.tensor_or_value(p)] for name, p in module._parameters.items()],
                         [[name, self.tensor_or_value(b), name in module._non_persistent_buffers_set]
                          for name, b in module._buffers.items()],
                         sorted(attributes.items())])
        return rows

    def tensor_or_value(self, value: Any, contents: bool = False) -> Any:
        """A tensor's metadata (and, with ``contents``, a digest of a real one's values: inputs only,
        since parameters are large and a trace does not branch on them), else ``describe``."""
        if not isinstance(value, torch.Tensor):
            return self.describe(value, 0)
        first = self.tensor_ids.setdefault(id(value), len(self.tensor_ids))  # tied weights: the same index
        return ["tensor", first, *_tensor_meta(value), _contents(value) if contents else None]

    def describe(self, value: Any, depth: int) -> Any:
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            return repr(value)
        if isinstance(value, enum.Enum):
            return ["enum", _qualname(type(value)), self.describe(value.value, depth)]
        if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format, torch.Size)):
            return repr(value)
        if isinstance(value, torch.Tensor):  # a plain tensor attribute or a nested input: a constant if small
            return self.tensor_or_value(value, contents=value.numel() <= _CONSTANT_NUMEL)
        if isinstance(value, nn.Module):
            if id(value) in self.paths:
                return ["module", self.paths[id(value)]]
            self.classes[type(value)] = None  # one outside the model (a loss_fn's): its tensors and mode
            return ["module", _qualname(type(value)), value.training,
                    [[name, self.tensor_or_value(t)] for name, t in (*value.named_parameters(), *value.named_buffers())]]
        if isinstance(value, (list, tuple)):
            return [type(value).__name__, [self.describe(v, depth) for v in value]]
        if isinstance(value, (set, frozenset)):
            return ["set", sorted((self.describe(v, depth) for v in value), key=repr)]
        if isinstance(value, dict):
            return ["dict", sorted(([repr(k), self.describe(v, depth)] for k, v in value.items()), key=repr)]
        if isinstance(value, type):
            self.classes[value] = None
            return ["class", _qualname(value)]
        return self._callable_or_object(value, depth)

    def _callable_or_object(self, value: Any, depth: int) -> Any:
        if isinstance(value, functools.partial):
            return ["partial", self.describe(value.func, depth), self.describe(value.args, depth),
                    self.describe(value.keywords, depth)]
        if isinstance(value, types.MethodType):
            return ["method", self.describe(value.__func__, depth), self.describe(value.__self__, depth + 1)]
        if isinstance(value, types.FunctionType):
            self.functions[value.__code__] = None
            closure = [self.describe(cell.cell_contents, depth + 1) for cell in value.__closure__ or ()
                       if _filled(cell)]
            return ["function", value.__module__, value.__qualname__, closure,
                    self.describe(value.__defaults__, depth + 1)]
        if isinstance(value, types.BuiltinFunctionType):
            return ["builtin", getattr(value, "__module__", None), value.__qualname__]
        if id(value) in self.seen:
            return ["seen", self.seen[id(value)]]
        self.seen[id(value)] = len(self.seen)
        if depth >= _DEPTH or not hasattr(value, "__dict__"):
            text = repr(value)
            return ["object", _qualname(type(value)), None if " at 0x" in text else text]
        self.classes[type(value)] = None
        state = {name: field for name, field in vars(value).items() if not _derived(name)}
        return ["object", _qualname(type(value)), self.describe(state, depth + 1)]

    def code(self) -> dict[str, Any]:
        """Every class's and function's code met, and the files that define them."""
        files: dict[str, str] = {}
        packages: dict[str, str | None] = {}
        bases = {base: None for cls in list(self.classes) for base in cls.__mro__ if base.__module__ != "builtins"}
        classes = [[_qualname(base), _methods_digest(base)] for base in bases]
        for base in bases:
            _add_file(files, packages, base, base.__module__)
        functions = []
        for code in self.functions:
            functions.append(_code_digest(code))
            files.setdefault(code.co_filename, _file_digest(code.co_filename))
        return {"classes": sorted(map(json.dumps, classes)), "functions": sorted(functions),
                "files": sorted(files.items()), "packages": sorted(packages.items(), key=repr)}


# Methods a trace of a built model does not run; Dynamo itself wraps nn.Module's __init__ and
# __setstate__ while tracing (mutation tracking), which must not change the key.
_UNTRACED = frozenset({"__init__", "__new__", "__setstate__", "__getstate__", "__reduce__", "__reduce_ex__", "__repr__",
                       "__str__", "__dir__", "__init_subclass__", "__class_getitem__", "extra_repr"})


def _methods_digest(cls: type) -> list[str]:
    """The code of the methods ``cls`` defines itself (the trace may run), in a stable order."""
    methods = (_function(member) for name, member in vars(cls).items() if name not in _UNTRACED)
    return sorted(_code_digest(f.__code__) for f in methods if isinstance(f, types.FunctionType))


def _function(member: Any) -> Any:
    """The function behind a class member: a method, a static or class method, a property's getter."""
    if isinstance(member, (staticmethod, classmethod)):
        return member.__func__
    return member.fget if isinstance(member, property) else member


def _derived(name: str) -> bool:
    """An attribute holding a hash of other state (a Hugging Face config's ``_original_object_hash``):
    Python's ``hash`` of strings differs by process, and the state it hashes is described anyway."""
    return "hash" in name.lower()


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell (a name assigned after the closure was made)
        return False
    return True


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _tensor_meta(tensor: torch.Tensor) -> list[Any]:
    if type(tensor) not in (torch.Tensor, nn.Parameter, nn.Buffer) and not is_fake(tensor):
        raise Unkeyable(f"a tensor subclass ({type(tensor).__name__})")
    return [list(tensor.shape), list(tensor.stride()), str(tensor.dtype), str(tensor.device), tensor.requires_grad,
            isinstance(tensor, nn.Parameter), is_fake(tensor)]


def _contents(tensor: torch.Tensor) -> str | None:
    """A digest of a real tensor's values (token ids can steer a trace through a data-dependent
    branch); None for meta and fake tensors, which have none."""
    if tensor.device.type == "meta" or is_fake(tensor):
        return None
    return hashlib.sha256(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


# --- code and its files ---------------------------------------------------------------------


def _code_digest(code: types.CodeType) -> str:
    """Bytecode, names and constants of ``code`` and the code nested in it (lambdas, inner functions)."""
    digest = hashlib.sha256()
    digest.update(code.co_code)
    digest.update(repr((code.co_names, code.co_varnames, code.co_freevars, code.co_qualname)).encode())
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            digest.update(_code_digest(constant).encode())
        else:  # a frozenset constant (``x in {"a", "b"}``) prints in hash order, which varies by process
            digest.update(repr(sorted(map(repr, constant)) if isinstance(constant, frozenset) else constant).encode())
    return digest.hexdigest()


def _add_file(files: dict[str, str], packages: dict[str, str | None], cls: type, module_name: str) -> None:
    try:
        path = inspect.getsourcefile(cls)
    except (TypeError, OSError):
        path = None
    if path is not None:
        files.setdefault(path, _file_digest(path))
    top = module_name.split(".")[0]
    if top not in packages:
        packages[top] = getattr(sys.modules.get(top), "__version__", None)


def _file_digest(path: str) -> str:
    """SHA-256 of a source file, re-read only when its size or modification time changes; a
    file that cannot be read (a class typed at a prompt) leaves its code objects' digests alone
    to stand for it."""
    try:
        stat = os.stat(path)
    except OSError:
        return "unreadable"
    return _read_digest(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4096)
def _read_digest(path: str, _size: int, _mtime_ns: int) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# --- global state -----------------------------------------------------------------------------


def _global_state(tensors: list[torch.Tensor], describer: _Describer) -> dict[str, Any]:
    from torch._dynamo import config as dynamo_config
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    backends = torch.backends
    cuda_devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    return {
        "grad": torch.is_grad_enabled(), "inference": torch.is_inference_mode_enabled(),
        "autocast": {kind: [torch.is_autocast_enabled(kind), str(torch.get_autocast_dtype(kind))]
                     for kind in ("cpu", "cuda")},
        "default_dtype": str(torch.get_default_dtype()), "default_device": str(torch.get_default_device()),
        "deterministic": [torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled()],
        "matmul_precision": torch.get_float32_matmul_precision(),
        "backends": [backends.mkldnn.enabled, backends.cudnn.enabled, backends.cudnn.deterministic,
                     backends.cudnn.benchmark, backends.cudnn.allow_tf32, backends.cuda.matmul.allow_tf32,
                     backends.cuda.flash_sdp_enabled(), backends.cuda.mem_efficient_sdp_enabled(),
                     backends.cuda.math_sdp_enabled(), backends.cuda.cudnn_sdp_enabled()],
        # Each config's entries, described (their get_hash pickles sets, whose order varies by process).
        "configs": [describer.describe(c.get_config_copy(), 0) for c in (dynamo_config, functorch_config,
                                                                          inductor_config)],
        "modes": [_qualname(type(m)) for m in (*_get_current_function_mode_stack(), *_get_current_dispatch_mode_stack())],
        "cuda": [torch.cuda.get_device_name(i) for i in cuda_devices],
    }


__all__ = ["Unkeyable", "before_tracing", "trace_key", "trace_record"]
