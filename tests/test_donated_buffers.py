"""Donated buffers off only for a compile whose saved tensors share a storage (``capture.donated_buffers``).

The wrong gradients donation gave where they do (HF OLMo2 under a peak budget on Inductor) are the slow
regression test in ``test_more_families.py``; here, which forwards turn it off, and for how long.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from remat_pass.capture.donated_buffers import saved_tensors_share_storage
from remat_pass.capture.inductor_compile import InductorPartitioner
from remat_pass.compat import donated_buffers_scope

pytestmark = pytest.mark.skipif(not hasattr(torch._functorch.config, "donated_buffer"),
                                reason="this torch has no donated buffers")


def _forward(saves_a_view: bool) -> fx.GraphModule:
    """A forward in AOTAutograd's shape: one user output, then the saved tensors (with fake values)."""
    def forward(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = x * 2
        saved = h.view(4, 2) if saves_a_view else torch.relu(h)
        return h.sum(), h, saved

    return make_fx(forward, tracing_mode="fake")(torch.randn(8))


def test_a_saved_tensor_and_its_view_share_a_storage_and_two_tensors_do_not():
    assert saved_tensors_share_storage(_forward(saves_a_view=True), num_fwd_outputs=1)
    assert not saved_tensors_share_storage(_forward(saves_a_view=False), num_fwd_outputs=1)


def test_a_user_output_aliasing_a_saved_tensor_is_not_among_the_saved():
    """Only the saved tensors are compared with each other (AOTAutograd already keeps a saved tensor
    that aliases an output out of donation)."""
    assert not saved_tensors_share_storage(_forward(saves_a_view=True), num_fwd_outputs=2)


@pytest.mark.parametrize("saves_a_view", [True, False])
def test_the_partitioner_turns_donation_off_for_its_own_compile_only(saves_a_view):
    """Inside the compile's scope the setting is what AOTAutograd reads after the partitioner; after the
    scope it is the user's again."""
    config = torch._functorch.config
    forward = _forward(saves_a_view)
    partitioner = InductorPartitioner(lambda gm, inputs, **kwargs: (forward, gm), identity=None)
    assert config.donated_buffer
    with donated_buffers_scope():
        partitioner(forward, [], num_fwd_outputs=1)
        assert config.donated_buffer is not saves_a_view
    assert config.donated_buffer


def test_a_users_own_setting_is_kept():
    config = torch._functorch.config
    forward = _forward(saves_a_view=False)
    partitioner = InductorPartitioner(lambda gm, inputs, **kwargs: (forward, gm), identity=None)
    with config.patch(donated_buffer=False):
        with donated_buffers_scope():
            partitioner(forward, [], num_fwd_outputs=1)
            assert not config.donated_buffer
        assert not config.donated_buffer
