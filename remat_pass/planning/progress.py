"""A sign of life while a plan is being solved.

A MIP solve can take from milliseconds to the whole time limit; a first training step that is
silent for a minute looks hung. ``solving`` logs at INFO once a solve has run ``after`` seconds,
then every ``every`` seconds until it ends (and how long it took, if it was reported at all).
It lives in the driver, not in ``solvers/``: the planners stay free of logging policy.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

logger = logging.getLogger(__name__)

FIRST_REPORT_SECONDS = 3.0
"""A solve shorter than this is not reported: most are."""

REPORT_EVERY_SECONDS = 10.0


@contextlib.contextmanager
def solving(what: str, time_limit: float | None = None, *, after: float | None = None,
            every: float | None = None) -> Iterator[None]:
    """Log "still solving <what>" at INFO while the body runs longer than ``after`` seconds.

    >>> with solving("a tiny plan"):  # fast: logs nothing
    ...     pass
    """
    after = FIRST_REPORT_SECONDS if after is None else after
    every = REPORT_EVERY_SECONDS if every is None else every
    started = time.perf_counter()
    done = threading.Event()
    reported = threading.Event()
    limit = f" (time limit {time_limit:g}s)" if time_limit else ""

    def report() -> None:
        wait: float = after
        while not done.wait(wait):
            reported.set()
            logger.info("still solving %s: %.0fs so far%s", what, time.perf_counter() - started, limit)
            wait = every

    thread = threading.Thread(target=report, name="remat-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        if reported.is_set():
            logger.info("solved %s in %.1fs", what, time.perf_counter() - started)


__all__ = ["FIRST_REPORT_SECONDS", "REPORT_EVERY_SECONDS", "solving"]
