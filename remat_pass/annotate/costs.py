"""How long an op takes to recompute: a roofline per device, not FLOPs alone.

``torch.utils.flop_counter`` gives FLOPs for matmuls and attention only; norms, softmax and
pointwise ops count 0 there, and a planner that believes them free would recompute them all
even when they move a lot of memory. Here an op costs the larger of its compute time and its
memory time (bytes read + written over bandwidth), plus a fixed launch overhead.
Views and reshapes cost nothing: they move no data.

The numbers are published peak figures derated to what dense kernels typically reach; they
rank choices, they do not predict wall time to the microsecond.

The host link (for offloading activations to host memory) is per direction: PCIe Gen4 x16
(A100) is ~25 GB/s nominal, PCIe Gen5 x16 (H100/H200 SXM and PCIe) ~50 GB/s nominal (64 GB/s
raw before encoding and protocol overhead). Pinned-memory copies reach less, and less again
while kernels compete for memory bandwidth: 80% of nominal is used here (20 and 40 GB/s). For a
Grace-Hopper NVLink-C2C part (~450 GB/s) or a measured number, make a profile with
``dataclasses.replace(get_profile("h100"), host_link_bytes_per_second=...)``. The CPU has no
host link: its host and device memory are the same, offloading saves nothing.

``device`` says where the step runs (its memory model and host link); ``costs`` says how an op
is priced (``CostModel``): "roofline" (the device's profile, below), "flops" (FLOPs alone) or
"measure" (each forward op timed once on the device: ``remat_pass.annotate.op_timing``).

Two device names are not devices:

* ``"auto"`` (the default of ``optimize`` and the backend) picks the profile of the device the
  step's tensors are on: "cpu" on the CPU, the matching GPU profile on CUDA (by the device's name;
  an unknown GPU gets "h100" and a warning saying how to choose). A plan priced for the wrong
  device ranks memory-bound ops wrongly: the CPU moves ~7 FLOPs per byte in the time an H100
  moves ~180.
* ``"flops"``, an alias of ``costs="flops"`` on the step's own device, prices an op by its FLOPs alone, as ``torch.utils.flop_counter`` counts them and as
  torch.compile's ``activation_memory_budget`` knapsack does by default (norms, softmax and
  pointwise ops cost only a tie-breaking launch overhead). It minimises recomputed FLOPs, the
  deterministic yardstick; it does not model time.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

AUTO = "auto"  # the profile of the device the step runs on (resolve_profile)


@dataclass(frozen=True)
class DeviceProfile:
    """Sustained throughput of one device. Units: FLOP/s, bytes/s, seconds."""

    name: str
    flops_per_second: dict[str, float]
    bytes_per_second: float
    launch_overhead_seconds: float
    host_link_bytes_per_second: float = 0.0  # per direction; 0: no offload (see the module doc)

    def matmul_rate(self, dtype: torch.dtype) -> float:
        key = {torch.float16: "16bit", torch.bfloat16: "16bit"}.get(dtype, "32bit")
        return self.flops_per_second[key]

    def op_seconds(self, flops: int, bytes_moved: int, dtype: torch.dtype) -> float:
        compute = flops / self.matmul_rate(dtype)
        memory = bytes_moved / self.bytes_per_second
        return self.launch_overhead_seconds + max(compute, memory)


DEVICE_PROFILES: dict[str, DeviceProfile] = {
    # A 2-core x86 server slice: ~100 GFLOP/s fp32 GEMM, ~15 GB/s streaming.
    "cpu": DeviceProfile("cpu", {"32bit": 1.0e11, "16bit": 0.5e11}, 1.5e10, 2e-6),
    # Dense tensor-core peaks (A100 312 / H100 989 / H200 989 TFLOP/s bf16), ~70% sustained;
    # fp32 without TF32; HBM bandwidth 2.0 / 3.35 / 4.8 TB/s, ~80% sustained.
    # Host link: PCIe Gen4 / Gen5 x16, 25 / 50 GB/s per direction nominal, 80% achieved.
    "a100": DeviceProfile("a100", {"32bit": 19.5e12 * 0.7, "16bit": 312e12 * 0.7}, 2.0e12 * 0.8, 4e-6, 25e9 * 0.8),
    "h100": DeviceProfile("h100", {"32bit": 67e12 * 0.7, "16bit": 989e12 * 0.7}, 3.35e12 * 0.8, 4e-6, 50e9 * 0.8),
    "h200": DeviceProfile("h200", {"32bit": 67e12 * 0.7, "16bit": 989e12 * 0.7}, 4.8e12 * 0.8, 4e-6, 50e9 * 0.8),
    # FLOPs alone: one "second" is 1e12 FLOPs at any dtype; memory traffic is free; a launch
    # costs the time of 1000 FLOPs, so that among plans of equal FLOPs the one that recomputes
    # fewer ops wins, without the tie-break outweighing any real matmul.
    "flops": DeviceProfile("flops", {"32bit": 1e12, "16bit": 1e12}, float("inf"), 1e-9),
}

# Substrings of torch.cuda.get_device_name() -> profile, first match wins.
_GPU_NAMES = (("GH200", "h100"), ("H200", "h200"), ("H100", "h100"), ("A100", "a100"))


def get_profile(device: str | DeviceProfile, tensors_on: torch.device | None = None) -> DeviceProfile:
    """Look a profile up by name ("cpu", "a100", "h100", "h200", "flops"); "cuda" means h100;
    "auto" means the profile of ``tensors_on`` (the device the step's tensors are on)."""
    if isinstance(device, DeviceProfile):
        return device
    if device == AUTO:
        return DEVICE_PROFILES[profile_name_for(tensors_on)]
    name = {"cuda": "h100"}.get(device, device)
    try:
        return DEVICE_PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown device profile {device!r}; choose one of {sorted(DEVICE_PROFILES)}") from None


def profile_name_for(device: torch.device | None) -> str:
    """The profile "auto" picks for tensors on ``device`` (None or "meta": the CPU's)."""
    if device is None or device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device)
    for part, profile in _GPU_NAMES:
        if part in name:
            return profile
    logger.warning("no cost profile for GPU %r: planning with h100's; pass device=DeviceProfile(...) "
                   "(remat_pass.annotate.costs) for a better one", name)
    return "h100"


def model_profile(device: str | DeviceProfile, model: torch.nn.Module) -> str | DeviceProfile:
    """``device`` with "auto" resolved from where ``model``'s parameters live (so that checks
    that need the device, such as offload's host link, run before anything is traced); "auto"
    stays for a model without parameters, to be resolved from the step's inputs."""
    if device != AUTO:
        return device
    for tensor in (*model.parameters(), *model.buffers()):
        return profile_name_for(tensor.device)
    return device


class CostModel(str, enum.Enum):
    """How recompute is priced (``optimize(costs=...)``); ``device`` says where the step runs."""

    ROOFLINE = "roofline"  # the device profile: max(compute, memory traffic) + launch overhead
    FLOPS = "flops"  # FLOPs alone, like torch.compile's activation_memory_budget knapsack
    MEASURE = "measure"  # each forward op timed once on the device, with the step's real inputs

    def __str__(self) -> str:
        return self.value


def parse_costs(costs: object) -> CostModel:
    """``costs`` as a ``CostModel``; anything else is a ValueError naming the choices."""
    try:
        return CostModel(costs)
    except (ValueError, TypeError):
        raise ValueError(f"costs must be one of {', '.join(repr(c.value) for c in CostModel)}, got {costs!r} "
                         "(device= says where the step runs, costs= how recompute is priced)") from None


def pricing_profiles(device: str | DeviceProfile, costs: object,
                     tensors_on: torch.device | None = None) -> tuple[DeviceProfile, DeviceProfile]:
    """(the device's profile, the profile that prices ops). The first gives the memory model and
    the host link; the second is the same profile except under "flops", where FLOPs alone price
    ops. ``device="flops"`` is kept as an alias of ``costs="flops"`` on the step's own device."""
    model = parse_costs(costs)
    if isinstance(device, str) and device == "flops":
        device, model = AUTO, CostModel.FLOPS
    where = get_profile(device, tensors_on)
    return where, DEVICE_PROFILES["flops"] if model is CostModel.FLOPS else where
