"""The allocator measurement (remat_pass.runtime.measure) on hand-counted cases; tests and benchmarks both use it."""

from __future__ import annotations

import os

import pytest
import torch

from remat_pass.compat import quiet_profiler_switch
from remat_pass.runtime.measure import allocator_peak, held_bytes, saved_activation_bytes

CPU = torch.device("cpu")


def test_allocator_peak_hand_counted():
    kept: list[torch.Tensor] = []

    def fn():
        a = torch.empty(1000)  # 4000 B
        kept.append(torch.empty(2000))  # 8000 B, survives, excluded like a gradient
        kept.append(torch.empty(500))  # 2000 B, survives, counted
        del a

    timeline = allocator_peak(fn, CPU, survivors=lambda: kept[:1])
    assert (timeline.peak, timeline.peak_excluding, timeline.end) == (14000, 6000, 10000)


def test_saved_bytes_leave_out_what_autograd_saved_and_freed_within_the_call():
    # An op that runs autograd inside itself (the chunked loss's per-chunk gradients) saves
    # tensors that are freed before the call returns: backward never holds them.
    x = torch.randn(64, 64, requires_grad=True)
    alive = []

    def fn():
        inner = torch.randn(64, 64, requires_grad=True)
        y = inner.exp()  # exp saves its output
        alive.append(y)  # kept alive, so its address is not reused by what follows
        torch.autograd.grad(y.sum(), inner)  # frees that graph, and what it saved
        return x.relu()  # saves its output until backward

    _, nbytes = saved_activation_bytes(fn, exclude=[x])
    assert nbytes == 64 * 64 * 4


def test_measuring_writes_nothing_of_its_own_to_stderr(monkeypatch, capfd):
    # torch 2.13's kineto writes "USDT: ... profiler_start/stop" to descriptor 2 at every switch:
    # two lines per measured kernel on a user's terminal. What the measured code writes still shows.
    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)
    for _ in range(3):
        allocator_peak(lambda: os.write(2, b"the measured code\n"), CPU)
    assert capfd.readouterr().err == "the measured code\n" * 3


def test_quiet_profiler_switch_restores_stderr_and_obeys_kineto_log_level(monkeypatch, capfd):
    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)
    with quiet_profiler_switch():
        os.write(2, b"silenced\n")
    os.write(2, b"after\n")
    monkeypatch.setenv("KINETO_LOG_LEVEL", "0")  # the user asked for kineto's log: nothing is silenced
    with quiet_profiler_switch():
        os.write(2, b"asked for\n")
    assert capfd.readouterr().err == "after\nasked for\n"


def test_allocator_peak_of_a_matmul_chain():
    x = torch.randn(128, 128)

    def fn():
        y = x @ x  # 64 KiB
        z = y @ x  # 64 KiB, y still alive
        del y
        return z.sum()

    timeline = allocator_peak(fn, CPU)
    # y and z together; mm allocates nothing else; everything is freed by the end.
    assert (timeline.peak, timeline.end) == (2 * 128 * 128 * 4, 0)


def test_held_bytes_equals_saved_tensors_for_eager():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    x = torch.randn(8, 64)
    loss, held = held_bytes(lambda: model(x).sum(), CPU)
    saved = saved_activation_bytes(lambda: model(x).sum(), exclude=[x, *model.parameters()])[1]
    assert saved == 8 * 64 * 4  # the ReLU output, saved by ReLU and the second Linear
    assert held == saved + loss.nbytes



def test_allocator_events_with_one_timestamp_keep_their_order():
    """Events the profiler stamps with the same nanosecond are replayed in the order they happened
    (pre-order in the event tree: a parent's before its children's, siblings in turn); an order that
    put the free first would count two live blocks where there was only ever one."""
    from types import SimpleNamespace

    from torch._C._profiler import _EventType

    from remat_pass.compat import allocator_events

    def allocation(size, ptr=1, t=5):
        fields = SimpleNamespace(device=torch.device("cpu"), ptr=ptr, alloc_size=size)
        return SimpleNamespace(tag=_EventType.Allocation, extra_fields=fields, start_time_ns=t, children=[])

    op = SimpleNamespace(tag=None, extra_fields=None, start_time_ns=5,
                         children=[allocation(100), allocation(-100), allocation(100, ptr=2)])
    prof = SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(
        experimental_event_tree=lambda: [op, allocation(-100, ptr=2, t=6)])))
    events = allocator_events(prof, "cpu")
    assert [size for _, _, size in events] == [100, -100, 100, -100]
    live = peak = 0
    for _, _, size in events:
        live += size
        peak = max(peak, live)
    assert peak == 100


def test_cuda_allocator_history_is_replayed_in_order():
    """The CUDA path's trace reader (run here on a recorded-shape trace: no GPU on CI): a block
    counts from its alloc to its completed free; frees of blocks allocated before the call and
    segment events are ignored."""
    from remat_pass.compat import _allocator_trace_events
    from remat_pass.runtime.measure import _replay

    trace = [
        {"action": "segment_alloc", "addr": 0, "size": 2 << 20},
        {"action": "alloc", "addr": 0, "size": 1024},
        {"action": "free_completed", "addr": 4096, "size": 512},  # allocated before the call
        {"action": "alloc", "addr": 1024, "size": 512},
        {"action": "free_requested", "addr": 0, "size": 1024},
        {"action": "free_completed", "addr": 0, "size": 1024},
        {"action": "alloc", "addr": 0, "size": 256},  # the survivor: reuses the first address
    ]
    events = _allocator_trace_events(trace)
    assert events == [(1, 0, 1024), (3, 1024, 512), (5, 0, -1024), (6, 0, 256)]
    measured = _replay(events, [])
    assert (measured.peak, measured.end) == (1536, 768)


@pytest.mark.parametrize("users_recording", [False, True])
def test_cuda_allocator_history_recording_is_left_as_the_user_had_it(monkeypatch, users_recording):
    """The switching around a CUDA measurement (no GPU on CI: the allocator's recorder is a fake
    that keeps its state): the user's own recording stays on, with its history; else it goes off."""
    from torch.cuda import memory as cuda_memory

    from remat_pass import compat

    recorder = {"on": users_recording, "trace": [{"action": "alloc", "addr": 8, "size": 64}] * users_recording}

    def record(enabled="all", **options):
        recorder["on"] = enabled is not None
        recorder["options"] = options

    def snapshot():
        return {"device_traces": [list(recorder["trace"])] if recorder["on"] else [[]]}

    def step():
        recorder["trace"].append({"action": "alloc", "addr": 0, "size": 1024})
        return "result"

    monkeypatch.setattr(torch._C, "_cuda_isHistoryEnabled", lambda: recorder["on"], raising=False)
    monkeypatch.setattr(cuda_memory, "_record_memory_history", record)
    monkeypatch.setattr(cuda_memory, "_snapshot", snapshot)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    result, events = compat.cuda_allocator_events(step, torch.device("cuda", 0))
    assert (result, events) == ("result", [(0, 0, 1024)])  # the user's earlier entries are not this call's
    assert recorder["on"] is users_recording
    if users_recording:
        assert recorder["options"]["context"] == "all" and len(recorder["trace"]) == 2
