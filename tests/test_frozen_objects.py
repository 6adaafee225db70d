"""A capture freezes the objects older than it (capture.frozen_objects) and leaves the collector as it was."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import remat_pass
from remat_pass.capture import frozen_objects
from remat_pass.capture.frozen_objects import older_objects_frozen


@pytest.fixture(autouse=True)
def nothing_frozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


class Node:
    pass


def test_older_objects_are_frozen_within_and_unfrozen_after_even_on_error():
    tracked = len(gc.get_objects())
    with pytest.raises(RuntimeError), older_objects_frozen():
        assert gc.get_freeze_count() >= tracked // 2
        raise RuntimeError("a failed capture")
    assert gc.get_freeze_count() == 0


def test_garbage_made_within_is_still_collected_within():
    with older_objects_frozen():
        cycle = Node()
        cycle.me = cycle
        gone = weakref.ref(cycle)
        del cycle
        gc.collect()
        assert gone() is None


def test_a_freeze_that_was_there_is_left_alone():
    gc.freeze()  # the user's (a server freezing before it forks)
    frozen = gc.get_freeze_count()
    # Frozen objects may still die by reference counting, so the count can only fall a little;
    # an unfreeze would make it 0.
    with older_objects_frozen():
        assert frozen // 2 < gc.get_freeze_count() <= frozen
    assert frozen // 2 < gc.get_freeze_count() <= frozen


def test_optimize_freezes_during_its_capture_and_unfreezes(monkeypatch):
    seen = []
    real = frozen_objects.gc.freeze

    def freeze():
        seen.append(gc.get_freeze_count())
        real()

    monkeypatch.setattr(frozen_objects.gc, "freeze", freeze)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimized = remat_pass.optimize(model, 0.5, example_inputs=(torch.randn(4, 8),), plan_cache=False)
    optimized(torch.randn(4, 8)).sum().backward()
    assert seen == [0]  # once, by plan_ahead; the backend inside it found the freeze and left it
    assert gc.get_freeze_count() == 0
