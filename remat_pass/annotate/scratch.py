"""Kernel scratch: the bytes an op allocates while it runs, beyond its inputs and outputs.

Some kernels allocate working memory that no graph node shows. On CPU (torch 2.13, oneDNN) a
convolution reorders its input and weight into a blocked layout (forward: about its input plus
weight; backward: about twice its input or output gradient, whichever is larger), batch norm's
backward builds an input-sized temporary, and dropout draws a float mask before keeping a bool
one; on CUDA, cuDNN convolutions (up to twice their input on an H200) and the attention
kernels take workspaces. The scratch lives only while the op runs, but next to everything else
alive then: a peak model without it under-counts, and a CPU ResNet step overshot its planned
peak by 3% (benchmarks/RESULTS.md).

How it is found, per configuration (op, every tensor argument's shape, strides, dtype and
device, the other arguments), once per process, and once per machine where the caller gives a
store (``optimize`` and the backend: the plan cache's ``scratch`` folder, so a cached re-plan in a
new process measures nothing again):

* **measured** where the tensors are on a real device: the op runs under ``measure.allocator_peak``
  (on CUDA the caching allocator's own history, so a measurement neither needs nor resets
  ``torch.cuda``'s peak statistics), and where that first call shows scratch it runs again and
  the second call counts (one-time allocations such as a library's workspace or a primitive
  cache are not scratch; a first call that shows none leaves nothing to discount), on random inputs of
  the right shape, without autograd or autocast, the RNG state restored afterwards
  (``op_timing.isolated``); scratch = the allocator's peak during the call less the bytes of
  the outputs it returns;
* **estimated** (``estimated_scratch_bytes``: measured ratios, CPU and CUDA) where nothing can run:
  tensors on the meta device, a step traced from fake tensors (``plan`` on a meta model that does
  not fit here: ``kernel_scratch(..., estimate=True)``), an op that reads a workspace or reserve its
  forward left (``_reads_opaque_state``), or a failed run.

Which ops run (``_measurable``): all but views, mutations, collectives, ops whose output
depends on data, and pointwise ops that write their output directly (one that first casts an
input to the output's dtype, a bool mask times a float gradient, is measured: the cast copy is
scratch). Measured over every op of the benchmark models (GPT-, Llama-style transformers, a
ResNet; CPU, fp32), only convolutions (forward and backward), batch norm backward, dropout
(forward and backward), layer norm backward (a few KiB) and the CPU attention kernels allocated
any (outside them, CPU ``upsample_nearest2d`` does too); an op that allocates none costs one
short call (a ResNet's ~90 configurations took ~0.4 s with two).
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import tempfile
from pathlib import Path
from typing import Any, Collection, Iterable, Mapping

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten, tree_map

from .collectives import is_collective
from ..compat import concrete_int
from ..runtime.measure import allocator_peak
from .op_timing import isolated

logger = logging.getLogger(__name__)

_SKIPPED_TAGS = (torch.Tag.inplace_view, torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
_MEASURED: dict[str, int] = {}  # configuration -> scratch bytes, for the process


def kernel_scratch(graph: fx.Graph, uncounted: Iterable[fx.Node | None] = (), *, estimate: bool = False,
                   store: Path | None = None) -> dict[fx.Node, int]:
    """Scratch bytes of every node of ``graph`` that has any (measured or estimated; see the module).

    ``uncounted``: nodes whose tensors the memory models leave out (the parameter gradients a
    backward returns). An op's scratch is what is live during it beyond the outputs the models
    do count, so such an output, live inside the kernel next to its scratch, counts as scratch.
    ``estimate``: never run a kernel, estimate every op. For a step traced from fake tensors (a
    meta model: ``plan``), whose fake CPU device is not the device planned for, and where running
    the kernels at full size cost minutes (a Llama-2-70B-shaped step: 208 s for 51 configurations).
    ``store``: a directory (the plan cache's ``scratch`` folder) where measurements persist across
    processes, one JSON file per torch version and machine (``_store_file``): a restarted job
    measures nothing it measured before (a 12-layer GPT-2: 2.6 s for 41 configurations).
    """
    left_out = {key for node in uncounted if node is not None for key in _storage_keys(node)}
    path = _store_file(store) if store is not None and not estimate else None
    known = _read_store(path) if path is not None else {}
    measured: dict[str, int] = {}
    found = {}
    for node in graph.nodes:
        if not _measurable(node):
            continue
        nbytes = estimated_scratch_bytes(node) if estimate else node_scratch_bytes(node, left_out, known, measured)
        if nbytes > 0:
            found[node] = nbytes
    if path is not None and measured:
        _write_store(path, measured)
    return found


def node_scratch_bytes(node: fx.Node, uncounted: Collection[StorageWeakRef] = (),
                       known: Mapping[str, int] | None = None, measured: dict[str, int] | None = None) -> int:
    """The scratch bytes ``node``'s op allocates when it runs (0 for ops that are not measured);
    outputs whose storage is in ``uncounted`` count as scratch (see ``kernel_scratch``).
    ``known``: measurements read from a store; each new measurement is added to ``measured``."""
    if not _measurable(node):
        return 0
    mask = tuple(key in uncounted for key in _storage_keys(node))
    key = f"{_configuration(node)} uncounted={mask}"
    if key not in _MEASURED and known and _device_key(node, key) in known:
        _MEASURED[key] = known[_device_key(node, key)]
    if key not in _MEASURED:
        _MEASURED[key], ran = _measure_or_estimate(node, mask)
        logger.debug("scratch of %s: %d bytes", key, _MEASURED[key])
        if ran and measured is not None:
            measured[_device_key(node, key)] = _MEASURED[key]
    return _MEASURED[key]


def _device_key(node: fx.Node, key: str) -> str:
    """A configuration as stored on disk: a CUDA device's model named (the file names the CPU)."""
    cuda = [t.device for t in _tensor_args(node) if t.device.type == "cuda"]
    return f"{torch.cuda.get_device_name(cuda[0])}: {key}" if cuda else key


def _store_file(directory: Path) -> Path:
    """One file per torch version and CPU (oneDNN's kernels differ by instruction set)."""
    machine = f"{platform.machine()}-{torch.backends.cpu.get_cpu_capability()}"
    return Path(directory) / f"scratch-torch{torch.__version__}-{machine}.json".replace("+", "_")


def _read_store(path: Path) -> dict[str, int]:
    try:
        return {str(k): int(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}  # none yet, or unreadable: measured again and rewritten


def _write_store(path: Path, measured: dict[str, int]) -> None:
    """Add ``measured`` to the file (merged with what another process may have written); atomic."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        merged = {**_read_store(path), **measured}
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as handle:
            json.dump(merged, handle)
        os.replace(handle.name, path)
    except OSError as error:
        logger.warning("could not write kernel scratch measurements to %s: %s", path, error)


def estimated_scratch_bytes(node: fx.Node) -> int:
    """A per-op estimate where the op cannot run (meta tensors: the device is unknown), the larger
    of what was measured on CPU (oneDNN, torch 2.13) and on an H200 (cuDNN, torch 2.11), fp32 and
    bf16, on the benchmark ResNets (benchmarks.scratch_check).

    Convolution forward: twice the larger of input and output, plus the weight (CPU: about the
    input plus the weight; cuDNN: up to twice the input). Backward: twice the larger of input and
    output gradient, plus the weight (both). Batch norm backward, dropout forward and backward
    (CPU): one tensor the size of the input (any batch norm backward: cuDNN's too, not measured
    where it reads its reserve). Every other op: 0.
    """
    name = node.target.overloadpacket.__name__ if isinstance(node.target, torch._ops.OpOverload) else ""
    if name.startswith("chunked_linear_cross_entropy"):
        return _chunked_loss_scratch(node)
    tensors = [_bytes(a) for a in node.args[:3]]
    if name == "convolution":
        return 2 * max(tensors[0], _bytes(node)) + tensors[1]
    if name == "convolution_backward":
        return 2 * max(tensors[0], tensors[1]) + tensors[2]
    if name.endswith("batch_norm_backward") or name in ("native_dropout", "native_dropout_backward"):
        return tensors[0]
    return 0


# A chunked loss's live working set, in chunks of fp32 logits. Measured on CPU (torch 2.13, fp32,
# 512 tokens x 4096 vocabulary in chunks of 64 rows; allocator peak less the outputs): forward 2.0
# chunks (no chain, or the upcast alone) and 3.0 (Gemma-2's softcapping then the upcast); backward
# 5.0 and 6.0. One chunk more each for chains or dtypes not measured. The gradients computed in
# forward run backward's loop: its count.
_CHUNK_LOGITS_LIVE = {"chunked_linear_cross_entropy": 4, "chunked_linear_cross_entropy_backward": 7,
                      "chunked_linear_cross_entropy_with_gradients": 7}


def _chunked_loss_scratch(node: fx.Node) -> int:
    """A chunked loss's working set where it cannot run: a few chunks of logits (its chunk rows
    x vocabulary in fp32), plus the weight's fp32 gradient accumulator for low-precision weights."""
    name = node.target.overloadpacket.__name__
    arguments = dict(zip((a.name for a in node.target._schema.arguments), node.args))
    hidden, weight = arguments["hidden"].meta["val"], arguments["weight"].meta["val"]
    rows = min(int(arguments["chunk_rows"]), concrete_int(hidden.shape[0]))
    chunk = rows * concrete_int(weight.shape[0]) * 4
    accumulates = name != "chunked_linear_cross_entropy" and arguments["weight_grads"]
    accumulator = _bytes(arguments["weight"]) * 2 if accumulates and weight.element_size() < 4 else 0
    return _CHUNK_LOGITS_LIVE[name] * chunk + accumulator


def _measurable(node: fx.Node) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if target._schema.is_mutable or any(tag in target.tags for tag in _SKIPPED_TAGS) or is_collective(node):
        return False
    outputs = [t for t in tree_flatten(node.meta.get("val"))[0] if isinstance(t, torch.Tensor)]
    inputs = _tensor_args(node)
    if not outputs or any(_same_storage(o, i) for o in outputs for i in inputs):
        return False  # a view: no kernel runs
    # A pointwise kernel writes its output directly, unless it first casts an input to the
    # output's dtype (a bool mask times a float gradient): that copy is scratch.
    return torch.Tag.pointwise not in target.tags or any(
        i.dtype != outputs[0].dtype and i.dim() > 0 for i in inputs)


def _reads_opaque_state(node: fx.Node) -> bool:
    """Whether the op reads a workspace or reserve its forward kernel left for it (RNN and batch norm
    backwards): made-up contents are not a valid state, and CPU ``mkldnn_rnn_layer_backward`` run on
    them crashed the process (an ``nn.LSTM`` under ``allow_rnn``; its fake workspace is empty, so
    sizes do not tell). Such ops are estimated."""
    return any("workspace" in a.name.lower() or "reserve" in a.name.lower() for a in node.target._schema.arguments)


def _configuration(node: fx.Node) -> str:
    """What the scratch can depend on: the op, each tensor's layout and device, other arguments."""

    def describe(a: Any) -> Any:
        if not isinstance(a, fx.Node):
            return a
        val = a.meta.get("val")
        if isinstance(val, torch.Tensor):
            return ("tensor", _sizes(val.shape), _sizes(val.stride()), concrete_int(val.storage_offset()),
                    str(val.dtype), str(val.device))
        return concrete_int(val) if isinstance(val, torch.SymInt) else repr(val)

    return repr((str(node.target), tree_map(describe, node.args), tree_map(describe, node.kwargs)))


def _measure_or_estimate(node: fx.Node, uncounted: tuple[bool, ...]) -> tuple[int, bool]:
    """The scratch, and whether it was measured (an estimate is not stored on disk)."""
    devices = {t.device for t in _tensor_args(node)}
    if not devices or any(d.type == "meta" for d in devices) or _reads_opaque_state(node):
        return estimated_scratch_bytes(node), False
    try:
        return _measure(node, next(d for d in devices if d.type != "cpu") if len(devices) > 1 else devices.pop(),
                        uncounted), True
    except Exception as error:  # noqa: BLE001 - a kernel that cannot run on random inputs: estimate
        logger.debug("could not measure the scratch of %s (%s); estimating it", node.format_node(), error)
        return estimated_scratch_bytes(node), False


def _measure(node: fx.Node, device: torch.device, uncounted: tuple[bool, ...]) -> int:
    """Run the op on random inputs; the allocator's peak during it, the ``uncounted`` outputs
    left out at their allocation, less the other outputs' bytes.

    The first call is measured too: it allocates all a later call does plus the one-time
    allocations (a library's workspace, a primitive cache), so when it shows no scratch there is
    none, and most ops (a GPT-2's matmuls) take one call instead of two. Otherwise it was the
    warm-up, and a second call is what is measured."""
    with isolated(device):
        args, kwargs = tree_map(_real, (node.args, node.kwargs))
        first = _scratch_of_one_call(node, args, kwargs, device, uncounted)
        return first if first == 0 else _scratch_of_one_call(node, args, kwargs, device, uncounted)


def _scratch_of_one_call(node: fx.Node, args: Any, kwargs: Any, device: torch.device,
                         uncounted: tuple[bool, ...]) -> int:
    outputs: list[torch.Tensor] = []

    def call() -> Any:
        result = node.target(*args, **kwargs)
        outputs.extend(t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor))
        return result

    measured = allocator_peak(call, device, survivors=lambda: [t for t, u in zip(outputs, uncounted) if u])
    counted = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
               for t, u in zip(outputs, uncounted + (False,) * len(outputs)) if not u}
    return max(measured.peak_excluding - sum(counted.values()), 0)


def _real(a: Any) -> Any:
    """A random tensor with the fake value's size, strides, dtype and device; sizes as ints."""
    if not isinstance(a, fx.Node):
        return a
    val = a.meta.get("val")
    if isinstance(val, torch.SymInt):
        return concrete_int(val)
    if not isinstance(val, torch.Tensor):
        return val
    shape, stride = _sizes(val.shape), _sizes(val.stride())
    extent = 1 + sum((size - 1) * step for size, step in zip(shape, stride)) if all(shape) else 0
    base = torch.zeros(extent + concrete_int(val.storage_offset()), dtype=val.dtype, device=val.device)
    if base.is_floating_point() or base.is_complex():
        _random_fill(base)
    return base.as_strided(shape, stride, concrete_int(val.storage_offset()))


_RANDOM_BLOCK = 1 << 16  # elements drawn per filled tensor; the rest repeats them


def _random_fill(flat: torch.Tensor) -> None:
    """Fill a 1-d tensor with normal values, one block drawn and repeated: scratch does not depend
    on the values (ops whose output does are not measured), and drawing every element of large
    inputs costs more than the short kernel calls it feeds."""
    block = torch.randn(min(flat.numel(), _RANDOM_BLOCK), dtype=flat.dtype, device=flat.device)
    whole = flat.numel() // max(block.numel(), 1)
    flat[: whole * block.numel()].view(whole, block.numel()).copy_(block)
    flat[whole * block.numel():].copy_(block[: flat.numel() - whole * block.numel()])


def _storage_keys(node: fx.Node) -> list[StorageWeakRef | None]:
    """The storages of ``node``'s tensors, in flattening order (the op's outputs, for a call)."""
    keys = []
    for tensor in tree_flatten(node.meta.get("val"))[0]:
        if isinstance(tensor, torch.Tensor):
            try:
                keys.append(StorageWeakRef(tensor.untyped_storage()))
            except (NotImplementedError, RuntimeError):
                keys.append(None)
    return keys


def _tensor_args(node: fx.Node) -> list[torch.Tensor]:
    return [v for v in (a.meta.get("val") for a in node.all_input_nodes) if isinstance(v, torch.Tensor)]


def _sizes(sizes: Any) -> tuple[int, ...]:
    return tuple(concrete_int(s) for s in sizes)


def _bytes(a: Any) -> int:
    tensors = [t for t in tree_flatten(a.meta.get("val") if isinstance(a, fx.Node) else a)[0]
               if isinstance(t, torch.Tensor)]
    return sum(math.prod(_sizes(t.shape)) * t.element_size() for t in tensors)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return StorageWeakRef(a.untyped_storage()) == StorageWeakRef(b.untyped_storage())
    except (NotImplementedError, RuntimeError):  # sparse or opaque tensors have no storage
        return False
