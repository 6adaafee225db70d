"""Run the Hugging Face-facing tests against the oldest and the newest transformers the pyproject allows.

CI installs the newest versions the pyproject allows, as a user does; this is the other end of
the range, and the check to run before widening a cap (dependency drift is how a fresh install
went red with transformers 5.25). Each version gets a fresh venv of its own (the running torch's
release, the project editable with its test extra, that transformers), so the project's
environment is not changed; a few minutes a version::

    python -m tests.deps_matrix                 # oldest and newest allowed transformers
    python -m tests.deps_matrix --versions 5.3.0 -- -x   # one version; pytest arguments after --

Exits non-zero when any version fails, naming it.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The test files that build Hugging Face models (tests/zoo_models.py and the families).
HF_TESTS = ("test_zoo.py", "test_hf_families.py", "test_as_given.py", "test_capture_errors.py",
            "test_checkpoint_reference.py", "test_api_inputs.py", "test_wrapper.py")

logger = logging.getLogger("deps_matrix")


def allowed_range(requirement: str = "transformers") -> tuple[str, str]:
    """The ``>=low,<high`` the pyproject's test extra gives ``requirement``."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    spec = next(s for s in extras if re.match(rf"{re.escape(requirement)}\b", s))
    low, high = re.search(r">=\s*([\w.]+)", spec), re.search(r"<\s*([\w.]+)", spec)
    if low is None or high is None:
        raise SystemExit(f"pyproject's test extra should give {requirement} a >=low,<high range, not {spec!r}")
    return low.group(1), high.group(1)


def newest_allowed(requirement: str, low: str, high: str) -> str:
    """The newest release pip would install for ``requirement>=low,<high`` (asks the index)."""
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-deps",
                          "--ignore-installed", "--report", "-", f"{requirement}>={low},<{high}"],
                         capture_output=True, text=True, check=True).stdout
    (install,) = json.loads(out)["install"]
    return install["metadata"]["version"]


def run_version(version: str, pytest_args: list[str]) -> bool:
    """A fresh venv with this torch, the project and transformers==version; the HF tests in it.

    A venv of its own, not a folder on PYTHONPATH: another release's dependencies left beside it
    break it in ways no user's install would (transformers 5.0 imports whatever ``kernels`` is
    installed, and the one 5.25 brings is not its API).
    """
    import torch

    with tempfile.TemporaryDirectory(prefix=f"transformers-{version}-") as folder:
        venv = Path(folder) / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        python = str(venv / "bin" / "python")
        pip = [python, "-m", "pip", "install", "--quiet"]
        subprocess.run([*pip, f"torch=={torch.__version__.split('+')[0]}"], check=True)  # the CPU wheel first
        subprocess.run([*pip, "-e", f"{ROOT}[test]", f"transformers=={version}"], check=True)
        probe = subprocess.run([python, "-c", "import transformers; print(transformers.__version__)"],
                               capture_output=True, text=True, check=True).stdout.strip()
        if probe != version:
            raise SystemExit(f"asked for transformers {version}, the tests would import {probe}")
        tests = [str(ROOT / "tests" / name) for name in HF_TESTS]
        logger.info("transformers %s: %s", version, " ".join(HF_TESTS))
        return subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests, *pytest_args],
                              cwd=ROOT).returncode == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", nargs="*", help="transformers versions (default: oldest and newest allowed)")
    args, pytest_args = parser.parse_known_args(argv)
    pytest_args = [a for a in pytest_args if a != "--"]
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    versions = args.versions
    if not versions:
        low, high = allowed_range()
        versions = [low, newest_allowed("transformers", low, high)]
    failed = [v for v in dict.fromkeys(versions) if not run_version(v, pytest_args)]
    if failed:
        logger.error("the Hugging Face tests fail with transformers %s", ", ".join(failed))
        return 1
    logger.info("the Hugging Face tests pass with transformers %s", ", ".join(versions))
    return 0


if __name__ == "__main__":
    sys.exit(main())
