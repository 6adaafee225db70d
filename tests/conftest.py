import logging

import pytest
import torch

from remat_pass.solvers.problem import Problem


@pytest.fixture(autouse=True)
def _eager_backend_unless_its_default_is_the_subject(request, monkeypatch):
    """The torch.compile backend compiles its graphs with Inductor by default, whose cold CPU
    compile takes 10-90 s a graph on this 2-core machine; tests marked ``backend_default`` run
    that default, the others the eager inner compiler (whose program the peak model describes
    exactly; under a peak budget Inductor is fitted by compiling and measuring candidates).
    ``optimize`` is eager by default either way."""
    if request.node.get_closest_marker("backend_default") is None:
        from remat_pass.runtime import dynamo_backend

        monkeypatch.setattr(dynamo_backend, "BACKEND_INNER", "eager")
        yield
        return
    # Inductor's CPU kernels that scatter with accumulation (an embedding's backward) add with
    # atomics across threads, so the summation order, and the gradient's last bits, vary from run
    # to run with more than one thread: the bit-for-bit comparisons here failed now and then on
    # the 2-core CI machine (tok_emb.weight). One thread makes the kernels deterministic.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no cached graph or plan leaks between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="session", autouse=True)
def _plan_cache_in_a_temporary_directory(tmp_path_factory):
    """The plan cache is on by default (in ``~/.cache/remat_pass/plans``): the tests never write
    there. Session fixtures plan into one temporary directory, each test into its own (below)."""
    from remat_pass.runtime import plan_cache

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plan_cache, "DEFAULT_DIRECTORY", tmp_path_factory.mktemp("plan_cache"))
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg_cache")))  # subprocesses too
        yield


@pytest.fixture(autouse=True)
def _fresh_plan_cache(tmp_path_factory, monkeypatch):
    """No plan solved by one test is served to another from the default cache."""
    from remat_pass.runtime import plan_cache

    monkeypatch.setattr(plan_cache, "DEFAULT_DIRECTORY", tmp_path_factory.mktemp("plan_cache"))


@pytest.fixture(scope="session")
def gpt_step() -> Problem:
    """A traced two-layer GPT step with dropout, its loss included: tuples (layer norm), views,
    replayed dropout, attention (``test_exact_rows``, ``test_peak_rows``)."""
    from remat_pass.planning.pipeline import trace_step

    from .models import make_case

    torch._dynamo.reset()
    model, inputs, loss = make_case("gpt")
    problem = trace_step(model, inputs, loss_fn=loss, device="cpu").problem
    torch._dynamo.reset()
    return problem


def pytest_configure(config):
    logging.getLogger("remat_pass").setLevel(logging.INFO)
