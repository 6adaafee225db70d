"""The planners install as ``remat_pass.solvers`` and stay torch-free."""

import subprocess
import sys


def test_solvers_import_without_torch():
    code = (
        "import sys; import remat_pass.solvers as s; "
        "assert 'torch' not in sys.modules, 'remat_pass.solvers imported torch'; "
        "assert s.__name__ == 'remat_pass.solvers'; "
        "assert 'solvers' not in sys.modules, 'a top-level solvers package was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_solver_loggers_live_under_remat_pass():
    from remat_pass.solvers import ilp

    assert ilp.logger.name == "remat_pass.solvers.ilp"
