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


def test_every_package_folder_is_declared_so_a_wheel_ships_it():
    """``pip install -e .`` maps folders, so it works with a package missing from pyproject's list;
    a wheel (``pip install .``, PyPI) ships only what is listed: remat_pass.solvers.fast was not."""
    from pathlib import Path

    import pytest

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    root = Path(__file__).resolve().parent.parent
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {name: Path(folder) for name, folder in setuptools["package-dir"].items()}
    folders.setdefault("remat_pass", Path("remat_pass"))
    found = set()
    for name, folder in folders.items():
        for init in (root / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(root / folder).parts
            found.add(".".join((name, *parts)))
    assert found == set(setuptools["packages"])
