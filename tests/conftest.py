import logging

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no cached graph or plan leaks between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def pytest_configure(config):
    logging.getLogger("remat_pass").setLevel(logging.INFO)
