"""The allocator measurement (remat_pass.measure) on hand-counted cases; tests and benchmarks both use it."""

from __future__ import annotations

import torch

from remat_pass.measure import allocator_peak, held_bytes, saved_activation_bytes

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

