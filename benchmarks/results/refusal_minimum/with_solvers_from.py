"""Run a script with another checkout's ``remat_pass`` and ``solvers`` (the "before" rows here).

The editable install maps ``remat_pass.solvers`` to this checkout's ``solvers/`` whatever ``PYTHONPATH``
says, so the other checkout's solvers are loaded as that package by hand:

    git worktree add /tmp/before dd78e7e
    python benchmarks/results/refusal_minimum/with_solvers_from.py /tmp/before SCRIPT [ARGS...]
"""

import importlib.util
import runpy
import sys

root = sys.argv[1]
sys.path.insert(0, root)
spec = importlib.util.spec_from_file_location("remat_pass.solvers", f"{root}/solvers/__init__.py",
                                              submodule_search_locations=[f"{root}/solvers"])
module = importlib.util.module_from_spec(spec)
sys.modules["remat_pass.solvers"] = module
spec.loader.exec_module(module)
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
